"""What the LM commands leave in ``--output``: one complete run or nothing.

- A rerun interrupted while it saves leaves the previous complete run as it was (the new run is
  written beside the folder and swapped in whole at the end), and no temporary folder behind; a
  swap stopped midway leaves ``INCOMPLETE`` in the folder, and the next run completes it.
- A model with NaN / inf weights is refused right after loading, and a pruning that produces one is
  refused before anything is written: one line each, exit status 2.
- A disk too small for the result is found right after loading, before any work; a write that fails
  (disk full) is one line and leaves the previous folder as it was.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import types
from pathlib import Path

import pandas as pd
import pytest
import torch
import transformers as tf
import yaml

from fairprune.causal.families import family_of, linear_weight
from fairprune.cli.prune import main as prune_main
from tiny_models import tiny_gpt2_folder

FAST = ["--nsamples", "2", "--seqlen", "32", "--device", "cpu", "--quiet", "--dense_cache", "false", "--eval_tokens", "256"]


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory) -> dict:
    """A tiny GPT-2 folder (a BPE tokenizer trained on the bundled corpus) and short texts."""
    from fairprune.data.prompts import holistic_prompts
    from fairprune.data.text import stereo_pairs

    root = tmp_path_factory.mktemp("lm")
    tiny_gpt2_folder(root)
    rows = ["sent_more,sent_less,stereo_antistereo"] + [f'"{a}","{b}",stereo' for a, b in stereo_pairs()[::30]]
    (root / "pairs.csv").write_text("\n".join(rows) + "\n")
    holistic_prompts(["gender_and_sex"]).groupby("bucket").head(6).to_csv(root / "prompts.csv", index=False)
    return {"root": root, "model": root / "dense",
            "fasp": ["--prompts", str(root / "prompts.csv"), "--max_new_tokens", "2", "--seqlen", "32", "--device", "cpu",
                     "--gamma", "0.25", "--alpha", "0.25", "--calib_text", str(root / "eval.txt")],
            "texts": ["--eval_text", str(root / "eval.txt"), "--calib_text", str(root / "eval.txt"),
                      "--pairs", str(root / "pairs.csv")]}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file of a run folder (but the lock) by content."""
    return {p.name: _digest(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != ".lock"}


def _last_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: "), err[-5:]
    assert not any("Traceback" in line for line in err)
    return err[-1]


def _interrupted(call) -> None:
    """``call()`` is stopped by Ctrl-C: it raises ``KeyboardInterrupt`` or, through the command
    line's guard, says so in one line and returns 130."""
    try:
        status = call()
    except KeyboardInterrupt:
        return
    assert status == 130


def _prune(lm_folder, method: str, sparsity: str, out: Path, model: Path | None = None) -> int:
    return prune_main([method, "--model", str(model or lm_folder["model"]), "--sparsity", sparsity,
                       *lm_folder["texts"], *FAST, "--output", str(out)])


def _spy_on_work(monkeypatch) -> list[str]:
    """Record (and still run) the first step of the work: the dense measurement of the LM commands,
    the head scoring run of fasp."""
    import fairprune.runs.fasp as fasp_package
    import fairprune.workflows.lm as lm_workflow

    calls: list[str] = []
    for module, name in ((lm_workflow, "dense_of"), (fasp_package, "run_fasp")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    return calls


def _nm_rows(model) -> bool:
    """Whether every prunable layer holds at most 2 nonzeros in every 4 consecutive input columns."""
    family = family_of(model)
    for block in family.block_list(model):
        for layer in family.block_linears(block).values():
            W = linear_weight(layer)
            if int((W.reshape(W.shape[0], -1, 4) != 0).sum(-1).max()) > 2:
                return False
    return True


# --------------------------------------------------------------------------------------------
# Item 3: one complete run per folder
# --------------------------------------------------------------------------------------------


def test_a_rerun_interrupted_while_saving_leaves_the_previous_complete_run(lm_folder, tmp_path, monkeypatch):
    from fairprune.reporting import runs

    out = tmp_path / "runs" / "m"
    assert _prune(lm_folder, "magnitude", "0.5", out) == 0
    before = _snapshot(out)
    assert "model.safetensors" in before and "report.json" in before

    real_write_text = runs.write_text
    seen: list[Path] = []

    def interrupt_after_the_weights(path, text):  # the run is killed right after its weights are written
        seen.append(Path(path).parent)
        assert (Path(path).parent / "model.safetensors").is_file()
        raise KeyboardInterrupt

    monkeypatch.setattr(runs, "write_text", interrupt_after_the_weights)
    _interrupted(lambda: _prune(lm_folder, "magnitude", "2:4", out))
    assert seen, "the save was not reached"
    # The folder still holds exactly the complete 0.5 run: report, config, sparsity and weights agree.
    assert _snapshot(out) == before
    report = json.loads((out / "report.json").read_text())
    assert yaml.safe_load((out / "config.yaml").read_text())["sparsity"] == "0.5"
    assert report["achieved_sparsity"] == pytest.approx(0.5, abs=0.02)
    assert pd.read_csv(out / "sparsity.csv")["sparsity"].tolist() == pytest.approx([0.5] * 8, abs=0.02)
    assert not _nm_rows(tf.AutoModelForCausalLM.from_pretrained(out))
    assert sorted(p.name for p in out.parent.iterdir()) == ["m"]  # the interrupted run's staging is gone

    # A clean rerun replaces the run as a whole and leaves no temporary folder beside it.
    monkeypatch.setattr(runs, "write_text", real_write_text)
    assert _prune(lm_folder, "magnitude", "2:4", out) == 0
    assert yaml.safe_load((out / "config.yaml").read_text())["sparsity"] == "2:4"
    assert _nm_rows(tf.AutoModelForCausalLM.from_pretrained(out))
    assert sorted(p.name for p in out.parent.iterdir()) == ["m"]
    assert not (out / ".lock").exists()


KILL_PLUGIN = """
import os
import signal

from fairprune.reporting import runs


def _killed(path, text):  # the process dies right after the weights are written
    os.kill(os.getpid(), signal.SIGKILL)


runs.write_text = _killed
"""


def test_a_run_killed_while_saving_leaves_the_previous_run_and_the_next_run_cleans_up(lm_folder, tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "m"
    assert _prune(lm_folder, "magnitude", "0.5", out) == 0
    (out / "notes.txt").write_text("mine\n")  # not a run's file: never removed
    before = _snapshot(out)
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "kill_on_save.py").write_text(KILL_PLUGIN)
    env = {**os.environ, "FAIRPRUNE_PLUGINS": "kill_on_save", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "plugins"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(root / "prune.py"), "magnitude", "--model", str(lm_folder["model"]),
                           "--sparsity", "2:4", *lm_folder["texts"], *FAST, "--output", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == -9, done.stderr[-2000:]
    assert _snapshot(out) == before  # still exactly the complete 0.5 run
    assert yaml.safe_load((out / "config.yaml").read_text())["sparsity"] == "0.5"

    assert _prune(lm_folder, "magnitude", "2:4", out) == 0  # takes over the dead run's lock
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "plugins"]  # no temporary folder left beside it
    assert (out / "notes.txt").read_text() == "mine\n"
    assert yaml.safe_load((out / "config.yaml").read_text())["sparsity"] == "2:4"
    assert _nm_rows(tf.AutoModelForCausalLM.from_pretrained(out))


def test_a_swap_stopped_midway_says_the_folder_is_incomplete_and_the_next_run_completes_it(lm_folder, tmp_path,
                                                                                           monkeypatch):
    import fairprune.storage.folders as folders

    out = tmp_path / "m"
    assert _prune(lm_folder, "magnitude", "0.5", out) == 0
    real_replace, moves = os.replace, []

    def stopped_after_two_moves(src, dst):  # the process stops in the instant between two renames of the swap
        if out in (Path(src).parent, Path(dst).parent) and not Path(src).name.startswith("."):  # not a temp file's
            if len(moves) == 2:
                raise KeyboardInterrupt
            moves.append(src)
        real_replace(src, dst)

    monkeypatch.setattr(folders.os, "replace", stopped_after_two_moves)
    _interrupted(lambda: _prune(lm_folder, "magnitude", "2:4", out))
    monkeypatch.setattr(folders.os, "replace", real_replace)
    assert Path(moves[0]).name == "report.json"  # the previous run's report leaves first
    assert not (out / "report.json").exists() and (out / "INCOMPLETE").is_file()  # not a finished run, and it says so
    staging = [p for p in tmp_path.iterdir() if p.name.startswith(".m.partial-")]
    assert len(staging) == 1 and str(staging[0]) in (out / "INCOMPLETE").read_text()  # the new run, complete, is named

    assert _prune(lm_folder, "magnitude", "2:4", out) == 0
    assert not (out / "INCOMPLETE").exists() and (out / "report.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert _nm_rows(tf.AutoModelForCausalLM.from_pretrained(out))


def test_fasp_keeps_its_scoring_journal_and_replaces_the_previous_run_whole(lm_folder, tmp_path):
    out = tmp_path / "f"
    assert _prune(lm_folder, "magnitude", "0.5", out) == 0
    args = ["fasp", "--model", str(lm_folder["model"]), *lm_folder["fasp"], "--quiet", "--output", str(out)]
    assert prune_main(args) == 0
    assert not (out / "sparsity.csv").exists()  # the magnitude run left as a whole
    assert json.loads((out / "report.json").read_text())["method"] == "fasp"
    journal = (out / "head_scores.csv").read_text()
    assert len(pd.read_csv(out / "head_scores.csv")) == 5  # the unpruned model + 4 heads
    assert prune_main(args) == 0  # resumes from the journal, which the swap kept: every head is scored already
    assert (out / "head_scores.csv").read_text() == journal
    assert {"report.json", "config.yaml", "model.safetensors", "heads_heatmap.png", "head_scores.json"} <= set(_snapshot(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]
    assert _prune(lm_folder, "magnitude", "0.5", out) == 0  # and a magnitude run replaces the fasp run whole
    assert not {"head_scores.csv", "head_scores.json", "heads_heatmap.png"} & set(_snapshot(out))


# --------------------------------------------------------------------------------------------
# Item 4: non-finite models
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["inf", "NaN"])
def broken_model(request, lm_folder) -> tuple[Path, str, str]:
    """The tiny model with one inf or NaN weight: (folder, parameter name, kind)."""
    model = tf.GPT2LMHeadModel.from_pretrained(lm_folder["model"])
    name = "transformer.h.1.mlp.c_fc.weight"
    with torch.no_grad():
        model.get_parameter(name)[3, 5] = float(request.param.lower())
    folder = lm_folder["root"] / f"broken-{request.param}"
    if not folder.exists():
        model.save_pretrained(folder)
        tf.AutoTokenizer.from_pretrained(lm_folder["model"]).save_pretrained(folder)
    return folder, name, request.param


@pytest.mark.parametrize("command", ["magnitude", "wanda", "sparsegpt", "evaluate", "fasp", "compare"])
def test_a_model_with_nonfinite_weights_is_refused_at_once(command, broken_model, lm_folder, tmp_path, capsys,
                                                           monkeypatch):
    folder, name, kind = broken_model
    measured = _spy_on_work(monkeypatch)
    out = tmp_path / "out"
    argv = {"evaluate": ["evaluate", *lm_folder["texts"], "--seqlen", "32", "--eval_tokens", "256", "--device", "cpu"],
            "fasp": ["fasp", *lm_folder["fasp"]],
            "compare": ["compare", "--methods", "[magnitude]", "--sparsities", '["0.5"]', *lm_folder["texts"], *FAST]}
    args = argv.get(command, [command, "--sparsity", "0.5", *lm_folder["texts"], *FAST])
    assert prune_main([*args, "--model", str(folder), "--quiet", "--output", str(out)]) == 2
    last = _last_error(capsys)
    assert name in last and kind in last and "input model" in last and "broken" in last
    assert not out.exists() or not any(out.iterdir())  # nothing written
    assert not measured  # refused before any measuring


LM_PLUGIN_NAME = "to-inf-test"


def test_a_pruning_that_produces_nonfinite_weights_writes_nothing(lm_folder, tmp_path, capsys):
    from fairprune.pruning import registry
    from fairprune.pruning.registry import Method

    def poison(W, _, sparsity, **__):
        W = W.clone()
        W[0, 0] = float("inf")
        return W

    registry.register(Method(LM_PLUGIN_NAME, "lm", "writes an inf (test)", selection=poison, uses_data=False))
    try:
        out = tmp_path / "out"
        assert _prune(lm_folder, LM_PLUGIN_NAME, "0.5", out) == 2
    finally:
        registry.unregister(LM_PLUGIN_NAME, "lm")
    last = _last_error(capsys)
    assert "inf" in last and "transformer.h.0." in last and "produced" in last
    assert not out.exists() or not any(out.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["out"])  # and nothing beside it


# --------------------------------------------------------------------------------------------
# Item 9: a full disk
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["sparsegpt", "fasp"])
def test_too_little_free_space_is_found_before_any_work(command, lm_folder, tmp_path, capsys, monkeypatch):
    import shutil

    measured = _spy_on_work(monkeypatch)
    asked: list[bool] = []

    def little(path):
        asked.append(Path(path).is_dir())
        return types.SimpleNamespace(total=10**9, used=10**9 - 50_000, free=50_000)

    monkeypatch.setattr(shutil, "disk_usage", little)
    out = tmp_path / "new" / "run"
    args = (["fasp", *lm_folder["fasp"]] if command == "fasp"
            else [command, "--sparsity", "0.5", *lm_folder["texts"], *FAST])
    assert prune_main([*args, "--model", str(lm_folder["model"]), "--quiet", "--output", str(out)]) == 2
    last = _last_error(capsys)
    assert "space" in last and str(out) in last
    assert not measured  # before any measuring or pruning
    assert asked and all(asked)  # the nearest existing folder was asked
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("failure", ["oserror", "safetensors"])
def test_a_full_disk_while_saving_is_one_line_and_keeps_the_previous_run(failure, lm_folder, tmp_path, capsys,
                                                                         monkeypatch):
    from safetensors import SafetensorError

    out = tmp_path / "m"
    assert _prune(lm_folder, "magnitude", "0.5", out) == 0
    before = _snapshot(out)
    capsys.readouterr()

    def full(self, folder, *args, **kwargs):
        Path(folder, "config.json").write_text("{}")  # what a save cut short leaves: a config without weights
        if failure == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28) at path "x"')

    monkeypatch.setattr(tf.PreTrainedModel, "save_pretrained", full)
    assert _prune(lm_folder, "magnitude", "2:4", out) == 2
    last = _last_error(capsys)
    assert "No space left on device" in last and str(out) in last
    assert _snapshot(out) == before  # the previous complete run, as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no half folder beside it

    fresh = tmp_path / "fresh"
    assert _prune(lm_folder, "magnitude", "0.5", fresh) == 2
    assert "No space left on device" in _last_error(capsys)
    assert not fresh.exists() or not any(fresh.iterdir())
