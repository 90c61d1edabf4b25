"""FASP: fairness-aware structured pruning of attention heads in causal LMs.

The method in four steps, all in one process on one model:

1. **Score every head** with :class:`~fairprune.pruning.heads.HeadGates`: for head ``h`` gated
   off, ``z_ppl(h)`` is the perplexity on held-out text and ``z_bias(h, axis)`` the bias (eq. 1,
   :func:`fairprune.metrics.toxicity.axis_bias`) of continuations the model writes for identity
   prompts. Rows are appended to ``head_scores.csv`` as they are computed, so an interrupted run
   resumes where it stopped.
2. **Select** (:func:`select_fasp`): the top ``γ`` fraction of heads by perplexity importance
   (largest perplexity when removed) is protected; among the rest the ``⌊α·N_h⌋`` heads whose
   removal gives the lowest bias are pruned. Baselines (:func:`select_heads`) return head sets of
   the same size: magnitude, gradient (Michel et al. 2019), random, fairness-only (γ = 0) and
   performance-only.
3. **Choose γ** (:func:`search_gamma`) on the validation prompts when it is not given: the γ
   with the lowest bias among those whose perplexity is within ``tolerance`` (relative) of the
   best baseline's perplexity.
4. **Remove** the heads (:func:`~fairprune.pruning.heads.without_heads`: in place, or a streamed
   model written block by block) and save the model.

:func:`fairprune.runs.fasp.run_fasp` does all of it and returns a report.

The package, one module per step (the public names are re-exported here); every forward is a pass
over a block model (:mod:`fairprune.causal.pipeline`), each block loaded once for all its batches
(a model in memory or streamed from disk, one code path):

- :mod:`~fairprune.pruning.fasp.scoring`: :class:`Evaluator`, bias and perplexity measurement,
  :func:`score_heads` with its resume and its shares under ``torchrun``;
- :mod:`~fairprune.pruning.fasp.sampling`: generation settings and the one KV-cached sampling loop
  (per-prompt seeded draws: the same text in any batch);
- :mod:`~fairprune.pruning.fasp.batched`: many head configurations per forward pass, perplexity
  from stored layer-boundary states;
- :mod:`~fairprune.pruning.fasp.gradient`: :func:`gradient_importance` (the gradient baseline),
  backpropagation split at the block boundaries;
- :mod:`~fairprune.pruning.fasp.selection`: :func:`counts`, :func:`select_fasp`,
  :func:`select_heads` (baselines), :func:`search_gamma`;

The plots (:func:`~fairprune.reporting.plots.plot_head_heatmap`,
:func:`~fairprune.reporting.plots.plot_axis_correlation`) live with the other plots in
:mod:`fairprune.reporting.plots`.
"""

from __future__ import annotations

from fairprune.pruning.fasp.gradient import gradient_importance
from fairprune.pruning.fasp.scoring import (
    BASELINE,
    Evaluator,
    Generation,
    generate_continuations,
    head_bias_by_axis,
    head_bias_impact,
    measure_bias,
    read_scores,
    score_heads,
    token_ids,
)
from fairprune.pruning.fasp.selection import (
    Selection,
    counts,
    search_gamma,
    select_fasp,
    select_heads,
)

__all__ = [
    "BASELINE", "Generation", "Evaluator", "generate_continuations", "measure_bias", "token_ids",
    "score_heads", "read_scores", "head_bias_impact", "head_bias_by_axis",
    "Selection", "counts", "select_fasp", "select_heads", "gradient_importance", "search_gamma",
]
