"""A vision run whose writes stop fitting (a full disk; here a file-size limit, ``RLIMIT_FSIZE``,
which makes a write past it fail as a full disk does) ends with one ``error:`` line naming the file,
no traceback, and no file cut short under a valid-looking name: checkpoints and ``config.yaml`` are
written beside their target and renamed over it.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from processes import clean_env

ROOT = Path(__file__).resolve().parents[1]
DATA = ["--data.synthetic_size", "300", "--data.image_size", "32", "--data.batch_size", "16"]
FAST = {"limit_train_batches": 2, "limit_val_batches": 2, "limit_test_batches": 2, "accelerator": "cpu",
        "enable_progress_bar": False, "enable_model_summary": False}


def limited(max_bytes: int):
    """For a child process: no file it writes may grow past ``max_bytes`` (EFBIG, as ENOSPC on a
    full disk; SIGXFSZ ignored so the write fails instead of killing the process)."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return apply


def run(script: str, args: list[str], max_bytes: int, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=cwd, preexec_fn=limited(max_bytes),
                          env=clean_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                          timeout=600)


def one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot write") and "File too large" in last, done.stderr[-3000:]
    assert [line for line in done.stderr.splitlines() if line.startswith("error:")] == [last]
    return last


def no_cut_files(out: Path) -> None:
    files = [p for p in out.rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix == ".ckpt" or p.name.endswith(".tmp")], files
    for config in out.rglob("config.yaml"):
        assert isinstance(yaml.safe_load(config.read_text()), dict)  # whole, never cut short


@pytest.mark.parametrize("max_bytes, what", [(200_000, "checkpoint"), (2_048, "configuration")])
def test_train_fit_into_a_full_disk(max_bytes, what, dense_ckpt, tmp_path):
    # dense_ckpt: the synthetic data set is in the shared cache already, so the run writes only its folder.
    out = tmp_path / "runs"
    done = run("train.py", ["fit", "--config", str(ROOT / "configs" / "vision" / "demo.yaml"), "--trainer.max_epochs", "1",
                            "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
                            "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
                            "--trainer.logger.init_args.save_dir", str(out), *DATA], max_bytes, tmp_path)
    last = one_line(done)
    assert what in last and str(out) in last
    no_cut_files(out)
    if what == "configuration":
        assert not list(out.rglob("config.yaml"))
    else:
        assert (out / "demo" / "dense" / "config.yaml").is_file()


def test_prune_vision_into_a_full_disk(dense_ckpt, tmp_path):
    out = tmp_path / "pruned"
    done = run("prune.py", ["vision", "--ckpt", str(dense_ckpt), "--pruning.method", "magnitude",
                            "--pruning.target_sparsity", "0.5", "--output", str(out), "--reference", "dense",
                            "--deploy", "false", "--trainer", json.dumps(FAST)], 200_000, tmp_path)
    last = one_line(done)
    assert "checkpoint" in last and str(out) in last
    no_cut_files(out)
    assert os.path.getsize(dense_ckpt) > 200_000  # the input was read, never written
