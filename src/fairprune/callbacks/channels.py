"""Channel granularity for :class:`~fairprune.callbacks.pruning.IterativePruning`: one step that
removes whole channels, and the optimizer rebuilt over the smaller model.

A step scores the weights with the method's importance (as at weight granularity), combines the
scores per channel of every coupled channel group (:mod:`fairprune.pruning.channels`: residual
additions, depthwise convolutions, BatchNorm and the classifier's input lose the same channels; the
classifier's outputs are never pruned; every group keeps at least ``min_channels``), selects
(``entry.select_channels``: per group, globally, or FairGRAPE's greedy group shares), and removes
the channels with torch-pruning. The model then records its architecture
(``pl_module.architecture``, plain data its checkpoints carry and reload into). The optimizer and
its schedulers are built again over the new parameters (``trainer.strategy.setup_optimizers``),
continuing at the learning rates and scheduler states reached; the optimizer's per-parameter state
(momenta) starts afresh.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch

from fairprune.errors import UserError
from fairprune.pruning import channels
from fairprune.pruning.masks import Target, prunable_targets
from fairprune.pruning.registry import Method


def check_settings(entry: Method, granularity: str, min_channels: int, multiple: int = 1) -> None:
    """A granularity the method supports, a floor and a multiple of 1 or more, or a one-line error."""
    if granularity not in channels.GRANULARITIES:
        raise UserError(f"granularity must be one of {', '.join(channels.GRANULARITIES)}, got {granularity!r}")
    if granularity not in entry.granularities:
        raise UserError(f"method {entry.name} prunes at granularity {' or '.join(entry.granularities)} only, not "
                        f"{granularity}; choose another method or --pruning.granularity {entry.granularities[0]}")
    if isinstance(min_channels, bool) or not isinstance(min_channels, int) or min_channels < 1:
        raise UserError(f"min_channels is the channels every group keeps, 1 or more, got {min_channels!r}")
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise UserError(f"channel_multiple rounds each group's kept channels up to a multiple of it: 1 or more "
                        f"(1: no rounding, 8: what CPU kernels block by), got {multiple!r}")


def check_run(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    """Channel pruning runs in one process, on a model that records its architecture and holds no
    weight masks; anything else is a one-line error before training starts."""
    if trainer.world_size > 1:
        raise UserError("channel granularity runs in one process (each step rebuilds the model); set "
                        "trainer devices: 1, or prune at granularity weight")
    if not hasattr(pl_module, "architecture"):
        raise UserError(f"channel granularity needs a model that records its pruned architecture in its "
                        f"checkpoints (fairprune.models.vision.VisionClassifier), not {type(pl_module).__name__}")
    channels.check_unmasked(pl_module)


def channel_step(trainer: L.Trainer, pl_module: L.LightningModule, entry: Method, density: float,
                 targets: list[Target], score: Callable[[list[Target]], dict[str, torch.Tensor]],
                 include_first: bool = True, floor: int = 1, multiple: int = 1) -> tuple[list[dict[str, Any]], float]:
    """Remove channels down to ``density`` of each group's (or of all) dense channels; return each
    channel group's FairGRAPE share report (named ``layer`` by the group's root layer; none for
    other methods) and the time scoring ended."""
    record = pl_module.architecture
    shape = record["input_shape"] if record else input_shape(trainer)
    dense_parameters = record["dense_parameters"] if record else channels.parameter_count(pl_module)
    first = [] if include_first else [t.module for t in prunable_targets(pl_module)[:1]]
    groups = channels.channel_groups(pl_module, shape, ignored=first, record=record, floor=floor, multiple=multiple)
    scores = score(targets)
    scored = time.perf_counter()
    choice = entry.select_channels(groups, channels.channel_scores(groups, scores, entry.channel_reduce), density)
    channels.remove(groups, choice.keeps)
    pl_module.architecture = channels.architecture(groups, shape, dense_parameters)
    rebuild_optimizers(trainer)
    return [{"layer": g.name, **share} for g, share in zip(groups, choice.shares)], scored


def input_shape(trainer: L.Trainer) -> list[int]:
    """The shape of one model input (one validation image), to trace the network with."""
    x = next(iter(trainer.datamodule.val_dataloader()))[0]
    return [1, *x.shape[1:]]


def rebuild_optimizers(trainer: L.Trainer) -> None:
    """Build the optimizers and schedulers again over the model's parameters now (channel pruning
    replaced them), continuing at the learning rates and scheduler states reached."""
    rates = [[group.get("lr") for group in optimizer.param_groups] for optimizer in trainer.optimizers]
    schedulers = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]
    trainer.strategy.setup_optimizers(trainer)
    for optimizer, old in zip(trainer.optimizers, rates):
        if len(optimizer.param_groups) == len(old):
            for group, lr in zip(optimizer.param_groups, old):
                if lr is not None:
                    group["lr"] = lr
    if len(schedulers) == len(trainer.lr_scheduler_configs):
        for config, state in zip(trainer.lr_scheduler_configs, schedulers):
            config.scheduler.load_state_dict(state)
