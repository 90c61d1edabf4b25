"""FairGRAPE's per-group importance: the one-pass ``group_scores`` against the K-backward path and
against a per-sample loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fairprune.errors import UserError
from fairprune.pruning.importance import group_scores, group_scores_reference
from fairprune.pruning.masks import Target, apply_mask

GROUPS = 3


def _model() -> nn.Module:
    """A small net with BatchNorm and Dropout: both behave differently in train mode."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.5),
        nn.Flatten(), nn.Linear(4 * 5 * 5, 3),
    ).double()
    with torch.no_grad():  # non-trivial running statistics, as after training
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model


def _targets(model: nn.Module) -> list[Target]:
    return [Target("0", model[0]), Target("5", model[5])]


def _loader(batches: int = 4, size: int = 10, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    """Batches with every group, an unknown group (-1), and one batch missing group 2."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for b in range(batches):
        g = torch.randint(-1, GROUPS, (size,), generator=gen)
        g[:GROUPS] = torch.arange(GROUPS)
        if b == 1:
            g[g == 2] = 0
        out.append((torch.randn(size, 2, 5, 5, generator=gen, dtype=torch.float64),
                    torch.randint(0, 3, (size,), generator=gen), g))
    return out


def _per_sample_oracle(model: nn.Module, targets: list[Target], loader) -> dict[str, torch.Tensor]:
    """The definition, one sample at a time in eval mode: per group, the mean over its samples of
    each sample's loss gradient, times the effective weight, squared."""
    model.eval()
    params = [getattr(t.module, "weight_orig", t.module.weight) for t in targets]
    sums = [torch.zeros((GROUPS, *p.shape), dtype=torch.float64) for p in params]
    counts = [0] * GROUPS
    for x, y, g in loader:
        for i in range(len(y)):
            k = int(g[i])
            if k < 0:
                continue
            loss = F.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum")
            for s, gr in zip(sums, torch.autograd.grad(loss, params)):
                s[k] += gr
            counts[k] += 1
    return {t.name: torch.stack([(s[k] / counts[k] * t.weight.detach()) ** 2 for k in range(GROUPS)])
            for t, s in zip(targets, sums)}


def test_one_pass_equals_the_k_backward_path_and_the_per_sample_definition():
    model, loader = _model(), _loader()
    targets = _targets(model)
    got = group_scores(model, targets, loader, F.cross_entropy, "cpu", GROUPS, progress=False)
    reference = group_scores_reference(model, targets, loader, F.cross_entropy, "cpu", GROUPS)
    oracle = _per_sample_oracle(model, targets, loader)
    for t in targets:
        assert got[t.name].shape == (GROUPS, *t.weight.shape)
        assert got[t.name].abs().sum() > 0
        # The gradient sums are float32 (as before); the model is float64.
        torch.testing.assert_close(got[t.name], reference[t.name], rtol=1e-4, atol=1e-12)
        torch.testing.assert_close(got[t.name], oracle[t.name], rtol=1e-4, atol=1e-12)


def test_scores_do_not_depend_on_how_samples_are_batched():
    """In eval mode a sample's gradient is its own: rebatching the same samples changes nothing
    (in train mode, BatchNorm's batch statistics would tie each sample to its batch)."""
    model, loader = _model(), _loader()
    targets = _targets(model)
    x, y, g = (torch.cat(parts) for parts in zip(*loader))
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(3))
    rebatched = [(x[perm][i:i + 7], y[perm][i:i + 7], g[perm][i:i + 7]) for i in range(0, len(y), 7)]
    a = group_scores(model, targets, loader, F.cross_entropy, "cpu", GROUPS, progress=False)
    b = group_scores(model, targets, rebatched, F.cross_entropy, "cpu", GROUPS, progress=False)
    for t in targets:
        torch.testing.assert_close(a[t.name], b[t.name], rtol=1e-4, atol=1e-12)


def test_modes_and_running_statistics_are_left_as_they_were():
    model, loader = _model(), _loader()
    model.train()
    model[3].eval()  # a module the caller put in eval mode on purpose stays there
    modes = [m.training for m in model.modules()]
    stats = [model[1].running_mean.clone(), model[1].running_var.clone(), model[1].num_batches_tracked.clone()]
    group_scores(model, _targets(model), loader, F.cross_entropy, "cpu", GROUPS, progress=False)
    assert [m.training for m in model.modules()] == modes
    for before, after in zip(stats, [model[1].running_mean, model[1].running_var, model[1].num_batches_tracked]):
        assert torch.equal(before, after), "the importance pass updated BatchNorm statistics"


def test_pruned_weights_score_zero_and_no_gradient_is_left_behind():
    model, loader = _model(), _loader()
    targets = _targets(model)
    mask = torch.rand(model[5].weight.shape, generator=torch.Generator().manual_seed(4)) < 0.5
    apply_mask(targets[1], mask)
    got = group_scores(model, targets, loader, F.cross_entropy, "cpu", GROUPS, progress=False)
    assert (got["5"][:, ~mask] == 0).all() and (got["5"][:, mask] > 0).any()
    torch.testing.assert_close(got["5"], _per_sample_oracle(model, targets, loader)["5"], rtol=1e-4, atol=1e-12)
    assert all(p.grad is None for p in model.parameters())


def test_runs_under_no_grad():
    model, loader = _model(), _loader()
    with torch.no_grad():
        got = group_scores(model, _targets(model), loader, F.cross_entropy, "cpu", GROUPS, progress=False)
    assert got["0"].abs().sum() > 0


def test_a_group_without_samples_is_an_error():
    model = _model()
    loader = [(x, y, torch.where(g == 2, torch.zeros_like(g), g)) for x, y, g in _loader()]
    for scores in (group_scores, group_scores_reference):
        with pytest.raises(UserError, match="elderly"):
            scores(model, _targets(model), loader, F.cross_entropy, "cpu", GROUPS, ["young", "adult", "elderly"])


def test_uneven_batches_and_a_large_group_are_chunked_without_losing_a_sample():
    """Batches of different sizes, most samples in one group: that group's samples run in several
    chunks of the largest batch size, the others at the end; every sample counts once."""
    gen = torch.Generator().manual_seed(5)
    loader = []
    for size in (4, 12, 3, 9):
        g = torch.where(torch.rand(size, generator=gen) < 0.8, 0, torch.randint(1, GROUPS, (size,), generator=gen))
        g[-1] = size % GROUPS
        loader.append((torch.randn(size, 2, 5, 5, generator=gen, dtype=torch.float64),
                       torch.randint(0, 3, (size,), generator=gen), g))
    assert all(bool((torch.cat([g for *_, g in loader]) == k).any()) for k in range(GROUPS))
    model = _model()
    targets = _targets(model)
    got = group_scores(model, targets, loader, F.cross_entropy, "cpu", GROUPS, progress=False)
    oracle = _per_sample_oracle(model, targets, loader)
    for t in targets:
        torch.testing.assert_close(got[t.name], oracle[t.name], rtol=1e-4, atol=1e-12)
