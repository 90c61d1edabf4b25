"""Post-training LLM pruning runs: load, measure, prune, measure again, save, report.

Shared by ``prune.py {magnitude,wanda,sparsegpt,debias-sparsegpt,evaluate,compare}``. Text defaults
are the bundled corpus and the bundled paired stereotype set; real runs pass ``--calib_text`` (e.g.
C4 shards as a text file), ``--eval_text`` (WikiText-2's raw test split) and ``--pairs``
(StereoSet / CrowS-Pairs). See :mod:`fairprune.data.pairs` for the calibration / evaluation split.

Each command runs under ``torchrun`` too (``@_torchrun``): the process group is made once from the
environment when the command starts and destroyed when it ends; every rank loads the model and
calibrates / measures on its shard (:mod:`fairprune.distributed`), rank 0 alone writes files and
prints, the others wait for it.
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandas as pd

from fairprune import distributed
from fairprune.data.pairs import lm_texts
from fairprune.hub import load_model, load_tokenizer, resolve_device
from fairprune.metrics.language import measure_lm
from fairprune.families import family_of
from fairprune.pruning import registry
from fairprune.pruning.llm import check_pattern_fits, parse_sparsity, prune_and_measure, sparsity_by_layer
from fairprune.reporting.compare import write_comparison
from fairprune.reporting.lock import locked
from fairprune.reporting.report import write_json
from fairprune.reporting.runs import write_lm_run
from fairprune.workflows.options import LMOptions, SolverOptions


def _torchrun(command):
    """Run an LM command inside :func:`fairprune.distributed.process_group` for its ``lm.device``
    (nothing changes in one process). The signature and docstring stay the command's, for prune.py."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        lm = inspect.signature(command).bind(*args, **kwargs).arguments["lm"]
        with distributed.process_group(lm.device):
            return command(*args, **kwargs)

    return run


def prune_loaded(model, tokenizer, method: str, sparsity: str, output: str | Path, texts, lm: LMOptions,
                 solver: SolverOptions, config: dict[str, Any]) -> dict[str, Any]:
    """Prune a loaded model in place, measure before and after, save it and its report."""
    report, layers = prune_and_measure(model, tokenizer, method, sparsity, texts, nsamples=lm.nsamples, seqlen=lm.seqlen,
                                       eval_seqlen=lm.window, device=resolve_device(lm.device), seed=lm.seed,
                                       percdamp=solver.percdamp, blocksize=solver.blocksize)
    report = {"method": method, "model": lm.model, **report}
    if distributed.is_main():  # torchrun: every rank holds the same model and figures; one writes
        write_lm_run(output, model, tokenizer, report, config, layers)
        before, after = report["reference"]["metrics"], report["metrics"]
        print(f"[{method}] perplexity {before['perplexity']:.2f} → {after['perplexity']:.2f}, stereotype score "
              f"{before['stereotype_score']:.3f} → {after['stereotype_score']:.3f}, sparsity {report['achieved_sparsity']:.4f}; "
              f"written to {output}", flush=True)
    distributed.barrier()
    return report


@locked(lambda output, **_: output)
@_torchrun
def prune_lm(method: str, lm: LMOptions, output: str, sparsity: str = "0.5", nm: str | None = None,
             solver: SolverOptions = SolverOptions()) -> dict[str, Any]:
    """Post-training pruning of a causal LM: load, measure, prune, measure again; writes the pruned
    model (``from_pretrained`` loads ``output``), ``report.json``, ``sparsity.csv``, ``config.yaml``.

    Args:
        method: magnitude, wanda, sparsegpt or debias-sparsegpt.
        lm: the model and its texts.
        output: folder for the pruned model and its report.
        sparsity: fraction in [0, 1) or N:M such as 2:4.
        nm: N:M pattern (the same as --sparsity 2:4).
        solver: SparseGPT's settings.
    """
    registry.get(method, "lm")
    sparsity = nm or sparsity
    parse_sparsity(sparsity)  # a bad value fails before the model loads
    texts = lm_texts(lm.calib_text, lm.eval_text, lm.pairs, lm.seed)
    tokenizer = load_tokenizer(lm.model, lm.trust_remote_code)
    model = load_model(lm.model, "causal-lm", lm.trust_remote_code)
    check_pattern_fits(model, sparsity)  # N:M against the layer widths, before the dense model is measured
    config = {"method": method, "sparsity": str(sparsity), **asdict(lm), **asdict(solver)}
    return prune_loaded(model, tokenizer, method, sparsity, output, texts, lm, solver, config)


@locked(lambda output, **_: output)
@_torchrun
def evaluate_lm(lm: LMOptions, output: str | None = None) -> dict[str, Any]:
    """Perplexity, stereotype score and sparsity of any causal LM.

    Args:
        lm: the model and its texts.
        output: folder for report.json (none: print only).
    """
    texts = lm_texts(None, lm.eval_text, lm.pairs, lm.seed)
    tokenizer = load_tokenizer(lm.model, lm.trust_remote_code)
    model = load_model(lm.model, "causal-lm", lm.trust_remote_code)
    layers = sparsity_by_layer(model, family_of(model))
    report = {"method": "evaluate", "model": lm.model, "achieved_sparsity": layers.pop("__total__"),
              "metrics": measure_lm(model, tokenizer, texts.eval_text, texts.eval_pairs, lm.window, resolve_device(lm.device))}
    if not distributed.is_main():
        return report
    if output:
        write_json(Path(output) / "report.json", report)
    print(f"[evaluate] {lm.model}: perplexity {report['metrics']['perplexity']:.2f}, stereotype score "
          f"{report['metrics']['stereotype_score']:.3f}, sparsity {report['achieved_sparsity']:.4f}")
    return report


@locked(lambda output, **_: output)
@_torchrun
def compare_lm(lm: LMOptions, methods: list[str], sparsities: list[str], output: str,
               solver: SolverOptions = SolverOptions()) -> pd.DataFrame:
    """Every method at every sparsity from one model: one run folder each (``<method>_<sparsity>``)
    and one comparison in ``output``."""
    for method in methods:
        registry.get(method, "lm")
    for s in sparsities:
        parse_sparsity(s)
    texts = lm_texts(lm.calib_text, lm.eval_text, lm.pairs, lm.seed)
    tokenizer = load_tokenizer(lm.model, lm.trust_remote_code)
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for method in methods:
        for s in sparsities:
            name = f"{method}_{str(s).replace(':', 'of')}"
            if distributed.is_main():
                print(f"[compare] {name} ...", flush=True)
            model = load_model(lm.model, "causal-lm", lm.trust_remote_code)
            if not rows:  # the first model: every N:M pattern must fit its widths before the first run
                for other in sparsities:
                    check_pattern_fits(model, other)
            config = {"method": method, "sparsity": str(s), **asdict(lm), **asdict(solver)}
            report = prune_loaded(model, tokenizer, method, str(s), Path(output) / name, texts, lm, solver, config)
            if not rows:
                rows.append({"method": "dense", "sparsity": "0", "achieved_sparsity": 0.0, **report["reference"]["metrics"],
                             "seconds": 0.0})
            rows.append({"method": method, "sparsity": str(s), "achieved_sparsity": report["achieved_sparsity"],
                         **report["metrics"], "seconds": report["seconds"]["total"]})
    if not distributed.is_main():
        return pd.DataFrame(rows)
    return write_comparison(rows, output, {"seconds": {"total": time.perf_counter() - start}})
