"""The group-stratified bootstrap against the plain loop it stands for: resample each group's test
items with replacement, recompute the figures, take percentiles."""

from __future__ import annotations

import numpy as np
import pytest

from fairprune.metrics.bootstrap import bootstrap

GROUPS = {"a": (120, 0.9), "b": (40, 0.7), "c": (25, 0.6)}  # test items, accuracy
REFERENCE = {"a": 0.92, "b": 0.8, "c": 0.75}


def report(groups=GROUPS, reference=REFERENCE) -> dict:
    return {"groups": {g: {"count": n, "accuracy": round(acc * n) / n} for g, (n, acc) in groups.items()},
            "reference": {"groups": {g: {"accuracy": v} for g, v in reference.items()}}}


def plain_loop(groups=GROUPS, reference=REFERENCE, resamples=4000, seed=1) -> dict:
    """Item by item: every group's 0/1 answers resampled with replacement."""
    rng = np.random.default_rng(seed)
    items = {g: np.r_[np.ones(round(acc * n)), np.zeros(n - round(acc * n))] for g, (n, acc) in groups.items()}
    acc_all, gap, std, per = [], [], [], {g: [] for g in groups}
    for _ in range(resamples):
        acc = {g: rng.choice(v, size=len(v), replace=True).mean() for g, v in items.items()}
        for g in groups:
            per[g].append(acc[g])
        acc_all.append(sum(acc[g] * groups[g][0] for g in groups) / sum(n for n, _ in groups.values()))
        gap.append(max(acc.values()) - min(acc.values()))
        std.append(np.std([reference[g] - acc[g] for g in groups]))
    q = lambda v: np.percentile(v, [2.5, 97.5])  # noqa: E731
    observed = {g: round(acc * n) / n for g, (n, acc) in groups.items()}
    gap0 = max(observed.values()) - min(observed.values())
    std0 = np.std([reference[g] - observed[g] for g in groups])
    # Spreads: the basic interval, the percentiles reflected about the observed value (clipped at 0).
    basic = lambda v, est: np.maximum(0, 2 * est - q(v)[::-1])  # noqa: E731
    return {"accuracy": q(acc_all), "acc_gap": basic(gap, gap0), "degradation_std": basic(std, std0),
            "groups": {g: q(v) for g, v in per.items()}}


def test_matches_the_plain_item_loop():
    fast, slow = bootstrap([report()], resamples=4000, seed=0), plain_loop()
    for key in ("accuracy", "acc_gap", "degradation_std"):
        assert fast[key] == pytest.approx(slow[key], abs=0.015), key
    for g, (n, _) in GROUPS.items():  # percentiles of a count move in steps of 1/n
        assert fast["groups"][g] == pytest.approx(slow["groups"][g], abs=1.01 / n), g
    assert fast["small_groups"] == ["c"]  # 25 < 30 test items


def test_seeded_and_narrower_with_more_items():
    assert bootstrap([report()], seed=3) == bootstrap([report()], seed=3)
    big = {g: (n * 16, acc) for g, (n, acc) in GROUPS.items()}
    small_width = np.diff(bootstrap([report()])["accuracy"])[0]
    big_width = np.diff(bootstrap([report(big)])["accuracy"])[0]
    assert big_width == pytest.approx(small_width / 4, rel=0.25)  # ∝ 1/√n


def test_seeds_widen_the_interval():
    one = bootstrap([report()])
    other = report({g: (n, min(acc + 0.08, 1.0)) for g, (n, acc) in GROUPS.items()})
    both = bootstrap([report(), other])
    assert np.diff(both["accuracy"])[0] > np.diff(one["accuracy"])[0]
    assert both["accuracy"][0] < both["accuracy"][1]


def test_a_spread_of_zero_is_inside_its_interval():
    even = {g: (n, REFERENCE[g] - 0.05) for g, (n, _) in {"a": (400, 0), "b": (400, 0)}.items()}
    ci = bootstrap([report(even, {"a": REFERENCE["a"], "b": REFERENCE["b"]})])
    assert ci["degradation_std"][0] == 0.0 <= ci["degradation_std"][1]


def test_no_counts_no_interval():
    assert bootstrap([{"groups": {}}]) == {}
    assert "degradation_std" not in bootstrap([{**report(), "reference": {}}])


def items(groups: dict[str, tuple[int, float]], seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    correct, group = [], []
    for g, (n, acc) in enumerate(groups.values()):
        correct.append(rng.random(n) < acc)
        group.append(np.full(n, g))
    correct, group = np.concatenate(correct), np.concatenate(group)
    return correct, group, np.arange(len(group))


def test_paired_difference_matches_the_plain_loop_and_is_narrower():
    from fairprune.metrics.bootstrap import paired_difference

    a = items(GROUPS, 0)
    # b: a with 6 % of the answers flipped, so the two runs share most of their items' difficulty.
    flip = np.random.default_rng(1).random(len(a[0])) < 0.06
    b = (a[0] ^ flip, a[1], a[2])
    got = paired_difference([a], [b], resamples=4000, seed=0)["accuracy"]
    rng = np.random.default_rng(5)
    diffs = []
    for _ in range(4000):  # the plain loop: resample item indices per group, score both runs on them
        idx = np.concatenate([rng.choice(np.flatnonzero(a[1] == g), size=(a[1] == g).sum()) for g in range(3)])
        diffs.append(a[0][idx].mean() - b[0][idx].mean())
    assert got["difference"] == pytest.approx(a[0].mean() - b[0].mean())
    assert got["ci"] == pytest.approx(list(np.percentile(diffs, [2.5, 97.5])), abs=0.006)
    unpaired = [bootstrap([{"groups": {g: {"count": int((x[1] == i).sum()), "accuracy": x[0][x[1] == i].mean()}
                                       for i, g in enumerate(GROUPS)}}])["accuracy"] for x in (a, b)]
    assert np.diff(got["ci"])[0] < 0.5 * np.diff(unpaired[0])[0]  # pairing cancels the shared noise
    assert paired_difference([a], [a])["accuracy"] == {"difference": 0.0, "ci": [0.0, 0.0], "excludes_zero": False}
    with pytest.raises(ValueError, match="same test items"):
        paired_difference([a], [(b[0][:-1], b[1][:-1], b[2][:-1])])
