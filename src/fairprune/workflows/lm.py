"""Post-training LLM pruning runs: load, measure, prune, measure again, save, report.

Shared by ``prune.py {magnitude,wanda,sparsegpt,debias-sparsegpt,evaluate,compare}``. Text defaults
are the bundled corpus and the bundled paired stereotype set; real runs pass ``--calib_text`` (e.g.
C4 shards as a text file), ``--eval_text`` (WikiText-2's raw test split) and ``--pairs``
(StereoSet / CrowS-Pairs). See :mod:`fairprune.data.pairs` for the calibration / evaluation split.

The evaluation text is tokenized once per command (capped at ``--eval_tokens``) and the dense
model's figures are obtained once: ``compare`` measures the dense model once for every method, and
every command takes them from the project cache when an earlier run measured the same weights on
the same texts with the same settings (:mod:`fairprune.workflows.dense`; ``--dense_cache false``
measures again). Reports split the time into ``load``, ``prune`` and ``evaluate``.

Each command runs under ``torchrun`` too (``@_torchrun``): the process group is made once from the
environment when the command starts and destroyed when it ends; every rank loads the model and
calibrates / measures on its shard (:mod:`fairprune.distributed`), rank 0 alone writes files and
prints, the others wait for it.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from fairprune import distributed
from fairprune.data.pairs import LMTexts, lm_texts
from fairprune.errors import UserError
from fairprune.families import family_of
from fairprune.hub import load_model, load_tokenizer, resolve_device
from fairprune.hub.checks import check_input_model, saved_bytes
from fairprune.hub.compressed import check_can_compress, dense_weight_bytes, weights_summary
from fairprune.metrics.harness import TaskItems, TaskSpec, dto, task_intervals, task_paired
from fairprune.metrics.language import LMItems, eval_ids
from fairprune.metrics.lm_bootstrap import lm_intervals, lm_paired
from fairprune.pruning import registry
from fairprune.pruning.llm import check_pattern_fits, evaluation_facts, prune_and_measure, sparsity_by_layer
from fairprune.pruning.options import SolverOptions
from fairprune.pruning.sparsity import Sparsity
from fairprune.reporting.compare import write_comparison
from fairprune.reporting.records import LMRow
from fairprune.reporting.runs import check_result, write_lm_run
from fairprune.storage.folders import check_free_space
from fairprune.storage.lock import locked
from fairprune.workflows.dense import DenseFigures, dense_figures, finish_evaluation, pruned_line
from fairprune.workflows.launch import torchrun as _torchrun
from fairprune.workflows.options import LMOptions, MachineOptions, model_folder
from fairprune.workflows.tasks import attach, measure_tasks, task_specs

#: A pandas DataFrame. Named so, not imported, because the command-line parser resolves the
#: annotations of a command's module by running its type-checking imports, and pandas costs an
#: LM run 30 MB it does not otherwise need until its tables are written.
Table = Any


def _load(lm: LMOptions, calibration: bool = True) -> tuple[LMTexts, Any, Any]:
    """The texts, the tokenizer and the model of an LM command (a model with NaN / inf weights is
    refused here, before any work)."""
    texts = lm_texts(lm.calib_text if calibration else None, lm.eval_text, lm.pairs, lm.seed)
    tokenizer = load_tokenizer(lm.model, lm.trust_remote_code)
    check_can_compress(lm.save_format)  # --save_format compressed without its package: refused before loading
    model = load_model(lm.model, "causal-lm", lm.trust_remote_code, dtype=lm.dtype)
    check_input_model(model, lm.model)
    return texts, tokenizer, model


def _dense(model, tokenizer, texts: LMTexts, lm: LMOptions, machine: MachineOptions,
           specs: list[TaskSpec] | None = None, who: str = "dense model: ") -> tuple[torch.Tensor, DenseFigures]:
    """The evaluation ids (tokenized once, capped) and the dense model's figures (cache or
    measured), with its lm-eval results when ``specs`` name tasks."""
    ids = eval_ids(texts.eval_text, tokenizer, lm.eval_tokens)
    device = resolve_device(lm.device)
    dense = dense_figures(model, tokenizer, ids, texts.eval_pairs, lm.window, device,
                          eval_tokens=lm.eval_tokens, use_cache=lm.dense_cache, progress=machine.progress)
    dense.tasks = measure_tasks(model, tokenizer, specs, lm, device, machine.progress, use_cache=lm.dense_cache, who=who)
    return ids, dense


def prune_loaded(model, tokenizer, method: str, sparsity: Sparsity, output: str | Path, texts, lm: LMOptions,
                 solver: SolverOptions, config: dict[str, Any], *, ids: torch.Tensor | None = None,
                 dense: DenseFigures | None = None, shared_dense: bool = False, machine: MachineOptions = MachineOptions(),
                 load_seconds: float = 0.0, specs: list[TaskSpec] | None = None) -> dict[str, Any]:
    """Prune a loaded model in place, measure it (and the dense model unless ``dense`` is given),
    save it and its report. ``ids``: the evaluation text already tokenized. Timings: this run's
    ``load_seconds`` and, unless ``shared_dense`` (one dense measurement serving several runs),
    the seconds ``dense`` took count towards the run's ``evaluate`` and ``total``. ``specs``: the
    lm-eval tasks the pruned model is scored on (against ``dense.tasks``)."""
    start = time.perf_counter()
    report, layers, items = prune_and_measure(
        model, tokenizer, method, sparsity, texts, nsamples=lm.nsamples, seqlen=lm.seqlen, eval_seqlen=lm.window,
        device=resolve_device(lm.device), seed=lm.seed, percdamp=solver.percdamp, blocksize=solver.blocksize,
        eval_tokens=lm.eval_tokens, eval_ids=ids, dense=None if dense is None else dense.metrics,
        dense_items=None if dense is None else dense.items, progress=machine.progress)
    report = {"method": method, "model": lm.model, **report, "threads": torch.get_num_threads()}
    if dense is not None:
        report["reference"].update(from_cache=dense.from_cache, seconds=dense.seconds)
    tasks = measure_tasks(model, tokenizer, specs, lm, resolve_device(lm.device), machine.progress, who=f"{method}: ")
    model.to("cpu")
    attach(report, tasks, None if dense is None else dense.tasks)
    seconds, dense_seconds = report["seconds"], 0.0 if dense is None or shared_dense else dense.seconds
    task_seconds = seconds.get("tasks", 0.0)  # lm-eval's pass on the pruned model (--tasks) counts as evaluation
    report["seconds"] = {"load": load_seconds, "prune": seconds["prune"], "solve": seconds["solve"],
                         "evaluate": seconds["evaluate"] + dense_seconds + task_seconds,
                         "total": load_seconds + dense_seconds + time.perf_counter() - start,
                         **({"tasks": task_seconds} if tasks is not None else {})}
    check_result(model, output, method)  # on every rank (each holds the same model): all stop together
    if distributed.is_main():  # torchrun: every rank holds the same model and figures; one writes
        write_lm_run(output, model, tokenizer, report, config, layers, items, save_format=lm.save_format, nm=sparsity.nm,
                     task_items=None if tasks is None else tasks.items)
        print(pruned_line(method, report, output), flush=True)
        print(f"[{method}] {weights_summary(report['weights'])}", flush=True)
    distributed.barrier()
    return report


def _config(lm: LMOptions, machine: MachineOptions, **fields: Any) -> dict[str, Any]:
    return {**fields, **asdict(lm), **asdict(machine)}


@_torchrun  # outermost: the lock is taken inside the process group, by its rank 0 alone
@locked(lambda output, **_: output, reads=model_folder)
def prune_lm(method: str, lm: LMOptions, output: str, sparsity: str = "0.5", nm: str | None = None,
             solver: SolverOptions = SolverOptions(), machine: MachineOptions = MachineOptions()) -> dict[str, Any]:
    """Post-training pruning of a causal LM: load, measure, prune, measure again; writes the pruned
    model (``from_pretrained`` loads ``output``), ``report.json``, ``sparsity.csv``, ``config.yaml``.

    Args:
        method: magnitude, wanda, sparsegpt or debias-sparsegpt.
        lm: the model and its texts.
        output: folder for the pruned model and its report.
        sparsity: fraction in [0, 1) or N:M such as 2:4.
        nm: N:M pattern (the same as --sparsity 2:4).
        solver: SparseGPT's settings.
        machine: threads and progress bars.
    """
    start = time.perf_counter()
    machine.apply()
    registry.get(method, "lm")
    sparsity = Sparsity.parse(nm or sparsity)  # a bad value fails before the model loads
    specs = task_specs(lm)  # --tasks / --task_data mistakes too
    if lm.stream:  # read and written block by block, never whole in memory
        from fairprune.workflows.streamed import prune_lm_streamed

        config = _config(lm, machine, method=method, sparsity=str(sparsity), **asdict(solver))
        return prune_lm_streamed(method, lm, output, sparsity, solver, machine, config, start, specs)
    texts, tokenizer, model = _load(lm)
    check_pattern_fits(model, sparsity)  # N:M against the layer widths, before the dense model is measured
    check_free_space(output, saved_bytes(model, tokenizer))  # a full disk is found now, not after the work
    load_seconds = time.perf_counter() - start
    ids, dense = _dense(model, tokenizer, texts, lm, machine, specs)
    config = _config(lm, machine, method=method, sparsity=str(sparsity), **asdict(solver))
    return prune_loaded(model, tokenizer, method, sparsity, output, texts, lm, solver, config, ids=ids, dense=dense,
                        machine=machine, load_seconds=load_seconds, specs=specs)


@_torchrun  # outermost: the lock is taken inside the process group, by its rank 0 alone
@locked(lambda output, **_: output, reads=model_folder)
def evaluate_lm(lm: LMOptions, output: str | None = None, machine: MachineOptions = MachineOptions()) -> dict[str, Any]:
    """Perplexity, stereotype score and sparsity of any causal LM (from the cache when an earlier
    run measured the same weights on the same texts with the same settings).

    Args:
        lm: the model and its texts.
        output: folder for report.json (none: print only).
        machine: threads and progress bars.
    """
    start = time.perf_counter()
    machine.apply()
    specs = task_specs(lm)
    if lm.stream:  # read block by block, never whole in memory
        from fairprune.workflows.streamed import evaluate_lm_streamed

        return evaluate_lm_streamed(lm, output, machine, start, specs)
    texts, tokenizer, model = _load(lm, calibration=False)
    loaded = time.perf_counter()
    ids, figures = _dense(model, tokenizer, texts, lm, machine, specs, who="")
    layers = sparsity_by_layer(model, family_of(model))
    report = {"method": "evaluate", "model": lm.model, "achieved_sparsity": layers.pop("__total__"),
              "metrics": figures.metrics, "from_cache": figures.from_cache,
              "evaluation": evaluation_facts(ids, lm.window, lm.eval_tokens, texts.eval_pairs, tokenizer),
              "threads": torch.get_num_threads(),
              "seconds": {"load": loaded - start, "evaluate": figures.seconds, "total": time.perf_counter() - start}}
    if figures.items is not None:
        report["ci"] = lm_intervals(figures.items)
    attach(report, figures.tasks)
    if not distributed.is_main():
        return report
    return finish_evaluation(report, figures, output, lm.model)


def _cell(method: str, sparsity: Sparsity) -> str:
    """The folder of one LM compare run: ``sparsegpt_0.5``, ``wanda_2of4``."""
    return f"{method}_{sparsity.label}"


def _compare_folders(output: str, methods: list[str], sparsities: list[str | float | Sparsity], **_: Any) -> list[Path]:
    """Every folder :func:`compare_lm` writes, its output first, named as its loop names them: all
    are locked before the model loads, so a run into one of them is refused while compare runs."""
    parsed = [Sparsity.parse(s) for s in sparsities]
    return [Path(output)] + [Path(output) / _cell(method, s) for method in methods for s in parsed]


@_torchrun  # outermost: the lock is taken inside the process group, by its rank 0 alone
@locked(_compare_folders, reads=model_folder)
def compare_lm(lm: LMOptions, methods: list[str], sparsities: list[str | float | Sparsity], output: str,
               solver: SolverOptions = SolverOptions(), machine: MachineOptions = MachineOptions(),
               baseline: str | None = None) -> Table:
    """Every method at every sparsity from one model: one run folder each (``<method>_<sparsity>``)
    and one comparison in ``output``. The dense model is measured once (or taken from the cache),
    and its figures are every run's reference. Every row carries 95 % intervals (perplexity over
    windows, stereotype score over pairs) and each method's paired difference against
    ``baseline`` (default: the first method; ``dense`` compares every run with the dense model)
    at the same sparsity, on the same windows and pairs."""
    import pandas as pd
    start = time.perf_counter()
    machine.apply()
    for method in methods:
        registry.get(method, "lm")
    baseline = baseline or methods[0]
    if baseline not in (*methods, "dense"):
        raise UserError(f"--baseline {baseline!r} is neither dense nor one of the compared methods ({', '.join(methods)}); "
                        "name one of them")
    sparsities = [Sparsity.parse(s) for s in sparsities]
    specs = task_specs(lm)
    if lm.stream:  # every run streams the model from disk; the dense figures are measured once
        return _compare_streamed(lm, methods, sparsities, output, solver, machine, baseline, start, specs)
    texts, tokenizer, model = _load(lm)
    for s in sparsities:  # every N:M pattern must fit the layer widths before the first run
        check_pattern_fits(model, s)
    check_free_space(output, saved_bytes(model, tokenizer) * len(methods) * len(sparsities))
    load_seconds = time.perf_counter() - start
    ids, dense = _dense(model, tokenizer, texts, lm, machine, specs)
    dense_zeros = sparsity_by_layer(model, family_of(model))["__total__"]
    rows = [LMRow.dense(dense.all_metrics(), dense_zeros, dense.seconds, dense_weight_bytes(model))]
    for method in methods:
        for s in sparsities:
            name = _cell(method, s)
            if distributed.is_main() and machine.progress:
                print(f"[compare] {name} ...", flush=True)
            tick = time.perf_counter()
            if model is None:  # the first run prunes the model the dense figures came from
                model = load_model(lm.model, "causal-lm", lm.trust_remote_code, dtype=lm.dtype)
                load_seconds = time.perf_counter() - tick
            config = _config(lm, machine, method=method, sparsity=str(s), **asdict(solver))
            report = prune_loaded(model, tokenizer, method, s, Path(output) / name, texts, lm, solver, config,
                                  ids=ids, dense=dense, shared_dense=True, machine=machine, load_seconds=load_seconds,
                                  specs=specs)
            model = None
            rows.append(LMRow.from_report(report, method, str(s)))
    if not distributed.is_main():
        return pd.DataFrame([row.as_dict() for row in rows])
    extra = {"evaluation": evaluation_facts(ids, lm.window, lm.eval_tokens, texts.eval_pairs, tokenizer)}
    return _write_lm_comparison(rows, output, extra, methods, sparsities, baseline, dense, dense_zeros, start,
                                "Language-model pruning comparison")


def _compare_streamed(lm: LMOptions, methods: list[str], sparsities: list[Sparsity], output: str, solver: SolverOptions,
                      machine: MachineOptions, baseline: str, start: float, specs: list[TaskSpec] | None = None) -> Table:
    """``compare --stream true``: each run is a streamed prune of the model on disk (one block
    resident) into its own folder; the dense model is measured once, streamed, and its figures
    cached, which every run then reads (with ``--dense_cache false`` each run measures it again)."""
    import pandas as pd

    from fairprune.workflows.streamed import check_streamable, prune_lm_streamed, streamed_dense

    check_streamable(lm)
    dense, dense_zeros, dense_bytes = streamed_dense(lm, machine, sparsities, specs)
    rows = [LMRow.dense(dense.all_metrics(), dense_zeros, dense.seconds, dense_bytes)]
    for method in methods:
        for s in sparsities:
            name = _cell(method, s)
            if distributed.is_main() and machine.progress:
                print(f"[compare] {name} (streamed) ...", flush=True)
            config = _config(lm, machine, method=method, sparsity=str(s), **asdict(solver))
            report = prune_lm_streamed(method, lm, str(Path(output) / name), s, solver, machine, config, specs=specs)
            if distributed.is_main():
                rows.append(LMRow.from_report(report, method, str(s)))
    if not distributed.is_main():
        return pd.DataFrame()
    return _write_lm_comparison(rows, output, {"stream": True}, methods, sparsities, baseline, dense, dense_zeros, start,
                                "Language-model pruning comparison (streamed)")


def _write_lm_comparison(rows: list[LMRow], output: str, extra: dict[str, Any], methods: list[str],
                         sparsities: list[Sparsity], baseline: str, dense: DenseFigures, dense_zeros: float, start: float,
                         title: str) -> Table:
    """An LM compare's table and report (in memory and streamed alike): the dense model as the
    reference, every row's intervals and paired differences from the run folders' items, DTO
    when the rows hold its figures."""
    reference = {"method": "dense", "metrics": dense.all_metrics(), "from_cache": dense.from_cache,
                 "dense_zero_fraction": dense_zeros, "seconds": dense.seconds}
    extra = {"reference": reference, **extra, "threads": torch.get_num_threads(),
             "seconds": {"total": time.perf_counter() - start}, "baseline": baseline}
    if dense.tasks is not None:
        reference["tasks"] = dense.tasks.figures
        extra["tasks"] = dense.tasks.facts
    intervals, paired = _lm_statistics(Path(output), methods, sparsities, baseline, dense)
    rows, dto_facts = _with_dto(rows)
    if dto_facts is not None:
        extra["dto"] = dto_facts
    return write_comparison(rows, output, extra, intervals=intervals, paired=paired, baseline=baseline, title=title)


def _lm_statistics(output: Path, methods: list[str], sparsities: list[Sparsity], baseline: str,
                   dense: DenseFigures) -> tuple[list, list]:
    """Every row's intervals and each run's paired difference against ``baseline`` at its
    sparsity, from the items each run folder holds (``eval_items.npz``, ``task_items.json``) and
    the dense model's."""
    cells = [(m, str(s)) for m in methods for s in sparsities]
    items = {(m, s): LMItems.load(output / _cell(m, Sparsity.parse(s))) for m, s in cells}
    tasks = {(m, s): TaskItems.load(output / _cell(m, Sparsity.parse(s))) for m, s in cells}
    dense_tasks = None if dense.tasks is None else dense.tasks.items

    def intervals_of(found: LMItems | None, task_items: TaskItems | None) -> dict[str, Any]:
        return {**(lm_intervals(found) if found is not None else {}),
                **(task_intervals(task_items) if task_items is not None else {})}

    intervals = [({"method": m, "sparsity": s}, intervals_of(items[m, s], tasks[m, s])) for m, s in cells]
    intervals.append(({"method": "dense", "sparsity": "0"}, intervals_of(dense.items, dense_tasks)))
    paired = []
    for m, s in cells:
        if m == baseline:
            continue
        against = (dense.items, dense_tasks) if baseline == "dense" else (items.get((baseline, s)), tasks.get((baseline, s)))
        found = {}
        if items[m, s] is not None and against[0] is not None:
            found.update(lm_paired(items[m, s], against[0]))
        if tasks[m, s] is not None and against[1] is not None:
            found.update(task_paired(tasks[m, s], against[1]))
        if found:
            paired.append(({"method": m, "sparsity": s}, found))
    return intervals, paired


def _with_dto(rows: list[LMRow]) -> tuple[list[LMRow], dict[str, Any] | None]:
    """Each row with its DTO (:func:`fairprune.metrics.harness.dto`) when the rows hold MMLU and
    abstention accuracy; and what it was computed from."""
    from dataclasses import replace

    distances, used = dto([row.metrics for row in rows])
    if used is None:
        return rows, None
    rows = [replace(row, metrics={**row.metrics, "dto": d}) if d is not None else row for row, d in zip(rows, distances)]
    return rows, {"accuracy": "mmlu/acc", "abstention": used, "ideal": [1, 1],
                  "normalisation": "min-max over the rows of this comparison"}
