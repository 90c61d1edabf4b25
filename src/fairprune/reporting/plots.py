"""Plots of runs and comparisons (matplotlib, Agg backend): per-group error-rate changes with
95 % ellipses (FairGRAPE's Fig. 3), kept importance share per layer (Fig. 5), head scores (FASP)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import pandas as pd


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


def plot_head_heatmap(impact, axes: Sequence[str], protected: Sequence[tuple[int, int]] = (),
                      removed: Sequence[tuple[int, int]] = (), path: str | os.PathLike = "heads_heatmap.png") -> Path:
    """Layer × head map of each head's bias impact, ``impact[layer, head]`` = bias with the head
    removed − unpruned bias, summed over ``axes`` (FASP's head scores).

    Blue heads lower the bias when removed, red ones raise it; ``P`` marks protected heads and
    ``×`` removed ones (``(layer, head)`` pairs).
    """
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    plt = _plt()
    grid = np.asarray(impact, dtype=float)
    layers, n = grid.shape
    span = max(float(abs(grid).max()), 1e-12)
    fig, ax = plt.subplots(figsize=(1 + 0.45 * n, 1 + 0.4 * layers))
    image = ax.imshow(grid, cmap="RdBu_r", norm=TwoSlopeNorm(0.0, -span, span), aspect="auto")
    for marks, symbol in ((protected, "P"), (removed, "×")):
        for layer, head in marks:
            ax.text(head, layer, symbol, ha="center", va="center", fontsize=8)
    ax.set(xlabel="head", ylabel="layer", title=f"bias impact of removing each head ({' + '.join(axes)})")
    fig.colorbar(image, ax=ax, label="Δ bias")
    return _save(fig, path)


def plot_axis_correlation(bias: pd.DataFrame, path: str | os.PathLike = "axis_correlation.png") -> Path:
    """Pearson correlation between axes of the heads' bias scores (``bias``: one row per head,
    one column per axis)."""
    plt = _plt()
    corr = bias.corr(method="pearson")
    names = [str(c) for c in bias.columns]
    fig, ax = plt.subplots(figsize=(1.5 + 1.1 * len(names), 1 + 1.0 * len(names)))
    image = ax.imshow(corr.to_numpy(), cmap="coolwarm", vmin=-1, vmax=1)
    for i in range(len(names)):
        for j in range(len(names)):
            ax.text(j, i, f"{corr.iat[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
    ax.set_yticks(range(len(names)), names)
    ax.set_title("head bias scores: Pearson r between axes")
    fig.colorbar(image, ax=ax)
    return _save(fig, path)


def _save(fig, path: str | os.PathLike) -> Path:
    """Write ``fig`` (tight layout, 120 dpi), creating the folder, and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path
