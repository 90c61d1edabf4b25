"""The trade-off curve of a vision compare over several sparsities: each method's test accuracy
and worst-group accuracy against its sparsity, with error bars (the rows' confidence intervals,
else ±1 sd over seeds), the dense model (and its compute-matched reference) as the points at 0."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from fairprune.reporting.plots import _column, _legend_beside, _literal_text, _plt, _save

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

#: The column holding each row's sparsity.
SPARSITY = "target_sparsity"


def _bars(table: pd.DataFrame, name: str, values: np.ndarray) -> np.ndarray:
    """Asymmetric error bars of ``name``: its interval, else its sd over seeds, else none (zeros)."""
    import numpy as np

    low, high = _column(table, f"{name}_ci_low"), _column(table, f"{name}_ci_high")
    if low is not None and high is not None:
        return np.vstack([np.clip(values - low.to_numpy(), 0, None), np.clip(high.to_numpy() - values, 0, None)])
    sd = table[f"{name}_sd"].astype(float).to_numpy() if f"{name}_sd" in table.columns else np.zeros(len(table))
    return np.vstack([sd, sd])


def _worst(table: pd.DataFrame) -> tuple[np.ndarray, np.ndarray] | None:
    """Each row's lowest group accuracy and its error bars (that group's interval or sd)."""
    import numpy as np

    groups = [c for c in table.columns if c.startswith("acc/") and not c.endswith(("_sd", "_ci_low", "_ci_high"))]
    groups = [c for c in groups if c.endswith("_mean")] or groups
    if not groups:
        return None
    values = table[groups].astype(float).to_numpy()
    at = np.nanargmin(np.where(np.isnan(values), np.inf, values), axis=1)
    worst = values[np.arange(len(table)), at]
    bars = np.zeros((2, len(table)))
    for j, column in enumerate(groups):
        rows = at == j
        bars[:, rows] = _bars(table, column.removesuffix("_mean"), values[:, j])[:, rows]
    return worst, np.nan_to_num(bars)


def several_sparsities(table: pd.DataFrame, index: str = "method") -> bool:
    """Whether some method of ``table`` was pruned to two or more sparsities (above 0)."""
    sparsity = _column(table, SPARSITY)
    if sparsity is None or index not in table.columns or _column(table, "accuracy") is None:
        return False
    pruned = table.assign(_s=sparsity)[sparsity > 0]
    return bool(len(pruned)) and int(pruned.groupby(index)["_s"].nunique().max()) >= 2


@_literal_text
def sparsity_curve_figure(table: pd.DataFrame, index: str = "method"):
    """The figure of :func:`plot_sparsity_curve`, or None for a compare at one sparsity."""
    import numpy as np

    if not several_sparsities(table, index):
        return None
    sparsity = _column(table, SPARSITY).to_numpy()
    accuracy = _column(table, "accuracy").to_numpy()
    acc_bars = np.nan_to_num(_bars(table, "accuracy", accuracy))
    worst = _worst(table)
    labels = [" ".join(str(row[c]) for c in (index, "granularity") if c in table.columns and isinstance(row[c], str) and row[c])
              for _, row in table.iterrows()]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, label in enumerate(dict.fromkeys(label for label, s in zip(labels, sparsity) if s > 0)):
        at = np.array([i for i, (name, s) in enumerate(zip(labels, sparsity)) if name == label and s > 0])
        at = at[np.argsort(sparsity[at])]
        colour = f"C{k % 10}"
        ax.errorbar(sparsity[at], accuracy[at], yerr=acc_bars[:, at], fmt="o-", color=colour, capsize=3,
                    label=f"{label}: accuracy")
        if worst is not None:
            ax.errorbar(sparsity[at], worst[0][at], yerr=worst[1][:, at], fmt="v--", color=colour, mfc="white",
                        capsize=3, label=f"{label}: worst group")
    for i in (i for i, s in enumerate(sparsity) if not s > 0):  # the dense rows, at 0
        marker = "*" if labels[i] == "dense" else "P"
        ax.errorbar(0.0, accuracy[i], yerr=acc_bars[:, [i]], fmt=marker, color="black", ms=10, capsize=3,
                    label=f"{labels[i]}: accuracy")
        if worst is not None:
            ax.errorbar(0.0, worst[0][i], yerr=worst[1][:, [i]], fmt=marker, color="grey", ms=10, mfc="white",
                        capsize=3, label=f"{labels[i]}: worst group")
    ax.set_xlabel("target sparsity")
    ax.set_ylabel("test accuracy")
    over_seeds = "accuracy_mean" in table.columns and "accuracy_ci_low" not in table.columns
    ax.set_title("accuracy (●, solid) and worst-group accuracy (▽, dashed) against sparsity"
                 + (" (±1 sd over seeds)" if over_seeds else " (95% CI)" if "accuracy_ci_low" in table.columns else ""))
    _legend_beside(ax)
    return fig


def plot_sparsity_curve(table: pd.DataFrame, path: str | os.PathLike, index: str = "method") -> Path | None:
    """Each method's accuracy and worst-group accuracy against sparsity, with error bars; None
    (and no file) unless some method ran at two or more sparsities."""
    fig = sparsity_curve_figure(table, index)
    return None if fig is None else _save(fig, path)
