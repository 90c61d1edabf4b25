"""Benchmark: FairGRAPE's greedy group-share selection, fast twin against the plain-loop oracle.

Run: ``.venv/bin/python bench/fairgrape_selection.py`` (about a minute on 2 cores).

1. First-call cost of the compiled kernels: in a fresh process with an empty numba cache
   (compile) and with the cache filled (load).
2. ResNet-34-sized layers (64x64x3x3, 256x256x3x3, 512x512x3x3), 7 groups, float32, keep 90 %: the oracle
   runs on the first ``ORACLE_SUBSET`` candidates only, and its time is extrapolated linearly to
   the full layer (its Python sort is N log N, so the extrapolation flatters it); the fast
   selection runs on the same subset (masks must be identical) and on the full layer.
3. A full ResNet-34 step: every Conv2d / Linear weight of ``torchvision.models.resnet34()``
   (21.8 M weights) with random importance, 7 groups, keep 90 % of each layer, through
   ``select_layer_masks(..., report=True)`` as the pruning callback calls it (layers in parallel
   threads), with float32 importance (what the importance pass returns) and with float64. Each
   layer's mask must equal the one-layer-at-a-time ``greedy_select`` on one thread; next to it,
   the oracle's time extrapolated to all 21.8 M weights from its per-weight time in step 2.

Importance is ``(g_k · w)²`` with ``w`` and ``g_k`` standard normal: random, positive, and
correlated across groups through the shared weight, as FairGRAPE's importance is. Wall and CPU
(process) time are both reported because the machine may be shared; the load average is logged.
Results: ``bench/results/fairgrape_selection.{json,md}``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torchvision

from fairprune.pruning.fairgrape import (
    greedy_select,
    greedy_select_reference,
    layer_quota,
    select_layer_masks,
)

GROUPS = 7
KEEP = 0.9
ORACLE_SUBSET = 20_000
LAYERS = {"64x64x3x3": (64, 64, 3, 3), "256x256x3x3": (256, 256, 3, 3), "512x512x3x3": (512, 512, 3, 3)}
RESULTS = Path(__file__).resolve().parent / "results"
FIRST_CALL_SNIPPET = (  # prints the import time, then the first call's time
    "import time, numpy as np; t = time.perf_counter();"
    "from fairprune.pruning.fairgrape import greedy_select; u = time.perf_counter();"
    "greedy_select(np.ones((2, 64)), 10); print(u - t, time.perf_counter() - u)"
)


def log(message: str) -> None:
    """Progress line, flushed at once so long steps show where the run is."""
    print(message, flush=True)


def timed(fn):
    """(result, wall seconds, CPU seconds of this process over all threads)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def random_importance(rng: np.random.Generator, weight: np.ndarray) -> np.ndarray:
    """[GROUPS, numel] importance ``(g_k · w)²`` with standard-normal per-group gradients."""
    flat = weight.reshape(1, -1)
    return (rng.standard_normal((GROUPS, flat.shape[1])) * flat) ** 2


def first_call_seconds() -> dict[str, float]:
    """First call in a fresh process: cold (empty numba cache dir), then warm (same dir again)."""
    with tempfile.TemporaryDirectory() as cache_dir:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir}
        runs = [
            subprocess.run([sys.executable, "-c", FIRST_CALL_SNIPPET], env=env, check=True,
                           capture_output=True, text=True)
            for _ in range(2)
        ]
    (import_s, cold), (_, warm) = ([float(x) for x in r.stdout.split()[-2:]] for r in runs)
    return {"import_s": import_s, "compile_s": cold, "cached_s": warm}


def bench_layer(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> dict:
    """Oracle on a prefix of the candidates, fast on the prefix and on the whole layer."""
    imp = random_importance(rng, rng.standard_normal(shape)).astype(np.float32)  # as the importance pass gives it
    n = imp.shape[1]
    sub = np.ascontiguousarray(imp[:, : min(n, ORACLE_SUBSET)])
    sub_quota = layer_quota(sub.shape[1], KEEP)
    log(f"[{name}] oracle on the first {sub.shape[1]:,} of {n:,} candidates ...")
    expected, oracle_wall, oracle_cpu = timed(lambda: greedy_select_reference(sub, sub_quota))
    got, fast_sub_wall, fast_sub_cpu = timed(lambda: greedy_select(sub, sub_quota))
    identical = bool(torch.equal(got, expected))
    log(f"[{name}] fast on all {n:,} candidates ...")
    kept, fast_wall, fast_cpu = timed(lambda: greedy_select(imp, layer_quota(n, KEEP)))
    assert int(kept.sum()) == layer_quota(n, KEEP)
    scale = n / sub.shape[1]
    row = {
        "layer": name,
        "weights": n,
        "oracle_subset": sub.shape[1],
        "identical_on_subset": identical,
        "oracle_subset_wall_s": oracle_wall,
        "oracle_subset_cpu_s": oracle_cpu,
        "fast_subset_wall_s": fast_sub_wall,
        "fast_subset_cpu_s": fast_sub_cpu,
        "speedup_subset_wall": oracle_wall / fast_sub_wall,
        "oracle_extrapolated_wall_s": oracle_wall * scale,
        "fast_wall_s": fast_wall,
        "fast_cpu_s": fast_cpu,
        "speedup_full_wall": oracle_wall * scale / fast_wall,
        "speedup_full_cpu": oracle_cpu * scale / fast_cpu,
    }
    log(
        f"[{name}] identical={identical}  oracle {oracle_wall:.2f} s on {sub.shape[1]:,} "
        f"-> {row['oracle_extrapolated_wall_s']:.1f} s extrapolated to {n:,}; fast {fast_wall:.3f} s "
        f"wall / {fast_cpu:.3f} s CPU; speedup {row['speedup_full_wall']:.0f}x wall, "
        f"{row['speedup_full_cpu']:.0f}x CPU ({row['speedup_subset_wall']:.0f}x on the subset)"
    )
    return row


def bench_resnet34(rng: np.random.Generator, dtype: type, oracle_s_per_weight: float) -> dict:
    """Every Conv2d / Linear weight of ResNet-34 through ``select_layer_masks``, keep 90 %."""
    model = torchvision.models.resnet34()  # random init, nothing downloaded
    layers = [m.weight.detach() for m in model.modules()
              if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    total = sum(w.numel() for w in layers)
    name = np.dtype(dtype).name
    log(f"[resnet34 {name}] {len(layers)} layers, {total:,} weights, {GROUPS} groups, keep {KEEP} ...")
    importances = [torch.from_numpy(random_importance(rng, w.numpy()).astype(dtype)).reshape(GROUPS, *w.shape)
                   for w in layers]
    masks = [torch.ones(w.shape, dtype=torch.bool) for w in layers]
    quotas = [layer_quota(w.numel(), KEEP) for w in layers]
    chosen, wall, cpu = timed(lambda: select_layer_masks(importances, masks, quotas, report=True))
    log(f"[resnet34 {name}] selection {wall:.2f} s wall, {cpu:.2f} s CPU; checking every layer's mask ...")
    for imp, quota, (mask, report) in zip(importances, quotas, chosen):
        assert int(mask.sum()) == quota == report["kept"]
        assert torch.equal(mask.reshape(-1), greedy_select(imp.reshape(GROUPS, -1), quota))
    oracle = oracle_s_per_weight * total
    log(f"[resnet34 {name}] identical masks; oracle extrapolated {oracle:,.0f} s ({oracle / wall:,.0f}x)")
    return {"dtype": name, "layers": len(layers), "weights": total, "selection_wall_s": wall,
            "selection_cpu_s": cpu, "oracle_extrapolated_wall_s": oracle, "speedup_wall": oracle / wall,
            "identical_to_single_layer_calls": True}


def write_markdown(results: dict, path: Path) -> None:
    """A short human-readable summary next to the JSON."""
    first, rn = results["first_call"], results["resnet34"]
    lines = [
        "# FairGRAPE greedy selection: fast vs oracle",
        "",
        f"{results['machine']}; torch threads {results['torch_threads']}; "
        f"load average at start {results['load_average_start']}, at end {results['load_average_end']}.",
        f"{GROUPS} groups, keep {KEEP}, importance (g_k·w)² with standard-normal g_k and w (float32 in the "
        "per-layer rows, as the importance pass returns it).",
        "",
        f"First call in a fresh process (after a {first['import_s']:.1f} s import): "
        f"{first['compile_s']:.1f} s with an empty numba cache (JIT compile), "
        f"{first['cached_s']:.2f} s with the cache filled (load).",
        "",
        f"The oracle runs on the first {ORACLE_SUBSET:,} candidates of each layer; its full-layer "
        "time is EXTRAPOLATED linearly (its sort is N log N, so this underestimates it).",
        "",
        "| layer | weights | identical | oracle (s, extrapolated) | fast wall (s) | fast CPU (s) "
        "| speedup wall | speedup CPU | speedup on subset |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["layers"]:
        lines.append(
            f"| {r['layer']} | {r['weights']:,} | {r['identical_on_subset']} | "
            f"{r['oracle_extrapolated_wall_s']:.1f} | {r['fast_wall_s']:.3f} | {r['fast_cpu_s']:.3f} | "
            f"{r['speedup_full_wall']:.0f}x | {r['speedup_full_cpu']:.0f}x | {r['speedup_subset_wall']:.0f}x |"
        )
    lines += [
        "",
        "Full ResNet-34 step (every Conv2d/Linear weight, keep 0.9, `select_layer_masks` with the "
        "share report, as the pruning callback runs it; the oracle EXTRAPOLATED linearly from its "
        "per-weight time on the 512x512x3x3 subset):",
        "",
        "| importance | layers | weights | wall (s) | CPU (s) | oracle (s, extrapolated) | speedup wall "
        "| masks identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rn:
        lines.append(
            f"| {r['dtype']} | {r['layers']} | {r['weights']:,} | {r['selection_wall_s']:.2f} | "
            f"{r['selection_cpu_s']:.2f} | {r['oracle_extrapolated_wall_s']:,.0f} | {r['speedup_wall']:,.0f}x "
            f"| {r['identical_to_single_layer_calls']} |"
        )
    lines.append("")
    path.write_text("\n".join(lines))


def main() -> None:
    rng = np.random.default_rng(0)
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch_threads": torch.get_num_threads(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "groups": GROUPS,
        "keep_fraction": KEEP,
        "oracle_subset": ORACLE_SUBSET,
        "oracle_extrapolation": "linear in the number of candidates",
    }
    log("first call: compile in a fresh process, then load from the cache ...")
    results["first_call"] = first_call_seconds()
    log(f"first call: {results['first_call']}")
    greedy_select(np.ones((2, 64)), 10)  # load the kernels in this process before timing
    results["layers"] = [bench_layer(name, shape, rng) for name, shape in LAYERS.items()]
    largest = results["layers"][-1]
    per_weight = largest["oracle_subset_wall_s"] / largest["oracle_subset"]
    results["resnet34"] = [bench_resnet34(rng, dtype, per_weight) for dtype in (np.float32, np.float64)]
    results["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fairgrape_selection.json").write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results, RESULTS / "fairgrape_selection.md")
    log(f"wrote {RESULTS / 'fairgrape_selection.json'} and .md")


if __name__ == "__main__":
    main()
