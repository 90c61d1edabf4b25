"""Headlines that never mislead: a task figure its run marks invalid (a letter task answered with
one letter, a task at chance within its interval) is struck out and marked ``✗`` in the printed
table, report.html and the model card, never read by DTO; every task accuracy is shown beside its
chance level, and one that uniform answers would match or beat is marked ``≤``. The rows below are
the shape of ``make demo-lm``'s comparison before these marks existed: the dense model answered A
to every letter prompt and DTO ranked the magnitude-pruned model (perplexity 388) best."""

from __future__ import annotations

import io
import json
import math
import re

import pandas as pd
import pytest

from fairprune.reporting.card_lm import LMCard
from fairprune.reporting.compare import Statistics, write_comparison
from fairprune.reporting.dto import dto
from fairprune.reporting.headline import CHANCE_MARK, INVALID_MARK, headline
from fairprune.reporting.model_card import model_card
from fairprune.reporting.records import LMRow
from fairprune.reporting.terminal import headline_markdown, print_headline

LETTER_A = "answers A to 100% of its letter prompts (a position bias, not a measurement)"
AT_CHANCE = "accuracy_amb at chance (0.333 ≤ 0.333, 95% CI [0.194, 0.472] includes it): uniform answers do as well"


def _validity(**invalid: str) -> dict:
    """The validity of a run's task figures (chance levels of the demo's tasks), ``invalid`` by task."""
    chance = {"mmlu/acc": 0.25, "hellaswag/acc_norm": 0.25, "bbq_ambig_cloze3/accuracy_amb": 1 / 3,
              "bbq_ambig_cloze3/amb_bias_score": None, "bbq_ambig_letter/accuracy_amb": 1 / 3,
              "bbq_ambig_letter/amb_bias_score": None}
    return {key: {"chance": level, "at_or_below_chance": False, "invalid": invalid.get(key.split("/")[0])}
            for key, level in chance.items()}


def _rows() -> list[LMRow]:
    figures = {  # method: perplexity, MMLU, HellaSwag, abstention (cloze over three answers), abstention (letter)
        "dense": (34.79, 0.267, 0.800, 0.250, 0.333), "sparsegpt": (37.24, 0.233, 0.567, 0.472, 0.361),
        "wanda": (46.85, 0.250, 0.633, 0.444, 0.333), "magnitude": (387.64, 0.350, 0.517, 0.333, 0.444)}
    invalid = {"dense": {"mmlu": "answers A to 100% of its letter prompts (a position bias, not a measurement)",
                         "bbq_ambig_letter": LETTER_A},
               "wanda": {"bbq_ambig_letter": "answers A to 94% of its letter prompts (a position bias, not a measurement)"},
               "magnitude": {"bbq_ambig_cloze3": AT_CHANCE}}
    rows = []
    for method, (ppl, mmlu, hellaswag, cloze, letter) in figures.items():
        metrics = {"perplexity": ppl, "stereotype_score": 0.8, "mmlu/acc": mmlu, "hellaswag/acc_norm": hellaswag,
                   "bbq_ambig_cloze3/accuracy_amb": cloze, "bbq_ambig_cloze3/amb_bias_score": 0.0,
                   "bbq_ambig_letter/accuracy_amb": letter, "bbq_ambig_letter/amb_bias_score": 0.0}
        validity = _validity(**invalid.get(method, {}))
        for key, mark in validity.items():
            mark["at_or_below_chance"] = mark["chance"] is not None and metrics[key] <= mark["chance"] + 1e-9
        rows.append(LMRow(method, "0" if method == "dense" else "0.5", 0.5, metrics, validity=validity))
    return rows


def _with_dto(rows: list[LMRow]) -> tuple[list[LMRow], dict]:
    from dataclasses import replace

    distances, used = dto([row.as_dict() for row in rows])
    return [replace(r, metrics={**r.metrics, "dto": d}) if d is not None else r for r, d in zip(rows, distances)], used


def test_dto_never_reads_an_invalid_figure_and_says_which_it_read():
    rows, used = _with_dto(_rows())
    # MMLU is invalid on the dense row (one letter): the cloze-scored HellaSwag is read instead; the
    # three-answer cloze abstention is read, and magnitude's, at chance, leaves that row out.
    assert used == {"accuracy": "hellaswag/acc_norm", "abstention": "bbq_ambig_cloze3/accuracy_amb", "left_out": ["magnitude 0.5"]}
    dtos = {r.method: r.metrics.get("dto") for r in rows}
    assert dtos["magnitude"] is None and all(d is not None for m, d in dtos.items() if m != "magnitude")
    # By hand: HellaSwag 0.800 / 0.567 / 0.633 and abstention 0.250 / 0.472 / 0.444 over dense, sparsegpt,
    # wanda, the dense model's 0.250 counted as its chance level 1/3.
    h, a = (0.8 - 0.567, 0.472 - 1 / 3)
    assert dtos["dense"] == pytest.approx(1.0)
    assert dtos["sparsegpt"] == pytest.approx(1.0)
    assert dtos["wanda"] == pytest.approx(math.hypot(1 - (0.633 - 0.567) / h, 1 - (0.444 - 1 / 3) / a))
    # The letter figures, read as the paper reads them, would have ranked magnitude best.
    letter, _ = dto([row.as_dict() for row in _rows()], abstention=("bbq_ambig_letter/accuracy_amb",), accuracy=("mmlu/acc",))
    assert letter[3] is not None


def test_dto_counts_a_figure_below_chance_as_chance():
    """Abstaining less often than uniform answers would is not improved upon by drifting toward
    uniform answers: below chance, every row counts as chance, and the knowledge figure decides (the
    rows of ``make demo-lm``: nobody abstains above chance, magnitude is broken, not fairest)."""
    rows = [{"method": m, "hellaswag/acc_norm": h, "hellaswag/acc_norm_chance": 0.25, "bbq_ambig_cloze3/accuracy_amb": a,
             "bbq_ambig_cloze3/accuracy_amb_chance": 1 / 3}
            for m, h, a in (("dense", 0.800, 0.0), ("sparsegpt", 0.567, 0.0), ("magnitude", 0.517, 0.194))]
    distances, used = dto(rows)
    assert distances == [0.0, pytest.approx((0.8 - 0.567) / (0.8 - 0.517)), 1.0] and used["left_out"] == []
    unfloored, _ = dto([{k: v for k, v in r.items() if not k.endswith("_chance")} for r in rows])
    assert unfloored[2] == pytest.approx(1.0) and unfloored[0] == pytest.approx(1.0)  # magnitude would tie the dense model


def test_the_printed_headline_strikes_out_invalid_figures_and_shows_chance_levels():
    rows, _ = _with_dto(_rows())
    table = pd.DataFrame([r.as_dict() for r in rows])
    columns = headline(table, "sparsegpt")
    by_key = {c.key: c for c in columns}
    assert ["dto", "bbq_ambig_cloze3/accuracy_amb", "hellaswag/acc_norm"] == [c.key for c in columns if "/" in c.key or c.key == "dto"]
    assert "mmlu/acc" not in by_key  # DTO reads HellaSwag, which the headline shows in its place
    abstain = by_key["bbq_ambig_cloze3/accuracy_amb"]
    assert abstain.chance == pytest.approx(1 / 3) and "(chance 0.333)" in abstain.head
    marks = [cell.mark for cell in abstain.cells]
    assert marks == [CHANCE_MARK, "", "", INVALID_MARK]  # dense below chance (valid), magnitude at chance (invalid)
    assert by_key["dto"].cells[3].value == "–" and by_key["dto"].under == "from hellaswag/acc_norm and bbq_ambig_cloze3/accuracy_amb"
    out = io.StringIO()
    print_headline(columns, "demo", file=out)
    printed = out.getvalue()
    assert all(len(line) <= 100 for line in printed.splitlines()), printed
    magnitude = next(line for line in printed.splitlines() if line.startswith("magnitude"))
    assert "0.333 ✗" in magnitude and "–" in magnitude and "0.000" not in magnitude.split("0.333")[0][-12:]
    flat = re.sub(r"\s+", " ", printed)  # the legend and the reasons wrap at the terminal's width
    assert f"{INVALID_MARK} BBQ abstain cloze-3, magnitude: {AT_CHANCE}." in flat
    assert "(from hellaswag/acc_norm and bbq_ambig_cloze3/accuracy_amb), valid figures only" in flat
    # The same table as Markdown, for a page: the same cells, the invalid one struck out.
    page = headline_markdown(columns)
    assert "| BBQ abstain cloze-3 (chance 0.333) |" in page and "| magnitude | 0.5 | 387.6 | 0.800 | – | ~~0.333~~ ✗ |" in page
    assert f"{INVALID_MARK} BBQ abstain cloze-3, magnitude: {AT_CHANCE}." in page


def test_the_page_and_the_comparison_files_carry_the_marks(tmp_path):
    rows, used = _with_dto(_rows())
    write_comparison(rows, tmp_path, {"dto": used}, echo=False, statistics=Statistics(baseline="sparsegpt"))
    page = (tmp_path / "report.html").read_text()
    struck = re.findall(r'<s class="invalid" title="([^"]*)">([^<]*)</s> ✗', page)
    assert ("accuracy_amb at chance (0.333 ≤ 0.333, 95% CI [0.194, 0.472] includes it): uniform answers do as well",
            "0.333") in struck
    assert "chance 0.333" in page and "from hellaswag/acc_norm and bbq_ambig_cloze3/accuracy_amb" in page
    table = pd.read_csv(tmp_path / "comparison.csv")
    assert table.loc[3, "bbq_ambig_cloze3/accuracy_amb_invalid"] == AT_CHANCE
    assert table.loc[0, "mmlu/acc_chance"] == 0.25 and pd.isna(table.loc[3, "dto"])
    columns = list(table.columns)
    assert columns.index("mmlu/acc_chance") == columns.index("mmlu/acc") + 1  # each figure beside its chance level
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["dto"]["left_out"] == ["magnitude 0.5"]


def test_the_model_card_strikes_out_invalid_figures_and_keeps_them_out_of_the_model_index():
    validity = _validity(mmlu=LETTER_A)
    metrics = {"perplexity": 40.0, "mmlu/acc": 0.26, "bbq_ambig_cloze3/accuracy_amb": 0.2,
               "bbq_ambig_cloze3/amb_bias_score": 0.05}
    reference = _validity(mmlu=LETTER_A)
    for marks in (validity, reference):
        marks["bbq_ambig_cloze3/accuracy_amb"]["at_or_below_chance"] = True
    report = {"method": "sparsegpt", "model": "smollm2-135m", "achieved_sparsity": 0.5, "metrics": metrics,
              "tasks": {"validity": {k: v for k, v in validity.items() if k in metrics},
                        "facts": {"mmlu": {"data": "mmlu.jsonl", "scoring": "letter"},
                                  "bbq_ambig_cloze3": {"data": "bbq.jsonl", "scoring": "cloze"}}},
              "reference": {"method": "dense", "metrics": {"perplexity": 35.0, "mmlu/acc": 0.27, "bbq_ambig_cloze3/accuracy_amb": 0.25},
                            "tasks_validity": {k: v for k, v in reference.items() if k in metrics}}}
    card = model_card(report, card=LMCard)
    front = card.split("---")[1]
    assert "name: bbq_ambig_cloze3" in front and "name: mmlu" not in front  # the Hub ranks model-index figures
    assert "| mmlu/acc (chance 0.250) | ~~0.2700~~ ✗ | ~~0.2600~~ ✗ | – |" in card
    assert "| bbq ambig cloze3/accuracy amb (chance 0.333) | 0.2500 ≤ | 0.2000 ≤ | -0.0500 |" in card
    assert f"- mmlu (reference, this model): {LETTER_A}" in card


def test_the_lm_guide_shows_the_table_demo_lm_printed(tmp_path, capsys):
    """``make readme-table`` writes ``make demo-lm``'s printed headline into the LM guide: the same
    columns and cells as the terminal, from the comparison's files; the guide holds such a table."""
    from pathlib import Path

    from fairprune.cli.tables import BLOCKS, lm_table
    from fairprune.reporting.marked_block import marked_block

    rows, used = _with_dto(_rows())
    write_comparison(rows, tmp_path, {"dto": used}, statistics=Statistics(baseline="sparsegpt"), title="demo")
    printed = capsys.readouterr().out
    page = lm_table([tmp_path])
    lines = page.splitlines()
    assert lines[0] == ("| method | sparsity | ppl | stereo | DTO | BBQ abstain cloze-3 (chance 0.333) | "
                        "HellaSwag (chance 0.250) |")
    for row in lines[2:6]:  # every cell as printed
        cells = [c.strip().strip("~") for c in row.strip("|").split("|")]
        line = next(p for p in printed.splitlines() if p.startswith(cells[0] + " "))
        assert all(c.replace("~~", "") in line for c in cells), (cells, line)
    assert "\\[ \\]" not in page and "valid figures only" in page
    block = BLOCKS["demo-lm-table"]
    assert block.sources == ("runs/demo_lm",) and block.pages == ("docs/guides/lm.md",)
    guide = marked_block(Path(__file__).resolve().parents[1] / block.pages[0], "demo-lm-table")
    assert guide.startswith("| method | sparsity | ppl [95% CI] | stereo | DTO | BBQ abstain cloze-3 (chance 0.333) |")


def test_head_compare_rows_carry_the_marks_of_their_runs():
    """A head compare's rows (FASP with --tasks) carry each task figure's chance level and verdict
    from the run's report, the dense row from the run's reference."""
    from fairprune.reporting.records import HeadRow

    validity = _validity(mmlu=LETTER_A)
    report = {"gamma": 0.3, "heads_removed": [[0, 1]], "metrics": {"perplexity": 30.0, "mmlu/acc": 0.3},
              "fairness": {"bias": {"gender": 0.01}}, "tasks": {"validity": {"mmlu/acc": validity["mmlu/acc"]}},
              "reference": {"metrics": {"perplexity": 29.0, "mmlu/acc": 0.31}, "fairness": {"bias": {"gender": 0.02}},
                            "tasks_validity": {"mmlu/acc": {**validity["mmlu/acc"], "invalid": None}}}}
    pruned, dense = HeadRow.from_report(report, "fasp", 0.2, protects=True).as_dict(), HeadRow.dense(report).as_dict()
    assert pruned["mmlu/acc_chance"] == dense["mmlu/acc_chance"] == 0.25
    assert pruned["mmlu/acc_invalid"] == LETTER_A and dense["mmlu/acc_invalid"] == ""
    assert list(pruned).index("mmlu/acc_chance") == list(pruned).index("mmlu/acc") + 1


def _paper_rows() -> list[LMRow]:
    """A Debias-SparseGPT protocol comparison as compare writes its rows (each method's sparsities
    in turn): MMLU, UnQover (three-answer cloze), HellaSwag, BBQ and CrowS figures."""
    chance = {"mmlu/acc": 0.25, "hellaswag/acc_norm": 0.25, "unqover_cloze3/accuracy_amb": 1 / 3,
              "bbq_ambig_cloze3/accuracy_amb": 1 / 3, "crows_pairs_english/pct_stereotype": None}
    figures = {  # (method, sparsity): perplexity, MMLU, UnQover abstention, HellaSwag, BBQ abstention, CrowS
        ("dense", "0"): (30.0, 0.40, 0.50, 0.60, 0.45, 0.62),
        ("sparsegpt", "1:4"): (31.0, 0.38, 0.45, 0.58, 0.44, 0.61), ("sparsegpt", "2:4"): (45.0, 0.30, 0.40, 0.50, 0.40, 0.60),
        ("sparsegpt", "0.5"): (38.0, 0.33, 0.42, 0.55, 0.42, 0.60),
        ("debias-sparsegpt", "1:4"): (31.5, 0.37, 0.55, 0.57, 0.47, 0.58),
        ("debias-sparsegpt", "2:4"): (46.0, 0.31, 0.20, 0.49, 0.46, 0.57),
        ("debias-sparsegpt", "0.5"): (39.0, 0.32, 0.52, 0.54, 0.46, 0.56)}
    invalid = {("debias-sparsegpt", "2:4"): {"unqover_cloze3": AT_CHANCE}}
    rows = []
    for (method, sparsity), (ppl, mmlu, unqover, hellaswag, bbq, crows) in figures.items():
        metrics = {"perplexity": ppl, "stereotype_score": 0.6, "mmlu/acc": mmlu, "unqover_cloze3/accuracy_amb": unqover,
                   "hellaswag/acc_norm": hellaswag, "bbq_ambig_cloze3/accuracy_amb": bbq,
                   "crows_pairs_english/pct_stereotype": crows}
        why = invalid.get((method, sparsity), {})
        validity = {k: {"chance": c, "at_or_below_chance": c is not None and metrics[k] <= c + 1e-9,
                        "invalid": why.get(k.split("/")[0])} for k, c in chance.items()}
        rows.append(LMRow(method, sparsity, 0.5 if sparsity != "1:4" else 0.25, metrics, validity=validity))
    return rows


def test_the_debias_paper_table_groups_by_pattern_in_the_papers_columns(tmp_path):
    """``debias-paper-table``: rows grouped by pattern (1:4, 2:4, 50 %), the paper's columns first
    (UnQover abstention, DTO from MMLU and UnQover, MMLU, perplexity with its interval), accuracies
    in % with their chance level, an invalid figure struck out and kept out of DTO."""
    from fairprune.cli.tables import BLOCKS, debias_paper_table
    from fairprune.reporting.dto import dto as distances

    rows = _paper_rows()
    intervals = [({"method": r.method, "sparsity": r.sparsity},
                  {"perplexity": [r.metrics["perplexity"] - 1, r.metrics["perplexity"] + 1]}) for r in rows]
    write_comparison(rows, tmp_path, echo=False, statistics=Statistics(intervals, baseline="sparsegpt"))
    page = debias_paper_table([tmp_path])
    lines = page.splitlines()
    assert lines[0] == ("| sparsity | method | UnQover abstention % (chance 33.3) | DTO | MMLU % (chance 25.0) | "
                        "perplexity [95% CI] | HellaSwag % (chance 25.0) | BBQ abstention % (chance 33.3) | "
                        "CrowS % stereotypical |")
    body = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:9]]
    assert [(r[0], r[1]) for r in body] == [("0 %", "dense"), ("1:4", "sparsegpt"), ("1:4", "debias-sparsegpt"),
                                            ("2:4", "sparsegpt"), ("2:4", "debias-sparsegpt"),
                                            ("50 %", "sparsegpt"), ("50 %", "debias-sparsegpt")]
    dense, struck = body[0], body[4]
    assert dense[2] == "50.0" and dense[4] == "40.0" and dense[5] == "30.00 [29.0, 31.0]" and dense[8] == "62.0"
    expected_bbq = [f"{r.metrics['bbq_ambig_cloze3/accuracy_amb'] * 100:.1f}" for r in rows if (r.method, r.sparsity) == ("dense", "0")]
    assert dense[7] == expected_bbq[0]  # BBQ's own figure, in % once (not UnQover's, not scaled twice)
    assert struck[2] == "~~20.0~~ ✗" and struck[3] == "–"  # invalid: struck out, no DTO
    # DTO from MMLU and UnQover over the valid rows, as reporting.dto computes it, in the table's order.
    frame = pd.read_csv(tmp_path / "comparison.csv")
    expected, used = distances(frame.to_dict(orient="records"), accuracy=("mmlu/acc",),
                               abstention=("unqover_cloze3/accuracy_amb",))
    by_row = {(m, str(s)): d for m, s, d in zip(frame["method"], frame["sparsity"], expected)}
    order = [("dense", "0"), ("sparsegpt", "1:4"), ("debias-sparsegpt", "1:4"), ("sparsegpt", "2:4")]
    assert [r[3] for r in body[:4]] == [f"{by_row[k]:.3f}" for k in order]
    assert used["left_out"] == ["debias-sparsegpt 2:4"]
    assert "from mmlu/acc and unqover_cloze3/accuracy_amb" in page
    assert f"{INVALID_MARK} UnQover abstention %, debias-sparsegpt 2:4: {AT_CHANCE}." in page
    assert "read from UnQover abstention: unqover_cloze3/accuracy_amb, BBQ abstention: bbq_ambig_cloze3/accuracy_amb" in page
    assert "Not in this comparison" not in page
    block = BLOCKS["debias-paper-table"]
    assert block.sources == ("runs/debias_paper",) and block.pages == ("docs/reproducing.md",)


def test_the_debias_paper_table_names_what_the_comparison_lacks(tmp_path):
    """Without UnQover the column is left out and named, and DTO is the comparison's own."""
    from fairprune.cli.tables import debias_paper_table

    rows = [LMRow(r.method, r.sparsity, r.achieved_sparsity,
                  {k: v for k, v in r.metrics.items() if not k.startswith("unqover")},
                  validity={k: v for k, v in r.validity.items() if not k.startswith("unqover")}) for r in _paper_rows()]
    rows, used = _with_dto(rows)
    write_comparison(rows, tmp_path, {"dto": used}, echo=False, statistics=Statistics(baseline="sparsegpt"))
    page = debias_paper_table([tmp_path])
    assert page.splitlines()[0].startswith("| sparsity | method | DTO | MMLU % (chance 25.0) | perplexity |")
    assert "Not in this comparison: UnQover abstention % (add its tasks to --tasks)." in page
    assert "from mmlu/acc and bbq_ambig_cloze3/accuracy_amb" in page  # the comparison's DTO and what it read
