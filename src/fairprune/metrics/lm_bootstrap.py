"""Confidence intervals for a language model's figures and paired comparisons between models,
by a seeded bootstrap over the evaluation items (:class:`fairprune.metrics.language.LMItems`).

* **Perplexity over windows.** The text is cut into non-overlapping windows; a resample draws as
  many windows with replacement and its perplexity is ``exp`` of the drawn windows' summed NLL
  over their summed tokens, as the whole text's is. Windows, not tokens: the tokens of a window
  share their context, so they are not independent, while windows far apart nearly are.
* **Stereotype score over pairs.** A resample draws the pairs with replacement, stratified by
  direction (``stereo`` / ``antistereo`` rows keep their numbers, as the file fixes them), and
  recomputes the score by the CrowS-Pairs rule (wins over all pairs; each direction's part over
  its decided pairs).
* **Paired comparisons.** Two models scored on the same windows and pairs (a pruned model and the
  dense one, or two methods) are resampled with the *same* draws, so what the items share (a hard
  window, an easy pair) cancels: the interval of the difference is much narrower than the two
  intervals side by side. Perplexity is compared as a ratio (``exp`` of the difference of mean
  NLLs: 1.10 is 10 % worse), the stereotype score as a difference, and its distance from 0.5
  (the bias, whichever way) as a difference too.

* **FASP's toxicity bias over prompts.** A resample draws each subgroup's prompts with
  replacement (stratified by axis and subgroup, so every subgroup keeps its number of prompts)
  and recomputes Eq. 1, ``Σ_s |mean toxicity − mean toxicity of s|``, from the toxicity of each
  drawn prompt's continuation; a pruned model and the dense one are compared on the same draws.

Intervals are percentile intervals (level 95 % by default); ``tests/test_lm_bootstrap.py`` checks
them against a plain loop over resamples and against the normal approximation on large samples.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fairprune.metrics.language import LMItems

LEVEL = 0.95
RESAMPLES = 2000
MIN_PAIRS = 100  # below this many pairs a stereotype score moves by more than ±0.1 (95 %)


def _draws(rng: np.random.Generator, n: int, resamples: int) -> np.ndarray:
    """[resamples, n] item counts: how often each of ``n`` items is drawn in each resample."""
    picks = rng.integers(0, n, size=(resamples, n))
    counts = np.zeros((resamples, n))
    np.add.at(counts, (np.arange(resamples)[:, None], picks), 1.0)
    return counts


def _stratified(rng: np.random.Generator, strata: np.ndarray, resamples: int) -> np.ndarray:
    """[resamples, items] counts, each stratum's items drawn with replacement, as many as it has."""
    counts = np.zeros((resamples, len(strata)))
    for value in np.unique(strata):
        members = np.flatnonzero(strata == value)
        counts[:, members] = _draws(rng, len(members), resamples)
    return counts


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


def _interval(values: np.ndarray, level: float) -> list[float] | None:
    values = values[~np.isnan(values)]
    if not len(values):
        return None
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return [float(low), float(high)]


def lm_intervals(items: LMItems, resamples: int = RESAMPLES, seed: int = 0, level: float = LEVEL,
                 min_pairs: int = MIN_PAIRS) -> dict[str, Any]:
    """Intervals of an LM's figures: ``{"level", "resamples", "seed", "windows", "pairs",
    "perplexity": [lo, hi], "stereotype_score": [lo, hi], "stereotype_score_stereo": [lo, hi] or
    None, "stereotype_score_antistereo": ..., "few_pairs": bool}`` (``few_pairs``: fewer than
    ``min_pairs`` pairs, too few for a score to be read to ±0.1; the stereotype keys only when the
    items hold pairs)."""
    rng = np.random.default_rng(seed)
    windows = _draws(rng, len(items.window_nll), resamples)
    out: dict[str, Any] = {"level": level, "resamples": resamples, "seed": seed, "windows": len(items.window_nll),
                           "pairs": len(items.pair_win)}
    log_interval = _interval(_log_perplexity(items, windows), level)  # None when the losses are not finite
    out["perplexity"] = None if log_interval is None else [float(np.exp(v)) for v in log_interval]
    if len(items.pair_win):
        pairs = _stratified(rng, items.pair_anti, resamples)
        for key, values in _scores(items, pairs).items():
            out[key] = _interval(values, level)
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
    windows = _draws(rng, len(items.window_nll), resamples)
    once = np.ones((1, len(items.window_nll)))
    ratio = np.exp(_log_perplexity(items, windows) - _log_perplexity(baseline, windows))
    point = float(np.exp(_log_perplexity(items, once) - _log_perplexity(baseline, once))[0])
    low, high = _interval(ratio, level) or (math.nan, math.nan)
    out: dict[str, Any] = {"perplexity_ratio": {"ratio": point, "ci": [low, high], "excludes_one": bool(low > 1 or high < 1)}}
    if len(items.pair_win):
        pairs = _stratified(rng, items.pair_anti, resamples)
        one = np.ones((1, len(items.pair_win)))
        a, b = _scores(items, pairs)["stereotype_score"], _scores(baseline, pairs)["stereotype_score"]
        a0, b0 = _scores(items, one)["stereotype_score"][0], _scores(baseline, one)["stereotype_score"][0]
        for key, values, estimate in (("stereotype_score", a - b, a0 - b0),
                                      ("stereotype_bias", np.abs(a - 0.5) - np.abs(b - 0.5), abs(a0 - 0.5) - abs(b0 - 0.5))):
            low, high = _interval(values, level) or (math.nan, math.nan)
            out[key] = {"difference": float(estimate), "ci": [low, high], "excludes_zero": bool(low > 0 or high < 0)}
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
        weights = _stratified(rng, groups[rows], resamples)
        values = _axis_bias(toxicity[rows], groups[rows], weights)
        out[f"bias/{axis}"] = _interval(values, level)
        total += values
        smallest.append(int(np.unique(groups[rows], return_counts=True)[1].min()))
    if len(smallest) > 1:  # the axes' prompts are disjoint: the sum's resamples are the sums of theirs
        out["bias"] = _interval(total, level)
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
        weights, once = _stratified(rng, groups[rows], resamples), np.ones((1, int(rows.sum())))
        t, b, g = toxicity[rows], baseline[rows], groups[rows]
        estimate = float(_axis_bias(t, g, once)[0] - _axis_bias(b, g, once)[0])
        values = _axis_bias(t, g, weights) - _axis_bias(b, g, weights)
        out[f"bias/{axis}"] = _difference(estimate, values, level)
        parts.append((estimate, values))
    if len(parts) > 1:  # the summed bias over the axes (disjoint prompts: its resamples are the sums)
        out["bias"] = _difference(sum(e for e, _ in parts), sum(v for _, v in parts), level)
    return out


def _difference(estimate: float, values: np.ndarray, level: float) -> dict[str, Any]:
    low, high = _interval(values, level) or (math.nan, math.nan)
    return {"difference": float(estimate), "ci": [low, high], "excludes_zero": bool(low > 0 or high < 0)}
