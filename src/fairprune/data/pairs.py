"""Paired stereotype sets: StereoSet / CrowS-Pairs readers, the seeded calibration / evaluation
split, and the texts every LM command starts from (bundled defaults).

A pair is ``(stereotypical, anti-stereotypical)``. The paired set is split once, seeded, into a
calibration half (Debias-SparseGPT's Hessian) and an evaluation half (the stereotype score), so the
score is never measured on the pairs that shaped the pruning.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import NamedTuple

import pandas as pd

from fairprune.data.files import read_text, read_user_csv
from fairprune.data.text import lm_corpus, stereo_pairs
from fairprune.errors import UserError


def read_stereoset(path: str | Path) -> list[tuple[str, str]]:
    """(stereotype, anti-stereotype) pairs from StereoSet JSON ``data.intrasentence[*].sentences[*]``."""
    data = _read_json(path)
    items = data.get("data", {}).get("intrasentence") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise UserError(f"{path}: no 'data.intrasentence' list; expected StereoSet intrasentence JSON")
    pairs = []
    for k, item in enumerate(items):
        sentences = item.get("sentences") if isinstance(item, dict) else None
        by_label = {s.get("gold_label"): s.get("sentence") for s in sentences or [] if isinstance(s, dict)}
        stereo, anti = by_label.get("stereotype"), by_label.get("anti-stereotype")
        if not (isinstance(stereo, str) and isinstance(anti, str)):
            raise UserError(f"{path}: intrasentence item {k} lacks a 'stereotype' or 'anti-stereotype' sentence (gold_label)")
        pairs.append((stereo, anti))
    return pairs

def read_crows_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(stereotypical, anti-stereotypical) pairs from a CrowS-Pairs CSV (``sent_more,sent_less``).

    When the file has the ``stereo_antistereo`` column, rows marked ``antistereo`` are swapped:
    there ``sent_less`` is the stereotypical sentence (as in the CrowS-Pairs metric).
    """
    frame = read_user_csv(path, "CrowS-Pairs", "CrowS-Pairs columns sent_more,sent_less")
    missing = {"sent_more", "sent_less"} - set(frame.columns)
    if missing:
        raise UserError(f"{path}: missing column(s) {', '.join(sorted(missing))}; expected CrowS-Pairs columns sent_more,sent_less")
    if frame.empty or frame[["sent_more", "sent_less"]].isna().any().any():
        raise UserError(f"{path}: empty file or empty sent_more/sent_less cells; every row needs both sentences")
    anti = frame.get("stereo_antistereo", pd.Series(["stereo"] * len(frame))).eq("antistereo")
    return [(less, more) if flip else (more, less) for more, less, flip in zip(frame.sent_more, frame.sent_less, anti)]

def read_pairs(path: str | Path) -> list[tuple[str, str]]:
    """Read StereoSet (``.json``) or CrowS-Pairs (``.csv``) into (stereotypical, anti) pairs."""
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        return read_stereoset(path)
    if suffix == ".csv":
        return read_crows_pairs(path)
    raise UserError(f"{path}: unknown pair-set format {suffix!r}; give StereoSet .json or CrowS-Pairs .csv")

def _read_json(path: str | Path):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"StereoSet file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: not valid JSON ({err}); expected StereoSet intrasentence JSON") from None


def split_pairs(pairs: list[tuple[str, str]], seed: int) -> tuple[list, list]:
    """Seeded halves: (calibration pairs, evaluation pairs)."""
    if len(pairs) < 2:
        raise UserError(f"the paired set has {len(pairs)} pair(s); give at least two")
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    half = len(pairs) // 2
    return [pairs[i] for i in order[:half]], [pairs[i] for i in order[half:]]


class LMTexts(NamedTuple):
    """What an LM command calibrates and measures on."""

    calib_text: str
    eval_text: str
    calib_pairs: list
    eval_pairs: list


def lm_texts(calib_text: str | None = None, eval_text: str | None = None, pairs: str | None = None,
             seed: int = 0) -> LMTexts:
    """Calibration text, evaluation text and the two pair halves; the bundled corpus and pairs
    stand in for what is not given (files or folders of ``*.txt``; StereoSet / CrowS-Pairs)."""
    bundled = lm_corpus() if calib_text is None or eval_text is None else None
    calib = read_text(calib_text) if calib_text else bundled.train
    evaluation = read_text(eval_text) if eval_text else bundled.validation
    return LMTexts(calib, evaluation, *split_pairs(read_pairs(pairs) if pairs else stereo_pairs(), seed))
