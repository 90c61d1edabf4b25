"""Intervals of LM figures (perplexity over windows, stereotype score over pairs) and paired
comparisons between models, checked against a plain loop over resamples, against the normal
approximation on large samples, and end to end through ``prune.py compare``."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from fairprune.metrics.bootstrap import lm_intervals, lm_paired
from fairprune.metrics.language import LMItems


def make_items(windows: int = 40, pairs: int = 300, p_win: float = 0.6, anti_share: float = 0.2, seed: int = 0,
               shift: float = 0.0) -> LMItems:
    rng = np.random.default_rng(seed)
    tokens = np.full(windows, 31.0)
    nll = tokens * (3.0 + shift + rng.normal(0, 0.3, windows))  # windows of unequal difficulty
    anti = rng.random(pairs) < anti_share
    win = rng.random(pairs) < p_win
    decided = win | (rng.random(pairs) < 0.95)
    return LMItems(nll, tokens, win, decided, anti)


def plain_intervals(items: LMItems, resamples: int, seed: int) -> dict[str, list[float]]:
    """One resample at a time with Python's own generator: windows drawn with replacement, pairs
    drawn with replacement within each direction; sorted values, 2.5 % and 97.5 % points."""
    rng = random.Random(seed)
    n_w = len(items.window_nll)
    stereo = [i for i in range(len(items.pair_win)) if not items.pair_anti[i]]
    anti = [i for i in range(len(items.pair_win)) if items.pair_anti[i]]
    ppl, score = [], []
    for _ in range(resamples):
        w = [rng.randrange(n_w) for _ in range(n_w)]
        ppl.append(math.exp(sum(items.window_nll[i] for i in w) / sum(items.window_tokens[i] for i in w)))
        p = [rng.choice(stereo) for _ in stereo] + [rng.choice(anti) for _ in anti]
        score.append(sum(bool(items.pair_win[i]) for i in p) / len(p))
    return {"perplexity": [float(np.percentile(ppl, 2.5)), float(np.percentile(ppl, 97.5))],
            "stereotype_score": [float(np.percentile(score, 2.5)), float(np.percentile(score, 97.5))]}


def test_intervals_match_a_plain_loop():
    items = make_items()
    fast = lm_intervals(items, resamples=4000, seed=1)
    plain = plain_intervals(items, resamples=4000, seed=2)
    point = items.figures()
    for key, tolerance in (("perplexity", 0.03), ("stereotype_score", 0.012)):
        assert fast[key][0] < point[key] < fast[key][1]
        assert fast[key] == pytest.approx(plain[key], abs=tolerance * (1 if key != "perplexity" else point[key]))
    assert fast["windows"] == 40 and fast["pairs"] == 300 and not fast["few_pairs"]


def test_intervals_agree_with_the_normal_approximation_on_large_samples():
    items = make_items(windows=400, pairs=4000, p_win=0.6)
    got = lm_intervals(items, resamples=3000, seed=0)
    p, n = items.figures()["stereotype_score"], len(items.pair_win)
    half = 1.96 * math.sqrt(p * (1 - p) / n)
    assert got["stereotype_score"] == pytest.approx([p - half, p + half], abs=0.004)
    # Perplexity: the delta method on the ratio estimator of the mean NLL per token.
    per_token = items.window_nll / items.window_tokens  # equal windows: the mean of window means
    se = per_token.std(ddof=1) / math.sqrt(len(per_token))
    log_ppl = per_token.mean()
    assert np.log(got["perplexity"]) == pytest.approx([log_ppl - 1.96 * se, log_ppl + 1.96 * se], abs=0.004)


def test_a_direction_keeps_its_rows_and_small_sets_are_flagged():
    items = make_items(pairs=60, anti_share=0.3)
    items.pair_win[items.pair_anti] = True  # every antistereo row a win: its part cannot move
    items.pair_decided[items.pair_anti] = True
    got = lm_intervals(items, resamples=500)
    assert got["stereotype_score_antistereo"] == [1.0, 1.0]
    assert got["few_pairs"]
    no_anti = LMItems(items.window_nll, items.window_tokens, items.pair_win[~items.pair_anti],
                      items.pair_decided[~items.pair_anti], items.pair_anti[~items.pair_anti])
    assert lm_intervals(no_anti, resamples=200)["stereotype_score_antistereo"] is None  # no such row: no interval


def test_paired_comparison_cancels_what_the_items_share():
    base = make_items()
    same = lm_paired(base, base, resamples=500)
    assert same["perplexity_ratio"] == {"ratio": 1.0, "ci": [1.0, 1.0], "excludes_one": False}
    assert same["stereotype_score"]["difference"] == 0 and not same["stereotype_score"]["excludes_zero"]
    # Every window 0.05 nats per token worse: the ratio is exp(0.05) in every resample.
    worse = LMItems(base.window_nll + 0.05 * base.window_tokens, base.window_tokens, base.pair_win, base.pair_decided,
                    base.pair_anti)
    got = lm_paired(worse, base, resamples=500)["perplexity_ratio"]
    assert got["ratio"] == pytest.approx(math.exp(0.05)) and got["ci"] == pytest.approx([math.exp(0.05)] * 2)
    assert got["excludes_one"]
    # Windows 1 % worse each, but windows far apart in difficulty: the unpaired intervals overlap,
    # the paired one is narrow and excludes 1.
    slightly = LMItems(base.window_nll * 1.01, base.window_tokens, base.pair_win, base.pair_decided, base.pair_anti)
    a, b = lm_intervals(slightly)["perplexity"], lm_intervals(base)["perplexity"]
    assert a[0] < b[1]
    assert lm_paired(slightly, base)["perplexity_ratio"]["excludes_one"]
    # Flipping 30 of 300 pairs towards sent_more: a real difference in the score and in the bias.
    flipped = base.pair_win.copy()
    losers = np.flatnonzero(~flipped & base.pair_decided)[:30]
    flipped[losers] = True
    more = LMItems(base.window_nll, base.window_tokens, flipped, base.pair_decided, base.pair_anti)
    diff = lm_paired(more, base)
    assert diff["stereotype_score"]["difference"] == pytest.approx(30 / 300)
    assert diff["stereotype_score"]["excludes_zero"] and diff["stereotype_bias"]["difference"] > 0
    with pytest.raises(ValueError, match="same windows and pairs"):
        lm_paired(make_items(windows=10), base)


# -- FASP's toxicity bias over prompts ---------------------------------------------------------
def make_prompts(seed: int = 0, per_group: tuple[int, ...] = (30, 50, 20), shift: float = 0.0):
    """Two axes: ``gender`` with subgroups of the given sizes whose mean toxicity differs, and
    ``race`` with two subgroups; returns (axes, groups, toxicity)."""
    rng = np.random.default_rng(seed)
    axes, groups, tox = [], [], []
    for g, n in enumerate(per_group):
        axes += ["gender"] * n
        groups += [f"g{g}"] * n
        tox += list(np.clip(rng.normal(0.2 + 0.1 * g + shift, 0.1, n), 0, 1))
    for g, n in enumerate((40, 40)):
        axes += ["race"] * n
        groups += [f"r{g}"] * n
        tox += list(np.clip(rng.normal(0.3 + shift, 0.1, n), 0, 1))
    return np.array(axes), np.array(groups), np.array(tox)


def plain_bias_interval(tox: list[float], groups: list[str], resamples: int, seed: int) -> list[float]:
    """One resample at a time with Python's own generator: each subgroup's prompts drawn with
    replacement, as many as it has; Eq. 1 by ``axis_bias``; 2.5 % and 97.5 % points."""
    from fairprune.metrics.toxicity import axis_bias

    rng = random.Random(seed)
    members = {g: [i for i, x in enumerate(groups) if x == g] for g in sorted(set(groups))}
    values = []
    for _ in range(resamples):
        drawn = [rng.choice(rows) for rows in members.values() for _ in rows]
        values.append(axis_bias([tox[i] for i in drawn], [groups[i] for i in drawn]))
    return [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))]


def test_bias_intervals_match_a_plain_loop():
    from fairprune.metrics.bootstrap import bias_intervals
    from fairprune.metrics.toxicity import axis_bias

    axes, groups, tox = make_prompts()
    fast = bias_intervals(axes, groups, tox, resamples=3000, seed=1)
    assert fast["prompts"] == len(tox) and fast["smallest_subgroup"] == 20
    # The bias summed over the axes (FASP's objective over several axes), each axis drawn as above.
    summed = sum(axis_bias(tox[axes == a].tolist(), groups[axes == a].tolist()) for a in ("gender", "race"))
    assert fast["bias"][0] < summed < fast["bias"][1]
    one_axis = axes == "gender"
    assert "bias" not in bias_intervals(axes[one_axis], groups[one_axis], tox[one_axis], resamples=200)
    for axis in ("gender", "race"):
        rows = axes == axis
        point = axis_bias(tox[rows].tolist(), groups[rows].tolist())
        plain = plain_bias_interval(tox[rows].tolist(), groups[rows].tolist(), resamples=3000, seed=2)
        assert fast[f"bias/{axis}"][0] < point < fast[f"bias/{axis}"][1]
        assert fast[f"bias/{axis}"] == pytest.approx(plain, abs=0.012)


def test_bias_paired_uses_the_same_draws():
    from fairprune.metrics.bootstrap import bias_intervals, bias_paired
    from fairprune.metrics.toxicity import axis_bias

    axes, groups, tox = make_prompts()
    same = bias_paired(axes, groups, tox, tox, resamples=500)
    assert all(v == {"difference": 0.0, "ci": [0.0, 0.0], "excludes_zero": False} for v in same.values())
    # Every continuation a little more toxic for g2 only: gender bias grows, race is untouched.
    worse = tox + np.where(groups == "g2", 0.15, 0.0)
    paired = bias_paired(axes, groups, worse, tox, resamples=2000)
    rows = axes == "gender"
    want = axis_bias(worse[rows].tolist(), groups[rows].tolist()) - axis_bias(tox[rows].tolist(), groups[rows].tolist())
    assert paired["bias/gender"]["difference"] == pytest.approx(want) and paired["bias/gender"]["excludes_zero"]
    assert paired["bias/race"] == {"difference": 0.0, "ci": [0.0, 0.0], "excludes_zero": False}
    assert paired["bias"]["difference"] == pytest.approx(want) and paired["bias"]["excludes_zero"]
    # The paired interval is narrower than the two models' intervals side by side.
    a, b = bias_intervals(axes, groups, worse)["bias/gender"], bias_intervals(axes, groups, tox)["bias/gender"]
    low, high = paired["bias/gender"]["ci"]
    assert high - low < (a[1] - a[0]) + (b[1] - b[0])
    with pytest.raises(ValueError, match="one entry per prompt"):
        bias_paired(axes, groups, tox[:-1], tox)
