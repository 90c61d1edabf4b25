"""``make demo``: the bundled end-to-end run on synthetic faces, offline, minutes on a CPU.

Trains a small MobileNet-V2 on the bundled synthetic face set (generated on first use in the
UTKFace layout and read by the real UTKFace reader), tests it and prints the per-group table.
Everything lands in ``runs/demo/``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from fairprune.cli import main as train_main

CONFIG = "configs/vision/demo.yaml"


def main() -> int:
    start = time.perf_counter()
    root = Path("runs/demo/dense")
    print(f"[demo] training the dense model ({CONFIG}) ...", flush=True)
    status = train_main(["fit", "--config", CONFIG])
    if status:
        return status
    print("[demo] testing it on the held-out split ...", flush=True)
    status = train_main(["test", "--config", CONFIG, "--ckpt_path", str(root / "checkpoints" / "last.ckpt")])
    print(f"[demo] done in {time.perf_counter() - start:.0f} s; report: {root / 'report.json'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
