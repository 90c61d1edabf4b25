"""Plots of runs and comparisons (matplotlib, Agg backend): per-group error-rate changes with
95 % ellipses (FairGRAPE's Fig. 3), kept importance share per layer (Fig. 5), head scores (FASP)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


def _error_rate_points(reports: dict[str, Any] | list[dict[str, Any]]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Per-group (Δ FPR, Δ FNR) against each report's dense reference; for a list of reports (one
    per seed) the per-group mean over them and its sample standard deviation (0 for one report)."""
    import numpy as np

    per_group: dict[str, list[tuple[float, float]]] = {}
    for report in reports if isinstance(reports, list) else [reports]:
        ref = report.get("reference", {}).get("groups", {})
        for k, g in report["groups"].items():
            if k in ref and g.get("fpr") is not None and ref[k].get("fpr") is not None:
                per_group.setdefault(k, []).append((g["fpr"] - ref[k]["fpr"], g["fnr"] - ref[k]["fnr"]))
    means, sds = [], []
    for values in per_group.values():
        arr = np.asarray(values, dtype=float)
        means.append(tuple(arr.mean(0)))
        sds.append(tuple(arr.std(0, ddof=1)) if len(arr) > 1 else (0.0, 0.0))
    return means, sds


def plot_error_rate_changes(reports: dict[str, Any], path: str | os.PathLike) -> Path:
    """Per-group change of FPR (x) and FNR (y) against the dense reference, one colour per run,
    with each run's 95 % ellipse (FairGRAPE's Fig. 3). A run given as a list of reports (one per
    seed) is drawn at each group's mean change with ±1 sd error bars."""
    from matplotlib.patches import Ellipse

    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 5))
    for i, (name, report) in enumerate(reports.items()):
        pts, sds = _error_rate_points(report)
        if not pts:
            continue
        colour = f"C{i}"
        if any(x or y for x, y in sds):
            ax.errorbar(*zip(*pts), xerr=[s[0] for s in sds], yerr=[s[1] for s in sds], fmt="o", color=colour,
                        capsize=3, label=f"{name} (mean ± sd, n={len(report)})")
        else:
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
    return _save(fig, path)


def plot_group_shares(shares: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Each group's share of kept importance per layer at the last pruning step, against its
    target share (FairGRAPE's Fig. 5). Rows of several seeds (a ``seed`` column) are drawn as
    their mean with a ±1 sd band."""
    plt = _plt()
    last = shares[shares["step"] == shares["step"].max()]
    layers = list(dict.fromkeys(last["layer"]))
    fig, ax = plt.subplots(figsize=(max(6, len(layers) * 0.25), 4))
    x = range(len(layers))
    for i, (group, rows) in enumerate(last.groupby("group", sort=False)):
        stats = rows.groupby("layer", sort=False)[["share", "target"]].agg(["mean", "std"]).loc[layers]
        mean, sd = stats[("share", "mean")], stats[("share", "std")].fillna(0.0)
        ax.plot(x, mean, marker="o", ms=3, color=f"C{i}", label=f"{group} kept")
        if (sd > 0).any():
            ax.fill_between(x, mean - sd, mean + sd, color=f"C{i}", alpha=0.2, lw=0)
        ax.plot(x, stats[("target", "mean")], ls="--", color=f"C{i}", lw=0.8)
    ax.set_xlabel("layer")
    ax.set_ylabel("share of importance")
    ax.set_title("kept share (solid) vs target share (dashed)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_group_accuracy(table: pd.DataFrame, path: str | os.PathLike, index: str = "method") -> Path | None:
    """Accuracy per group for every row of a comparison table (bars), with ±1 sd error bars when
    the table is aggregated over seeds (``acc/<group>_mean`` / ``_sd`` columns). None (and no
    file) when the table has no per-group accuracy."""
    import numpy as np

    means = [c for c in table.columns if c.startswith("acc/") and not c.endswith("_sd")]
    means = [c for c in means if c.endswith("_mean")] or [c for c in means if not c.endswith("_mean")]
    if not means or table.empty:
        return None
    groups = [c[4:-5] if c.endswith("_mean") else c[4:] for c in means]
    labels = []
    for _, row in table.iterrows():
        label = str(row.get(index, ""))
        sparsity = row.get("target_sparsity")
        if isinstance(sparsity, (int, float)) and sparsity == sparsity and sparsity > 0:
            label += f" {sparsity:g}"
        labels.append(label)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels) * max(1, len(groups)) / 3), 4))
    width = 0.8 / len(groups)
    for j, (group, column) in enumerate(zip(groups, means)):
        values = table[column].astype(float).to_numpy()
        sd_column = column[:-5] + "_sd" if column.endswith("_mean") else None
        errors = table[sd_column].astype(float).fillna(0.0).to_numpy() if sd_column in table else None
        ax.bar(np.arange(len(labels)) + (j - (len(groups) - 1) / 2) * width, np.nan_to_num(values), width,
               yerr=errors, capsize=2, color=f"C{j}", label=group)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("accuracy per group" + (" (mean ± sd)" if means[0].endswith("_mean") else ""))
    ax.legend(fontsize=7, ncol=min(len(groups), 4))
    return _save(fig, path)


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
