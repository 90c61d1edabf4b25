"""The one compare loop: ``prune.py compare`` (a vision checkpoint, an LM's weights or its heads)
runs its cells, each into its own folder under the output, in order and writes one comparison
(:func:`fairprune.reporting.compare.write_comparison`). Each kind supplies what differs: its
cells, how one runs, what an earlier compare left in a cell's folder, the rows and statistics."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fairprune import distributed
from fairprune.reporting.compare import Statistics, write_comparison
from fairprune.reporting.records import Row


@dataclass(frozen=True)
class Cell:
    """One run: its ``folder`` (its name printed, then ``tag``) and ``key``: what its kind runs it with."""

    folder: Path
    key: Any = None
    tag: str = ""

    @property
    def name(self) -> str:
        return self.folder.name


@dataclass
class Written:
    """A comparison as :func:`write_comparison` takes it."""

    rows: list[Row]
    extra: dict[str, Any]
    title: str
    statistics: Statistics = Statistics()
    keys: list[str] | None = None
    figures: list[tuple[str | os.PathLike, str]] = field(default_factory=list)


def compare_folders(output: str | os.PathLike, cells: list[Cell], *others: Path) -> list[Path]:
    """What a compare locks before its first cell runs: its output, ``others``, every cell's folder. A
    run into one of them (``prune.py vision --name <cell>``) is then refused while compare runs, and
    compare at once by such a run."""
    return [Path(output), *others, *(cell.folder for cell in cells)]


def run_compare(output: str | os.PathLike, cells: list[Cell], run: Callable[[Cell, str | None], dict[str, Any]],
                finish: Callable[[list[tuple[Cell, dict[str, Any]]]], Written],
                earlier: Callable[[Cell], tuple[dict[str, Any] | None, str | None]] | None = None, talk: bool = True) -> Any:
    """Run every cell in order, one progress line each where ``talk``, and write into ``output`` the
    comparison ``finish`` makes of the cells and their reports; return its table. ``run(cell,
    resume)``: the cell's report; ``earlier(cell)``: the finished report an earlier compare left
    in its folder (reused), else a checkpoint ``run`` resumes from. Under ``torchrun`` / DDP every
    process runs the cells and rank 0 alone writes (the others return an empty table)."""
    import pandas as pd

    done = []
    for i, cell in enumerate(cells, 1):
        line = f"[compare] {cell.name}{cell.tag} ({i}/{len(cells)})"
        report, resume = earlier(cell) if earlier is not None else (None, None)
        if report is not None and distributed.is_main():  # said even when quiet: the run did not redo it
            print(f"{line}: finished earlier with the same settings, reusing {cell.folder}", flush=True)
        elif talk:
            print(f"{line}{f': resuming from {resume}' if resume else ''} ...", flush=True)
        done.append((cell, report if report is not None else run(cell, resume)))
    if not distributed.is_main():
        return pd.DataFrame()
    found = finish(done)
    return write_comparison(found.rows, output, found.extra, keys=found.keys, figures=found.figures, title=found.title,
                            statistics=found.statistics)
