"""SparseGPT: one-shot pruning of a linear layer with optimal-brain-surgeon error feedback.

Given calibration inputs ``X`` of a layer, the solver prunes ``W`` ([out, in]) column by column
and, after each column, spreads that column's pruning error over the columns not yet visited,
using the inverse Hessian of the layer-wise reconstruction loss ``‖WX − ŴX‖²``. It follows the
reference implementation (Frantar & Alistarh, 2023): columns in blocks of 128, the mask chosen
by ``w² / diag(Hinv)²`` (per block for unstructured sparsity, per M columns for N:M; the
choice itself is :func:`fairprune.pruning.select.top_k` / :func:`~fairprune.pruning.select.n_m`), error
feedback inside a block and one lazy update of the remaining columns after each block.

Two Hessians feed the same solver:

* :class:`Hessian` — ``H = 2/n Σ XXᵀ``, n the number of calibration sequences (running average).
* :class:`PairedHessian` — Debias-SparseGPT: ``H = 1/P Σ_pairs (X0X0ᵀ + X1X1ᵀ + 2ΔXΔXᵀ)`` with
  ``ΔX = X0 − X1`` the activation difference of two token-aligned sentences (stereotypical /
  anti-stereotypical). Every pair has the same weight. Optional unpaired text adds the plain
  SparseGPT Hessian ``2/N Σ XXᵀ`` (its own average, then summed): the paired term without its
  ΔX part is ≈ two sentences' second moment, so both sources carry comparable weight while the
  ``2ΔXΔXᵀ`` term makes directions in which the pair differs expensive to disturb.

A batch of pairs adds one product ``ZᵀZ`` of the stacked ``Z = [(X0+X1)/√2; √(5/2)·ΔX]`` (the
counted tokens of every pair of the batch): ``ZᵀZ = X0X0ᵀ + X1X1ᵀ + 2ΔXΔXᵀ`` summed over the
batch's pairs, since ``X0X0ᵀ + X1X1ᵀ = ½(X0+X1)(X0+X1)ᵀ + ½ΔXΔXᵀ``; two rows per pair position,
one per calibration token, the cost of SparseGPT's product over the same tokens.

Both keep the sum of the per-batch products (each computed in float32) in a
:class:`fairprune.distributed.ExactSum` and divide by the sample count in :meth:`value`. Under
``torch.distributed`` (torchrun: each rank calibrates on its share of the batches) the sums and
counts are added across processes there; as the sum does not depend on the order of its terms,
N ranks get one process's Hessian, so its masks and weights, bit for bit.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Sequence

import torch

from fairprune import distributed
from fairprune.errors import UserError
from fairprune.pruning.select import n_m, top_k
from fairprune.pruning.sparsity import Sparsity


def _tokens(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Flatten [batch, seq, cols] (or [seq, cols]) to [tokens, cols], keeping masked-in tokens."""
    if mask is not None:
        x = x[mask.to(x.device, torch.bool)]
    return x.reshape(-1, x.shape[-1]).float()


_SQRT_HALF, _SQRT_FIVE_HALVES = math.sqrt(0.5), math.sqrt(2.5)


def _batch_size(x: torch.Tensor) -> int:
    return x.shape[0] if x.dim() > 2 else 1


def _global_count(count: int) -> int:
    """The number of samples over every process (``count`` without a group)."""
    if distributed.world()[1] == 1:
        return count
    return int(distributed.all_reduce_sum(torch.tensor([float(count)], dtype=torch.float64)).item())


class Hessian:
    """``H = 2/n Σ XXᵀ`` over calibration sequences, fed by :meth:`add_batch`."""

    def __init__(self, columns: int, device=None, dtype=torch.float32):
        self.dtype, self.device = dtype, device
        self.sum = distributed.ExactSum((columns, columns), device)  # Σ XXᵀ, one term per batch
        self.count = 0

    def add_batch(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Add inputs ``x`` [batch, seq, cols]; ``mask`` [batch, seq] selects the tokens that count."""
        rows = _tokens(x, mask).to(self.dtype)
        self.count += _batch_size(x)
        self.sum.add(rows.T @ rows)

    def value(self) -> torch.Tensor:
        """The Hessian over every process of a distributed run (zeros before any sample)."""
        n = _global_count(self.count)
        H = self.sum.total(self.dtype, times=2, over=max(n, 1))  # 2·Σ/n in float64, made as float32 a slice at a time
        return H.to(self.device or H.device)


class PairedHessian:
    """Debias-SparseGPT Hessian: paired term plus an optional plain term (see module docstring)."""

    def __init__(self, columns: int, device=None, dtype=torch.float32):
        self.dtype, self.device = dtype, device
        self.sum = distributed.ExactSum((columns, columns), device)  # Σ X0X0ᵀ + X1X1ᵀ + 2ΔXΔXᵀ, one term per batch
        self.pairs = 0
        self.plain = Hessian(columns, device, dtype)

    def add_pair(self, x0: torch.Tensor, x1: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Add a batch of pairs: the inputs of two token-aligned batches (same shape [pairs, seq,
        cols]: side 0 and side 1 of each pair); ``mask`` [pairs, seq] selects the tokens that count.
        One product of the stacked ``[(X0+X1)/√2; √(5/2)·ΔX]``, one exact-sum term, whatever the pair count."""
        if x0.shape != x1.shape:
            raise UserError(
                f"paired inputs must align token-wise, got shapes {tuple(x0.shape)} and {tuple(x1.shape)}; "
                "pad or truncate both sides of every pair to the same length"
            )
        a, c = _tokens(x0, mask).to(self.dtype), _tokens(x1, mask).to(self.dtype)
        tokens = len(a)
        # X0X0ᵀ + X1X1ᵀ + 2ΔXΔXᵀ = ½(X0+X1)(X0+X1)ᵀ + (5/2)ΔXΔXᵀ: two rows per pair token instead of
        # three, one calibration row per token as in SparseGPT (the same Hessian to rounding).
        stacked = torch.empty(2 * tokens, a.shape[1], dtype=self.dtype, device=a.device)
        torch.add(a, c, out=stacked[:tokens]).mul_(_SQRT_HALF)
        torch.sub(a, c, out=stacked[tokens:]).mul_(_SQRT_FIVE_HALVES)
        del a, c
        self.pairs += _batch_size(x0)  # every pair gets weight 1/P
        self.sum.add(stacked.T @ stacked)

    def add_batch(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Add unpaired inputs (plain SparseGPT term)."""
        self.plain.add_batch(x, mask)

    def value(self) -> torch.Tensor:
        """Paired term plus plain term, each averaged over every process."""
        pairs, plain = _global_count(self.pairs), _global_count(self.plain.count)
        H = self.sum.total().div_(max(pairs, 1))  # in place: each total is a new tensor
        if plain:
            H.add_(self.plain.sum.total().mul_(2).div_(plain))
        return H.to(self.dtype).to(self.device or H.device)


def inverse_hessian_cholesky(H: torch.Tensor, percdamp: float = 0.01, retries: int = 4) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + λI)⁻¹`` with ``λ = percdamp·mean(diag H)``.

    If a factorisation fails, retry with ten times more damping (warning each time); after
    ``retries`` attempts raise :class:`UserError` rather than fall back to an identity.
    """
    mean_diag = H.diagonal().mean()
    for attempt in range(retries + 1):
        damped = H.clone()
        damped.diagonal().add_(percdamp * mean_diag)
        L, info = torch.linalg.cholesky_ex(damped)
        del damped  # each n² buffer is dropped once the next is made: two live at a time, not four
        if info.item() == 0:
            inverse = torch.cholesky_inverse(L)
            del L
            U, info = torch.linalg.cholesky_ex(inverse, upper=True)
            del inverse
            if info.item() == 0 and torch.isfinite(U).all():
                return U
        if attempt < retries:
            percdamp = percdamp * 10 if percdamp > 0 else 0.01
            warnings.warn(f"SparseGPT: Hessian not positive definite; retrying with percdamp={percdamp:g}", stacklevel=2)
    raise UserError(
        f"SparseGPT: Hessian is not positive definite even with percdamp={percdamp:g}; "
        "use more calibration samples or a larger percdamp"
    )


def sparsegpt_solve(
    W: torch.Tensor,
    H: torch.Tensor,
    sparsity: Sparsity,
    blocksize: int = 128,
    percdamp: float = 0.01,
    segments: Sequence[int] | None = None,
) -> torch.Tensor:
    """Prune ``W`` [out, in] against Hessian ``H`` [in, in]; return the updated copy in H's dtype.

    ``sparsity``: a fraction (unstructured; exactly ``floor(fraction·out·in)`` weights are
    removed) or N:M (N of every M consecutive input columns per output row), see
    :class:`~fairprune.pruning.sparsity.Sparsity`. Zeros of the result are the mask.

    ``segments``: ``W`` is several layers that read the same input (so share ``H``) stacked by
    rows, of these row counts; each keeps its own unstructured quota, chosen among its own
    weights. A row's solve reads only that row and ``H``, so the result is each layer's own solve,
    bit for bit, with one inverse Hessian and one pass over the columns for all of them.
    """
    rows, cols = W.shape
    bounds = list(itertools.accumulate(segments or [rows], initial=0))
    if bounds[-1] != rows:
        raise ValueError(f"segments {list(segments or [])} do not add up to the {rows} rows of W")
    nm = sparsity.nm
    if nm is not None:
        n, m = nm
        if cols % m:
            raise ValueError(f"N:M {n}:{m}: M does not divide the layer width {cols} (checked per model by check_pattern_fits)")
        blocksize = max(m, blocksize // m * m)  # an N:M group never straddles two blocks
    fraction = sparsity.fraction
    W = W.to(H.dtype, copy=True)
    H = H.clone()
    dead = H.diagonal() == 0  # inputs that are always zero: weight is irrelevant, prune it
    H[dead, dead] = 1
    W[:, dead] = 0
    Hinv = inverse_hessian_cholesky(H, percdamp)

    # Column by column, as the paper's algorithm goes, on W's transpose: a column is then one
    # contiguous row, so each step's few element-wise operations run on contiguous memory (the
    # same operations on the same values as on W itself: the same bits, about 1.5x faster).
    WT = W.t().contiguous()
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1, Hinv1 = WT[i1:i2].clone(), Hinv[i1:i2, i1:i2]
        d = Hinv1.diagonal()
        Err1 = torch.zeros_like(W1)
        # mask1: True = prune (the complement of the keep masks from fairprune.pruning.select).
        if nm is None:
            mask1 = torch.empty_like(W1, dtype=torch.bool)
            for r0, r1 in zip(bounds, bounds[1:]):  # per layer: cumulative floor, exact whatever the block widths
                k = math.floor(fraction * (r1 - r0) * i2) - math.floor(fraction * (r1 - r0) * i1)
                part = W1[:, r0:r1]
                mask1[:, r0:r1] = ~top_k((part**2 / d[:, None] ** 2).t(), part.numel() - k).t()
        else:
            mask1 = torch.zeros_like(W1, dtype=torch.bool)
        for i in range(i2 - i1):
            if nm is not None and i % m == 0:
                mask1[i : i + m] = ~n_m((W1[i : i + m] ** 2 / d[i : i + m, None] ** 2).t(), n, m).t()
            w, err = W1[i], Err1[i]
            torch.div(w.masked_fill(~mask1[i], 0), d[i], out=err)  # (w - q) / d, q the kept part of w
            W1[i:].sub_(Hinv1[i, i:, None] * err[None, :])
            w.masked_fill_(mask1[i], 0)  # exact zeros (the update leaves rounding residue)
        WT[i1:i2] = W1
        for r0, r1 in zip(bounds, bounds[1:]):  # lazy update of the columns after this block, per layer:
            WT[i2:, r0:r1] -= Hinv[i1:i2, i2:].t() @ Err1[:, r0:r1]  # a product's rounding follows its shape
    return WT.t().contiguous()
