"""FairGRAPE's greedy group-share selection: the fast twin against the plain-loop oracle."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from fairprune.errors import UserError
from fairprune.pruning.fairgrape import (
    _descending_orders,
    greedy_select,
    greedy_select_reference,
    group_share_report,
    group_targets,
    layer_quota,
    select_layer_mask,
    select_layer_masks,
)

# ---------------------------------------------------------------------------------------------
# A hand-worked example
# ---------------------------------------------------------------------------------------------

# Two groups, six weights. Weight 5 has no importance for anyone.
HAND = torch.tensor(
    [
        [4.0, 3.0, 0.0, 1.0, 2.0, 0.0],
        [0.0, 3.0, 5.0, 2.0, 4.0, 0.0],
    ]
)
# S = [10, 14], so t = [10/24, 14/24] = [0.4167, 0.5833].
# Group orders (importance descending, ties by lower index):
#   group 0: 0 (4), 1 (3), 4 (2), 3 (1), 2 (0), 5 (0)
#   group 1: 2 (5), 4 (4), 1 (3), 3 (2), 0 (0), 5 (0)
# pick 1: s = [0, 0], sum 0 -> shares 0, deficits [-0.4167, -0.5833] -> group 1 -> weight 2;
#         s = [0, 5]
# pick 2: shares [0, 1], deficits [-0.4167, +0.4167] -> group 0 -> weight 0; s = [4, 5]
# pick 3: shares [4/9, 5/9] = [0.4444, 0.5556], deficits [+0.0278, -0.0278] -> group 1
#         -> weight 4; s = [6, 9]
# pick 4: shares [6/15, 9/15] = [0.4, 0.6], deficits [-0.0167, +0.0167] -> group 0
#         -> weight 1; s = [9, 12]
# pick 5: shares [9/21, 12/21] = [0.4286, 0.5714], deficits [+0.0119, -0.0119] -> group 1;
#         its next weight, 1, was kept by group 0 at pick 4, so it is skipped -> weight 3
# pick 6: only weight 5 is left.
HAND_PICKS = [2, 0, 4, 1, 3, 5]


@pytest.mark.parametrize("select", [greedy_select_reference, greedy_select])
def test_hand_worked_example(select):
    for quota in range(len(HAND_PICKS) + 1):
        expected = torch.zeros(6, dtype=torch.bool)
        expected[HAND_PICKS[:quota]] = True
        assert torch.equal(select(HAND, quota), expected), f"quota={quota}"


def test_hand_worked_share_report():
    report = group_share_report(HAND, greedy_select(HAND, 3))  # kept weights 0, 2, 4
    assert report["target"] == pytest.approx([10 / 24, 14 / 24])
    assert report["share"] == pytest.approx([6 / 15, 9 / 15])
    assert report["gap"] == pytest.approx([6 / 15 - 10 / 24, 9 / 15 - 14 / 24])
    assert report["max_abs_gap"] == pytest.approx(abs(6 / 15 - 10 / 24))
    assert (report["kept"], report["candidates"]) == (3, 6)
    # Weights 0..4 hold all the importance: keeping them matches the targets exactly.
    full = group_share_report(HAND, greedy_select(HAND, 5))
    assert full["share"] == pytest.approx(full["target"])


# ---------------------------------------------------------------------------------------------
# Fast == oracle
# ---------------------------------------------------------------------------------------------


def _importance(kind: str, groups: int, n: int, seed: int) -> np.ndarray:
    """Random importance of one of several kinds, chosen to stress ties and edge cases."""
    rng = np.random.default_rng(seed)
    if kind == "continuous":
        return (rng.standard_normal((groups, n)) * rng.standard_normal(n)) ** 2
    if kind == "small_ints":  # heavy ties within and across groups
        return rng.integers(0, 3, (groups, n)).astype(np.float64)
    if kind == "equal_rows":  # every weight ties with every other weight in a group
        return np.repeat(rng.random((groups, 1)) + 0.5, n, axis=1)
    if kind == "all_zero":
        return np.zeros((groups, n))
    if kind == "zero_group":  # group 0 has no importance at all
        imp = rng.random((groups, n))
        imp[0] = 0.0
        return imp
    if kind == "float32":
        return (rng.random((groups, n)) ** 3).astype(np.float32)
    if kind == "low_bits":  # values differing only in their last mantissa bits
        return 0.75 + rng.integers(0, 4, (groups, n)) * np.ldexp(1.0, -52)
    if kind == "signed_zero":
        imp = rng.integers(0, 2, (groups, n)).astype(np.float64)
        imp[rng.random((groups, n)) < 0.3] = -0.0
        return imp
    raise AssertionError(kind)


KINDS = ["continuous", "small_ints", "equal_rows", "all_zero", "zero_group", "float32",
         "low_bits", "signed_zero"]
SHAPES = [(1, 1), (2, 1), (1, 17), (3, 2), (2, 64), (7, 129), (4, 700), (7, 3000)]


def _quotas(n: int) -> list[int]:
    return sorted({0, 1, n // 2, n - 1, n} & set(range(n + 1)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("groups,n", SHAPES)
def test_fast_equals_oracle(kind, groups, n):
    imp = _importance(kind, groups, n, seed=groups * 10007 + n)
    as_torch = torch.from_numpy(imp)  # both input types are accepted
    for quota in _quotas(n):
        expected = greedy_select_reference(imp, quota)
        got = greedy_select(as_torch if quota % 2 else imp, quota)
        assert got.dtype == torch.bool and got.shape == (n,)
        assert int(got.sum()) == quota
        assert torch.equal(got, expected), f"quota={quota}"


@pytest.mark.parametrize("groups", [1, 2, 5, 7])
def test_fast_equals_oracle_near_balanced(groups):
    """Near-equal group totals make the chosen group switch at almost every pick."""
    rng = np.random.default_rng(groups)
    imp = rng.random((groups, 2500)) * 1e-3 + 1.0
    quota = 2250
    assert torch.equal(greedy_select(imp, quota), greedy_select_reference(imp, quota))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_orders_follow_the_tie_rule(dtype):
    """The radix sort orders by importance descending, ties by lower index: values that differ
    only in their last mantissa bits, exact ties, +0.0 / -0.0, and buckets large enough for the
    in-bucket passes as well as small insertion-sorted ones."""
    rng = np.random.default_rng(0)
    n = 1 << 17
    ulp = np.ldexp(1.0, -52 if dtype == np.float64 else -23)
    imp = np.stack([
        0.75 + rng.integers(0, 1 << 16, n) * ulp,  # one bucket, low bits only
        rng.integers(0, 3, n).astype(np.float64),  # heavy exact ties
        rng.standard_normal(n) ** 2 * np.exp(rng.uniform(-30, 5, n)),  # many buckets
        np.where(rng.random(n) < 0.5, -0.0, 0.0) + (rng.random(n) < 0.1),  # signed zeros and ones
    ]).astype(dtype)
    imp[0, ::3] = 0.0
    expected = np.stack([np.argsort(-(row.astype(np.float64) + 0.0), kind="stable") for row in imp])
    got = _descending_orders(imp)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(_descending_orders(imp, workers=1), expected)


@pytest.mark.parametrize("seed", range(6))
def test_fast_equals_oracle_on_random_importance_with_ties(seed):
    """Seven groups, importance drawn from a few values (ties within and across groups) mixed
    with continuous values, float32 as the importance pass returns it; several quotas."""
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(200, 3000))
    imp = (rng.standard_normal((7, n)) * rng.standard_normal(n)) ** 2
    tied = rng.random((7, n)) < rng.uniform(0.2, 0.9)
    imp[tied] = rng.choice([0.0, 0.25, 0.5, 1.0, 2.0], size=int(tied.sum()))
    imp[:, rng.random(n) < 0.1] = 0.5  # whole columns equal across groups
    imp = imp.astype(np.float32)
    for quota in (1, n // 3, int(n * 0.9), n - 1):
        assert torch.equal(greedy_select(imp, quota), greedy_select_reference(imp, quota)), quota


def test_float32_importance_gives_the_mask_of_its_float64_values():
    rng = np.random.default_rng(7)
    imp = ((rng.standard_normal((5, 4000)) * rng.standard_normal(4000)) ** 2).astype(np.float32)
    for quota in (100, 2000, 3600):
        single = greedy_select(torch.from_numpy(imp), quota)
        assert torch.equal(single, greedy_select(imp.astype(np.float64), quota))
        assert torch.equal(single, greedy_select_reference(imp, quota))


def test_single_group_keeps_its_top_weights():
    """With one group the greedy rule reduces to top-`quota` by importance, ties by index."""
    rng = np.random.default_rng(1)
    imp = rng.integers(0, 5, (1, 300)).astype(np.float64)
    ranked = sorted(range(300), key=lambda w: (-imp[0, w], w))
    expected = torch.zeros(300, dtype=torch.bool)
    expected[ranked[:120]] = True
    assert torch.equal(greedy_select(imp, 120), expected)
    assert torch.equal(greedy_select_reference(imp, 120), expected)


def test_shares_track_targets():
    """The greedy rule keeps each group's kept share close to its target."""
    rng = np.random.default_rng(2)
    imp = rng.random((5, 4000)) * np.array([[1.0], [2.0], [0.5], [3.0], [1.5]])
    report = group_share_report(imp, greedy_select(imp, 3600))
    assert report["max_abs_gap"] < 1e-3


def test_fast_equals_oracle_on_a_larger_layer():
    """20,000 candidates of 7 groups, keep 90 % (the bench measures the speed)."""
    rng = np.random.default_rng(3)
    imp = rng.random((7, 20_000)) ** 2
    assert torch.equal(greedy_select(imp, 18_000), greedy_select_reference(imp, 18_000))


# ---------------------------------------------------------------------------------------------
# Targets and quotas
# ---------------------------------------------------------------------------------------------


def test_group_targets():
    rng = np.random.default_rng(4)
    imp = rng.random((4, 1000))
    sums = imp.sum(axis=1)
    torch.testing.assert_close(group_targets(imp), torch.from_numpy(sums / sums.sum()))
    torch.testing.assert_close(group_targets(np.zeros((4, 10))), torch.full((4,), 0.25,
                                                                             dtype=torch.float64))


def test_layer_quota_rounds_half_up():
    for n in range(0, 200):
        for eighths in range(0, 9):  # fractions exact in binary, so n·f is exact
            exact = Fraction(n) * Fraction(eighths, 8)
            assert layer_quota(n, eighths / 8) == math.floor(exact + Fraction(1, 2))
    assert layer_quota(5, 0.9) == 5  # 4.5 rounds up
    assert layer_quota(1, 0.4) == 0


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan")])
def test_layer_quota_rejects_bad_fractions(fraction):
    with pytest.raises(UserError, match="keep_fraction"):
        layer_quota(10, fraction)


# ---------------------------------------------------------------------------------------------
# Layer masks
# ---------------------------------------------------------------------------------------------


def test_select_layer_mask_prunes_only_alive_weights():
    rng = np.random.default_rng(5)
    weight_shape = (6, 4, 3, 3)
    importance = torch.from_numpy(rng.random((3, *weight_shape))).float()
    mask = torch.ones(weight_shape, dtype=torch.bool)
    for _ in range(4):
        alive = int(mask.sum())
        new_mask = select_layer_mask(importance, mask, keep_fraction=0.8)
        assert new_mask.shape == weight_shape and new_mask.dtype == torch.bool
        assert not (new_mask & ~mask).any(), "a pruned weight came back"
        assert int(new_mask.sum()) == layer_quota(alive, 0.8)
        # Same as the oracle run on the alive candidates only.
        candidates = mask.reshape(-1).nonzero().squeeze(1)
        keep = greedy_select_reference(importance.reshape(3, -1)[:, candidates],
                                       layer_quota(alive, 0.8))
        assert torch.equal(new_mask.reshape(-1)[candidates], keep)
        mask = new_mask


def test_select_layer_mask_with_a_quota_and_its_share_report():
    """The callback's form: a kept count instead of a fraction, and the step's share report."""
    rng = np.random.default_rng(6)
    importance = torch.from_numpy(rng.random((4, 5, 7)))
    mask = torch.from_numpy(rng.random((5, 7)) < 0.7)
    alive = int(mask.sum())
    for quota in (0, 1, alive // 2, alive):
        new_mask, report = select_layer_mask(importance, mask, quota=quota, report=True)
        assert int(new_mask.sum()) == quota and not (new_mask & ~mask).any()
        candidates = mask.reshape(-1).nonzero().squeeze(1)
        keep = greedy_select_reference(importance.reshape(4, -1)[:, candidates], quota)
        assert torch.equal(new_mask.reshape(-1)[candidates], keep)
        assert report == group_share_report(importance, new_mask, candidates=mask)
        assert (report["kept"], report["candidates"]) == (quota, alive)
    fraction_mask, fraction_report = select_layer_mask(importance, mask, 0.5, report=True)
    assert torch.equal(fraction_mask, select_layer_mask(importance, mask, quota=layer_quota(alive, 0.5)))
    assert fraction_report["kept"] == layer_quota(alive, 0.5)
    with pytest.raises(ValueError, match="quota"):
        select_layer_mask(importance, mask, quota=alive + 1)
    with pytest.raises(ValueError, match="exactly one"):
        select_layer_mask(importance, mask, 0.5, quota=3)
    with pytest.raises(ValueError, match="exactly one"):
        select_layer_mask(importance, mask)


@pytest.mark.parametrize("threads", [1, 2])
def test_select_layer_masks_equals_one_layer_at_a_time(threads):
    """The many-layer entry point (layers in parallel threads) gives each layer's own masks and
    reports, in the given order, whatever the thread count."""
    rng = np.random.default_rng(8)
    shapes = [(3, 2, 3, 3), (70_000,), (16, 9), (1, 1), (5, 40, 3, 3)]
    importances = [torch.from_numpy(rng.random((4, *shape)) ** 3).float() for shape in shapes]
    masks = [torch.from_numpy(rng.random(shape) < 0.8) for shape in shapes]
    quotas = [layer_quota(int(m.sum()), 0.9) for m in masks]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = select_layer_masks(importances, masks, quotas, report=True)
        plain = select_layer_masks(importances, masks, quotas)
    finally:
        torch.set_num_threads(before)
    assert len(together) == len(plain) == len(shapes)
    for imp, mask, quota, (got, report), got_plain in zip(importances, masks, quotas, together, plain):
        expected, expected_report = select_layer_mask(imp, mask, quota=quota, report=True)
        assert torch.equal(got, expected) and torch.equal(got_plain, expected)
        assert int(got.sum()) == quota and not (got & ~mask).any()
        assert report == expected_report == group_share_report(imp, got, candidates=mask)
    with pytest.raises(ValueError, match="one of each"):
        select_layer_masks(importances, masks[:2], quotas)


def test_select_layer_mask_with_nothing_alive():
    mask = torch.zeros(3, 4, dtype=torch.bool)
    assert not select_layer_mask(torch.ones(2, 3, 4), mask, 0.9).any()


def test_select_layer_mask_rejects_bad_inputs():
    with pytest.raises(ValueError, match="shape"):
        select_layer_mask(torch.ones(2, 3, 4), torch.ones(3, 5, dtype=torch.bool), 0.9)
    with pytest.raises(ValueError, match="bool"):
        select_layer_mask(torch.ones(2, 3, 4), torch.ones(3, 4), 0.9)
    with pytest.raises(UserError, match="keep_fraction"):
        select_layer_mask(torch.ones(2, 3, 4), torch.ones(3, 4, dtype=torch.bool), 2.0)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("select", [greedy_select_reference, greedy_select])
def test_validation(select):
    good = np.ones((2, 5))
    for quota in (-1, 6):
        with pytest.raises(ValueError, match="quota"):
            select(good, quota)
    for bad_value, message in ((-1.0, "non-negative"), (np.nan, "NaN"), (np.inf, "infinite")):
        bad = good.copy()
        bad[1, 2] = bad_value
        with pytest.raises(ValueError, match=message):
            select(bad, 2)
    for bad_shape in (np.ones(5), np.ones((0, 5)), np.ones((2, 2, 2))):
        with pytest.raises(ValueError, match="shape"):
            select(bad_shape, 1)
