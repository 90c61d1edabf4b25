"""GPTQ with a fixed sparsity mask (``--quantize w4a16-gptq | w8a16-gptq``).

- Against round-to-nearest, the oracle: on a layer's calibration inputs, GPTQ's output error is no
  larger; every pruned zero stays exactly zero; every weight lies on its group's grid.
- With a diagonal Hessian (no correlation between inputs) nothing is compensated: GPTQ is
  round-to-nearest, bit for bit.
- Through the layer-by-layer pass: every method (a plain Hessian collected for those without
  one), the sparsity the method reached kept, the scales GPTQ chose stored and read back.
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization.lifecycle.forward import fake_quantize

from fairprune.causal.blocks import Resident
from fairprune.errors import UserError
from fairprune.hub.quantized import group_scale, load_quantized, save_quantized, weight_args
from fairprune.pruning.gptq import gptq_quantize
from fairprune.pruning.llm import magnitude_solve, prune_causal_lm, prune_with
from fairprune.pruning.modifiers import from_flags
from fairprune.pruning.sparsegpt import sparsegpt_solve
from fairprune.pruning.sparsity import Sparsity
from tiny_models import BUILDERS


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _layer(rows: int = 48, cols: int = 128, tokens: int = 512, seed: int = 0):
    """A weight and correlated calibration inputs X [tokens, cols] (a few shared directions plus
    noise, as real activations are), with the Hessian 2/n XᵀX."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(rows, cols, generator=g) * 0.05
    mix = torch.randn(8, cols, generator=g)
    X = torch.randn(tokens, 8, generator=g) @ mix + 0.3 * torch.randn(tokens, cols, generator=g)
    return W, X, 2 / tokens * X.T @ X


def _nearest(W: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest with compressed-tensors' own scales, in bfloat16 as the folder stores them."""
    scale, zero = group_scale(W, args)
    scale = scale.to(torch.bfloat16).float()
    return fake_quantize(W, scale, zero, args), scale


@pytest.mark.parametrize("bits, group", [(4, 32), (4, 64), (8, 64)])
@pytest.mark.parametrize("pruned_by", ["sparsegpt", "magnitude"])
def test_gptq_error_is_at_most_round_to_nearest_and_the_mask_holds(bits, group, pruned_by):
    W, X, H = _layer()
    half = Sparsity.parse("0.5")
    W = sparsegpt_solve(W, H, half) if pruned_by == "sparsegpt" else magnitude_solve(W, None, half)
    args = weight_args(bits, group)
    Q, scales = gptq_quantize(W, H, args)
    nearest, _ = _nearest(W, args)
    gptq_error = ((W - Q) @ X.T).pow(2).sum()
    nearest_error = ((W - nearest) @ X.T).pow(2).sum()
    assert gptq_error <= nearest_error
    if bits == 4:
        assert gptq_error < 0.9 * nearest_error  # and clearly so on correlated inputs
    assert bool((Q[W == 0] == 0).all())  # every pruned zero still zero
    assert float((Q != 0).float().mean()) <= 0.5
    step = scales.float().repeat_interleave(group, dim=1)
    ints = Q / step
    assert torch.equal(ints, ints.round())  # on the grid of the scales it returns
    assert float(ints.abs().max()) <= 2 ** (bits - 1)


def test_with_a_diagonal_hessian_gptq_is_round_to_nearest():
    W, _, _ = _layer(seed=1)
    W = magnitude_solve(W, None, Sparsity.parse("0.5"))
    H = torch.diag(torch.rand(W.shape[1], generator=torch.Generator().manual_seed(2)) + 0.5)
    args = weight_args(4, 32)
    Q, scales = gptq_quantize(W, H, args)
    nearest, scale = _nearest(W, args)
    assert torch.equal(Q, nearest) and torch.equal(scales.float(), scale)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_every_method_keeps_its_sparsity_and_the_folder_holds_the_gptq_weights(model_type, method, tmp_path):
    torch.manual_seed(0)
    model = BUILDERS[model_type]().eval()
    ids = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(0))
    plain = BUILDERS[model_type]().eval()
    plain.load_state_dict(model.state_dict())
    reached = prune_causal_lm(plain, method, Sparsity.parse("0.5"), ids, progress=False)["achieved_sparsity"]
    blocks = Resident(model)
    result = prune_with(blocks, from_flags(method, Sparsity.parse("0.5"), "w4a16-gptq", 64), ids, progress=False)
    if method != "sparsegpt":  # a mask from the weights alone: the very same mask, then quantized
        assert result["achieved_sparsity"] >= reached
    assert result["achieved_sparsity"] >= 0.5 and len(blocks.quantizer.scales) == 14
    facts = save_quantized(model, tmp_path / "q", "w4a16-gptq", 128, layers=blocks.layers(), progress=False,
                           scales=blocks.quantizer.scales)
    assert facts["quantization"]["rounding"] == "gptq" and facts["quantization"]["layer_ratio"] <= 0.30
    loaded = load_quantized(tmp_path / "q", torch.float32, progress=False)
    for name, module in model.named_modules():
        if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
            # the folder holds the integers GPTQ chose: loaded back, the weights are GPTQ's in bfloat16
            assert torch.equal(loaded.get_submodule(name).weight, module.weight.to(torch.bfloat16).float()), name


def test_magnitude_without_calibration_data_is_refused_for_gptq():
    blocks = Resident(BUILDERS["llama"]().eval())
    with pytest.raises(UserError, match="needs calibration data"):
        prune_with(blocks, from_flags("magnitude", Sparsity.parse("0.5"), "w4a16-gptq", 64), progress=False)
