"""The one comparison writer: every ``compare`` command (vision, LM weights, heads, Diff-Pruning)
hands its rows here and gets the same files and the same printed table: ``comparison.csv``,
``comparison.md``, ``report.json``, ``report.html`` (one self-contained page) and, when the rows
carry per-group accuracies (``acc/<group>`` columns), ``group_accuracy.png``; when they carry
perplexity and a bias figure (LM and head compares), ``perplexity_bias.png``.

Rows of repeated runs (several seeds) carry a ``seed`` column; :func:`aggregate` folds them into one
row per method and setting with each figure's mean, standard deviation and count of runs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fairprune.reporting.curves import plot_sparsity_curve
from fairprune.reporting.environment import environment
from fairprune.reporting.headline import headline, rows_of_other_size
from fairprune.reporting.html import write_html
from fairprune.reporting.plots import plot_group_accuracy, plot_latency_tradeoff, plot_quality_bias
from fairprune.reporting.records import Row, as_dicts
from fairprune.reporting.report import markdown, write_json
from fairprune.reporting.terminal import print_headline
from fairprune.storage.atomic import write_csv, write_text

if TYPE_CHECKING:
    import pandas as pd

#: The column that tells repeated runs apart.
SEED = "seed"


def aggregate(rows: Sequence[dict[str, Any]], keys: Sequence[str], by: str = SEED) -> pd.DataFrame:
    """One row per distinct ``keys`` (in first-seen order) over the runs told apart by ``by``:
    ``n`` (runs), and for every numeric column ``c`` its mean ``c_mean`` and sample standard
    deviation ``c_sd`` (ddof 1; empty for a single run). Missing values are left out of a figure."""
    import pandas as pd
    table = pd.DataFrame(rows)
    keys = [k for k in keys if k in table.columns]
    values = [c for c in table.columns if c not in keys and c != by and pd.api.types.is_numeric_dtype(table[c])]
    out = []
    for key, group in table.groupby(keys, sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        row: dict[str, Any] = dict(zip(keys, key))
        row["n"] = int(group[by].nunique()) if by in group else len(group)
        for c in values:
            row[f"{c}_mean"] = group[c].mean()
            row[f"{c}_sd"] = group[c].std(ddof=1) if group[c].count() > 1 else float("nan")
        out.append(row)
    return pd.DataFrame(out)


def mean_sd_table(table: pd.DataFrame) -> pd.DataFrame:
    """An aggregated table for reading: each ``c_mean`` / ``c_sd`` pair becomes one column ``c``
    holding ``"mean ± sd"`` (the mean alone when there is no sd)."""
    import pandas as pd
    out = pd.DataFrame(index=table.index)
    for c in table.columns:
        if c.endswith("_sd") and f"{c[:-3]}_mean" in table.columns:
            continue
        if c.endswith("_mean"):
            base, sds = c[:-5], table.get(f"{c[:-5]}_sd")
            out[base] = [_mean_sd(m, None if sds is None else sds.iloc[i]) for i, m in enumerate(table[c])]
        else:
            out[c] = table[c]
    return out


def _mean_sd(mean: Any, sd: Any) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return ""
    if sd is None or (isinstance(sd, float) and math.isnan(sd)):
        return f"{mean:.4f}"
    return f"{mean:.4f} ± {sd:.4f}"


#: The figures whose confidence intervals a table shows, in this order (those the rows have).
INTERVALS = ("accuracy", "acc_gap", "degradation_std", "perplexity", "stereotype_score")
#: The figures of a paired comparison a table shows: differences, and perplexity as a ratio.
PAIRED = ("accuracy", "acc_gap", "degradation_std", "perplexity_ratio", "stereotype_score", "stereotype_bias")


def _per_axis(results: Sequence[tuple[dict[str, Any], dict[str, Any]]], columns: Sequence[str] = ()) -> list[str]:
    """The toxicity-bias figures (``bias/<axis>`` and the summed ``bias``, FASP) the results hold,
    and the lm-eval figures (``<task>/<metric>``) the table shows a column of, sorted."""
    shown = set(columns)
    return sorted({key for _, result in results for key in result
                   if key == "bias" or key.startswith("bias/") or ("/" in key and key in shown)})


def _row_results(table: pd.DataFrame, results: Sequence[tuple[dict[str, Any], dict[str, Any]]], figure: str) -> list:
    """Per table row, the result (of ``(key columns and values, result)`` pairs) whose key columns
    match the row and which has ``figure``; None where none does."""
    found: list[Any] = [None] * len(table)
    for i in range(len(table)):
        for key, result in results:
            if all(k in table.columns and table.iloc[i][k] == v for k, v in key.items()) and figure in result:
                found[i] = result[figure]
    return found


def add_intervals(table: pd.DataFrame, shown: pd.DataFrame, intervals: Sequence[tuple[dict[str, Any], dict[str, Any]]],
                  level: float = 0.95) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Each row's intervals (``(key columns and values, bootstrap result)`` pairs, matched on the
    key columns): numeric ``<figure>_ci_low`` / ``_ci_high`` columns in the table, one
    ``<figure> 95% CI`` column in the shown one."""
    table, shown = table.copy(), shown.copy()
    for figure in (*INTERVALS, *_per_axis(intervals, table.columns)):
        found = _row_results(table, intervals, figure)
        lows = [float("nan") if f is None else f[0] for f in found]
        highs = [float("nan") if f is None else f[1] for f in found]
        if all(math.isnan(v) for v in lows):
            continue
        table[f"{figure}_ci_low"], table[f"{figure}_ci_high"] = lows, highs
        shown[f"{figure} {level:.0%} CI"] = ["" if math.isnan(lo) else f"[{lo:.3f}, {hi:.3f}]" for lo, hi in zip(lows, highs)]
    groups = _row_results(table, intervals, "groups")  # per-group accuracy intervals: numeric columns only
    for name in dict.fromkeys(g for found in groups if isinstance(found, dict) for g in found):
        if f"acc/{name}" in table.columns or f"acc/{name}_mean" in table.columns:
            bounds = [found.get(name) if isinstance(found, dict) else None for found in groups]
            for j, side in enumerate(("low", "high")):
                table[f"acc/{name}_ci_{side}"] = [float("nan") if not b else b[j] for b in bounds]
    return table, shown


def add_paired(table: pd.DataFrame, shown: pd.DataFrame, paired: Sequence[tuple[dict[str, Any], dict[str, Any]]],
               baseline: str, level: float = 0.95) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Each row's paired difference against ``baseline`` (``(key columns and values,
    paired_difference / lm_paired result)`` pairs): numeric ``<figure>_diff`` / ``_diff_ci_low`` /
    ``_diff_ci_high`` columns, and one ``Δ <figure> vs <baseline>`` column shown as
    ``+0.051 [0.020, 0.083] *`` (``*``: the interval excludes 0). A ratio (``perplexity_ratio``)
    is shown as ``×1.052 [×1.031, ×1.074] *`` (``*``: the interval excludes 1)."""
    table, shown = table.copy(), shown.copy()
    for figure in (*PAIRED, *_per_axis(paired, table.columns)):
        found = _row_results(table, paired, figure)
        if all(r is None for r in found):
            continue
        ratio = any(r is not None and "ratio" in r for r in found)
        values = [[float("nan")] * 3 + [False] if r is None else
                  [r["ratio"] if ratio else r["difference"], *r["ci"], r["excludes_one"] if ratio else r["excludes_zero"]]
                  for r in found]
        for j, suffix in enumerate(("diff", "diff_ci_low", "diff_ci_high")):
            table[f"{figure}_{suffix}"] = [v[j] for v in values]
        if ratio:
            cells = ["" if math.isnan(d) else f"×{d:.3f} [×{lo:.3f}, ×{hi:.3f}]{' *' if sig else ''}" for d, lo, hi, sig in values]
            shown[f"{figure.removesuffix('_ratio')} vs {baseline}"] = cells
        else:
            shown[f"Δ {figure} vs {baseline}"] = ["" if math.isnan(d) else f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]{' *' if sig else ''}"
                                                   for d, lo, hi, sig in values]
    return table, shown


@dataclass(frozen=True)
class Statistics:
    """Each row's ``intervals`` and ``paired`` difference against ``baseline`` (:func:`add_intervals`, :func:`add_paired`)."""

    intervals: Sequence[tuple[dict[str, Any], dict[str, Any]]] = ()
    paired: Sequence[tuple[dict[str, Any], dict[str, Any]]] = ()
    baseline: str = ""


def write_comparison(rows: Sequence[Row | dict[str, Any]], output: str | os.PathLike, extra: dict[str, Any] | None = None,
                     index: str = "method", echo: bool = True, keys: Sequence[str] | None = None,
                     figures: Sequence[tuple[str | os.PathLike, str]] = (), title: str = "comparison",
                     statistics: Statistics = Statistics()) -> pd.DataFrame:
    """Write the comparison of ``rows`` (records of :mod:`~fairprune.reporting.records`, or plain
    dicts) into ``output`` and return its table; ``echo`` prints it.

    Rows with a ``seed`` column holding several seeds are repeated runs: ``comparison.csv`` holds
    one row per ``keys`` (default: every non-numeric column, e.g. method and sparsity) with
    ``n``, ``<figure>_mean`` and ``<figure>_sd`` columns, ``comparison_runs.csv`` every run, and
    the markdown / HTML tables show ``mean ± sd``. Otherwise the table is the rows themselves.

    ``statistics``: bootstrap intervals per row (:func:`add_intervals`), pooled over seeds for
    repeated runs, and each row's difference against its baseline on the same test items
    (:func:`add_paired`). ``figures`` (``(png path, caption)`` pairs, e.g. the vision compare's plots) are embedded in
    ``report.html`` with the table. ``report.json`` holds ``{"comparison": rows, "threads": torch's
    CPU threads, "environment": library versions and machine, **extra}`` (and
    ``"aggregate"`` for repeated runs); it is written last, so a folder with a ``report.json``
    holds a finished comparison."""
    import pandas as pd
    rows = as_dicts(rows)
    raw = pd.DataFrame(rows)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    repeated = SEED in raw.columns and raw[SEED].nunique() > 1
    if repeated:
        keys = list(keys or [c for c in raw.columns if c != SEED and not pd.api.types.is_numeric_dtype(raw[c])])
        table = aggregate(rows, keys)
        shown = mean_sd_table(table)
        write_csv(out / "comparison_runs.csv", raw, index=False)
    else:
        table = shown = raw
    table, shown = add_intervals(table, shown, statistics.intervals)
    table, shown = add_paired(table, shown, statistics.paired, statistics.baseline)
    write_csv(out / "comparison.csv", table, index=False)
    text = markdown(shown.set_index(index)) if index in shown.columns else markdown(shown)
    write_text(out / "comparison.md", text + "\n")
    plots = list(figures)
    accuracy = plot_group_accuracy(table, out / "group_accuracy.png", index=index)
    if accuracy is not None:
        plots.insert(0, (accuracy, "Accuracy per group" + (" (mean ± sd over seeds)" if repeated else "")))
    # Latency against accuracy where networks differ in size (at equal shapes latency differs by noise alone).
    tradeoff = plot_latency_tradeoff(table, out / "latency_tradeoff.png", index=index) \
        if rows_of_other_size(table, index) else None
    if tradeoff is not None:
        plots.insert(1, (tradeoff, "Accuracy and worst-group accuracy against measured CPU latency (ONNX Runtime, "
                                   "batch 32)" + (", mean ± sd over seeds" if repeated else "")))
    quality = plot_quality_bias(table, out / "perplexity_bias.png", index=index)  # LM and heads compares
    if quality is not None:
        bias = "stereotype score (0.5: no preference)" if any(c.startswith("stereotype_score") for c in table.columns) \
            else "summed bias over the axes"
        plots.insert(0, (quality, f"Perplexity against {bias} per method and setting; the dense model is the black star"))
    curve = plot_sparsity_curve(table, out / "accuracy_sparsity.png", index=index)  # several sparsities: first
    if curve is not None:
        plots.insert(0, (curve, "The trade-off curve: accuracy and worst-group accuracy against sparsity per method"
                                + (" (±1 sd over seeds)" if repeated and not statistics.intervals else " with 95% intervals")))
    write_html(out / "report.html", title, shown, plots, extra, numeric=table, baseline=statistics.baseline, index=index)
    import torch  # loaded already by every compare: each comparison says how many CPU threads it ran with

    payload = {"comparison": rows, "threads": torch.get_num_threads(), "environment": environment(), **(extra or {})}
    if repeated:
        payload["aggregate"] = table.to_dict(orient="records")
    write_json(out / "report.json", payload)
    if echo:  # the headline columns; every column is in comparison.md / .csv
        print(flush=True)
        print_headline(headline(table, statistics.baseline, index), title,
                       f"The full table ({len(shown.columns)} columns): {out}/comparison.md.")
        print(f"[compare] written to {out}/comparison.csv, comparison.md, report.html and report.json", flush=True)
    return table
