"""What one vision pruning step calls through a method's registry entry: ``entry.importance(context)``
scores every targeted weight, then ``entry.selection(targets, scores, density)`` chooses the keep
masks.

The callback (:class:`~fairprune.callbacks.pruning.IterativePruning`) builds one
:class:`ScoreContext` per step; a method reads from it what it needs. The data is reached through
``context.data()`` so that data-free methods (magnitude, random) never build the importance loader.
A method registered by a user (``fairprune.pruning.registry.register``) plugs in with two functions
of the same shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fairprune.pruning import importance as imp
from fairprune.pruning import select
from fairprune.pruning.fairgrape import layer_quota, select_layer_masks
from fairprune.pruning.masks import Target

Scores = dict[str, torch.Tensor]


@dataclass
class ScoreContext:
    """What a vision method may score with.

    ``data()`` returns ``(batches, number of groups, group names)``: the group-stratified
    importance share of the training set, its batches ``(x, y, group)``; built on first call.
    ``seed`` already includes the step (each step of random pruning draws anew)."""

    model: nn.Module
    targets: list[Target]
    device: torch.device
    data: Callable[[], tuple[Iterable, int, list[str]]]
    seed: int = 0
    batches: int = 1
    progress: bool = True
    loss: Callable[..., torch.Tensor] = F.cross_entropy


@dataclass
class MaskChoice:
    """Keep masks (True = keep), one per target in order; FairGRAPE adds each layer's group shares."""

    keeps: list[torch.Tensor]
    shares: list[dict[str, Any]] = field(default_factory=list)


# -- importance ----------------------------------------------------------------------------------
def magnitude(c: ScoreContext) -> Scores:
    return imp.magnitude_scores(c.targets)


def random(c: ScoreContext) -> Scores:
    return imp.random_scores(c.targets, c.seed)


def snip(c: ScoreContext) -> Scores:
    loader, _, _ = c.data()
    return imp.snip_scores(c.model, c.targets, loader, c.loss, c.device, c.batches, c.progress)


def grasp(c: ScoreContext) -> Scores:
    loader, _, _ = c.data()
    return imp.grasp_scores(c.model, c.targets, loader, c.loss, c.device, c.batches, c.progress)


def group_importance(c: ScoreContext) -> Scores:
    """FairGRAPE's ``[K, *shape]`` per-group ``(g·w)²``."""
    loader, groups, names = c.data()
    return imp.group_scores(c.model, c.targets, loader, c.loss, c.device, groups, names, c.progress)


# -- selection -----------------------------------------------------------------------------------
def per_layer(targets: list[Target], scores: Scores, density: float) -> MaskChoice:
    """The top ``density`` of every layer (ties keep the lower index; pruned weights stay pruned)."""
    return MaskChoice([select.top_k(scores[t.name].cpu(), layer_quota(t.weight.numel(), density), t.mask.cpu())
                       for t in targets])


def global_(targets: list[Target], scores: Scores, density: float) -> MaskChoice:
    """The top ``density`` of all targeted weights ranked together (SNIP and GraSP as published)."""
    total = sum(t.weight.numel() for t in targets)
    keeps = select.top_k({t.name: scores[t.name].cpu() for t in targets}, layer_quota(total, density),
                         {t.name: t.mask.cpu() for t in targets})
    return MaskChoice([keeps[t.name] for t in targets])


def fair_shares(targets: list[Target], scores: Scores, density: float) -> MaskChoice:
    """FairGRAPE's greedy selection keeping each group's share, every layer in one call (the
    layers run in parallel threads)."""
    candidates = [t.mask.cpu() for t in targets]
    quotas = [min(layer_quota(t.weight.numel(), density), int(c.sum())) for t, c in zip(targets, candidates)]
    chosen = select_layer_masks([scores[t.name] for t in targets], candidates, quotas, report=True)
    return MaskChoice([keep for keep, _ in chosen], [share for _, share in chosen])
