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

Everything lands in ``runs/demo/`` (``dense/`` and ``compare/``).
"""

from __future__ import annotations

import sys
import time

from fairprune.cli.prune import main as prune_main
from fairprune.cli.train import main as train_main

TRAIN_CONFIG = "configs/vision/demo.yaml"
COMPARE_CONFIG = "configs/compare/demo.yaml"


def main() -> int:
    start = time.perf_counter()
    steps = [
        ("training the dense model", lambda: train_main(["fit", "--config", TRAIN_CONFIG])),
        ("pruning to 80 % with magnitude and FairGRAPE", lambda: prune_main(["compare", "--config", COMPARE_CONFIG])),
    ]
    for i, (what, step) in enumerate(steps, 1):
        print(f"\n[demo {i}/{len(steps)}] {what} ... ({time.perf_counter() - start:.0f} s so far)", flush=True)
        status = step()
        if status:
            return status
    print(f"[demo] done in {time.perf_counter() - start:.0f} s; page: runs/demo/compare/report.html, "
          f"full table: runs/demo/compare/comparison.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
