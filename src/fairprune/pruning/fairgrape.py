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
- :func:`greedy_select` orders each group's candidates once with a radix sort and runs the pick
  loop compiled with numba (:mod:`fairprune.pruning.fairgrape_kernels`);
- :func:`select_layer_masks` runs a whole model's layers, several at a time in threads.

Why a compiled per-pick loop rather than batching the picks between group switches: with
near-balanced groups the chosen group changes at almost every pick, so batches have length ~1
and batching saves nothing, while each pick costs only O(K) compiled operations. What remains
is memory: the K sorts and, per pick, one random read of the chosen weight's K importances,
which the pick loop prefetches one turn ahead (see :func:`~fairprune.pruning.fairgrape_kernels.pick`).

Why both implementations agree exactly: a group switch can hinge on the last bit of a share,
so both do the same float64 operations in the same order. Sums are plain sequential sums in
index order (never pairwise like ``numpy.sum``, never compensated like Python >= 3.12's
``sum``), shares are ``s_k / total`` and deficits ``share_k - t_k``. numba does not enable
fast-math by default, so its float64 arithmetic is the same IEEE arithmetic as Python's.
float32 importance (what :func:`~fairprune.pruning.importance.group_scores` returns) is read
as float32 and widened on use: widening is exact, so it gives the mask of the same values in
float64, with half the memory traffic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from fairprune.errors import UserError
from fairprune.pruning import fairgrape_kernels as kernels

__all__ = [
    "layer_quota",
    "group_targets",
    "greedy_select_reference",
    "greedy_select",
    "select_layer_mask",
    "select_layer_masks",
    "group_share_report",
]


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def _as_importance(importance: Any) -> np.ndarray:
    """Return ``importance`` as a C-contiguous float32 or float64 array of shape [K, N], validated.

    Accepts a torch tensor (any device) or anything ``numpy.asarray`` takes. float32 and float64
    keep their type (a contiguous CPU float32 tensor is not even copied); any other type becomes
    float64, which holds every float16, bfloat16 and float32 value exactly.
    """
    if isinstance(importance, torch.Tensor):
        importance = importance.detach().cpu()
        if importance.dtype not in (torch.float32, torch.float64):
            importance = importance.to(torch.float64)
        importance = importance.numpy()
    imp = np.asarray(importance)
    imp = np.ascontiguousarray(imp, dtype=imp.dtype if imp.dtype in (np.float32, np.float64) else np.float64)
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


def group_targets(importance: Any) -> torch.Tensor:
    """Each group's target share ``S_k / Σ_j S_j`` (uniform ``1/K`` when all importance is 0).

    Returns a float64 tensor [K] summing to 1 (up to rounding).
    """
    return torch.from_numpy(kernels.targets(_as_importance(importance)))


_PARALLEL_MIN_WEIGHTS = 1 << 16  # below this, starting threads costs more than it saves


def _threads() -> int:
    """Worker threads: ``torch.get_num_threads()``, so one setting governs the CPU use of
    training and pruning alike."""
    return max(1, torch.get_num_threads())


def _descending_orders(imp: np.ndarray, workers: int | None = None) -> np.ndarray:
    """[K, N] every group's candidates by importance descending, ties by lower index.

    int32 indices (int64 from 2**31 weights on). The groups are sorted in ``workers`` threads
    (default :func:`_threads`); the compiled sort releases the GIL.
    """
    num_groups, n = imp.shape
    orders = np.empty((num_groups, n), dtype=np.int32 if n < 2**31 else np.int64)
    bits = imp.view(np.uint32 if imp.dtype == np.float32 else np.uint64)
    if workers is None:
        workers = _threads() if n >= _PARALLEL_MIN_WEIGHTS else 1
    workers = min(workers, num_groups)
    if workers <= 1:
        for group in range(num_groups):
            kernels.descending_order(bits[group], orders[group])
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda group: kernels.descending_order(bits[group], orders[group]), range(num_groups)))
    return orders


def _by_weight(imp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([N, P] the importance transposed, the targets). P = K rounded up to a power of two and
    rows aligned to 64 bytes: one weight's K importances (up to 64 bytes) lie in one cache line."""
    num_groups, n = imp.shape
    width = 1 << (num_groups - 1).bit_length()
    slack = 64 // imp.itemsize
    buffer = np.empty(n * width + slack, dtype=imp.dtype)
    offset = (-buffer.ctypes.data % 64) // imp.itemsize
    out = buffer[offset: offset + n * width].reshape(n, width)
    return out, kernels.transpose_targets(imp, out)


def _select(imp: np.ndarray, quota: int, workers: int | None = None) -> tuple[np.ndarray, ...]:
    """(kept bool [N], targets [K], kept importance per group [K]) of validated importance and
    quota; both [K] float64, summed in index order."""
    n = imp.shape[1]
    if quota in (0, n):  # nothing or everything: no choice to make
        kept = np.full(n, quota > 0)
        return kept, kernels.targets(imp), kernels.kept_sums(imp, kept)
    orders = _descending_orders(imp, workers)
    by_weight, targets = _by_weight(imp)
    kept, kept_importance = kernels.pick(by_weight, orders, targets, quota)
    return kept, targets, kept_importance


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
    return torch.from_numpy(_select(imp, quota)[0])


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
    workers: int | None = None,
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
        workers: threads sorting the groups (default ``torch.get_num_threads()``).

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
    imp = _as_importance(flat_importance)
    chosen, targets, kept_importance = _select(imp, _check_quota(quota, imp.shape[1]), workers)
    if candidates.numel() < flat_mask.numel():
        new_mask = torch.zeros_like(flat_mask)
        new_mask[candidates[torch.from_numpy(chosen)]] = True
    else:
        new_mask = torch.from_numpy(chosen)
    new_mask = new_mask.reshape(current_mask.shape).to(current_mask.device)
    if report:
        return new_mask, _share_report(targets, kept_importance, int(quota), imp.shape[1])
    return new_mask


def select_layer_masks(
    importances: Sequence[torch.Tensor],
    current_masks: Sequence[torch.Tensor],
    quotas: Sequence[int],
    *,
    report: bool = False,
) -> list[torch.Tensor] | list[tuple[torch.Tensor, dict[str, Any]]]:
    """:func:`select_layer_mask` with ``quota`` for many layers, the same masks and reports.

    The layers run in ``torch.get_num_threads()`` threads, largest first (the compiled kernels
    release the GIL); each layer's groups are then sorted in that layer's thread.

    Returns:
        One entry per layer, in the given order: the mask, or ``(mask, report)`` with ``report``.
    """
    if not len(importances) == len(current_masks) == len(quotas):
        raise ValueError(f"got {len(importances)} importances, {len(current_masks)} masks and "
                         f"{len(quotas)} quotas; give one of each per layer")
    workers = min(_threads(), len(importances))

    def step(i: int, threads: int | None):
        return select_layer_mask(importances[i], current_masks[i], quota=quotas[i], report=report, workers=threads)

    if workers <= 1:
        return [step(i, None) for i in range(len(importances))]
    largest_first = sorted(range(len(importances)), key=lambda i: -current_masks[i].numel())
    with ThreadPoolExecutor(workers) as pool:
        done = dict(zip(largest_first, pool.map(lambda i: step(i, 1), largest_first)))
    return [done[i] for i in range(len(importances))]


def _share_report(targets: np.ndarray, kept_sums: np.ndarray, kept: int, candidates: int) -> dict[str, Any]:
    """The report of :func:`group_share_report` from the targets and the kept sums."""
    total = _sequential_sum(kept_sums.tolist())
    share = kept_sums / total if total > 0 else np.zeros_like(kept_sums)
    gap = share - targets
    return {
        "target": targets.tolist(),
        "share": share.tolist(),
        "gap": gap.tolist(),
        "max_abs_gap": float(np.abs(gap).max()),
        "kept": kept,
        "candidates": candidates,
    }


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
    imp = torch.as_tensor(importance).detach()
    imp = _as_importance(imp.reshape(imp.shape[0], -1))
    keep = torch.as_tensor(mask).detach().cpu().reshape(-1).to(torch.bool).numpy()
    pool = (
        np.ones_like(keep)
        if candidates is None
        else torch.as_tensor(candidates).detach().cpu().reshape(-1).to(torch.bool).numpy()
    )
    if keep.size != imp.shape[1] or pool.size != imp.shape[1]:
        raise ValueError(
            f"mask and candidates must have {imp.shape[1]} entries to match importance, "
            f"got {keep.size} and {pool.size}"
        )
    targets = kernels.targets(imp if pool.all() else np.ascontiguousarray(imp[:, pool]))
    return _share_report(targets, kernels.kept_sums(imp, keep), int(keep.sum()), int(pool.sum()))
