"""``--tasks`` on the LM commands: lm-eval's figures in report.json, with intervals, the paired
difference against the dense model and the task cache; compare's table with DTO; and the one-line
errors of a bad ``--tasks`` / ``--task_data``, before any work and with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from cli_output import last_error
from fairprune.cli.prune import main as prune_main
from tiny_models import tiny_gpt2_folder

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory, one_thread) -> Path:
    root = tmp_path_factory.mktemp("tasks-cli")
    tiny_gpt2_folder(root)
    return root


def _common(root: Path) -> list[str]:
    return ["--model", str(root / "dense"), "--eval_text", str(root / "eval.txt"), "--nsamples", "4", "--seqlen", "32",
            "--eval_tokens", "1024", "--device", "cpu", "--quiet"]


def test_evaluate_and_prune_report_task_figures_with_intervals_and_paired(tiny_lm, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))
    tasks = ["--tasks", "[mmlu, bbq_ambig_letter]", "--limit", "30"]
    assert prune_main(["evaluate", *_common(tiny_lm), *tasks, "--output", str(tmp_path / "eval")]) == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["tasks"]["facts"]["mmlu"]["samples"] == 30 and report["tasks"]["facts"]["limit"] == 30
    assert report["tasks"]["facts"]["bbq_ambig_letter"]["scoring"] == "letter"
    assert 0 <= report["metrics"]["mmlu/acc"] <= 1 and "bbq_ambig_letter/amb_bias_score" in report["metrics"]
    low, high = report["ci"]["mmlu/acc"]
    assert low <= report["metrics"]["mmlu/acc"] <= high
    assert report["tasks"]["figures"]["bbq_ambig_letter"]["accuracy_amb"] == report["metrics"]["bbq_ambig_letter/accuracy_amb"]
    assert (tmp_path / "eval" / "task_items.json").is_file()

    assert prune_main(["sparsegpt", *_common(tiny_lm), *tasks, "--output", str(tmp_path / "sgpt")]) == 0
    pruned = json.loads((tmp_path / "sgpt" / "report.json").read_text())
    assert pruned["reference"]["tasks_from_cache"] is True  # evaluate scored the same weights on the same data
    assert pruned["reference"]["metrics"]["mmlu/acc"] == report["metrics"]["mmlu/acc"]
    paired = pruned["paired"]["mmlu/acc"]
    assert paired["difference"] == pytest.approx(pruned["metrics"]["mmlu/acc"] - report["metrics"]["mmlu/acc"])
    assert paired["ci"][0] <= paired["difference"] <= paired["ci"][1]
    # The model card: a figure the run marks invalid is struck out and kept out of the model index
    # the Hub ranks; a valid one is in it, named as lm-eval names it.
    card = (tmp_path / "sgpt" / "README.md").read_text()
    marks = pruned["tasks"]["validity"]
    assert marks["mmlu/acc"]["chance"] == 0.25 and marks["bbq_ambig_letter/accuracy_amb"]["chance"] == pytest.approx(1 / 3)
    for task in ("mmlu", "bbq_ambig_letter"):
        invalid = marks[f"{task}/{'acc' if task == 'mmlu' else 'accuracy_amb'}"]["invalid"]
        assert (f"task:\n      type: text-generation\n      name: {task}\n" in card) != bool(invalid), task
        if invalid:
            assert f"- {task} (" in card and invalid in card and "~~" in card
    assert "(chance 0.250)" in card


def test_compare_table_has_task_columns_chance_validity_dto_and_paired(tiny_lm, tmp_path, monkeypatch, capsys):
    """Each task figure comes with its chance level and its run's verdict (``<figure>_chance``,
    ``<figure>_invalid``); DTO reads only figures valid on its rows and names them; the printed
    headline strikes out what a run marks invalid and says why."""
    from fairprune.metrics.task_figures import ABSTENTION, KNOWLEDGE, valid

    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))
    assert prune_main(["compare", *_common(tiny_lm), "--methods", "[magnitude, wanda]", "--sparsities", "[0.5]",
                       "--tasks", "[mmlu, bbq_ambig_cloze3, bbq_ambig_letter, hellaswag]", "--limit", "20",
                       "--baseline", "dense", "--output", str(tmp_path / "cmp")]) == 0
    table = pd.read_csv(tmp_path / "cmp" / "comparison.csv")
    assert list(table["method"]) == ["dense", "magnitude", "wanda"]
    for column in ("mmlu/acc", "mmlu/acc_chance", "mmlu/acc_invalid", "bbq_ambig_cloze3/accuracy_amb_chance",
                   "hellaswag/acc_norm", "mmlu/acc_ci_low", "mmlu/acc_diff", "bbq_ambig_letter/amb_bias_score_invalid"):
        assert column in table.columns, column
    assert (table["mmlu/acc_chance"] == 0.25).all() and (table["bbq_ambig_cloze3/accuracy_amb_chance"] - 1 / 3).abs().max() < 1e-9
    report = json.loads((tmp_path / "cmp" / "report.json").read_text())
    used = report["dto"]
    assert used["accuracy"] in (*KNOWLEDGE, None) and used["abstention"] in (*ABSTENTION, None)
    rows = table.to_dict(orient="records")
    for row in rows:
        both = used["accuracy"] and used["abstention"] and valid(row, used["accuracy"]) and valid(row, used["abstention"])
        assert any(name.split()[0] == row["method"] for name in used["left_out"]) != bool(both)
        if "dto" in table.columns:
            assert (row["dto"] == row["dto"]) == bool(both)  # a DTO exactly where both figures are valid
    cell = json.loads((tmp_path / "cmp" / "wanda_0.5" / "report.json").read_text())
    for key, mark in cell["tasks"]["validity"].items():
        invalid = table.set_index("method").loc["wanda", f"{key}_invalid"]
        assert (mark["invalid"] or "") == ("" if invalid != invalid else invalid), key
    assert cell["reference"]["tasks_validity"]["mmlu/acc"]["chance"] == 0.25
    printed = capsys.readouterr().out
    marked = [k for k, m in cell["tasks"]["validity"].items() if m["invalid"]]
    if any(k.split("/")[0] in ("mmlu", "bbq_ambig_letter") for k in marked):  # a letter task answered with one letter
        assert "✗" in printed and "of its letter prompts" in printed
    shown = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "Δ mmlu/acc vs dense" in shown and "mmlu/acc_chance" in shown
    for cell_name in ("magnitude_0.5", "wanda_0.5"):
        assert (tmp_path / "cmp" / cell_name / "task_items.json").is_file()


@pytest.mark.parametrize("args, message", [
    (["--tasks", "[mmlu]", "--task_data", "[bbq=/nowhere/bbq.jsonl]"], "--task_data bbq=/nowhere/bbq.jsonl"),
    (["--tasks", "[mmlu]", "--task_data", "[mmlu]"], "is not NAME=PATH"),
    (["--tasks", "[mmlu]", "--task_data", "[wikitext=x.txt]"], "neither a data format"),
    (["--tasks", "[mmlu, mmlu]"], "names a task twice"),
    (["--tasks", "[mmlu]", "--limit", "-3"], "--limit must be a positive number"),
    (["--tasks", "[mmlu]", "--num_fewshot", "-1"], "--num_fewshot must be 0 or more"),
])
def test_task_mistakes_are_one_line_before_any_work(tiny_lm, tmp_path, capsys, args, message):
    assert prune_main(["sparsegpt", *_common(tiny_lm), *args, "--output", str(tmp_path / "out")]) == 2
    assert message in last_error(capsys)
    assert not (tmp_path / "out").exists()


def test_a_task_file_in_the_wrong_format_names_file_format_and_source(tiny_lm, tmp_path, capsys):
    wrong = tmp_path / "bbq.jsonl"
    wrong.write_text(json.dumps({"question": "What?", "choices": ["a", "b", "c", "d"], "answer": 1}) + "\n")
    assert prune_main(["evaluate", *_common(tiny_lm), "--tasks", "[bbq_ambig]", "--task_data", f"[bbq={wrong}]",
                       "--output", str(tmp_path / "out")]) == 2
    line = last_error(capsys)
    assert str(wrong) in line and "nyu-mll/BBQ" in line
    assert not (tmp_path / "out").exists()


def test_streamed_runs_score_tasks_through_the_block_reader_as_in_memory(tiny_lm, tmp_path, monkeypatch):
    """``--stream true --tasks``: lm-eval runs on the streamed model, each part read from the
    model's files by the pipeline's own reader as the forward reaches it, and gives the in-memory
    run's figures; while a block runs, it is the only part of the model resident."""
    from transformers import AutoTokenizer

    from fairprune.causal.streamed import StreamedModel
    from fairprune.metrics.harness import resolve_tasks
    from fairprune.pruning.options import LMOptions
    from fairprune.runs.tasks import measure_tasks

    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))
    tasks = ["--tasks", "[mmlu, bbq_ambig_letter]", "--limit", "20", "--dense_cache", "false"]
    for stream in ("false", "true"):
        assert prune_main(["sparsegpt", *_common(tiny_lm), *tasks, "--stream", stream, "--output", str(tmp_path / stream)]) == 0
    memory, streamed = (json.loads((tmp_path / s / "report.json").read_text()) for s in ("false", "true"))
    assert streamed["tasks"]["facts"]["streamed"]["largest_part_bytes"] > 0
    assert "streamed" not in memory["tasks"]["facts"]
    assert {k: v for k, v in streamed["metrics"].items() if "/" in k} == {k: v for k, v in memory["metrics"].items() if "/" in k}
    assert streamed["paired"]["mmlu/acc"] == memory["paired"]["mmlu/acc"]

    lm = LMOptions(model=str(tmp_path / "true"), tasks=["mmlu", "bbq_ambig_letter"], limit=20)
    specs = resolve_tasks(["mmlu", "bbq_ambig_letter"], {})
    sm = StreamedModel(tmp_path / "true")
    resident: list[int] = []
    for block in sm.blocks:  # registered before the reader's own hooks: it runs while the block is loaded
        block.register_forward_hook(
            lambda *_: resident.append(sum(p.numel() for p in sm.model.parameters() if p.device.type != "meta")))
    got = measure_tasks(sm, AutoTokenizer.from_pretrained(tmp_path / "true"), specs, lm, "cpu", progress=False)
    assert got.figures == streamed["tasks"]["figures"]
    assert resident and max(resident) == max(sum(p.numel() for p in b.parameters()) for b in sm.blocks)
    assert all(p.device.type == "meta" for p in sm.model.parameters())  # every part let go afterwards


def test_fasp_scores_the_tasks_before_and_after_removing_heads(tiny_lm, tmp_path, monkeypatch):
    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))
    code = prune_main(["fasp", "--model", str(tiny_lm / "dense"), "--scorer", "lexicon", "--max_new_tokens", "2",
                       "--gamma", "0.25", "--alpha", "0.5", "--calib_text", str(tiny_lm / "eval.txt"),
                       "--eval_text", str(tiny_lm / "eval.txt"), "--seqlen", "32", "--device", "cpu", "--quiet",
                       "--tasks", "[mmlu]", "--limit", "20", "--output", str(tmp_path / "fasp")])
    assert code == 0
    report = json.loads((tmp_path / "fasp" / "report.json").read_text())
    assert report["heads_removed"] and "mmlu/acc" in report["metrics"] and "mmlu/acc" in report["reference"]["metrics"]
    assert report["paired"]["mmlu/acc"]["difference"] == pytest.approx(
        report["metrics"]["mmlu/acc"] - report["reference"]["metrics"]["mmlu/acc"])
    assert (tmp_path / "fasp" / "task_items.json").is_file()


def test_task_data_points_every_task_of_a_format_at_a_users_file(tiny_lm, tmp_path, monkeypatch):
    """``--task_data bbq=FILE`` (a file in BBQ's public layout) serves bbq_ambig and bbq_ambig_letter;
    ``--task_data mmlu=FILE`` the MMLU task; the report names the files read."""
    from fairprune.data.yardsticks import bbq_items, mmlu_items

    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))
    bbq, mmlu = tmp_path / "Age.jsonl", tmp_path / "mmlu.jsonl"
    bbq.write_text("".join(json.dumps(row) + "\n" for row in bbq_items(8, seed=5)))
    mmlu.write_text("".join(json.dumps(row) + "\n" for row in mmlu_items(4, seed=5)))
    assert prune_main(["evaluate", *_common(tiny_lm), "--tasks", "[bbq_ambig, bbq_ambig_letter, mmlu]",
                       "--task_data", f"[bbq={bbq}, mmlu={mmlu}]", "--output", str(tmp_path / "eval")]) == 0
    facts = json.loads((tmp_path / "eval" / "report.json").read_text())["tasks"]["facts"]
    ambiguous = sum(row["context_condition"] == "ambig" for row in bbq_items(8, seed=5))
    assert facts["bbq_ambig"]["data"] == str(bbq) and facts["bbq_ambig"]["samples"] == ambiguous
    assert facts["bbq_ambig_letter"]["samples"] == ambiguous
    assert facts["mmlu"]["data"] == str(mmlu) and facts["mmlu"]["samples"] == len(mmlu_items(4, seed=5))


def test_evaluate_prints_unqover_abstention_with_chance_and_interval(tiny_lm, tmp_path, capsys, monkeypatch):
    """``prune.py evaluate --tasks [unqover_cloze3, unqover_letter_balanced] --task_data unqover=FILE
    --limit N`` on one of the generator's files: each headline figure printed with its interval and,
    for abstention, its chance level; a bad file refused in one line before the model loads."""
    from fairprune.data.unqover_standin import CLASSES, write_standin

    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))
    source = write_standin(tmp_path / "unqover") / CLASSES["religion"][0]
    args = ["evaluate", *_common(tiny_lm), "--tasks", "[unqover_cloze3, unqover_letter_balanced]", "--limit", "48"]
    capsys.readouterr()
    assert prune_main([*args, "--task_data", f"unqover={source}", "--output", str(tmp_path / "eval")]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    for task in ("unqover_cloze3", "unqover_letter_balanced"):
        value, (low, high) = report["metrics"][f"{task}/accuracy_amb"], report["ci"][f"{task}/accuracy_amb"]
        assert f"  {task}/accuracy_amb {value:.3f} [{low:.3f}, {high:.3f}] (chance 0.333)" in printed
        assert f"  {task}/mu " in printed and f"  {task}/eta " in printed
    assert report["tasks"]["facts"]["unqover_cloze3"]["samples"] == 12  # 48 questions: 12 pairs of twins
    assert set(report["tasks"]["figures"]["unqover_cloze3"]) >= {"accuracy_amb_religion", "mu_religion", "eta_religion"}
    broken = tmp_path / "broken.json"
    broken.write_text('{"a|b|c|d|0|x|y|y": {"context": "C"}}')
    assert prune_main([*args, "--task_data", f"unqover={broken}", "--output", str(tmp_path / "bad")]) != 0
    assert "has no q0.question" in last_error(capsys) and not (tmp_path / "bad").exists()
