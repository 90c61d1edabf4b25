"""The one pass over a causal LM's blocks: capture, then for each block calibrate → change → emit.

Every post-training step that visits the blocks goes through :func:`run`: the pruning solvers and
GPTQ (their statistics collected, then each layer changed), measuring (perplexity, pair scores,
the lm-eval forward of a streamed model), FASP's head scores (the perplexity windows under many
head configurations, each sampling step, the gradient baseline), head removal, the share of
zeros, and the writing of a changed block, in memory or streamed alike.

1. :func:`capture`: the model's own forward with every block a stub keeps what block 0 receives
   (the hidden states) and the positional and keyword arguments *each* block is called with
   (attention mask, rotary position embeddings, KV cache: layers may differ, Gemma alternates
   sliding-window and global attention), one :class:`Batch` per forward;
2. for each block, loaded once (:meth:`~fairprune.causal.blocks.BlockModel.loaded`: moved to the
   device, or read from the model's files when streamed):

   - **calibrate**: when a :class:`Step` collects, every batch runs through the block while each
     collecting step's :meth:`Step.calibrate` context is open (its hooks see the block's layers'
     inputs); nothing has changed yet, so every step collects from the same inputs;
   - **change**: each step's :meth:`Step.change`, in order (a solver prunes, GPTQ rounds, head
     removal slices);
   - **emit**: the batches through the changed block (``flow``, by default :func:`through`): the
     next block's inputs; then each step's :meth:`Step.emit` (a streamed run writes the block to its
     shard);

3. the caller runs the tail and the head on the last hidden states (:meth:`~fairprune.causal.blocks.BlockModel.tail`).

A pass holds the hidden states of all its batches between blocks; :func:`passes` cuts the work into
passes of at most :data:`PASS_BYTES` of them (each pass reads a streamed model once more).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from tqdm.auto import tqdm

from fairprune.causal.structure import BlockCall, block_calls

#: Bytes of hidden states (and KV caches) one pass holds between blocks.
PASS_BYTES = 512 * 2**20

T = TypeVar("T")


@dataclass
class CalibInput:
    """One batch of token ids; ``paired``: the first half and second half are aligned pair sides."""

    ids: torch.Tensor  # [batch, seq]
    paired: bool = False
    mask: torch.Tensor | None = None  # [batch (pairs), seq]: tokens that count in statistics
    attention: torch.Tensor | None = None  # [batch, seq]: 1 a token, 0 right padding (None: no padding)


@dataclass
class Batch:
    """One forward's rows on their way through the blocks: the hidden states entering the next
    block, every block's other arguments as the model passes them, the calibration batch it came
    from (None for a plain forward) and the rows' own head gates (``[rows, layers, heads]``; None:
    the model's gates as they stand)."""

    hidden: torch.Tensor
    calls: list[BlockCall]
    source: CalibInput | None = None
    gates: torch.Tensor | None = None


@torch.no_grad()
def capture(blocks, inputs: Sequence[CalibInput | dict[str, Any]], device) -> list[Batch]:
    """For each input — a :class:`CalibInput`, or the keyword arguments of the model's forward —
    block 0's input and every block's arguments (:func:`fairprune.causal.structure.block_calls`:
    the model's own forward with the blocks as stubs, so no block runs), the embedding front loaded
    once for all. ``blocks``: a block model (:mod:`fairprune.causal.blocks`)."""
    captured: list[Batch] = []
    with blocks.loaded(*blocks.front_modules(), device=device):
        for current in inputs:
            if isinstance(current, CalibInput):
                source = current
                kwargs = {"input_ids": current.ids}
                if current.attention is not None:
                    kwargs["attention_mask"] = current.attention
            else:
                source, kwargs = None, current
            moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            hidden, calls = block_calls(blocks.model, blocks.blocks, blocks.family.returns_tuple, **moved)
            captured.append(Batch(hidden, calls, source))
    return captured


def call_block(index: int, block: nn.Module, b: Batch, hidden: torch.Tensor | None = None):
    """Block ``index`` called on batch ``b`` (or on ``hidden`` with ``b``'s arguments) with the
    arguments the model gives that block."""
    call = b.calls[index]
    return block(b.hidden if hidden is None else hidden, *call.args, **call.kwargs)


def hidden_of(output) -> torch.Tensor:
    """A block's output hidden states: v5 blocks return a tensor; some (GPT-Neo) still return a
    tuple whose first item it is."""
    return output[0] if isinstance(output, (tuple, list)) else output


def through(index: int, block: nn.Module, batches: Sequence[Batch], gates: Any = None) -> None:
    """Every batch through block ``index`` (loaded), its hidden states replaced by the block's
    output; a batch with its own gates runs under them (``gates``: the attached head gates,
    :class:`fairprune.pruning.heads.HeadGates`)."""
    for b in batches:
        with gates.per_row(b.gates) if b.gates is not None else contextlib.nullcontext():
            b.hidden = hidden_of(call_block(index, block, b))


class Step:
    """What a pass does at each block, beside running its batches: a modifier's part in it.

    - :attr:`collects`: True when the step needs the block's calibration batches run through it
      before any change (its :meth:`calibrate` context is open while they run);
    - :meth:`calibrate`: a context open while the batches run through the block, yielding a
      function called with each batch before it runs (or None);
    - :meth:`change`: change the block in place (every collecting step has collected);
    - :meth:`emit`: the changed block, still loaded, after the batches ran through it (write it).
    """

    collects = False

    @contextlib.contextmanager
    def calibrate(self, index: int, block: nn.Module) -> Iterator[Callable[[Batch], None] | None]:
        yield None

    def change(self, index: int, block: nn.Module) -> None:
        """Change block ``index`` in place (or read it: a measuring step)."""

    def emit(self, index: int, block: nn.Module) -> None:
        """Block ``index`` is changed and its batches have run through it."""


class Each(Step):
    """A step from functions: ``change(index, block)`` (change the block, or read it: a measuring
    step) and ``emit(index, block)``."""

    def __init__(self, change: Callable[[int, nn.Module], None] | None = None,
                 emit: Callable[[int, nn.Module], None] | None = None):
        if change is not None:
            self.change = change
        if emit is not None:
            self.emit = emit


def run(blocks, steps: Sequence[Step] = (), batches: list[Batch] | None = None, *, device=None,
        flow: Callable[[int, nn.Module, list[Batch]], None] | None = through, flow_last: bool = True,
        reverse: bool = False, progress: bool = False, desc: str = "blocks") -> list[Batch] | None:
    """The pass: every block of ``blocks`` loaded on ``device`` (None: the model's run device) in
    turn — in reverse order with ``reverse`` — calibrated, changed and emitted by ``steps`` (see the
    module docstring), ``batches`` run through it by ``flow`` (None: not run; ``flow_last`` False:
    not through the last block, whose outputs no one reads). Returns the batches after the last block."""
    device = device if device is not None else blocks.run_device()
    order = list(enumerate(blocks.blocks))
    if reverse:
        order.reverse()
    collecting = [s for s in steps if s.collects]
    for index, block in tqdm(order, desc=desc, unit="block", leave=False, disable=not progress):
        with blocks.loaded(block, device=device):
            if batches is not None and collecting:
                with contextlib.ExitStack() as stack:
                    before = [f for f in (stack.enter_context(s.calibrate(index, block)) for s in collecting) if f]
                    for b in batches:
                        for f in before:
                            f(b)
                        call_block(index, block, b)
            for step in steps:
                step.change(index, block)
            if batches is not None and flow is not None and (flow_last or index + 1 < len(order)):
                flow(index, block, batches)
            for step in steps:
                step.emit(index, block)
    return batches


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
