"""FASP step 3: choosing the heads to remove, by FASP or a baseline, and the search for γ."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from torch import nn

from fairprune import distributed
from fairprune.causal.blocks import BlockModel
from fairprune.errors import UserError
from fairprune.pruning import registry
from fairprune.pruning.fasp.gradient import gradient_importance
from fairprune.pruning.fasp.scoring import Evaluator, _bias, _heads_only, across_ranks
from fairprune.pruning.heads import Head, HeadGates, head_weight_norms
from fairprune.pruning.select import lowest_k


@dataclass
class Selection:
    """Heads to remove and heads kept on purpose (FASP's protected set)."""

    removed: list[Head]
    protected: list[Head]


def counts(n_heads: int, gamma: float, alpha: float) -> tuple[int, int]:
    """(protected, removed) head counts for ``γ`` and ``α``; checks that they fit together."""
    for name, value in (("gamma", gamma), ("alpha", alpha)):
        if not 0.0 <= value <= 1.0:
            raise UserError(f"{name} must lie in [0, 1], got {value}")
    # The small epsilon keeps 0.3 × 10 from flooring to 2.
    protect, remove = math.floor(gamma * n_heads + 1e-9), math.floor(alpha * n_heads + 1e-9)
    if remove > n_heads - protect:
        raise UserError(f"alpha {alpha} removes {remove} of {n_heads} heads but gamma {gamma} leaves only "
                        f"{n_heads - protect} unprotected; lower alpha or gamma (alpha + gamma <= 1)")
    return protect, remove


def select_fasp(scores: pd.DataFrame, gamma: float, alpha: float, axes: Sequence[str]) -> Selection:
    """Protect the top γ by perplexity importance; prune the ⌊α·N_h⌋ lowest-bias-when-removed others."""
    heads = _heads_only(scores).assign(objective=lambda f: _bias(f, axes))
    protect, remove = counts(len(heads), gamma, alpha)
    # Stable sorts: ties fall back to (layer, head) order, so the choice is deterministic.
    by_importance = heads.sort_values("perplexity", ascending=False, kind="stable")
    protected = by_importance.iloc[:protect]
    candidates = by_importance.iloc[protect:].sort_values(["objective", "layer", "head"], kind="stable")
    return Selection(removed=_pairs(candidates.iloc[:remove]), protected=_pairs(protected))


def _pairs(frame: pd.DataFrame) -> list[Head]:
    return sorted(zip(frame.layer.astype(int).tolist(), frame["head"].astype(int).tolist()))


def _lowest(values: torch.Tensor, k: int) -> list[Head]:
    """The ``k`` heads with the smallest value in a ``[layers, heads]`` tensor (ties: layer-major order)."""
    n = values.shape[1]
    return [(int(i) // n, int(i) % n) for i in lowest_k(values, k)]


@dataclass
class HeadContext:
    """What a head-selection method may use: the ratios, the per-head scores (scored methods),
    the model (an ``nn.Module`` or a block model), and the perplexity text for gradient importance."""

    alpha: float
    gamma: float = 0.0
    scores: pd.DataFrame | None = None
    model: nn.Module | BlockModel | None = None
    axes: Sequence[str] = ()
    ppl_ids: torch.Tensor | None = None
    seqlen: int = 128
    batch_size: int = 4
    seed: int = 0

    def grid(self) -> tuple[int, int]:
        """(layers, heads per layer), from the scores or the model."""
        if self.scores is not None:
            heads = _heads_only(self.scores)
            return int(heads.layer.max()) + 1, int(heads["head"].max()) + 1
        return tuple(HeadGates(self.model).values.shape)

    def removals(self) -> int:
        """⌊α·N_h⌋, the number of heads to remove."""
        layers, heads = self.grid()
        return counts(layers * heads, 0.0, self.alpha)[1]


def select_heads(method: str, alpha: float, *, scores: pd.DataFrame | None = None, model: nn.Module | BlockModel | None = None,
                 axes: Sequence[str] = (), gamma: float = 0.0, ppl_ids: torch.Tensor | None = None,
                 seqlen: int = 128, batch_size: int = 4, seed: int = 0) -> Selection:
    """The heads ``method`` removes at ratio ``α`` (FASP or a baseline: the registry's ``heads`` kind)."""
    entry = registry.get(method, "heads")
    if entry.scored and scores is None:
        raise UserError(f"method {method!r} needs head scores; run score_heads first")
    return entry.select(HeadContext(alpha, gamma, scores, model, axes, ppl_ids, seqlen, batch_size, seed))


def select_fasp_heads(c: HeadContext) -> Selection:
    return select_fasp(c.scores, c.gamma, c.alpha, c.axes)


def select_fairness_heads(c: HeadContext) -> Selection:
    return select_fasp(c.scores, 0.0, c.alpha, c.axes)


def select_performance_heads(c: HeadContext) -> Selection:
    heads = _heads_only(c.scores)
    return Selection(_lowest(torch.tensor(heads.perplexity.to_numpy()).view(*c.grid()), c.removals()), [])


def select_magnitude_heads(c: HeadContext) -> Selection:
    return Selection(_lowest(head_weight_norms(c.model), c.removals()), [])


def select_gradient_heads(c: HeadContext) -> Selection:
    if c.ppl_ids is None:
        raise UserError("the gradient baseline needs perplexity text (ppl_ids)")
    return Selection(_lowest(gradient_importance(c.model, c.ppl_ids, c.seqlen, c.batch_size), c.removals()), [])


def select_random_heads(c: HeadContext) -> Selection:
    n_layers, n_heads = c.grid()
    order = torch.randperm(n_layers * n_heads, generator=torch.Generator().manual_seed(c.seed))
    return Selection(sorted((int(i) // n_heads, int(i) % n_heads) for i in order[:c.removals()]), [])


def search_gamma(evaluate: Evaluator, scores: pd.DataFrame, alpha: float, axes: Sequence[str],
                 gammas: Sequence[float] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
                 baselines: Sequence[str] = ("performance", "magnitude", "gradient", "random"),
                 tolerance: float = 0.05, seed: int = 0, gates: HeadGates | None = None, batched: bool = True) -> dict:
    """Pick γ* on the validation prompts by the paper's rule.

    Every baseline and every feasible γ (``⌊α·N⌋ ≤ N − ⌊γ·N⌋``) is applied with gates and
    measured. γ* has the lowest bias (summed over ``axes``) among the γ whose perplexity is at most
    ``(1 + tolerance) ×`` the best baseline's; if none qualifies, the γ with the lowest perplexity.
    Batched (the default, when ``evaluate`` has ``many``), the trials share forward passes; the
    measurements are those of one trial at a time. Under ``torchrun`` every rank must call: each
    measures its share of the trials and every rank returns the same result.
    """
    gates = gates or HeadGates(evaluate.model)
    n = gates.values.numel()
    planned = []
    for method in baselines:
        with distributed.local():  # every rank plans the same trials
            chosen = select_heads(method, alpha, scores=scores, model=evaluate.model, ppl_ids=evaluate.ppl_ids,
                                  seqlen=evaluate.seqlen, batch_size=evaluate.ppl_batch_size, seed=seed)
        planned.append((method, None, chosen.removed))
    for gamma in gammas:
        if math.floor(alpha * n + 1e-9) > n - math.floor(gamma * n + 1e-9):
            continue
        planned.append(("fasp", gamma, select_fasp(scores, gamma, alpha, axes).removed))
    many = getattr(evaluate, "many", None) if batched else None
    axes_all = sorted(evaluate.prompts.axis.unique())

    def compute(trials: list) -> list[dict]:
        with gates:
            if many:
                configs = torch.ones(len(trials), *gates.values.shape)
                for row, (_, _, removed) in enumerate(trials):
                    for layer, head in removed:
                        configs[row, layer, head] = 0.0
                return many(configs)
            return [_measure(evaluate, gates, removed) for _, _, removed in trials]

    results = across_ranks(planned, compute, axes_all)  # under torchrun each rank measures its share of the trials
    trials = [{"method": method, "gamma": gamma, **_summary(result, removed, axes)}
              for (method, gamma, removed), result in zip(planned, results)]
    fasp = [t for t in trials if t["gamma"] is not None]  # the baselines' trials have no γ
    if not fasp:
        raise UserError(f"no gamma in {list(gammas)} leaves room to remove alpha={alpha} of the heads; lower alpha")
    best_baseline = min((t["perplexity"] for t in trials if t["gamma"] is None), default=math.inf)
    within = [t for t in fasp if t["perplexity"] <= best_baseline * (1 + tolerance)]
    pick = min(within, key=lambda t: t["objective"]) if within else min(fasp, key=lambda t: t["perplexity"])
    return {"gamma": pick["gamma"], "best_baseline_perplexity": best_baseline, "tolerance": tolerance,
            "within_tolerance": bool(within), "trials": trials}


def _measure(evaluate: Evaluator, gates: HeadGates, removed: list[Head]) -> dict:
    gates.set(removed)
    result = evaluate()
    gates.clear()
    return result


def _summary(result: dict, removed: list[Head], axes: Sequence[str]) -> dict:
    return {"perplexity": result["perplexity"], "bias": result["bias"],
            "objective": sum(result["bias"][a] for a in axes), "removed": len(removed)}
