"""FASP's run: score, select (searching γ when not given), remove the heads and report. The model
is an ``nn.Module`` or a block model (:mod:`fairprune.causal.blocks`): every measurement is a pass
over its blocks (:mod:`fairprune.causal.pipeline`), so a streamed model is scored, pruned and
measured with one block resident and gives the figures of the model in memory. The heads go by
:func:`fairprune.pruning.heads.without_heads`: a model in memory loses them in place, a streamed one
is written without them block by block into ``FaspSettings.output`` and measured from there; the
caller finishes the folder (:meth:`~fairprune.causal.blocks.BlockModel.save`,
:func:`fairprune.reporting.runs.write_head_files`). The only other file written here is
``head_scores.csv``, the scoring journal an interrupted run resumes from."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn

from fairprune import distributed
from fairprune.causal.blocks import BlockModel, as_blocks
from fairprune.data.prompts import check_prompts, holistic_prompts, split_prompts
from fairprune.errors import UserError, suggest
from fairprune.metrics.bootstrap import bias_intervals, bias_paired, lm_intervals, lm_paired
from fairprune.metrics.language import LMItems, eval_ids
from fairprune.metrics.toxicity import ToxicityScorer, make_scorer, scorer_name
from fairprune.pruning import registry
from fairprune.pruning.fasp.scoring import Evaluator, Generation, head_bias_by_axis, head_bias_impact, score_heads, token_ids
from fairprune.pruning.fasp.selection import counts, search_gamma, select_heads
from fairprune.pruning.head_size import measure, removal_size, tokens_per_second
from fairprune.pruning.heads import HeadGates, without_heads
from fairprune.pruning.options import CalibrationOptions, HeadOptions


@dataclass
class FaspResult:
    """A finished head-pruning run: its report and what its plots show."""

    report: dict[str, Any]
    axes: list[str]
    protected: list = field(default_factory=list)
    removed: list = field(default_factory=list)
    impact: Any = None  # per-head bias impact grid [layers, heads] (None when heads were not scored)
    bias_by_axis: pd.DataFrame | None = None  # per-head bias per axis, for the axis correlation plot
    reference: dict | None = None  # the dense model's test measurement (a later run of a compare takes it)
    pruned: Any = None  # the pruned model as a block model (streamed: read from FaspSettings.output)


@dataclass(frozen=True)
class FaspSettings:
    """How a head-pruning run scores and measures, beyond the command's options.

    ``eval_text`` (default the scoring text) gives the reported perplexity; ``generation`` (default
    from ``HeadOptions.max_new_tokens`` and the calibration seed) how continuations are sampled;
    ``validation`` the share of prompts heads are scored on, split by ``subgroup``; ``gammas`` and
    ``tolerance`` the γ search; ``loadable`` keeps the pruned model loadable by plain transformers;
    ``batched=False`` scores one head per pass (the reference path: same scores). ``device``: where
    the model runs (None: a model in memory where it is, a streamed one on its own ``device``);
    ``output``: the folder a streamed model's pruned weights are written into (a model in memory is
    pruned in place and saved by the caller); ``reference``: the dense model's test measurement when
    an earlier run on the same model and settings made it (a compare's later cells), else measured."""

    eval_text: str | Sequence[str] | None = None
    generation: Generation | None = None
    ppl_batch_size: int = 4
    validation: float = 0.2
    subgroup: str = "bucket"
    gammas: Sequence[float] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    tolerance: float = 0.05
    loadable: bool = True
    progress: bool = True
    batched: bool = True
    device: str | None = None
    output: str | Path | None = None
    reference: dict | None = None


def run_fasp(
    model: nn.Module | BlockModel,
    tokenizer,
    prompts: pd.DataFrame | None = None,
    ppl_text: str | Sequence[str] | None = None,
    method: str = "fasp",
    heads: HeadOptions = HeadOptions(),
    output_dir: str | Path = "runs/fasp",
    *,
    calibration: CalibrationOptions = CalibrationOptions(),
    scorer: ToxicityScorer | None = None,
    settings: FaspSettings = FaspSettings(),
) -> FaspResult:
    """Score, select and remove heads; return the run (report and plot data). ``prompts``: default the
    bundled HolisticBias-format set; ``ppl_text``: the bundled corpus's validation part; ``heads``: γ,
    α, the axis (one, several, or ``"all"``), the scorer (``scorer``: an object instead) and
    ``max_batch`` (rows per forward; None: from the memory); ``calibration``: ``seqlen``, ``seed``,
    ``eval_tokens``. Heads are scored and γ searched on the validation prompts (scores journaled to
    ``output_dir/head_scores.csv``), the report measures the test prompts. Under ``torchrun`` the
    scoring and the γ trials are shared out; every rank ends with the same model and report."""
    blocks, start, seconds = as_blocks(model), time.perf_counter(), {}
    if heads.max_batch is not None and heads.max_batch < 1:
        raise UserError(f"max_batch must be at least 1 row per forward pass, got {heads.max_batch}")
    if not blocks.holds_changes and (not settings.loadable or (settings.output is None and distributed.is_main())):
        raise UserError("a streamed model loses its heads as it is written block by block: give FaspSettings(output=...) "
                        "and keep loadable=True (the folder must load with from_pretrained)")
    out = Path(output_dir)
    if distributed.is_main():
        out.mkdir(parents=True, exist_ok=True)
    run = _Prepared.of(blocks, tokenizer, prompts, ppl_text, heads, calibration, scorer, settings)
    entry = registry.get(method, "heads")
    gamma = heads.gamma
    counts(HeadGates(blocks).values.numel(), gamma if entry.protects and gamma is not None else 0.0, heads.alpha)  # impossible ratios: before the work
    with _timed(seconds, "reference"), distributed.local():  # every rank measures the whole set: the same figures everywhere
        reference = settings.reference or run.on_test()
    gates, scores, search = HeadGates(blocks), None, None
    if entry.scored:
        with _timed(seconds, "scoring"):
            scores = score_heads(run.on_val, out / "head_scores.csv", gates, settings.progress, batched=settings.batched)
    with _timed(seconds, "selection"):
        if entry.protects and gamma is None:  # search γ; the trials are shared out under torchrun
            search = search_gamma(run.on_val, scores, heads.alpha, run.axes, settings.gammas, tolerance=settings.tolerance,
                                  seed=calibration.seed, gates=gates, batched=settings.batched)
            gamma = search["gamma"]
        with distributed.local():
            selection = select_heads(method, heads.alpha, scores=scores, model=blocks, axes=run.axes, gamma=gamma or 0.0,
                                     ppl_ids=run.on_val.ppl_ids, seqlen=calibration.seqlen,
                                     batch_size=settings.ppl_batch_size, seed=calibration.seed)
    with _timed(seconds, "removal"):
        kept, removal, size = _remove(blocks, selection.removed, run.on_test.ppl_ids, calibration.seqlen, settings)
    with _timed(seconds, "evaluation"), distributed.local():
        pruned = replace(run.on_test, model=kept)()
    seconds["total"] = time.perf_counter() - start
    report = {"method": method, "model": getattr(blocks.config, "name_or_path", "") or blocks.config.model_type, "gamma": gamma,
              "alpha": heads.alpha, "axes": run.axes, "heads_total": gates.values.numel(), **_report(selection, removal, size,
              scorer_name(run.scorer), pruned, reference), "gamma_search": search, "seconds": seconds}
    _intervals(report, pruned, reference, run.test_prompts, settings.subgroup)
    impact = None if scores is None else head_bias_impact(scores, run.axes)
    by_axis = head_bias_by_axis(scores) if scores is not None and (len(run.axes) > 1 or run.prompts.axis.nunique() > 1) else None
    return FaspResult(report, run.axes, list(selection.protected), list(selection.removed), impact, by_axis, reference, kept)


@contextmanager
def _timed(seconds: dict[str, float], key: str) -> Iterator[None]:
    tick = time.perf_counter()
    yield
    seconds[key] = time.perf_counter() - tick


@dataclass
class _Prepared:
    """A FASP run's prompts split into validation and test parts, its axes, scorer and the two
    evaluators (heads scored on the validation part, the report measured on the test part)."""

    prompts: pd.DataFrame
    test_prompts: pd.DataFrame
    axes: list[str]
    scorer: Any
    on_val: Evaluator
    on_test: Evaluator

    @classmethod
    def of(cls, blocks, tokenizer, prompts, ppl_text, heads: HeadOptions, calibration: CalibrationOptions, scorer,
           settings: FaspSettings) -> _Prepared:
        axis, seed, subgroup = heads.axis, calibration.seed, settings.subgroup
        prompts = check_prompts(holistic_prompts() if prompts is None else prompts)
        if subgroup not in prompts.columns:
            raise UserError(f"subgroup column {subgroup!r} is not in the prompts; use bucket or descriptor")
        axes = sorted(prompts.axis.unique()) if axis == "all" else [axis] if isinstance(axis, str) else list(axis)
        val_prompts, test_prompts = split_prompts(prompts, settings.validation, seed, stratify=subgroup, axes=axes)
        if ppl_text is None:
            from fairprune.data.text import lm_corpus

            ppl_text = lm_corpus().validation
        scorer = make_scorer(heads.scorer if scorer is None else scorer)
        generation = settings.generation or Generation(max_new_tokens=heads.max_new_tokens, seed=seed)
        common = dict(model=blocks, tokenizer=tokenizer, scorer=scorer, generation=generation, seqlen=calibration.seqlen,
                      ppl_batch_size=settings.ppl_batch_size, subgroup=subgroup, max_batch=heads.max_batch,
                      device=settings.device, progress=settings.progress)
        on_val = Evaluator(prompts=val_prompts, ppl_ids=token_ids(tokenizer, ppl_text), **common)
        test_ids = eval_ids(token_ids(tokenizer, settings.eval_text or ppl_text), max_tokens=calibration.eval_tokens)
        on_test = Evaluator(prompts=test_prompts, ppl_ids=test_ids, **common)
        for a in axes:
            if a not in set(val_prompts.axis):
                raise UserError(f"no prompts for axis {a!r}{suggest(a, val_prompts.axis.unique())}; "
                                f"axes present: {', '.join(sorted(val_prompts.axis.unique()))}")
        return cls(prompts, test_prompts, axes, scorer, on_val, on_test)


def _remove(blocks, removed, ppl_ids, seqlen: int, settings: FaspSettings):
    """The heads removed (:func:`~fairprune.pruning.heads.without_heads`: in place, or written block by
    block into ``settings.output``): the model kept, the removal and its size; the throughput
    before and after where the model is in memory (a streamed forward times the disk: ``None``)."""
    before = measure(blocks.model, seqlen)
    timed = blocks.holds_changes
    speed_before = tokens_per_second(blocks.model, ppl_ids, seqlen) if timed else None
    kept, removal = without_heads(blocks, removed, settings.loadable, settings.output, settings.progress)
    size = removal_size(before, kept.model, removal, settings.loadable)
    size["tokens_per_second"] = None if not timed else {
        "before": speed_before, "window": min(seqlen, ppl_ids.numel()),
        "after": tokens_per_second(kept.model, ppl_ids, seqlen), "threads": torch.get_num_threads()}
    return kept, removal, size


def _report(selection, removal, size, scorer: str, pruned: dict, reference: dict) -> dict[str, Any]:
    """The report's heads, removal, size, scorer and the pruned and dense figures."""
    return {
        "heads_removed": [list(h) for h in selection.removed], "protected": [list(h) for h in selection.protected],
        "removal": removal.as_dict(), "size": size, "scorer": scorer,
        "metrics": {"perplexity": pruned["perplexity"]}, "fairness": {"bias": pruned["bias"]},
        "reference": {"method": "dense", "metrics": {"perplexity": reference["perplexity"]},
                      "fairness": {"bias": reference["bias"]}},
    }


def _intervals(report: dict[str, Any], pruned: dict, reference: dict, test_prompts: pd.DataFrame, subgroup: str) -> None:
    """Perplexity's intervals over windows, and the bias of every axis over the test prompts, with
    the paired differences against the dense model on the same windows and prompts."""
    after, before = (LMItems.of_windows(*figures["windows"]) for figures in (pruned, reference))
    report["ci"], report["reference"]["ci"] = lm_intervals(after), lm_intervals(before)
    report["paired"] = {"baseline": "dense", **lm_paired(after, before)}
    prompt_axes, prompt_groups = test_prompts.axis.to_numpy(), test_prompts[subgroup].to_numpy()
    report["ci"].update(bias_intervals(prompt_axes, prompt_groups, pruned["toxicity"]))
    report["reference"]["ci"].update(bias_intervals(prompt_axes, prompt_groups, reference["toxicity"]))
    report["paired"].update(bias_paired(prompt_axes, prompt_groups, pruned["toxicity"], reference["toxicity"]))
