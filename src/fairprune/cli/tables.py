"""``python -m fairprune.cli.tables``: write the demos' tables into the pages that show them.

A table on a page is a marked block (:mod:`fairprune.reporting.marked_block`) that this command
writes from the files a demo wrote, so the pages show what the demo produced, not a hand copy:

- ``demo-table``: ``make demo``'s comparison (``runs/demo/compare/comparison.csv``) in
  ``README.md``, ``docs/getting-started.md``, ``docs/reading-a-comparison.md`` and ``docs/demo.md``;
- ``demo-seed1-table``, ``demo-seed2-table``, ``demo-seeds``: the same demo from seeds 1 and 2
  (``python -m fairprune.cli.demo --seed N``) and a line per seed, in ``docs/demo.md``;
- ``demo-lm-table``: ``make demo-lm``'s headline (``runs/demo_lm/comparison.csv``), the table it
  printed, in ``docs/guides/lm.md``;
- ``debias-paper-table``: the Debias-SparseGPT protocol's comparison
  (``configs/compare/debias_paper.yaml``, ``runs/debias_paper``) in the paper's table layout, in
  ``docs/reproducing.md``.

Another table is one :data:`BLOCKS` entry: its folders, a function from them to Markdown, its pages.

``python -m fairprune.cli.tables`` (``make readme-table``) rewrites every block whose demo has run
(a block named on the command line must have run); ``--check`` changes nothing and exits with status 1 and one line per block that differs on a page
from what its demo wrote, or when no demo has run at all (a check that compared nothing fails) (``.ci/run`` runs it after ``make demo``). Names select blocks
(``python -m fairprune.cli.tables --check demo-table``).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fairprune.errors import UserError

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Block:
    """A generated table: the folders a demo writes (relative to the checkout), how they become
    Markdown, the pages that show it and the command that writes the folders."""

    sources: tuple[str, ...]
    render: Callable[[list[Path]], str]
    pages: tuple[str, ...]
    command: str


def _figure(value: float, digits: int = 3, sign: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def _with_interval(row, name: str, sign: bool = False, mark: bool = False) -> str:
    """``0.912 [0.884, 0.937]`` from a figure and its ``_ci_low`` / ``_ci_high`` columns; ``*``
    (``mark``) where the interval excludes 0."""
    value = row.get(name)
    if value is None or math.isnan(value):
        return ""
    low, high = row.get(f"{name}_ci_low"), row.get(f"{name}_ci_high")
    if low is None or high is None or math.isnan(low) or math.isnan(high):
        return _figure(value, sign=sign)
    star = " *" if mark and (low > 0 or high < 0) else ""
    return f"{_figure(value, sign=sign)} [{_figure(low, sign=sign)}, {_figure(high, sign=sign)}]{star}"


def _comparison(folder: Path):
    import pandas as pd

    path = folder / "comparison.csv"
    if not path.is_file():
        raise UserError(f"{path} does not exist: run the demo first (make demo)")
    return pd.read_csv(path)


def _baseline(table) -> str:
    """The method the paired differences are against: the pruned row without one."""
    if "accuracy_diff" not in table.columns:
        return "the baseline"
    pruned = table[table["accuracy_diff"].isna() & table["target_sparsity"].fillna(0).gt(0)]
    return str(pruned["method"].iloc[0]) if len(pruned) else "the baseline"


def _groups(table) -> list[str]:
    return [c for c in table.columns if c.startswith("acc/") and not c.endswith(("_ci_low", "_ci_high"))]


def vision_table(folders: list[Path]) -> str:
    """A vision comparison's reading table from its ``comparison.csv``: each row's method, sparsity,
    accuracy with its 95 % interval, every group's accuracy, the accuracy gap, the degradation std
    with its interval, and the paired differences of accuracy and degradation std against the
    baseline (``*``: the interval excludes 0)."""
    table = _comparison(folders[0])
    groups, baseline = _groups(table), _baseline(table)
    head = ["method", "sparsity", "accuracy (95 % CI)", *(g.removeprefix("acc/") for g in groups), "accuracy gap",
            "degradation std (95 % CI)", f"Δ accuracy vs {baseline}", f"Δ degradation std vs {baseline}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table.to_dict(orient="records"):
        sparsity = row.get("target_sparsity")
        cells = [str(row["method"]), "0" if sparsity is None or math.isnan(sparsity) else f"{sparsity:g}",
                 _with_interval(row, "accuracy"), *(_figure(row[g]) for g in groups), _figure(row.get("acc_gap")),
                 _with_interval(row, "degradation_std") or "–",
                 _with_interval(row, "accuracy_diff", sign=True, mark=True),
                 _with_interval(row, "degradation_std_diff", sign=True, mark=True)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _worst(row, groups: list[str]) -> str:
    """The lowest group accuracy of a row and its group: ``0.861 (Asian)``."""
    values = {g.removeprefix("acc/"): row[g] for g in groups if not math.isnan(row[g])}
    name = min(values, key=values.get)
    return f"{_figure(values[name])} ({name})"


def seeds_table(folders: list[Path]) -> str:
    """One line per demo seed (one comparison folder each, in the order given): the dense model's
    lowest group and accuracy gap, each pruned method's accuracy with its interval and its lowest
    group, and the paired differences of accuracy and degradation std against the baseline."""
    lines = []
    for i, folder in enumerate(folders):
        table = _comparison(folder)
        groups, baseline = _groups(table), _baseline(table)
        rows = {r["method"]: r for r in table.to_dict(orient="records")}
        others = [m for m in rows if m not in ("dense", baseline) and not m.startswith("dense ")]
        if i == 0:
            head = ["run", "dense: lowest group", "dense: accuracy gap", f"{baseline}: accuracy (95 % CI)",
                    f"{baseline}: lowest group", f"{baseline}: degradation std"]
            for m in others:
                head += [f"{m}: accuracy (95 % CI)", f"{m}: lowest group", f"{m}: degradation std",
                         f"Δ accuracy {m} − {baseline}", f"Δ degradation std {m} − {baseline}"]
            lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        dense, base = rows["dense"], rows[baseline]
        cells = [folder.parent.name, _worst(dense, groups), _figure(dense["acc_gap"]),
                 _with_interval(base, "accuracy"), _worst(base, groups), _with_interval(base, "degradation_std")]
        for m in others:
            row = rows[m]
            cells += [_with_interval(row, "accuracy"), _worst(row, groups), _with_interval(row, "degradation_std"),
                      _with_interval(row, "accuracy_diff", sign=True, mark=True),
                      _with_interval(row, "degradation_std_diff", sign=True, mark=True)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def lm_table(folders: list[Path]) -> str:
    """An LM comparison's headline from its ``comparison.csv`` and ``report.json`` (the baseline):
    the table ``compare`` printed (:func:`fairprune.reporting.headline.headline`), as Markdown, with
    its legend and a line per figure a run marks invalid."""
    import json

    from fairprune.reporting.headline import headline
    from fairprune.reporting.terminal import headline_markdown

    table = _comparison(folders[0])
    report = json.loads((folders[0] / "report.json").read_text(encoding="utf-8"))
    return headline_markdown(headline(table, str(report.get("baseline") or "")))


#: UnQover's abstention figures, the first the rows hold validly read (the three-answer cloze first).
UNQOVER = ("unqover_cloze3/accuracy_amb", "unqover_letter_balanced/accuracy_amb")
#: CrowS-Pairs' figure: the share of pairs whose stereotypical sentence is the more likely.
CROWS = "crows_pairs_english/pct_stereotype"


def _pattern(value) -> str:
    """A comparison row's sparsity as the paper writes it: ``1:4``, ``2:4``, ``50 %`` (dense: ``0 %``)."""
    text = str(value)
    return text if ":" in text else f"{float(text) * 100:g} %"


def _by_pattern(table):
    """The dense row(s) first, then the rows grouped by sparsity in the order the comparison first
    names each, the methods in the comparison's order within each group."""
    dense = [i for i, m in enumerate(table["method"]) if str(m).startswith("dense")]
    others = [i for i in range(len(table)) if i not in dense]
    order = list(dict.fromkeys(str(table["sparsity"].iloc[i]) for i in others))
    others.sort(key=lambda i: order.index(str(table["sparsity"].iloc[i])))
    return table.iloc[dense + others].reset_index(drop=True)


def debias_paper_table(folders: list[Path]) -> str:
    """The Debias-SparseGPT paper's main-table layout from a comparison's ``comparison.csv``
    (``prune.py compare --config configs/compare/debias_paper.yaml``): the dense model first, then
    the rows grouped by sparsity in the comparison's order (1:4, 2:4, 50 %), the methods in order
    within each; the paper's columns UnQover abstention, DTO (from MMLU and UnQover abstention,
    min-max over these rows; without UnQover, the comparison's own DTO and the figures it read),
    MMLU and perplexity (with its 95 % interval), then HellaSwag, BBQ abstention and CrowS-Pairs.
    Accuracies and CrowS in %, each accuracy headed by its chance level; a value its run marks
    invalid struck out (``✗``) and one at or below chance marked ``≤``, as the printed headline
    shows them. A column the comparison does not hold is left out and named under the table."""
    import pandas as pd

    from fairprune.reporting.dto import ABSTENTION, choose
    from fairprune.reporting.headline import Cell, Column, figure_column, task_column
    from fairprune.reporting.terminal import headline_markdown

    table = _by_pattern(_comparison(folders[0]))
    rows = table.to_dict(orient="records")

    def held(candidates: tuple[str, ...]) -> str | None:  # the figure the most rows hold validly, else the first present
        return choose(rows, candidates) or next((c for c in candidates if c in table.columns), None)

    unqover, bbq = held(UNQOVER), held(tuple(name for name in ABSTENTION if name.startswith("bbq_")))
    percent = table.copy()
    for name in (unqover, "mmlu/acc", "hellaswag/acc_norm", bbq, CROWS):
        for column in (name, f"{name}_chance"):
            if name and column in percent.columns:
                percent[column] = pd.to_numeric(percent[column], errors="coerce") * 100

    def share(name: str | None, head: str):  # a figure in %, one decimal
        return name and task_column(percent, name, head, fmt=lambda v: f"{v:.1f}")

    wanted = [("UnQover abstention %", share(unqover, "UnQover abstention %")), ("DTO", _paper_dto(table, unqover)),
              ("MMLU %", share("mmlu/acc", "MMLU %")),
              ("perplexity", figure_column(table, "perplexity", "perplexity", "perplexity")),
              ("HellaSwag %", share("hellaswag/acc_norm", "HellaSwag %")), ("BBQ abstention %", share(bbq, "BBQ abstention %")),
              ("CrowS % stereotypical", share(CROWS, "CrowS % stereotypical"))]
    keys = [Column("sparsity", "sparsity", "sparsity", [Cell(_pattern(s)) for s in table["sparsity"]], numeric=False),
            Column("method", "method", "method", [Cell(str(m)) for m in table["method"]], numeric=False)]
    names = [f"{m} {_pattern(s)}" for m, s in zip(table["method"], table["sparsity"])]
    text = headline_markdown(keys + [c for _, c in wanted if c], names)
    read = ", ".join(f"{head.removesuffix(' %')}: {name}" for head, name in (("UnQover abstention", unqover),
                                                                           ("BBQ abstention", bbq)) if name)
    notes = ["Accuracies and CrowS in % (CrowS: the pairs whose stereotypical sentence the model finds the more "
             "likely; 50 % is no preference); N:M: N zeros in every M consecutive inputs of a row"
             + (f"; read from {read}" if read else "") + "."]
    missing = [head for head, column in wanted if not column]
    if missing:
        notes.append(f"Not in this comparison: {', '.join(missing)} (add its tasks to --tasks).")
    return text + "\n" + "\n\n".join(notes) + "\n"


def _paper_dto(table, unqover: str | None):
    """DTO as the paper reads it, from MMLU and UnQover abstention over these rows; where fewer than
    two rows hold both validly, the comparison's own DTO column (its note names the figures it read)."""
    from fairprune.reporting.dto import dto
    from fairprune.reporting.headline import Cell, Column, dto_column, number

    if unqover is None or "mmlu/acc" not in table.columns:
        return dto_column(table)
    distances, used = dto(table.to_dict(orient="records"), accuracy=("mmlu/acc",), abstention=(unqover,))
    if used is None or all(d is None for d in distances):  # no two rows hold both validly: the comparison's own
        own = dto_column(table)
        if own is not None or used is None:
            return own
    cells = [Cell(number(d)) if d is not None else Cell("–", why="a figure it reads is missing or invalid")
             for d in distances]
    return Column("dto", "DTO", "DTO", cells, f"from mmlu/acc and {unqover}")


#: The demo's runs from three seeds (``python -m fairprune.cli.demo --seed N``).
SEED_RUNS = ("runs/demo/compare", "runs/demo_seed1/compare", "runs/demo_seed2/compare")

#: Every generated table, by block name.
BLOCKS: dict[str, Block] = {
    "demo-table": Block(SEED_RUNS[:1], vision_table,
                        ("README.md", "docs/getting-started.md", "docs/reading-a-comparison.md", "docs/demo.md",
                         "docs/reproducing.md"), "make demo"),
    "demo-seed1-table": Block(SEED_RUNS[1:2], vision_table, ("docs/demo.md",), "python -m fairprune.cli.demo --seed 1"),
    "demo-seed2-table": Block(SEED_RUNS[2:3], vision_table, ("docs/demo.md",), "python -m fairprune.cli.demo --seed 2"),
    "demo-seeds": Block(SEED_RUNS, seeds_table, ("docs/demo.md",),
                        "make demo and python -m fairprune.cli.demo --seed 1 (and 2)"),
    "demo-lm-table": Block(("runs/demo_lm",), lm_table, ("docs/guides/lm.md",), "make demo-lm"),
    "sparsegpt-paper-table": Block(("runs/sparsegpt_paper",), lm_table, ("docs/reproducing.md",),
                                   "python prune.py compare --config configs/compare/sparsegpt_paper.yaml"),
    "debias-paper-table": Block(("runs/debias_paper",), debias_paper_table, ("docs/reproducing.md",),
                                "python prune.py compare --config configs/compare/debias_paper.yaml"),
}


def run(names: Sequence[str], check: bool, root: Path | None = None) -> int:
    """Write (or with ``check`` compare) the blocks ``names`` (every block when empty); the status:
    1 when ``check`` finds a page that differs (one line on stderr per block), else 0."""
    from fairprune.reporting.marked_block import marked_block, replace_marked_block

    root = root or ROOT
    unknown = [n for n in names if n not in BLOCKS]
    if unknown:
        raise UserError(f"no table named {', '.join(unknown)}; the tables: {', '.join(BLOCKS)}")
    differ, checked = [], 0
    for name in names or list(BLOCKS):
        block = BLOCKS[name]
        missing = [s for s in block.sources if not (root / s).is_dir()]
        if missing:
            if names:
                raise UserError(f"{', '.join(missing)} does not exist: run {block.command} first")
            print(f"[tables] {name}: {', '.join(missing)} does not exist, skipped (run {block.command} first)")
            continue
        text = block.render([root / s for s in block.sources])
        sources = ", ".join(block.sources)
        checked += 1
        if check:
            pages = [page for page in block.pages if marked_block(root / page, name) != text]
            if pages:
                differ.append(f"error: the {name} table in {', '.join(pages)} differs from what {block.command} "
                              f"wrote ({sources}); run make readme-table and commit the pages")
            continue
        for page in block.pages:
            if replace_marked_block(root / page, name, text):
                print(f"[tables] {name}: {page} rewritten from {sources}")
            else:
                print(f"[tables] {name}: {page} is up to date")
    if check and not checked:  # a check that compared nothing must not pass
        differ.append("error: no demo has written its table (every block skipped): nothing was checked; run make demo "
                      "(or the demo of the table named) first")
    for line in differ:
        print(line, file=sys.stderr)
    return 1 if differ else 0


class _Parser(argparse.ArgumentParser):
    """A mistake on the command line is one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message}\n")


def main(args: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m fairprune.cli.tables", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"the tables to write (default: all of {', '.join(BLOCKS)})")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit with status 1 where a page differs from what its demo wrote")
    parsed = parser.parse_args(args)
    try:
        return run(parsed.names, parsed.check)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
