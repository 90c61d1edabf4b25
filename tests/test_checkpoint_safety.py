"""Checkpoints are data: a file whose pickle would run code is refused in one line and runs nothing;
``--resume`` / ``--ckpt_path`` take only a checkpoint that fits the run; ``train.py validate`` and
``test`` never write over the fit's files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fairprune.cli.prune import main as prune_main
from fairprune.cli.train import main as train_main

ROOT = Path(__file__).resolve().parents[1]
FAST = {"limit_train_batches": 2, "limit_val_batches": 2, "limit_test_batches": 2, "accelerator": "cpu",
        "enable_progress_bar": False}
PRUNING = ["--pruning.method", "magnitude", "--pruning.target_sparsity", "0.5", "--pruning.keep_per_iter", "0.5"]
TRAIN = ["--config", str(ROOT / "configs" / "vision" / "demo.yaml"), "--trainer.limit_train_batches", "2",
         "--trainer.limit_val_batches", "2", "--trainer.limit_test_batches", "2", "--trainer.accelerator", "cpu",
         "--trainer.enable_progress_bar", "false", "--data.synthetic_size", "150", "--data.image_size", "32",
         "--data.batch_size", "16"]


class _WritesMarker:
    """Unpickled, it creates ``marker``: what a crafted checkpoint could do with any other call."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def _error(capsys, status: int) -> str:
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "code-ran"


@pytest.fixture
def evil_ckpt(dense_ckpt, tmp_path, marker) -> Path:
    """A real dense checkpoint, shaped as Lightning writes it, with one crafted object in its
    hyper-parameters."""
    state = torch.load(dense_ckpt, map_location="cpu", weights_only=True)
    state["hyper_parameters"]["note"] = _WritesMarker(marker)
    path = tmp_path / "evil.ckpt"
    torch.save(state, path)
    return path


@pytest.fixture(scope="module")
def pruned_run(dense_ckpt, tmp_path_factory) -> Path:
    """A finished ``prune.py vision`` run (magnitude, one step)."""
    out = tmp_path_factory.mktemp("pruned")
    assert prune_main(["vision", "--ckpt", str(dense_ckpt), *PRUNING, "--output", str(out),
                       "--trainer", json.dumps(FAST)]) == 0
    return out / "magnitude"


# --------------------------------------------------------------------------------------------
# 1. A checkpoint runs no code
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["vision", "compare", "resume", "train-test"])
def test_a_checkpoint_that_would_run_code_is_refused_in_one_line(command, evil_ckpt, dense_ckpt, marker, tmp_path, capsys):
    out = str(tmp_path / "out")
    if command == "vision":
        status = prune_main(["vision", "--ckpt", str(evil_ckpt), *PRUNING, "--output", out, "--trainer", json.dumps(FAST)])
    elif command == "compare":
        status = prune_main(["compare", "--ckpt", str(evil_ckpt), "--methods", "[magnitude]", "--sparsities", "[0.5]",
                             "--output", out, "--trainer", json.dumps(FAST)])
    elif command == "resume":
        status = prune_main(["vision", "--ckpt", str(dense_ckpt), *PRUNING, "--output", out, "--trainer", json.dumps(FAST),
                             "--resume", str(evil_ckpt)])
    else:
        status = train_main(["test", *TRAIN, "--trainer.logger.init_args.save_dir", out, "--ckpt_path", str(evil_ckpt)])
    line = _error(capsys, status)
    assert not marker.exists(), "unpickling the checkpoint ran its code"
    assert str(evil_ckpt) in line and "code" in line
    assert ("prune.py vision" if command == "resume" else "train.py") in line  # what to pass instead
    assert not (Path(out) / "magnitude" / "config.yaml").exists()


def test_a_model_folder_whose_weights_would_run_code_is_refused_in_one_line(tmp_path, marker, capsys):
    from transformers import GPT2Config

    from fairprune.data.text import lm_corpus, train_bpe_tokenizer

    folder = tmp_path / "model"
    tokenizer = train_bpe_tokenizer(lm_corpus(train_docs=20, validation_docs=2, seed=0).train, 280, folder)
    GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=32, vocab_size=len(tokenizer)).save_pretrained(folder)
    torch.save({"transformer.wte.weight": _WritesMarker(marker)}, folder / "pytorch_model.bin")
    status = prune_main(["magnitude", "--model", str(folder), "--sparsity", "0.5", "--device", "cpu",
                         "--output", str(tmp_path / "out")])
    line = _error(capsys, status)
    assert not marker.exists()
    assert str(folder) in line and "code" in line


def test_checkpoints_fairprune_writes_load_as_plain_data(pruned_run):
    """A pruning run's checkpoint holds plain data only (no objects of the optimizer's settings), so
    it loads with ``weights_only=True`` and no allow-list, and records its model and data classes."""
    state = torch.load(pruned_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert state["hyper_parameters"]["_class_path"] == "fairprune.models.vision.VisionClassifier"
    assert state["datamodule_hyper_parameters"]["_class_path"] == "fairprune.data.faces.FaceDataModule"


def test_a_real_checkpoint_still_tests_through_train_py(dense_ckpt, tmp_path):
    out = tmp_path / "runs"
    assert train_main(["test", *TRAIN, "--trainer.logger.init_args.save_dir", str(out), "--ckpt_path", str(dense_ckpt)]) == 0
    assert json.loads((out / "demo" / "dense" / "test" / "report.json").read_text())["split"] == "test"


# --------------------------------------------------------------------------------------------
# 7. --resume and --ckpt_path are checked before anything runs
# --------------------------------------------------------------------------------------------


def _truncated(source: Path, tmp_path: Path) -> Path:
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    return cut


@pytest.mark.parametrize("which", ["dense", "missing", "truncated", "other-settings"])
def test_resume_takes_only_a_checkpoint_of_this_run(which, dense_ckpt, pruned_run, tmp_path, capsys):
    last = pruned_run / "checkpoints" / "last.ckpt"
    resume = {"dense": dense_ckpt, "missing": tmp_path / "nothing.ckpt", "truncated": _truncated(last, tmp_path),
              "other-settings": last}[which]
    kept = {f.name: f.read_bytes() for f in pruned_run.iterdir() if f.is_file() and f.name != ".lock"}
    # The same run folder, so a check made too late would overwrite the earlier run's files.
    pruning = ["--pruning.target_sparsity", "0.75"] if which == "other-settings" else []
    status = prune_main(["vision", "--ckpt", str(dense_ckpt), *PRUNING, *pruning, "--output", str(pruned_run.parent),
                         "--trainer", json.dumps(FAST), "--resume", str(resume)])
    line = _error(capsys, status)
    assert str(resume) in line
    if which == "dense":
        assert "--ckpt" in line and "IterativePruning" in line
    if which == "other-settings":
        assert "schedule" in line
    assert {f.name: f.read_bytes() for f in pruned_run.iterdir() if f.is_file() and f.name != ".lock"} == kept


@pytest.mark.parametrize("which", ["missing", "truncated"])
def test_train_py_ckpt_path_missing_or_cut_is_one_line(which, dense_ckpt, tmp_path, capsys):
    path = tmp_path / "nothing.ckpt" if which == "missing" else _truncated(dense_ckpt, tmp_path)
    status = train_main(["fit", *TRAIN, "--trainer.max_epochs", "1", "--trainer.logger.init_args.save_dir",
                         str(tmp_path / "runs"), "--ckpt_path", str(path)])
    line = _error(capsys, status)
    assert str(path) in line
    assert not (tmp_path / "runs" / "demo" / "dense" / "metrics.csv").exists()


# --------------------------------------------------------------------------------------------
# 11. validate / test write beside the fit's files
# --------------------------------------------------------------------------------------------


def test_validate_and_test_keep_the_fits_files(tmp_path):
    args = [*TRAIN, "--trainer.logger.init_args.save_dir", str(tmp_path)]
    assert train_main(["fit", *args, "--trainer.max_epochs", "1"]) == 0
    run = tmp_path / "demo" / "dense"
    files = ("metrics.csv", "report.json", "config.yaml", "groups.csv", "sparsity.csv", "hparams.yaml")
    fitted = {name: (run / name).read_bytes() for name in files}
    last = str(run / "checkpoints" / "last.ckpt")
    assert train_main(["test", *args, "--ckpt_path", last]) == 0
    assert train_main(["validate", *args, "--ckpt_path", last]) == 0
    assert {name: (run / name).read_bytes() for name in files} == fitted
    assert json.loads(fitted["report.json"])["split"] == "val"
    for folder, split in (("test", "test"), ("validate", "val")):
        report = json.loads((run / folder / "report.json").read_text())
        assert report["split"] == split and report["groups"]
        assert (run / folder / "metrics.csv").read_text().count("\n") >= 2
        assert (run / folder / "config.yaml").is_file() and (run / folder / "groups.csv").is_file()
    # Run again, the test replaces its own files only.
    assert train_main(["test", *args, "--ckpt_path", last]) == 0
    assert {name: (run / name).read_bytes() for name in files} == fitted
    assert not (run / "test" / "test").exists()
