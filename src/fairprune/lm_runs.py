"""Post-training LLM pruning runs: load, measure, prune, measure again, save, report.

Shared by ``prune.py {magnitude,wanda,sparsegpt,debias-sparsegpt,evaluate,compare}`` and by the
post-training callback that prunes when ``train.py fit`` ends. Text defaults are the bundled corpus
and the bundled paired stereotype set; real runs pass ``--calib_text`` (e.g. C4 shards as a text
file), ``--eval_text`` (WikiText-2's raw test split) and ``--pairs`` (StereoSet / CrowS-Pairs).

The paired set is split once, seeded, into a calibration half (Debias-SparseGPT's Hessian) and an
evaluation half (the stereotype score), so the score is never measured on the pairs that shaped
the pruning.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import yaml

from fairprune.data.lm import load_tokenizer, read_text
from fairprune.data.text import calibration_ids, lm_corpus, paired_ids, stereo_pairs
from fairprune.errors import UserError
from fairprune.metrics.language import perplexity, read_pairs, stereotype_score
from fairprune.models.language import load_causal_lm
from fairprune.pruning.llm import METHODS, prune_causal_lm, sparsity_by_layer
from fairprune.models.families import family_of
from fairprune.reports import markdown, write_json


def parse_sparsity(value: float | str) -> tuple[float | None, tuple[int, int] | None]:
    """``0.5`` → unstructured 50 %; ``"2:4"`` → N:M. Errors name the fix."""
    if isinstance(value, str) and ":" in value:
        try:
            n, m = (int(part) for part in value.split(":"))
        except ValueError:
            raise UserError(f"N:M sparsity must look like 2:4, got '{value}'") from None
        if not 0 < n < m:
            raise UserError(f"N:M sparsity needs 0 < N < M, got {value}")
        return None, (n, m)
    try:
        sparsity = float(value)
    except ValueError:
        raise UserError(f"sparsity must be a number in [0, 1) or N:M like 2:4, got '{value}'") from None
    if not 0.0 <= sparsity < 1.0:
        hint = " (quote N:M patterns in YAML lists, \"2:4\": unquoted, 2:4 reads as the number 124)" if sparsity >= 60 else ""
        raise UserError(f"sparsity must be in [0, 1) or N:M, got {value}{hint}")
    return sparsity, None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def split_pairs(pairs: list[tuple[str, str]], seed: int) -> tuple[list, list]:
    """Seeded halves: (calibration pairs, evaluation pairs)."""
    if len(pairs) < 2:
        raise UserError(f"the paired set has {len(pairs)} pair(s); give at least two")
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    half = len(pairs) // 2
    return [pairs[i] for i in order[:half]], [pairs[i] for i in order[half:]]


def texts_and_pairs(calib_text: str | None, eval_text: str | None, pairs: str | None, seed: int):
    """(calibration text, evaluation text, calibration pairs, evaluation pairs) with bundled defaults."""
    bundled = lm_corpus() if calib_text is None or eval_text is None else None
    calib = read_text(calib_text) if calib_text else bundled.train
    evaluation = read_text(eval_text) if eval_text else bundled.validation
    all_pairs = read_pairs(pairs) if pairs else stereo_pairs()
    return (calib, evaluation, *split_pairs(all_pairs, seed))


def measure(model, tokenizer, eval_text: str, eval_pairs: list, seqlen: int, device: torch.device) -> dict[str, float]:
    """Perplexity (non-overlapping windows) and paired stereotype score (0.5 ideal)."""
    model.eval()
    return {
        "perplexity": float(perplexity(model, eval_text, tokenizer, seqlen=seqlen, device=device, batch_size=8)),
        "stereotype_score": float(stereotype_score(model, tokenizer, eval_pairs, device=device)),
    }


def prune_loaded(
    model, tokenizer, method: str, sparsity: float | str, output: str | Path, *,
    calib_text: str, eval_text: str, calib_pairs: list, eval_pairs: list, model_name: str,
    nsamples: int = 128, seqlen: int = 128, eval_seqlen: int | None = None, device: str = "auto",
    percdamp: float = 0.01, blocksize: int = 128, seed: int = 0, config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Prune a loaded model in place, measure before and after, save it and its report."""
    if method not in METHODS:
        from fairprune.errors import suggest

        raise UserError(f"unknown LLM pruning method '{method}'{suggest(method, METHODS)}; choose one of {', '.join(METHODS)}")
    target, nm = parse_sparsity(sparsity)
    dev = resolve_device(device)
    family_of(model)  # unknown families fail here, before any work
    eval_seqlen = eval_seqlen or seqlen
    start = time.perf_counter()
    print(f"[{method}] measuring the dense model ...", flush=True)
    before = measure(model, tokenizer, eval_text, eval_pairs, eval_seqlen, dev)
    calib = calibration_ids(tokenizer, calib_text, nsamples, seqlen, seed) if method != "magnitude" else None
    pairs = paired_ids(tokenizer, calib_pairs, seqlen) if method == "debias-sparsegpt" else None
    model.to("cpu")
    result = prune_causal_lm(model, method, target, nm, calib, pairs, dev, percdamp, blocksize)
    print(f"[{method}] measuring the pruned model ...", flush=True)
    after = measure(model, tokenizer, eval_text, eval_pairs, eval_seqlen, dev)
    model.to("cpu")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    report = {
        "method": method, "model": model_name, "family": result["family"], "target_sparsity": result["target_sparsity"],
        "nm": result["nm"], "achieved_sparsity": result["achieved_sparsity"], "metrics": after,
        "reference": {"method": "dense", "metrics": before},
        "calibration": {"nsamples": nsamples if calib is not None else 0, "seqlen": seqlen,
                        "pairs": len(calib_pairs) if pairs is not None else 0, "eval_pairs": len(eval_pairs)},
        "seconds": {**result["seconds"], "total": time.perf_counter() - start},
    }
    pd.DataFrame([{"layer": k, "sparsity": v} for k, v in result["layers"].items()]).to_csv(out / "sparsity.csv", index=False)
    (out / "config.yaml").write_text(yaml.safe_dump(config or {"method": method, "sparsity": str(sparsity)}, sort_keys=False))
    write_json(out / "report.json", report)
    print(f"[{method}] perplexity {before['perplexity']:.2f} → {after['perplexity']:.2f}, stereotype score "
          f"{before['stereotype_score']:.3f} → {after['stereotype_score']:.3f}, sparsity {report['achieved_sparsity']:.4f}; "
          f"written to {out}", flush=True)
    return report


def run_llm_pruning(model: str, method: str, sparsity: float | str, output: str | Path, *, calib_text: str | None = None,
                    eval_text: str | None = None, pairs: str | None = None, trust_remote_code: bool = False,
                    seed: int = 0, **settings: Any) -> dict[str, Any]:
    """``prune.py <method>``: load by name or path, prune, save an HF folder and its report."""
    calib, evaluation, calib_pairs, eval_pairs = texts_and_pairs(calib_text, eval_text, pairs, seed)
    tokenizer = load_tokenizer(model, trust_remote_code)
    lm = load_causal_lm(model, trust_remote_code)
    config = {"model": model, "method": method, "sparsity": str(sparsity), "calib_text": calib_text, "eval_text": eval_text,
              "pairs": pairs, "seed": seed, **settings}
    return prune_loaded(lm, tokenizer, method, sparsity, output, calib_text=calib, eval_text=evaluation,
                        calib_pairs=calib_pairs, eval_pairs=eval_pairs, model_name=model, seed=seed, config=config, **settings)


def evaluate_lm(model: str, output: str | Path | None = None, *, eval_text: str | None = None, pairs: str | None = None,
                seqlen: int = 128, device: str = "auto", trust_remote_code: bool = False, seed: int = 0) -> dict[str, Any]:
    """``prune.py evaluate``: perplexity, stereotype score and sparsity of any causal LM."""
    _, evaluation, _, eval_pairs = texts_and_pairs(None, eval_text, pairs, seed)
    tokenizer = load_tokenizer(model, trust_remote_code)
    lm = load_causal_lm(model, trust_remote_code)
    layers = sparsity_by_layer(lm, family_of(lm))
    report = {"method": "evaluate", "model": model, "achieved_sparsity": layers.pop("__total__"),
              "metrics": measure(lm, tokenizer, evaluation, eval_pairs, seqlen, resolve_device(device))}
    if output:
        write_json(Path(output) / "report.json", report)
    print(f"[evaluate] {model}: perplexity {report['metrics']['perplexity']:.2f}, stereotype score "
          f"{report['metrics']['stereotype_score']:.3f}, sparsity {report['achieved_sparsity']:.4f}")
    return report


def compare_lm(model: str, methods: list[str], sparsities: list[float | str], output: str | Path, *,
               calib_text: str | None = None, eval_text: str | None = None, pairs: str | None = None,
               trust_remote_code: bool = False, seed: int = 0, **settings: Any) -> pd.DataFrame:
    """Every method at every sparsity from one model; ``comparison.csv`` / ``.md`` in ``output``."""
    for method in methods:
        if method not in METHODS:
            raise UserError(f"unknown LLM pruning method '{method}'; choose from {', '.join(METHODS)}")
    for s in sparsities:
        parse_sparsity(s)
    calib, evaluation, calib_pairs, eval_pairs = texts_and_pairs(calib_text, eval_text, pairs, seed)
    tokenizer = load_tokenizer(model, trust_remote_code)
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for method in methods:
        for s in sparsities:
            name = f"{method}_{str(s).replace(':', 'of')}"
            print(f"[compare] {name} ...", flush=True)
            lm = load_causal_lm(model, trust_remote_code)
            report = prune_loaded(lm, tokenizer, method, s, Path(output) / name, calib_text=calib, eval_text=evaluation,
                                  calib_pairs=calib_pairs, eval_pairs=eval_pairs, model_name=model, seed=seed, **settings)
            if not rows:
                rows.append({"method": "dense", "sparsity": "0", "achieved_sparsity": 0.0, **report["reference"]["metrics"],
                             "seconds": 0.0})
            rows.append({"method": method, "sparsity": str(s), "achieved_sparsity": report["achieved_sparsity"],
                         **report["metrics"], "seconds": report["seconds"]["total"]})
    table = pd.DataFrame(rows)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "comparison.csv", index=False)
    (out / "comparison.md").write_text(markdown(table.set_index("method")) + "\n")
    write_json(out / "report.json", {"comparison": rows, "seconds": {"total": time.perf_counter() - start}})
    return table


def run_fasp_cli(args) -> dict[str, Any]:
    """``prune.py fasp``: score heads, select, remove, save, and write ``report.json``."""

    from fairprune.data.prompts import read_prompts
    from fairprune.pruning.fasp import Generation, run_fasp

    for name in ("alpha",) + (("gamma",) if args.gamma is not None else ()):
        if not 0.0 <= args[name] <= 1.0:
            raise UserError(f"--{name} must be in [0, 1], got {args[name]}")
    prompts = read_prompts(args.prompts) if args.prompts else None
    tokenizer = load_tokenizer(args.model, args.trust_remote_code)
    model = load_causal_lm(args.model, args.trust_remote_code)
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
    from fairprune.pruning.fasp import METHODS as HEAD_METHODS, Generation, run_fasp

    for method in methods:
        if method not in HEAD_METHODS:
            raise UserError(f"unknown head-pruning method '{method}'; choose from {', '.join(HEAD_METHODS)}")
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
            report = run_fasp(load_causal_lm(model, trust_remote_code), tokenizer, table_prompts, text, method, gamma, alpha,
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
