"""Attention-head pruning runs: ``prune.py fasp`` (FASP or a baseline) and ``prune.py compare
--alphas`` (several methods × α with the heads scored once and the dense model measured once).

The model is opened as the weight-pruning commands open it (:func:`fairprune.workflows.opened.stream_choice`,
``--stream true|false|auto``): in memory, or streamed from its safetensors folder with one block
resident — scored by passes over its blocks, its pruned blocks written into the run's folder as
they lose their heads and the pruned model measured from there, with the figures of the in-memory
run. A streamed compare opens the model once for all its runs.

Both run under ``torchrun`` too (``@torchrun``): every rank loads the model on its device (``--device
auto`` takes the rank's GPU when there is one), the heads are scored in shares across the ranks,
and rank 0 alone writes files and prints; every rank ends with the same pruned model.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd

from fairprune import distributed
from fairprune.causal.blocks import SaveOptions
from fairprune.data.chats import read_calibration
from fairprune.data.files import read_text
from fairprune.data.prompts import read_prompts, split_prompts
from fairprune.data.text import render_calib_text
from fairprune.errors import UserError
from fairprune.hub import load_tokenizer, resolve_device
from fairprune.pruning import registry
from fairprune.pruning.options import HeadOptions, LMOptions
from fairprune.reporting.compare import Statistics
from fairprune.reporting.records import HeadRow
from fairprune.reporting.runs import JOURNAL, RUN_FILES, write_head_files
from fairprune.runs.lm import lm_tasks
from fairprune.runs.tasks import attach, task_specs
from fairprune.storage.folders import check_free_space, replace_folder
from fairprune.storage.lock import locked
from fairprune.workflows.compare import Cell, Written, compare_folders, run_compare
from fairprune.workflows.launch import torchrun
from fairprune.workflows.opened import open_blocks, stream_choice
from fairprune.workflows.options import MachineOptions, model_folder


@dataclass
class _Shared:
    """What the runs of one command share: whether the model streams (decided once), the model
    when a run leaves it as it was (streamed: its skeleton, whose weights stay in the folder; a
    model in memory loses its heads in place and is loaded again per run), and the dense model's
    figures once measured (its test measurement and lm-eval results)."""

    stream: bool
    blocks: Any = None
    reference: dict | None = None
    tasks: Any = None


def _prune_heads(lm: LMOptions, tokenizer, method: str, heads: HeadOptions, alpha: float, output: Path,
                 machine: MachineOptions, specs: list | None, shared: _Shared) -> dict[str, Any]:
    """Score / select / remove heads with ``method`` at ``alpha``; write the pruned model, its plots
    and ``report.json`` into ``output``. In memory the model is loaded and pruned in place, then
    saved; streamed (``--stream``) it is scored block by block and its pruned blocks are written
    into the run's staging folder as they lose their heads, and measured from there. ``specs``:
    lm-eval tasks scored on the model before and after (``--tasks``)."""
    from fairprune.runs.fasp import FaspSettings, run_fasp

    prompts = read_prompts(heads.prompts) if heads.prompts else None
    if prompts is not None:
        split_prompts(prompts, seed=lm.seed, axes=heads.axis)  # before any work: both parts can measure bias
    device, talk = resolve_device(lm.device), machine.progress and distributed.is_main()  # --device cuda without one: refused
    blocks = shared.blocks if shared.blocks is not None else open_blocks(lm, shared.stream)  # NaN / inf refused
    blocks.family.require_heads(f"prune.py {method}")  # before any work: where its heads are
    check_free_space(output, blocks.saved_bytes(tokenizer))
    if shared.tasks is None:
        shared.tasks = lm_tasks(blocks, tokenizer, specs, lm, device, talk, dense=True)
    blocks.run_on(device)
    scoring_text = render_calib_text(tokenizer, read_calibration(lm.calib_text)) if lm.calib_text else None
    eval_text = read_text(lm.eval_text) if lm.eval_text else None
    config = {"method": method, **asdict(lm), **asdict(heads), "alpha": alpha}

    def run(out: Path | None):
        """Score, select, remove (into ``out``, the staging folder, when streamed) and measure;
        then the folder finished beside the weights. Collective under torchrun: rank 0 writes."""
        settings = FaspSettings(eval_text=eval_text, progress=talk, output=out, reference=shared.reference)
        result = run_fasp(blocks, tokenizer, prompts, scoring_text, method, replace(heads, alpha=alpha), output,
                          calibration=lm, settings=settings)
        distributed.barrier()  # every rank measured the pruned model (streamed: from the staging folder) before rank 0 moves it
        result.report.update(model=lm.model, stream=blocks.how == "streamed")
        tasks = lm_tasks(result.pruned, tokenizer, specs, lm, device, talk, who=f"{method}: ")
        attach(result.report, tasks, shared.tasks)
        shared.reference = result.reference
        result.pruned.save(out, tokenizer, SaveOptions(trust_remote_code=lm.trust_remote_code, progress=talk,
                                                      method=method, output=str(output)))  # refused when not finite
        if out is not None:
            write_head_files(out, tokenizer, result, config, None if tasks is None else tasks.items)
        return result

    if not blocks.holds_changes:  # left as it was (its heads went into the run's folder): the next run of a compare takes it
        shared.blocks = blocks
    if distributed.is_main():
        done: list = []
        replace_folder(output, lambda out: done.append(run(out)), keep=JOURNAL, owned=RUN_FILES)
        result = done[0]
    else:
        result = run(None)
    distributed.barrier()
    return result.report


@torchrun  # outermost: the lock is taken inside the process group, by its rank 0 alone
@locked(lambda output, **_: output, reads=model_folder)
def fasp(lm: LMOptions, output: str, method: str = "fasp", heads: HeadOptions = HeadOptions(),
         machine: MachineOptions = MachineOptions()) -> dict[str, Any]:
    """FASP: remove the attention heads that most raise toxicity disparity, protecting the heads
    perplexity needs (or a baseline's choice). Writes the pruned model and ``report.json``,
    ``head_scores.csv`` and plots into ``output``.

    Args:
        lm: the model and its texts (calib_text: the text heads are scored on; eval_text: the reported perplexity).
        output: folder for the pruned model, head_scores.csv, report.json and plots.
        method: fasp, fairness, performance, magnitude, gradient or random.
        heads: what to protect and remove, and how bias is measured.
        machine: threads and progress bars.
    """
    machine.apply()
    registry.get(method, "heads")
    specs = task_specs(lm)
    tokenizer = load_tokenizer(lm.model, lm.trust_remote_code)
    report = _prune_heads(lm, tokenizer, method, heads, heads.alpha, Path(output), machine, specs, _Shared(stream_choice(lm)))
    if not distributed.is_main():
        return report
    print(f"[fasp] {method}: removed {len(report.get('heads_removed', []))} heads; perplexity "
          f"{report['reference']['metrics']['perplexity']:.2f} → {report['metrics']['perplexity']:.2f}; {_bias_text(report)}; "
          f"written to {output}")
    if report.get("size"):
        from fairprune.pruning.head_size import summary as size_summary

        print(f"[fasp] size: {size_summary(report['size'])}")
        if report["size"].get("note"):
            print(f"[fasp] note: {report['size']['note']}")
    return report


def _bias_text(report: dict[str, Any]) -> str:
    """``bias <axis> 0.210 → 0.150 [0.090, 0.200] (Δ −0.060 [−0.110, −0.010] *)`` per axis: dense →
    pruned with the pruned model's 95 % interval over prompts and the paired difference."""
    parts = []
    before = report.get("reference", {}).get("fairness", {}).get("bias", {})
    for axis, value in report.get("fairness", {}).get("bias", {}).items():
        text = f"bias {axis} {before.get(axis, float('nan')):.3f} → {value:.3f}"
        interval = (report.get("ci") or {}).get(f"bias/{axis}")
        if interval:
            text += f" [{interval[0]:.3f}, {interval[1]:.3f}]"
        paired = (report.get("paired") or {}).get(f"bias/{axis}")
        if paired:
            low, high = paired["ci"]
            text += f" (Δ {paired['difference']:+.3f} [{low:+.3f}, {high:+.3f}]{' *' if paired['excludes_zero'] else ''})"
        parts.append(text)
    return "; ".join(parts) or "no bias measured"


def _cells(output: str, methods: list[str], alphas: list[float], **_: Any) -> list[Cell]:
    """The runs of a head-pruning compare, in order: one folder each, ``fasp_a0.1``."""
    return [Cell(Path(output) / f"{m}_a{a:g}", (m, a)) for m in methods for a in alphas]


def _heads_comparison(done: list[tuple[Cell, dict[str, Any]]], start: float) -> Written:
    """Each run's row, the dense model's from the first run's reference; the intervals and the
    paired differences against the dense model each run's report holds (perplexity over windows)."""
    rows = [HeadRow.dense(report) for _, report in done[:1]]
    rows += [HeadRow.from_report(report, *cell.key, registry.get(cell.key[0], "heads").protects) for cell, report in done]
    intervals = [({"method": "dense"}, report["reference"].get("ci") or {}) for _, report in done[:1]]
    intervals += [(dict(zip(("method", "alpha"), cell.key)), report.get("ci") or {}) for cell, report in done]
    paired = [(dict(zip(("method", "alpha"), cell.key)), report.get("paired") or {}) for cell, report in done]
    return Written(rows, {"seconds": {"total": time.perf_counter() - start}}, "Attention-head pruning comparison",
                   Statistics(intervals, paired, "dense"))


@torchrun  # outermost: the lock is taken inside the process group, by its rank 0 alone
@locked(lambda output, **args: compare_folders(output, _cells(output, **args)), reads=model_folder)
def compare_heads(lm: LMOptions, methods: list[str], alphas: list[float], output: str,
                  heads: HeadOptions = HeadOptions(), machine: MachineOptions = MachineOptions()) -> pd.DataFrame:
    """FASP and its baselines at several α from one model: heads are scored once (the first run
    writes ``head_scores.csv``; later runs resume from a copy of it) and the dense model is measured
    once, one table of bias and perplexity in ``output``. Streamed (``--stream``), the model is
    opened once and every run reads it from its folder; in memory each run loads it afresh (it
    loses its heads in place)."""
    machine.apply()
    for method in methods:
        registry.get(method, "heads")
    for alpha in alphas:
        if not 0.0 <= alpha <= 1.0:
            raise UserError(f"--alphas must be in [0, 1], got {alpha}")
    specs, tokenizer = task_specs(lm), load_tokenizer(lm.model, lm.trust_remote_code)
    scored: list[Path] = []  # the first run's folder with the heads' scores
    together = _Shared(stream_choice(lm))  # streamed: the model opened once; the dense figures measured once

    def run(cell: Cell, resume: str | None) -> dict[str, Any]:
        (method, alpha), folder = cell.key, cell.folder
        if distributed.is_main():
            folder.mkdir(parents=True, exist_ok=True)
            if scored and not (folder / "head_scores.csv").exists():
                for name in ("head_scores.csv", "head_scores.json"):
                    shutil.copy(scored[0] / name, folder / name)
        report = _prune_heads(lm, tokenizer, method, heads, alpha, folder, machine, specs, together)
        if (folder / "head_scores.csv").exists() and not scored:
            scored.append(folder)
        return report

    start = time.perf_counter()
    return run_compare(output, _cells(output, methods, alphas), run, lambda done: _heads_comparison(done, start),
                       talk=distributed.is_main())
