"""``prune.py <method> --stream true``: prune a causal LM bigger than memory, one block resident.

The same run as :func:`fairprune.workflows.lm.prune_lm` — measure the dense model, prune, measure
the pruned one, write the folder and its report — with the weights read block by block from the
input folder's safetensors files and the pruned ones written block by block to the output's
(:mod:`fairprune.pruning.streamed`, :mod:`fairprune.metrics.streamed`): the model is never whole in
memory, neither dense nor pruned. The pruned model is measured from the files just written, so
the figures are those of the folder a later ``from_pretrained`` loads.

``--model`` must be a local folder of safetensors weights (``save_pretrained``'s layout): a hub
name is read from its snapshot in the local cache, ``smollm2-135m`` / a ``*.gguf`` file from its
converted folder. ``--dtype`` is what blocks are held, run and written in (the solvers work in
float32 inside each layer). The dense figures come from the same cache as the in-memory runs:
the key hashes the weights as loaded in that dtype, read tensor by tensor.

Under ``torchrun`` every rank streams the same way and shares the work (calibration batches,
evaluation batches); rank 0 alone writes the output, and the other ranks measure the pruned model
from the files it wrote (its staging folder, whose path it broadcasts): the output folder must be
readable by every rank.

``report.json`` gains ``stream: true`` and ``memory``: the process's peak resident memory
(``ru_maxrss``) when the work began (after the imports) and at the end, the largest block's
parameter bytes and the largest part resident at once (a block, the embeddings or the head);
under ``torchrun`` also ``peak_rss_bytes_per_rank``.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

import fairprune
from fairprune import distributed
from fairprune.data.pairs import direction, lm_texts
from fairprune.data.text import calibration_ids, encode_sentence, paired_ids
from fairprune.errors import UserError
from fairprune.hub import load_tokenizer, resolve_device, resolve_name
from fairprune.hub.compressed import dtype_name, megabytes, torch_dtype, weight_file_bytes
from fairprune.hub.shards import ShardWriter, local_folder
from fairprune.metrics.language import eval_ids
from fairprune.metrics.lm_bootstrap import lm_intervals, lm_paired
from fairprune.metrics.streamed import measure_streamed
from fairprune.pruning import registry
from fairprune.pruning.llm import check_pattern_fits, evaluation_facts
from fairprune.pruning.options import SolverOptions
from fairprune.pruning.sparsity import Sparsity
from fairprune.pruning.streamed import StreamedModel, prune_streamed, stream_facts
from fairprune.reporting.model_card import write_model_card
from fairprune.reporting.report import write_json
from fairprune.reporting.runs import RUN_FILES
from fairprune.storage.atomic import write_csv, write_text
from fairprune.storage.folders import check_free_space, replace_folder
from fairprune.workflows import dense as dense_cache
from fairprune.workflows.dense import DenseFigures, cached_figures, finish_evaluation, pruned_line
from fairprune.workflows.options import LMOptions, MachineOptions
from fairprune.workflows.tasks import attach, measure_tasks, offloaded

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_freed_memory() -> None:
    """On glibc, serve every buffer of 256 KiB or more from its own mapping, so a freed block's
    weights or activations go back to the system at once. By default glibc raises that threshold
    to the size of the largest buffer freed so far, and later buffers below it come from a heap
    that does not shrink: a streamed run would keep the memory of blocks long gone."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 256 * 1024)
        except (OSError, AttributeError):  # another C library: its own policy stands
            pass


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far: ``ru_maxrss`` (KiB on Linux, bytes on macOS),
    on Linux taken from ``/proc/self/status`` (``VmHWM``, the same high-water mark) because
    ``ru_maxrss`` also keeps the resident size the parent had when it started this program."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


def open_streamed(lm: LMOptions) -> StreamedModel:
    """The streamed model a ``--model`` names, in ``--dtype`` (its weights stay on disk)."""
    folder = local_folder(lm.model, resolve_name(lm.model))
    return StreamedModel(folder, torch_dtype(lm.dtype), lm.trust_remote_code, source=lm.model)


def rank_peaks() -> list[int]:
    """Every rank's peak resident memory so far, by rank (this process's alone); collective under torchrun."""
    rank, size = distributed.world()
    peaks = torch.zeros(size, dtype=torch.float64)
    peaks[rank] = peak_rss_bytes()
    return [int(v) for v in distributed.all_reduce_sum(peaks).tolist()]


def check_streamable(lm: LMOptions) -> None:
    """Refuse what a streamed run does not do, before any work."""
    if lm.save_format != "dense":
        raise UserError(f"--stream true writes the pruned model block by block as plain safetensors; --save_format "
                        f"{lm.save_format} needs the whole model in memory: use --save_format dense with --stream true")


def streamed_digest(sm: StreamedModel) -> str:
    """:func:`fairprune.workflows.dense.weights_digest` of the model as ``from_pretrained`` would
    load it in the same dtype, read tensor by tensor (the same bytes, so the same digest)."""
    model = sm.model
    digest = hashlib.sha256(type(model).__name__.encode())
    settings = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict(keep_vars=True).items()):
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        flat = sm.read_output(name).contiguous().reshape(-1)
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()


def streamed_cache_key(sm: StreamedModel, tokenizer, ids: torch.Tensor, pairs: list, window: int,
                       eval_tokens: int | None, device) -> dict[str, Any]:
    """:func:`fairprune.workflows.dense.cache_key` of a streamed model."""
    pair_ids = [encode_sentence(tokenizer, sentence) for pair in pairs for sentence in pair]
    return {
        "version": dense_cache.CACHE_VERSION, "fairprune": fairprune.__version__,
        "model": streamed_digest(sm), "eval_ids": dense_cache._ids_digest(ids),
        "pairs": dense_cache._ids_digest([*pair_ids, [int(direction(pair) == "antistereo") for pair in pairs]]),
        "window": int(window), "eval_tokens": eval_tokens,
        "device": torch.device(device).type, "dtype": str(sm.dtype),
    }


def streamed_dense_figures(sm: StreamedModel, tokenizer, ids: torch.Tensor, pairs: list, window: int, device, *,
                           eval_tokens: int | None = None, use_cache: bool = True, progress: bool = True) -> DenseFigures:
    """:func:`fairprune.workflows.dense.dense_figures` of a streamed model: the cache entry an
    in-memory run of the same weights wrote, or a streamed measurement (then cached)."""
    key = streamed_cache_key(sm, tokenizer, ids, pairs, window, eval_tokens, device) if use_cache else None
    return cached_figures(key, lambda: measure_streamed(sm, tokenizer, ids, pairs, window, device, progress=progress),
                          progress, how=", streamed")


def write_model_files(sm: StreamedModel, out: Path) -> None:
    """``config.json`` (the run's dtype) and ``generation_config.json`` beside the weights, as
    ``save_pretrained`` writes them."""
    from transformers import GenerationConfig

    config = sm.model.config
    config.architectures = [type(sm.model).__name__]
    config.dtype = sm.dtype
    config.save_pretrained(out)
    generation = None
    if (sm.folder / "generation_config.json").is_file():
        try:
            generation = GenerationConfig.from_pretrained(sm.folder)
        except (OSError, ValueError):
            generation = None
    generation = generation or getattr(sm.model, "generation_config", None)
    if generation is not None and sm.model.can_generate():
        generation.save_pretrained(out)


def prune_lm_streamed(method: str, lm: LMOptions, output: str, sparsity: Sparsity, solver: SolverOptions,
                      machine: MachineOptions, config: dict[str, Any], start: float | None = None,
                      specs: list | None = None) -> dict[str, Any]:
    """The streamed ``prune.py <method>`` run (see the module docstring); ``config`` is written as
    the run's ``config.yaml``, ``start`` is when the command began (its imports before it)."""
    start = time.perf_counter() if start is None else start
    rss_start = peak_rss_bytes()
    entry = registry.get(method, "lm")
    check_streamable(lm)
    return_freed_memory()
    talk = machine.progress
    device = resolve_device(lm.device)
    texts = lm_texts(lm.calib_text, lm.eval_text, lm.pairs, lm.seed)
    tokenizer = load_tokenizer(lm.model, lm.trust_remote_code)
    sm = open_streamed(lm)
    check_pattern_fits(sm.model, sparsity)
    plan = sm.output_tensors()
    total_bytes = sum(t.numel() * t.element_size() for t in plan.values())
    check_free_space(output, total_bytes + 128 * len(tokenizer) + 64 * 1024)
    loaded = time.perf_counter()
    ids = eval_ids(texts.eval_text, tokenizer, lm.eval_tokens)
    dense = streamed_dense_figures(sm, tokenizer, ids, texts.eval_pairs, lm.window, device, eval_tokens=lm.eval_tokens,
                                   use_cache=lm.dense_cache, progress=talk)
    facts = stream_facts(sm)
    dense_tasks = streamed_tasks(sm, sm.folder, tokenizer, specs, lm, device, talk, facts, dense=True)
    calib = calibration_ids(tokenizer, texts.calib_text, lm.nsamples, lm.seqlen, lm.seed) if entry.uses_data else None
    pairs = paired_ids(tokenizer, texts.calib_pairs, lm.seqlen) if entry.paired else None
    report: dict[str, Any] = {}

    def write(out: Path | None) -> None:
        """Prune, write and measure; collective under torchrun: rank 0 writes into ``out`` (the
        staging folder), the other ranks (``out`` None) calibrate, solve and measure beside it."""
        tick = time.perf_counter()
        writer = ShardWriter(out, plan, total_parameters=sm.num_parameters()) if out is not None else None
        try:
            result = prune_streamed(sm, method, sparsity, calib, pairs, device, solver.percdamp, solver.blocksize,
                                    writer=writer, progress=talk)
            if writer is not None:
                writer.close()
        finally:
            if writer is not None:
                writer.abort()
        if out is not None:
            write_model_files(sm, out)
            tokenizer.save_pretrained(out)
        pruned_at = time.perf_counter()
        folder = Path(distributed.broadcast_text(None if out is None else str(out)))  # rank 0's files, for every rank
        if talk and distributed.is_main():
            print(f"[{method}] measuring the pruned model, streamed from the files just written ...", flush=True)
        pruned = StreamedModel(folder, sm.dtype, lm.trust_remote_code, source=str(output))
        after, items = measure_streamed(pruned, tokenizer, ids, texts.eval_pairs, lm.window, device, progress=talk)
        end = time.perf_counter()
        peaks = rank_peaks()
        if out is None:
            return
        written = weight_file_bytes(out)
        report.update({
            "method": method, "model": lm.model, "family": result["family"], "target_sparsity": result["target_sparsity"],
            "nm": result["nm"], "achieved_sparsity": result["achieved_sparsity"],
            "sparsity": {"target": result["target_sparsity"], "nm": result["nm"], "achieved": result["achieved_sparsity"],
                         "dense_zero_fraction": result["dense_zero_fraction"]},
            "metrics": after,
            "reference": {"method": "dense", "metrics": dense.metrics, "from_cache": dense.from_cache, "seconds": dense.seconds},
            "calibration": {"nsamples": lm.nsamples if calib is not None else 0, "seqlen": lm.seqlen,
                            "pairs": len(texts.calib_pairs) if pairs is not None else 0, "eval_pairs": len(texts.eval_pairs)},
            "evaluation": evaluation_facts(ids, lm.window, lm.eval_tokens, texts.eval_pairs, tokenizer),
            "seconds": {"load": loaded - start, "prune": pruned_at - tick, "solve": result["seconds"]["solve"],
                        "evaluate": dense.seconds + (end - pruned_at), "total": end - start},
            "threads": torch.get_num_threads(),
            "stream": True,
            "weights": {"save_format": "dense", "dtype": dtype_name(sm.dtype), "format": "dense",
                        "dense_bytes": total_bytes, "file_bytes": written, "ratio": written / total_bytes if total_bytes else None},
            "memory": {"peak_rss_bytes": peaks[0], "peak_rss_at_start_bytes": rss_start,
                       "largest_block_bytes": facts.largest_block_bytes, "largest_part_bytes": facts.largest_part_bytes,
                       "model_bytes": total_bytes, **({"peak_rss_bytes_per_rank": peaks} if len(peaks) > 1 else {})},
        })
        report["ci"] = lm_intervals(items)
        if dense.items is not None:
            report["reference"]["ci"] = lm_intervals(dense.items)
            report["paired"] = {"baseline": "dense", **lm_paired(items, dense.items)}
        items.save(out)
        tasks = streamed_tasks(sm, out, tokenizer, specs, lm, device, talk, facts, who=f"{method}: ")
        attach(report, tasks, dense_tasks)
        if tasks is not None:
            tasks.items.save(out)
        import pandas as pd  # here, not at the top: a streamed run holds it only once its work is done

        write_csv(out / "sparsity.csv", pd.DataFrame([{"layer": k, "sparsity": v} for k, v in result["layers"].items()]),
                  index=False)
        write_text(out / "config.yaml", yaml.safe_dump(config, sort_keys=False))
        write_model_card(out, report, config)
        write_json(out / "report.json", report)

    if not distributed.is_main():  # torchrun: this rank works beside rank 0, which writes
        write(None)
        return report
    replace_folder(output, write, owned=RUN_FILES)
    memory = report["memory"]
    print(pruned_line(method, report, output), flush=True)
    print(f"[{method}] streamed in {dtype_name(sm.dtype)}: peak resident memory {megabytes(memory['peak_rss_bytes'])} "
          f"({megabytes(memory['peak_rss_at_start_bytes'])} before loading), largest block "
          f"{megabytes(memory['largest_block_bytes'])} of a {megabytes(memory['model_bytes'])} model", flush=True)
    return report


def streamed_tasks(sm: StreamedModel, folder: Path, tokenizer, specs: list | None, lm: LMOptions, device, progress: bool,
                   facts, dense: bool = False, who: str = "dense model: "):
    """The lm-eval pass of a streamed run on the model in ``folder``, loaded with transformers'
    disk offload (at most four of its largest parts' bytes in memory): the whole model is never
    resident here either. ``dense``: the model ``sm`` reads, its results cached by its digest."""
    if not specs or not distributed.is_main():
        return None
    budget = 4 * facts.largest_part_bytes
    return measure_tasks(None, tokenizer, specs, lm, device, progress, use_cache=dense and lm.dense_cache, who=who,
                         digest=streamed_digest(sm) if dense and lm.dense_cache else None,
                         offload=offloaded(folder, lm, budget))


def zero_fraction(sm: StreamedModel) -> float:
    """The share of exact zeros in the prunable layers of every block, one block read at a time."""
    zeros = total = 0
    for block in sm.blocks:
        with sm.loaded(*sm.family.block_linears(block).values()):
            for layer in sm.family.block_linears(block).values():
                zeros += int((layer.weight == 0).sum())
                total += layer.weight.numel()
    return zeros / total if total else 0.0


def streamed_dense(lm: LMOptions, machine: MachineOptions, sparsities: list[Sparsity],
                   specs: list | None = None) -> tuple[DenseFigures, float, int]:
    """For ``compare --stream true``: the dense model's figures (measured streamed, or from the
    cache, which the runs then read), its prunable layers' zero fraction and its weights' bytes
    in ``--dtype``; every N:M pattern checked against the layer widths first."""
    texts = lm_texts(None, lm.eval_text, lm.pairs, lm.seed)
    tokenizer = load_tokenizer(lm.model, lm.trust_remote_code)
    sm = open_streamed(lm)
    for sparsity in sparsities:
        check_pattern_fits(sm.model, sparsity)
    ids = eval_ids(texts.eval_text, tokenizer, lm.eval_tokens)
    dense = streamed_dense_figures(sm, tokenizer, ids, texts.eval_pairs, lm.window, resolve_device(lm.device),
                                   eval_tokens=lm.eval_tokens, use_cache=lm.dense_cache, progress=machine.progress)
    dense.tasks = streamed_tasks(sm, sm.folder, tokenizer, specs, lm, resolve_device(lm.device), machine.progress,
                                 stream_facts(sm), dense=True)
    weight_bytes = sum(t.numel() * t.element_size() for t in sm.output_tensors().values())
    return dense, zero_fraction(sm), weight_bytes


def evaluate_lm_streamed(lm: LMOptions, output: str | None, machine: MachineOptions,
                         start: float | None = None, specs: list | None = None) -> dict[str, Any]:
    """``prune.py evaluate --stream true``: perplexity, stereotype score and sparsity of a model
    read block by block (the dense cache as the in-memory command uses it)."""
    start = time.perf_counter() if start is None else start
    check_streamable(lm)
    return_freed_memory()
    device = resolve_device(lm.device)
    texts = lm_texts(None, lm.eval_text, lm.pairs, lm.seed)
    tokenizer = load_tokenizer(lm.model, lm.trust_remote_code)
    sm = open_streamed(lm)
    loaded = time.perf_counter()
    ids = eval_ids(texts.eval_text, tokenizer, lm.eval_tokens)
    figures = streamed_dense_figures(sm, tokenizer, ids, texts.eval_pairs, lm.window, device, eval_tokens=lm.eval_tokens,
                                     use_cache=lm.dense_cache, progress=machine.progress)
    facts = stream_facts(sm)
    figures.tasks = streamed_tasks(sm, sm.folder, tokenizer, specs, lm, device, machine.progress, facts, dense=True, who="")
    peaks = rank_peaks()
    if not distributed.is_main():  # torchrun: rank 0 counts the zeros, reports and writes
        return {}
    report = {"method": "evaluate", "model": lm.model, "achieved_sparsity": zero_fraction(sm),
              "metrics": figures.metrics, "from_cache": figures.from_cache,
              "evaluation": evaluation_facts(ids, lm.window, lm.eval_tokens, texts.eval_pairs, tokenizer),
              "threads": torch.get_num_threads(), "stream": True,
              "seconds": {"load": loaded - start, "evaluate": figures.seconds, "total": time.perf_counter() - start}}
    if figures.items is not None:
        report["ci"] = lm_intervals(figures.items)
    attach(report, figures.tasks)
    report["memory"] = {"peak_rss_bytes": max(peaks[0], peak_rss_bytes()), "largest_block_bytes": facts.largest_block_bytes,
                        "largest_part_bytes": facts.largest_part_bytes,
                        **({"peak_rss_bytes_per_rank": peaks} if len(peaks) > 1 else {})}
    return finish_evaluation(report, figures, output, lm.model)

