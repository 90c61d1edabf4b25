"""GPTQ: quantization of a pruned linear layer with error compensation from the layer Hessian.

``--quantize w4a16-gptq`` (or ``w8a16-gptq``) quantizes each prunable layer right after it is
pruned, inside the layer-by-layer pass, from the same Hessian ``H = 2/n Σ XXᵀ`` SparseGPT solves
with (Debias-SparseGPT: its paired Hessian; Wanda and magnitude: a plain Hessian collected beside
their own statistic; :class:`fairprune.pruning.modifiers.Quantize`). The later blocks are then calibrated on the outputs of
the quantized ones, as GPTQ does (Frantar et al., 2023).

The update is SparseGPT's with rounding in place of masking: columns in blocks, each column
rounded to the grid of its group, its rounding error divided by ``Hinv[i, i]`` and spread over the
columns not yet visited, a lazy update of the later blocks after each one. The sparsity mask is
held fixed: a pruned entry is quantized to exactly 0 (its error compensated like any other), so
a pruned zero stays zero. A group's scale is taken when the pass reaches its first column, from
the group's present (already compensated) kept weights, as GPTQ's reference does; the blocks are
a whole number of groups, so no group straddles a lazy update. The scale is rounded to the
folder's 16-bit dtype before use, so the written integers are the ones the pass chose.

Scales, zero points and the rounding itself are compressed-tensors' (``calculate_qparams``,
``fake_quantize``); the column loop below is written by hand because compressed-tensors has no
GPTQ (llm-compressor's GPTQ modifier owns its own model lifecycle, hooks and Hessians, and cannot
take the Hessian this pass already holds nor keep a sparsity mask fixed).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fairprune import distributed
from fairprune.causal.families import linear_weight, set_linear_weight
from fairprune.pruning.sparsegpt import inverse_hessian_cholesky


def column_args(args: Any) -> Any:
    """``args`` (group strategy) for one column of a group: one scale per row, the same bits."""
    return args.model_copy(update={"strategy": "channel", "group_size": None})


@torch.no_grad()
def gptq_quantize(W: torch.Tensor, H: torch.Tensor, args: Any, scale_dtype: torch.dtype = torch.bfloat16,
                  blocksize: int = 128, percdamp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """``W`` [out, in] (pruned: its zeros are the mask) quantized against Hessian ``H`` [in, in] with
    ``args`` (compressed-tensors ``QuantizationArgs``: symmetric int, group strategy); returns the
    dequantized weights (float32, on the grid, the mask's zeros exact) and the scales [out, in /
    group] in ``scale_dtype``."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    rows, cols = W.shape
    group = args.group_size
    blocksize = max(group, blocksize // group * group)  # a group never straddles two blocks
    one = column_args(args)
    W = W.to(torch.float32, copy=True)
    keep = W != 0
    H = H.to(torch.float32, copy=True)
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    keep &= ~dead
    Hinv = inverse_hessian_cholesky(H, percdamp)
    scales = torch.empty(rows, cols // group, dtype=scale_dtype, device=W.device)
    zero = torch.zeros(rows, 1, dtype=W.dtype, device=W.device)
    scale = zero
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1, Hinv1, keep1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2], keep[:, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            if (i1 + i) % group == 0:  # the group's scale from its kept weights as they are now
                kept = W1[:, i:i + group] * keep1[:, i:i + group]
                scale, _ = calculate_qparams(kept.amin(1, keepdim=True), kept.amax(1, keepdim=True), one)
                scale = scale.to(scale_dtype)
                scales[:, (i1 + i) // group] = scale[:, 0]
                scale = scale.float()
            w = W1[:, i]
            q = fake_quantize(w.unsqueeze(1), scale, zero, one)[:, 0].masked_fill(~keep1[:, i], 0)
            err = (w - q) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            W1[:, i] = q  # exactly on the grid (the update leaves rounding residue)
            Err1[:, i] = err
        W[:, i1:i2] = W1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]  # lazy update of the columns after this block
    return W, scales


class LayerQuantizer:
    """``--quantize``'s plan for a run: the scheme (bits, one group size), whether GPTQ compensates,
    and the scales GPTQ chose, by full module name, for the writer to store."""

    def __init__(self, quantize: str, group: int, asked: int | None = None):
        from fairprune.hub.quantized import BITS, is_gptq, weight_args

        self.quantize, self.group, self.bits = quantize, group, BITS[quantize]
        self.asked = group if asked is None else asked  # the group size asked for (``group``: the one used)
        self.gptq = is_gptq(quantize)
        self.args = weight_args(self.bits, group)
        self.scales: dict[str, torch.Tensor] = {}

    def solve(self, name: str, layer: nn.Module, stat: Any, settings: dict[str, Any], scale_dtype: torch.dtype) -> None:
        """GPTQ of one pruned layer in place (``name``: its full module name); collective under
        torchrun, as the prune solve: every rank solved from the same reduced Hessian, rank 0's result
        makes them identical."""
        W, scales = gptq_quantize(linear_weight(layer), stat.value(), self.args, scale_dtype,
                                  settings.get("blocksize", 128), settings.get("percdamp", 0.01))
        set_linear_weight(layer, distributed.broadcast(W.contiguous()))
        self.scales[name] = distributed.broadcast(scales.contiguous()).cpu()
