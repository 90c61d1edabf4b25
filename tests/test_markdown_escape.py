"""Markdown tables hold names as text: a group, class or method name never adds a column or a row
to ``comparison.md`` (or a printed groups table), nor reaches a renderer as HTML; the CSV and the
JSON keep the names as they are."""

from __future__ import annotations

import json

import pandas as pd

from fairprune.reporting.compare import write_comparison
from fairprune.reporting.report import group_table, markdown

GROUP = "<img src=x onerror=alert(1)>|x"
METHOD = "mag\nnitude & <b>co</b>"
CLASS = "cat|dog\\"  # a trailing backslash would escape the next cell's bar


def _rows(table: str) -> list[str]:
    return table.strip("\n").split("\n")


def _columns(line: str) -> int:
    return line.count("|")  # no bar inside a cell survives: every one left is a cell border


def test_comparison_md_escapes_names_and_the_csv_keeps_them(tmp_path):
    rows = [{"method": "dense", "worst_class": "cat", "accuracy": 0.9, f"acc/{GROUP}": 0.8, "acc/plain": 0.95},
            {"method": METHOD, "worst_class": CLASS, "accuracy": 0.7, f"acc/{GROUP}": 0.6, "acc/plain": 0.75}]
    write_comparison(rows, tmp_path, echo=False)
    text = (tmp_path / "comparison.md").read_text()
    lines = _rows(text)
    assert len(lines) == 2 + len(rows)  # header, rule, one line per row: the newline made no row
    assert len({_columns(line) for line in lines}) == 1, text
    assert _columns(lines[0]) == 6  # method (the index) and four figures: 5 cells, 6 borders
    assert "<img" not in text and "<b>" not in text and "&lt;img" in text
    assert "\\|" not in text.replace("&#92;", "")  # no backslash left to escape a border

    csv = pd.read_csv(tmp_path / "comparison.csv")
    assert f"acc/{GROUP}" in csv.columns and list(csv["method"]) == ["dense", METHOD]
    assert list(csv["worst_class"]) == ["cat", CLASS]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["comparison"][1]["method"] == METHOD


def test_a_groups_table_escapes_group_names():
    report = {"groups": {GROUP: {"accuracy": 0.5, "count": 3}, "plain": {"accuracy": 0.75, "count": 4}}}
    text = markdown(group_table(report))
    lines = _rows(text)
    assert len(lines) == 4 and len({_columns(line) for line in lines}) == 1, text
    assert "<img" not in text and "0.7500" in text  # figures keep their format
