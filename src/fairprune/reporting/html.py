"""``report.html``: a comparison as one self-contained page that opens offline.

The page holds the comparison table and its plots, each PNG embedded as a base64 ``data:`` URI;
styles are inline. It loads nothing: no scripts, no style sheets, no fonts, no remote images.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from fairprune.storage.atomic import write_text

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1100px;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: right; white-space: nowrap; }
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
tr:nth-child(even) td { background: #fafafa; }
.scroll { overflow-x: auto; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.9em; color: #555; }
pre { background: #f6f6f6; padding: 0.6em; font-size: 0.8em; overflow-x: auto; }
"""


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return ""
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def table_html(table: pd.DataFrame) -> str:
    """A plain HTML table of ``table`` (its columns; floats with four decimals)."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in row) + "</tr>"
                   for row in table.itertuples(index=False))
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def figure_html(path: str | os.PathLike, caption: str) -> str:
    """A PNG embedded as a base64 ``data:`` URI, with its caption; empty when the file is absent."""
    path = Path(path)
    if not path.is_file():
        return ""
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    alt = html.escape(caption)
    return (f'<figure><img alt="{alt}" src="data:image/png;base64,{data}">'
            f"<figcaption>{alt} ({html.escape(path.name)})</figcaption></figure>")


def write_html(path: str | os.PathLike, title: str, table: pd.DataFrame,
               figures: Sequence[tuple[str | os.PathLike, str]] = (), extra: dict[str, Any] | None = None) -> Path:
    """Write the page: ``title``, ``table``, every ``(png, caption)`` figure that exists, and
    ``extra`` (the comparison's other fields, e.g. run folders and seconds) as JSON text."""
    parts = [f"<h1>{html.escape(title)}</h1>",
             f"<p>Written {_dt.datetime.now().isoformat(timespec='seconds')} in {html.escape(str(Path(path).parent))}.</p>",
             "<h2>Table</h2>", table_html(table)]
    shown = [figure_html(p, c) for p, c in figures]
    if any(shown):
        parts += ["<h2>Plots</h2>", *filter(None, shown)]
    if extra:
        parts += ["<h2>Details</h2>", f"<pre>{html.escape(json.dumps(extra, indent=2, default=str))}</pre>"]
    page = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>\n<body>\n"
            + "\n".join(parts) + "\n</body></html>\n")
    return write_text(path, page)
