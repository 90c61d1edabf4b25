"""Every confidence interval and paired difference of the package: one seeded bootstrap over test
items, whatever the items are (a group's test images, an LM's windows and sentence pairs, FASP's
prompts, an lm-eval task's samples).

A resample is a row of *weights*: how often each item is drawn (:func:`draws`; :func:`stratified`
keeps every stratum's size). A figure is computed from weights, so the point estimate is the same
function under weights of one (``once``), and a paired comparison scores both models under the
*same* rows: what the items share (a hard window, an easy image) cancels, and the interval of the
difference is much narrower than the two intervals side by side. With several seeds (one run per
seed) each resample first draws the seeds with replacement (:func:`over_seeds`), so the spread
between seeds widens the interval too. Intervals are percentile intervals (:func:`interval`; level
95 % by default), spreads between groups basic ones (:func:`basic`).

* **Groups** (:func:`bootstrap`, :func:`paired_difference`). Accuracy, the accuracy gap and the
  spread of degradation depend on the test items only through each group's number of correct
  answers. Resampling a group's ``n`` items with replacement gives a number of correct answers
  that is Binomial(``n``, its accuracy), so :func:`bootstrap` draws those counts directly: the same
  distribution as resampling items one by one (``tests/test_bootstrap.py`` checks it against that
  plain loop), and it needs only the counts a report already holds. Strata are the groups. The
  reference accuracies (what degradation is measured against) are held fixed.
* **Perplexity over windows.** A resample draws as many windows with replacement and its perplexity
  is ``exp`` of the drawn windows' summed NLL over their summed tokens. Windows, not tokens: the
  tokens of a window share their context, while windows far apart nearly are independent.
  Compared as a ratio (``exp`` of the difference of mean NLLs: 1.10 is 10 % worse).
* **Stereotype score over pairs**, stratified by direction (``stereo`` / ``antistereo`` rows keep
  their numbers), recomputed by the CrowS-Pairs rule; compared as a difference, and its distance
  from 0.5 (the bias, whichever way) as a difference too.
* **FASP's toxicity bias over prompts**, stratified by axis and subgroup, recomputing Eq. 1,
  ``Σ_s |mean toxicity − mean toxicity of s|``.
* **lm-eval task samples** (:func:`paired`; :mod:`fairprune.metrics.task_figures` gives the figures).

``tests/test_lm_bootstrap.py`` checks the LM intervals against a plain loop over resamples and
against the normal approximation on large samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fairprune.metrics.language import LMItems

LEVEL = 0.95
RESAMPLES = 2000
MIN_GROUP = 30  # below this many test items a group's accuracy moves by more than ±0.15 (95 %)
MIN_PAIRS = 100  # below this many pairs a stereotype score moves by more than ±0.1 (95 %)

#: Figures per resample from a [resamples, items] array of weights.
Figures = Callable[[np.ndarray], dict[str, np.ndarray]]


# -- resampling -----------------------------------------------------------------------------------
def draws(rng: np.random.Generator, n: int, resamples: int) -> np.ndarray:
    """[resamples, n] item counts: how often each of ``n`` items is drawn in each resample."""
    picks = rng.integers(0, n, size=(resamples, n))
    counts = np.zeros((resamples, n))
    np.add.at(counts, (np.arange(resamples)[:, None], picks), 1.0)
    return counts


def stratified(rng: np.random.Generator, strata: np.ndarray, resamples: int) -> np.ndarray:
    """[resamples, items] counts, each stratum's items drawn with replacement, as many as it has."""
    counts = np.zeros((resamples, len(strata)))
    for value in np.unique(strata):
        members = np.flatnonzero(strata == value)
        counts[:, members] = draws(rng, len(members), resamples)
    return counts


def over_seeds(rng: np.random.Generator, seeds: int, resamples: int,
               one_seed: Callable[[int], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per resample, the figures of ``one_seed(s)`` (one resample of run ``s``) averaged over seeds
    drawn with replacement (a single run: always itself)."""
    drawn = rng.integers(0, seeds, size=(resamples, seeds)) if seeds > 1 else np.zeros((resamples, 1), dtype=np.int64)
    totals: dict[str, Any] = {}
    for slot in range(drawn.shape[1]):
        per_seed = [one_seed(s) for s in range(seeds)]
        pick = drawn[:, slot]
        for key in per_seed[0]:
            stacked = np.stack([p[key] for p in per_seed])  # [seeds, resamples, ...]
            totals[key] = totals.get(key, 0) + stacked[pick, np.arange(resamples)] / drawn.shape[1]
    return totals


def interval(values: np.ndarray, level: float) -> list[float] | None:
    """The percentile interval of the resampled ``values`` (NaN left out); None when none is finite."""
    values = values[~np.isnan(values)]
    if not len(values):
        return None
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return [float(low), float(high)]


def basic(values: np.ndarray, estimate: float, level: float) -> list[float]:
    """The basic (reverse-percentile) interval, for spreads between groups: resampling adds noise to
    every group, so a resampled gap or std sits above the observed one (a spread of 0 is never
    resampled as 0) and percentiles would miss it; reflecting them about the estimate removes that
    bias. Clipped at 0, where a spread ends."""
    low, high = interval(values, level)
    return [max(0.0, 2 * estimate - high), max(0.0, 2 * estimate - low)]


def difference(estimate: float, values: np.ndarray, level: float) -> dict[str, Any]:
    """A paired difference: ``{"difference", "ci": [lo, hi], "excludes_zero"}``."""
    low, high = interval(values, level) or (math.nan, math.nan)
    return {"difference": float(estimate), "ci": [low, high], "excludes_zero": bool(low > 0 or high < 0)}


def paired(figures: Figures, baseline: Figures, weights: np.ndarray, level: float) -> dict[str, Any]:
    """Every figure both give, a model's against a baseline's under the same ``weights``."""
    once = np.ones((1, weights.shape[1]))
    a, b, a0, b0 = figures(weights), baseline(weights), figures(once), baseline(once)
    return {key: difference(float(a0[key][0] - b0[key][0]), a[key] - b[key], level) for key in a.keys() & b.keys()}


# -- groups ---------------------------------------------------------------------------------------
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

    def one_seed(s: int) -> dict[str, np.ndarray]:
        _, n, k = parsed[s]
        return _statistics(rng.binomial(n, k / n, size=(resamples, len(n))), n, references[s])

    totals = over_seeds(rng, len(parsed), resamples, one_seed)
    n_items = parsed[0][1]
    point = {key: np.mean([_statistics(k, n, r)[key] for (_, n, k), r in zip(parsed, references)])
             for key in ("acc_gap", "degradation_std") if key in totals}
    out: dict[str, Any] = {"level": level, "resamples": resamples, "seed": seed,
                           "accuracy": interval(totals["accuracy"], level),
                           "acc_gap": basic(totals["acc_gap"], point["acc_gap"], level),
                           "groups": {name: interval(totals["groups"][:, i], level) for i, name in enumerate(names)},
                           "min_group": min_group,
                           "small_groups": [name for name, count in zip(names, n_items) if count < min_group]}
    if "degradation_std" in totals:
        out["degradation_std"] = basic(totals["degradation_std"], point["degradation_std"], level)
    return out


def _group_figures(correct: np.ndarray, groups: np.ndarray, weights: np.ndarray, present: list[int],
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
    for (_, ga, ia), (_, gb, ib) in zip(runs, baselines):
        if not (np.array_equal(ga, gb) and np.array_equal(ia, ib)):
            raise ValueError("a paired comparison needs both runs scored on the same test items")

    def one_seed(s: int, weights: np.ndarray | None = None) -> dict[str, np.ndarray]:
        (a, groups, _), (b, _, _) = runs[s], baselines[s]
        present = sorted(set(groups.tolist()))
        weights = stratified(rng, groups, resamples) if weights is None else weights
        fa, fb = (_group_figures(x.astype(float), groups, weights, present, reference) for x in (a, b))
        return {key: fa[key] - fb[key] for key in fa if key != "groups"}

    rng = np.random.default_rng(seed)
    seeds = len(runs)
    point = {key: sum(float(one_seed(s, np.ones((1, len(runs[s][0]))))[key][0]) / seeds for s in range(seeds))
             for key in one_seed(0, np.ones((1, len(runs[0][0]))))}
    diffs = over_seeds(rng, seeds, resamples, one_seed)
    return {key: difference(point[key], values, level) for key, values in diffs.items()}


# -- an LM's windows and sentence pairs -----------------------------------------------------------
def _log_perplexity(items: LMItems, weights: np.ndarray) -> np.ndarray:
    return (weights @ items.window_nll) / (weights @ items.window_tokens)


def _scores(items: LMItems, weights: np.ndarray) -> dict[str, np.ndarray]:
    """Per resample: the headline score and each direction's part (NaN where none decided)."""
    win, decided, anti = (x.astype(float) for x in (items.pair_win, items.pair_decided, items.pair_anti))
    out = {"stereotype_score": (weights @ win) / weights.sum(-1)}
    for name, rows in (("stereo", 1 - anti), ("antistereo", anti)):
        n = weights @ (rows * decided)
        with np.errstate(invalid="ignore", divide="ignore"):
            out[f"stereotype_score_{name}"] = np.where(n > 0, (weights @ (rows * win)) / np.maximum(n, 1), np.nan)
    return out


def lm_intervals(items: LMItems, resamples: int = RESAMPLES, seed: int = 0, level: float = LEVEL,
                 min_pairs: int = MIN_PAIRS) -> dict[str, Any]:
    """Intervals of an LM's figures: ``{"level", "resamples", "seed", "windows", "pairs",
    "perplexity": [lo, hi], "stereotype_score": [lo, hi], "stereotype_score_stereo": [lo, hi] or
    None, "stereotype_score_antistereo": ..., "few_pairs": bool}`` (``few_pairs``: fewer than
    ``min_pairs`` pairs, too few for a score to be read to ±0.1; the stereotype keys only when the
    items hold pairs)."""
    rng = np.random.default_rng(seed)
    windows = draws(rng, len(items.window_nll), resamples)
    out: dict[str, Any] = {"level": level, "resamples": resamples, "seed": seed, "windows": len(items.window_nll),
                           "pairs": len(items.pair_win)}
    log_interval = interval(_log_perplexity(items, windows), level)  # None when the losses are not finite
    out["perplexity"] = None if log_interval is None else [float(np.exp(v)) for v in log_interval]
    if len(items.pair_win):
        pairs = stratified(rng, items.pair_anti, resamples)
        for key, values in _scores(items, pairs).items():
            out[key] = interval(values, level)
        out["few_pairs"] = len(items.pair_win) < min_pairs
    return out


def lm_paired(items: LMItems, baseline: LMItems, resamples: int = RESAMPLES, seed: int = 0,
              level: float = LEVEL) -> dict[str, Any]:
    """A model against a baseline on the same windows and pairs: ``{"perplexity_ratio",
    "stereotype_score", "stereotype_bias"}``, each ``{"difference", "ci": [lo, hi],
    "excludes_zero"}`` (for the ratio: ``"ratio"``, and ``"excludes_one"``). The bias is the
    distance of the score from 0.5; a negative difference means less bias than the baseline."""
    if len(items.window_nll) != len(baseline.window_nll) or not np.array_equal(items.window_tokens, baseline.window_tokens) \
            or len(items.pair_win) != len(baseline.pair_win) or not np.array_equal(items.pair_anti, baseline.pair_anti):
        raise ValueError("a paired comparison needs both models scored on the same windows and pairs")
    rng = np.random.default_rng(seed)
    windows = draws(rng, len(items.window_nll), resamples)
    once = np.ones((1, len(items.window_nll)))
    ratio = np.exp(_log_perplexity(items, windows) - _log_perplexity(baseline, windows))
    point = float(np.exp(_log_perplexity(items, once) - _log_perplexity(baseline, once))[0])
    low, high = interval(ratio, level) or (math.nan, math.nan)
    out: dict[str, Any] = {"perplexity_ratio": {"ratio": point, "ci": [low, high], "excludes_one": bool(low > 1 or high < 1)}}
    if len(items.pair_win):
        pairs = stratified(rng, items.pair_anti, resamples)
        one = np.ones((1, len(items.pair_win)))
        a, b = _scores(items, pairs)["stereotype_score"], _scores(baseline, pairs)["stereotype_score"]
        a0, b0 = _scores(items, one)["stereotype_score"][0], _scores(baseline, one)["stereotype_score"][0]
        out["stereotype_score"] = difference(a0 - b0, a - b, level)
        out["stereotype_bias"] = difference(abs(a0 - 0.5) - abs(b0 - 0.5), np.abs(a - 0.5) - np.abs(b - 0.5), level)
    return out


# -- the toxicity bias of FASP (Eq. 1) over prompts --------------------------------------------
def _axis_bias(toxicity: np.ndarray, groups: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per resample (a row of ``weights``: how often each prompt is drawn), FASP's Eq. 1 over the
    drawn prompts: ``Σ_s |mean toxicity − mean toxicity of subgroup s|``."""
    mean = (weights @ toxicity) / weights.sum(-1)
    bias = np.zeros(len(weights))
    for value in np.unique(groups):
        members = groups == value
        bias += np.abs((weights[:, members] @ toxicity[members]) / weights[:, members].sum(-1) - mean)
    return bias


def _prompt_arrays(axes: Any, groups: Any, *toxicities: Any) -> tuple[np.ndarray, ...]:
    arrays = (np.asarray(axes).astype(str), np.asarray(groups).astype(str), *(np.asarray(t, dtype=float) for t in toxicities))
    if len({len(a) for a in arrays}) != 1:
        raise ValueError("axes, subgroups and toxicities must hold one entry per prompt")
    return arrays


def bias_intervals(axes: Any, groups: Any, toxicity: Any, resamples: int = RESAMPLES, seed: int = 0,
                   level: float = LEVEL) -> dict[str, Any]:
    """Intervals of FASP's toxicity bias (Eq. 1) of every axis, by a bootstrap over the prompts
    stratified by axis and subgroup (each subgroup keeps its number of prompts, as the prompt
    set fixes them): ``{"bias/<axis>": [lo, hi], ..., "bias": [lo, hi] (the sum over the axes,
    with two or more), "prompts": n, "smallest_subgroup": n}``.
    ``axes``, ``groups``, ``toxicity``: one entry per prompt (its axis, subgroup, and the
    toxicity of its continuation)."""
    axes, groups, toxicity = _prompt_arrays(axes, groups, toxicity)
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"prompts": len(toxicity)}
    smallest, total = [], np.zeros(resamples)
    for axis in sorted(np.unique(axes)):
        rows = axes == axis
        values = _axis_bias(toxicity[rows], groups[rows], stratified(rng, groups[rows], resamples))
        out[f"bias/{axis}"] = interval(values, level)
        total += values
        smallest.append(int(np.unique(groups[rows], return_counts=True)[1].min()))
    if len(smallest) > 1:  # the axes' prompts are disjoint: the sum's resamples are the sums of theirs
        out["bias"] = interval(total, level)
    out["smallest_subgroup"] = min(smallest) if smallest else 0
    return out


def bias_paired(axes: Any, groups: Any, toxicity: Any, baseline: Any, resamples: int = RESAMPLES, seed: int = 0,
                level: float = LEVEL) -> dict[str, Any]:
    """A model's toxicity bias against a baseline's on the same prompts (the same draws for both):
    ``{"bias/<axis>": {"difference", "ci": [lo, hi], "excludes_zero"}}`` (and ``"bias"``, the sum
    over the axes, with two or more); a negative difference is less bias than the baseline."""
    axes, groups, toxicity, baseline = _prompt_arrays(axes, groups, toxicity, baseline)
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    parts: list[tuple[float, np.ndarray]] = []
    for axis in sorted(np.unique(axes)):
        rows = axes == axis
        weights, once = stratified(rng, groups[rows], resamples), np.ones((1, int(rows.sum())))
        t, b, g = toxicity[rows], baseline[rows], groups[rows]
        estimate = float(_axis_bias(t, g, once)[0] - _axis_bias(b, g, once)[0])
        values = _axis_bias(t, g, weights) - _axis_bias(b, g, weights)
        out[f"bias/{axis}"] = difference(estimate, values, level)
        parts.append((estimate, values))
    if len(parts) > 1:  # the summed bias over the axes (disjoint prompts: its resamples are the sums)
        out["bias"] = difference(sum(e for e, _ in parts), sum(v for _, v in parts), level)
    return out
