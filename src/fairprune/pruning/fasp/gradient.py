"""The gradient baseline's head importance (Michel et al. 2019), by passes over a block model.

``importance[l, h] = Σ_batches |∂loss_b/∂gate_{l,h}|`` over the non-overlapping windows of the
perplexity text, ``loss_b`` the mean next-token loss of batch ``b``. The forward is a pass over the
blocks (:mod:`~fairprune.causal.pipeline`) keeping every block's input; the loss's gradient at
the last block's output comes from the tail and the head; then the blocks are loaded once more in
reverse order and each is run again with gradients on to carry the gradient back to its input and to
its layer's gates (a gate acts only in its own layer, so that block gives its whole gradient). In
memory this is backpropagation split at the block boundaries, the same sums; streamed, each block
is read twice per pass (forward and backward), one resident at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fairprune.causal import pipeline
from fairprune.causal.blocks import as_blocks
from fairprune.causal.pipeline import call_block, capture, element_size, hidden_of, hidden_size, passes, through
from fairprune.errors import UserError
from fairprune.pruning.heads import HeadGates


def gradient_importance(model, ids: torch.Tensor, seqlen: int, batch_size: int = 4, device=None) -> torch.Tensor:
    """Michel et al. (2019): ``Σ_batches |∂loss/∂gate_h|`` over non-overlapping windows, ``[layers, heads]``.
    ``model``: an ``nn.Module`` or a block model; ``device``: where it runs (None: its own)."""
    windows = ids.numel() // seqlen
    if windows == 0:
        raise UserError(f"perplexity text has {ids.numel()} tokens, fewer than one window of {seqlen}")
    blocks = as_blocks(model)
    device = device or blocks.run_device()
    batches = list(ids[: windows * seqlen].view(windows, seqlen).split(batch_size))
    row_bytes = seqlen * hidden_size(blocks.config) * element_size(blocks) * (len(blocks.blocks) + 2)
    gates = HeadGates(blocks)
    frozen = {p: p.requires_grad for p in blocks.model.parameters()}
    was_training = blocks.model.training
    blocks.model.eval()
    importance = torch.zeros_like(gates.values)
    try:
        for p in frozen:  # only the gates need gradients; the weights stay frozen
            p.requires_grad_(False)
        with gates:
            for group in passes(batches, lambda batch: len(batch) * row_bytes):
                importance += _pass(blocks, group, gates, device)
    finally:
        gates.values.requires_grad_(False)
        for p, flag in frozen.items():
            p.requires_grad_(flag)
        blocks.model.train(was_training)
    return importance


def _pass(blocks, group: list[torch.Tensor], gates: HeadGates, device) -> torch.Tensor:
    """The summed ``|∂loss_b/∂gates|`` of the batches of ``group``: one pass forward, one back."""
    with torch.no_grad():
        batches = capture(blocks, [{"input_ids": ids} for ids in group], device)
        inputs = [[b.hidden] for b in batches]  # every block's input, per batch

        def forward(index: int, block, batches) -> None:
            through(index, block, batches)
            for kept, b in zip(inputs, batches):
                kept.append(b.hidden)

        pipeline.run(blocks, batches=batches, device=device, flow=forward, desc="gradient")
    with torch.enable_grad():
        finals = [kept[-1].detach().requires_grad_() for kept in inputs]
        tails = blocks.tail(finals, device)
        with blocks.head(device) as head:
            grads = []
            for final, tail, ids in zip(finals, tails, group):
                logits = head(tail).float()
                ids = ids.to(logits.device)
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
                grads.append(torch.autograd.grad(loss, final)[0])
    importance = torch.zeros_like(gates.values)

    def backward(index: int, block, batches) -> None:  # the blocks last to first: each one's gradient at its input
        with torch.enable_grad():
            for n, (kept, b) in enumerate(zip(inputs, batches)):
                x = kept[index].detach().requires_grad_()
                out = hidden_of(call_block(index, block, b, hidden=x))
                grads[n], gate_grad = torch.autograd.grad(out, [x, gates.values], grads[n])
                importance.add_(gate_grad.abs().cpu())

    gates.values.requires_grad_(True)
    pipeline.run(blocks, batches=batches, device=device, flow=backward, reverse=True, desc="gradient")
    gates.values.requires_grad_(False)
    return importance
