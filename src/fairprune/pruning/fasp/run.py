"""FASP step 4 and the whole run: score, select (searching γ when not given), remove the heads and
report. The model is an ``nn.Module`` or a block model (:mod:`fairprune.causal.blocks`): every
measurement is a pass over its blocks, so a streamed model (:class:`~fairprune.causal.streamed.StreamedModel`)
is scored, pruned and measured with one block resident and gives the figures of the model in
memory. A model in memory loses its heads in place, and what the run leaves on disk (the pruned
model, the plots, ``report.json``) is written by the caller
(:func:`fairprune.reporting.runs.write_head_run`); a streamed one is written without its heads
block by block into ``FaspSettings.output`` (:func:`fairprune.pruning.heads.write_without_heads`)
and measured from there. The only other file written here is ``head_scores.csv``, the scoring
journal an interrupted run resumes from."""

from __future__ import annotations

import time
from collections.abc import Sequence
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
from fairprune.pruning.heads import HeadGates, remove_heads, write_without_heads
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
    """Score, select and remove heads in place; return the run (report and plot data).

    ``prompts`` defaults to the bundled HolisticBias-format set, ``ppl_text`` to the validation
    part of the bundled corpus. ``heads``: γ, α, the axis (one, several, their biases summed, or
    ``"all"``), the scorer (``scorer``: a scorer object instead of its name) and ``max_batch``, the
    rows per forward when many head configurations are evaluated together (None: from the memory);
    ``calibration``: the window length (``seqlen``), ``seed`` and ``eval_tokens``. Heads are scored
    and γ is searched (when ``gamma`` is None) on the validation prompts; the report measures the
    test prompts. Head scores are journaled to ``output_dir/head_scores.csv``. Under ``torchrun`` the heads are scored in shares across the
    ranks, and so are the trials of the γ search; everything else runs whole on every rank, so every
    rank ends with the same model and report (rank 0 alone writes the journal).
    """
    blocks = as_blocks(model)
    gamma, alpha, axis, max_batch = heads.gamma, heads.alpha, heads.axis, heads.max_batch
    seqlen, seed, eval_tokens = calibration.seqlen, calibration.seed, calibration.eval_tokens
    generation = settings.generation or Generation(max_new_tokens=heads.max_new_tokens, seed=seed)
    subgroup, ppl_batch_size, batched = settings.subgroup, settings.ppl_batch_size, settings.batched
    if max_batch is not None and max_batch < 1:
        raise UserError(f"max_batch must be at least 1 row per forward pass, got {max_batch}")
    if blocks.streamed and (not settings.loadable or (settings.output is None and distributed.is_main())):
        raise UserError("a streamed model loses its heads as it is written block by block: give FaspSettings(output=...) "
                        "and keep loadable=True (the folder must load with from_pretrained)")
    start = time.perf_counter()
    seconds: dict[str, float] = {}
    out = Path(output_dir)
    if distributed.is_main():
        out.mkdir(parents=True, exist_ok=True)
    prompts = check_prompts(holistic_prompts() if prompts is None else prompts)
    if subgroup not in prompts.columns:
        raise UserError(f"subgroup column {subgroup!r} is not in the prompts; use bucket or descriptor")
    axes = sorted(prompts.axis.unique()) if axis == "all" else [axis] if isinstance(axis, str) else list(axis)
    val_prompts, test_prompts = split_prompts(prompts, settings.validation, seed, stratify=subgroup, axes=axes)
    if ppl_text is None:
        from fairprune.data.text import lm_corpus

        ppl_text = lm_corpus().validation
    scorer = make_scorer(heads.scorer if scorer is None else scorer)
    common = dict(model=blocks, tokenizer=tokenizer, scorer=scorer, generation=generation, seqlen=seqlen,
                  ppl_batch_size=ppl_batch_size, subgroup=subgroup, max_batch=max_batch, device=settings.device,
                  progress=settings.progress)
    on_val = Evaluator(prompts=val_prompts, ppl_ids=token_ids(tokenizer, ppl_text), **common)
    on_test = Evaluator(prompts=test_prompts, ppl_ids=eval_ids(token_ids(tokenizer, settings.eval_text or ppl_text), max_tokens=eval_tokens),
                        **common)
    for a in axes:
        if a not in set(val_prompts.axis):
            raise UserError(f"no prompts for axis {a!r}{suggest(a, val_prompts.axis.unique())}; "
                            f"axes present: {', '.join(sorted(val_prompts.axis.unique()))}")
    entry = registry.get(method, "heads")
    # Fail on impossible ratios before the expensive part.
    counts(HeadGates(blocks).values.numel(), gamma if entry.protects and gamma is not None else 0.0, alpha)

    tick = time.perf_counter()
    with distributed.local():  # every rank measures the whole set: the same figures everywhere
        reference = settings.reference or on_test()
    seconds["reference"] = time.perf_counter() - tick

    gates, scores, search = HeadGates(blocks), None, None
    if entry.scored:
        tick = time.perf_counter()
        scores = score_heads(on_val, out / "head_scores.csv", gates, settings.progress, batched=batched)
        seconds["scoring"] = time.perf_counter() - tick
    tick = time.perf_counter()
    if entry.protects and gamma is None:  # search γ; the trials are shared out under torchrun
        search = search_gamma(on_val, scores, alpha, axes, settings.gammas, tolerance=settings.tolerance, seed=seed, gates=gates,
                              batched=batched)
        gamma = search["gamma"]
    with distributed.local():
        selection = select_heads(method, alpha, scores=scores, model=blocks, axes=axes, gamma=gamma or 0.0,
                                 ppl_ids=on_val.ppl_ids, seqlen=seqlen, batch_size=ppl_batch_size, seed=seed)
    seconds["selection"] = time.perf_counter() - tick

    tick = time.perf_counter()
    size_before = measure(blocks.model, seqlen)
    if blocks.streamed:  # written block by block, one resident; no throughput: a streamed forward times the disk
        kept, removal = write_without_heads(blocks, selection.removed, True, settings.output, settings.progress)
        size = {**removal_size(size_before, kept.model, removal), "tokens_per_second": None}
    else:
        kept, speed_before = blocks, tokens_per_second(blocks.model, on_test.ppl_ids, seqlen)
        removal = remove_heads(blocks.model, selection.removed, loadable=settings.loadable)
        size = removal_size(size_before, blocks.model, removal, settings.loadable)
        size["tokens_per_second"] = {"before": speed_before, "window": min(seqlen, on_test.ppl_ids.numel()),
                                     "after": tokens_per_second(blocks.model, on_test.ppl_ids, seqlen),
                                     "threads": torch.get_num_threads()}
    seconds["removal"] = time.perf_counter() - tick
    tick = time.perf_counter()
    with distributed.local():
        pruned = replace(on_test, model=kept)()
    seconds["evaluation"] = time.perf_counter() - tick
    seconds["total"] = time.perf_counter() - start
    report = {
        "method": method, "model": getattr(blocks.config, "name_or_path", "") or blocks.config.model_type,
        "gamma": gamma, "alpha": alpha, "axes": axes, "heads_total": gates.values.numel(),
        "heads_removed": [list(h) for h in selection.removed], "protected": [list(h) for h in selection.protected],
        "removal": removal.as_dict(), "size": size, "scorer": scorer_name(scorer),
        "metrics": {"perplexity": pruned["perplexity"]}, "fairness": {"bias": pruned["bias"]},
        "reference": {"method": "dense", "metrics": {"perplexity": reference["perplexity"]},
                      "fairness": {"bias": reference["bias"]}},
        "gamma_search": search, "seconds": seconds,
    }
    after, before = (LMItems.of_windows(*figures["windows"]) for figures in (pruned, reference))
    report["ci"], report["reference"]["ci"] = lm_intervals(after), lm_intervals(before)
    report["paired"] = {"baseline": "dense", **lm_paired(after, before)}
    # The bias of every axis over the test prompts, and against the dense model on the same prompts.
    prompt_axes, prompt_groups = test_prompts.axis.to_numpy(), test_prompts[subgroup].to_numpy()
    report["ci"].update(bias_intervals(prompt_axes, prompt_groups, pruned["toxicity"]))
    report["reference"]["ci"].update(bias_intervals(prompt_axes, prompt_groups, reference["toxicity"]))
    report["paired"].update(bias_paired(prompt_axes, prompt_groups, pruned["toxicity"], reference["toxicity"]))
    scored = scores is not None
    return FaspResult(report, axes, list(selection.protected), list(selection.removed),
                      head_bias_impact(scores, axes) if scored else None,
                      head_bias_by_axis(scores) if scored and (len(axes) > 1 or prompts.axis.nunique() > 1) else None,
                      reference, kept)
