"""Two torchrun launches of one command into one ``--output`` are two runs, not one.

Every launch without ``--rdzv-id`` gets ``TORCHELASTIC_RUN_ID=none`` and the same arguments, so the
run lock must tell a launch by its own rendezvous: a live lock of another launch of the same
command refuses the whole second launch, every rank with the one ``error:`` line, and leaves the
folder as it was.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from processes import clean_env
from tiny_models import tiny_gpt2_folder

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 300

# Holds the lock of argv[1] as a run of ``prune.py <argv[2:]>`` would, until stdin closes.
HOLD = """
import sys
from fairprune.storage.lock import RunLock
folder, sys.argv = sys.argv[1], ["prune.py", *sys.argv[2:]]
lock = RunLock(folder).acquire()
print("held", flush=True)
sys.stdin.read()
lock.release()
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("rdzv", ["static", "standalone"])
def test_a_second_torchrun_launch_into_a_held_folder_is_refused_on_every_rank(rdzv, tmp_path):
    tiny_gpt2_folder(tmp_path)
    out = tmp_path / "out"
    args = ["magnitude", "--model", str(tmp_path / "dense"), "--sparsity", "0.5", "--eval_text",
            str(tmp_path / "eval.txt"), "--output", str(out), "--nsamples", "2", "--seqlen", "32", "--device", "cpu",
            "--quiet", "--dense_cache", "false", "--eval_tokens", "256", "--threads", "1"]
    port = free_port()
    # The first launch, as every launch without --rdzv-id looks to the lock: run id "none", the
    # same rendezvous address, the same arguments.
    env = clean_env(OMP_NUM_THREADS="1", TORCHELASTIC_RUN_ID="none", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out), *args], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        lock_before = (out / ".lock").read_bytes()
        assert json.loads(lock_before)["pid"] == holder.pid
        where = (["--standalone"] if rdzv == "standalone"
                 else ["--master_addr", "127.0.0.1", "--master_port", str(port)])
        second = subprocess.run([sys.executable, "-m", "torch.distributed.run", *where, "--nproc_per_node", "2",
                                 "--monitor_interval", "0.1", "--tee", "3", str(ROOT / "prune.py"), *args],
                                cwd=tmp_path, env=clean_env(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                                                            HF_HUB_OFFLINE="1"),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
        assert second.returncode != 0, second.stdout[-3000:]
        ranks: dict[str, list[str]] = {}
        for line in second.stdout.splitlines():
            found = re.match(r"\[default(\d)\]:(.*)", line)
            if found:
                ranks.setdefault(found.group(1), []).append(found.group(2))
        assert sorted(ranks) == ["0", "1"], second.stdout[-3000:]
        for rank, lines in ranks.items():
            assert not any("Traceback" in line for line in lines), "\n".join(lines)
            errors = [line for line in lines if line.startswith("error:")]
            assert len(errors) == 1 and lines[-1] == errors[0], (rank, lines)
            assert f"is in use by another run (pid {holder.pid}" in errors[0]
        # Nothing was written: the folder holds the first run's lock, as it was.
        assert [p.name for p in out.iterdir()] == [".lock"] and (out / ".lock").read_bytes() == lock_before
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert not out.exists() or not any(out.iterdir())


def test_the_ranks_of_one_launch_agree_on_a_token_another_launch_does_not_share(tmp_path):
    """Before any process group exists, the ranks of one launch read one token from their own
    rendezvous store; another launch at the same address, with the same run id, draws another."""
    script = ("from fairprune.storage.lock import launch_id; import os; "
              "print('ID', os.environ['RANK'], launch_id(), flush=True)")
    ids, port = [], free_port()
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                               str(port), "--tee", "3", "--no-python", sys.executable, "-c", script],
                              cwd=tmp_path, env=clean_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
        assert done.returncode == 0, done.stdout[-3000:]
        found = dict(re.findall(r"ID (\d) (\S+)", done.stdout))
        assert sorted(found) == ["0", "1"] and found["0"] == found["1"], done.stdout[-3000:]
        assert found["0"].startswith("torchelastic:none@") and "#" in found["0"]
        ids.append(found["0"])
    assert ids[0] != ids[1]
