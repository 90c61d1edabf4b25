"""Start-up cost of the command lines: CPU seconds (user + sys) of ``--help``, measured side by side.

``prune.py --help`` and ``train.py --help`` answer without importing torch or Lightning; a
subcommand's help builds its full parser and imports what it needs. The reference row is what the
top-level help cost when every command's code was imported up front: importing the vision pruning
callback, the LightningCLI and every workflow. Each command runs ``--repeats`` times in a fresh
interpreter, interleaved, and the lowest CPU time is kept. Target: top-level help under 2 s CPU.
Writes ``bench/results/startup.json`` and ``bench/results/startup.md``.

    python bench/startup.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EAGER = ("import fairprune.callbacks.pruning, fairprune.cli.lightning_cli, fairprune.workflows.vision, "
         "fairprune.workflows.lm, fairprune.workflows.heads, fairprune.workflows.diff")
COMMANDS = {
    "prune.py --help": ["prune.py", "--help"],
    "train.py --help": ["train.py", "--help"],
    "prune.py sparsegpt --help": ["prune.py", "sparsegpt", "--help"],
    "prune.py vision --help": ["prune.py", "vision", "--help"],
    "train.py fit --help": ["train.py", "fit", "--help"],
    "reference: every command's code imported up front": ["-c", EAGER],
}
TARGET = {"prune.py --help": 2.0, "train.py --help": 2.0}


def cpu_seconds(args: list[str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one fresh interpreter running ``args``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in COMMANDS}
    for i in range(args.repeats):
        for name, command in COMMANDS.items():
            samples[name].append(cpu_seconds(command))
            print(f"[startup] round {i + 1}/{args.repeats}: {name}: {samples[name][-1][0]:.2f} s CPU", flush=True)
    rows = []
    for name, values in samples.items():
        cpu, wall = min(values)
        row = {"command": name, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3)}
        if name in TARGET:
            row["target_cpu_s"] = TARGET[name]
            row["met"] = cpu < TARGET[name]
        rows.append(row)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "repeats": args.repeats, "date": time.strftime("%Y-%m-%d")}
    (out / "startup.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# Command-line start-up (CPU seconds, lowest of {args.repeats:d})", "",
             "| command | CPU s | wall s | target |", "|---|---|---|---|"]
    for row in rows:
        target = f"< {row['target_cpu_s']:g} s: {'met' if row['met'] else 'missed'}" if "target_cpu_s" in row else ""
        lines.append(f"| {row['command']} | {row['cpu_s']:.2f} | {row['wall_s']:.2f} | {target} |")
    (out / "startup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
