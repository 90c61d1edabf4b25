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
from typing import Any

import pandas as pd

# Keys of a flat metric dict (``acc/White``, ``acc_gap``, ...) and where they go in the report.
_GROUP_KEYS = {"acc": "accuracy", "fpr": "fpr", "fnr": "fnr", "count": "count", "degradation": "degradation"}
_FAIRNESS_KEYS = ("acc_gap", "acc_std", "degradation_var", "degradation_std", "demographic_parity", "equal_opportunity")


def split_results(flat: dict[str, float]) -> dict[str, Any]:
    """Turn a flat metric dict into the report's ``metrics`` / ``groups`` / ``fairness`` parts.

    Absent groups (no samples) are listed with ``count`` 0 and ``present`` false.
    """
    metrics: dict[str, float] = {}
    groups: dict[str, dict[str, Any]] = {}
    fairness: dict[str, float] = {}
    for key, value in flat.items():
        head, _, group = key.partition("/")
        if group and head in _GROUP_KEYS:
            groups.setdefault(group, {})[_GROUP_KEYS[head]] = int(value) if head == "count" else value
        elif group and head == "present":
            groups.setdefault(group, {})["present"] = bool(value)
        elif head in _FAIRNESS_KEYS or head.startswith(("DP_", "EO_")):
            fairness[key] = value
        elif not group:
            metrics["accuracy" if key == "acc" else key] = value
    return {"metrics": metrics, "groups": groups, "fairness": fairness}


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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_clean(payload), indent=2) + "\n")
    tmp.replace(path)
    return path


def write_lm_run(output: str | os.PathLike, model, tokenizer, report: dict[str, Any], layers: dict[str, float],
                 config: dict[str, Any]) -> Path:
    """A pruned LM's folder: the transformers model and tokenizer (``save_pretrained``),
    ``sparsity.csv``, ``config.yaml`` and, last, ``report.json``."""
    import yaml

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    pd.DataFrame([{"layer": k, "sparsity": v} for k, v in layers.items()]).to_csv(out / "sparsity.csv", index=False)
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    write_json(out / "report.json", report)
    return out


def group_table(report: dict[str, Any]) -> pd.DataFrame:
    """Per-group table of a report (rows = groups)."""
    frame = pd.DataFrame.from_dict(report.get("groups", {}), orient="index")
    frame.index.name = "group"
    return frame


def markdown(frame: pd.DataFrame, floatfmt: str = ".4f") -> str:
    """A markdown table (pandas + tabulate)."""
    return frame.to_markdown(floatfmt=floatfmt)
