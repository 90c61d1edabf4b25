"""Compiled kernels behind :func:`fairprune.pruning.fairgrape.greedy_select`.

Every kernel is ``nogil``, so layers (or one layer's groups) run in parallel Python threads,
and single-threaded, so those threads are the only parallelism and nothing is oversubscribed.

Exactness: the kernels read float32 or float64 importance and do all arithmetic in float64.
Widening float32 to float64 is exact, so a float32 input gives the same sums, shares and order
as the same values converted to float64 first (which is what the plain-loop oracle does). Sums
are sequential in index order, and numba does not enable fast-math, so the float64 operations
are the oracle's, operation for operation.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

# --------------------------------------------------------------------------------------------
# Prefetch
# --------------------------------------------------------------------------------------------

_BYTE_POINTER = ir.IntType(8).as_pointer()
# llvmlite builds typed pointers (i8*) up to LLVM 14 and opaque ones (ptr) from LLVM 15 on; the
# intrinsic's name carries the pointer type.
_PREFETCH = "llvm.prefetch.p0" if getattr(_BYTE_POINTER, "is_opaque", False) else "llvm.prefetch.p0i8"


@intrinsic
def _prefetch(typingctx, array, index):  # pragma: no cover - compiled
    """Hint the CPU to fetch ``array.flat[index]``'s cache line (read, keep in all levels).

    A hint: nothing is read and no fault is possible, so it never changes a result.
    """
    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        arr = context.make_array(array_type)(context, builder, args[0])
        pointer = cgutils.get_item_pointer(context, builder, array_type, arr, [args[1]], wraparound=False)
        i32 = ir.IntType(32)
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_BYTE_POINTER, i32, i32, i32]), _PREFETCH)
        builder.call(function, [builder.bitcast(pointer, _BYTE_POINTER), ir.Constant(i32, 0),
                                ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(array, index), codegen


# --------------------------------------------------------------------------------------------
# Sums
# --------------------------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True)
def targets(imp):  # pragma: no cover - compiled
    """Target shares ``S_k / Σ S`` of [K, N] importance (uniform when all of it is 0)."""
    num_groups, n = imp.shape
    group_sums = np.zeros(num_groups)
    for k in range(num_groups):
        acc = 0.0
        for w in range(n):
            acc += imp[k, w]
        group_sums[k] = acc
    return _shares(group_sums)


@numba.njit(cache=True, nogil=True)
def _shares(group_sums):  # pragma: no cover - compiled
    """``group_sums / Σ group_sums`` (sequential total), uniform when the total is 0."""
    num_groups = group_sums.size
    total = 0.0
    for k in range(num_groups):
        total += group_sums[k]
    if total == 0.0:
        return np.full(num_groups, 1.0 / num_groups)
    return group_sums / total


@numba.njit(cache=True, nogil=True)
def kept_sums(imp, keep):  # pragma: no cover - compiled
    """Each group's importance summed over the kept weights, in index order."""
    num_groups, n = imp.shape
    sums = np.zeros(num_groups)
    for k in range(num_groups):
        acc = 0.0
        for w in range(n):
            if keep[w]:
                acc += imp[k, w]
        sums[k] = acc
    return sums


# --------------------------------------------------------------------------------------------
# One group's order: importance descending, ties by lower index
# --------------------------------------------------------------------------------------------

_TOP_BITS = 11  # the first (most significant) radix digit
_SMALL_BUCKET = 32  # buckets up to this size are insertion-sorted


@numba.njit(cache=True, nogil=True)
def descending_order(bits, order):  # pragma: no cover - compiled
    """Fill ``order`` with the indices of ``bits`` by importance descending, ties by index.

    ``bits`` is the importance row viewed as unsigned integers of its width (uint32 for
    float32, uint64 for float64). For non-negative floats the IEEE bits grow with the value,
    so the complement ``~bits`` is an ascending key for descending importance; -0.0 (the sign
    bit alone) is read as +0.0 so that the two tie. A stable sort of the keys keeps equal keys
    in index order, which is the tie rule.

    The sort is a radix sort: one stable scatter by the key's top ``_TOP_BITS`` bits into
    buckets (the only pass over the whole row), then each bucket sorted by the remaining bits
    with stable least-significant-digit passes, in cache; digits that every key of a bucket
    shares are skipped.
    """
    n = bits.size
    width = bits.itemsize * 8
    rest = width - _TOP_BITS  # bits below the top digit
    passes = (rest + _TOP_BITS - 1) // _TOP_BITS
    # Constants in the key's own unsigned type: numba widens a mix of uint64 and int64 to
    # float64, so every shift and mask below stays unsigned.
    const = np.empty(3 + 2 * passes, dtype=bits.dtype)
    const[0] = 0
    const[1] = 1
    const[1] <<= width - 1  # the sign bit alone: -0.0
    const[2] = rest
    for p in range(passes):
        const[3 + p] = p * _TOP_BITS
        const[3 + passes + p] = (1 << min(_TOP_BITS, rest - p * _TOP_BITS)) - 1
    zero, sign_only, top_shift = const[0], const[1], const[2]
    starts = np.zeros((1 << _TOP_BITS) + 1, dtype=np.int64)
    for w in range(n):
        b = bits[w]
        starts[np.int64(~(b if b != sign_only else zero) >> top_shift) + 1] += 1
    for d in range(1 << _TOP_BITS):
        starts[d + 1] += starts[d]
    fill = starts[:-1].copy()
    keys = np.empty(n, dtype=bits.dtype)
    for w in range(n):
        b = bits[w]
        key = ~(b if b != sign_only else zero)
        d = np.int64(key >> top_shift)
        p = fill[d]
        fill[d] = p + 1
        keys[p] = key
        order[p] = w
    largest = 0
    for d in range(1 << _TOP_BITS):
        largest = max(largest, starts[d + 1] - starts[d])
    spare_keys = np.empty(largest, dtype=bits.dtype)
    spare_order = np.empty(largest, dtype=order.dtype)
    counts = np.empty(1 << _TOP_BITS, dtype=np.int64)
    for d in range(1 << _TOP_BITS):
        a, b = starts[d], starts[d + 1]
        if b - a <= _SMALL_BUCKET:
            _insertion_sort(keys, order, a, b)
        else:
            _sort_bucket(keys[a:b], order[a:b], spare_keys[: b - a], spare_order[: b - a], counts, const, passes)


@numba.njit(cache=True, nogil=True)
def _insertion_sort(keys, order, a, b):  # pragma: no cover - compiled
    """Stable sort of ``keys[a:b]`` (and ``order`` alike): moves only past strictly larger keys."""
    for i in range(a + 1, b):
        key, index, j = keys[i], order[i], i - 1
        while j >= a and keys[j] > key:
            keys[j + 1] = keys[j]
            order[j + 1] = order[j]
            j -= 1
        keys[j + 1] = key
        order[j + 1] = index


@numba.njit(cache=True, nogil=True)
def _sort_bucket(keys, order, spare_keys, spare_order, counts, const, passes):  # pragma: no cover
    """Stable LSD radix sort of one bucket by the digits below its top one, in place.

    Each pass moves the pairs between the bucket and the spare arrays; a digit that every key
    shares is skipped; the result is copied back if it ends in the spare arrays.
    """
    m = keys.size
    src_keys, src_order, dst_keys, dst_order = keys, order, spare_keys, spare_order
    in_spare = False
    for p in range(passes):
        shift, mask = const[3 + p], const[3 + passes + p]
        size = np.int64(mask) + 1
        counts[:size] = 0
        for i in range(m):
            counts[np.int64((src_keys[i] >> shift) & mask)] += 1
        if counts[np.int64((src_keys[0] >> shift) & mask)] == m:
            continue  # every key of the bucket shares this digit
        acc = 0
        for q in range(size):
            c = counts[q]
            counts[q] = acc
            acc += c
        for i in range(m):
            q = np.int64((src_keys[i] >> shift) & mask)
            r = counts[q]
            counts[q] = r + 1
            dst_keys[r] = src_keys[i]
            dst_order[r] = src_order[i]
        src_keys, src_order, dst_keys, dst_order = dst_keys, dst_order, src_keys, src_order
        in_spare = not in_spare
    if in_spare:
        keys[:] = src_keys
        order[:] = src_order


# --------------------------------------------------------------------------------------------
# The pick loop
# --------------------------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True)
def pick(by_weight, orders, targets, quota):  # pragma: no cover - compiled
    """The pick loop of :func:`~fairprune.pruning.fairgrape.greedy_select_reference`.

    Args:
        by_weight: [N, P] importance transposed (P >= K, padding ignored), so that one weight's
            K importances share a cache line.
        orders: [K, N] each group's candidates, importance descending, ties by lower index.
        targets: [K] float64 target shares.
        quota: picks to make, < N.

    Returns (bool [N] the kept weights, float64 [K] their importance summed per group in index
    order, as :func:`kept_sums` sums it).

    The group choice and the running sums are the oracle's float64 operations in its order.
    The rest is memory: a bitset of kept weights (small enough for the L2 cache), and after
    each pick the chosen group moves past the weights other groups already kept and prefetches
    the importance of its next candidate, so that when the group is picked again (a few picks
    later) that read is a cache hit.
    """
    n = by_weight.shape[0]
    num_groups = orders.shape[0]
    flat = by_weight.reshape(-1)
    stride = by_weight.shape[1]
    one = np.uint64(1)
    kept_bits = np.zeros((n + 63) >> 6, dtype=np.uint64)
    next_pos = np.zeros(num_groups, dtype=np.int64)
    sums = np.zeros(num_groups)
    for k in range(num_groups):
        _prefetch(flat, orders[k, 0] * stride)
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
        # Fewer than N weights are kept and every order covers all N, so this stops.
        pos = next_pos[group]
        weight = orders[group, pos]
        while (kept_bits[weight >> 6] >> np.uint64(weight & 63)) & one:
            pos += 1
            weight = orders[group, pos]
        kept_bits[weight >> 6] |= one << np.uint64(weight & 63)
        base = weight * stride
        for j in range(num_groups):
            sums[j] += flat[base + j]
        pos += 1
        while pos < n:
            candidate = orders[group, pos]
            if not (kept_bits[candidate >> 6] >> np.uint64(candidate & 63)) & one:
                _prefetch(flat, candidate * stride)
                break
            pos += 1
        next_pos[group] = pos
    # The bitset as bools, and each group's kept importance summed in index order (as
    # kept_sums does), in one sequential pass.
    kept = np.empty(n, dtype=np.bool_)
    kept_importance = np.zeros(num_groups)
    for w in range(n):
        kept[w] = (kept_bits[w >> 6] >> np.uint64(w & 63)) & one
        if kept[w]:
            for j in range(num_groups):
                kept_importance[j] += flat[w * stride + j]
    return kept, kept_importance


@numba.njit(cache=True, nogil=True)
def transpose_targets(imp, out):  # pragma: no cover - compiled
    """``out[w, k] = imp[k, w]`` for the K columns of ``out`` that ``imp`` has; returns
    :func:`targets` of ``imp``, summed on the way (each group's sum still in index order)."""
    num_groups, n = imp.shape
    group_sums = np.zeros(num_groups)
    for w in range(n):
        for k in range(num_groups):
            value = imp[k, w]
            out[w, k] = value
            group_sums[k] += value
    return _shares(group_sums)
