"""Post-training LLM pruning runs: load, measure, prune, measure again, save, report.

Shared by ``prune.py {magnitude,wanda,sparsegpt,debias-sparsegpt,evaluate,compare}``. Text defaults
are the bundled corpus and the bundled paired stereotype set; real runs pass ``--calib_text`` (e.g.
C4 shards as a text file), ``--eval_text`` (WikiText-2's raw test split) and ``--pairs``
(StereoSet / CrowS-Pairs), and ``--calib_text_for`` a text of their own to the runs at a sparsity
(``{"2:4": bundled:ultrachat}``). See :mod:`fairprune.data.pairs` for the calibration / evaluation split.

The evaluation text is tokenized once per command (capped at ``--eval_tokens``) and the dense
model's figures are obtained once: ``compare`` measures the dense model once for every method, and
every command takes them from the project cache when an earlier run measured the same weights on
the same texts with the same settings (:mod:`fairprune.runs.dense`; ``--dense_cache false``
measures again). Reports split the time into ``load``, ``prune`` and ``evaluate``.

The model is opened once as a block model (:mod:`fairprune.workflows.opened`): in memory, or with
``--stream`` read block by block from its safetensors files (``auto``: when it would not fit
comfortably in memory). Everything after is the same pipeline for both: the dense figures and their
cache, the run (:mod:`fairprune.runs.lm`, the one the ``PostTrainingPruning`` callback runs
too), the compare loop and its table.

Each command runs under ``torchrun`` too (``@_torchrun``): the process group is made once from the
environment when the command starts and destroyed when it ends; every rank loads the model and
calibrates / measures on its shard (:mod:`fairprune.distributed`), rank 0 alone writes files and
prints, the others wait for it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from fairprune import distributed
from fairprune.causal.blocks import zero_fraction
from fairprune.data.pairs import LMTexts, lm_texts
from fairprune.errors import UserError, stop_in
from fairprune.hub import load_tokenizer
from fairprune.memory import peak_rss_bytes
from fairprune.metrics.bootstrap import lm_intervals, lm_paired
from fairprune.metrics.harness import TaskItems, dto, task_intervals, task_paired
from fairprune.metrics.language import LMItems
from fairprune.pruning import registry
from fairprune.pruning.llm import check_pattern_fits
from fairprune.pruning.options import LMOptions, SolverOptions
from fairprune.pruning.sparsity import Sparsity
from fairprune.reporting.compare import Statistics
from fairprune.reporting.records import LMRow
from fairprune.runs.dense import DenseFigures, finish_evaluation
from fairprune.runs.lm import Pruned, Start, dense_of, evaluation_facts, memory_facts, prune_run
from fairprune.runs.tasks import attach, task_specs
from fairprune.storage.folders import check_free_space
from fairprune.storage.lock import locked
from fairprune.workflows.compare import Cell, Written, compare_folders, run_compare
from fairprune.workflows.launch import torchrun as _torchrun
from fairprune.workflows.opened import open_blocks, stream_choice
from fairprune.workflows.options import MachineOptions, model_folder

#: A pandas DataFrame. Named so, not imported, because the command-line parser resolves the
#: annotations of a command's module by running its type-checking imports, and pandas costs an
#: LM run 30 MB it does not otherwise need until its tables are written.
Table = Any


def _open(lm: LMOptions, machine: MachineOptions, calibration: bool = True) -> tuple[LMTexts, Any, Any, bool]:
    """The texts, the tokenizer and the model of an LM command as a block model, in memory or
    streamed (``--stream``, decided once here: :func:`fairprune.workflows.opened.stream_choice`)."""
    stream = stream_choice(lm)  # one line, --quiet or not: which way the run goes
    texts = (lm_texts(lm.calib_text, lm.eval_text, lm.pairs, lm.seed, lm.calib_text_for) if calibration
             else lm_texts(None, lm.eval_text, lm.pairs, lm.seed))
    tokenizer = load_tokenizer(lm.model, lm.trust_remote_code)
    return texts, tokenizer, open_blocks(lm, stream), stream


def _check_quantize(blocks, lm: LMOptions) -> None:
    """``--quantize`` against the model's block layers (Linear, a group size for each), before any work."""
    if lm.quantize != "none":
        from fairprune.causal.experts import refuse_quantize
        from fairprune.hub.quantized import check_groups, linear_layers

        refuse_quantize(blocks, lm.quantize)
        check_groups(linear_layers(blocks.layers()), lm.quant_group_size)


def _check_experts(blocks, methods: list[str]) -> None:
    """Experts a calibrated method could not calibrate (:func:`fairprune.causal.experts.check_routed`),
    refused before any work; magnitude reads no inputs and prunes them."""
    if any(registry.get(method, "lm").statistic is not None for method in methods):
        from fairprune.causal.experts import check_routed

        for block in blocks.blocks:
            check_routed(block, str(getattr(blocks.model.config, "model_type", "this model")))


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
    start, rss_start = time.perf_counter(), peak_rss_bytes()
    machine.apply()
    registry.get(method, "lm")
    sparsity = Sparsity.parse(nm or sparsity)  # a bad value fails before the model loads
    lm.check_calib_text_for([sparsity], "--sparsity")
    config = _config(lm, machine, method=method, sparsity=str(sparsity), **asdict(solver))
    return _prune(method, sparsity, lm, output, solver, machine, config, Start(0.0, rss_start), start)


def _prune(method: str, sparsity: Sparsity, lm: LMOptions, output: str, solver: SolverOptions, machine: MachineOptions,
           config: dict[str, Any], start_from: Start, start: float, modifiers: list | None = None) -> dict[str, Any]:
    """Open, check, measure the dense model, then the run (:func:`fairprune.runs.lm.prune_run`)."""
    specs = task_specs(lm)  # --tasks / --task_data mistakes too
    texts, tokenizer, blocks, _ = _open(lm, machine)
    check_pattern_fits(blocks.model, sparsity)  # N:M against the layer widths, before the dense model is measured
    _check_quantize(blocks, lm)
    _check_experts(blocks, [method])
    check_free_space(output, blocks.saved_bytes(tokenizer))  # a full disk is found now, not after the work
    load_seconds = time.perf_counter() - start
    measuring = dense_of(blocks, tokenizer, texts, lm, machine.progress, specs)
    return prune_run(blocks, method, sparsity, output, measuring, lm, solver, config,
                     replace(start_from, load_seconds=load_seconds, modifiers=modifiers), machine.progress)


@_torchrun  # outermost: the lock is taken inside the process group, by its rank 0 alone
@locked(lambda output, **_: output, reads=model_folder)
def prune_recipe(recipe: str, lm: LMOptions, output: str, solver: SolverOptions = SolverOptions(),
                 machine: MachineOptions = MachineOptions()) -> dict[str, Any]:
    """Post-training run of a causal LM by a recipe: its modifiers (one pruning method, then
    optionally quantize) applied block by block in order; the same folder and report as
    ``prune.py <method> --sparsity S --quantize Q``.

    Args:
        recipe: YAML list of modifiers, e.g. [{sparsegpt: {sparsity: "2:4"}}, {quantize: {scheme: w4a16-gptq}}].
        lm: the model and its texts (give quantization in the recipe, not --quantize).
        output: folder for the pruned model and its report.
        solver: SparseGPT's and GPTQ's settings.
        machine: threads and progress bars.
    """
    from fairprune.pruning.modifiers import Quantize
    from fairprune.pruning.recipe import read_recipe, recipe_of

    start, rss_start = time.perf_counter(), peak_rss_bytes()
    machine.apply()
    if lm.quantize != "none":
        raise UserError(f"--quantize {lm.quantize} with --recipe: give quantization as a recipe entry "
                        "({quantize: {scheme: ...}}), once")
    modifiers = read_recipe(recipe, {"blocksize": solver.blocksize, "percdamp": solver.percdamp})
    quantize = next((m for m in modifiers if isinstance(m, Quantize)), None)
    if quantize is not None:  # the run's options say what the recipe does: checks, config and report agree
        lm = replace(lm, quantize=quantize.scheme, quant_group_size=quantize.group_size)
    method, sparsity = modifiers[0].name, modifiers[0].sparsity
    lm.check_calib_text_for([sparsity], "the recipe")
    config = _config(lm, machine, method=method, sparsity=str(sparsity), recipe=recipe_of(modifiers), **asdict(solver))
    return _prune(method, sparsity, lm, output, solver, machine, config, Start(0.0, rss_start), start, modifiers)


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
    rss_start = peak_rss_bytes()
    machine.apply()
    specs = task_specs(lm)
    texts, tokenizer, blocks, stream = _open(lm, machine, calibration=False)
    loaded = time.perf_counter()
    measured = dense_of(blocks, tokenizer, texts, lm, machine.progress, specs, who="")
    ids, figures = measured.ids, measured.dense
    memory = memory_facts(blocks, rss_start)
    if not distributed.is_main():  # torchrun: rank 0 counts the zeros, reports and writes
        return {}
    report = {"method": "evaluate", "model": lm.model, "achieved_sparsity": zero_fraction(blocks),
              "metrics": figures.metrics, "from_cache": figures.from_cache,
              "evaluation": evaluation_facts(ids, lm.window, lm.eval_tokens, texts.eval_pairs, tokenizer),
              "threads": torch.get_num_threads(), "stream": stream,
              "seconds": {"load": loaded - start, "evaluate": figures.seconds, "total": time.perf_counter() - start}}
    if figures.items is not None:
        report["ci"] = lm_intervals(figures.items)
    attach(report, figures.tasks)
    report["memory"] = memory
    return finish_evaluation(report, figures, output, lm.model)


def _cells(output: str, methods: list[str], sparsities: list[str | float | Sparsity], lm: LMOptions | None = None,
           **_: Any) -> list[Cell]:
    """The runs of an LM compare, in order, keyed ``(row label, method, sparsity, quantize)``; with
    ``--quantize`` each method of ``--quantize_methods`` (default: all) and sparsity twice, pruned
    (``sparsegpt_0.5``) then pruned and quantized (``sparsegpt + w4a16``, ``sparsegpt_0.5_w4a16``)."""
    quantize, quantized = (lm.quantize, lm.quantize_methods) if lm is not None else ("none", None)
    found = []
    for method in methods:
        for s in map(Sparsity.parse, sparsities):
            found.append(Cell(Path(output) / f"{method}_{s.label}", (method, method, s, "none")))
            if quantize != "none" and (quantized is None or method in quantized):
                found.append(Cell(Path(output) / f"{method}_{s.label}_{quantize}", (f"{method} + {quantize}", method, s, quantize)))
    return found


def _reusable(kept, method: str, sparsity: Sparsity, quantize: str) -> Pruned | None:
    """What a quantized row takes from its float row (``kept``: that run's model in memory,
    pruned, and its :class:`Pruned` record): its prune, when the row rounds to nearest (w4a16, w8a16), so the same pruned weights
    are quantized without pruning again; None for a float row and for GPTQ (``-gptq``), whose
    rounding is solved from the calibration Hessians while the model is pruned."""
    from fairprune.hub.quantized import is_gptq

    if kept is None or quantize == "none" or is_gptq(quantize):
        return None
    _, pruned = kept
    return pruned if (pruned.method, pruned.sparsity) == (method, str(sparsity)) else None


@_torchrun  # outermost: the lock is taken inside the process group, by its rank 0 alone
@locked(lambda output, **args: compare_folders(output, _cells(output, **args)), reads=model_folder)
def compare_lm(lm: LMOptions, methods: list[str], sparsities: list[str | float | Sparsity], output: str,
               solver: SolverOptions = SolverOptions(), machine: MachineOptions = MachineOptions(),
               baseline: str | None = None) -> Table:
    """Every method at every sparsity from one model: one run folder each (``<method>_<sparsity>``)
    and one comparison in ``output``. The dense model is measured once (or taken from the cache),
    and its figures are every run's reference. Every row carries 95 % intervals (perplexity over
    windows, stereotype score over pairs) and each method's paired difference against
    ``baseline`` (default: the first method; ``dense`` compares every run with the dense model)
    at the same sparsity, on the same windows and pairs. With ``--quantize``, each method and
    sparsity also gets a pruned and quantized row (``sparsegpt + w4a16``, its folder
    ``sparsegpt_0.5_w4a16``: the float row's pruned model quantized, or with ``-gptq`` or
    ``--stream`` the model pruned again the same way, then quantized; measured as loaded back),
    paired against the same baseline: with the method itself as the baseline, its quantized row's
    difference is what quantization cost on top of pruning. With ``--calib_text_for`` (``{"2:4":
    TEXT}``) the cells at a sparsity calibrate on that text instead of ``--calib_text``; each cell's
    ``config.yaml`` names the text it calibrated on, so an earlier cell calibrated on another is
    not reused."""
    start = time.perf_counter()
    machine.apply()
    for method in methods:
        registry.get(method, "lm")
    baseline = baseline or methods[0]
    if baseline not in (*methods, "dense"):
        raise UserError(f"--baseline {baseline!r} is neither dense nor one of the compared methods ({', '.join(methods)}); "
                        "name one of them")
    sparsities = [Sparsity.parse(s) for s in sparsities]
    lm.check_calib_text_for(sparsities)
    stray = sorted(set(lm.quantize_methods or ()) - set(methods))
    if stray:
        raise UserError(f"--quantize_methods names {', '.join(stray)}, which --methods does not compare "
                        f"({', '.join(methods)}); name compared methods")
    specs = task_specs(lm)
    texts, tokenizer, blocks, stream = _open(lm, machine)
    for s in sparsities:  # every N:M pattern must fit the layer widths before the first run
        check_pattern_fits(blocks.model, s)
    _check_quantize(blocks, lm)
    _check_experts(blocks, methods)
    cells = _cells(output, methods, sparsities, lm)
    check_free_space(output, blocks.saved_bytes(tokenizer) * len(cells))
    load_seconds = time.perf_counter() - start
    measuring = dense_of(blocks, tokenizer, texts, lm, machine.progress, specs)
    ids, dense = measuring.ids, measuring.dense
    dense_zeros = zero_fraction(blocks)
    dense_row = LMRow.dense(dense.all_metrics(), dense_zeros, dense.seconds, blocks.weight_bytes(),
                            validity=None if dense.tasks is None else dense.tasks.validity())
    opened, blocks = [blocks], None  # the model the dense figures came from: the first run prunes it (in memory: in place)
    kept: list = []  # the last float run's pruned model in memory, for its round-to-nearest quantized row

    def config_of(cell: Cell) -> dict[str, Any]:
        _, method, s, quantize = cell.key
        return _config(replace(lm.at_sparsity(s), quantize=quantize, quantize_methods=None), machine, method=method,
                       sparsity=str(s), **asdict(solver))

    def earlier(cell: Cell) -> tuple[dict[str, Any] | None, None]:
        return _earlier_lm_cell(cell.folder, config_of(cell), dense, specs is not None), None

    def run(cell: Cell, resume: str | None) -> dict[str, Any]:
        try:
            return run_cell(cell)
        except BaseException as err:
            stop_in(err, f"cell {cell.name}{cell.tag}", "run the same command again: the finished cells are reused, "
                    "this one runs again")
            raise

    def run_cell(cell: Cell) -> dict[str, Any]:
        nonlocal load_seconds
        _, method, s, quantize = cell.key
        tick = time.perf_counter()
        reuse = _reusable(kept[0] if kept else None, method, s, quantize)
        if reuse is not None:  # the float row's model, pruned: quantized as it is
            opened[:], load_seconds = [kept[0][0]], 0.0
        kept.clear()
        if not opened:  # each later run opens the model again
            opened.append(open_blocks(lm, stream))
            load_seconds = time.perf_counter() - tick
        run_lm = replace(lm.at_sparsity(s), quantize=quantize, quantize_methods=None)
        config = config_of(cell)
        blocks = opened.pop()
        record: list = []
        report = prune_run(blocks, method, s, cell.folder, measuring, run_lm, solver, config,
                           Start(load_seconds, peak_rss_bytes(), shared_dense=True, reuse=reuse, record=record),
                           machine.progress)
        if quantize == "none" and blocks.holds_changes:  # in memory: the pruned model, for the quantized row
            kept.append((blocks, record[0]))
        return report

    def finish(done: list[tuple[Cell, dict[str, Any]]]) -> Written:
        """The dense model as the reference, intervals and paired differences from the items, DTO."""
        reference = {"method": "dense", "metrics": dense.all_metrics(), "from_cache": dense.from_cache,
                     "dense_zero_fraction": dense_zeros, "seconds": dense.seconds}
        extra = {"reference": reference,
                 "evaluation": evaluation_facts(ids, lm.window, lm.eval_tokens, texts.eval_pairs, tokenizer), "stream": stream,
                 "threads": torch.get_num_threads(), "seconds": {"total": time.perf_counter() - start}, "baseline": baseline}
        if dense.tasks is not None:
            reference["tasks"] = dense.tasks.figures
            extra["tasks"] = dense.tasks.facts
        rows, dto_facts = _with_dto([dense_row, *(LMRow.from_report(report, cell.key[0], str(cell.key[2]))
                                                  for cell, report in done)])
        if dto_facts is not None:
            extra["dto"] = dto_facts
        return Written(rows, extra, "Language-model pruning comparison" + (" (streamed)" if stream else ""),
                       _lm_statistics(cells, baseline, dense))

    return run_compare(output, cells, run, finish, earlier, talk=distributed.is_main() and machine.progress)


#: Settings that change no figure of a run: an earlier cell with other values of these is reused.
_NO_RESULT = ("quiet", "dense_cache", "quantize_methods")


def _earlier_lm_cell(folder: Path, config: dict[str, Any], dense: DenseFigures, tasks: bool) -> dict[str, Any] | None:
    """The report an earlier compare left finished in an LM cell's folder, reused when it was run
    with the same settings (its ``config.yaml``, leaving out :data:`_NO_RESULT`) against the same
    dense figures (so the same model weights, texts and windows), and its per-item files are whole
    (the statistics read them); else None: the cell runs again."""
    import yaml

    def identity(found: Any) -> Any:
        return {k: v for k, v in found.items() if k not in _NO_RESULT} if isinstance(found, dict) else found

    try:
        if identity(yaml.safe_load((folder / "config.yaml").read_text())) != identity(yaml.safe_load(yaml.safe_dump(config))):
            return None
        report = json.loads((folder / "report.json").read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    as_written = {k: None if isinstance(v, float) and v != v else v for k, v in dense.metrics.items()}  # NaN: null
    if not isinstance(report, dict) or (report.get("reference") or {}).get("metrics") != as_written:
        return None
    if LMItems.load(folder) is None or (tasks and TaskItems.load(folder) is None):
        return None
    return report


def _lm_statistics(cells: list[Cell], baseline: str, dense: DenseFigures) -> Statistics:
    """Every row's intervals and each run's paired difference against ``baseline`` at its
    sparsity, from the items each run folder holds (``eval_items.npz``, ``task_items.json``) and
    the dense model's."""
    found = {(cell.key[0], str(cell.key[2])): (LMItems.load(cell.folder), TaskItems.load(cell.folder)) for cell in cells}
    found["dense", "0"] = dense.items, None if dense.tasks is None else dense.tasks.items
    intervals = [({"method": m, "sparsity": s}, {**(lm_intervals(items) if items is not None else {}),
                                                 **(task_intervals(tasks) if tasks is not None else {})})
                 for (m, s), (items, tasks) in found.items()]
    paired = []
    for (m, s), (items, tasks) in found.items():
        if m in (baseline, "dense"):
            continue
        against = found.get(("dense", "0") if baseline == "dense" else (baseline, s), (None, None))
        difference = {**(lm_paired(items, against[0]) if items is not None and against[0] is not None else {}),
                      **(task_paired(tasks, against[1]) if tasks is not None and against[1] is not None else {})}
        if difference:
            paired.append(({"method": m, "sparsity": s}, difference))
    return Statistics(intervals, paired, baseline)


def _with_dto(rows: list[LMRow]) -> tuple[list[LMRow], dict[str, Any] | None]:
    """Each row with its DTO (:func:`fairprune.metrics.harness.dto`, from the figures each row's
    run does not mark invalid) when the rows hold a knowledge and an abstention figure; and what it
    was computed from."""
    distances, used = dto([row.as_dict() for row in rows])
    if used is None:
        return rows, None
    rows = [replace(row, metrics={**row.metrics, "dto": d}) if d is not None else row for row, d in zip(rows, distances)]
    return rows, {**used, "ideal": [1, 1], "normalisation": "min-max over the rows of this comparison that hold both "
                                                          "figures validly, a figure below chance counted as chance"}
