"""Faults of issue #38 (third probe): each is one line, before any work, with nothing lost.

- An output equal to, inside or holding what a ``--model`` value resolves to on disk (a GGUF
  model's converted folder, a hub name's cached snapshot) is refused, not only the literal value.
- Task files: every row checked (fields, ranges such as BBQ's label), rows and files bounded in
  size, an unknown task name and too many few-shot examples, all before the model loads; one task
  without brackets; ``--limit`` whole above 1 and only with ``--tasks``.
- A vision compare reuses finished cells whatever ``--quiet`` or its folder; a zip-bomb
  ``test_items.npz``; activations that overflow; an unwritable ``train.py`` run folder; a negative
  ``max_epochs`` in the pruning commands; a small HolisticBias set; a plugin named ``--help``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_output import last_error
from fairprune.cli.prune import main as prune_main
from fairprune.hub.converted import MARKER, converted_location
from test_faults_probe2 import FAST  # the command line's fast LM settings
from tiny_models import builder, tiny_gpt2_folder, write_gguf

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("probe3")
    tiny_gpt2_folder(root)
    return root


def _gguf(tmp_path: Path) -> Path:
    import torch

    from fairprune.data.text import lm_corpus, train_bpe_tokenizer

    corpus = lm_corpus(train_docs=20, validation_docs=2, seed=3)
    tokenizer = train_bpe_tokenizer(corpus.train, 300, tmp_path / "tok")
    torch.manual_seed(0)
    eos = tokenizer.eos_token_id
    model = builder("qwen2", vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                    tie_word_embeddings=False)()
    write_gguf(model, tokenizer, tmp_path / "m.gguf")
    return tmp_path / "m.gguf"


@pytest.mark.parametrize("where", ["is", "inside"])
def test_an_output_in_the_converted_folder_of_a_gguf_model_is_refused(where, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))
    gguf = _gguf(tmp_path)
    from fairprune.hub import cache_dir

    converted = converted_location(str(gguf), cache_dir())
    converted.mkdir(parents=True)
    (converted / MARKER).write_text("{}")
    output = converted if where == "is" else converted / "run"
    assert prune_main(["magnitude", "--model", str(gguf), "--output", str(output), *FAST]) == 2
    assert "the input" in last_error(capsys)
    assert sorted(p.name for p in converted.iterdir()) == [MARKER]  # nothing written, nothing replaced


def test_an_output_in_a_hub_names_cached_snapshot_is_refused(tiny, tmp_path, monkeypatch, capsys):
    import shutil

    hub = tmp_path / "hub"
    repo = hub / "models--someone--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    shutil.copytree(tiny / "dense", snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))  # read when called, not when imported
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    before = sorted(p.name for p in snapshot.iterdir())
    code = prune_main(["magnitude", "--model", "someone/tiny", "--output", str(snapshot), *FAST,
                       "--eval_text", str(tiny / "eval.txt")])
    assert code == 2 and "the input" in last_error(capsys)
    assert sorted(p.name for p in snapshot.iterdir()) == before


def test_quiet_and_a_moved_folder_reuse_a_finished_vision_compare(dense_ckpt, tmp_path, capsys):
    """--quiet (no progress bar) and another --output folder change no result: the finished cells of
    an earlier compare are reused, their files untouched."""
    import shutil

    from fairprune.workflows.options import VisionCompareOptions
    from fairprune.workflows.vision import compare_vision

    fast = {"max_epochs": 2, "limit_train_batches": 2, "limit_val_batches": 1, "limit_test_batches": 2,
            "accelerator": "cpu"}
    pruning = {"keep_per_iter": 0.5, "bn_recalibration": 2}
    first = tmp_path / "first"
    compare_vision(str(dense_ckpt), VisionCompareOptions(["magnitude"], [0.5], pruning, fast), str(first))
    capsys.readouterr()
    moved = tmp_path / "moved"
    shutil.move(first, moved)
    cell = moved / "magnitude_s0.5"
    kept = {f: f.stat().st_mtime_ns for f in cell.rglob("*") if f.is_file()}
    quiet = {**fast, "enable_progress_bar": False}
    compare_vision(str(dense_ckpt), VisionCompareOptions(["magnitude"], [0.5], pruning, quiet), str(moved))
    assert "finished earlier with the same settings, reusing" in capsys.readouterr().out
    assert {f: f.stat().st_mtime_ns for f in cell.rglob("*") if f.is_file()} == kept
    assert json.loads((cell / "report.json").read_text())["split"] == "test"


def test_a_zip_bomb_of_test_items_is_refused_before_it_is_inflated(tmp_path):
    """A 2 MB ``test_items.npz`` whose 'correct' array states 300 MB: refused from the zip's
    directory, nothing inflated."""
    import zipfile

    import numpy as np

    from fairprune.workflows.paired import ITEMS, BadItems, read_items

    n = 300 * 2**20
    with zipfile.ZipFile(tmp_path / ITEMS, "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open("correct.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array_header_1_0(member, {"descr": "|b1", "fortran_order": False, "shape": (n,)})
            zeros = bytes(2**20)
            for _ in range(300):
                member.write(zeros)
    assert (tmp_path / ITEMS).stat().st_size < 3 * 2**20
    with pytest.raises(BadItems, match="too large.*300 MiB"):
        read_items(tmp_path, groups=2)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_activations_that_overflow_are_one_line_and_nothing_is_written(dtype, tiny, tmp_path, capsys):
    """Finite weights whose activations overflow (a final norm scaled by 3·10⁴): float16 turns the
    loss to inf / nan, float32 gives a loss whose exp overflows; both are one line, nothing written."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny / "dense")
    with torch.no_grad():
        model.transformer.ln_f.weight.mul_(3e4)
    model.save_pretrained(tmp_path / "loud")
    AutoTokenizer.from_pretrained(tiny / "dense").save_pretrained(tmp_path / "loud")
    out = tmp_path / "out"
    code = prune_main(["magnitude", "--model", str(tmp_path / "loud"), "--dtype", dtype, "--eval_text",
                       str(tiny / "eval.txt"), "--output", str(out), *FAST])
    assert code == 2
    assert "perplexity cannot be measured" in last_error(capsys)
    assert not out.exists()


def test_train_fit_into_a_folder_it_cannot_write_is_one_line(locked, capsys):
    from fairprune.cli.train import main as train_main

    root = Path(__file__).resolve().parents[1]
    code = train_main(["fit", "--config", str(root / "configs" / "vision" / "demo.yaml"), "--trainer.max_epochs", "1",
                       "--trainer.accelerator", "cpu", "--trainer.logger.init_args.save_dir", str(locked / "runs"),
                       "--data.synthetic_size", "100", "--data.image_size", "32"])
    assert code == 2
    err = last_error(capsys)
    assert "cannot write to the run folder" in err and "Permission denied" in err
    assert list(locked.iterdir()) == []


@pytest.mark.parametrize("command", ["vision", "compare"])
def test_negative_max_epochs_is_refused_by_the_pruning_commands_too(command, dense_ckpt, tmp_path, capsys):
    args = ["--ckpt", str(dense_ckpt), "--output", str(tmp_path / "out"), "--trainer", "{max_epochs: -2}"]
    args += ["--pruning", "{method: magnitude}"] if command == "vision" else ["--methods", "[magnitude]", "--sparsities", "[0.5]"]
    assert prune_main([command, *args]) == 2
    assert "max_epochs -2: give a number of epochs >= 0" in last_error(capsys)
    assert not (tmp_path / "out").exists()


def test_a_small_prompt_set_splits_every_subgroup_into_both_parts_or_says_why_first(tiny, tmp_path, capsys,
                                                                                      monkeypatch):
    import pandas as pd

    import fairprune.workflows.opened as opened
    from fairprune.data.prompts import split_prompts

    rows = [(f"The {d} person number {i} is", "gender_and_sex", b, d)
            for b, d in [("binary", "female"), ("binary", "male"), ("transgender", "trans"), ("non_binary", "queer")]
            for i in range(2)]
    frame = pd.DataFrame(rows, columns=["text", "axis", "bucket", "descriptor"])
    val, test = split_prompts(frame, stratify="descriptor")  # 8 prompts: too few for a plain stratified split
    assert val.descriptor.nunique() == test.descriptor.nunique() == 4 and len(val) + len(test) == 8

    frame.iloc[:5].to_csv(tmp_path / "few.csv", index=False)  # three subgroups with one prompt each
    monkeypatch.setattr(opened, "load_model", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    out = tmp_path / "out"
    code = prune_main(["fasp", "--model", str(tiny / "dense"), "--prompts", str(tmp_path / "few.csv"),
                       "--output", str(out), "--quiet"])
    assert code == 2
    assert "give every subgroup at least two prompts" in last_error(capsys)
    assert not out.exists()


@pytest.mark.parametrize("command", ["fasp", "compare"])
def test_quiet_head_commands_print_no_progress_bars(command, tiny, tmp_path, capfd):
    args = ["--model", str(tiny / "dense"), "--output", str(tmp_path / "out"), "--quiet", "--max_new_tokens", "2",
            "--seqlen", "32", "--gamma", "0.25", "--calib_text", str(tiny / "eval.txt")]
    args += ["--alpha", "0.25"] if command == "fasp" else ["--methods", "[fasp, random]", "--alphas", "[0.25]"]
    capfd.readouterr()
    assert prune_main([command, *args]) == 0
    printed = "".join(capfd.readouterr())
    assert "it/s]" not in printed and "Loading weights" not in printed and "Writing model" not in printed


@pytest.mark.parametrize("name", ["--help", "-x", "My Method", "", "a/b", "x;rm", "1st", "ok-"])
def test_a_plugin_method_name_must_be_a_name(name):
    from fairprune.errors import UserError
    from fairprune.pruning import registry
    from fairprune.pruning.registry import Method

    with pytest.raises(UserError, match="is not a name"):
        registry.register(Method(name, "lm", "a toy", selection="fairprune.pruning.llm:magnitude_solve", uses_data=False))
    assert name not in registry.names("lm")


@pytest.mark.parametrize("args, needle", [
    (["--limit", "1.5", "--tasks", "[mmlu]"], "--limit 1.5: above 1 it counts documents, so give a whole number"),
    (["--limit", "3"], "--limit sets how lm-eval runs the --tasks, and no --tasks are given"),
    (["--num_fewshot", "2"], "--num_fewshot sets how lm-eval runs the --tasks, and no --tasks are given"),
])
def test_limit_and_fewshot_mistakes_are_one_line(args, needle, tiny, tmp_path, capsys):
    assert prune_main(["evaluate", "--model", str(tiny / "dense"), "--output", str(tmp_path / "ev"), *args]) == 2
    assert needle in last_error(capsys) and not (tmp_path / "ev").exists()


def test_one_task_and_one_task_file_need_no_brackets():
    from fairprune.pruning.options import LMOptions

    lm = LMOptions(model="m", tasks="bbq_ambig", task_data="bbq=/data/BBQ/Age.jsonl")
    assert lm.tasks == ["bbq_ambig"] and lm.task_data == ["bbq=/data/BBQ/Age.jsonl"]


def test_the_command_line_takes_one_task_without_brackets(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))
    assert prune_main(["evaluate", "--model", str(tiny / "dense"), "--eval_text", str(tiny / "eval.txt"), "--seqlen", "32",
                       "--eval_tokens", "256", "--quiet", "--tasks", "mmlu", "--limit", "4",
                       "--output", str(tmp_path / "ev")]) == 0
    assert json.loads((tmp_path / "ev" / "report.json").read_text())["tasks"]["facts"]["mmlu"]["samples"] == 4


def _bbq_file(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("change, needle", [
    (lambda r: r.pop("context_condition"), "line 7 lacks the field 'context_condition'"),
    (lambda r: r.update(context_condition="maybe"), "line 7 has context_condition 'maybe', not ambig or disambig"),
    (lambda r: r.update(label=-1), "line 7 has label -1, not 0, 1 or 2"),
    (lambda r: r.update(label=3), "line 7 has label 3, not 0, 1 or 2"),
])
def test_every_row_of_a_task_file_is_checked_before_the_model_loads(change, needle, tiny, tmp_path, capsys,
                                                                  monkeypatch):
    import fairprune.workflows.lm as lm
    from fairprune.data.yardsticks import bbq_items

    rows = bbq_items(4)[:9]
    change(rows[6])  # past the first five rows
    path = _bbq_file(tmp_path / "bbq.jsonl", rows)
    monkeypatch.setattr(lm, "open_blocks", lambda *a, **k: pytest.fail("the model was opened before the check"))
    code = prune_main(["evaluate", "--model", str(tiny / "dense"), "--tasks", "[bbq_ambig]", "--task_data",
                       f"[bbq={path}]", "--output", str(tmp_path / "ev")])
    assert code == 2
    err = last_error(capsys)
    assert needle in err and str(path) in err and not (tmp_path / "ev").exists()


def test_an_oversized_task_row_is_refused_without_reading_it_whole(tmp_path):
    from fairprune.data.task_files import MAX_ROW_BYTES, check_format
    from fairprune.data.yardsticks import bbq_items
    from fairprune.errors import UserError

    rows = bbq_items(4)
    rows[1]["context"] = "x" * (2 * MAX_ROW_BYTES)
    path = _bbq_file(tmp_path / "big.jsonl", rows)
    with pytest.raises(UserError, match="line 2 is longer than 1 MiB"):
        check_format("bbq", path)


@pytest.mark.parametrize("args, needle", [
    (["--tasks", "[mmlu, hellaswagg]"], "'hellaswagg' is neither a task fairprune defines"),
    (["--tasks", "[mmlu]", "--num_fewshot", "500"], "--num_fewshot 500: task mmlu can draw at most 59 examples"),
])
def test_a_task_lm_eval_cannot_run_is_one_line_before_the_model_loads(args, needle, tiny, tmp_path, capsys,
                                                                    monkeypatch):
    import fairprune.workflows.lm as lm

    monkeypatch.setattr(lm, "open_blocks", lambda *a, **k: pytest.fail("the model was opened before the check"))
    assert prune_main(["evaluate", "--model", str(tiny / "dense"), *args, "--output", str(tmp_path / "ev")]) == 2
    assert needle in last_error(capsys) and not (tmp_path / "ev").exists()
