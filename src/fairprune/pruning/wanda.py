"""Wanda: prune by weight magnitude times input activation norm (Sun et al., 2024).

The score of weight ``W_ij`` is ``|W_ij| · ‖X_j‖₂``, the norm taken over every calibration
token reaching input column ``j``. Weights compete only within their output row (unstructured:
the lowest ``floor(sparsity·in)`` per row; N:M: the lowest N of every M consecutive columns).
Surviving weights are not updated.

The mask helpers :func:`row_mask` and :func:`nm_mask` are shared with magnitude pruning.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fairprune.pruning.sparsegpt import check_nm, check_sparsity


class InputNorms:
    """Per-column ``Σ x_j²`` over calibration tokens; a plain tensor, summed across processes."""

    def __init__(self, columns: int, device=None):
        self.sq = torch.zeros(columns, device=device, dtype=torch.float32)

    def add_batch(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Add inputs ``x`` [batch, seq, cols]; ``mask`` [batch, seq] selects the tokens that count."""
        if mask is not None:
            x = x[mask.to(x.device, torch.bool)]
        self.sq += x.reshape(-1, x.shape[-1]).float().pow(2).sum(0)

    def value(self) -> torch.Tensor:
        """``‖X_j‖₂`` per input column over all processes' tokens."""
        sq = self.sq.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sq)
        return sq.sqrt()


def row_mask(score: torch.Tensor, sparsity: float) -> torch.Tensor:
    """True for the ``floor(sparsity·cols)`` lowest scores of every row."""
    check_sparsity(sparsity)
    k = int(score.shape[1] * sparsity)
    mask = torch.zeros_like(score, dtype=torch.bool)
    if k > 0:
        mask.scatter_(1, score.topk(k, dim=1, largest=False).indices, True)
    return mask


def nm_mask(score: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """True for the ``n`` lowest scores of every ``m`` consecutive columns of every row."""
    rows, cols = score.shape
    check_nm((n, m), cols)
    groups = score.reshape(rows, cols // m, m)
    mask = torch.zeros_like(groups, dtype=torch.bool)
    mask.scatter_(2, groups.topk(n, dim=2, largest=False).indices, True)
    return mask.reshape(rows, cols)


def wanda_mask(
    W: torch.Tensor, norms: torch.Tensor, sparsity: float | None = None, nm: tuple[int, int] | None = None
) -> torch.Tensor:
    """Mask (True = prune) of ``W`` [out, in] given input-column norms [in]."""
    score = W.abs().float() * norms.to(W.device).float().unsqueeze(0)
    return nm_mask(score, *nm) if nm is not None else row_mask(score, sparsity)
