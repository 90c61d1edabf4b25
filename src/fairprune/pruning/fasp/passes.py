"""FASP's forward passes on a block model: every row of a pass through each block, loaded once.

Every forward FASP makes — the perplexity windows under many head configurations
(:mod:`~fairprune.pruning.fasp.batched`), each step of the KV-cached sampling loop
(:mod:`~fairprune.pruning.fasp.sampling`), the gradient baseline's forward and backward
(:mod:`~fairprune.pruning.fasp.gradient`) — is a *pass* over a block model
(:mod:`fairprune.causal.blocks`): the embedding front runs every batch of the pass with the
blocks as stubs (:func:`fairprune.causal.structure.block_calls`: block 0's input and the arguments
the model gives each block — its masks, rotary tables, KV cache), then each block is loaded once
and runs every batch (each batch under its own per-row head gates), then the tail and the head.
In memory (:class:`~fairprune.causal.blocks.Resident`) loading moves nothing already on the
device; streamed (:class:`~fairprune.causal.streamed.StreamedModel`) it reads the block from the
model's files, so a model larger than memory is scored with one block resident. It is one code
path for both kinds: the same operations on the same batches, so the same figures (bit for bit on
a CPU).

A pass holds the hidden states (and KV caches) of all its batches between blocks; the work is cut
into passes of at most :data:`PASS_BYTES` of them (:func:`passes`), and each pass reads a streamed
model once more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from fairprune.causal.forward import call_block
from fairprune.causal.structure import BlockCall, block_calls
from fairprune.pruning.heads import HeadGates

#: Bytes of hidden states (and KV caches) one pass holds between blocks.
PASS_BYTES = 512 * 2**20

T = TypeVar("T")


@dataclass
class Batch:
    """One forward's rows on their way through the blocks: the hidden states entering the next
    block, every block's other arguments, and the rows' own head gates (``[rows, layers, heads]``;
    None: the model's gates as they stand)."""

    hidden: torch.Tensor
    calls: list[BlockCall]
    gates: torch.Tensor | None = None


def capture(blocks, inputs: Sequence[dict[str, Any]], device) -> list[Batch]:
    """For each model call of ``inputs`` (keyword arguments of the model's forward, tensors moved to
    ``device``): block 0's input and every block's arguments, the front loaded once for all."""
    out = []
    with blocks.loaded(*blocks.front_modules(), device=device):
        for kwargs in inputs:
            moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            out.append(Batch(*block_calls(blocks.model, blocks.blocks, blocks.family.returns_tuple, **moved)))
    return out


def through(index: int, block: nn.Module, batches: Sequence[Batch], gates: HeadGates | None = None) -> None:
    """Every batch through block ``index`` (loaded), its hidden states replaced by the block's
    output; a batch with its own gates runs under them (``gates``: the attached :class:`HeadGates`)."""
    for b in batches:
        with gates.per_row(b.gates) if b.gates is not None else nullcontext():
            out = call_block(index, block, b)
        b.hidden = out[0] if isinstance(out, (tuple, list)) else out


def passes(items: Sequence[T], size: Callable[[T], int], budget: int = PASS_BYTES) -> list[list[T]]:
    """``items`` in order, grouped so that the ``size`` of each group adds up to at most ``budget``
    (one item at least per group)."""
    groups: list[list[T]] = []
    used = 0
    for item in items:
        if not groups or (groups[-1] and used + size(item) > budget):
            groups.append([])
            used = 0
        groups[-1].append(item)
        used += size(item)
    return groups


def element_size(blocks) -> int:
    """Bytes per element of the model's activations (its dtype)."""
    return torch.empty(0, dtype=blocks.dtype).element_size()


def hidden_size(config) -> int:
    """The width of the model's hidden states (768 when the config does not say)."""
    return int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0) or 768)
