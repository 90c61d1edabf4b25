"""Compressed LM checkpoints on the packaged SmolLM2-135M: bytes on disk, reload, perplexity.

For magnitude pruning at 50 % and 2:4 in bfloat16, through the real command line
(``prune.py magnitude --model smollm2-135m --sparsity ... --save_format compressed --dtype bfloat16``):

* bytes — the weight files the compressed run wrote against what ``save_pretrained`` writes for the
  dense bfloat16 model (measured by saving it), and their ratio;
* reload — the folder loaded by ``fairprune.hub.load_model`` against the same pruning done again in
  memory (magnitude is deterministic): every tensor bit for bit, in bfloat16;
* perplexity — the run's own figure (measured on the in-memory pruned model before it was saved)
  against ``prune.py evaluate`` on the reloaded folder, same tokens and window.

    python bench/compressed_lm.py [--eval_tokens 2048] [--nsamples 8] [--threads 1]

Writes ``bench/results/compressed_lm.json`` and ``.md``. A few minutes on one CPU thread (the
GGUF's conversion, about 40 s, comes first on a fresh checkout).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from fairprune.cli.prune import main as prune_main
from fairprune.hub import load_model
from fairprune.hub.compressed import dense_weight_bytes, weight_file_bytes
from fairprune.pruning.llm import prune_causal_lm
from fairprune.pruning.sparsity import Sparsity

RESULTS = Path(__file__).parent / "results"


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def identical(a: torch.nn.Module, b: torch.nn.Module) -> tuple[bool, int]:
    """Whether two models hold the same tensors bit for bit, and how many tensors were compared."""
    sa, sb = a.state_dict(), b.state_dict()
    same = sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(_bits(sa[k]), _bits(sb[k])) for k in sa)
    return same, len(sa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--eval_tokens", type=int, default=2048)
    parser.add_argument("--nsamples", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=None, help="folder for the runs (default: a temporary folder, removed)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    common = ["--eval_tokens", str(args.eval_tokens), "--nsamples", str(args.nsamples),
              "--threads", str(args.threads), "--device", "cpu", "--dtype", "bfloat16", "--quiet", "--dense_cache", "false"]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.output or scratch)
        dense = load_model(args.model, dtype="bfloat16")
        dense.save_pretrained(root / "dense_bf16")
        dense_files, dense_tensors = weight_file_bytes(root / "dense_bf16"), dense_weight_bytes(dense)
        del dense
        for pattern in ("0.5", "2:4"):
            sparsity = Sparsity.parse(pattern)
            out = root / f"magnitude_{sparsity.label}"
            start = time.perf_counter()
            assert prune_main(["magnitude", "--model", args.model, *common, "--sparsity", pattern, "--save_format", "compressed",
                               "--output", str(out)]) == 0
            run_seconds = time.perf_counter() - start
            report = json.loads((out / "report.json").read_text())
            tick = time.perf_counter()
            reloaded = load_model(str(out))
            load_seconds = time.perf_counter() - tick
            again = load_model(args.model, dtype="bfloat16")
            prune_causal_lm(again, "magnitude", sparsity, progress=False)
            same, tensors = identical(reloaded, again)
            del reloaded, again
            assert prune_main(["evaluate", "--model", str(out), *common, "--output", str(out / "eval")]) == 0
            evaluated = json.loads((out / "eval" / "report.json").read_text())
            weights = report["weights"]
            rows.append({"sparsity": pattern, "format": weights["format"], "dtype": weights["dtype"],
                         "dense_file_bytes": dense_files, "dense_tensor_bytes": dense_tensors,
                         "report_dense_bytes": weights["dense_bytes"], "compressed_file_bytes": weights["file_bytes"],
                         "ratio_vs_dense_files": weights["file_bytes"] / dense_files, "ratio_in_report": weights["ratio"],
                         "compressed_layers": weights["compressed_layers"], "achieved_sparsity": report["achieved_sparsity"],
                         "reload_identical": same, "tensors_compared": tensors, "reload_seconds": load_seconds,
                         "perplexity_dense": report["reference"]["metrics"]["perplexity"],
                         "perplexity_pruned": report["metrics"]["perplexity"],
                         "perplexity_reloaded": evaluated["metrics"]["perplexity"],
                         "stereotype_score_pruned": report["metrics"]["stereotype_score"],
                         "stereotype_score_reloaded": evaluated["metrics"]["stereotype_score"],
                         "run_seconds": run_seconds})
            print(json.dumps(rows[-1]), flush=True)
    settings = {**vars(args), "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "compressed_lm.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=2) + "\n")
    lines = ["# Compressed checkpoints: SmolLM2-135M, magnitude pruning, bfloat16", "",
             f"`prune.py magnitude --model {args.model} --save_format compressed --dtype bfloat16 --eval_tokens "
             f"{args.eval_tokens} --nsamples {args.nsamples} --threads {args.threads}`. Dense: `save_pretrained` of the "
             "bfloat16 model (measured). Reload: `fairprune.hub.load_model(folder)` against the same pruning redone "
             "in memory. Perplexity: the run's figure (in-memory model) and `prune.py evaluate` on the reloaded folder.",
             "", "| sparsity | format | dense MB | compressed MB | ratio | reload bit-identical | perplexity dense | "
             "pruned | reloaded |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['sparsity']} | {r['format']} | {r['dense_file_bytes'] / 1e6:.1f} | "
                     f"{r['compressed_file_bytes'] / 1e6:.1f} | {r['ratio_vs_dense_files']:.3f} | "
                     f"{'yes' if r['reload_identical'] else 'NO'} ({r['tensors_compared']} tensors) | "
                     f"{r['perplexity_dense']:.2f} | {r['perplexity_pruned']:.2f} | {r['perplexity_reloaded']:.2f} |")
    (RESULTS / "compressed_lm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
