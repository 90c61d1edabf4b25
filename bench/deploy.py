"""Benchmark: what removing channels buys on a CPU, in PyTorch and in ONNX Runtime.

Run: ``.venv/bin/python bench/deploy.py`` (a few minutes on 2 cores).

For each model (torchvision, random init, ``CLASSES`` classes): the dense network and copies with
channels removed by torch-pruning (``MetaPruner`` with ``MagnitudeImportance``, the L2 norm of each
channel group's weights; ``pruning_ratio`` of the channels of every coupled group, the classifier's
outputs kept) at each ratio of ``RATIOS``. All of a model's networks are measured in one run by
:func:`fairprune.models.deploy.deploy_side_by_side`, their timings taking turns so load on the
machine hits them alike: stored numbers, safetensors bytes, MACs per image and median ms per image
at batch 1 and 32 in PyTorch (eval, no_grad) and ONNX Runtime, on ``BENCH_THREADS`` threads
(default 1) in both. The ratios to the dense network are the result, and the smallest channel
ratio whose ONNX Runtime latency at batch 32 is at least 2x lower.

Two checks ride along: every network's ONNX file gives PyTorch's outputs (max abs difference), and
the dense network exported by torch's current exporter (``dynamo=True``, what ``prune.py export``
writes by default) runs as fast in ONNX Runtime as the TorchScript export the deploy figures use.
Results: ``bench/results/deploy.{json,md}``.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch_pruning as tp
import torchvision

from fairprune.models.deploy import DeploySettings, deploy_side_by_side, plain_copy, time_side_by_side, torch_threads
from fairprune.models.onnx_export import INPUT, export_onnx, max_abs_differences, ort_session

CLASSES = 2
RATIOS = (0.25, 0.5, 0.6, 0.75)
# Kept channel counts as the ratio leaves them, and rounded to a multiple of 8 (SIMD-friendly).
ROUND_TO = (None, 8)
# (name, builder, image size): the demo's half-width MobileNet-V2 at the tests' 32 px and the demo
# config's 64 px, and ResNet-18 (the paper's ResNet family) at 32 px.
MODELS = [
    ("mobilenet_v2 x0.5", lambda: torchvision.models.mobilenet_v2(width_mult=0.5, num_classes=CLASSES), 32),
    ("mobilenet_v2 x0.5", lambda: torchvision.models.mobilenet_v2(width_mult=0.5, num_classes=CLASSES), 64),
    ("resnet18", lambda: torchvision.models.resnet18(num_classes=CLASSES), 32),
]
SETTINGS = DeploySettings(batch_sizes=(1, 32), warmup=5, repeats=41, budget_s=None)
RESULTS = Path(__file__).resolve().parent / "results"
THREADS = int(os.environ.get("BENCH_THREADS", "1"))


def log(message: str) -> None:
    print(message, flush=True)


def remove_channels(model: torch.nn.Module, ratio: float, size: int, round_to: int | None) -> torch.nn.Module:
    """A copy of ``model`` with ``ratio`` of every coupled channel group removed (L2 magnitude),
    the kept counts rounded to a multiple of ``round_to`` when it is given."""
    pruned = copy.deepcopy(model).eval()
    classifier = [m for m in pruned.modules() if isinstance(m, torch.nn.Linear)][-1]
    pruner = tp.pruner.MetaPruner(pruned, torch.randn(1, 3, size, size), importance=tp.importance.MagnitudeImportance(p=2),
                                  pruning_ratio=ratio, ignored_layers=[classifier], round_to=round_to)
    pruner.step()
    return pruned


def exporter_check(model: torch.nn.Module, size: int) -> dict:
    """ONNX Runtime's latency at batch 32 of the two exporters' files of one network, side by side."""
    plain = plain_copy(model)
    with tempfile.TemporaryDirectory() as folder, torch_threads(THREADS):
        sessions = {name: ort_session(export_onnx(plain, Path(folder) / f"{name}.onnx", (3, size, size),
                                                  SETTINGS.opset, dynamo=name == "dynamo"), THREADS)
                    for name in ("torchscript", "dynamo")}
        feed = {INPUT: torch.randn(32, 3, size, size).numpy()}
        timings = time_side_by_side({n: (lambda s=s: s.run(None, feed)) for n, s in sessions.items()},
                                    SETTINGS.warmup, SETTINGS.repeats)
        seconds = {n: statistics.median(t) for n, t in timings.items()}
        differences = {n: max(max_abs_differences(plain, s, (3, size, size)).values()) for n, s in sessions.items()}
    return {"ms_per_image_b32": {n: 1000 * s / 32 for n, s in seconds.items()}, "max_abs_difference": differences,
            "dynamo_over_torchscript": seconds["dynamo"] / seconds["torchscript"]}


def bench_model(name: str, build, size: int) -> dict:
    torch.manual_seed(0)
    dense = build().eval()
    networks, how = {"dense": dense}, {"dense": (0.0, None)}
    for ratio in RATIOS:
        for round_to in ROUND_TO:
            label = f"channels -{ratio:.0%}" + (f", kept x{round_to}" if round_to else "")
            networks[label], how[label] = remove_channels(dense, ratio, size, round_to), (ratio, round_to)
    start = time.perf_counter()
    figures = deploy_side_by_side(networks, (3, size, size), THREADS, SETTINGS)
    log(f"[{name} @{size}px] measured {len(networks)} networks in {time.perf_counter() - start:.1f} s")
    base = figures["dense"]
    rows = []
    for label, f in figures.items():
        if label == "settings":
            continue
        ratio, round_to = how[label]
        with tempfile.TemporaryDirectory() as folder, torch_threads(THREADS):
            plain = plain_copy(networks[label])
            session = ort_session(export_onnx(plain, Path(folder) / "m.onnx", (3, size, size), SETTINGS.opset, False), THREADS)
            difference = max(max_abs_differences(plain, session, (3, size, size)).values())
            with torch.no_grad():
                scale = float(plain(torch.randn(5, 3, size, size, generator=torch.Generator().manual_seed(0))).abs().max())
        speedup = {rt: {b: base["ms_per_image"][rt][b] / ms for b, ms in per.items()} for rt, per in f["ms_per_image"].items()}
        best = {rt: {b: base["ms_per_image_best"][rt][b] / ms for b, ms in per.items()}
                for rt, per in f["ms_per_image_best"].items()}
        rows.append({"network": label, "channel_ratio": ratio, "round_to": round_to, "stored_numel": f["stored_numel"], "bytes": f["bytes"],
                     "macs": f["macs"], "ms_per_image": f["ms_per_image"], "speedup": speedup,
                     "ms_per_image_best": f["ms_per_image_best"], "speedup_best": best,
                     "size_ratio": base["bytes"] / f["bytes"], "macs_ratio": base["macs"] / f["macs"],
                     "ort_max_abs_difference": difference, "ort_relative_difference": difference / scale})
        log(f"[{name} @{size}px] {label}: {f['bytes'] / 1e6:.2f} MB, {f['macs'] / 1e6:.1f} MMACs, ort b32 "
            f"{f['ms_per_image']['ort']['32']:.3f} ms/img ({speedup['ort']['32']:.2f}x), torch b32 "
            f"{f['ms_per_image']['torch']['32']:.3f} ms/img ({speedup['torch']['32']:.2f}x)")
    twice = {str(k): min((r["channel_ratio"] for r in rows if r["channel_ratio"] > 0 and r["round_to"] == k
                          and r["speedup"]["ort"]["32"] >= 2.0), default=None) for k in ROUND_TO}
    exporters = exporter_check(dense, size)
    log(f"[{name} @{size}px] dynamo export / TorchScript export, ORT b32: {exporters['dynamo_over_torchscript']:.2f}x")
    return {"model": name, "image": size, "rows": rows, "settings": figures["settings"],
            "smallest_ratio_2x_ort_b32": twice, "exporters": exporters}


def write_markdown(results: dict, path: Path) -> None:
    s = results["settings"]
    lines = [
        "# Deploy figures: dense vs channels removed (torch-pruning), PyTorch and ONNX Runtime on CPU",
        "",
        f"{results['machine']}; {results['threads']} thread(s) in PyTorch and ONNX Runtime (intra-op) alike; load "
        f"average at start {results['load_average_start']}, at end {results['load_average_end']} (a shared machine: "
        "the ratios, measured in alternating turns, are the result; absolute times vary with load).",
        f"torch {s['torch']}, onnxruntime {s['onnxruntime']}, ONNX opset {s['opset']} ({s['exporter']} exporter); "
        f"median of {s['repeats']} timings after {s['warmup']} warm-up forwards, per network, runtime and batch size "
        f"(each timing as many forwards in a row as take {s['min_timing_s'] * 1000:.0f} ms). Random-init weights, "
        f"{CLASSES} classes; channels "
        "removed with `tp.pruner.MetaPruner` + `MagnitudeImportance(p=2)`, the same ratio in every coupled group, "
        "the classifier's outputs kept. Speed-up = dense ms/img ÷ network ms/img (medians; 'best timings': the "
        "fastest timing of each, what an idle machine approaches).",
        "",
    ]
    for m in results["models"]:
        found = m["smallest_ratio_2x_ort_b32"]  # per rounding ("None", "8")
        lines += [f"## {m['model']}, {m['image']}x{m['image']} input", "",
                  "| network | params (M) | MB | MMACs | torch b1 ms/img | torch b32 ms/img | ort b1 ms/img | ort b32 ms/img "
                  "| speed-up torch b1 / b32 | speed-up ort b1 / b32 | ort b32 speed-up, best timings "
                  "| ORT vs torch max abs diff (relative to the largest logit) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in m["rows"]:
            ms, up = r["ms_per_image"], r["speedup"]
            lines.append(f"| {r['network']} | {r['stored_numel'] / 1e6:.3f} | {r['bytes'] / 1e6:.2f} | {r['macs'] / 1e6:.2f} "
                         f"| {ms['torch']['1']:.3f} | {ms['torch']['32']:.3f} | {ms['ort']['1']:.3f} | {ms['ort']['32']:.3f} "
                         f"| {up['torch']['1']:.2f}x / {up['torch']['32']:.2f}x | {up['ort']['1']:.2f}x / {up['ort']['32']:.2f}x "
                         f"| {r['speedup_best']['ort']['32']:.2f}x | {r['ort_max_abs_difference']:.1e} "
                         f"({r['ort_relative_difference']:.1e}) |")
        e = m["exporters"]
        shown = {k: "none of " + ", ".join(f"{r:.0%}" for r in RATIOS) if v is None else f"{v:.0%}" for k, v in found.items()}
        lines += ["", f"Smallest channel ratio with ≥ 2× lower ONNX Runtime latency at batch 32: **{shown['None']}** "
                  f"(kept counts as the ratio leaves them), **{shown['8']}** (kept counts multiples of 8). "
                  f"Dense network, ONNX Runtime at batch 32: dynamo export {e['ms_per_image_b32']['dynamo']:.3f} ms/img, "
                  f"TorchScript export {e['ms_per_image_b32']['torchscript']:.3f} ms/img "
                  f"({e['dynamo_over_torchscript']:.2f}x).", ""]
    path.write_text("\n".join(lines))


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(THREADS)
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", "threads": THREADS,
               "load_average_start": [round(x, 2) for x in os.getloadavg()], "ratios": list(RATIOS)}
    results["models"] = [bench_model(name, build, size) for name, build, size in MODELS]
    results["settings"] = results["models"][0]["settings"]
    results["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "deploy.json").write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results, RESULTS / "deploy.md")
    log(f"wrote {RESULTS / 'deploy.json'} and .md")


if __name__ == "__main__":
    main()
