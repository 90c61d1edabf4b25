"""The headline of a comparison: the few columns methods are compared by, chosen from the
comparison's numeric table, for the printed table (:mod:`~fairprune.reporting.terminal`) and the
first table of ``report.html``. Every other column stays in ``comparison.csv`` / ``.md``.

- A vision (or Diff-Pruning) comparison: method, sparsity, accuracy with its interval, the worst
  group's accuracy (and which group), the accuracy gap, the degradation std and the paired
  difference of accuracy against the baseline with its interval.
- An LM (weights or heads) comparison: method, sparsity (or α), perplexity with its interval, the
  stereotype score (or the summed toxicity bias), up to three task figures and the perplexity
  ratio against the baseline with its interval (else the paired difference of the stereotype
  score). The task figures are DTO and the abstention and knowledge figures it was computed from
  (:func:`fairprune.reporting.dto.choose`: the first of each list that the rows hold
  validly), each accuracy headed by its chance level. A value its run marks invalid
  (``<figure>_invalid``: one letter takes 90 % of a letter task's answers, or the task is at or
  below chance within its interval) is shown struck out with ``✗`` and is left out of DTO; a
  value uniform answers would match or beat is shown with ``≤``.

The columns are read by name from the table :func:`~fairprune.reporting.compare.write_comparison`
writes (plain figures, or ``<figure>_mean`` / ``_sd`` over seeds, ``<figure>_ci_low`` / ``_ci_high``
and ``<figure>_diff`` / ``_diff_ci_low`` / ``_diff_ci_high``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fairprune.reporting.records import CHANCE, INVALID

if TYPE_CHECKING:
    import pandas as pd

#: Task figures a headline shows, with short names: DTO and the figures it reads first, then the rest
#: in this order (the first three the rows have, one per kind of figure).
TASKS = {"dto": "DTO",
         "bbq_ambig_cloze3/accuracy_amb": "BBQ abstain cloze-3",
         "bbq_ambig_letter_balanced/accuracy_amb": "BBQ abstain letter-balanced",
         "bbq_ambig_letter/accuracy_amb": "BBQ abstain letter", "bbq_ambig/accuracy_amb": "BBQ abstain cloze-12",
         "mmlu/acc": "MMLU", "hellaswag/acc_norm": "HellaSwag",
         "bbq_ambig_cloze3/amb_bias_score": "BBQ bias cloze-3", "bbq_ambig_letter/amb_bias_score": "BBQ bias letter",
         "bbq_ambig/amb_bias_score": "BBQ bias cloze-12", "crows_pairs_english/pct_stereotype": "CrowS %stereo"}
#: What kind of figure each is: a headline shows one of each kind.
KINDS = {**{k: "abstention" for k in TASKS if k.endswith("/accuracy_amb")}, "mmlu/acc": "knowledge",
         "hellaswag/acc_norm": "knowledge", **{k: "bias" for k in TASKS if k.endswith("/amb_bias_score")}}
#: A value its run marks invalid, and a value uniform answers would match or beat.
INVALID_MARK, CHANCE_MARK = "✗", "≤"
#: The columns that tell rows apart as a setting, the first the table has (shown as "sparsity" / "α").
SETTINGS = (("target_sparsity", "sparsity"), ("sparsity", "sparsity"), ("alpha", "α"))
#: The most task figures a headline shows.
MAX_TASKS = 3


@dataclass(frozen=True)
class Cell:
    """One value as shown: ``value``, its ``interval`` (``[0.80, 0.87]``), a ``note`` (which
    group), ``strong`` when a paired interval excludes no change (printed with ``*``), and
    ``mark``: :data:`INVALID_MARK` for a value its run marks invalid (``why`` says why), or
    :data:`CHANCE_MARK` for one at or below its chance level."""

    value: str = ""
    interval: str = ""
    note: str = ""
    strong: bool = False
    mark: str = ""
    why: str = ""

    @property
    def invalid(self) -> bool:
        return self.mark == INVALID_MARK

    def text(self) -> str:
        """One line: ``0.836 [0.80, 0.87]``, ``+0.051 [+0.02, +0.08] *``, ``0.712 Indian``, ``0.350 ✗``."""
        parts = [self.value, self.mark, self.interval, self.note, "*" if self.strong else ""]
        return " ".join(p for p in parts if p)

    def lines(self) -> list[str]:
        """Two lines where there is an interval: the value (and ``*``), the interval under it."""
        if not self.interval:
            return [self.text()]
        return [" ".join(p for p in (self.value, self.mark, self.note, "*" if self.strong else "") if p),
                self.interval]


@dataclass(frozen=True)
class Column:
    """A headline column: ``head`` (short, for the terminal), ``title`` and ``under`` (the page's
    header and the note beneath it), whether it holds numbers (right-aligned) and its cells."""

    key: str
    head: str
    title: str
    cells: list[Cell] = field(default_factory=list)
    under: str = ""
    numeric: bool = True
    chance: float | None = None  # a task figure's chance level, where every row has the same


def _series(table: pd.DataFrame, name: str) -> pd.Series | None:
    """A figure's values, plain or their means over seeds, as floats; None when absent."""
    import pandas as pd

    for column in (name, f"{name}_mean"):
        if column in table.columns:
            return pd.to_numeric(table[column], errors="coerce")
    return None


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def number(value: float, digits: int = 3) -> str:
    """A figure with ``digits`` decimals below 10 and one fewer per further digit before the point
    (perplexities run to thousands): ``0.836``, ``31.20``, ``468.0``, ``1234``."""
    whole = len(str(int(abs(value)))) if math.isfinite(value) else 1
    return f"{value:.{max(0, digits - whole + 1)}f}"


def figure_column(table: pd.DataFrame, name: str, head: str, title: str, interval: bool = True,
                  fmt: Callable[[float], str] = number) -> Column | None:
    """A figure's column: value (written by ``fmt``), and its interval (two decimals) or, over
    seeds, ``± sd``."""
    values = _series(table, name)
    if values is None or values.isna().all():
        return None
    low, high = _series(table, f"{name}_ci_low"), _series(table, f"{name}_ci_high")
    sd = table[f"{name}_sd"] if f"{name}_sd" in table.columns else None
    cells = []
    for i, value in enumerate(values):
        if _missing(value):
            cells.append(Cell())
            continue
        span = ""
        if interval and low is not None and high is not None and not (_missing(low.iloc[i]) or _missing(high.iloc[i])):
            span = f"[{number(low.iloc[i], 2)}, {number(high.iloc[i], 2)}]"
        elif interval and sd is not None and not _missing(sd.iloc[i]):
            span = f"± {number(float(sd.iloc[i]), 3)}"
        cells.append(Cell(fmt(float(value)), span))
    under = "95% CI" if interval and low is not None else ("± sd" if interval and sd is not None else "")
    return Column(name, f"{head} [{under}]" if under == "95% CI" else f"{head} {under}".strip(), title, cells, under)


def _worst_group(table: pd.DataFrame) -> Column | None:
    """The lowest group accuracy of each row, with the group's name."""
    groups = [c for c in table.columns if c.startswith("acc/") and not c.endswith(("_sd", "_ci_low", "_ci_high"))]
    groups = [c for c in groups if c.endswith("_mean")] or groups
    if not groups:
        return None
    cells = []
    for _, row in table[groups].apply(lambda s: s.astype(float)).iterrows():
        present = row.dropna()
        if present.empty:
            cells.append(Cell())
            continue
        name = present.idxmin()
        cells.append(Cell(number(float(present[name])), note=name.removeprefix("acc/").removesuffix("_mean")))
    return Column("worst_group", "worst group", "worst group", cells, "accuracy (group)")


def _paired(table: pd.DataFrame, figure: str, baseline: str, head: str) -> Column | None:
    """The paired difference of ``figure`` against the baseline (a ratio for ``*_ratio``)."""
    if f"{figure}_diff" not in table.columns:
        return None
    ratio = figure.endswith("_ratio")
    cells = []
    for diff, low, high in zip(*(_floats(table[f"{figure}_{s}"]) for s in ("diff", "diff_ci_low", "diff_ci_high"))):
        if _missing(diff):
            cells.append(Cell())
        elif ratio:
            cells.append(Cell(f"×{diff:.3f}", f"[×{low:.2f}, ×{high:.2f}]", strong=bool(low > 1 or high < 1)))
        else:
            cells.append(Cell(f"{diff:+.3f}", f"[{low:+.2f}, {high:+.2f}]", strong=bool(low > 0 or high < 0)))
    against = f" vs {baseline}" if baseline else ""
    title = f"{figure.removesuffix('_ratio')} ×{against}" if ratio else f"Δ {figure}{against}"
    return Column(f"{figure}_diff", f"{head}{against}", title, cells, "paired, 95% CI")


def _floats(values: pd.Series) -> list[float]:
    """The values as floats (NaN where missing)."""
    import pandas as pd

    return [float(v) for v in pd.to_numeric(values, errors="coerce")]


def _keys(table: pd.DataFrame, index: str) -> list[Column]:
    """The row's name (with its granularity, where the comparison has one) and its setting."""
    columns = []
    if index in table.columns:
        names = [str(v) for v in table[index]]
        if "granularity" in table.columns:
            names = [f"{n} ({g})" if isinstance(g, str) and g else n for n, g in zip(names, table["granularity"])]
        columns.append(Column(index, index, index, [Cell(n) for n in names], numeric=False))
    for name, head in SETTINGS:
        if name in table.columns:
            cells = [Cell() if _missing(v) else Cell(f"{v:g}" if isinstance(v, (int, float)) else str(v)) for v in table[name]]
            columns.append(Column(name, head, head, cells))
            break
    return columns


def task_column(table: pd.DataFrame, name: str, head: str, fmt: Callable[[float], str] = number) -> Column | None:
    """A task figure's column: each value with :data:`INVALID_MARK` where its run marks it invalid
    (``<name>_invalid``) or :data:`CHANCE_MARK` where it is at or below its chance level
    (``<name>_chance``); the chance level heads the column when every row has the same one. Values
    and chance levels are written by ``fmt``."""
    column = figure_column(table, name, head, head, interval=False, fmt=fmt)
    if column is None:
        return None
    values = _series(table, name)
    chance = _series(table, f"{name}{CHANCE}")
    reasons = table[f"{name}{INVALID}"] if f"{name}{INVALID}" in table.columns else None
    cells = []
    for i, cell in enumerate(column.cells):
        why = reasons.iloc[i] if reasons is not None else None
        level = None if chance is None or _missing(chance.iloc[i]) else float(chance.iloc[i])
        if cell.value and isinstance(why, str) and why:
            cells.append(Cell(cell.value, mark=INVALID_MARK, why=why))
        elif cell.value and level is not None and float(values.iloc[i]) <= level + 1e-9:
            cells.append(Cell(cell.value, mark=CHANCE_MARK, why=f"at or below its chance level {fmt(level)}"))
        else:
            cells.append(cell)
    levels = {round(float(v), 9) for v in (chance if chance is not None else []) if not _missing(v)}
    if len(levels) == 1:
        level = levels.pop()
        return Column(name, f"{head} (chance {fmt(level)})", head, cells, f"chance {fmt(level)}", chance=level)
    return Column(name, head, head, cells)


def dto_column(table: pd.DataFrame) -> Column | None:
    """DTO's column: the rows without it (a figure missing or invalid) show ``–``; the note under
    the header names the figures it was computed from."""
    column = figure_column(table, "dto", "DTO", "DTO", interval=False)
    if column is None:
        return None
    used = dto_figures(table)
    cells = [cell if cell.value else Cell("–", why="a figure it reads is missing or invalid") for cell in column.cells]
    return Column("dto", "DTO", "DTO", cells, "from " + " and ".join(used) if len(used) == 2 else "")


def dto_figures(table: pd.DataFrame) -> list[str]:
    """The knowledge and abstention figures DTO reads in this table (:func:`fairprune.reporting.dto.choose`)."""
    from fairprune.reporting.dto import ABSTENTION, KNOWLEDGE, choose

    rows = table.to_dict(orient="records")
    return [f for f in (choose(rows, KNOWLEDGE), choose(rows, ABSTENTION)) if f]


def _tasks(table: pd.DataFrame) -> list[Column]:
    """Up to :data:`MAX_TASKS` task figures, one of each kind: DTO, then the abstention and
    knowledge figures it reads (the first of each the rows hold validly), then those of
    :data:`TASKS` in order, then any other."""
    from fairprune.reporting.dto import ABSTENTION, KNOWLEDGE, choose

    shown: list[Column] = []
    kinds: set[str] = set()
    rows = table.to_dict(orient="records")
    others = [c for c in table.columns if "/" in c and not c.startswith(("acc/", "bias/", DEPLOY_PREFIX)) and not c.endswith(
        ("_sd", "_ci_low", "_ci_high", "_diff", "_diff_ci_low", "_diff_ci_high", CHANCE, INVALID))]
    first = [choose(rows, ABSTENTION), choose(rows, KNOWLEDGE)]
    for name in ["dto", *filter(None, first), *TASKS, *others]:
        name = name.removesuffix("_mean")
        kind = KINDS.get(name, name)
        if len(shown) == MAX_TASKS or kind in kinds:
            continue
        column = dto_column(table) if name == "dto" else task_column(table, name, TASKS.get(name, name))
        if column is not None:
            shown.append(column)
            kinds.add(kind)
    return shown


def headline(table: pd.DataFrame, baseline: str = "", index: str = "method") -> list[Column]:
    """The headline columns of a comparison's numeric table (see the module's docstring)."""
    columns = _keys(table, index)
    if _series(table, "perplexity") is not None:  # a language-model comparison
        bias = [c for c in table.columns if c.startswith("bias/") and not c.endswith(("_sd", "_ci_low", "_ci_high"))]
        figures = [figure_column(table, "perplexity", "ppl", "perplexity"),
                   figure_column(table, "stereotype_score", "stereo", "stereotype score", interval=False)]
        if bias and figures[1] is None:
            total = table[bias].apply(lambda s: s.astype(float)).sum(axis=1, min_count=1)
            figures[1] = figure_column(table.assign(bias_total=total), "bias_total", "bias Σ", "bias (summed)", interval=False)
        figures += _tasks(table)
        figures.append(_paired(table, "perplexity_ratio", baseline, "ppl ×")
                       or _paired(table, "stereotype_score", baseline, "Δ stereo"))
    elif _series(table, "accuracy") is not None:  # a vision or Diff-Pruning comparison
        figures = [figure_column(table, "accuracy", "acc", "accuracy"), _worst_group(table),
                   figure_column(table, "acc_gap", "gap", "accuracy gap", interval=False),
                   figure_column(table, "degradation_std", "deg. std", "degradation std", interval=False),
                   _paired(table, "accuracy", baseline, "Δ acc")]
    else:  # anything else: its first few numeric figures
        import pandas as pd

        numeric = [c for c in table.columns if c not in {k.key for k in columns} and pd.api.types.is_numeric_dtype(table[c])]
        figures = [figure_column(table, c, c, c, interval=False) for c in numeric[:5]]
    return columns + [c for c in figures if c is not None]


#: Columns of deploy figures: the network's size (these decide whether rows differ) and its speed.
SIZES = ("params (M)", "MB", "MMACs", "weights_mb")
DEPLOY_PREFIX = "ms/img"


def deploy_columns(table: pd.DataFrame) -> list[str]:
    """The table's deploy columns (size, MACs, latency; means over seeds where aggregated)."""
    names = [c for c in table.columns if c.removesuffix("_mean") in SIZES or c.startswith(DEPLOY_PREFIX)]
    return [c for c in names if not c.endswith(("_sd", "_ci_low", "_ci_high"))]


def rows_of_other_size(table: pd.DataFrame, index: str = "method") -> list[int]:
    """The positions of the rows whose network size (parameters, file, MACs) differs from the
    dense model's (the ``dense`` row, else the first): channel pruning and compressed formats.
    Weight pruning keeps the dense shapes (zeros are stored), so its rows have the dense figures
    and none is listed; latency alone (timing noise at equal shapes) does not count."""
    sizes = [c for c in table.columns if c.removesuffix("_mean") in SIZES and not c.endswith("_sd")]
    if not sizes or table.empty:
        return []
    values = table[sizes].apply(lambda s: s.astype(float))
    dense = [i for i, v in enumerate(table[index]) if v == "dense"] if index in table.columns else []
    reference = values.iloc[dense[0] if dense else 0]
    out = []
    for i in range(len(table)):
        row = values.iloc[i]
        if any(not (_missing(a) or _missing(b)) and not math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
               for a, b in zip(row, reference)):
            out.append(i)
    return out
