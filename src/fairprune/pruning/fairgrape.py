"""FairGRAPE's per-layer weight selection: greedy group shares.

FairGRAPE scores every weight ``w`` of a layer once per demographic group ``k`` with
``I[k, w] = (g_{k,w} · w)²`` and then keeps the weights that preserve each group's share of
the layer's importance. For the candidate weights of one layer (weights already pruned are
not candidates and never return):

1. target shares ``t_k = S_k / Σ_j S_j`` with ``S_k = Σ_w I[k, w]``;
2. start with nothing kept and running sums ``s_k = 0``;
3. until ``quota`` weights are kept: ``share_k = s_k / Σ_j s_j`` (all 0 while that sum is 0),
   pick the group with the largest deficit ``argmin_k (share_k − t_k)`` (ties: lowest k),
   keep that group's most important weight not kept yet (ties: lowest weight index), and add
   the kept weight's importance ``I[:, w]`` to every ``s_j``.

Two implementations return the same mask, bit for bit, ties included:

- :func:`greedy_select_reference` is the plain Python loop, kept as the test oracle;
- :func:`greedy_select` sorts each group's candidates once (vectorised) and runs the pick loop
  compiled with numba.

Why a compiled per-pick loop rather than batching the picks between group switches: with
near-balanced groups the chosen group changes at almost every pick, so batches have length ~1
and batching saves nothing, while each pick costs only O(K) compiled operations. What remains
is memory-bound: the K sorts (see ``_pack_row``) and, per pick, one random read of the chosen
weight's K importances; on a 2.4 M-weight layer with 7 groups the two cost about the same.

Why both implementations agree exactly: a group switch can hinge on the last bit of a share,
so both do the same float64 operations in the same order. Sums are plain sequential sums in
index order (never pairwise like ``numpy.sum``, never compensated like Python >= 3.12's
``sum``), shares are ``s_k / total`` and deficits ``share_k - t_k``. numba does not enable
fast-math by default, so its float64 arithmetic is the same IEEE arithmetic as Python's.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numba
import numpy as np
import torch

from fairprune.errors import UserError

__all__ = [
    "layer_quota",
    "group_targets",
    "greedy_select_reference",
    "greedy_select",
    "select_layer_mask",
    "group_share_report",
]


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def _as_importance(importance: Any) -> np.ndarray:
    """Return ``importance`` as a C-contiguous float64 array of shape [K, N], validated.

    Accepts a torch tensor (any device) or anything ``numpy.asarray`` takes.
    """
    if isinstance(importance, torch.Tensor):
        importance = importance.detach().to("cpu", torch.float64).numpy()
    imp = np.ascontiguousarray(importance, dtype=np.float64)
    if imp.ndim != 2 or imp.shape[0] < 1:
        raise ValueError(
            f"importance must have shape [groups, weights] with at least one group, "
            f"got shape {tuple(imp.shape)}"
        )
    if imp.size:
        # min and max propagate NaN and need no temporary array, unlike isfinite(imp).all().
        low, high = imp.min(), imp.max()
        if not (np.isfinite(low) and np.isfinite(high)):
            raise ValueError("importance contains NaN or infinite values; check the gradients")
        if low < 0:
            raise ValueError("importance must be non-negative (it is a square, (g·w)²)")
    return imp


def _check_quota(quota: int, num_candidates: int) -> int:
    """Return ``quota`` as an int after checking 0 <= quota <= num_candidates."""
    if isinstance(quota, bool) or int(quota) != quota:
        raise ValueError(f"quota must be an integer, got {quota!r}")
    if not 0 <= quota <= num_candidates:
        raise ValueError(f"quota must be in [0, {num_candidates}] (the candidate count), got {quota}")
    return int(quota)


def layer_quota(num_candidates: int, keep_fraction: float) -> int:
    """Number of weights to keep: ``num_candidates · keep_fraction`` rounded half up.

    The product is taken in float64, so ``layer_quota(5, 0.9) == 5`` (4.5 rounds up) and
    ``layer_quota(1, 0.4) == 0`` (a tiny layer can be emptied by a small fraction).
    """
    if not 0.0 <= keep_fraction <= 1.0:
        raise UserError(f"keep_fraction must be in [0, 1], got {keep_fraction}; e.g. 0.9 keeps 90 %")
    if num_candidates < 0:
        raise ValueError(f"num_candidates must be >= 0, got {num_candidates}")
    return min(num_candidates, math.floor(num_candidates * keep_fraction + 0.5))


# --------------------------------------------------------------------------------------------
# Oracle: the plain loop
# --------------------------------------------------------------------------------------------


def _sequential_sum(values: list[float]) -> float:
    """Left-to-right float64 sum (Python >= 3.12's ``sum`` is compensated, so not used)."""
    acc = 0.0
    for v in values:
        acc += v
    return acc


def greedy_select_reference(importance: Any, quota: int) -> torch.Tensor:
    """Greedy group-share selection as a plain Python loop (the test oracle).

    Args:
        importance: [K, N] non-negative importance of N candidate weights for K groups.
        quota: number of weights to keep, in [0, N].

    Returns:
        torch.bool tensor [N] with exactly ``quota`` True.
    """
    imp = _as_importance(importance)
    num_groups, n = imp.shape
    quota = _check_quota(quota, n)
    rows = imp.tolist()

    group_sums = [_sequential_sum(row) for row in rows]
    total = _sequential_sum(group_sums)
    targets = [s / total for s in group_sums] if total != 0.0 else [1.0 / num_groups] * num_groups

    orders = [sorted(range(n), key=lambda w, row=row: (-row[w], w)) for row in rows]
    next_pos = [0] * num_groups
    kept = [False] * n
    sums = [0.0] * num_groups
    for _ in range(quota):
        kept_total = _sequential_sum(sums)
        shares = [s / kept_total if kept_total != 0.0 else 0.0 for s in sums]
        deficits = [shares[k] - targets[k] for k in range(num_groups)]
        group = min(range(num_groups), key=deficits.__getitem__)  # first minimum wins ties
        while kept[orders[group][next_pos[group]]]:
            next_pos[group] += 1
        weight = orders[group][next_pos[group]]
        kept[weight] = True
        for j in range(num_groups):
            sums[j] += rows[j][weight]
    return torch.tensor(kept, dtype=torch.bool)


# --------------------------------------------------------------------------------------------
# Fast twin
# --------------------------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True)
def _targets_kernel(imp):  # pragma: no cover - compiled
    """Targets with the oracle's arithmetic: sequential sums in index order."""
    num_groups, n = imp.shape
    group_sums = np.zeros(num_groups)
    for k in range(num_groups):
        acc = 0.0
        for w in range(n):
            acc += imp[k, w]
        group_sums[k] = acc
    total = 0.0
    for k in range(num_groups):
        total += group_sums[k]
    if total == 0.0:
        return np.full(num_groups, 1.0 / num_groups)
    return group_sums / total


def group_targets(importance: Any) -> torch.Tensor:
    """Each group's target share ``S_k / Σ_j S_j`` (uniform ``1/K`` when all importance is 0).

    Returns a float64 tensor [K] summing to 1 (up to rounding).
    """
    return torch.from_numpy(_targets_kernel(_as_importance(importance)))


# Each group's order: a sort of packed uint64 values.
#
# numpy.argsort(kind="stable") and torch.sort(stable=True) cost ~0.5-1 s of CPU per
# 2.4 M-weight row, while numpy sorts plain uint64 values with SIMD several times faster. So
# each weight becomes one uint64: the high bits of its order key above its index. Equal
# prefixes then sort by index, which is the tie rule; the rare runs whose keys differ only in
# the dropped low bits are re-sorted exactly afterwards. float32 importance widened to float64
# loses nothing to the truncation (its 24-bit mantissa fits), so only exact ties form runs.

_NEGATIVE_ZERO = np.uint64(1 << 63)
_PARALLEL_MIN_WEIGHTS = 1 << 16  # below this, starting threads costs more than it saves


@numba.njit(cache=True, nogil=True)
def _pack_row(row, index_bits):  # pragma: no cover - compiled
    """Pack each weight as (top ``64 - index_bits`` bits of its order key, then its index).

    The order key is the complement of the value's IEEE bits: for non-negative floats the
    bits grow with the value, so the complement sorts descending. -0.0 (the sign bit alone)
    is read as +0.0 so that the two tie.
    """
    bits = row.view(np.uint64)
    shift = np.uint64(index_bits)
    packed = np.empty(row.size, dtype=np.uint64)
    for w in range(row.size):
        value_bits = bits[w] if bits[w] != _NEGATIVE_ZERO else np.uint64(0)
        packed[w] = ((~value_bits >> shift) << shift) | np.uint64(w)
    return packed


def _fix_truncation_runs(row: np.ndarray, packed: np.ndarray, index_bits: int,
                         order: np.ndarray) -> None:
    """Re-sort, by full value, the runs of ``order`` whose packed keys share their high bits.

    Within such a run the indices ascend (they are the low bits of ``packed``); where the
    values differ, a sort by (run, value descending, index) restores the exact order.
    """
    prefix = packed >> np.uint64(index_bits)
    joined = prefix[1:] == prefix[:-1]  # position i and i + 1 are in one run
    if not joined.any():
        return
    in_run = np.zeros(order.size, dtype=bool)
    in_run[:-1] |= joined
    in_run[1:] |= joined
    positions = np.flatnonzero(in_run)
    indices = order[positions]
    values = row[indices]
    if not (joined[positions[:-1]] & (values[1:] != values[:-1])).any():
        return  # exact ties only: index order is already right
    starts_run = np.ones(positions.size, dtype=bool)
    starts_run[1:] = ~joined[positions[:-1]]
    run_id = np.cumsum(starts_run)
    order[positions] = indices[np.lexsort((indices, -values, run_id))]


def _sort_group(imp: np.ndarray, orders: np.ndarray, group: int) -> None:
    """Fill ``orders[group]``: candidates by importance descending, ties by lower index."""
    row = imp[group]
    index_bits = max(1, (row.size - 1).bit_length())
    packed = _pack_row(row, index_bits)
    packed.sort()
    np.bitwise_and(packed, np.uint64((1 << index_bits) - 1), out=orders[group].view(np.uint64))
    _fix_truncation_runs(row, packed, index_bits, orders[group])


def _descending_orders(imp: np.ndarray) -> np.ndarray:
    """[K, N] int64: every group's candidate order, groups sorted in parallel threads.

    numpy's sort and the compiled kernels release the GIL. The thread count follows
    ``torch.get_num_threads()`` so one setting governs the CPU use of training and pruning.
    """
    num_groups, n = imp.shape
    orders = np.empty((num_groups, n), dtype=np.int64)
    workers = min(num_groups, torch.get_num_threads()) if n >= _PARALLEL_MIN_WEIGHTS else 1
    if workers <= 1:
        for group in range(num_groups):
            _sort_group(imp, orders, group)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda group: _sort_group(imp, orders, group), range(num_groups)))
    return orders


@numba.njit(cache=True, nogil=True)
def _pick_kernel(imp_by_weight, orders, targets, quota):  # pragma: no cover - compiled
    """The pick loop of :func:`greedy_select_reference`, operation for operation.

    ``imp_by_weight`` is the importance transposed to [N, K] so that adding one weight's
    importance to all K running sums reads one cache line instead of K.
    """
    n, num_groups = imp_by_weight.shape
    kept = np.zeros(n, dtype=np.bool_)
    next_pos = np.zeros(num_groups, dtype=np.int64)
    sums = np.zeros(num_groups)
    for _ in range(quota):
        kept_total = 0.0
        for k in range(num_groups):
            kept_total += sums[k]
        # Same order of comparison as Python's min(): start at group 0, replace on strict <.
        group = 0
        best = (sums[0] / kept_total if kept_total != 0.0 else 0.0) - targets[0]
        for k in range(1, num_groups):
            deficit = (sums[k] / kept_total if kept_total != 0.0 else 0.0) - targets[k]
            if deficit < best:
                best = deficit
                group = k
        # A group's order covers all N weights and fewer than N are kept, so this stops.
        pos = next_pos[group]
        while kept[orders[group, pos]]:
            pos += 1
        weight = orders[group, pos]
        next_pos[group] = pos + 1
        kept[weight] = True
        for j in range(num_groups):
            sums[j] += imp_by_weight[weight, j]
    return kept


def greedy_select(importance: Any, quota: int) -> torch.Tensor:
    """Fast greedy group-share selection; the same mask as :func:`greedy_select_reference`.

    Args:
        importance: [K, N] non-negative importance (numpy or torch, any float dtype).
        quota: number of weights to keep, in [0, N].

    Returns:
        torch.bool tensor [N] with exactly ``quota`` True.

    Example:
        >>> imp = torch.tensor([[4.0, 3.0, 0.0, 1.0], [0.0, 1.0, 5.0, 2.0]])
        >>> greedy_select(imp, 2).tolist()
        [True, False, True, False]
    """
    imp = _as_importance(importance)
    quota = _check_quota(quota, imp.shape[1])
    if quota in (0, imp.shape[1]):  # nothing or everything: no choice to make
        return torch.full((imp.shape[1],), quota > 0, dtype=torch.bool)
    targets = _targets_kernel(imp)
    orders = _descending_orders(imp)
    kept = _pick_kernel(np.ascontiguousarray(imp.T), orders, targets, quota)
    return torch.from_numpy(kept)


# --------------------------------------------------------------------------------------------
# Layer-level entry points
# --------------------------------------------------------------------------------------------


def select_layer_mask(
    importance: torch.Tensor,
    current_mask: torch.Tensor,
    keep_fraction: float | None = None,
    *,
    quota: int | None = None,
    report: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, dict[str, Any]]:
    """One FairGRAPE step for one layer: the new keep-mask, a subset of ``current_mask``.

    Args:
        importance: [K, *weight_shape] importance of every weight for each of K groups.
        current_mask: [*weight_shape] bool, True where the weight is still alive (the
            candidates; a pruned weight is never revived).
        keep_fraction: fraction of the alive weights to keep (see :func:`layer_quota`).
        quota: instead of ``keep_fraction``, the number of weights to keep, in
            ``[0, alive]`` (the pruning callback's per-layer density target).
        report: also return :func:`group_share_report` of the step (targets over the alive
            weights, shares over the kept ones).

    Returns:
        bool tensor [*weight_shape] on ``current_mask``'s device; with ``report``, the pair
        ``(mask, report)``.
    """
    if (keep_fraction is None) == (quota is None):
        raise ValueError("give exactly one of keep_fraction or quota")
    importance = torch.as_tensor(importance)
    current_mask = torch.as_tensor(current_mask)
    if current_mask.dtype != torch.bool:
        raise ValueError(f"current_mask must be a bool tensor, got {current_mask.dtype}")
    if importance.dim() < 2 or importance.shape[1:] != current_mask.shape:
        raise ValueError(
            f"importance shape {tuple(importance.shape)} must be [groups, *weight_shape] with "
            f"weight_shape equal to the mask shape {tuple(current_mask.shape)}"
        )
    flat_mask = current_mask.detach().reshape(-1).cpu()
    candidates = flat_mask.nonzero().squeeze(1)
    if quota is None:
        quota = layer_quota(candidates.numel(), keep_fraction)
    flat_importance = importance.detach().reshape(importance.shape[0], -1).cpu()
    if candidates.numel() < flat_mask.numel():  # a dense layer needs no gathered copy
        flat_importance = flat_importance[:, candidates]
    chosen = greedy_select(flat_importance, quota)
    new_mask = torch.zeros_like(flat_mask)
    new_mask[candidates[chosen]] = True
    new_mask = new_mask.reshape(current_mask.shape).to(current_mask.device)
    if report:
        return new_mask, group_share_report(flat_importance, chosen)
    return new_mask


def group_share_report(
    importance: Any, mask: Any, candidates: Any | None = None
) -> dict[str, Any]:
    """Each group's share of the kept importance next to its target share.

    Args:
        importance: [K, *weight_shape] importance.
        mask: [*weight_shape] bool, the kept weights.
        candidates: [*weight_shape] bool, the weights the targets are taken over (the mask
            before the step); all weights when None. Pruned weights have importance 0 anyway.

    Returns:
        ``{"target": [K], "share": [K], "gap": [K] (share − target), "max_abs_gap": float,
        "kept": int, "candidates": int}``, plain Python numbers (JSON-ready). With nothing
        kept, or nothing important kept, shares are 0.
    """
    imp = torch.as_tensor(importance).detach().cpu().to(torch.float64)
    imp = imp.reshape(imp.shape[0], -1)
    keep = torch.as_tensor(mask).detach().cpu().reshape(-1).to(torch.bool)
    pool = (
        torch.ones_like(keep)
        if candidates is None
        else torch.as_tensor(candidates).detach().cpu().reshape(-1).to(torch.bool)
    )
    if keep.numel() != imp.shape[1] or pool.numel() != imp.shape[1]:
        raise ValueError(
            f"mask and candidates must have {imp.shape[1]} entries to match importance, "
            f"got {keep.numel()} and {pool.numel()}"
        )
    target = group_targets(imp[:, pool])
    kept_sums = imp[:, keep].sum(dim=1)
    total = kept_sums.sum()
    share = kept_sums / total if total > 0 else torch.zeros_like(kept_sums)
    gap = share - target
    return {
        "target": target.tolist(),
        "share": share.tolist(),
        "gap": gap.tolist(),
        "max_abs_gap": float(gap.abs().max()),
        "kept": int(keep.sum()),
        "candidates": int(pool.sum()),
    }
