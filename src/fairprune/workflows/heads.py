"""Attention-head pruning runs: ``prune.py fasp`` (FASP or a baseline) and ``prune.py compare
--alphas`` (several methods × α with the heads scored once)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pandas as pd

from fairprune.data.lm import read_text
from fairprune.errors import UserError
from fairprune.hub import load_model, load_tokenizer
from fairprune.reporting.report import markdown, write_json


def run_fasp_cli(args) -> dict[str, Any]:
    """``prune.py fasp``: score heads, select, remove, save, and write ``report.json``."""

    from fairprune.data.prompts import read_prompts
    from fairprune.pruning.fasp import Generation, run_fasp

    for name in ("alpha",) + (("gamma",) if args.gamma is not None else ()):
        if not 0.0 <= args[name] <= 1.0:
            raise UserError(f"--{name} must be in [0, 1], got {args[name]}")
    prompts = read_prompts(args.prompts) if args.prompts else None
    tokenizer = load_tokenizer(args.model, args.trust_remote_code)
    model = load_model(args.model, "causal-lm", args.trust_remote_code)
    ppl_text = read_text(args.ppl_text) if args.ppl_text else None
    eval_text = read_text(args.eval_text) if args.eval_text else None
    report = run_fasp(model, tokenizer, prompts, ppl_text, args.method, args.gamma, args.alpha, args.axis, args.scorer,
                      args.output, eval_text=eval_text, generation=Generation(max_new_tokens=args.max_new_tokens, seed=args.seed),
                      seqlen=args.seqlen, seed=args.seed)
    report.setdefault("model", args.model)
    write_json(Path(args.output) / "report.json", report)
    fairness = report.get("fairness", {}).get("bias", {})
    print(f"[fasp] {args.method}: removed {len(report.get('heads_removed', []))} heads; perplexity "
          f"{report['reference']['metrics']['perplexity']:.2f} → {report['metrics']['perplexity']:.2f}; bias {fairness}; "
          f"written to {args.output}")
    return report


def compare_fasp(model: str, methods: list[str], alphas: list[float], output: str | Path, *, gamma: float | None = 0.3,
                 axis: str = "gender_and_sex", scorer: str = "lexicon", prompts: str | None = None,
                 ppl_text: str | None = None, max_new_tokens: int = 20, seqlen: int = 128,
                 trust_remote_code: bool = False, seed: int = 0) -> pd.DataFrame:
    """FASP and its baselines at several α from one model: heads are scored once (the first run
    writes ``head_scores.csv``; later runs resume from a copy of it), one table of bias and
    perplexity in ``output``."""
    import shutil

    from fairprune.data.prompts import read_prompts
    from fairprune.pruning import registry
    from fairprune.pruning.fasp import Generation, run_fasp

    for method in methods:
        registry.get(method, "heads")
    for a in alphas:
        if not 0.0 <= a <= 1.0:
            raise UserError(f"alpha must be in [0, 1], got {a}")
    table_prompts = read_prompts(prompts) if prompts else None
    text = read_text(ppl_text) if ppl_text else None
    tokenizer = load_tokenizer(model, trust_remote_code)
    out, rows, shared = Path(output), [], None
    start = time.perf_counter()
    for method in methods:
        for alpha in alphas:
            run = out / f"{method}_a{alpha:g}"
            run.mkdir(parents=True, exist_ok=True)
            if shared is not None and not (run / "head_scores.csv").exists():
                for name in ("head_scores.csv", "head_scores.json"):
                    shutil.copy(shared / name, run / name)
            print(f"[compare] {run.name} ...", flush=True)
            report = run_fasp(load_model(model, "causal-lm", trust_remote_code), tokenizer, table_prompts, text, method, gamma, alpha,
                              axis, scorer, run, generation=Generation(max_new_tokens=max_new_tokens, seed=seed),
                              seqlen=seqlen, seed=seed)
            write_json(run / "report.json", report)
            if (run / "head_scores.csv").exists() and shared is None:
                shared = run
            if not rows:
                rows.append({"method": "dense", "alpha": 0.0, "gamma": None, "heads_removed": 0,
                             "perplexity": report["reference"]["metrics"]["perplexity"],
                             **{f"bias/{k}": v for k, v in report["reference"]["fairness"]["bias"].items()}})
            rows.append({"method": method, "alpha": alpha, "gamma": report["gamma"] if method == "fasp" else None,
                         "heads_removed": len(report["heads_removed"]), "perplexity": report["metrics"]["perplexity"],
                         **{f"bias/{k}": v for k, v in report["fairness"]["bias"].items()}})
    table = pd.DataFrame(rows)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "comparison.csv", index=False)
    (out / "comparison.md").write_text(markdown(table.set_index("method")) + "\n")
    write_json(out / "report.json", {"comparison": rows, "seconds": {"total": time.perf_counter() - start}})
    return table
