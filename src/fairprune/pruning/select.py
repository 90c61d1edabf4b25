"""The one selection core: which scored weights survive, as a boolean mask where True = KEEP.

Every pruning method scores its weights (higher = more worth keeping) and asks this module
which to keep: the vision callback (per layer and global), Diff-Pruning's magnitude pruning of
``δ``, magnitude / Wanda / SparseGPT masks of LMs, and FASP's head baselines.

The tie rule, for every function here: entries are ranked with a *stable* sort, so among equal
scores the lower flat index ranks first (row-major; within a row for the per-row functions).

- :func:`top_k`, :func:`top_k_per_row` and :func:`n_m` rank descending and keep the first
  entries: at the cut, of two equal scores the lower index is kept and the higher one pruned.
- :func:`lowest_k` ranks ascending and selects the first entries (the heads to remove): at the
  cut, of two equal values the lower index is selected.
- Entries outside ``candidates`` (already pruned) are never kept, whatever their score: a
  pruned weight is never revived. ``k`` larger than the number of candidates keeps them all.

Scores are compared exactly as given (float16 / bfloat16 are widened to float32, which changes
no order); NaN scores are not supported. The functions compute the same masks as a full stable
sort but find the cut with a selection (``kthvalue``) and break the ties at the cut by a running
count, so large layers need no full sort.

N:M sparsity keeps the meaning it has everywhere in fairprune: ``n_m(scores, 2, 4)`` prunes the
2 lowest of every 4 consecutive weights along the last (input) dimension and keeps the other 2.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import overload

import torch

__all__ = ["top_k", "top_k_per_row", "n_m", "lowest_k", "magnitude"]

Masks = dict[str, torch.Tensor]


def magnitude(weight: torch.Tensor) -> torch.Tensor:
    """The magnitude score ``|w|`` (detached): vision WS / lottery and LM magnitude pruning."""
    return weight.detach().abs()


def _sortable(scores: torch.Tensor) -> torch.Tensor:
    """``scores`` detached, half precision widened to float32 (exact, order-preserving)."""
    scores = scores.detach()
    if scores.dtype in (torch.float16, torch.bfloat16, torch.bool):
        scores = scores.float()
    return scores


def _check_k(k: int, limit: int, what: str = "k") -> int:
    if isinstance(k, bool) or int(k) != k:
        raise ValueError(f"{what} must be an integer, got {k!r}")
    if not 0 <= k <= limit:
        raise ValueError(f"{what} must be in [0, {limit}], got {k}")
    return int(k)


def _first_k_rows(values: torch.Tensor, k: int) -> torch.Tensor:
    """Keep mask of the ``k`` largest entries of every row of a 2-D tensor (0 < k < columns).

    The k-th largest value of a row is its cut: everything above it is kept, and of the entries
    equal to it the first ``k − above`` in index order (what a stable descending sort keeps).
    """
    cut = torch.kthvalue(values, values.shape[1] - k + 1, dim=1, keepdim=True).values
    keep = values > cut
    ties = values == cut
    need = k - keep.sum(dim=1, keepdim=True, dtype=torch.int32)
    return keep | (ties & (ties.cumsum(dim=1, dtype=torch.int32) <= need))


def _top_k_flat(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Keep mask of the ``k`` largest entries of a 1-D tensor (0 <= k <= numel)."""
    if k == 0:
        return torch.zeros(flat.shape, dtype=torch.bool, device=flat.device)
    if k == flat.numel():
        return torch.ones(flat.shape, dtype=torch.bool, device=flat.device)
    cut = torch.kthvalue(flat, flat.numel() - k + 1).values
    keep = flat > cut
    # The ties at the cut are few: index them rather than count through the whole tensor.
    ties = (flat == cut).nonzero().squeeze(1)
    keep[ties[: k - int(keep.sum())]] = True
    return keep


@overload
def top_k(scores: torch.Tensor, k: int, candidates: torch.Tensor | None = None) -> torch.Tensor: ...
@overload
def top_k(scores: Mapping[str, torch.Tensor], k: int, candidates: Mapping[str, torch.Tensor] | None = None) -> Masks: ...


def top_k(scores, k, candidates=None):
    """Keep the ``k`` highest-scoring candidates, globally.

    Args:
        scores: a tensor of any shape, or ``{name: tensor}`` ranked as one flat concatenation
            (in the mapping's order; the tensors must share a device).
        k: how many to keep, in ``[0, scores.numel()]``; at most the candidates are kept.
        candidates: bool, True where an entry may be kept (the current mask); shaped like
            ``scores`` (a mapping with the same keys for mapping scores); None: all entries.

    Returns:
        The keep mask, bool, shaped like ``scores`` (a mapping of masks for mapping scores).

    Example:
        >>> top_k(torch.tensor([1.0, 3.0, 3.0, 2.0]), 2).tolist()
        [False, True, True, False]
        >>> top_k(torch.tensor([1.0, 3.0, 3.0, 2.0]), 1).tolist()  # tie: lower index kept
        [False, True, False, False]
    """
    if isinstance(scores, Mapping):
        names = list(scores)
        if candidates is not None and set(candidates) != set(names):
            raise ValueError("candidates must have the same keys as scores")
        flat = torch.cat([_sortable(scores[n]).reshape(-1) for n in names]) if names else torch.zeros(0)
        cands = None
        if candidates is not None and names:
            cands = torch.cat([candidates[n].reshape(-1).to(flat.device, torch.bool) for n in names])
        chunks = torch.split(top_k(flat, k, cands), [scores[n].numel() for n in names])
        return {n: chunk.view(scores[n].shape) for n, chunk in zip(names, chunks)}

    flat = _sortable(scores).reshape(-1)
    k = _check_k(k, flat.numel())
    if candidates is None:
        return _top_k_flat(flat, k).view(scores.shape)
    if candidates.shape != scores.shape:
        raise ValueError(f"candidates shape {tuple(candidates.shape)} must match scores {tuple(scores.shape)}")
    cands = candidates.reshape(-1).to(flat.device, torch.bool)
    index = cands.nonzero().squeeze(1)
    keep = torch.zeros_like(cands)
    keep[index] = _top_k_flat(flat[index], min(k, index.numel()))
    return keep.view(scores.shape)


def top_k_per_row(scores: torch.Tensor, k: int | None = None, *, fraction: float | None = None) -> torch.Tensor:
    """Keep the ``k`` highest scores of every row of a 2-D tensor ([out, in]: per output row).

    Give ``k`` (entries kept per row) or ``fraction`` (kept share of a row; ``k`` is
    ``floor(fraction · columns)``).

    Example:
        >>> top_k_per_row(torch.tensor([[1.0, 4.0, 2.0], [5.0, 5.0, 0.0]]), 1).tolist()
        [[False, True, False], [True, False, False]]
    """
    if scores.dim() != 2:
        raise ValueError(f"top_k_per_row needs a 2-D score tensor [rows, columns], got shape {tuple(scores.shape)}")
    cols = scores.shape[1]
    if (k is None) == (fraction is None):
        raise ValueError("give exactly one of k or fraction")
    if fraction is not None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        k = int(cols * fraction)
    k = _check_k(k, cols)
    values = _sortable(scores)
    if k == 0 or k == cols or values.shape[0] == 0:
        return torch.full(values.shape, k > 0, dtype=torch.bool, device=values.device)
    return _first_k_rows(values, k)


def n_m(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """N:M keep mask: of every ``m`` consecutive entries along the last dimension, prune the ``n``
    lowest and keep the other ``m − n``. The last dimension must be a multiple of ``m``.

    Example:
        >>> n_m(torch.tensor([[4.0, 1.0, 3.0, 2.0]]), 2, 4).tolist()
        [[True, False, True, False]]
    """
    if not 0 <= n <= m or m < 1:
        raise ValueError(f"N:M needs 0 <= N <= M and M >= 1, got {n}:{m}")
    if scores.dim() < 1 or scores.shape[-1] % m:
        raise ValueError(f"N:M {n}:{m}: the last dimension of shape {tuple(scores.shape)} must be a multiple of {m}")
    return top_k_per_row(scores.reshape(-1, m), m - n).view(scores.shape)


def lowest_k(values: torch.Tensor, k: int) -> torch.Tensor:
    """Flat indices (ascending) of the ``k`` lowest entries of ``values``: a selection to
    *remove*, e.g. attention heads from a ``[layers, heads]`` score. Ties: lower index first.

    Example:
        >>> lowest_k(torch.tensor([[2.0, 1.0], [1.0, 0.5]]), 2).tolist()
        [1, 3]
    """
    flat = _sortable(values).reshape(-1)
    k = _check_k(k, flat.numel())
    # Keeping the k highest of −values would break ties the other way: rank ascending instead.
    order = torch.sort(flat, stable=True).indices[:k]
    return order.sort().values
