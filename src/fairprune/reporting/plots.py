"""Plots of runs and comparisons (matplotlib, Agg backend): per-group error-rate changes with
95 % ellipses (FairGRAPE's Fig. 3), kept importance share per layer (Fig. 5), head scores (FASP),
accuracy per group, and perplexity against bias for LM comparisons.

Each comparison plot has a ``*_figure`` builder (the figure, for inspection) and a ``plot_*``
function that saves it; legends sit beside the axes so they never cover data.

Names (groups, methods, axes, columns) are data and are drawn as written: every figure is built and
saved with mathtext and TeX off (:func:`_literal_text`), so a ``$`` in a group name is a dollar sign,
not the start of a formula matplotlib cannot parse."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd



def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


#: Text drawn literally: no mathtext (``$...$``) and no TeX, whatever matplotlibrc says.
LITERAL_TEXT = {"text.parse_math": False, "text.usetex": False}


def _literal_text(build: Callable) -> Callable:
    """Run ``build`` (a figure builder or :func:`_save`) with :data:`LITERAL_TEXT`: every text object
    it makes (titles, axis and tick labels, legend entries, annotations, and the tick labels made
    when the figure is drawn) shows its string as it is."""

    @functools.wraps(build)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import matplotlib

        with matplotlib.rc_context(LITERAL_TEXT):
            return build(*args, **kwargs)

    return wrapper


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


def _error_rate_points(reports: dict[str, Any] | list[dict[str, Any]]) -> tuple[list[str], list[tuple[float, float]], list[tuple[float, float]]]:
    """Group names and per-group (Δ FPR, Δ FNR) against each report's dense reference; for a list
    of reports (one per seed) the per-group mean over them and its sample standard deviation (0 for
    one report)."""
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
    return list(per_group), means, sds


#: One marker per group in the error-rate chart (colour is the run), reused past the eighth group.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _legend_beside(ax, handles=None, title: str | None = None):
    """A legend right of the axes, off the data (saved with ``bbox_inches="tight"``, so the image
    grows to hold it)."""
    return ax.legend(handles=handles, title=title, fontsize=8, title_fontsize=8, loc="upper left",
                     bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


@_literal_text
def error_rate_figure(reports: dict[str, Any]):
    """The figure of :func:`plot_error_rate_changes`: colour says the run, marker the group."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Ellipse

    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    runs, markers = [], {}
    for i, (name, report) in enumerate(reports.items()):
        groups, pts, sds = _error_rate_points(report)
        if not pts:
            continue
        colour = f"C{i}"
        repeated = any(x or y for x, y in sds)
        for group, (x, y), (sx, sy) in zip(groups, pts, sds):
            marker = markers.setdefault(group, MARKERS[len(markers) % len(MARKERS)])
            if repeated:
                ax.errorbar(x, y, xerr=sx, yerr=sy, fmt=marker, color=colour, capsize=3, ms=6)
            else:
                ax.plot(x, y, marker, color=colour, ms=6)
        runs.append(Line2D([], [], color=colour, marker="o", ls="", label=f"{name} (mean ± sd, n={len(report)})"
                           if repeated else name))
        ellipse = confidence_ellipse(pts)
        if ellipse:
            centre, width, height, angle = ellipse
            ax.add_patch(Ellipse(centre, width, height, angle=angle, fill=False, color=colour))
    ax.axhline(0, color="grey", lw=0.5)
    ax.axvline(0, color="grey", lw=0.5)
    ax.set_xlabel("Δ FPR per group (pruned − dense)")
    ax.set_ylabel("Δ FNR per group (pruned − dense)")
    if runs:  # one legend, so the two lists cannot overlap however long they are
        spacer = Line2D([], [], ls="", label=" ")
        groups = [Line2D([], [], color="dimgrey", marker=m, ls="", label=g) for g, m in markers.items()]
        _legend_beside(ax, [*runs, spacer, *groups], title="colour: run, marker: group")
    ax.autoscale_view()
    return fig


def plot_error_rate_changes(reports: dict[str, Any], path: str | os.PathLike) -> Path:
    """Per-group change of FPR (x) and FNR (y) against the dense reference, one colour per run and
    one marker per group, with each run's 95 % ellipse (FairGRAPE's Fig. 3). A run given as a list
    of reports (one per seed) is drawn at each group's mean change with ±1 sd error bars."""
    return _save(error_rate_figure(reports), path)


@_literal_text
def group_shares_figure(shares: pd.DataFrame):
    """The figure of :func:`plot_group_shares`. Targets often lie on the kept shares, so they are
    drawn over them, dashed with a white casing, to stay visible."""
    from matplotlib import patheffects

    plt = _plt()
    last = shares[shares["step"] == shares["step"].max()]
    layers = list(dict.fromkeys(last["layer"]))
    fig, ax = plt.subplots(figsize=(min(10, max(6, len(layers) * 0.25)) + 2, 4))  # capped: see group_accuracy_figure
    x = range(len(layers))
    casing = [patheffects.withStroke(linewidth=3.5, foreground="white")]
    for i, (group, rows) in enumerate(last.groupby("group", sort=False)):
        stats = rows.groupby("layer", sort=False)[["share", "target"]].agg(["mean", "std"]).loc[layers]
        mean, sd = stats[("share", "mean")], stats[("share", "std")].fillna(0.0)
        ax.plot(x, mean, marker="o", ms=3, lw=1.2, color=f"C{i}", label=f"{group} kept", zorder=2)
        if (sd > 0).any():
            ax.fill_between(x, mean - sd, mean + sd, color=f"C{i}", alpha=0.2, lw=0, zorder=1)
        ax.plot(x, stats[("target", "mean")], ls=(0, (4, 2)), lw=1.6, color=f"C{i}", label=f"{group} target",
                zorder=3, path_effects=casing)
    ax.set_xlabel("layer")
    ax.set_ylabel("share of importance")
    ax.set_title("kept share (solid, dots) vs target share (dashed)")
    _legend_beside(ax)
    return fig


def plot_group_shares(shares: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Each group's share of kept importance per layer at the last pruning step, against its
    target share (FairGRAPE's Fig. 5). Rows of several seeds (a ``seed`` column) are drawn as
    their mean with a ±1 sd band."""
    return _save(group_shares_figure(shares), path)


@_literal_text
def group_accuracy_figure(table: pd.DataFrame, index: str = "method"):
    """The figure of :func:`plot_group_accuracy`, or None without per-group accuracy."""
    import numpy as np

    means = [c for c in table.columns if c.startswith("acc/") and not c.endswith(("_sd", "_ci_low", "_ci_high"))]
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
    # Capped: the page scales the image to its width, and a wider one would shrink its text.
    fig, ax = plt.subplots(figsize=(min(12, max(6, 1.2 * len(labels) * max(1, len(groups)) / 3)) + 2, 4))
    width = 0.8 / len(groups)
    top = 1.0
    for j, (group, column) in enumerate(zip(groups, means)):
        values = np.nan_to_num(table[column].astype(float).to_numpy())
        sd_column = column[:-5] + "_sd" if column.endswith("_mean") else None
        errors = table[sd_column].astype(float).fillna(0.0).to_numpy() if sd_column in table else None
        top = max(top, float((values + (0 if errors is None else errors)).max()))
        ax.bar(np.arange(len(labels)) + (j - (len(groups) - 1) / 2) * width, values, width,
               yerr=errors, capsize=2, color=f"C{j}", label=group)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, top + 0.05)  # an error bar past 1.0 is drawn whole, not cut at the frame
    ax.set_yticks(np.linspace(0, 1, 6))
    ax.set_title("accuracy per group" + (" (mean ± sd)" if means[0].endswith("_mean") else ""))
    _legend_beside(ax, title="group")
    return fig


def plot_group_accuracy(table: pd.DataFrame, path: str | os.PathLike, index: str = "method") -> Path | None:
    """Accuracy per group for every row of a comparison table (bars), with ±1 sd error bars when
    the table is aggregated over seeds (``acc/<group>_mean`` / ``_sd`` columns). None (and no
    file) when the table has no per-group accuracy."""
    fig = group_accuracy_figure(table, index)
    return None if fig is None else _save(fig, path)


LATENCY = "ms/img b32 (ort)"  # the deploy figure the trade-off plot reads (ONNX Runtime, batch 32)


@_literal_text
def latency_tradeoff_figure(table: pd.DataFrame, index: str = "method", latency: str = LATENCY):
    """The figure of :func:`plot_latency_tradeoff`, or None without latency and accuracy."""
    import numpy as np

    x, accuracy = _column(table, latency), _column(table, "accuracy")
    groups = [c for c in table.columns if c.startswith("acc/") and not c.endswith(("_sd", "_ci_low", "_ci_high"))]
    groups = [c for c in groups if c.endswith("_mean")] or groups
    if x is None or accuracy is None or x.isna().all() or not groups:
        return None
    per_group = table[groups].astype(float).to_numpy()
    worst_at = np.nanargmin(np.where(np.isnan(per_group), np.inf, per_group), axis=1)
    worst = per_group[np.arange(len(table)), worst_at]

    def sd(column: str) -> np.ndarray:
        name = column.removesuffix("_mean") + "_sd"
        return table[name].astype(float).fillna(0.0).to_numpy() if name in table.columns else np.zeros(len(table))

    worst_sd = np.array([sd(groups[j])[i] for i, j in enumerate(worst_at)])
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (_, row) in enumerate(table.iterrows()):
        label = " ".join(str(row[c]) for c in (index, "granularity") if c in table.columns and row[c] == row[c])
        colour = f"C{i % 10}"
        ax.errorbar(x.iloc[i], accuracy.iloc[i], xerr=sd(latency)[i] if f"{latency}_mean" in table else None,
                    yerr=sd("accuracy_mean")[i] if "accuracy_mean" in table else None, fmt="o", color=colour,
                    capsize=3, label=f"{label}: accuracy")
        ax.errorbar(x.iloc[i], worst[i], yerr=worst_sd[i], fmt="v", color=colour, capsize=3, mfc="white",
                    label=f"{label}: worst group ({groups[worst_at[i]].removeprefix('acc/').removesuffix('_mean')})")
    ax.set_xlabel(f"CPU latency, {latency} (lower is faster)")
    ax.set_ylabel("test accuracy")
    ax.set_title("accuracy (●) and worst-group accuracy (▽) against latency" +
                 (" (mean ± sd over seeds)" if "accuracy_mean" in table else ""))
    _legend_beside(ax)
    return fig


def plot_latency_tradeoff(table: pd.DataFrame, path: str | os.PathLike, index: str = "method") -> Path | None:
    """Each row's accuracy and worst-group accuracy against its measured CPU latency (ONNX
    Runtime, batch 32: the deploy figures), ±1 sd error bars over seeds when the table is
    aggregated. None (and no file) when the table has no latency column."""
    fig = latency_tradeoff_figure(table, index)
    return None if fig is None else _save(fig, path)


def _column(table: pd.DataFrame, name: str) -> pd.Series | None:
    """A figure's column, plain or aggregated over seeds (``<name>_mean``), as floats."""
    import pandas as pd
    for column in (name, f"{name}_mean"):
        if column in table.columns:
            return pd.to_numeric(table[column], errors="coerce")
    return None


def _interval(table: pd.DataFrame, name: str, values: pd.Series):
    """Asymmetric error bars from ``<name>_ci_low`` / ``_ci_high`` columns, or None without them."""
    import numpy as np

    low, high = _column(table, f"{name}_ci_low"), _column(table, f"{name}_ci_high")
    if low is None or high is None or (low.isna() & high.isna()).all():
        return None
    return np.vstack([(values - low).clip(lower=0).fillna(0), (high - values).clip(lower=0).fillna(0)])


@_literal_text
def quality_bias_figure(table: pd.DataFrame, index: str = "method"):
    """The figure of :func:`plot_quality_bias`, or None when the table has no perplexity or no
    bias figure (not an LM comparison)."""
    import numpy as np
    import pandas as pd
    from matplotlib.lines import Line2D

    x = _column(table, "perplexity")
    y = _column(table, "stereotype_score")
    ylabel, ci_name = "stereotype score (0.5: no preference)", "stereotype_score"
    if y is None:
        axes = [c for c in table.columns if c.startswith("bias/") and not c.endswith(("_sd", "_ci_low", "_ci_high"))]
        if axes:
            y = sum(pd.to_numeric(table[c], errors="coerce") for c in axes)
            names = [c[5:-5] if c.endswith("_mean") else c[5:] for c in axes]
            # One axis: its interval over prompts; a sum of axes has none (the sum's is not the sum of theirs).
            ylabel, ci_name = ((f"bias ({names[0]})", f"bias/{names[0]}") if len(names) == 1
                               else (f"summed bias ({' + '.join(names)})", "bias"))
    if x is None or y is None or table.empty or x.isna().all():
        return None
    methods = table[index].astype(str) if index in table.columns else pd.Series([""] * len(table), index=table.index)
    setting = next((c for c in ("sparsity", "target_sparsity", "alpha") if c in table.columns), None)
    xerr, yerr = _interval(table, "perplexity", x), _interval(table, ci_name, y)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    handles = []
    dense = methods == "dense"
    for i, method in enumerate(dict.fromkeys(methods[~dense])):
        rows = np.flatnonzero((methods == method).to_numpy())
        colour, marker = f"C{i}", MARKERS[i % len(MARKERS)]  # a marker too: methods may land on one point
        ax.plot(x.iloc[rows], y.iloc[rows], "-", color=colour, lw=0.8, alpha=0.6)
        if xerr is not None or yerr is not None:
            ax.errorbar(x.iloc[rows], y.iloc[rows], xerr=None if xerr is None else xerr[:, rows],
                        yerr=None if yerr is None else yerr[:, rows], fmt=marker, color=colour, capsize=3, ms=7,
                        mfc="none", mew=1.5)
        else:
            ax.plot(x.iloc[rows], y.iloc[rows], marker, color=colour, ms=7, mfc="none", mew=1.5)
        handles.append(Line2D([], [], color=colour, marker=marker, ls="", mfc="none", mew=1.5, label=method))
    for k in np.flatnonzero(dense.to_numpy()):
        kw = {"xerr": None if xerr is None else xerr[:, [k]], "yerr": None if yerr is None else yerr[:, [k]]}
        if kw["xerr"] is not None or kw["yerr"] is not None:
            ax.errorbar([x.iloc[k]], [y.iloc[k]], fmt="none", color="black", capsize=3, **kw)
        ax.plot(x.iloc[k], y.iloc[k], "*", color="black", ms=14, zorder=4)
        ax.annotate("dense", (x.iloc[k], y.iloc[k]), xytext=(7, -10), textcoords="offset points", fontsize=8)
    if dense.any():
        handles.insert(0, Line2D([], [], color="black", marker="*", ms=12, ls="", label="dense"))
    if setting is not None:
        for k in range(len(table)):
            value = table[setting].iloc[k]
            if dense.iloc[k] or value is None or value != value:
                continue
            text = f"{value:g}" if isinstance(value, (int, float)) else str(value)
            ax.annotate(f"α={text}" if setting == "alpha" else text, (x.iloc[k], y.iloc[k]), xytext=(5, 4),
                        textcoords="offset points", fontsize=8)
    if ci_name == "stereotype_score":
        ax.axhline(0.5, color="grey", lw=0.8, ls=":")
    finite = x[np.isfinite(x) & (x > 0)]
    if len(finite) and finite.max() / finite.min() > 5:
        ax.set_xscale("log")  # a pruned model's perplexity can be many times the dense one's
    ax.set_xlabel("perplexity (lower is better)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"perplexity against {'stereotype score' if ci_name == 'stereotype_score' else 'bias'}"
                 + (f", labelled by {setting}" if setting else ""))
    _legend_beside(ax, handles, title=index)
    return fig


def plot_quality_bias(table: pd.DataFrame, path: str | os.PathLike, index: str = "method") -> Path | None:
    """Perplexity (x) against stereotype score (LM weight pruning) or summed bias over the
    ``bias/<axis>`` columns (head pruning) (y), one colour per method, each point labelled with its
    sparsity (or α), the dense model a black star; error bars where the table carries
    ``<figure>_ci_low`` / ``_ci_high`` columns. None (and no file) without those figures."""
    fig = quality_bias_figure(table, index)
    return None if fig is None else _save(fig, path)


@_literal_text
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


@_literal_text
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


@_literal_text
def _save(fig, path: str | os.PathLike) -> Path:
    """Write ``fig`` (tight layout, 120 dpi), creating the folder, and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # legends beside the axes are kept in the image
    _plt().close(fig)
    return path
