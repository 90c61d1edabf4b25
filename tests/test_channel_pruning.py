"""Channel (structured) pruning: FairGRAPE over channels against a plain-loop oracle, every method
on ResNet-18 and MobileNet-V2 (fewer parameters, the same outputs' shape, coupled layers losing the
same channels), floors and bad settings. With a Trainer and the CLI: test_channel_pruning_runs.py."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fairprune.callbacks.pruning import IterativePruning
from fairprune.errors import UserError
from fairprune.models.vision import build_backbone
from fairprune.pruning import channels, registry
from fairprune.pruning import importance as imp
from fairprune.pruning.fairgrape import greedy_select_reference, layer_quota
from fairprune.pruning.masks import prunable_targets
from fairprune.pruning.steps import ScoreContext
from fairprune.workflows.paired import compare_granularities


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models on a shared 2-core machine: one thread."""


# ---------------------------------------------------------------------------------------------
# The oracle: a tiny network whose coupling is written out by hand
# ---------------------------------------------------------------------------------------------


class Tiny(nn.Module):
    """stem → [a → depthwise → b] + stem → classifier. Channel groups: the residual one (outputs of
    stem and b, read by a and the classifier) and the inner one (outputs of a and the depthwise
    convolution, read by b)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn0 = nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
        self.a, self.bna = nn.Conv2d(6, 5, 1, bias=False), nn.BatchNorm2d(5)
        self.dw, self.bnd = nn.Conv2d(5, 5, 3, padding=1, groups=5, bias=False), nn.BatchNorm2d(5)
        self.b, self.bnb = nn.Conv2d(5, 6, 1, bias=False), nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn0(self.stem(x)))
        inner = F.relu(self.bnd(self.dw(F.relu(self.bna(self.a(h))))))
        return self.fc(F.relu(h + self.bnb(self.b(inner))).mean((2, 3)))


#: Per hand-written group: (layer, axis) of every weight slice that belongs to channel c.
COUPLING = {
    frozenset({"stem", "b"}): [("stem", 0), ("b", 0), ("a", 1), ("fc", 1)],
    frozenset({"a", "dw"}): [("a", 0), ("dw", 0), ("b", 1)],
}


def _loop_channel_scores(model: nn.Module, scores: dict[str, torch.Tensor], slices, size: int,
                         squared: bool = False) -> list[list[float]]:
    """[K][size] channel scores by plain Python loops over every weight element."""
    k = next(iter(scores.values())).shape[0]
    out = [[0.0] * size for _ in range(k)]
    for name, axis in slices:
        score = scores[name].tolist()
        shape = tuple(getattr(model, name).weight.shape)
        for g in range(k):
            for index in itertools.product(*(range(n) for n in shape)):
                value = score[g]
                for i in index:
                    value = value[i]
                out[g][index[axis]] += value * value if squared else value
    return out


def _batches(groups: int, seed: int = 0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 3, 6, 6, generator=gen, dtype=dtype), torch.randint(0, 3, (8,), generator=gen),
             torch.arange(8) % groups) for _ in range(3)]


@pytest.mark.parametrize("kind", ["gradients", "integers"])
@pytest.mark.parametrize("density", [0.7, 0.5, 0.2])
def test_fairgrape_channels_match_the_loop_oracle(kind, density):
    """Per demographic group the (g·w)² of every weight, summed over each coupled channel by plain
    loops, then the plain-loop greedy selection per channel group: the same kept channels as the
    library path (torch-pruning groups, tensor sums, the compiled greedy core). ``integers``:
    small whole-number importances, so sums are exact and ties are everywhere."""
    torch.manual_seed(1)
    model = Tiny().double().eval()
    targets = prunable_targets(model)
    k = 3
    if kind == "gradients":
        scores = imp.group_scores(model, targets, _batches(k), F.cross_entropy, torch.device("cpu"), k, progress=False)
    else:
        gen = torch.Generator().manual_seed(7)
        scores = {t.name: torch.randint(0, 4, (k, *t.weight.shape), generator=gen).double() for t in targets}
    groups = channels.channel_groups(model, [1, 3, 6, 6])
    assert {frozenset(g.layers) for g in groups} == set(COUPLING)
    got = channels.fair_shares(groups, channels.channel_scores(groups, scores, "sum"), density)
    for group, keep in zip(groups, got.keeps):
        expected_scores = _loop_channel_scores(model, scores, COUPLING[frozenset(group.layers)], group.size)
        library = channels.channel_scores([group], scores, "sum")[0]
        torch.testing.assert_close(library, torch.tensor(expected_scores, dtype=torch.float64), rtol=1e-12, atol=0)
        quota = max(1, layer_quota(group.size, density))
        expected = greedy_select_reference(torch.tensor(expected_scores), quota)
        assert torch.equal(keep, expected), (group.name, keep, expected)
    assert len(got.shares) == len(groups) and all("target" in s and "share" in s for s in got.shares)


def test_magnitude_channels_are_the_l2_norm_of_the_coupled_weights():
    torch.manual_seed(2)
    model = Tiny().double().eval()
    scores = registry.get("magnitude", "vision").score(ScoreContext(model, prunable_targets(model), torch.device("cpu"),
                                                                    data=None))
    groups = channels.channel_groups(model, [1, 3, 6, 6])
    for group, got in zip(groups, channels.channel_scores(groups, scores, "l2")):
        squares = _loop_channel_scores(model, {n: s.unsqueeze(0) for n, s in scores.items()},
                                       COUPLING[frozenset(group.layers)], group.size, squared=True)[0]
        assert got.tolist() == pytest.approx([math.sqrt(v) for v in squares], rel=1e-12)
        keep = channels.per_group([group], [got], 0.5).keeps[0]
        order = sorted(range(group.size), key=lambda c: (-got[c].item(), c))[: layer_quota(group.size, 0.5)]
        assert sorted(keep.nonzero().squeeze(1).tolist()) == sorted(order)


# ---------------------------------------------------------------------------------------------
# Real architectures: smaller, still consistent
# ---------------------------------------------------------------------------------------------


def _context(model: nn.Module, targets):
    x, y, g = _batches(2, dtype=torch.float32)[0]
    x = F.interpolate(x, size=32)
    return ScoreContext(model, targets, torch.device("cpu"), data=lambda: ([(x, y % 3, g)], 2, ["p", "q"]),
                        seed=0, batches=1, progress=False)


def _coupled_consistently(name: str, model: nn.Module) -> None:
    """The layers a residual addition or a depthwise convolution ties together agree."""
    if name == "resnet18":
        for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
            for block in stage:
                assert block.bn2.num_features == block.conv2.out_channels
                assert block.conv2.in_channels == block.conv1.out_channels == block.bn1.num_features
                width = block.downsample[0].out_channels if block.downsample is not None else block.conv1.in_channels
                assert block.conv2.out_channels == width  # the residual addition's two sides
        assert model.fc.in_features == model.layer4[-1].conv2.out_channels
    else:
        for block in model.features[1:-1]:
            depthwise = [m for m in block.modules() if isinstance(m, nn.Conv2d) and m.groups > 1]
            for conv in depthwise:
                assert conv.groups == conv.in_channels == conv.out_channels
            if block.use_res_connect:
                assert block.conv[-2].out_channels == block.conv[0][0].in_channels
        assert model.classifier[-1].in_features == model.features[-1][0].out_channels


@pytest.mark.parametrize("method", ["fairgrape", "magnitude", "snip", "grasp", "random"])
@pytest.mark.parametrize("backbone", ["resnet18", "mobilenet_v2"])
def test_real_architectures_lose_coupled_channels_and_still_run(backbone, method):
    torch.manual_seed(0)
    model = build_backbone(backbone, 3, **({"width_mult": 0.5} if backbone == "mobilenet_v2" else {})).eval()
    x = torch.randn(2, 3, 32, 32)
    before, shape = channels.parameter_count(model), model(x).shape
    entry = registry.get(method, "vision")
    targets = prunable_targets(model)
    scores = entry.score(_context(model, targets))
    groups = channels.channel_groups(model, [1, 3, 32, 32])
    # Distinct BatchNorm scales, to see afterwards which channels each BatchNorm kept.
    norms = {id(item.dep.target.module): item.dep.target.module for g in groups for item in g.group
             if isinstance(item.dep.target.module, nn.BatchNorm2d)}
    with torch.no_grad():
        for bn in norms.values():
            bn.weight.copy_(torch.arange(bn.num_features, dtype=torch.float32) + 1)
    old = {key: bn.weight.detach().clone() for key, bn in norms.items()}
    choice = entry.select_channels(groups, channels.channel_scores(groups, scores, entry.channel_reduce), 0.5)
    dense = [g.size for g in groups]
    kept_rows = {}
    for g, keep in zip(groups, choice.keeps):
        for item in g.group:
            if id(item.dep.target.module) in norms:
                kept_rows[id(item.dep.target.module)] = [c for c, r in zip(item.idxs, item.root_idxs) if keep[r]]
    channels.remove(groups, choice.keeps)
    after = channels.parameter_count(model)
    assert after < before * 0.5  # a 0.5 channel density removes about 3/4 of a convolution's weights
    out = model(x)
    assert out.shape == shape and torch.isfinite(out).all()
    _coupled_consistently(backbone, model)
    for key, bn in norms.items():  # every BatchNorm of a group kept exactly the group's chosen channels
        assert torch.equal(bn.weight.detach(), old[key][kept_rows[key]])
    kept = [int(k.sum()) for k in choice.keeps]
    if entry.scope == "global":
        assert sum(kept) == layer_quota(sum(dense), 0.5) and min(kept) >= 1
    else:
        assert kept == [layer_quota(d, 0.5) for d in dense]


def test_every_group_keeps_its_floor():
    torch.manual_seed(0)
    model = build_backbone("mobilenet_v2", 3, width_mult=0.5).eval()
    groups = channels.channel_groups(model, [1, 3, 32, 32], floor=2)
    scores = channels.channel_scores(groups, registry.get("magnitude", "vision").score(
        ScoreContext(model, prunable_targets(model), torch.device("cpu"), data=None)), "l2")
    for select in (channels.per_group, channels.global_):
        assert min(int(k.sum()) for k in select(groups, scores, 0.001).keeps) == 2
    channels.remove(groups, channels.per_group(groups, scores, 0.001).keeps)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 3)


@pytest.mark.parametrize("method", ["fairgrape", "magnitude"])
def test_kept_counts_round_up_to_the_channel_multiple(method):
    """channel_multiple 8: every group keeps a multiple of 8 channels (or all it has), the least
    multiple at or above its quota, and the network still runs."""
    torch.manual_seed(0)
    model = build_backbone("mobilenet_v2", 3, width_mult=0.5).eval()
    entry = registry.get(method, "vision")
    scores = entry.score(_context(model, prunable_targets(model)))
    groups = channels.channel_groups(model, [1, 3, 32, 32], multiple=8)
    choice = entry.select_channels(groups, channels.channel_scores(groups, scores, entry.channel_reduce), 0.4)
    kept = [int(k.sum()) for k in choice.keeps]
    assert kept == [min(g.size, -(-layer_quota(g.dense, 0.4) // 8) * 8) for g in groups]
    assert all(k % 8 == 0 or k == g.size for k, g in zip(kept, groups))
    assert any(layer_quota(g.dense, 0.4) % 8 for g in groups)  # the rounding did change some counts
    channels.remove(groups, choice.keeps)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 3)


def test_global_ranking_rounds_each_group_up_with_its_best_channels():
    """SNIP and GraSP's global ranking with channel_multiple 8: every group keeps a multiple of 8
    (or all it has), what the unrounded ranking keeps plus the best channels it left out."""
    torch.manual_seed(0)
    model = build_backbone("mobilenet_v2", 3, width_mult=0.5).eval()
    scores = registry.get("magnitude", "vision").score(_context(model, prunable_targets(model)))
    plain = channels.channel_groups(model, [1, 3, 32, 32])
    rounded_groups = channels.channel_groups(model, [1, 3, 32, 32], multiple=8)
    unrounded = channels.global_(plain, channels.channel_scores(plain, scores, "l2"), 0.4).keeps
    group_scores = channels.channel_scores(rounded_groups, scores, "l2")
    rounded = channels.global_(rounded_groups, group_scores, 0.4).keeps
    changed = 0
    for before, after, score, g in zip(unrounded, rounded, group_scores, rounded_groups):
        kept = int(after.sum())
        assert kept % 8 == 0 or kept == g.size
        assert bool((after | before).eq(after).all()) and kept - int(before.sum()) < 8
        added, left = score[after & ~before], score[~after]
        if len(added) and len(left):
            assert added.min() >= left.max()
        changed += int(kept != int(before.sum()))
    assert changed > 0
    channels.remove(rounded_groups, rounded)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 3)


def test_bad_channel_settings_are_one_line_errors():
    with pytest.raises(UserError, match="lottery prunes at granularity weight only"):
        IterativePruning("lottery", granularity="channel")
    with pytest.raises(UserError, match="granularity must be one of weight, channel"):
        IterativePruning("magnitude", granularity="filter")
    with pytest.raises(UserError, match="min_channels"):
        IterativePruning("magnitude", granularity="channel", min_channels=0)
    with pytest.raises(UserError, match="channel_multiple rounds"):
        IterativePruning("magnitude", granularity="channel", channel_multiple=0)
    with pytest.raises(UserError, match="disagree"):
        compare_granularities(["weight", "channel"], {"granularity": "channel"})
    with pytest.raises(UserError, match="distinct ones of weight, channel"):
        compare_granularities(["weight", "weight"], {})
    assert compare_granularities(None, {"granularity": "channel"}) == ["channel"]
    assert compare_granularities(None, None) == ["weight"]
