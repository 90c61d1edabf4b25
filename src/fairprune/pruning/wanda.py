"""Wanda: prune by weight magnitude times input activation norm (Sun et al., 2024).

The score of weight ``W_ij`` is ``|W_ij| · ‖X_j‖₂``, the norm taken over every calibration
token reaching input column ``j``. Weights compete only within their output row (unstructured:
the lowest ``floor(sparsity·in)`` per row; N:M: the lowest N of every M consecutive columns).
Surviving weights are not updated. The masks come from :mod:`fairprune.pruning.select`
(:func:`~fairprune.pruning.select.top_k_per_row`, :func:`~fairprune.pruning.select.n_m`).
"""

from __future__ import annotations

import torch

from fairprune import distributed
from fairprune.pruning.select import n_m, top_k_per_row
from fairprune.pruning.sparsity import Sparsity


class InputNorms:
    """Per-column ``Σ x_j²`` over calibration tokens, one float32 term per batch in a
    :class:`fairprune.distributed.ExactSum`: summed across processes (torchrun: each rank adds its
    share of the batches) to one process's sum bit for bit."""

    def __init__(self, columns: int, device=None):
        self.device = device
        self.sq = distributed.ExactSum((columns,), device)

    def add_batch(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Add inputs ``x`` [batch, seq, cols]; ``mask`` [batch, seq] selects the tokens that count."""
        if mask is not None:
            x = x[mask.to(x.device, torch.bool)]
        self.sq.add(x.reshape(-1, x.shape[-1]).float().pow(2).sum(0))

    def value(self) -> torch.Tensor:
        """``‖X_j‖₂`` per input column over all processes' tokens (float32)."""
        total = self.sq.total()
        return total.sqrt().float().to(self.device or total.device)


def wanda_mask(W: torch.Tensor, norms: torch.Tensor, sparsity: Sparsity) -> torch.Tensor:
    """Mask (True = prune) of ``W`` [out, in] given input-column norms [in]: per row the lowest
    ``floor(fraction·in)`` scores, or for N:M the lowest N of every M columns."""
    score = W.abs().float() * norms.to(W.device).float().unsqueeze(0)
    if sparsity.nm is not None:
        return ~n_m(score, *sparsity.nm)
    return ~top_k_per_row(score, score.shape[1] - int(score.shape[1] * sparsity.fraction))


def wanda_solve(W: torch.Tensor, norms: torch.Tensor, sparsity: Sparsity, **_) -> torch.Tensor:
    """One layer pruned by Wanda (the registry's layer solve): masked, not updated."""
    return W.masked_fill(wanda_mask(W, norms, sparsity), 0)
