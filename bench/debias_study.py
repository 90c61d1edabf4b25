"""Debias-SparseGPT against SparseGPT on the packaged SmolLM2-135M, over seeds and calibration
choices: stereotype score (with its binomial standard error) and perplexity at 50 %.

The seed chooses the calibration windows and the calibration / evaluation split of the bundled
pairs, so each seed is an independent replicate of the whole comparison. Variants:

* ``sparsegpt``: the plain Hessian from calibration text;
* ``debias+text``: the paired Hessian X0X0ᵀ + X1X1ᵀ + 2ΔXΔXᵀ plus the plain term from the same
  calibration text (what ``prune.py debias-sparsegpt`` does at every pattern);
* ``debias (pairs only)``: the paired Hessian alone, as the method's paper does for unstructured
  sparsity.

    python bench/debias_study.py --seeds 0 1 2 --threads 2

Writes bench/results/debias_study.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from fairprune.data.pairs import lm_texts
from fairprune.data.text import calibration_ids, paired_ids
from fairprune.hub import load_model, load_tokenizer
from fairprune.metrics.language import eval_ids, measure_lm
from fairprune.pruning.llm import prune_causal_lm
from fairprune.pruning.sparsity import Sparsity

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--eval_tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    rows = []
    for seed in args.seeds:
        texts = lm_texts(seed=seed)
        ids = eval_ids(texts.eval_text, tokenizer, args.eval_tokens)
        dense_model = load_model(args.model)
        dense = measure_lm(dense_model, tokenizer, ids, texts.eval_pairs, args.window, "cpu")
        rows.append({"seed": seed, "variant": "dense", **dense, "eval_pairs": len(texts.eval_pairs),
                     "calib_pairs": len(texts.calib_pairs), "seconds": 0.0})
        calib = calibration_ids(tokenizer, texts.calib_text, args.nsamples, args.seqlen, seed)
        pairs = paired_ids(tokenizer, texts.calib_pairs, args.seqlen)
        for variant, method, c, p in [("sparsegpt", "sparsegpt", calib, None),
                                      ("debias+text", "debias-sparsegpt", calib, pairs),
                                      ("debias (pairs only)", "debias-sparsegpt", None, pairs)]:
            model = load_model(args.model)
            start = time.perf_counter()
            prune_causal_lm(model, method, Sparsity.parse(0.5), c, p, "cpu", progress=False)
            seconds = time.perf_counter() - start
            figures = measure_lm(model, tokenizer, ids, texts.eval_pairs, args.window, "cpu")
            rows.append({"seed": seed, "variant": variant, **figures, "eval_pairs": len(texts.eval_pairs),
                         "calib_pairs": len(texts.calib_pairs), "seconds": seconds})
            print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        p, n = row["stereotype_score"], row["eval_pairs"]
        row["stereotype_se"] = math.sqrt(p * (1 - p) / n)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "debias_study.json").write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2))
    lines = ["# Debias-SparseGPT vs SparseGPT at 50 % (SmolLM2-135M, bundled texts and pairs)", "",
             f"{args.nsamples} calibration windows × {args.seqlen} tokens; perplexity on {args.eval_tokens} tokens "
             f"in {args.window}-token windows; stereotype score ± binomial standard error on the evaluation half of the pairs.",
             "", "| seed | variant | perplexity | stereotype score | prune s |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['seed']} | {row['variant']} | {row['perplexity']:.2f} | "
                     f"{row['stereotype_score']:.3f} ± {row['stereotype_se']:.3f} | {row['seconds']:.0f} |")
    (RESULTS / "debias_study.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
