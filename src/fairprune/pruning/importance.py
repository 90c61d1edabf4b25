"""Weight importance for vision pruning: magnitude, random, SNIP, GraSP and FairGRAPE's per-group
``(g·w)²``.

Each function returns ``{layer name: score tensor shaped like the weight}`` (``[K, *shape]`` for the
per-group score) over the given :class:`~fairprune.pruning.masks.Target` list. Higher score = more
worth keeping. Gradients are taken with respect to the *effective* (masked) weight, so a pruned
weight scores zero, and no optimizer step happens while scoring.

When a ``torch.distributed`` process group exists (outside :func:`fairprune.distributed.local`),
gradient sums and sample / batch counts are all-reduced, so every process ends with the same
scores: the average over every process's samples. Each process may hold its own shard of the
importance set, or all of it (sums and counts then grow alike, and the average is one process's).
The pruning callback scores inside ``local()`` instead: each process the whole set, no reduction.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from fairprune.distributed import all_reduce_sum
from fairprune.errors import UserError
from fairprune.pruning.masks import Target
from fairprune.pruning.select import magnitude

Scores = dict[str, torch.Tensor]


def _reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum over the processes (unchanged alone, or inside ``fairprune.distributed.local()``)."""
    return all_reduce_sum(t)


def _params(targets: list[Target]) -> list[torch.Tensor]:
    """The leaf tensor holding each weight (``weight_orig`` once a mask is attached)."""
    return [getattr(t.module, "weight_orig", t.module.weight) for t in targets]


def _effective(targets: list[Target]) -> list[torch.Tensor]:
    return [t.weight.detach() for t in targets]


def magnitude_scores(targets: list[Target]) -> Scores:
    """|w| (WS: weight selection; per-layer in the pruning callback), the score LM magnitude
    pruning uses too (:func:`fairprune.pruning.select.magnitude`)."""
    return {t.name: magnitude(t.weight) for t in targets}


def random_scores(targets: list[Target], seed: int) -> Scores:
    """Uniform random scores, seeded (the random-pruning baseline)."""
    gen = torch.Generator().manual_seed(seed)
    return {t.name: torch.rand(t.weight.shape, generator=gen).to(t.weight.device) for t in targets}


def _batches(loader: Iterable, device: torch.device, desc: str, limit: int | None = None):
    for i, (x, y, g) in enumerate(tqdm(loader, desc=desc, leave=False, total=limit)):
        if limit is not None and i >= limit:
            break
        yield x.to(device), y.to(device), g.to(device)


def snip_scores(model: nn.Module, targets: list[Target], loader: Iterable, loss_fn: Callable, device: torch.device,
                batches: int = 1) -> Scores:
    """SNIP: |g·w| with g the gradient of the mean loss on ``batches`` batches (one by default)."""
    params = _params(targets)
    sums = [torch.zeros_like(p) for p in params]
    count = torch.zeros((), device=device)
    for x, y, _ in _batches(loader, device, "snip", batches):
        grads = torch.autograd.grad(loss_fn(model(x), y) * len(y), params)
        for s, gr in zip(sums, grads):
            s += gr
        count += len(y)
    count = _reduce(count)
    return {t.name: (_reduce(s) / count * w).abs() for t, s, w in zip(targets, sums, _effective(targets))}


def grasp_scores(model: nn.Module, targets: list[Target], loader: Iterable, loss_fn: Callable, device: torch.device,
                 batches: int = 1) -> Scores:
    """GraSP: keep score ``w·(Hg)``, i.e. the negated removal score ``−w·Hg`` of the paper.

    GraSP removes the weights with the largest ``−w·Hg`` (their removal reduces gradient flow
    least), so the weights worth keeping are those with the largest ``w·Hg``.
    """
    params = _params(targets)
    grads = [torch.zeros_like(p) for p in params]
    batches_seen = []
    for x, y, _ in _batches(loader, device, "grasp: gradient", batches):
        for acc, gr in zip(grads, torch.autograd.grad(loss_fn(model(x), y), params)):
            acc += gr
        batches_seen.append((x, y))
    # The mean over every process's batches: batch count summed like the gradients.
    seen = max(float(_reduce(torch.tensor(float(len(batches_seen)), device=device))), 1.0)
    grads = [_reduce(g) / seen for g in grads]
    hg = [torch.zeros_like(p) for p in params]
    for x, y in batches_seen:
        first = torch.autograd.grad(loss_fn(model(x), y), params, create_graph=True)
        dot = sum((f * g).sum() for f, g in zip(first, grads))
        for acc, h in zip(hg, torch.autograd.grad(dot, params)):
            acc += h
    return {t.name: w * _reduce(h) / seen for t, h, w in zip(targets, hg, _effective(targets))}


def group_scores(model: nn.Module, targets: list[Target], loader: Iterable, loss_fn: Callable, device: torch.device,
                 num_groups: int, group_names: list[str] | None = None) -> Scores:
    """FairGRAPE's per-group importance ``I[k, w] = (g_k,w · w)²``, shaped ``[K, *weight]``.

    ``g_k`` is the gradient of the mean loss over group k's samples in ``loader``. Each group's
    gradient is taken separately (``autograd.grad`` on that group's summed loss), so nothing
    leaks between groups. Samples with an unknown group (-1) are skipped.
    """
    params = _params(targets)
    sums = [torch.zeros((num_groups, *p.shape), device=p.device) for p in params]
    counts = torch.zeros(num_groups, device=device)
    for x, y, g in _batches(loader, device, "fairgrape: group importance"):
        losses = loss_fn(model(x), y, reduction="none")
        present = [k for k in range(num_groups) if bool((g == k).any())]
        for j, k in enumerate(present):
            grads = torch.autograd.grad(losses[g == k].sum(), params, retain_graph=j < len(present) - 1)
            for s, gr in zip(sums, grads):
                s[k] += gr
            counts[k] += (g == k).sum()
    counts = _reduce(counts)
    empty = [group_names[k] if group_names else str(k) for k in range(num_groups) if counts[k] == 0]
    if empty:
        raise UserError(
            f"group(s) {', '.join(empty)} have no samples in the importance data; "
            "raise the callback's importance_fraction or check the sensitive attribute"
        )
    shape = (num_groups,) + (1,) * (sums[0].dim() - 1)
    return {
        t.name: (_reduce(s) / counts.view(shape[: s.dim()]) * w.unsqueeze(0)).square()
        for t, s, w in zip(targets, sums, _effective(targets))
    }
