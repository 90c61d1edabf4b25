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


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def confidence_ellipse(points, level_chi2: float = 5.991) -> tuple[tuple[float, float], float, float, float] | None:
    """Centre, width, height and angle (degrees) of the 95 % covariance ellipse of 2-D points
    (``level_chi2`` is the χ² quantile with 2 degrees of freedom). None for fewer than 3 points."""
    import numpy as np

    pts = np.asarray(points, dtype=float)
    if len(pts) < 3:
        return None
    cov = np.cov(pts, rowvar=False)
    values, vectors = np.linalg.eigh(cov)
    values = np.clip(values, 0.0, None)
    angle = float(np.degrees(np.arctan2(vectors[1, 1], vectors[0, 1])))
    width, height = 2 * np.sqrt(level_chi2 * values[::-1])
    return (float(pts[:, 0].mean()), float(pts[:, 1].mean())), float(width), float(height), angle


def plot_error_rate_changes(reports: dict[str, dict[str, Any]], path: str | os.PathLike) -> Path:
    """Per-group change of FPR (x) and FNR (y) against the dense reference, one colour per run,
    with each run's 95 % ellipse (FairGRAPE's Fig. 3)."""
    from matplotlib.patches import Ellipse

    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 5))
    for i, (name, report) in enumerate(reports.items()):
        ref = report.get("reference", {}).get("groups", {})
        pts = [(g["fpr"] - ref[k]["fpr"], g["fnr"] - ref[k]["fnr"])
               for k, g in report["groups"].items() if k in ref and "fpr" in g and "fpr" in ref[k]]
        if not pts:
            continue
        colour = f"C{i}"
        ax.scatter(*zip(*pts), color=colour, label=name)
        ellipse = confidence_ellipse(pts)
        if ellipse:
            centre, width, height, angle = ellipse
            ax.add_patch(Ellipse(centre, width, height, angle=angle, fill=False, color=colour))
    ax.axhline(0, color="grey", lw=0.5)
    ax.axvline(0, color="grey", lw=0.5)
    ax.set_xlabel("Δ FPR per group (pruned − dense)")
    ax.set_ylabel("Δ FNR per group (pruned − dense)")
    ax.legend(fontsize=8)
    ax.autoscale_view()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_group_shares(shares: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Each group's share of kept importance per layer at the last pruning step, against its
    target share (FairGRAPE's Fig. 5)."""
    plt = _plt()
    last = shares[shares["step"] == shares["step"].max()]
    layers = list(dict.fromkeys(last["layer"]))
    fig, ax = plt.subplots(figsize=(max(6, len(layers) * 0.25), 4))
    for i, (group, rows) in enumerate(last.groupby("group", sort=False)):
        rows = rows.set_index("layer").loc[layers]
        ax.plot(range(len(layers)), rows["share"], marker="o", ms=3, color=f"C{i}", label=f"{group} kept")
        ax.plot(range(len(layers)), rows["target"], ls="--", color=f"C{i}", lw=0.8)
    ax.set_xlabel("layer")
    ax.set_ylabel("share of importance")
    ax.set_title("kept share (solid) vs target share (dashed)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
