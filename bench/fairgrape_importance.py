"""Benchmark: FairGRAPE's per-group importance pass against one plain forward + backward.

Run: ``.venv/bin/python bench/fairgrape_importance.py`` (a few minutes on 2 cores).

For each model (torchvision MobileNet-V2 and ResNet-18, random init, ``IMAGE`` x ``IMAGE``
inputs, ``CLASSES`` classes) over the same ``BATCHES`` batches of ``BATCH`` samples in
``GROUPS`` groups, in eval mode, on ``BENCH_THREADS`` torch threads (default 1), three ways of taking gradients are timed side by side:

- ``plain``: one forward and one backward of the batch's summed loss (``autograd.grad`` with
  respect to every Conv2d / Linear weight): the floor any importance pass pays;
- ``group_scores``: the one-pass importance (a forward and backward per group over that group's
  samples only), :func:`fairprune.pruning.importance.group_scores`;
- ``reference``: the K-backward path, one forward over the batch then one backward per group,
  :func:`fairprune.pruning.importance.group_scores_reference`.

The three run in turns, ``ROUNDS`` rounds, the order rotating each round, and each method's
median is reported, so machine load hits them alike; the ratios to ``plain`` are the result
(target: ``group_scores`` <= 1.5x). The two importance paths must agree (float tolerance).
Results: ``bench/results/fairgrape_importance.{json,md}``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision

from fairprune.pruning.importance import group_scores, group_scores_reference
from fairprune.pruning.masks import prunable_targets

GROUPS = 7
BATCH = 64
BATCHES = 6
IMAGE = 64
CLASSES = 2
ROUNDS = 3
MODELS = {"mobilenet_v2": torchvision.models.mobilenet_v2, "resnet18": torchvision.models.resnet18}
RESULTS = Path(__file__).resolve().parent / "results"
# One torch thread by default: on a shared, oversubscribed machine every parallel region's barrier
# can wait a scheduler slice, which punishes many small operations and skews the ratios.
THREADS = int(os.environ.get("BENCH_THREADS", "1"))


def log(message: str) -> None:
    print(message, flush=True)


def plain_pass(model, targets, loader) -> None:
    """One forward and one backward per batch, gradients summed over the batches."""
    params = [t.module.weight for t in targets]
    sums = [torch.zeros_like(p) for p in params]
    model.eval()
    for x, y, _ in loader:
        for s, gr in zip(sums, torch.autograd.grad(F.cross_entropy(model(x), y, reduction="sum"), params)):
            s += gr


def bench_model(name: str, build) -> dict:
    torch.manual_seed(0)
    model = build(num_classes=CLASSES)
    model.eval()
    targets = prunable_targets(model)
    gen = torch.Generator().manual_seed(1)
    loader = [(torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen), torch.randint(0, CLASSES, (BATCH,), generator=gen),
               torch.randint(0, GROUPS, (BATCH,), generator=gen)) for _ in range(BATCHES)]
    methods = {
        "plain": lambda: plain_pass(model, targets, loader),
        "group_scores": lambda: group_scores(model, targets, loader, F.cross_entropy, "cpu", GROUPS, progress=False),
        "reference": lambda: group_scores_reference(model, targets, loader, F.cross_entropy, "cpu", GROUPS),
    }
    new = group_scores(model, targets, loader, F.cross_entropy, "cpu", GROUPS, progress=False)  # warm up
    old = group_scores_reference(model, targets, loader, F.cross_entropy, "cpu", GROUPS)
    worst = max(float(((new[t.name] - old[t.name]).abs() / (old[t.name].abs().amax() + 1e-30)).max()) for t in targets)
    assert worst < 1e-3, f"group_scores and the reference disagree by {worst:.2e} (relative to each layer's largest)"
    times: dict[str, list[float]] = {m: [] for m in methods}
    names = list(methods)
    for r in range(ROUNDS):
        for m in names[r % 3:] + names[: r % 3]:
            start = time.perf_counter()
            methods[m]()
            times[m].append(time.perf_counter() - start)
        log(f"[{name}] round {r + 1}/{ROUNDS}: " + ", ".join(f"{m} {times[m][-1]:.2f} s" for m in names))
    median = {m: statistics.median(v) for m, v in times.items()}
    row = {
        "model": name,
        "weights": sum(t.module.weight.numel() for t in targets),
        "samples": BATCH * BATCHES,
        "median_s": median,
        "all_s": times,
        "ratio_group_scores_to_plain": median["group_scores"] / median["plain"],
        "ratio_reference_to_plain": median["reference"] / median["plain"],
        "speedup_over_reference": median["reference"] / median["group_scores"],
        "max_relative_difference": worst,
    }
    log(f"[{name}] group_scores {row['ratio_group_scores_to_plain']:.2f}x plain, reference "
        f"{row['ratio_reference_to_plain']:.2f}x plain ({row['speedup_over_reference']:.1f}x faster)")
    return row


def write_markdown(results: dict, path: Path) -> None:
    lines = [
        "# FairGRAPE importance: one pass vs K backward passes",
        "",
        f"{results['machine']}; torch threads {results['torch_threads']}; load average at start "
        f"{results['load_average_start']}, at end {results['load_average_end']} (a shared machine: the "
        "ratios, measured in alternating turns, are the result; absolute times vary with load).",
        f"{GROUPS} groups, {BATCHES} batches of {BATCH} samples, {IMAGE}x{IMAGE} inputs, eval mode; "
        f"median of {ROUNDS} rounds.",
        "",
        "| model | weights | plain fwd+bwd (s) | group_scores (s) | reference, K backward (s) "
        "| group_scores / plain | reference / plain | max rel. diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["models"]:
        m = r["median_s"]
        lines.append(
            f"| {r['model']} | {r['weights']:,} | {m['plain']:.2f} | {m['group_scores']:.2f} | {m['reference']:.2f} "
            f"| {r['ratio_group_scores_to_plain']:.2f}x | {r['ratio_reference_to_plain']:.2f}x "
            f"| {r['max_relative_difference']:.1e} |"
        )
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    torch.set_num_threads(THREADS)
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch_threads": torch.get_num_threads(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "groups": GROUPS, "batch": BATCH, "batches": BATCHES, "image": IMAGE, "rounds": ROUNDS,
    }
    results["models"] = [bench_model(name, build) for name, build in MODELS.items()]
    results["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fairgrape_importance.json").write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results, RESULTS / "fairgrape_importance.md")
    log(f"wrote {RESULTS / 'fairgrape_importance.json'} and .md")


if __name__ == "__main__":
    main()
