"""The table a ``compare`` prints: the headline columns (:mod:`~fairprune.reporting.headline`)
drawn by ``rich`` within the terminal's width, at most :data:`WIDTH` columns, a legend, a line per
figure shown invalid saying why (struck out on a terminal, and marked ``✗`` wherever the text
goes), and a line saying where the full table is. Values and names are shown as text (no markup is
read from them)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from fairprune.reporting.headline import CHANCE_MARK, INVALID_MARK, Cell, Column

#: The widest the printed table gets, whatever the terminal's width.
WIDTH = 100
#: The width a name (the row's, the worst group's) keeps before it folds or is cut.
NAME_WIDTH = 16


def width() -> int:
    """The terminal's width (``COLUMNS`` where set; :data:`WIDTH` when not a terminal), at most
    :data:`WIDTH`."""
    return min(shutil.get_terminal_size((WIDTH, 24)).columns, WIDTH)


def widths(columns: Sequence[Column], room: int) -> list[int]:
    """Each column's width within ``room``: as wide as its header and cells where they fit; else,
    in turn, headers wrap at their spaces, names (the first column, the worst group) fold or are
    cut down to :data:`NAME_WIDTH`, intervals go under their values, names shrink to a few
    characters. A number never wraps."""
    names = [i for i, c in enumerate(columns) if i == 0 or c.key == "worst_group"]
    words = [max(map(len, c.head.split()), default=0) for c in columns]
    cells = [max((len(cell.text()) for cell in c.cells), default=0) for c in columns]
    stacked = [max((len(line) for cell in c.cells for line in cell.lines()), default=0) for c in columns]
    natural = [max(len(c.head), n) for c, n in zip(columns, cells)]
    floors = [max(w, n) for w, n in zip(words, cells)]
    named = [max(w, min(n, NAME_WIDTH)) if i in names else f for i, (w, n, f) in enumerate(zip(words, cells, floors))]
    under = [n if i in names else max(w, s) for i, (w, s, n) in enumerate(zip(words, stacked, named))]
    least = [max(w, min(6, n)) if i in names else n for i, (w, n) in enumerate(zip(words, under))]
    sizes = list(natural)
    for lowest in (floors, named, under, least):
        for i in sorted(range(len(sizes)), key=lambda i: lowest[i] - sizes[i]):
            excess = sum(sizes) - room
            if excess <= 0:
                return sizes
            sizes[i] -= min(excess, max(0, sizes[i] - lowest[i]))
    return sizes


def _cell(cell: Cell, size: int) -> str:
    """A cell's text on one line where it fits ``size``, else its interval on a line of its own."""
    text = cell.text()
    return text if len(text) <= size else "\n".join(cell.lines())


def _legend(columns: Sequence[Column]) -> str:
    keys = {c.key for c in columns}
    notes = []
    if any(c.under == "95% CI" for c in columns):
        notes.append("[ ]: 95% CI")
    if "worst_group" in keys:
        notes.append("worst group: the lowest group accuracy, and its group")
    if "acc_gap" in keys:
        notes.append("gap: best − worst group accuracy")
    if "degradation_std" in keys:
        notes.append("deg. std: spread of the groups' accuracy drops")
    if any(c.key.endswith("_diff") for c in columns):
        notes.append("Δ / ×: paired against the baseline on the same test items, * where the interval excludes no change")
    dto = next((c for c in columns if c.key == "dto"), None)
    if dto is not None:
        notes.append(f"DTO: distance to (1, 1) of the figures min-max normalised over these rows"
                     f"{' (' + dto.under + ')' if dto.under else ''}, valid figures only, below chance counted as "
                     "chance, lower is better")
    if any(cell.invalid for c in columns for cell in c.cells):
        notes.append(f"{INVALID_MARK}: invalid (its run says why below), not ranked, left out of DTO")
    if any(cell.mark == CHANCE_MARK for c in columns for cell in c.cells):
        notes.append(f"{CHANCE_MARK}: at or below its chance level (uniform answers would match or beat it)")
    return "; ".join(notes) + "." if notes else ""


def invalid_lines(columns: Sequence[Column], names: Sequence[str] | None = None) -> list[str]:
    """One line per figure shown invalid: the column, the rows (``names``; default: the first
    column's values) and the reason their runs give."""
    names = list(names) if names is not None else [cell.value for cell in columns[0].cells] if columns else []
    found: dict[tuple[str, str], list[str]] = {}
    for column in columns:
        for i, cell in enumerate(column.cells):
            if cell.invalid:
                row = names[i] if i < len(names) else str(i)
                found.setdefault((column.title, cell.why), []).append(row)
    return [f"{INVALID_MARK} {title}, {', '.join(rows)}: {why}." for (title, why), rows in found.items()]


def print_headline(columns: Sequence[Column], title: str = "", footer: str = "", file: TextIO | None = None) -> None:
    """Print ``columns`` as a table that fits :func:`width` (numbers are never wrapped; a long
    name or header wraps), then a legend and ``footer``."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(file=file or sys.stdout, width=width(), highlight=False, emoji=False, markup=False,
                      soft_wrap=False)
    table = Table(title=Text(title, style="bold") if title else None, box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1, 0, 0), show_edge=False)
    sizes = widths(columns, width() - 2 * (len(columns) - 1))
    for column, size in zip(columns, sizes):
        table.add_column(Text(column.head), justify="right" if column.numeric else "left", width=size,
                         overflow="ellipsis" if column.key == "worst_group" else "fold")
    for i in range(max((len(c.cells) for c in columns), default=0)):
        table.add_row(*(Text(_cell(c.cells[i], size), style="strike" if c.cells[i].invalid else "") if i < len(c.cells)
                        else Text("") for c, size in zip(columns, sizes)))
    console.print(table)
    for line in (_legend(columns), *invalid_lines(columns), footer):
        if line:
            console.print(Text(line))


def headline_markdown(columns: Sequence[Column], names: Sequence[str] | None = None) -> str:
    """The printed table as Markdown: the same columns, headers and cells (each value with its
    interval; a value its run marks invalid struck out and marked), then the legend and a line per
    invalid figure (its rows called by ``names``, default: the first column's values): what a page
    shows as a comparison's headline."""
    from fairprune.reporting.report import markdown_text

    def cell(c: Cell) -> str:
        text = str(markdown_text(c.text()))
        return f"~~{markdown_text(c.value)}~~ {c.text()[len(c.value):].strip()}" if c.invalid else text

    rows = max((len(c.cells) for c in columns), default=0)
    lines = ["| " + " | ".join(str(markdown_text(c.head)) for c in columns) + " |",
             "|" + "|".join("---:" if c.numeric else "---" for c in columns) + "|"]
    lines += ["| " + " | ".join(cell(c.cells[i]) if i < len(c.cells) else "" for c in columns) + " |" for i in range(rows)]
    notes = [line for line in (_legend(columns), *invalid_lines(columns, names)) if line]
    # "[ ]: ..." at the start of a paragraph would read as a link reference definition: escaped.
    notes = [str(markdown_text(n)).replace("[ ]:", "\\[ \\]:") for n in notes]
    return "\n\n".join(["\n".join(lines), *notes]) + "\n"


def task_lines(report: dict[str, Any]) -> list[str]:
    """One line per headline task figure of a report: its value, 95 % interval, chance level (for
    an accuracy) and, where the run cannot stand behind it, why."""
    tasks = report.get("tasks") or {}
    lines = []
    for key, mark in (tasks.get("validity") or {}).items():
        value, ci = report.get("metrics", {}).get(key), report.get("ci", {}).get(key)
        if not isinstance(value, (int, float)):
            continue
        text = f"  {key} {value:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci and None not in ci[:2] else "")
        if mark.get("chance") is not None:
            text += f" (chance {mark['chance']:.3f})"
        if mark.get("invalid"):
            text += f" — invalid: {mark['invalid']}"
        lines.append(text)
    return lines
