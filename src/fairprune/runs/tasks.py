"""The lm-evaluation-harness pass of the LM commands (``--tasks``): checked before any work, run on
the model in memory (the dense model once, from the project cache when an earlier run scored the
same weights on the same task data with the same settings), and folded into the run's report:
``tasks`` (every figure and what it was measured on), the headline figures among ``metrics`` as
``<task>/<metric>``, their intervals in ``ci`` and the paired differences against the dense model
in ``paired`` (:mod:`fairprune.metrics.harness`).

Under ``torchrun`` rank 0 alone runs lm-eval (it scores a model in memory in one process); the
other ranks wait for it at the next barrier and write nothing, as always.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import fairprune
from fairprune import distributed
from fairprune.causal.blocks import as_blocks
from fairprune.metrics.harness import (
    TaskItems,
    TaskResults,
    TaskSpec,
    check_runnable,
    check_tasks,
    headline,
    letter_warnings,
    resolve_tasks,
    run_tasks,
    task_facts,
    task_figures,
    task_intervals,
    task_paired,
)
from fairprune.storage.digest import file_sha256

TASK_CACHE_VERSION = 3  # 2: letter tasks record their number of choices; 3: samples record their chance level


def task_specs(lm) -> list[TaskSpec] | None:
    """``--tasks`` / ``--task_data`` checked (one line on a mistake) and resolved to their data
    files, before the model loads; None without ``--tasks``."""
    data = check_tasks(lm.tasks, lm.task_data)
    if not lm.tasks:
        return None
    specs = resolve_tasks(list(lm.tasks), data)
    check_runnable(specs, lm.num_fewshot)
    return specs


def _cache_path(key: dict[str, Any]) -> Path:
    from fairprune.runs.dense import cache_path

    return cache_path(key, "tasks")


def _key(blocks, specs: list[TaskSpec], lm, device) -> dict[str, Any]:
    import torch

    from fairprune.metrics.harness import _lm_eval_version
    from fairprune.runs.dense import library_versions, weights_digest

    return {"version": TASK_CACHE_VERSION, "fairprune": fairprune.__version__, "lm_eval": _lm_eval_version(),
            "model": weights_digest(blocks), "tasks": [[s.name, s.scoring, s.data and file_sha256(s.data)] for s in specs],
            "limit": lm.limit, "num_fewshot": lm.num_fewshot, "seed": lm.seed, "device": torch.device(device).type,
            "dtype": str(getattr(torch, lm.dtype)), "libraries": library_versions()}


def measure_tasks(model, tokenizer, specs: list[TaskSpec] | None, lm, device, progress: bool = True,
                  use_cache: bool = False, who: str = "") -> TaskResults | None:
    """lm-eval on ``model`` (rank 0 only; None elsewhere and without ``specs``). ``use_cache``: the
    dense model's results from the project cache when an earlier run scored the same weights on
    the same files with the same settings, else measured and cached. ``model``: an ``nn.Module``
    or a block model; a streamed one runs with each part read from its files as the forward
    reaches it (:meth:`~fairprune.causal.blocks.BlockModel.runnable`), and the facts say so."""
    if not specs or not distributed.is_main():
        return None
    blocks = as_blocks(model)
    key = _key(blocks, specs, lm, device) if use_cache else None
    if key is not None:
        try:
            stored = json.loads(_cache_path(key).read_text())
            items = TaskItems(stored["items"]) if stored.get("key") == key else None
        except (OSError, ValueError, KeyError, TypeError):
            items = None
        if items is not None:
            if progress:
                print(f"[tasks] {who}figures from the cache ({_cache_path(key)})", flush=True)
            facts = task_facts(specs, items, lm.limit, lm.num_fewshot)
            return TaskResults(task_figures(items), items, facts, 0.0, from_cache=True)
    if progress:
        how = " (streamed: each part read from the files as the forward reaches it)" if blocks.reads_files else ""
        print(f"[tasks] {who}lm-eval{how}: {', '.join(s.name for s in specs)} ...", flush=True)
    with blocks.runnable(device) as runnable:
        results = run_tasks(runnable, tokenizer, specs, limit=lm.limit, num_fewshot=lm.num_fewshot, device=device,
                            progress=progress, seed=lm.seed, streamed=blocks.reads_files)
    results.facts.update(blocks.pass_facts())
    for line in letter_warnings(results.facts, who.strip() or str(lm.model)):
        print(line, file=sys.stderr, flush=True)
    if key is not None:
        from fairprune.reporting.report import write_json

        try:
            write_json(_cache_path(key), {"key": key, "items": results.items.tasks, "facts": results.facts})
        except OSError as err:  # a read-only cache costs the next run a measurement, not this run its result
            warnings.warn(f"could not write the task cache {_cache_path(key)}: {err}", stacklevel=2)
    return results


def attach(report: dict[str, Any], results: TaskResults | None, dense: TaskResults | None = None) -> None:
    """Fold a model's task results (and the dense model's, as its reference) into its report."""
    if results is None:
        return
    intervals = task_intervals(results.items)
    report["tasks"] = {"figures": results.figures, "chance": results.chance(), "validity": results.validity(intervals),
                       "facts": results.facts, "seconds": results.seconds, "from_cache": results.from_cache}
    report.setdefault("metrics", {}).update(headline(results.figures))
    report.setdefault("ci", {}).update(intervals)
    report.setdefault("seconds", {})["tasks"] = results.seconds
    if dense is not None and "reference" in report:
        reference = report["reference"]
        reference.setdefault("metrics", {}).update(headline(dense.figures))
        reference["tasks"] = dense.figures
        reference["tasks_validity"] = dense.validity()
        reference["tasks_from_cache"] = dense.from_cache
        reference.setdefault("ci", {}).update(task_intervals(dense.items))
        report.setdefault("paired", {"baseline": "dense"}).update(task_paired(results.items, dense.items))

