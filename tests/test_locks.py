"""The run lock covers every folder a command writes, whatever the environment says about ranks,
and tells a live run from a process that merely got the same pid later.

- ``compare`` locks its cell folders (and the per-seed dense folders) before the first cell runs,
  so a second command into a cell is refused in one line, and compare is refused by a cell another
  run holds; the LM and head-pruning compares do the same for their per-run folders.
- ``RANK`` / ``LOCAL_RANK`` / ``SLURM_PROCID`` in the environment skip nothing: only a rank of a
  real process group, or a rank its lock's holder launched (Lightning's DDP), takes no lock.
- A lock records its process's start time and the boot: a pid that lives on as another process
  (after a reboot or a container restart) no longer blocks the folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli_output import last_error
from fairprune.cli.prune import main as prune_main
from fairprune.errors import UserError
from fairprune.storage.lock import RunLock

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = {"limit_train_batches": 2, "limit_val_batches": 2, "limit_test_batches": 2, "accelerator": "cpu",
        "enable_progress_bar": False, "enable_model_summary": False}
LINUX = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="process start times come from /proc")

_HOLDER = """
import sys
from fairprune.storage.lock import RunLock
locks = [RunLock(folder).acquire() for folder in sys.argv[1:]]
print("held", flush=True)
sys.stdin.read()  # until the test closes it
for lock in locks:
    lock.release()
"""


@contextlib.contextmanager
def held(*folders: Path) -> Iterator[int]:
    """Another process holding the locks of ``folders`` until the block ends; yields its pid."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, *map(str, folders)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc.pid
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def start_time(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat (after the command name, which may hold spaces)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def write_lock(folder: Path, pid: int, **fields) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / ".lock"
    lock.write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": "2024-01-01T00:00:00", **fields}))
    return lock


# --------------------------------------------------------------------------------------------
# Every folder a command writes is locked


def test_compare_is_refused_by_a_cell_another_run_holds(dense_ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    cell = out / "fairgrape_s0.5"
    args = ["compare", "--ckpt", str(dense_ckpt), "--methods", "[magnitude, fairgrape]", "--sparsities", "[0.5]",
            "--output", str(out), "--trainer", json.dumps(FAST)]
    with held(cell) as holder:
        assert prune_main(args) == 2
        err = last_error(capsys)
        assert "in use by another run" in err and str(cell) in err and f"pid {holder}" in err
        assert json.loads((cell / ".lock").read_text())["pid"] == holder  # the holder's lock is left alone
    # Refused before the first cell ran, and every lock compare took is gone again.
    assert not list(out.rglob("report.json")) and not (out / "comparison.csv").exists()
    assert not list(out.rglob(".lock"))


def test_compare_is_refused_by_a_dense_folder_another_run_holds(dense_ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["compare", "--ckpt", str(dense_ckpt), "--methods", "[magnitude]", "--sparsities", "[0.5]", "--seeds", "[0, 1]",
            "--dense_per_seed", "true", "--output", str(out), "--trainer", json.dumps(FAST)]
    with held(out / "seed1" / "dense"):
        assert prune_main(args) == 2
        assert str(out / "seed1" / "dense") in last_error(capsys)
    assert not list(out.rglob("*.ckpt"))  # not even seed 0's dense model was trained


def test_a_run_into_a_cell_of_a_running_compare_is_refused(dense_ckpt, tmp_path, monkeypatch, capsys):
    """While compare runs its first cell, ``prune.py vision`` into its second cell is refused at once."""
    from fairprune.workflows import vision
    from fairprune.workflows.options import VisionCompareOptions

    out, real, statuses = tmp_path / "out", vision._prune, []

    def first_cell(*args, **kwargs):
        if statuses:  # the probe's own run, should it get this far
            return real(*args, **kwargs)
        statuses.append(None)
        statuses.append(prune_main(["vision", "--ckpt", str(dense_ckpt), "--pruning.method", "fairgrape",
                                    "--output", str(out), "--name", "fairgrape_s0.5", "--trainer", json.dumps(FAST)]))
        raise RuntimeError("stop here")

    monkeypatch.setattr(vision, "_prune", first_cell)
    with pytest.raises(RuntimeError, match="stop here"):
        vision.compare_vision(str(dense_ckpt), VisionCompareOptions(["magnitude", "fairgrape"], [0.5], {}, FAST), str(out))
    assert statuses[1] == 2
    err = last_error(capsys)
    assert "in use by another run" in err and str(out / "fairgrape_s0.5") in err
    assert not (out / "fairgrape_s0.5" / "config.yaml").exists()  # the refused run wrote nothing
    assert not list(out.rglob(".lock"))  # compare released every lock on its way out


@pytest.mark.parametrize("kind", ["weights", "heads"])
def test_an_lm_compare_is_refused_by_a_run_folder_another_run_holds(kind, tmp_path, capsys):
    out = tmp_path / "out"
    if kind == "weights":
        cell, extra = out / "wanda_0.5", ["--methods", "[magnitude, wanda]", "--sparsities", "[0.5]"]
    else:
        cell, extra = out / "fasp_a0.5", ["--methods", "[fasp]", "--alphas", "[0.25, 0.5]"]
    with held(cell):
        # Refused before the model is even looked for.
        assert prune_main(["compare", "--model", "missing-model", *extra, "--output", str(out)]) == 2
        err = last_error(capsys)
    assert "in use by another run" in err and str(cell) in err


# --------------------------------------------------------------------------------------------
# Ranks: the process group decides, not the environment


def test_rank_variables_without_a_process_group_skip_no_lock(tmp_path, monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"):
        monkeypatch.setenv(name, "1")
    with RunLock(tmp_path / "run") as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    write_lock(tmp_path / "busy", os.getppid())
    with pytest.raises(UserError, match="in use by another run"):
        RunLock(tmp_path / "busy").acquire()


_RANK = """
import sys, torch.distributed as dist
from fairprune.errors import UserError
from fairprune.storage.lock import RunLock
rank, init, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
try:
    lock = RunLock(folder).acquire()
    print(f"rank {rank}: holds {lock.held}", flush=True)
except UserError as err:
    print(f"rank {rank}: refused: {err}", flush=True)
dist.barrier()  # rank 0 holds the lock until rank 1 has tried
lock.release()
dist.destroy_process_group()
"""


def test_in_a_process_group_rank_zero_alone_takes_the_lock(tmp_path):
    """No RANK in the environment: the process group says which process is rank 0."""
    from processes import clean_env

    env = clean_env(OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(tmp_path / "init"), str(tmp_path / "run")],
                              env=env, stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        printed = [p.communicate(timeout=120)[0].strip() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert printed == ["rank 0: holds True", "rank 1: holds False"]


_LAUNCHER = """
import os, subprocess, sys
from fairprune.errors import UserError
from fairprune.storage.lock import RunLock
folder, launched = sys.argv[1], os.environ.get("LAUNCHED")
if not launched:  # the run: holds the folder and starts another rank by running its command again
    with RunLock(folder):
        subprocess.run([sys.executable, *sys.argv], env={**os.environ, "LAUNCHED": "same"}, check=True)
        subprocess.run([sys.executable, sys.argv[0], folder, "--other"], env={**os.environ, "LAUNCHED": "other"},
                       check=True)
else:
    try:
        print(f"{launched}: followed, holds {RunLock(folder).acquire().held}", flush=True)
    except UserError as err:
        print(f"{launched}: refused: {err}", flush=True)
"""


def test_a_rank_its_run_launched_follows_the_run_and_another_command_is_refused(tmp_path):
    """Lightning's DDP launcher runs the command again in a child before any process group exists:
    that child is part of the run holding the lock; a child running another command is not."""
    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    same, other = done.stdout.splitlines()
    assert same == "same: followed, holds False"  # part of the run: not refused, and it takes no lock
    assert other.startswith("other: refused: ") and "in use by another run" in other


@LINUX
def test_ranks_of_one_torchrun_launch_follow_the_one_that_locked(tmp_path, monkeypatch):
    """torchrun (or srun) starts every rank of ``prune.py vision`` side by side before any process
    group exists: the rank that comes second follows the one that locked, if it shares its launch."""
    from fairprune.storage import lock as lock_module

    monkeypatch.setattr(lock_module, "_launched_by", None, raising=False)  # following is for the rest of a process: undo it
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    launch = lock_module.launch_id()
    assert launch == "torchelastic:run-7@:"  # no rendezvous store to draw a token from: the run id and address alone
    sibling = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        holder = {"pid_start": start_time(sibling.pid), "boot_id": boot_id(), "argv": sys.argv[1:], "launch": launch}
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-8")  # another launch of the same command: refused
        with pytest.raises(UserError, match=f"in use by another run \\(pid {sibling.pid}"):
            RunLock(write_lock(tmp_path / "run", sibling.pid, **holder).parent).acquire()
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
        assert not RunLock(tmp_path / "run").acquire().held
        assert RunLock(tmp_path / "elsewhere").acquire().held is False  # a rank takes no lock of its own
        assert json.loads((tmp_path / "run" / ".lock").read_text())["pid"] == sibling.pid
    finally:
        sibling.stdin.close()
        sibling.wait(timeout=30)


# --------------------------------------------------------------------------------------------
# A pid that lives on as another process


@LINUX
def test_a_lock_records_its_process_start_and_the_boot(tmp_path):
    with RunLock(tmp_path / "run") as lock:
        holder = json.loads(lock.path.read_text())
    assert holder["pid_start"] == start_time(os.getpid()) and holder["boot_id"] == boot_id()
    assert holder["command"]


@LINUX
def test_a_lock_whose_pid_is_now_another_process_is_taken_over(tmp_path, capsys):
    ppid = os.getppid()  # alive, and not the process that wrote the lock below
    write_lock(tmp_path / "same", ppid, pid_start=start_time(ppid), boot_id=boot_id())
    with pytest.raises(UserError, match=f"in use by another run \\(pid {ppid}"):
        RunLock(tmp_path / "same").acquire()

    for name, fields in (("restarted", {"pid_start": start_time(ppid) + 7, "boot_id": boot_id()}),
                         ("rebooted", {"pid_start": start_time(ppid), "boot_id": "another-boot"})):
        write_lock(tmp_path / name, ppid, **fields)
        with RunLock(tmp_path / name) as lock:
            assert json.loads(lock.path.read_text())["pid"] == os.getpid()
        warning = capsys.readouterr().err
        assert warning.startswith("warning: taking over") and f"pid {ppid}" in warning, name
