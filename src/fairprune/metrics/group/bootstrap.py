"""Confidence intervals for the per-group figures: a seeded, group-stratified bootstrap over test
items (and, with several seeds, over seeds and items).

Accuracy, the accuracy gap and the spread of degradation depend on the test items only through
each group's number of correct answers. Resampling a group's ``n`` items with replacement gives a
number of correct answers that is Binomial(``n``, its accuracy), so the bootstrap draws those counts
directly: the same distribution as resampling items one by one (``tests/test_bootstrap.py`` checks
it against that plain loop), thousands of resamples in milliseconds, and it needs only the counts a
report already holds. Strata are the groups, so each group keeps its size in every resample, as a
test set with fixed group sizes does. The reference accuracies (what degradation is measured
against) are held fixed: the interval is that of the pruned model's figures.

With several seeds (one report per seed) each resample first draws the seeds with replacement,
then every drawn seed's items, and averages the statistic over the drawn seeds: the spread between
seeds and the noise of the test items both widen the interval.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

LEVEL = 0.95
RESAMPLES = 2000
MIN_GROUP = 30  # below this many test items a group's accuracy moves by more than ±0.15 (95 %)


def _counts(report: Mapping[str, Any]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Group names, test items and correct answers per present group of a report."""
    names, n, k = [], [], []
    for name, g in (report.get("groups") or {}).items():
        count = int(round(float(g.get("count") or 0)))
        if count > 0 and g.get("accuracy") is not None:
            names.append(name)
            n.append(count)
            k.append(int(round(float(g["accuracy"]) * count)))
    return names, np.asarray(n, dtype=np.int64), np.asarray(k, dtype=np.int64)


def _statistics(correct: np.ndarray, n: np.ndarray, reference: np.ndarray | None) -> dict[str, np.ndarray]:
    """Per resample (rows): overall accuracy, per-group accuracy, gap and degradation std."""
    acc = correct / n
    out = {"accuracy": correct.sum(-1) / n.sum(-1), "groups": acc,
           "acc_gap": acc.max(-1) - acc.min(-1) if acc.shape[-1] > 1 else np.zeros(acc.shape[:-1])}
    if reference is not None:
        counted = ~np.isnan(reference)
        drop = reference[counted] - acc[..., counted]
        out["degradation_std"] = drop.std(-1) if counted.sum() > 1 else np.zeros(acc.shape[:-1])
    return out


def _interval(values: np.ndarray, level: float) -> list[float]:
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail], axis=0)
    return [float(low), float(high)]


def bootstrap(reports: Sequence[Mapping[str, Any]], resamples: int = RESAMPLES, seed: int = 0,
              level: float = LEVEL, min_group: int = MIN_GROUP) -> dict[str, Any]:
    """Intervals of a run's figures from its test report(s) (several: one per seed).

    Returns ``{"level", "resamples", "accuracy": [lo, hi], "acc_gap": [lo, hi], "degradation_std":
    [lo, hi] (when the reports have a reference), "groups": {name: [lo, hi]}, "small_groups":
    [names with fewer than min_group test items]}``; empty when the reports hold no counts.
    """
    parsed = [_counts(r) for r in reports]
    parsed = [p for p in parsed if len(p[0])]
    if not parsed:
        return {}
    names = parsed[0][0]
    if any(p[0] != names for p in parsed):
        return {}  # runs on different group sets cannot be pooled
    references = []
    for report in reports:
        groups = (report.get("reference") or {}).get("groups") or {}
        ref = [groups.get(name, {}).get("accuracy") for name in names]
        references.append(None if all(r is None for r in ref) else np.array([np.nan if r is None else r for r in ref], float))
    rng = np.random.default_rng(seed)
    seeds = len(parsed)
    # [resamples, seeds drawn]: which run each draw takes (a single run: always itself).
    drawn = rng.integers(0, seeds, size=(resamples, seeds)) if seeds > 1 else np.zeros((resamples, 1), dtype=np.int64)
    totals: dict[str, Any] = {}
    for slot in range(drawn.shape[1]):
        per_seed = []
        for s in range(seeds):
            _, n, k = parsed[s]
            correct = rng.binomial(n, k / n, size=(resamples, len(n)))
            per_seed.append(_statistics(correct, n, references[s]))
        pick = drawn[:, slot]
        for key in per_seed[0]:
            stacked = np.stack([p[key] for p in per_seed])  # [seeds, resamples, ...]
            chosen = stacked[pick, np.arange(resamples)]
            totals[key] = totals.get(key, 0) + chosen / drawn.shape[1]
    n_items = parsed[0][1]
    point = {key: np.mean([_statistics(k, n, r)[key] for (_, n, k), r in zip(parsed, references)])
             for key in ("acc_gap", "degradation_std") if key in totals}
    out: dict[str, Any] = {"level": level, "resamples": resamples, "seed": seed,
                           "accuracy": _interval(totals["accuracy"], level),
                           "acc_gap": _basic(totals["acc_gap"], point["acc_gap"], level),
                           "groups": {name: _interval(totals["groups"][:, i], level) for i, name in enumerate(names)},
                           "min_group": min_group,
                           "small_groups": [name for name, count in zip(names, n_items) if count < min_group]}
    if "degradation_std" in totals:
        out["degradation_std"] = _basic(totals["degradation_std"], point["degradation_std"], level)
    return out


def _basic(values: np.ndarray, estimate: float, level: float) -> list[float]:
    """The basic (reverse-percentile) interval, for spreads between groups: resampling adds noise to
    every group, so a resampled gap or std sits above the observed one (a spread of 0 is never
    resampled as 0) and percentiles would miss it; reflecting them about the estimate removes that
    bias. Clipped at 0, where a spread ends."""
    low, high = _interval(values, level)
    return [max(0.0, 2 * estimate - high), max(0.0, 2 * estimate - low)]


def _figures(correct: np.ndarray, groups: np.ndarray, weights: np.ndarray, present: list[int],
             reference: np.ndarray | None) -> dict[str, np.ndarray]:
    """Figures per resample from item ``weights`` [resamples, items] (how often each item is drawn)."""
    n = np.stack([weights[:, groups == g].sum(-1) for g in present], -1)
    k = np.stack([(weights[:, groups == g] * correct[groups == g]).sum(-1) for g in present], -1)
    return _statistics(k, n, None if reference is None else reference[present])


def paired_difference(runs: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
                      baselines: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], reference: np.ndarray | None = None,
                      resamples: int = RESAMPLES, seed: int = 0, level: float = LEVEL) -> dict[str, Any]:
    """A method against a baseline on the same test items: the difference (method − baseline) of
    accuracy, accuracy gap and degradation std, with a paired, group-stratified bootstrap interval
    (both scored on the same resampled items; with several seeds, the seeds are drawn first).

    ``runs`` / ``baselines``: per seed ``(correct [items] bool, group [items] int, item ids)``; the
    items of a seed must be the same for both (same ids in the same order). ``reference``: per-group
    reference accuracy (indexed by group id) for the degradation spread. Returns ``{figure:
    {"difference", "ci": [lo, hi], "excludes_zero"}}``."""
    if len(runs) != len(baselines) or not runs:
        return {}
    rng = np.random.default_rng(seed)
    seeds = len(runs)
    drawn = rng.integers(0, seeds, size=(resamples, seeds)) if seeds > 1 else np.zeros((resamples, 1), dtype=np.int64)
    diffs: dict[str, np.ndarray] = {}
    point: dict[str, float] = {}
    for (a, ga, ia), (b, gb, ib) in zip(runs, baselines):
        if not (np.array_equal(ga, gb) and np.array_equal(ia, ib)):
            raise ValueError("a paired comparison needs both runs scored on the same test items")
        present = sorted(set(ga.tolist()))
        once = np.ones((1, len(a)))
        fa, fb = (_figures(x.astype(float), ga, once, present, reference) for x in (a, b))
        for key in fa:
            if key != "groups":
                point[key] = point.get(key, 0.0) + float(fa[key][0] - fb[key][0]) / seeds
    for slot in range(drawn.shape[1]):
        per_seed = []
        for (a, ga, _), (b, _, _) in zip(runs, baselines):
            present = sorted(set(ga.tolist()))
            # Group-stratified: each group's items drawn with replacement, as many as it has.
            weights = np.zeros((resamples, len(a)))
            for g in present:
                members = np.flatnonzero(ga == g)
                picks = rng.integers(0, len(members), size=(resamples, len(members)))
                np.add.at(weights, (np.arange(resamples)[:, None], members[picks]), 1.0)
            fa = _figures(a.astype(float), ga, weights, present, reference)
            fb = _figures(b.astype(float), ga, weights, present, reference)
            per_seed.append({k: fa[k] - fb[k] for k in fa if k != "groups"})
        pick = drawn[:, slot]
        for key in per_seed[0]:
            stacked = np.stack([p[key] for p in per_seed])
            diffs[key] = diffs.get(key, 0) + stacked[pick, np.arange(resamples)] / drawn.shape[1]
    out = {}
    for key, values in diffs.items():
        low, high = _interval(values, level)
        out[key] = {"difference": point[key], "ci": [low, high], "excludes_zero": bool(low > 0 or high < 0)}
    return out
