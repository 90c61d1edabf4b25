"""Weight importance for vision pruning: magnitude, random, SNIP, GraSP and FairGRAPE's per-group
``(g·w)²``.

Each function returns ``{layer name: score tensor shaped like the weight}`` (``[K, *shape]`` for the
per-group score) over the given :class:`~fairprune.pruning.masks.Target` list. Higher score = more
worth keeping. The data-driven scores show a progress bar over their batches unless ``progress=False``. Gradients are taken with respect to the *effective* (masked) weight, so a pruned
weight scores zero, and no optimizer step happens while scoring.

When a ``torch.distributed`` process group exists (outside :func:`fairprune.distributed.local`),
gradient sums and sample / batch counts are all-reduced, so every process ends with the same
scores: the average over every process's samples. Each process may hold its own shard of the
importance set, or all of it (sums and counts then grow alike, and the average is one process's).
The pruning callback scores inside ``local()`` instead: each process the whole set, no reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager

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


def _batches(loader: Iterable, device: torch.device, desc: str, limit: int | None = None, progress: bool = True):
    for i, (x, y, g) in enumerate(tqdm(loader, desc=desc, leave=False, total=limit, disable=not progress)):
        if limit is not None and i >= limit:
            break
        yield x.to(device), y.to(device), g.to(device)


def snip_scores(model: nn.Module, targets: list[Target], loader: Iterable, loss_fn: Callable, device: torch.device,
                batches: int = 1, progress: bool = True) -> Scores:
    """SNIP: |g·w| with g the gradient of the mean loss on ``batches`` batches (one by default)."""
    params = _params(targets)
    sums = [torch.zeros_like(p) for p in params]
    count = torch.zeros((), device=device)
    for x, y, _ in _batches(loader, device, "snip", batches, progress):
        grads = torch.autograd.grad(loss_fn(model(x), y) * len(y), params)
        for s, gr in zip(sums, grads):
            s += gr
        count += len(y)
    count = _reduce(count)
    return {t.name: (_reduce(s) / count * w).abs() for t, s, w in zip(targets, sums, _effective(targets))}


def grasp_scores(model: nn.Module, targets: list[Target], loader: Iterable, loss_fn: Callable, device: torch.device,
                 batches: int = 1, progress: bool = True) -> Scores:
    """GraSP: keep score ``w·(Hg)``, i.e. the negated removal score ``−w·Hg`` of the paper.

    GraSP removes the weights with the largest ``−w·Hg`` (their removal reduces gradient flow
    least), so the weights worth keeping are those with the largest ``w·Hg``.
    """
    params = _params(targets)
    grads = [torch.zeros_like(p) for p in params]
    batches_seen = []
    for x, y, _ in _batches(loader, device, "grasp: gradient", batches, progress):
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


@contextmanager
def _eval_mode(model: nn.Module):
    """Eval mode inside the block (no dropout; BatchNorm uses its running statistics), every
    module's own mode restored after it."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def group_scores(model: nn.Module, targets: list[Target], loader: Iterable, loss_fn: Callable, device: torch.device,
                 num_groups: int, group_names: list[str] | None = None, progress: bool = True) -> Scores:
    """FairGRAPE's per-group importance ``I[k, w] = (g_k,w · w)²``, shaped ``[K, *weight]``.

    ``g_k`` is the gradient of the mean loss over group k's samples in ``loader``: each batch's
    per-sample losses (``reduction="none"``) are summed per group, their gradients summed over the
    batches, divided by the group's sample count, then multiplied by the weight and squared.
    Samples with an unknown group (-1) are skipped.

    The pass runs in eval mode (each module's mode is restored afterwards): no dropout, and
    BatchNorm normalises with its running statistics instead of the batch's, so a sample's loss
    does not depend on the other samples in its batch. Each group's gradient then comes from
    forwards and backwards over that group's samples only, and nothing leaks between groups: one
    pass over the data in all, the work of one plain forward and backward, where
    :func:`group_scores_reference` backpropagates the whole batch once per group. A group's
    samples wait until they fill a batch of the loader's size (the rest run at the end), so the
    passes keep the loader's batch size rather than a K-th of it.
    """
    params = _params(targets)
    sums = [torch.zeros((num_groups, *p.shape), device=p.device) for p in params]
    counts = torch.zeros(num_groups, device=device)
    pending: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(num_groups)]
    chunk = 0  # the largest batch the loader gave: each group's samples are run in chunks of it

    def run(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = loss_fn(model(x), y, reduction="none").sum()
        for s, gr in zip(sums, torch.autograd.grad(loss, params)):
            s[k] += gr
        counts[k] += len(y)

    def flush(k: int, at_least: int) -> None:
        """Run group k's waiting samples in chunks of ``chunk`` while ``at_least`` are waiting."""
        while pending[k] and sum(len(y) for _, y in pending[k]) >= at_least:
            x, y = (torch.cat(parts) for parts in zip(*pending[k]))
            run(k, x[:chunk], y[:chunk])
            pending[k] = [(x[chunk:], y[chunk:])] if len(y) > chunk else []

    with _eval_mode(model), torch.enable_grad():
        for x, y, g in _batches(loader, device, "fairgrape: group importance", progress=progress):
            chunk = max(chunk, len(y))
            known = ((g >= 0) & (g < num_groups)).nonzero().squeeze(1)
            by_group = known[torch.argsort(g[known], stable=True)]
            sizes = torch.bincount(g[known], minlength=num_groups).tolist()  # one device sync a batch
            for k, members in enumerate(torch.split(by_group, sizes)):
                if len(members):
                    pending[k].append((x[members], y[members]))
                    flush(k, chunk)
        for k in range(num_groups):
            flush(k, 1)
    return _squared_means(targets, sums, counts, group_names)


def group_scores_reference(model: nn.Module, targets: list[Target], loader: Iterable, loss_fn: Callable,
                           device: torch.device, num_groups: int, group_names: list[str] | None = None) -> Scores:
    """:func:`group_scores` as K backward passes per batch: one forward over the whole batch,
    then one ``autograd.grad`` per present group on that group's summed loss (``retain_graph``).

    The same definition (also in eval mode), computed the slow way; kept as the test oracle and
    the benchmark's baseline.
    """
    params = _params(targets)
    sums = [torch.zeros((num_groups, *p.shape), device=p.device) for p in params]
    counts = torch.zeros(num_groups, device=device)
    with _eval_mode(model), torch.enable_grad():
        for x, y, g in _batches(loader, device, "fairgrape: group importance (reference)", progress=False):
            losses = loss_fn(model(x), y, reduction="none")
            present = [k for k in range(num_groups) if bool((g == k).any())]
            for j, k in enumerate(present):
                grads = torch.autograd.grad(losses[g == k].sum(), params, retain_graph=j < len(present) - 1)
                for s, gr in zip(sums, grads):
                    s[k] += gr
                counts[k] += (g == k).sum()
    return _squared_means(targets, sums, counts, group_names)


def _squared_means(targets: list[Target], sums: list[torch.Tensor], counts: torch.Tensor,
                   group_names: list[str] | None) -> Scores:
    """``(mean gradient · w)²`` per group from the gradient sums and sample counts (summed over
    the processes first)."""
    num_groups = len(counts)
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
