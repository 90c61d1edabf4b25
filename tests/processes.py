"""Running gloo process groups in tests: one-process reference (rank -1) beside ranks 0 and 1."""

from __future__ import annotations

import os
import subprocess
import sys

# What torchrun / Lightning set for a rank: a test's own ranks must not inherit them.
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                    "GROUP_RANK")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the launch variables, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}, **extra}


def run_ranks(script: str, argv_of, ranks=(-1, 0, 1), timeout: float = 120) -> None:
    """Run ``python -c script *argv_of(rank)`` once per rank at the same time (one thread each);
    assert every one exits 0, and kill any still running when that fails."""
    env = clean_env(OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", script, *argv_of(r)], env=env) for r in ranks]
    try:
        assert [p.wait(timeout=timeout) for p in procs] == [0] * len(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
