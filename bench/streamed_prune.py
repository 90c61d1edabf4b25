"""Streamed pruning (``--stream true``) against the in-memory run: peak resident memory and perplexity.

Runs, each in a fresh child process whose peak resident memory over its life (``ru_maxrss``, what
``/usr/bin/time -v`` reports, read before the interpreter's shutdown) is recorded:

* ``baseline`` — ``python -c "import torch, transformers"``: the import-only floor;
* ``baseline + model code`` — the same, plus the classes a run of this model imports
  (``AutoConfig`` of the folder, ``AutoTokenizer``, ``AutoModelForCausalLM``; no weights, no
  vocabulary): with transformers 5 a Llama config imports the image utilities, hence torchvision,
  ``torch._dynamo`` and sympy, a cost every run of this model pays before any weight is read
  (triton skipped where torch sees no GPU, as the prune runs skip it:
  :func:`fairprune.workflows.options.skip_gpu_compiler`);
* ``in-memory`` — ``prune.py <method> --dtype <dtype>`` (the whole model held);
* ``streamed`` — the same command with ``--stream true`` (one block resident).

Both prune runs measure the dense model themselves (``--dense_cache false``), so each does the
same work. Reported: each child's peak RSS, the prune runs' peaks above both baselines,
perplexity and stereotype score of the dense and pruned model from each run's ``report.json``, the
streamed run's ``memory`` block, and wall seconds. Targets: streamed peak at most 0.35 GB above
the baseline, pruned perplexity within 1 % of the in-memory run's.

Writes ``bench/results/streamed_prune.json`` and ``.md``.

    python bench/streamed_prune.py [--model smollm2-135m] [--method sparsegpt] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9


RUNNER = ROOT / "bench" / "peak_rss.py"  # runs a child and prints the peak RSS of its life


def run_child(argv: list[str], env: dict[str, str]) -> dict:
    """Run ``python <argv>`` (a script and its arguments, or ``-c code``) from the repository root:
    the peak RSS of its life (bytes) and wall seconds."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(RUNNER), *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    code = proc.wait()
    lines = output.strip().splitlines()
    if code != 0 or not lines or not lines[-1].startswith("PEAK_RSS_KIB"):
        raise SystemExit(f"{' '.join(argv)[:200]} failed ({code}):\n{output[-3000:]}")
    unit = 1 if sys.platform == "darwin" else 1024
    return {"peak_rss_bytes": int(lines[-1].split()[1]) * unit, "seconds": time.perf_counter() - start,
            "output": lines[-4:-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="sparsegpt")
    parser.add_argument("--sparsity", default="0.5")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--eval_tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "streamed_prune"))
    args = parser.parse_args()

    from fairprune.hub import resolve_name

    folder = resolve_name(args.model)  # a packaged GGUF is converted once here, outside the measured runs
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    code = ("import torch, transformers; from fairprune.workflows.options import skip_gpu_compiler; skip_gpu_compiler(); "
            "from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer; "
            f"AutoConfig.from_pretrained({str(folder)!r})")
    children = {"baseline": ["-c", "import torch, transformers"], "baseline + model code": ["-c", code]}
    scratch = Path(tempfile.mkdtemp(prefix="streamed-bench-"))
    common = [str(ROOT / "prune.py"), args.method, "--model", args.model, "--sparsity", args.sparsity,
              "--dtype", args.dtype, "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen),
              "--eval_tokens", str(args.eval_tokens), "--threads", str(args.threads), "--device", "cpu",
              "--dense_cache", "false", "--quiet"]
    children["in-memory"] = [*common, "--stream", "false", "--output", str(scratch / "in-memory")]
    children["streamed"] = [*common, "--stream", "true", "--output", str(scratch / "streamed")]
    runs = {}
    try:
        for name, argv in children.items():
            print(f"[bench] {name} ...", flush=True)
            runs[name] = run_child(argv, env)
            print(f"[bench] {name}: peak RSS {runs[name]['peak_rss_bytes'] / GB:.3f} GB, {runs[name]['seconds']:.0f} s", flush=True)
            report = scratch / name / "report.json"
            if report.is_file():
                runs[name]["report"] = json.loads(report.read_text())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    base, code_base = runs["baseline"]["peak_rss_bytes"], runs["baseline + model code"]["peak_rss_bytes"]
    memory, streamed = runs["in-memory"]["report"], runs["streamed"]["report"]
    ppl = {"dense (in-memory)": memory["reference"]["metrics"]["perplexity"],
           "dense (streamed)": streamed["reference"]["metrics"]["perplexity"],
           "pruned (in-memory)": memory["metrics"]["perplexity"], "pruned (streamed)": streamed["metrics"]["perplexity"]}
    relative = streamed["metrics"]["perplexity"] / memory["metrics"]["perplexity"] - 1
    above = runs["streamed"]["peak_rss_bytes"] - base
    result = {
        "settings": {**vars(args), "folder": str(folder), "python": platform.python_version(),
                     "machine": platform.machine(), "cpus": os.cpu_count()},
        "peak_rss_bytes": {name: run["peak_rss_bytes"] for name, run in runs.items()},
        "seconds": {name: run["seconds"] for name, run in runs.items()},
        "above_baseline_bytes": {name: runs[name]["peak_rss_bytes"] - base for name in ("in-memory", "streamed")},
        "above_model_code_baseline_bytes": {name: runs[name]["peak_rss_bytes"] - code_base for name in ("in-memory", "streamed")},
        "perplexity": ppl,
        "stereotype_score": {"dense (in-memory)": memory["reference"]["metrics"]["stereotype_score"],
                             "dense (streamed)": streamed["reference"]["metrics"]["stereotype_score"],
                             "pruned (in-memory)": memory["metrics"]["stereotype_score"],
                             "pruned (streamed)": streamed["metrics"]["stereotype_score"]},
        "perplexity_relative_difference": relative,
        "achieved_sparsity": {"in-memory": memory["achieved_sparsity"], "streamed": streamed["achieved_sparsity"]},
        "streamed_memory": streamed["memory"],
        "weights_bytes": memory.get("weights", {}).get("file_bytes"),
        "targets": {"streamed_above_baseline_at_most_0.35GB": above <= 0.35 * GB,
                    "streamed_above_model_code_baseline_at_most_0.35GB":
                        runs["streamed"]["peak_rss_bytes"] - code_base <= 0.35 * GB,
                    "perplexity_within_1pct": abs(relative) <= 0.01},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    s, peak = r["settings"], r["peak_rss_bytes"]
    lines = [f"# Streamed pruning: {s['model']} {s['method']} {s['sparsity']} in {s['dtype']}", "",
             f"`python bench/streamed_prune.py` — {s['nsamples']} × {s['seqlen']} calibration tokens, perplexity on "
             f"{s['eval_tokens']} tokens, {s['threads']} thread(s), CPU; each row a fresh child process, its peak "
             "resident memory `ru_maxrss` over its life (read in the child as it ends, before the interpreter's "
             "shutdown).", "",
             "| run | peak RSS | above baseline | above baseline + model code | seconds |", "|---|---|---|---|---|"]
    for name, value in peak.items():
        above = "" if name.startswith("baseline") else f"{(value - peak['baseline']) / GB:.3f} GB"
        above_code = "" if name.startswith("baseline") else f"{(value - peak['baseline + model code']) / GB:.3f} GB"
        lines.append(f"| {name} | {value / GB:.3f} GB | {above} | {above_code} | {r['seconds'][name]:.0f} |")
    m = r["streamed_memory"]
    lines += ["", "| model | in-memory | streamed |", "|---|---|---|",
              f"| dense perplexity | {r['perplexity']['dense (in-memory)']:.3f} | {r['perplexity']['dense (streamed)']:.3f} |",
              f"| pruned perplexity | {r['perplexity']['pruned (in-memory)']:.3f} | {r['perplexity']['pruned (streamed)']:.3f} |",
              f"| dense stereotype score | {r['stereotype_score']['dense (in-memory)']:.3f} | "
              f"{r['stereotype_score']['dense (streamed)']:.3f} |",
              f"| pruned stereotype score | {r['stereotype_score']['pruned (in-memory)']:.3f} | "
              f"{r['stereotype_score']['pruned (streamed)']:.3f} |",
              f"| achieved sparsity | {r['achieved_sparsity']['in-memory']:.4f} | {r['achieved_sparsity']['streamed']:.4f} |",
              "", f"Pruned perplexity, streamed vs in-memory: {r['perplexity_relative_difference']:+.2e} relative.",
              f"Streamed run: model {m['model_bytes'] / 1e6:.1f} MB in {s['dtype']}, largest block "
              f"{m['largest_block_bytes'] / 1e6:.2f} MB, largest part resident at once {m['largest_part_bytes'] / 1e6:.1f} MB "
              f"(the embedding table), peak RSS {m['peak_rss_bytes'] / GB:.3f} GB in-process "
              f"({m['peak_rss_at_start_bytes'] / GB:.3f} GB once its imports were done).", "",
              "Targets: " + ", ".join(f"{k}: {'met' if v else 'not met'}" for k, v in r["targets"].items()) + ".", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
