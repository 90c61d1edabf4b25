"""BatchNorm recalibration: re-estimate the running statistics of a model's BatchNorm layers after
its weights changed (a pruning step, the end of pruning).

A pruned network's activations no longer match the running mean and variance its BatchNorm layers
learnt while it was denser; evaluation then normalises with stale statistics. Recalibration resets
them and averages each layer's batch statistics over a few training batches with equal weight
(PyTorch's cumulative average, ``momentum=None``): ``running_mean`` is the mean of the per-batch
means, ``running_var`` the mean of the per-batch unbiased variances. While it runs, BatchNorm layers
are in train mode and every other module in eval mode (no dropout); no gradient is taken and no
weight changes. Modes and momenta are restored afterwards.

Under ``torch.distributed`` every process passes the same batches (the whole loader, in the same
order); process ``r`` of ``w`` forwards batches ``r, r + w, ...`` of the first ``batches``, and the
per-layer sums ``count · mean`` / ``count · var`` and the counts are all-reduced, so every process
ends with identical statistics: those one process computes over the same batches (up to the order
of the floating-point sums).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

import torch
from torch import nn

from fairprune.distributed import all_reduce_sum, world


def batchnorm_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The BatchNorm layers (1-d, 2-d, 3-d, synchronised) that keep running statistics."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


def _inputs(batch):
    """The model input of a batch: a tensor, or the first element of an ``(x, y, ...)`` tuple."""
    return batch[0] if isinstance(batch, (list, tuple)) else batch


@torch.no_grad()
def recalibrate_batchnorm(model: nn.Module, loader: Iterable, batches: int, device: torch.device | str | None = None) -> int:
    """Re-estimate every BatchNorm layer's running statistics over the first ``batches`` batches of
    ``loader`` (this process's share of them under ``torch.distributed``, see the module's notes);
    return the number of batches used over all processes (0: nothing changed).

    ``model`` is called on each batch's input (moved to ``device``, default: the model's); a batch
    of one sample (a loader's last) is skipped. A layer that no batch reached keeps its statistics."""
    layers = batchnorm_layers(model)
    if batches <= 0 or not layers:
        return 0
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    rank, size = world()
    modes = {m: m.training for m in model.modules()}
    saved = [(bn.momentum, bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()) for bn in layers]
    try:
        model.eval()
        for bn in layers:
            bn.reset_running_stats()
            bn.momentum = None  # cumulative average: every batch weighs the same
            bn.train()
        for batch in islice(loader, rank, batches, size):
            x = _inputs(batch)
            if len(x) > 1:  # one sample has no variance (BatchNorm refuses it in train mode): skip it
                model(x.to(device))
        used = _all_reduce_statistics(layers)
        for bn, (_, mean, var, tracked) in zip(layers, saved):
            if int(bn.num_batches_tracked) == 0:  # no batch reached it: keep what it had
                bn.running_mean.copy_(mean)
                bn.running_var.copy_(var)
                bn.num_batches_tracked.copy_(tracked)
    finally:
        for module, training in modes.items():
            module.training = training
        for bn, (momentum, *_) in zip(layers, saved):
            bn.momentum = momentum
    return used


def _all_reduce_statistics(layers: list[nn.modules.batchnorm._BatchNorm]) -> int:
    """Combine the processes' cumulative averages into the average over every process's batches
    (one collective; nothing when alone). Returns the largest per-layer batch count."""
    if world()[1] == 1:
        return max(int(bn.num_batches_tracked) for bn in layers)
    device = layers[0].running_mean.device
    parts = []
    for bn in layers:
        n = bn.num_batches_tracked.to(device=device, dtype=torch.float64).reshape(1)
        parts += [n, bn.running_mean.double() * n, bn.running_var.double() * n]
    flat = all_reduce_sum(torch.cat(parts))
    start, used = 0, 0
    for bn in layers:
        width = bn.running_mean.numel()
        n = flat[start]
        if n > 0:
            bn.running_mean.copy_(flat[start + 1: start + 1 + width] / n)
            bn.running_var.copy_(flat[start + 1 + width: start + 1 + 2 * width] / n)
        bn.num_batches_tracked.fill_(int(round(float(n))))
        used = max(used, int(round(float(n))))
        start += 1 + 2 * width
    return used
