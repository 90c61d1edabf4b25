"""The block forward: a batch through a causal LM one block at a time, the one way every part of
the LM pipeline runs a model (calibration, the solve, perplexity, pair scores, head scoring).

1. :func:`capture_block_inputs`: the model's own forward with every block a stub keeps what block
   0 receives (the hidden states) and the positional and keyword arguments *each* block is called
   with (attention mask, rotary position embeddings, ...: layers may differ, Gemma alternates
   sliding-window and global attention);
2. :func:`run_block`: every batch through one block, which gives the next block's inputs.

A block model (:mod:`fairprune.causal.blocks`) loads each part only while it runs, so the same
forward serves a model in memory and one streamed from disk.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from fairprune.causal.structure import BlockCall, block_calls


@dataclass
class CalibInput:
    """One batch of token ids; ``paired``: the first half and second half are aligned pair sides."""

    ids: torch.Tensor  # [batch, seq]
    paired: bool = False
    mask: torch.Tensor | None = None  # [batch (pairs), seq]: tokens that count in statistics
    attention: torch.Tensor | None = None  # [batch, seq]: 1 a token, 0 right padding (None: no padding)


@dataclass
class BlockInput:
    """What the blocks are called with for one calibration batch: the current hidden states, and
    each block's other arguments as the model passes them to that block (its own attention mask
    and rotary embeddings where layers differ, Gemma's sliding-window and global layers)."""

    hidden: torch.Tensor
    calls: list[BlockCall]
    source: CalibInput


@torch.no_grad()
def capture_block_inputs(blocks, inputs: list[CalibInput], device) -> list[BlockInput]:
    """Run each batch through the embedding front (loaded for the time it runs) and keep block 0's
    input and every block's call arguments (:func:`fairprune.causal.structure.block_calls`: the
    model's own forward with the blocks as stubs, so no block runs). ``blocks``: a block model
    (:mod:`fairprune.causal.blocks`)."""
    captured: list[BlockInput] = []
    with blocks.loaded(*blocks.front_modules(), device=device):
        for current in inputs:
            padded = {} if current.attention is None else {"attention_mask": current.attention.to(device)}
            hidden, calls = block_calls(blocks.model, blocks.blocks, blocks.family.returns_tuple,
                                        input_ids=current.ids.to(device), **padded)
            captured.append(BlockInput(hidden, calls, current))
    return captured


def run_block(index: int, block: nn.Module, batches: list[BlockInput]) -> list[BlockInput]:
    """Every batch through block ``index``: the next block's inputs."""
    return [replace(b, hidden=_hidden(call_block(index, block, b))) for b in batches]


def call_block(index: int, block: nn.Module, b: BlockInput):
    """Block ``index`` called on batch ``b`` with the arguments the model gives that block."""
    call = b.calls[index]
    return block(b.hidden, *call.args, **call.kwargs)


def _hidden(output) -> torch.Tensor:
    # v5 blocks return a tensor; some (GPT-Neo) still return a tuple whose first item it is.
    return output[0] if isinstance(output, (tuple, list)) else output
