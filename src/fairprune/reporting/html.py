"""``report.html``: a comparison as one self-contained page that opens offline.

The page holds, in reading order: warnings and what the data readers left out, the headline table
(the columns of :mod:`~fairprune.reporting.headline`, each value with its confidence interval
beneath it, the paired difference against the baseline included, task figures under their chance
level, a figure its run marks invalid struck out with the reason beneath the table; it fits a
1280 px window), the
per-group accuracies in a table of their own, size and speed where networks differ in size from the
dense model (else one line saying why they are left out), the plots (each PNG embedded as a base64
``data:`` URI; a compare over several sparsities has its trade-off curve first), the full table
folded in a ``<details>``, and the settings as a definition list. Styles are inline. It loads nothing: no scripts, no
style sheets, no fonts, no remote images. Every name and value is escaped: group names, methods and
folders come from data and the command line.

Which columns go where is decided from their names alone (:func:`split_columns`), so any
comparison (vision, LM weights, heads, Diff-Pruning) and any subset of columns lays out.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import numbers
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fairprune.reporting.headline import (
    CHANCE_MARK,
    INVALID_MARK,
    Cell,
    Column,
    deploy_columns,
    headline,
    rows_of_other_size,
)
from fairprune.storage.atomic import write_text

if TYPE_CHECKING:
    import pandas as pd

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5em auto; max-width: 1240px;
       padding: 0 1em; color: #222; line-height: 1.35; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
code { font-size: 0.9em; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.45em; text-align: right; }
td { white-space: nowrap; font-variant-numeric: tabular-nums; vertical-align: top; }
th { background: #f0f0f0; vertical-align: bottom; font-weight: 600; }
td:first-child, th:first-child { text-align: left; }
tbody tr:nth-child(even) td { background: #fafafa; }
.ci { display: block; color: #555; font-size: 0.9em; font-weight: normal; }
.sig { font-weight: 700; }
s.invalid { color: #888; }
.scroll { overflow-x: auto; max-width: 100%; }
.note { font-size: 0.85em; color: #555; margin: 0.3em 0; }
.warnings { border: 2px solid #c77700; background: #fff4e0; padding: 0.4em 1em; border-radius: 4px; margin: 1em 0; }
.warnings ul { margin: 0.3em 0; padding-left: 1.2em; }
.data { border-left: 4px solid #9ab; background: #f4f7f9; padding: 0.4em 1em; margin: 1em 0; }
.data.left-out { border-left-color: #c77700; }
dl.settings { display: grid; grid-template-columns: max-content minmax(0, 1fr); gap: 0.35em 1.2em; }
dl.settings dt { font-weight: 600; } dl.settings dd { margin: 0; overflow-wrap: anywhere; }
dl.settings dl { margin: 0; display: grid; grid-template-columns: max-content minmax(0, 1fr); gap: 0.1em 0.8em; }
dl.settings dl dt { font-weight: normal; color: #555; } dl.settings dl dd { margin: 0; }
table.kv { font-size: 0.9em; } table.kv th, table.kv td { text-align: left; white-space: normal;
  overflow-wrap: anywhere; background: none; font-weight: normal; vertical-align: top; }
table.kv th { color: #555; }
details.full { margin: 1em 0; } details.full summary { cursor: pointer; font-weight: 600; }
figure { margin: 1em 0; } figure img { max-width: 100%; box-sizing: border-box; border: 1px solid #eee; }
figcaption { font-size: 0.9em; color: #555; }
"""

#: Columns that name a row (beside the first), repeated in the per-group table.
KEYS = ("method", "target_sparsity", "sparsity", "alpha", "seed")
#: Columns that go to the per-group table (``acc/<group>``), headed by the group's name.
GROUP_PREFIX = "acc/"
_CI = re.compile(r"^(?P<base>.+) (?P<level>\d+(?:\.\d+)?%) CI$")  # "accuracy 95% CI"
_MEAN_SD = re.compile(r"^(?P<mean>[+-]?\d[\d.]*(?:e[+-]?\d+)?) ± (?P<sd>\d[\d.]*(?:e[+-]?\d+)?)$")  # over seeds
_DIFF = re.compile(r"^(?P<value>[+-]?\d\S*) (?P<ci>\[[^\]]*\])(?P<sig> \*)?$")  # "+0.051 [+0.020, +0.083] *"


def _cell(value: Any, column: str = "") -> str:
    if value is None or (isinstance(value, float) and value != value):
        return ""
    if isinstance(value, bool) or isinstance(value, numbers.Integral):
        return str(value)
    if isinstance(value, float):
        return f"{value:.1f}" if "seconds" in column else f"{value:.4f}"
    return str(value)


def _label(name: str) -> str:
    """An escaped column name that may wrap after ``_`` and ``/`` (headers, not cells, wrap)."""
    return re.sub(r"([_/])", r"\1<wbr>", html.escape(name))


def _plan(columns: Sequence[Any]) -> list[tuple[str, tuple[str, ...], str]]:
    """Each column to show, with the columns holding its interval (shown under the value in the
    same cell: ``<figure> 95% CI`` text, or numeric ``<figure>_ci_low`` / ``_ci_high``) and the
    interval's header note. Interval columns without their figure stay columns of their own."""
    names = [str(c) for c in columns]
    intervals: dict[str, tuple[tuple[str, ...], str]] = {}
    for name in names:
        match = _CI.match(name)
        if match and match["base"] in names:
            intervals[match["base"]] = ((name,), f"{match['level']} CI")
        elif name.endswith("_ci_low") and name[:-7] in names and f"{name[:-7]}_ci_high" in names:
            intervals[name[:-7]] = ((name, f"{name[:-7]}_ci_high"), "CI")
    merged = {c for cols, _ in intervals.values() for c in cols}
    return [(name, *intervals.get(name, ((), ""))) for name in names if name not in merged]


def split_columns(columns: Sequence[Any]) -> tuple[list[str], list[str]]:
    """The headline table's columns and the per-group table's (the row's name and key columns,
    then every ``acc/<group>`` column and its interval); the second is empty without group
    columns. A wide comparison (seven groups and three intervals) then fits a laptop screen."""
    names = [str(c) for c in columns]
    groups = [n for n in names if n.startswith(GROUP_PREFIX)]
    if not groups:
        return names, []
    keys = [n for n in names if n in KEYS and not n.startswith(GROUP_PREFIX)]
    if names[0] not in keys:
        keys.insert(0, names[0])
    return [n for n in names if n not in groups], keys + groups


def _value_html(text: str, interval: str, column: str = "") -> str:
    """A cell, stacked so columns stay narrow: a paired difference (``+0.051 [+0.020, +0.083] *``)
    as value over interval, bold when the interval excludes 0; a ``mean ± sd`` over seeds as mean
    over ``± sd``; any value with its interval (if any) beneath."""
    match = _DIFF.match(text)
    if match:
        sig = ' class="sig" title="the interval excludes 0"' if match["sig"] else ""
        return (f'<span{sig}>{html.escape(match["value"])}{" *" if match["sig"] else ""}</span>'
                f'<span class="ci">{html.escape(match["ci"])}</span>')
    below = [interval] if interval else []
    match = _MEAN_SD.match(text)
    if match:
        text, sd = (_cell(float(match[k]), column) for k in ("mean", "sd"))
        below.insert(0, f"± {sd}")
    return html.escape(text) + "".join(f'<span class="ci">{html.escape(b)}</span>' for b in below)


def table_html(table: pd.DataFrame, css: str = "", heads: Mapping[str, str] | None = None) -> str:
    """An HTML table of ``table``: floats with four decimals (seconds with one), each figure's
    interval under its value (:func:`_plan`); ``heads`` renames headers, ``css`` is its class."""
    table = table.copy()
    table.columns = [str(c) for c in table.columns]
    plan = _plan(table.columns)
    notes = {name: f'<span class="ci">{html.escape(note)}</span>' if note else "" for name, _, note in plan}
    head = "".join(f"<th>{_label((heads or {}).get(name, name))}{notes[name]}</th>" for name, _, _ in plan)
    rows = []
    position = {name: i for i, name in enumerate(table.columns)}
    for values in table.itertuples(index=False, name=None):  # per-column types (iterrows would upcast ints)
        row = {name: values[i] for name, i in position.items()}
        cells = []
        for name, cols, _ in plan:
            if len(cols) == 2:
                low, high = (_cell(row[c]) for c in cols)
                interval = f"[{low}, {high}]" if low or high else ""
            else:
                interval = _cell(row[cols[0]]) if cols else ""
            cells.append(f"<td>{_value_html(_cell(row[name], name), interval, name)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    css = f' class="{html.escape(css)}"' if css else ""
    return (f'<div class="scroll"><table{css}><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


def _number(value: float, seconds: bool) -> str:
    if not seconds:
        return f"{value:.6g}"
    if value < 60:
        return f"{value:.1f} s"
    minutes, secs = divmod(round(value), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{value:.1f} s ({f'{hours} h {minutes} min' if hours else f'{minutes} min {secs} s'})"


def _scalar_html(value: Any, seconds: bool = False) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, numbers.Integral):
        return str(value)
    if isinstance(value, numbers.Real):
        return _number(float(value), seconds)
    text = html.escape(str(value))
    return f"<code>{text}</code>" if os.sep in str(value) or "/" in str(value) else text


def _setting_html(key: str, value: Any, depth: int = 0) -> str:
    """One setting, readable: a flat mapping as a small table, a list of flat mappings as a table
    with their keys as columns, nested mappings as nested lists, anything deeper as compact JSON."""
    seconds = "seconds" in key
    if isinstance(value, Mapping):
        if not value:
            return "—"
        if depth >= 3:
            return f"<code>{html.escape(json.dumps(value, default=str))}</code>"
        if all(not isinstance(v, (Mapping, list, tuple)) for v in value.values()):
            rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{_scalar_html(v, seconds or 'seconds' in str(k))}</td></tr>"
                           for k, v in value.items())
            return f'<table class="kv">{rows}</table>'
        return "<dl>" + "".join(f"<dt>{html.escape(str(k))}</dt><dd>{_setting_html(str(k) if not seconds else key, v, depth + 1)}</dd>"
                                for k, v in value.items()) + "</dl>"
    if isinstance(value, (list, tuple)):
        if not value:
            return "none"
        if all(not isinstance(v, (Mapping, list, tuple)) for v in value):
            return ", ".join(_scalar_html(v, seconds) for v in value)
        if depth < 3 and all(isinstance(v, Mapping) and all(not isinstance(x, (Mapping, list, tuple)) for x in v.values())
                             for v in value):
            keys = list(dict.fromkeys(k for v in value for k in v))
            head = "".join(f"<th>{html.escape(str(k))}</th>" for k in keys)
            body = "".join("<tr>" + "".join(f"<td>{_scalar_html(v.get(k), 'seconds' in str(k))}</td>" for k in keys) + "</tr>"
                           for v in value)
            return f'<table class="kv"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
        return "<ul>" + "".join(f"<li>{_setting_html(key, v, depth + 1)}</li>" for v in value) + "</ul>"
    return _scalar_html(value, seconds)


def settings_html(extra: Mapping[str, Any]) -> str:
    """The comparison's other fields (runs, seeds, reference, seconds, ...) as a definition list."""
    items = "".join(f"<dt>{html.escape(str(k))}</dt><dd>{_setting_html(str(k), v)}</dd>" for k, v in extra.items())
    return f'<dl class="settings">{items}</dl>'


def warnings_html(warnings: Any) -> str:
    """Warnings first, in a box: they say which figures not to trust. Empty without warnings."""
    if not warnings:
        return ""
    items = [warnings] if isinstance(warnings, (str, Mapping)) else list(warnings)
    body = "".join(f"<li>{html.escape(w) if isinstance(w, str) else _setting_html('warning', w)}</li>" for w in items)
    return (f'<div class="warnings" role="alert"><strong>{len(items)} warning{"s" if len(items) != 1 else ""}'
            f"</strong><ul>{body}</ul></div>")


def data_html(data: Any) -> str:
    """What the data readers kept (``samples`` per split) and left out (``skipped`` per reason),
    in a line before the tables; empty when the comparison's reports carry no such counts."""
    if not isinstance(data, Mapping) or not ({"skipped", "samples"} & set(data)):
        return ""
    parts = []
    samples = data.get("samples") or {}
    if isinstance(samples, Mapping) and samples:
        parts.append(", ".join(f"{html.escape(str(n))} {html.escape(str(split))}" for split, n in samples.items())
                     + " samples.")
    skipped = data.get("skipped") or {}
    counts = {k: v for k, v in skipped.items() if isinstance(v, numbers.Real) and v} if isinstance(skipped, Mapping) else {}
    if counts:
        parts.append(f"<strong>Left out while reading: {sum(counts.values()):g}</strong> ("
                     + ", ".join(f"{html.escape(str(v))} {html.escape(str(k))}" for k, v in counts.items()) + ").")
    else:
        parts.append("Nothing was left out while reading the data.")
    return f'<p class="data{" left-out" if counts else ""}">Data: {" ".join(parts)}</p>'


def figure_html(path: str | os.PathLike, caption: str) -> str:
    """A PNG embedded as a base64 ``data:`` URI, with its caption; empty when the file is absent."""
    path = Path(path)
    if not path.is_file():
        return ""
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    alt = html.escape(caption)
    return (f'<figure><img alt="{alt}" src="data:image/png;base64,{data}">'
            f"<figcaption>{alt} ({html.escape(path.name)})</figcaption></figure>")


def _legend(heads: Sequence[str]) -> str:
    """One line on how to read the headline's intervals and differences, when it has any."""
    notes = []
    if any("CI" in h for h in heads):
        notes.append("Under a value: its confidence interval (headed “CI”).")
    if any("± sd" in h for h in heads):
        notes.append("± sd: the standard deviation over seeds.")
    if any(h.startswith("Δ ") or " ×" in h for h in heads):
        notes.append("Δ (×: a ratio): the paired difference against the baseline on the same test items, with its "
                     "interval; <strong>*</strong> (bold): the interval excludes no change.")
    return f'<p class="note">{" ".join(notes)}</p>' if notes else ""


def headline_html(columns: Sequence[Column]) -> str:
    """The headline table (:func:`fairprune.reporting.headline.headline`): each value with its
    interval (or the worst group's name) beneath it; a paired difference whose interval excludes
    no change in bold with ``*``."""
    head = "".join(f"<th>{_label(c.title)}{f'<span class=ci>{html.escape(c.under)}</span>' if c.under else ''}</th>"
                   for c in columns)
    rows = []
    for i in range(max((len(c.cells) for c in columns), default=0)):
        cells = []
        for column in columns:
            cell = column.cells[i] if i < len(column.cells) else Cell()
            value = html.escape(cell.value) + (" *" if cell.strong else "")
            if cell.strong:
                value = f'<span class="sig" title="the interval excludes no change">{value}</span>'
            if cell.invalid:
                value = f'<s class="invalid" title="{html.escape(cell.why)}">{value}</s> {INVALID_MARK}'
            elif cell.mark:
                value = f'<span title="{html.escape(cell.why)}">{value} {html.escape(cell.mark)}</span>'
            below = "".join(f'<span class="ci">{html.escape(b)}</span>' for b in (cell.interval, cell.note) if b)
            cells.append(f"<td>{value}{below}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<div class="scroll"><table class="headline"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


def marks_html(columns: Sequence[Column]) -> str:
    """What the headline's marks mean, and why each figure struck out is invalid (its run's
    reason); empty when no value is marked."""
    from fairprune.reporting.terminal import invalid_lines

    notes = []
    if any(cell.invalid for c in columns for cell in c.cells):
        notes.append(f"{INVALID_MARK} (struck out): the run marks the figure invalid; it is not ranked and DTO leaves it "
                     "out.")
    if any(cell.mark == CHANCE_MARK for c in columns for cell in c.cells):
        notes.append(f"{CHANCE_MARK}: at or below its chance level (the score of uniform answers over the task's own "
                     "choices, under the column's name): uniform answers would match or beat it.")
    if not notes:
        return ""
    lines = "".join(f"<li>{html.escape(line)}</li>" for line in invalid_lines(columns))
    return f'<div class="note"><p>{html.escape(" ".join(notes))}</p>{f"<ul>{lines}</ul>" if lines else ""}</div>'


def deploy_html(numeric: pd.DataFrame, index: str = "method") -> str:
    """Size, MACs and latency in a table of their own, for the dense rows and the rows whose
    network differs in size from the dense model's (channel pruning, compressed formats); where
    none does (weight pruning keeps the shapes) one line says so. Empty without deploy figures."""
    figures = deploy_columns(numeric)
    if not figures:
        return ""
    other = rows_of_other_size(numeric, index)
    if not other:
        return ('<p class="note">Size, MACs and latency are left out: every row has the dense model\'s shapes '
                "(weight pruning stores the zeros), so its figures are the dense model's (the full table lists them).</p>")
    keys = [c for c in numeric.columns if c in (index, *KEYS, "granularity")]
    dense = [i for i, v in enumerate(numeric[index]) if str(v).startswith("dense")] if index in numeric.columns else []
    rows = numeric.iloc[sorted(set(dense) | set(other))]
    return "<h2>Size and speed</h2>" + table_html(rows[keys + figures], "deploy")


def write_html(path: str | os.PathLike, title: str, table: pd.DataFrame,
               figures: Sequence[tuple[str | os.PathLike, str]] = (), extra: dict[str, Any] | None = None,
               numeric: pd.DataFrame | None = None, baseline: str = "", index: str = "method") -> Path:
    """Write the page: ``title``; ``extra``'s ``warnings`` and ``data`` (samples kept and left
    out) first; the headline table (:func:`headline_html`, from ``numeric``, the comparison's
    numeric table, default ``table``), the per-group table when ``table`` has ``acc/<group>``
    columns (:func:`split_columns`), size and speed (:func:`deploy_html`); every ``(png,
    caption)`` figure that exists; ``table`` whole, folded; and the rest of ``extra`` (the
    comparison's other fields, e.g. run folders and seconds) as settings."""
    extra = dict(extra or {})
    warnings, data = extra.pop("warnings", None), extra.get("data")
    notices = [warnings_html(warnings), data_html(data)]
    if notices[1] or not data:
        extra.pop("data", None)
    table = table.copy()
    table.columns = [str(c) for c in table.columns]
    numeric = table if numeric is None else numeric
    columns = headline(numeric, baseline, index)
    _, groups = split_columns(table.columns)
    parts = [f"<h1>{html.escape(title)}</h1>",
             f'<p class="note">Written {_dt.datetime.now().isoformat(timespec="seconds")} in '
             f"<code>{html.escape(str(Path(path).parent))}</code>.</p>",
             *filter(None, notices), "<h2>Results</h2>", _legend([c.title for c in columns] + [c.under for c in columns]),
             headline_html(columns), marks_html(columns)]
    if groups:
        names = {c: c[len(GROUP_PREFIX):] for c in groups if c.startswith(GROUP_PREFIX)}
        parts += ["<h2>Accuracy per group</h2>", table_html(table[groups], "groups", names)]
    parts.append(deploy_html(numeric, index))
    shown = [figure_html(p, c) for p, c in figures]
    if any(shown):
        parts += ["<h2>Plots</h2>", *filter(None, shown)]
    parts.append(f'<details class="full"><summary>The full table ({len(table.columns)} columns, as in comparison.md)'
                 f"</summary>{table_html(table, 'full')}</details>")
    if extra:
        parts += ["<h2>Settings</h2>", settings_html(extra)]
    page = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>\n<body>\n"
            + "\n".join(filter(None, parts)) + "\n</body></html>\n")
    return write_text(path, page)
