"""DTO, the distance to the optimum of Debias-SparseGPT, over the rows of a comparison: which
knowledge and abstention figures it reads (the first each row holds validly, never one its run
marked invalid) and each row's distance. It reads comparison rows, not a model's samples, so it
lives beside the tables that show it (:mod:`fairprune.reporting.headline`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

#: DTO's knowledge figure, the first valid one of: the paper's MMLU (letter prompt), a cloze-scored task.
KNOWLEDGE = ("mmlu/acc", "hellaswag/acc_norm")
#: DTO's abstention figure, the first valid one of: UnQover (the paper's: as a cloze over each question's
#: three answers, then the letter prompt balanced over positions), then BBQ likewise, then BBQ's plain
#: letter prompt. Never lm-eval's twelve-answer ``bbq_ambig``: a model pushed toward uniform answers
#: abstains there toward 10/12.
ABSTENTION = ("unqover_cloze3/accuracy_amb", "unqover_letter_balanced/accuracy_amb", "bbq_ambig_cloze3/accuracy_amb",
              "bbq_ambig_letter_balanced/accuracy_amb", "bbq_ambig_letter/accuracy_amb")


def valid(row: dict[str, Any], figure: str) -> bool:
    """Whether a comparison row holds ``figure`` as a finite value its run does not mark invalid
    (``<figure>_invalid``, the reason, empty when valid)."""
    reason = row.get(f"{figure}_invalid")
    return _finite(row.get(figure)) and not (isinstance(reason, str) and reason)


def choose(rows: Sequence[dict[str, Any]], candidates: Sequence[str]) -> str | None:
    """The figure of ``candidates`` that the most rows hold validly, the earlier one on a tie (so
    the first that every row holds validly); None when no row holds any validly."""
    counts = [sum(valid(r, c) for r in rows) for c in candidates]
    best = max(range(len(candidates)), key=lambda i: (counts[i], -i), default=None)
    return None if best is None or counts[best] == 0 else candidates[best]


def dto(rows: Sequence[dict[str, Any]], accuracy: Sequence[str] = KNOWLEDGE,
        abstention: Sequence[str] = ABSTENTION) -> tuple[list[float | None], dict[str, Any] | None]:
    """DTO, the distance to the optimum of Debias-SparseGPT, over the rows of a comparison (row
    dicts holding ``<task>/<metric>`` and, from runs that mark figures, ``<task>/<metric>_invalid``):
    a knowledge figure (the first of ``accuracy`` the rows hold validly, :func:`choose`) and an
    abstention figure (likewise from ``abstention``) are min-max normalised over the rows that hold
    both validly (a figure equal on every such row normalises to 1), and each such row's DTO is its
    Euclidean distance to the ideal point (1, 1). Lower is better. A figure below its chance level
    (``<figure>_chance``) counts as the chance level: moving toward uniform answers, which is what
    damage does to a model that answers below chance, earns nothing. Rows whose figures are missing
    or invalid get None and are named in ``left_out``. Returns the distances and ``{"accuracy",
    "abstention", "left_out"}`` (with ``reason`` where fewer than two rows hold both figures validly,
    so no row has a DTO); None where the rows hold no figure of one of the two lists at all."""
    def label(i: int) -> str:
        return " ".join(str(rows[i][k]) for k in ("method", "sparsity") if k in rows[i]) or str(i)

    if not any(_finite(r.get(c)) for r in rows for c in accuracy) or not any(_finite(r.get(c)) for r in rows for c in abstention):
        return [None] * len(rows), None
    known, abstains = choose(rows, accuracy), choose(rows, abstention)
    both = [i for i, r in enumerate(rows) if known and abstains and valid(r, known) and valid(r, abstains)]
    used: dict[str, Any] = {"accuracy": known, "abstention": abstains,
                            "left_out": [label(i) for i in range(len(rows)) if i not in both]}
    if len(both) < 2:
        used["left_out"] = [label(i) for i in range(len(rows))]
        used["reason"] = (f"fewer than two rows hold a valid knowledge figure ({', '.join(accuracy)}) and a valid "
                          f"abstention figure ({', '.join(abstention)})")
        return [None] * len(rows), used

    def floored(row: dict[str, Any], key: str) -> float:
        chance = row.get(f"{key}_chance")
        return max(row[key], chance) if _finite(chance) else row[key]

    def norm(row: dict[str, Any], key: str) -> float:
        low, high = min(floored(rows[i], key) for i in both), max(floored(rows[i], key) for i in both)
        return 1.0 if high == low else (floored(row, key) - low) / (high - low)

    return [math.hypot(1 - norm(r, known), 1 - norm(r, abstains)) if i in both else None
            for i, r in enumerate(rows)], used


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
