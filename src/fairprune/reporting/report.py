"""Run reports: ``report.json``, per-group tables and plots.

The report shape is the same for every method and model (see the README): ``metrics`` holds
overall figures, ``groups`` the per-group rates, ``fairness`` the gap and degradation figures,
``reference`` the dense model's figures when known.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from fairprune.storage.atomic import write_text

if TYPE_CHECKING:
    import pandas as pd


class Report(TypedDict, total=False):
    """A run's ``report.json``: one shape for every method and model (see the README).

    ``metrics`` holds the overall figures (accuracy, or perplexity and stereotype score),
    ``groups`` the per-group rates, ``fairness`` the gaps and degradation spread, ``reference`` the
    dense model's figures in the same shape, ``seconds`` the timings."""

    method: str
    model: str
    dataset: str
    task: str
    sensitive: str | None
    split: str
    target_sparsity: float
    achieved_sparsity: float
    metrics: dict[str, float]
    groups: dict[str, dict[str, Any]]
    fairness: dict[str, float]
    reference: dict[str, Any]
    seconds: dict[str, float]
    environment: dict[str, Any]  # library versions and machine (fairprune.reporting.environment)


def _clean(value: Any) -> Any:
    """JSON-safe values: NaN/inf become null, tensors and numpy scalars become floats."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Write JSON atomically (temp file + rename) so an interrupted run never leaves half a report."""
    return write_text(path, json.dumps(_clean(payload), indent=2) + "\n")


def group_table(report: dict[str, Any]) -> pd.DataFrame:
    """Per-group table of a report (rows = groups)."""
    import pandas as pd
    frame = pd.DataFrame.from_dict(report.get("groups", {}), orient="index")
    frame.index.name = "group"
    return frame


# Names (groups, classes, methods) come from data and options: in a table cell they are text. A bar
# or a newline would add a column or a row, a trailing backslash would escape the next border, and
# ``<`` / ``&`` would reach a renderer as HTML; entities keep every one of them as its character.
_MARKDOWN_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", "|": "&#124;", "\\": "&#92;"})


def markdown_text(value: Any) -> Any:
    """``value`` as the text of one markdown table cell (strings only; numbers keep their type)."""
    if isinstance(value, tuple):  # a MultiIndex label
        return tuple(markdown_text(v) for v in value)
    if not isinstance(value, str):
        return value
    return "<br>".join(value.translate(_MARKDOWN_ESCAPES).splitlines()) if value else value


def markdown(frame: pd.DataFrame, floatfmt: str = ".4f") -> str:
    """A markdown table (pandas + tabulate) whose names and text cells are escaped (:func:`markdown_text`)."""
    import pandas as pd
    frame = frame.copy()
    frame.columns = frame.columns.map(markdown_text)
    frame.index = frame.index.map(markdown_text)
    frame.index.names = [markdown_text(name) for name in frame.index.names]
    for column in range(frame.shape[1]):
        if not pd.api.types.is_numeric_dtype(frame.dtypes.iloc[column]):
            frame.isetitem(column, frame.iloc[:, column].map(markdown_text))
    return frame.to_markdown(floatfmt=floatfmt)
