"""Command lines: ``train.py`` (LightningCLI), ``prune.py`` (jsonargparse) and ``make demo``.

Importing this package, before torch loads, fits the threads to the machine as it is
(:func:`fit_threads`), unless the environment already says how (``OMP_NUM_THREADS`` or
``OMP_WAIT_POLICY``) or ``--threads`` is given later. The library itself leaves the environment alone.
"""

from __future__ import annotations

import os
import time

#: What :func:`fit_threads` found and chose, for the report (``environment.hardware.threads_chosen``).
CHOSEN = "FAIRPRUNE_THREADS_CHOSEN"


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from ``/proc/stat``; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return sum(fields) - idle, sum(fields)


def others_busy(seconds: float = 0.2) -> float | None:
    """How many of the machine's cores other processes kept busy over ``seconds`` (this one sleeps
    meanwhile); None where the load cannot be read."""
    first = _cpu_times()
    if first is None:
        return None
    time.sleep(seconds)
    second = _cpu_times()
    if second is None or second[1] == first[1]:
        return None
    return (second[0] - first[0]) / (second[1] - first[1]) * (os.cpu_count() or 1)


def fit_threads() -> str | None:
    """On a machine other processes keep busy, run as many torch threads as there are idle cores
    (at least one) and let OpenMP's waiting threads sleep (``OMP_WAIT_POLICY=PASSIVE``), so torch
    neither fights those processes for cores nor spins on them: on two cores beside one busy process,
    OpenMP's defaults made a SparseGPT block and shared-context scoring 2.2× and 2.1× slower than one thread (``bench/shared_machine.py``).
    An idle machine keeps torch's and OpenMP's defaults, which are fastest there. Returns what was
    chosen (also in ``$FAIRPRUNE_THREADS_CHOSEN``), None when nothing was changed."""
    if any(name in os.environ for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = others_busy()
    if busy is None or cores < 2 or busy < 0.5:
        return None
    threads = max(1, min(cores, int(cores - busy + 0.5)))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ[CHOSEN] = (f"{busy:.1f} of {cores} cores busy with other processes at the start: {threads} "
                          f"thread{'s' if threads > 1 else ''}, OpenMP threads wait passively")
    return os.environ[CHOSEN]


fit_threads()
