"""Paired stereotype sets: StereoSet / CrowS-Pairs readers, the seeded calibration / evaluation
split, and the texts every LM command starts from (bundled defaults).

A pair is a :class:`Pair`: ``(more, less)`` — StereoSet's (stereotype, anti-stereotype), a
CrowS-Pairs row's ``(sent_more, sent_less)`` exactly as written — carrying the row's direction
(``stereo`` / ``antistereo``). The CrowS-Pairs metric asks in every row whether ``sent_more`` wins
and reports the two directions apart, so a reader that swapped antistereo rows would score another
metric. The paired set is split once, seeded, into a calibration half (Debias-SparseGPT's Hessian)
and an evaluation half (the stereotype score), so the score is never measured on the pairs that
shaped the pruning.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import NamedTuple

from fairprune.data.chats import BUNDLED_CORPUS, read_calibration
from fairprune.data.files import Chats, read_text, read_user_csv
from fairprune.data.text import lm_corpus, stereo_pairs
from fairprune.errors import UserError

DIRECTIONS = ("stereo", "antistereo")


class Pair(tuple):
    """``(more, less)`` with the pair's ``direction``: a 2-tuple, so every ``for a, b in pairs``
    keeps working; equality and hashing are the sentences' (a tuple's)."""

    def __new__(cls, more: str, less: str, direction: str = "stereo"):
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        pair = super().__new__(cls, (more, less))
        pair.direction = direction
        return pair

    def __getnewargs__(self):  # copy / pickle rebuild through __new__, direction included
        return (self[0], self[1], self.direction)

    def __repr__(self) -> str:
        return f"Pair({self[0]!r}, {self[1]!r}, {self.direction!r})"

    @property
    def more(self) -> str:
        return self[0]

    @property
    def less(self) -> str:
        return self[1]


def direction(pair) -> str:
    """The pair's direction; a plain 2-tuple (the bundled set, a caller's own pairs) is ``stereo``."""
    return getattr(pair, "direction", "stereo")


def read_stereoset(path: str | Path) -> list[Pair]:
    """(stereotype, anti-stereotype) pairs from StereoSet's JSON (the official ``dev.json``):
    ``{"version", "data": {"intrasentence": [{"id", "target", "bias_type", "context", "sentences":
    [{"sentence", "id", "labels", "gold_label"}, ...]}, ...], "intersentence": [...]}}``. Each
    intrasentence item gives one pair: its sentence whose ``gold_label`` is ``stereotype`` and the
    one whose ``gold_label`` is ``anti-stereotype`` (the ``unrelated`` one is not used; the
    intersentence part is not read). A missing part or an item without exactly one of each is a
    one-line :class:`UserError` naming the item."""
    data = _read_json(path)
    part = data.get("data") if isinstance(data, dict) else None
    items = part.get("intrasentence") if isinstance(part, dict) else None
    if not isinstance(items, list) or not items:
        raise UserError(f"{path}: no 'data.intrasentence' list; expected StereoSet intrasentence JSON "
                        '({"data": {"intrasentence": [{"id", "sentences": [{"sentence", "gold_label"}, ...]}, ...]}})')
    pairs = []
    for k, item in enumerate(items):
        name = f"intrasentence item {k}" + (f" (id {item['id']!r})" if isinstance(item, dict) and "id" in item else "")
        sentences = item.get("sentences") if isinstance(item, dict) else None
        if not isinstance(sentences, list):
            raise UserError(f"{path}: {name} has no 'sentences' list; each item lists its sentences with their gold_label")
        by_label: dict[str, list] = {}
        for s in sentences:
            if isinstance(s, dict):
                by_label.setdefault(s.get("gold_label"), []).append(s.get("sentence"))
        stereo, anti = by_label.get("stereotype", []), by_label.get("anti-stereotype", [])
        if len(stereo) != 1 or len(anti) != 1 or not all(isinstance(t, str) and t for t in stereo + anti):
            found = f"{len(stereo)} stereotype and {len(anti)} anti-stereotype sentence(s)"
            raise UserError(f"{path}: {name} has {found}; each item needs exactly one 'stereotype' and one "
                            "'anti-stereotype' sentence (gold_label) with its text")
        pairs.append(Pair(stereo[0], anti[0], "stereo"))
    return pairs

def read_crows_pairs(path: str | Path) -> list[Pair]:
    """``(sent_more, sent_less)`` pairs from a CrowS-Pairs CSV, every row as written, each with its
    ``stereo_antistereo`` direction (no such column: all ``stereo``). Antistereo rows are not
    swapped: the CrowS-Pairs metric counts them, like stereo rows, when ``sent_more`` wins."""
    import pandas as pd
    frame = read_user_csv(path, "CrowS-Pairs", "CrowS-Pairs columns sent_more,sent_less")
    missing = {"sent_more", "sent_less"} - set(frame.columns)
    if missing:
        raise UserError(f"{path}: missing column(s) {', '.join(sorted(missing))}; expected CrowS-Pairs columns sent_more,sent_less")
    if frame.empty or frame[["sent_more", "sent_less"]].isna().any().any():
        raise UserError(f"{path}: empty file or empty sent_more/sent_less cells; every row needs both sentences")
    directions = frame.get("stereo_antistereo", pd.Series(["stereo"] * len(frame), index=frame.index))
    for row, value in enumerate(directions, start=1):
        if value not in DIRECTIONS:  # a mislabelled row would land silently in the wrong part
            raise UserError(f"{path}: row {row} has stereo_antistereo {value!r}; each row needs stereo or antistereo")
    return [Pair(more, less, d) for more, less, d in zip(frame.sent_more, frame.sent_less, directions)]

#: The longest pair sentence taken (CrowS-Pairs' and StereoSet's are under 300 characters): a longer
#: one is rows run together (a quote left open in a cut or edited file), not a sentence.
MAX_SENTENCE = 2000


def read_pairs(path: str | Path) -> list[Pair]:
    """Read StereoSet (``.json``) or CrowS-Pairs (``.csv``) into :class:`Pair` s; every sentence
    text of at most :data:`MAX_SENTENCE` characters, or a one-line :class:`UserError` naming the pair."""
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        pairs = read_stereoset(path)
    elif suffix == ".csv":
        pairs = read_crows_pairs(path)
    else:
        raise UserError(f"{path}: unknown pair-set format {suffix!r}; give StereoSet .json or CrowS-Pairs .csv")
    for number, pair in enumerate(pairs, start=1):
        for text in pair[:2]:
            if not isinstance(text, str):
                raise UserError(f"{path}: pair {number} has {text!r} where a sentence goes; every pair needs two sentences")
            if len(text) > MAX_SENTENCE:
                raise UserError(f"{path}: pair {number} has a sentence of {len(text)} characters, more than "
                                f"{MAX_SENTENCE}: rows run together (a quote left open?); fix the file")
    return pairs

def _read_json(path: str | Path):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"StereoSet file not found: {path}") from None
    except IsADirectoryError:
        raise UserError(f"StereoSet file {path} is a directory; give the JSON file itself (e.g. dev.json)") from None
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
    """What an LM command calibrates and measures on. ``calib_name``: what ``calib_text`` is (the
    name or path it was given by, or :data:`~fairprune.data.chats.BUNDLED_CORPUS`);
    ``calib_for``: per sparsity (``"2:4"``), the ``(text, name)`` its runs calibrate on instead
    (``--calib_text_for``; :meth:`at`)."""

    calib_text: str | Chats  # plain text, or chat rows rendered with the tokenizer (data.text.calibration_ids)
    eval_text: str
    calib_pairs: list
    eval_pairs: list
    calib_name: str = BUNDLED_CORPUS
    calib_for: dict | None = None

    def at(self, sparsity) -> LMTexts:
        """The texts of a run at ``sparsity``: its own calibration text where ``calib_for`` has one."""
        found = (self.calib_for or {}).get(str(sparsity))
        return self if found is None else self._replace(calib_text=found[0], calib_name=found[1], calib_for=None)


def lm_texts(calib_text: str | None = None, eval_text: str | None = None, pairs: str | None = None,
             seed: int = 0, calib_text_for: dict[str, str] | None = None) -> LMTexts:
    """Calibration text, evaluation text and the two pair halves; the bundled corpus and pairs
    stand in for what is not given (files or folders of ``*.txt``; StereoSet / CrowS-Pairs).

    ``calib_text`` may also be chat data in UltraChat's jsonl form (``.jsonl``, or a file whose lines
    are such rows) or ``bundled:ultrachat`` (:func:`fairprune.data.chats.read_calibration`): it is
    returned as :class:`~fairprune.data.files.Chats` and rendered, one text per row, with the
    tokenizer's chat template where the calibration windows are drawn
    (:func:`fairprune.data.text.calibration_ids`). For debias-sparsegpt these windows are the unpaired
    data (plain XXᵀ) beside the calibration pairs. ``calib_text_for`` (``{"2:4": TEXT}``, keys as
    :class:`~fairprune.pruning.sparsity.Sparsity` writes them) is read likewise, every text now,
    before any model loads."""
    bundled = lm_corpus() if calib_text is None or eval_text is None else None
    calib = read_calibration(calib_text) if calib_text else bundled.train
    evaluation = read_text(eval_text) if eval_text else bundled.validation
    by_sparsity = {key: (read_calibration(text), text) for key, text in (calib_text_for or {}).items()}
    return LMTexts(calib, evaluation, *split_pairs(read_pairs(pairs) if pairs else stereo_pairs(), seed),
                   calib_name=calib_text or BUNDLED_CORPUS, calib_for=by_sparsity or None)
