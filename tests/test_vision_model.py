"""The vision classifier's backbones: timm heads and penultimate embeddings through timm's own API,
torchvision's through their last Linear; tiny models built offline (random weights)."""

from __future__ import annotations

import pytest
import torch

from fairprune.models.vision import VisionClassifier

CLASSES = ["a", "b", "c"]

pytestmark = pytest.mark.usefixtures("one_thread")


def images(n: int = 4, size: int = 32) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("backbone", ["timm:resnet10t", "timm:convnext_atto"])
def test_timm_embedding_is_the_pre_logits_features(backbone):
    torch.manual_seed(0)
    module = VisionClassifier(backbone=backbone, class_names=CLASSES).eval()
    net, x = module.net, images()
    with torch.no_grad():
        logits = module(x)
        expected = net.forward_head(net.forward_features(x), pre_logits=True)
    assert logits.shape == (len(x), len(CLASSES))
    assert net.get_classifier().out_features == len(CLASSES)
    embedding = module.embed(x)
    assert embedding.shape == (len(x), net.get_classifier().in_features)
    assert torch.equal(embedding, expected.flatten(1))
    assert torch.allclose(net.get_classifier()(embedding), logits, atol=1e-5)  # the classifier's input


def test_torchvision_embedding_is_the_last_linear_input():
    torch.manual_seed(0)
    module = VisionClassifier(backbone="torchvision:mobilenet_v2", class_names=CLASSES,
                              backbone_kwargs={"width_mult": 0.25}).eval()
    x = images()
    with torch.no_grad():
        logits = module(x)
    assert logits.shape == (len(x), len(CLASSES))
    embedding = module.embed(x)
    assert torch.allclose(module.net.classifier[-1](embedding), logits, atol=1e-5)
