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
from typing import Any, TypedDict

import pandas as pd

from fairprune.storage.atomic import write_text


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
    frame = pd.DataFrame.from_dict(report.get("groups", {}), orient="index")
    frame.index.name = "group"
    return frame


def markdown(frame: pd.DataFrame, floatfmt: str = ".4f") -> str:
    """A markdown table (pandas + tabulate)."""
    return frame.to_markdown(floatfmt=floatfmt)
