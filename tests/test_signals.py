"""Runs stopped from outside and runs stopped by a mistake: SIGTERM (a scheduler's preemption) ends a
run with status 143, one ``error:`` line and a last checkpoint that resumes; Ctrl-C ends every command
with status 130 and one line; a user mistake prints its ``error:`` line alone and leaves no empty
run folder behind."""

from __future__ import annotations

import functools
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fairprune.cli.prune import main as prune_main
from fairprune.cli.train import main as train_main
from processes import clean_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models on a shared 2-core machine: threads only thrash
DEMO = ROOT / "configs" / "vision" / "demo.yaml"
SMALL_DATA = ["--data.synthetic_size", "300", "--data.image_size", "32", "--data.batch_size", "8"]
QUIET_TRAINER = ["--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
                 "--trainer.enable_model_summary", "false"]


class Command:
    """A command line run in a subprocess from ``cwd``, its output collected as it comes."""

    def __init__(self, script: str, args: list[str], cwd: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ROOT / script), *args], cwd=cwd, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=clean_env(OMP_NUM_THREADS="1"))
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._drain, args=(s, into), daemon=True)
                         for s, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _drain(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    def wait_for(self, ready, timeout: float = 90) -> None:
        """Wait until ``ready()`` holds; fail if the process ends first."""
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, f"ended before it was signalled:\n{''.join(self.err)[-3000:]}"
            assert time.monotonic() < deadline, "never got there"
            time.sleep(0.05)

    def terminate(self, timeout: float = 90) -> int:
        self.proc.send_signal(signal.SIGTERM)
        status = self.proc.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=10)
        return status

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _last_stderr_line(lines: list[str]) -> str:
    text = "".join(lines)
    assert "Traceback" not in text, text[-3000:]
    return text.strip().splitlines()[-1]


# --------------------------------------------------------------------------------------------
# SIGTERM: exit 143, one line, a last checkpoint that resumes
# --------------------------------------------------------------------------------------------


def test_sigterm_stops_train_fit_with_a_checkpoint_that_resumes(tmp_path):
    runs = tmp_path / "runs"
    args = ["fit", "--config", str(DEMO), *SMALL_DATA, *QUIET_TRAINER, "--trainer.max_epochs", "100",
            "--trainer.limit_train_batches", "5", "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
            "--trainer.logger.init_args.save_dir", str(runs)]
    last = runs / "demo" / "dense" / "checkpoints" / "last.ckpt"
    run = Command("train.py", args, tmp_path)
    try:
        run.wait_for(last.is_file)  # the first epoch ended: the run is inside the second one
        first_epoch_steps = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
        status = run.terminate()
    finally:
        run.kill()
    assert status == 143
    line = _last_stderr_line(run.err)
    found = re.fullmatch(r"error: stopped by SIGTERM at epoch (\d+); run the same command again with "
                         r"--ckpt_path (\S+) to resume", line)
    assert found, line
    assert Path(found.group(2)) == last
    saved = torch.load(last, map_location="cpu", weights_only=False)
    assert saved["epoch"] == int(found.group(1)) >= 1
    assert saved["global_step"] > first_epoch_steps  # the work after the last epoch's end is kept

    resumed = [a if a != "100" else str(saved["epoch"] + 1) for a in args]
    assert train_main([*resumed, "--ckpt_path", str(last)]) == 0
    finished = torch.load(last, map_location="cpu", weights_only=False)
    assert finished["epoch"] == saved["epoch"] and finished["global_step"] > saved["global_step"]
    assert (runs / "demo" / "dense" / "report.json").is_file()


# Two pruning steps, one retraining epoch each, a few batches: the stop lands in epoch 0, right
# after the first step; degradation against the checkpoint itself (no continued dense training).
PRUNING = {"keep_per_iter": 0.7, "retrain_epochs": 1, "bn_recalibration": 0, "importance_fraction": 0.1}
TRAINER = {"accelerator": "cpu", "enable_progress_bar": False, "enable_model_summary": False,
           "limit_train_batches": 3, "limit_val_batches": 1, "limit_test_batches": 1}
PRUNE_ARGS = ["--pruning.method", "magnitude", "--pruning.target_sparsity", "0.5",
              *[arg for key, value in PRUNING.items() for arg in (f"--pruning.{key}", str(value))],
              "--trainer", json.dumps(TRAINER), "--data.batch_size", "8", "--reference", "dense"]


def test_sigterm_stops_prune_vision_with_a_checkpoint_that_resume_takes(dense_ckpt, tmp_path):
    out = tmp_path / "out"
    args = ["vision", "--ckpt", str(dense_ckpt), "--output", str(out), *PRUNE_ARGS]
    run = Command("prune.py", args, tmp_path)
    try:
        run.wait_for(lambda: any("magnitude step 1/" in line for line in run.out))  # epoch 0 has begun
        status = run.terminate()
    finally:
        run.kill()
    assert status == 143
    line = _last_stderr_line(run.err)
    last = out / "magnitude" / "checkpoints" / "last.ckpt"
    assert line == f"error: stopped by SIGTERM at epoch 0; run the same command again with --resume {last} to resume"
    saved = torch.load(last, map_location="cpu", weights_only=False)  # no epoch had ended: saved at the stop
    assert saved["epoch"] == 0
    assert not (out / "magnitude" / ".lock").exists()

    assert prune_main([*args, "--resume", str(last)]) == 0
    report = (out / "magnitude" / "report.json").read_text()
    assert '"split": "test"' in report


def test_sigterm_stops_compare_naming_the_cell_and_the_same_command_resumes(dense_ckpt, tmp_path):
    out = tmp_path / "grid"
    args = ["compare", "--ckpt", str(dense_ckpt), "--output", str(out), "--methods", "[magnitude]",
            "--sparsities", "[0.5]", "--pruning", json.dumps(PRUNING), "--trainer", json.dumps(TRAINER),
            "--data", json.dumps({"batch_size": 8}), "--reference", "dense"]
    run = Command("prune.py", args, tmp_path)
    try:
        run.wait_for(lambda: any("magnitude step 1/" in line for line in run.out))
        status = run.terminate()
    finally:
        run.kill()
    assert status == 143
    line = _last_stderr_line(run.err)
    assert line == ("error: stopped by SIGTERM at epoch 0 of cell magnitude_s0.5; run the same command again to "
                    "resume (finished cells are reused, this one resumes from its last checkpoint)")
    assert (out / "magnitude_s0.5" / "checkpoints" / "last.ckpt").is_file()
    assert prune_main(args) == 0
    assert (out / "comparison.csv").is_file()


# --------------------------------------------------------------------------------------------
# Ctrl-C: exit 130, one line, for every command
# --------------------------------------------------------------------------------------------


def _interrupting(function):
    @functools.wraps(function)  # the same signature: prune.py builds the options from it
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    return interrupted


@pytest.mark.parametrize("command", ["magnitude", "evaluate"])
def test_ctrl_c_in_an_lm_command_is_one_line_and_status_130(command, tmp_path, capsys, monkeypatch):
    from fairprune.workflows import lm

    name = {"magnitude": "prune_lm", "evaluate": "evaluate_lm"}[command]
    monkeypatch.setattr(lm, name, _interrupting(getattr(lm, name)))
    assert prune_main([command, "--model", "some/model", "--output", str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err == "error: interrupted (Ctrl-C); run the same command again\n"


@pytest.fixture
def python_sigint():
    """Python's own Ctrl-C handler for the test, whatever the test run inherited (a run started in
    the background of a non-interactive shell begins with SIGINT ignored); the inherited one after."""
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, outer)


def test_ctrl_c_in_a_lightning_fit_is_one_line_and_status_130(tmp_path, capsys, monkeypatch, python_sigint):
    from fairprune.models.vision import VisionClassifier

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(VisionClassifier, "training_step", interrupted)
    status = train_main(["fit", "--config", str(DEMO), *SMALL_DATA, *QUIET_TRAINER, "--trainer.max_epochs", "1",
                         "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")])
    assert status == 130
    assert capsys.readouterr().err == ("error: interrupted (Ctrl-C) at epoch 0; no checkpoint of this run was written "
                                       "yet: run the same command again\n")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C works again after the command


# --------------------------------------------------------------------------------------------
# A user mistake: its error line alone, and no empty folder left behind
# --------------------------------------------------------------------------------------------


def test_prune_vision_missing_ckpt_is_one_line_and_leaves_no_folder(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(ROOT / "prune.py"), "vision", "--ckpt", str(tmp_path / "missing.ckpt"),
                           "--output", str(out)], cwd=tmp_path, capture_output=True, text=True, env=clean_env())
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("error: checkpoint "), done.stderr
    assert not out.exists()


def test_train_fit_data_root_that_is_a_file_is_one_line_saying_so(tmp_path):
    afile = tmp_path / "faces.txt"
    afile.write_text("not a folder\n")
    runs = tmp_path / "runs"
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "fit", "--config", str(DEMO), "--data.root", str(afile),
                           "--trainer.accelerator", "cpu", "--trainer.logger.init_args.save_dir", str(runs)],
                          cwd=tmp_path, capture_output=True, text=True, env=clean_env())
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: ") and "is a file, not a folder" in done.stderr
    assert "does not exist" not in done.stderr
    assert not runs.exists()
    assert afile.read_text() == "not a folder\n"


def test_a_real_dataset_root_that_is_a_file_says_it_is_a_file(tmp_path):
    from fairprune.data.faces import FaceDataModule
    from fairprune.errors import UserError

    afile = tmp_path / "UTKFace.zip"
    afile.write_bytes(b"PK")
    with pytest.raises(UserError, match="is a file, not a folder"):
        FaceDataModule("utkface", root=str(afile))
