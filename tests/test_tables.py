"""Generated tables in Markdown pages: a block between two marker lines is rewritten and nothing
else; a page without the markers is refused in one line; the demo's table is written from its
comparison.csv into every page that shows it, and ``--check`` finds a page that differs without
changing it."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from fairprune.cli import tables
from fairprune.errors import UserError
from fairprune.reporting.marked_block import marked_block, markers, replace_marked_block

ROOT = Path(__file__).resolve().parents[1]

PAGE = """# A page

Text before.

<!-- t:start -->
| old | table |
|---|---|
<!-- t:end -->

Text after, with <!-- t:start --> inside a line (not a marker).
"""


def test_the_block_and_only_the_block_is_rewritten(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    assert replace_marked_block(page, "t", "| new |\n|---|\n| 1 |")
    text = page.read_text()
    assert text == PAGE.replace("| old | table |\n|---|---|\n", "| new |\n|---|\n| 1 |\n")
    assert marked_block(page, "t") == "| new |\n|---|\n| 1 |\n"
    before = page.stat().st_mtime_ns
    assert not replace_marked_block(page, "t", "| new |\n|---|\n| 1 |\n")  # unchanged: not written
    assert page.stat().st_mtime_ns == before
    assert replace_marked_block(page, "t", "")  # an empty block keeps its markers
    assert marked_block(page, "t") == "" and page.read_text().count("<!-- t:end -->") == 1


@pytest.mark.parametrize("content, found", [
    ("# no markers\n", "none found"),
    ("<!-- t:start -->\n<!-- t:start -->\n<!-- t:end -->\n", "2 start and 1 end"),
    ("<!-- t:end -->\n<!-- t:start -->\n", "1 start and 1 end"),
])
def test_a_page_without_one_pair_of_markers_is_refused_in_one_line(tmp_path, content, found):
    page = tmp_path / "page.md"
    page.write_text(content)
    with pytest.raises(UserError, match=found) as err:
        replace_marked_block(page, "t", "| x |")
    assert "\n" not in str(err.value) and "<!-- t:start -->" in str(err.value)
    assert page.read_text() == content  # left as it was
    with pytest.raises(UserError, match="does not exist"):
        marked_block(tmp_path / "missing.md", "t")
    with pytest.raises(UserError, match="one word"):
        markers("two words")


def test_text_holding_a_marker_is_refused(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    with pytest.raises(UserError, match="marker"):
        replace_marked_block(page, "t", "<!-- t:end -->\n")
    assert page.read_text() == PAGE


def test_every_page_of_the_demo_table_has_its_markers_and_a_table():
    block = tables.BLOCKS["demo-table"]
    assert block.pages[0] == "README.md"
    for page in block.pages:
        text = marked_block(ROOT / page, "demo-table")
        head = text.splitlines()[0]
        assert head.startswith("| method | sparsity | accuracy (95 % CI) | White | Black | Asian | Indian |"), page
        assert [line.split(" | ")[0] for line in text.splitlines()[2:]] == \
            ["| dense", "| dense +1 epochs", "| magnitude", "| fairgrape"], page


def _comparison(folder: Path) -> None:
    folder.mkdir(parents=True)
    nan = float("nan")
    pd.DataFrame({
        "method": ["dense", "dense +3 epochs", "magnitude", "fairgrape"],
        "target_sparsity": [0.0, 0.0, 0.8, 0.8],
        "accuracy": [0.95, 0.96, 0.8, 0.9], "accuracy_ci_low": [0.93, 0.94, 0.76, 0.87],
        "accuracy_ci_high": [0.97, 0.98, 0.84, 0.93],
        "acc/A": [0.96, 0.97, 0.9, 0.91], "acc/B": [0.94, 0.95, 0.7, 0.89],
        "acc_gap": [0.02, 0.02, 0.2, 0.02], "degradation_std": [nan, nan, 0.1, 0.01],
        "degradation_std_ci_low": [nan, nan, 0.05, 0.0], "degradation_std_ci_high": [nan, nan, 0.15, 0.03],
        "accuracy_diff": [nan, nan, nan, 0.1], "accuracy_diff_ci_low": [nan, nan, nan, 0.05],
        "accuracy_diff_ci_high": [nan, nan, nan, 0.15], "degradation_std_diff": [nan, nan, nan, -0.09],
        "degradation_std_diff_ci_low": [nan, nan, nan, -0.14], "degradation_std_diff_ci_high": [nan, nan, nan, 0.01],
    }).to_csv(folder / "comparison.csv", index=False)


def test_the_vision_table_reads_the_comparison(tmp_path):
    _comparison(tmp_path / "c")
    lines = tables.vision_table([tmp_path / "c"]).splitlines()
    assert lines[0] == ("| method | sparsity | accuracy (95 % CI) | A | B | accuracy gap | degradation std (95 % CI) "
                        "| Δ accuracy vs magnitude | Δ degradation std vs magnitude |")
    assert lines[2] == "| dense | 0 | 0.950 [0.930, 0.970] | 0.960 | 0.940 | 0.020 | – |  |  |"
    assert lines[5] == ("| fairgrape | 0.8 | 0.900 [0.870, 0.930] | 0.910 | 0.890 | 0.020 | 0.010 [0.000, 0.030] "
                        "| +0.100 [+0.050, +0.150] * | -0.090 [-0.140, +0.010] |")
    with pytest.raises(UserError, match="make demo"):
        tables.vision_table([tmp_path / "missing"])


def test_the_seeds_table_has_a_line_per_run(tmp_path):
    for name in ("demo", "demo_seed1"):
        _comparison(tmp_path / name / "compare")
    lines = tables.seeds_table([tmp_path / "demo" / "compare", tmp_path / "demo_seed1" / "compare"]).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| run | dense: lowest group |")
    assert lines[2].startswith("| demo | 0.940 (B) | 0.020 | 0.800 [0.760, 0.840] | 0.700 (B) | 0.100 [0.050, 0.150] "
                               "| 0.900 [0.870, 0.930] | 0.890 (B) |")
    assert lines[3].startswith("| demo_seed1 |") and lines[3].endswith("| +0.100 [+0.050, +0.150] * | -0.090 [-0.140, +0.010] |")


def test_write_then_check_and_a_differing_page_fails_in_one_line(tmp_path, monkeypatch, capsys):
    _comparison(tmp_path / "runs" / "c")
    for page in ("README.md", "docs/a.md"):
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text("intro\n<!-- demo-table:start -->\n<!-- demo-table:end -->\nend\n")
    monkeypatch.setattr(tables, "BLOCKS", {
        "demo-table": tables.Block(("runs/c",), tables.vision_table, ("README.md", "docs/a.md"), "make demo"),
        "later": tables.Block(("runs/later",), tables.vision_table, ("README.md",), "a later demo")})
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    assert tables.main(["--check", "demo-table"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: the demo-table table in README.md, docs/a.md differs from what make demo wrote (runs/c); "
        "run make readme-table and commit the pages"]
    assert tables.main([]) == 0  # the block whose demo has not run is skipped
    assert "later: runs/later does not exist, skipped" in capsys.readouterr().out
    assert tables.main(["later"]) == 2
    assert capsys.readouterr().err.strip() == "error: runs/later does not exist: run a later demo first"
    assert "| fairgrape | 0.8 |" in (tmp_path / "docs/a.md").read_text()
    assert (tmp_path / "README.md").read_text().startswith("intro\n<!-- demo-table:start -->\n| method |")
    assert tables.main(["--check"]) == 0
    edited = (tmp_path / "README.md").read_text().replace("0.900", "0.901")
    (tmp_path / "README.md").write_text(edited)
    capsys.readouterr()
    assert tables.main(["--check"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: the demo-table table in README.md differs from what make demo wrote (runs/c); "
                   "run make readme-table and commit the pages"]
    assert (tmp_path / "README.md").read_text() == edited  # --check changes nothing
    assert tables.main(["--check", "nothing"]) == 2
    assert capsys.readouterr().err.strip() == "error: no table named nothing; the tables: demo-table, later"


def test_a_check_that_compared_nothing_fails(tmp_path, monkeypatch, capsys):
    (tmp_path / "README.md").write_text("intro\n<!-- demo-table:start -->\n<!-- demo-table:end -->\nend\n")
    monkeypatch.setattr(tables, "BLOCKS", {
        "demo-table": tables.Block(("runs/c",), tables.vision_table, ("README.md",), "make demo")})
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    assert tables.main(["--check"]) == 1  # no demo has run: nothing was compared
    assert "nothing was checked" in capsys.readouterr().err
    assert tables.main([]) == 0  # writing skips what has not run, as before
