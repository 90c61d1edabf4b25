"""``make demo``: train, then prune fairly, on the bundled data; offline, minutes on a CPU.

1. Trains a half-width MobileNet-V2 on the bundled synthetic faces (generated on first use in the
   UTKFace layout and read by the real UTKFace reader): gender, measured per race group.
2. Prunes the dense checkpoint to 80 % with magnitude (WS) and with FairGRAPE, retraining between
   steps, and prints the comparison's headline within 100 columns: the dense model and its
   compute-matched reference (trained on as long as the schedule retrains), each method's test
   accuracy with its 95 % interval, worst-group accuracy, accuracy gap, degradation std and the
   paired difference against magnitude. The full table (per-group accuracies, size and latency,
   every interval) is in ``comparison.md`` and ``report.html``. The dense model's test figures are
   its row of that table (one test pass serves both; ``train.py test`` gives them alone).
3. Says whether the README's table (``python -m fairprune.cli.tables``, which writes it from
   ``comparison.csv``) is this run's.

Everything lands in ``runs/demo/`` (``dense/`` and ``compare/``). ``--seed N`` runs the same demo
from another seed (the synthetic faces drawn, the split, the initial weights and the pruning's
batches all follow it) into ``runs/demo_seed<N>/``. The demo runs on :data:`THREADS` CPU threads
whatever the machine (``--threads N`` for another count, whose figures differ).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

#: CPU kernels the demo runs with, set before torch loads: torch's own (``ATEN_CPU_CAPABILITY``),
#: oneDNN's convolutions (``DNNL_MAX_CPU_ISA``) and MKL's matrix products (``MKL_CBWR``, MKL's
#: conditional numerical reproducibility, which otherwise picks its code path by CPU vendor and
#: model) capped at AVX2, so an AVX-512 machine, Intel or AMD, computes the same float sums as an
#: AVX2 one and prints the same table. A value the user set is kept.
KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "DNNL_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2"}
for _name, _value in KERNELS.items():
    os.environ.setdefault(_name, _value)

from fairprune.cli.prune import main as prune_main
from fairprune.cli.train import main as train_main

TRAIN_CONFIG = "configs/vision/demo.yaml"
COMPARE_CONFIG = "configs/compare/demo.yaml"
#: The demo's seed: the one its configs set and the README's table shows.
SEED = 0
#: torch's CPU threads, fixed whatever the machine: float sums split over another number of threads
#: round differently, and after a few hundred training steps the figures differ. With a fixed count
#: the demo prints the README's table on any machine with the same CPU kernels (x86-64 with AVX2).
THREADS = 2


def folder(seed: int) -> str:
    """The run folder of the demo from ``seed``: ``runs/demo`` for the configs' own seed."""
    return "runs/demo" if seed == SEED else f"runs/demo_seed{seed}"


def commands(seed: int = SEED, threads: int = THREADS) -> tuple[list[str], list[str]]:
    """The ``train.py`` and ``prune.py`` arguments of the demo from ``seed``."""
    machine = ["--threads", str(threads)]
    train, compare = ["fit", "--config", TRAIN_CONFIG, *machine], ["compare", "--config", COMPARE_CONFIG, *machine]
    if seed != SEED:
        out = folder(seed)
        train += ["--seed_everything", str(seed), "--data.seed", str(seed),
                  "--trainer.logger.init_args.name", out.removeprefix("runs/")]
        compare += ["--ckpt", f"{out}/dense/checkpoints/last.ckpt", "--seeds", f"[{seed}]", "--output", f"{out}/compare"]
    return train, compare


def _readme_note() -> str:
    """One line: whether the README's demo table is this run's."""
    from fairprune.cli.tables import BLOCKS, ROOT
    from fairprune.errors import UserError
    from fairprune.reporting.marked_block import marked_block

    block = BLOCKS["demo-table"]
    try:
        same = marked_block(ROOT / "README.md", "demo-table") == block.render([ROOT / s for s in block.sources])
    except UserError as err:
        return f"[demo] the README's table could not be compared: {err}"
    if same:
        return "[demo] the README's table is this run's, figure for figure"
    return ("[demo] this run's table differs from the README's (another machine or library build); "
            "`make readme-table` writes it into the README and the docs")


class _Parser(argparse.ArgumentParser):
    """A mistake on the command line is one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message}\n")


def main(args: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m fairprune.cli.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=SEED,
                        help=f"one seed for the data, the split, the training and the pruning (default {SEED}: "
                             "runs/demo/; another: runs/demo_seed<N>/)")
    parser.add_argument("--threads", type=int, default=THREADS,
                        help=f"torch's CPU threads (default {THREADS}, the count the README's table was computed with)")
    parsed = parser.parse_args(args)
    if parsed.seed < 0:
        parser.error(f"--seed must be 0 or more, got {parsed.seed}")
    if parsed.threads < 1:
        parser.error(f"--threads must be 1 or more, got {parsed.threads}")
    # Idle OpenMP threads sleep rather than spin (read when torch loads, below): on a machine that
    # runs other jobs, spinning threads hold the cores the working ones wait for. The figures do not
    # change; on a loaded 2-core machine the demo ran several times faster.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    train, compare = commands(parsed.seed, parsed.threads)
    start = time.perf_counter()
    steps = [
        ("training the dense model", lambda: train_main(train)),
        ("pruning to 80 % with magnitude and FairGRAPE", lambda: prune_main(compare)),
    ]
    for i, (what, step) in enumerate(steps, 1):
        print(f"\n[demo {i}/{len(steps)}] {what} ... ({time.perf_counter() - start:.0f} s so far)", flush=True)
        status = step()
        if status:
            return status
    out = folder(parsed.seed)
    print(f"[demo] done in {time.perf_counter() - start:.0f} s; page: {out}/compare/report.html, "
          f"full table: {out}/compare/comparison.md")
    if parsed.seed == SEED:
        print(_readme_note())
    return 0


if __name__ == "__main__":
    sys.exit(main())
