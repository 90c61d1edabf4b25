"""The values and tables of a model card: numbers read defensively from a report (a missing or
non-finite figure is a dash), intervals, and Markdown tables whose every cell is escaped text."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fairprune.reporting.report import markdown_text

_INTERVALS = (("ci95", "95 % CI"), ("ci", "CI"))  # where a report keeps a figure's interval, and its label


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _number(value: Any) -> float | int | None:
    """A finite plain ``int`` / ``float`` (tensors and numpy scalars unwrapped: YAML writes only
    plain numbers), else None."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value) if isinstance(value, int) else float(value)


def _bounds(pair: Any) -> tuple[float, float] | None:
    if isinstance(pair, Mapping):
        pair = next(((pair[a], pair[b]) for a, b in (("low", "high"), ("lo", "hi"), ("lower", "upper")) if a in pair and b in pair),
                    None)
    if isinstance(pair, (list, tuple)) and len(pair) == 2:
        low, high = _number(pair[0]), _number(pair[1])
        if low is not None and high is not None:
            return float(low), float(high)
    return None


def _figure(figures: Any, key: str, outer: tuple[Mapping[str, Any], str] | None = None,
            ) -> tuple[float | int | None, tuple[str, float, float] | None]:
    """The value of ``figures[key]`` and its interval (label, low, high) where the report has one:
    beside the value, or in ``outer`` (a report-level section of intervals and its label)."""
    figures = _mapping(figures)
    raw = figures.get(key)
    inner = _mapping(raw)
    value = next((inner[k] for k in ("value", "mean", "estimate") if k in inner), None) if inner else raw
    for suffix, label in _INTERVALS:
        for pair in (inner.get(suffix), figures.get(f"{key}_{suffix}"), _mapping(figures.get(suffix)).get(key)):
            bounds = _bounds(pair)
            if bounds is not None:
                return _number(value), (label, *bounds)
    bounds = _bounds(_mapping(outer[0]).get(key)) if outer is not None else None
    return _number(value), ((outer[1], *bounds) if bounds is not None else None)


def _fmt(value: float | int | None, interval: tuple[str, float, float] | None = None) -> str:
    if value is None:
        return "–"
    text = str(value) if isinstance(value, int) else f"{value:.4f}"
    if interval is not None:
        text += f" ({interval[0]} {interval[1]:.4f}–{interval[2]:.4f})"
    return text


def _cell(figures: Any, key: str, outer: tuple[Mapping[str, Any], str] | None = None) -> str:
    return _fmt(*_figure(figures, key, outer))


def _plain(value: Any) -> str:
    return ", ".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys of the scalar settings (lists as they are written); nothing that is unset."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{name}."))
        elif value is not None and value != {} and value != []:
            out[name] = value
    return out


def _text(value: Any) -> str:
    """A name from the data as Markdown text: no HTML, no table border, no line break."""
    return str(markdown_text(str(value)))


def _table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table whose every cell is text (:func:`~fairprune.reporting.report.markdown_text`)."""
    lines = ["| " + " | ".join(_text(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_text(c) if str(c) else "–" for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _intervals(report: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """The report's own section of intervals for this model's figures (``ci``: ``{figure: [low,
    high], "groups": {group: [low, high]}, "level": 0.95}``, or ``ci95``) and their label."""
    for key, label in (("ci", "CI"), ("ci95", "95 % CI")):
        section = report.get(key)
        if isinstance(section, Mapping):
            level = _number(section.get("level"))
            return section, (f"{level * 100:g} % CI" if level is not None and 0 < level < 1 else label)
    return {}, "CI"
