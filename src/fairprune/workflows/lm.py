"""Post-training LLM pruning runs: load, measure, prune, measure again, save, report.

Shared by ``prune.py {magnitude,wanda,sparsegpt,debias-sparsegpt,evaluate,compare}``. Text defaults
are the bundled corpus and the bundled paired stereotype set; real runs pass ``--calib_text`` (e.g.
C4 shards as a text file), ``--eval_text`` (WikiText-2's raw test split) and ``--pairs``
(StereoSet / CrowS-Pairs). See :mod:`fairprune.data.pairs` for the calibration / evaluation split.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pandas as pd

from fairprune.data.pairs import lm_texts
from fairprune.hub import load_model, load_tokenizer, resolve_device
from fairprune.metrics.language import measure_lm
from fairprune.families import family_of
from fairprune.pruning import registry
from fairprune.pruning.llm import parse_sparsity, prune_and_measure, sparsity_by_layer
from fairprune.reporting.report import markdown, write_json, write_lm_run


def prune_loaded(model, tokenizer, method: str, sparsity: float | str, output: str | Path, texts, *, model_name: str,
                 device: str = "auto", config: dict[str, Any] | None = None, **settings: Any) -> dict[str, Any]:
    """Prune a loaded model in place, measure before and after, save it and its report."""
    report, layers = prune_and_measure(model, tokenizer, method, sparsity, texts, device=resolve_device(device), **settings)
    report = {"method": method, "model": model_name, **report}
    write_lm_run(output, model, tokenizer, report, layers, config or {"method": method, "sparsity": str(sparsity)})
    before, after = report["reference"]["metrics"], report["metrics"]
    print(f"[{method}] perplexity {before['perplexity']:.2f} → {after['perplexity']:.2f}, stereotype score "
          f"{before['stereotype_score']:.3f} → {after['stereotype_score']:.3f}, sparsity {report['achieved_sparsity']:.4f}; "
          f"written to {output}", flush=True)
    return report


def run_llm_pruning(model: str, method: str, sparsity: float | str, output: str | Path, *, calib_text: str | None = None,
                    eval_text: str | None = None, pairs: str | None = None, trust_remote_code: bool = False,
                    seed: int = 0, **settings: Any) -> dict[str, Any]:
    """``prune.py <method>``: load by name or path, prune, save an HF folder and its report."""
    texts = lm_texts(calib_text, eval_text, pairs, seed)
    tokenizer = load_tokenizer(model, trust_remote_code)
    lm = load_model(model, "causal-lm", trust_remote_code)
    config = {"model": model, "method": method, "sparsity": str(sparsity), "calib_text": calib_text, "eval_text": eval_text,
              "pairs": pairs, "seed": seed, **settings}
    return prune_loaded(lm, tokenizer, method, sparsity, output, texts, model_name=model, seed=seed, config=config, **settings)


def evaluate_lm(model: str, output: str | Path | None = None, *, eval_text: str | None = None, pairs: str | None = None,
                seqlen: int = 128, device: str = "auto", trust_remote_code: bool = False, seed: int = 0) -> dict[str, Any]:
    """``prune.py evaluate``: perplexity, stereotype score and sparsity of any causal LM."""
    texts = lm_texts(None, eval_text, pairs, seed)
    tokenizer = load_tokenizer(model, trust_remote_code)
    lm = load_model(model, "causal-lm", trust_remote_code)
    layers = sparsity_by_layer(lm, family_of(lm))
    report = {"method": "evaluate", "model": model, "achieved_sparsity": layers.pop("__total__"),
              "metrics": measure_lm(lm, tokenizer, texts.eval_text, texts.eval_pairs, seqlen, resolve_device(device))}
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
        registry.get(method, "lm")
    for s in sparsities:
        parse_sparsity(s)
    texts = lm_texts(calib_text, eval_text, pairs, seed)
    tokenizer = load_tokenizer(model, trust_remote_code)
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for method in methods:
        for s in sparsities:
            name = f"{method}_{str(s).replace(':', 'of')}"
            print(f"[compare] {name} ...", flush=True)
            lm = load_model(model, "causal-lm", trust_remote_code)
            report = prune_loaded(lm, tokenizer, method, s, Path(output) / name, texts, model_name=model, seed=seed, **settings)
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
