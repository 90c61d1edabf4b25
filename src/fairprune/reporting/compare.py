"""The one comparison writer: every ``compare`` command (vision, LM weights, heads, Diff-Pruning)
hands its rows here and gets the same three files and the same printed table."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pandas as pd

from fairprune.reporting.atomic import write_csv, write_text
from fairprune.reporting.report import markdown, write_json


def write_comparison(rows: list[dict[str, Any]], output: str | os.PathLike, extra: dict[str, Any] | None = None,
                     index: str = "method", echo: bool = True) -> pd.DataFrame:
    """Write ``comparison.csv``, ``comparison.md`` and ``report.json`` (``{"comparison": rows,
    **extra}``) into ``output`` and return the table; ``echo`` prints it. The JSON is written last,
    so a folder with a ``report.json`` holds a finished comparison."""
    table = pd.DataFrame(rows)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "comparison.csv", table, index=False)
    text = markdown(table.set_index(index)) if index in table.columns else markdown(table)
    write_text(out / "comparison.md", text + "\n")
    write_json(out / "report.json", {"comparison": rows, **(extra or {})})
    if echo:
        print("\n" + text + "\n")
        print(f"[compare] written to {out}/comparison.csv, comparison.md and report.json", flush=True)
    return table
