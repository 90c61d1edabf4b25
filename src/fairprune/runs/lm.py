"""One post-training run of an opened LM: prune, save, measure the pruned model, write the folder.

Every LM weight-pruning run goes through :func:`prune_run`: ``prune.py``'s LM commands
(:mod:`fairprune.workflows.lm`) and the ``PostTrainingPruning`` callback
(:mod:`fairprune.callbacks.post_training`), which build the same :class:`Measuring` first
(:func:`dense_of`: the evaluation ids and the dense model's figures, from the project cache when
enabled, with ``--tasks``' lm-eval results).

The same steps whether the model is in memory or streamed from disk (a block model,
:mod:`fairprune.causal.blocks`): calibration data from the run's texts; the layer-by-layer prune
(:func:`fairprune.pruning.llm.prune_causal_lm`; a streamed model writes each solved block as it
goes); the pruned model saved into a staging folder beside ``output`` (in memory:
``save_pretrained`` or the compressed format; streamed: the rest of the files beside the blocks
already written); the pruned model measured (streamed: read back from the files just written, so
the figures are those of the folder a later ``from_pretrained`` loads) and scored by lm-eval with
``--tasks``; the report (:func:`fairprune.pruning.llm.lm_report`, with ``memory``), ``sparsity.csv``,
the per-item outcomes, ``config.yaml``, the model card and ``report.json``; then the staging folder
swapped in whole (:func:`fairprune.storage.folders.replace_folder`).

A compare's round-to-nearest quantized row (``sparsegpt + w4a16``) prunes nothing: it takes its
float row's model, still in memory and pruned (``reuse``, the :class:`Pruned` record the float run
left on it), quantizes it, loads it back and measures it. Its weights are those a fresh prune
would quantize (the same dense model, calibration and solver give the same pruned weights), and
its report says so: ``pruned_from`` names the float row's folder, ``seconds.prune`` and
``seconds.solve`` are 0 and ``seconds.quantize`` is the quantize, save and load back.

Under ``torchrun`` every rank prunes and measures its share; rank 0 alone writes (a streamed run's
other ranks measure the pruned model from the files rank 0 wrote: its staging folder, whose path
it broadcasts, must be readable by every rank).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fairprune import distributed
from fairprune.causal.blocks import SaveOptions
from fairprune.causal.written import check_written, measure_written
from fairprune.causal.written import summary as written_summary
from fairprune.data.files import Chats
from fairprune.data.pairs import LMTexts
from fairprune.data.text import bos_of, calibration_ids, document_start, paired_ids
from fairprune.hub import resolve_device
from fairprune.hub.compressed import dtype_name, megabytes, weights_summary
from fairprune.metrics.bootstrap import lm_intervals, lm_paired
from fairprune.metrics.language import LMItems, eval_ids, measure_lm_items
from fairprune.pruning import registry
from fairprune.pruning.llm import prune_with
from fairprune.pruning.options import LMOptions, SolverOptions
from fairprune.pruning.sparsity import Sparsity
from fairprune.reporting.runs import RUN_FILES, write_run_files
from fairprune.runs.dense import DenseFigures, dense_figures, pruned_line
from fairprune.runs.tasks import attach, measure_tasks
from fairprune.storage.folders import replace_folder


def lm_report(result: dict, after: dict[str, float], items: LMItems, before: dict[str, float],
              before_items: LMItems | None, *, calibration: dict, evaluation: dict, seconds: dict,
              from_cache: bool = False, **extra: Any) -> dict[str, Any]:
    """The report of one post-training run, whatever ran it (a command, in memory or streamed, or
    the post-training callback): the method and sparsity facts of ``result``
    (:func:`prune_causal_lm`'s), the pruned model's figures ``after`` with their intervals, the
    dense model's ``before`` as the reference (with intervals, and the paired differences on the
    same windows and pairs when ``before_items`` are at hand); ``extra`` keys added at the top."""
    report: dict[str, Any] = {
        "method": result["method"], **{k: v for k, v in extra.items() if k == "model"},
        "family": result["family"], "target_sparsity": result["target_sparsity"],
        "nm": result["nm"], "achieved_sparsity": result["achieved_sparsity"],
        "sparsity": {"target": result["target_sparsity"], "nm": result["nm"], "achieved": result["achieved_sparsity"],
                     "dense_zero_fraction": result["dense_zero_fraction"]},
        "metrics": after, "reference": {"method": "dense", "metrics": before, "from_cache": from_cache},
        "calibration": calibration, "evaluation": evaluation, "seconds": seconds,
        **{k: v for k, v in extra.items() if k != "model"},
    }
    report["ci"] = lm_intervals(items)
    if before_items is not None:
        report["reference"]["ci"] = lm_intervals(before_items)
        report["paired"] = {"baseline": "dense", **lm_paired(items, before_items)}
    return report


def calibration_facts(texts: LMTexts, nsamples: int, seqlen: int, paired: bool) -> dict[str, Any]:
    """What a run calibrated on: windows and their length, the text they were drawn from (its name
    or path as given, and its chat rows when it is chat data; None when the run drew no window),
    stereotype pairs, evaluation pairs."""
    facts: dict[str, Any] = {"nsamples": nsamples, "seqlen": seqlen, "text": texts.calib_name if nsamples else None}
    if nsamples and isinstance(texts.calib_text, Chats):
        facts["chat_rows"] = len(texts.calib_text)
    return {**facts, "pairs": len(texts.calib_pairs) if paired else 0, "eval_pairs": len(texts.eval_pairs)}


def evaluation_facts(ids: torch.Tensor, window: int, eval_tokens: int | None, eval_pairs: list, tokenizer=None) -> dict:
    """What perplexity was measured on: the tokens scored (whole windows of ``ids``), the cap asked
    for, the window, the number of stereotype pairs, and the token each paired sentence is scored
    after (:func:`fairprune.data.text.document_start`: the plain document start, never a chat token)."""
    bos = bos_of(tokenizer) if tokenizer is not None else None
    span = window - 1 if bos is not None else window  # a BOS heads every window: the text fills the rest
    facts = {"tokens": ids.numel() // span * span, "eval_tokens": eval_tokens, "window": window,
             "pairs": len(eval_pairs)}
    if tokenizer is not None:
        facts["document_start"] = document_start(tokenizer)[0]
        facts["bos"] = tokenizer.convert_ids_to_tokens(bos) if bos is not None else None
    return facts


@dataclass(frozen=True)
class Measuring:
    """What the runs of one command are measured with, got once before them (:func:`dense_of`):
    the texts, the tokenizer, the evaluation ids (tokenized once, capped at ``--eval_tokens``), the
    dense model's figures (every run's reference) and the ``--tasks`` specs (None without them)."""

    texts: LMTexts
    tokenizer: Any
    ids: torch.Tensor
    dense: DenseFigures
    specs: list | None = None


@dataclass(frozen=True)
class Pruned:
    """A prune done on a block model in memory, recorded by :func:`prune_run` (its ``record``):
    the method and sparsity, :func:`fairprune.pruning.llm.prune_causal_lm`'s ``result`` and the
    run folder the float model was written to."""

    method: str
    sparsity: str
    result: dict[str, Any]
    folder: Path


@dataclass(frozen=True)
class Start:
    """What a run starts from: the seconds the model took to open (``load_seconds``), the peak
    resident memory when the work began (``rss_start``), whether one dense measurement serves
    several runs (``shared_dense``, as in compare: then its seconds are not counted towards this
    run's ``evaluate`` and ``total``), and a prune already done on the model in memory
    (``reuse``: the run saves it with round-to-nearest ``--quantize`` instead of pruning again)."""

    load_seconds: float = 0.0
    rss_start: int = 0
    shared_dense: bool = False
    reuse: Pruned | None = None
    modifiers: list | None = None  # the run's modifiers (a recipe's); None: those the flags name
    record: list | None = None  # a list the run appends its Pruned record to (a compare's quantized row takes it)


def lm_tasks(blocks, tokenizer, specs, lm: LMOptions, device, progress: bool, *, dense: bool = False,
             who: str = "dense model: "):
    """The lm-eval pass on ``blocks`` (rank 0; None without ``specs``), in memory or streamed
    (:meth:`~fairprune.causal.blocks.BlockModel.runnable`). ``dense``: the dense model, its results
    cached by its weights' digest."""
    if not specs or not distributed.is_main():
        return None
    return measure_tasks(blocks, tokenizer, specs, lm, device, progress, use_cache=dense and lm.dense_cache, who=who)


def dense_of(blocks, tokenizer, texts: LMTexts, lm: LMOptions, progress: bool = True, specs=None,
             who: str = "dense model: ") -> Measuring:
    """The evaluation ids (tokenized once, capped) and the dense model's figures (cache or
    measured), with its lm-eval results when ``specs`` name tasks: what every run of ``blocks``
    is measured with."""
    ids = eval_ids(texts.eval_text, tokenizer, lm.eval_tokens)
    device = resolve_device(lm.device)
    dense = dense_figures(blocks, tokenizer, ids, texts.eval_pairs, lm.window, device,
                          eval_tokens=lm.eval_tokens, use_cache=lm.dense_cache, progress=progress)
    dense.tasks = lm_tasks(blocks, tokenizer, specs, lm, device, progress, dense=True, who=who)
    return Measuring(texts, tokenizer, ids, dense, specs)


def memory_facts(blocks, start_bytes: int) -> dict[str, Any]:
    """A report's ``memory``: every rank's peak resident memory (collective under torchrun), the
    peak when the work began, and the model's sizes."""
    from fairprune.memory import rank_peaks

    peaks = rank_peaks()
    return {"peak_rss_bytes": peaks[0], "peak_rss_at_start_bytes": start_bytes, **blocks.facts(),
            **({"peak_rss_bytes_per_rank": peaks} if len(peaks) > 1 else {})}


def prune_run(blocks, method: str, sparsity: Sparsity, output: str | Path, measuring: Measuring, lm: LMOptions,
              solver: SolverOptions, config: dict[str, Any], start_from: Start = Start(),
              progress: bool = True) -> dict[str, Any]:
    """Prune ``blocks`` (in place, or block by block into ``output``) with ``method`` at
    ``sparsity``, measure, save and report (see the module docstring); ``config`` is written as the
    run's ``config.yaml``. ``measuring``: the texts (the calibration windows are drawn from the
    text of ``sparsity``, :meth:`LMTexts.at`), the evaluation ids and the dense model's figures,
    every run's reference (:func:`dense_of`). ``start_from``: what the run counts from
    (:class:`Start`), the prune it reuses, if any, the run's modifiers (a recipe's; None: those the
    flags name, ``method`` at ``sparsity`` then ``--quantize``) and where its :class:`Pruned`
    record goes."""
    from fairprune.pruning.modifiers import from_flags

    start = time.perf_counter()
    entry = registry.get(method, "lm")
    talk = progress and distributed.is_main()
    device = resolve_device(lm.device)
    texts, tokenizer, ids, dense = measuring.texts.at(sparsity), measuring.tokenizer, measuring.ids, measuring.dense
    settings = {"blocksize": solver.blocksize, "percdamp": solver.percdamp}
    modifiers = start_from.modifiers or from_flags(method, sparsity, lm.quantize, lm.quant_group_size, settings)
    calibrates, reuse = entry.uses_data or any(m.calibrates for m in modifiers), start_from.reuse  # GPTQ: every method
    for modifier in modifiers:  # before the writer opens: a quantized model's writer stores its scales
        modifier.begin(blocks)
    calib = (calibration_ids(tokenizer, texts.calib_text, lm.nsamples, lm.seqlen, lm.seed)
             if calibrates and reuse is None else None)
    pairs = paired_ids(tokenizer, texts.calib_pairs, lm.seqlen) if entry.paired and reuse is None else None
    dense_seconds = 0.0 if start_from.shared_dense else dense.seconds
    load_seconds = start_from.load_seconds
    report: dict[str, Any] = {}

    def write(out: Path | None) -> None:
        """Prune, save and measure; collective under torchrun: rank 0 writes into ``out`` (the
        staging folder), the other ranks (``out`` None) calibrate, solve and measure beside it."""
        tick = time.perf_counter()
        writer = blocks.writer(out)  # streamed: each block written as it is changed (quantized when asked)
        try:
            if reuse is None:
                result = prune_with(blocks, modifiers, calib, pairs, device, solver.moe_calibrate, talk, writer)
                if start_from.record is not None:
                    start_from.record.append(Pruned(method, str(sparsity), result, Path(output)))
            else:
                result = {**reuse.result, "seconds": {**reuse.result["seconds"], "solve": 0.0}}
            saving = SaveOptions(save_format=lm.save_format, nm=sparsity.nm, trust_remote_code=lm.trust_remote_code,
                                 progress=progress, method=method, output=str(output))
            pruned, weights = blocks.save(out, tokenizer, saving)
            written = None
            if out is not None:  # what the files hold, before anything is measured on them
                written = measure_written(out, blocks)
                check_written(written, float(sparsity.fraction), output)
        finally:
            if writer is not None:
                writer.abort()
        pruned_at = time.perf_counter()
        if talk:
            print(f"[{method}] measuring the pruned model ...", flush=True)
        after, items = measure_lm_items(pruned, tokenizer, ids, texts.eval_pairs, lm.window, device, progress=progress)
        tasks = lm_tasks(pruned, tokenizer, measuring.specs, lm, device, progress, who=f"{method}: ")
        end = time.perf_counter()
        memory = memory_facts(blocks, start_from.rss_start)
        if out is None:
            return
        quantization = weights.pop("quantization", None) if weights else None
        task_seconds = 0.0 if tasks is None else tasks.seconds
        saved = {"prune": pruned_at - tick} if reuse is None else {"prune": 0.0, "quantize": pruned_at - tick}
        report.update(lm_report(
            result, after, items, dense.metrics, dense.items, from_cache=dense.from_cache, model=lm.model,
            calibration=calibration_facts(texts, lm.nsamples if calibrates else 0, lm.seqlen, entry.paired),
            evaluation=evaluation_facts(ids, lm.window, lm.eval_tokens, texts.eval_pairs, tokenizer),
            seconds={"load": load_seconds, **saved, "solve": result["seconds"]["solve"],
                     "evaluate": dense_seconds + (end - pruned_at), "total": load_seconds + dense_seconds + end - start},
            threads=torch.get_num_threads(), stream=blocks.how == "streamed", weights=weights, memory=memory))
        report["reference"]["seconds"] = dense.seconds
        report["achieved_sparsity"] = written["achieved"]
        report["sparsity"].update(achieved=written["achieved"], solver_achieved=result["achieved_sparsity"],
                                  **{k: v for k, v in written.items() if k not in ("achieved", "units")})
        if "experts" in result:
            report["experts"] = result["experts"]
        if reuse is not None:  # pruned by the float run in that folder, then quantized here
            report["pruned_from"] = str(reuse.folder)
        if quantization is not None:  # the figures above are the loaded-back quantized model's
            report["quantization"] = quantization
        attach(report, tasks, dense.tasks)
        if tasks is not None:
            report["seconds"]["tasks"] = task_seconds
        write_run_files(out, report, config, result["layers"], items, None if tasks is None else tasks.items)

    if not distributed.is_main():  # torchrun: this rank works beside rank 0, which writes
        write(None)
    else:
        replace_folder(output, write, owned=RUN_FILES)
        memory = report["memory"]
        print(pruned_line(method, report, output), flush=True)
        print(f"[{method}] sparsity as written, by kind: {written_summary(report['sparsity'])}", flush=True)
        label = method if report.get("quantization") is None else f"{method} + {report['quantization']['scheme']}"
        print(f"[{label}] {weights_summary({**report['weights'], 'quantization': report.get('quantization')})}; {blocks.how} in "
              f"{dtype_name(blocks.dtype)}, peak resident memory {megabytes(memory['peak_rss_bytes'])} "
              f"({megabytes(memory['peak_rss_at_start_bytes'])} when the run began) for a {megabytes(memory['model_bytes'])} "
              "model", flush=True)
    distributed.barrier()
    return report
