"""``make demo``: train, then prune fairly, on the bundled data; offline, minutes on a CPU.

1. Trains a half-width MobileNet-V2 on the bundled synthetic faces (generated on first use in the
   UTKFace layout and read by the real UTKFace reader): gender, measured per race group.
2. Tests it and prints the per-group table.
3. Prunes the dense checkpoint to 80 % with magnitude (WS) and with FairGRAPE, retraining between
   steps, and prints one comparison table: overall and per-group accuracy, accuracy gap,
   degradation std, sparsity, seconds.

Everything lands in ``runs/demo/`` (``dense/`` and ``compare/``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from fairprune.cli.prune import main as prune_main
from fairprune.cli.train import main as train_main

TRAIN_CONFIG = "configs/vision/demo.yaml"
COMPARE_CONFIG = "configs/compare/demo.yaml"


def main() -> int:
    start = time.perf_counter()
    checkpoint = Path("runs/demo/dense/checkpoints/last.ckpt")
    steps = [
        ("training the dense model", lambda: train_main(["fit", "--config", TRAIN_CONFIG])),
        ("testing it on the held-out split", lambda: train_main(["test", "--config", TRAIN_CONFIG, "--ckpt_path", str(checkpoint)])),
        ("pruning to 80 % with magnitude and FairGRAPE", lambda: prune_main(["compare", "--config", COMPARE_CONFIG])),
    ]
    for i, (what, step) in enumerate(steps, 1):
        print(f"\n[demo {i}/{len(steps)}] {what} ... ({time.perf_counter() - start:.0f} s so far)", flush=True)
        status = step()
        if status:
            return status
    print(f"[demo] done in {time.perf_counter() - start:.0f} s; table: runs/demo/compare/comparison.md, "
          f"plots: runs/demo/compare/*.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
