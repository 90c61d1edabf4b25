"""torchrun for the LM commands: the process group, each rank's share of the data, the reductions.

``torchrun --nproc_per_node N prune.py sparsegpt ...`` starts N copies of the command with
``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT`` in their environment.
:func:`process_group` creates the group from them once per command (gloo for CPU tensors, NCCL for
CUDA tensors, each rank on GPU ``LOCAL_RANK``) and destroys it when the command ends, after a
barrier so every rank finishes together. Without ``WORLD_SIZE > 1`` it does nothing: one process
runs exactly as before.

While a ``torch.distributed`` group exists (this one or Lightning's), LM calibration and
measurement are collective: every rank calls them, each works on its :func:`shard` of the samples
and the partial sums meet in :func:`all_reduce_sum`. Code that runs on one rank only while a group
exists (a rank-zero-only callback) must run inside :func:`local`, so it neither shards nor waits
for ranks that never come.

What is summed over many terms (calibration statistics) goes through :class:`ExactSum`, whose
result does not depend on how the terms are split across ranks nor on the order they arrive in: N
ranks give one process's figures bit for bit.

Imports torch only (and the project's error type).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from fairprune.errors import UserError

T = TypeVar("T", bound=Sequence)

_local_depth = 0  # open local() blocks


def world() -> tuple[int, int]:
    """``(rank, world size)`` of the processes running this code together; ``(0, 1)`` alone."""
    if _local_depth or not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def is_main() -> bool:
    """True on the rank that writes files and prints (rank 0, or the only process)."""
    return world()[0] == 0


def shard(items: T) -> T:
    """This rank's share of ``items`` (a tensor's rows, a list): every ``size``-th item from
    ``rank`` on, so the shares differ in length by one at most. Everything when alone."""
    rank, size = world()
    return items if size == 1 else items[rank::size]


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the ranks, in place (and returned); unchanged when alone. A CPU tensor
    under an NCCL-only group travels through the current GPU."""
    if world()[1] == 1:
        return tensor
    if tensor.device.type == "cpu" and "gloo" not in str(dist.get_backend()):
        moved = tensor.cuda()
        dist.all_reduce(moved)
        return tensor.copy_(moved)
    dist.all_reduce(tensor)
    return tensor


class ExactSum:
    """A sum of same-shaped tensor terms whose bits do not depend on the order the terms are added
    in nor on how they are split across ranks, so N ranks reach one process's sum exactly.

    Float addition is not associative: a running float64 sum of float32 terms, reduced across
    ranks, ends a few ulps away from one process's, and a few ulps in a Hessian are enough to move
    SparseGPT's masks. Here each term is rounded once, on its own, to a grid of
    ``2^-BITS`` of the top of its magnitude class (classes of ``CLASS`` binades by the term's
    largest entry; the grid is finer than float32's resolution at that entry); terms on one grid
    add in float64 without any rounding while fewer than ``2^(53 - BITS)`` of them are added, so
    each class's sum is the same in any order. The classes (one or two per statistic in practice)
    are reduced across ranks one by one and added in a fixed order.
    """

    BITS, CLASS, MAX_TERMS = 33, 8, 1 << 20
    CHUNK = 1 << 18  # entries of a term rounded at once (2 MB of float64)
    _KEYS = 1100 // 8 + 2  # class keys of float64 magnitudes lie in [-_KEYS, _KEYS)

    def __init__(self, shape: Sequence[int], device: str | torch.device | None = None):
        self.shape = tuple(shape)
        # float64 where the device has it (MPS does not: keep the sum on the CPU there).
        self.device = torch.device(device if device is not None else "cpu")
        if self.device.type == "mps":
            self.device = torch.device("cpu")
        self.parts: dict[int, torch.Tensor] = {}  # class key -> sum of that class's rounded terms
        self.terms = 0
        self._shared = False

    def add(self, term: torch.Tensor) -> None:
        """Add ``term`` (any float dtype, this sum's shape)."""
        if self._shared:
            raise RuntimeError("ExactSum: a term was added after the sum was reduced across ranks")
        self.terms += 1
        term = term.to(self.device)
        low, high = torch.aminmax(term) if term.numel() else (0.0, 0.0)
        top = max(float(high), -float(low))  # the largest magnitude, with no |term| buffer (NaN: both NaN)
        if top == 0.0:
            return
        key = -(-math.frexp(top)[1] // self.CLASS)  # smallest key with top < 2^(CLASS·key); NaN/inf: 0, kept as they are
        shift = self.BITS - self.CLASS * key  # grid units per 1.0, as a power of two (split: it may pass 2^1023)
        up, down = 2.0 ** (shift // 2), 2.0 ** (shift - shift // 2)
        part = self.parts.get(key)
        if part is None:
            part = self.parts[key] = torch.zeros(self.shape, dtype=torch.float64, device=self.device)
        # Rounded and added a slice at a time, so no float64 copy of a whole term (a 1536² Hessian
        # term is 19 MB) sits beside the sum.
        flat, into = term.reshape(-1), part.view(-1)
        # Scaling by a power of two is exact, so one factor does what two do wherever it is a
        # float64 (|shift| < 1023): the same bits in two passes fewer.
        one = abs(shift) < 1000
        scale = 2.0 ** shift if one else None
        for start in range(0, flat.numel(), self.CHUNK):
            piece = flat[start : start + self.CHUNK].to(torch.float64, copy=True)
            if one:
                into[start : start + self.CHUNK] += piece.mul_(scale).round_().div_(scale)  # exact but the rounding
            else:
                into[start : start + self.CHUNK] += piece.mul_(up).mul_(down).round_().div_(down).div_(up)

    def total(self, dtype: torch.dtype = torch.float64, times: float = 1.0, over: float = 1.0) -> torch.Tensor:
        """The sum over every rank's terms (zeros when there were none), times ``times`` and divided
        by ``over`` in float64, then as ``dtype``. Collective under a group: every rank calls it,
        once its terms are in.

        Made a slice at a time: each entry gets the very operations it would as
        ``(total * times / over).to(dtype)``, but no float64 copy of the whole sum is made beside
        the class sums when ``dtype`` is narrower (a 11008² Hessian: 0.97 GB less at its peak)."""
        terms = self.terms
        if world()[1] > 1 and not self._shared:
            present = torch.zeros(2 * self._KEYS + 1, dtype=torch.float64)  # the classes, then the term count
            for key in self.parts:
                present[key + self._KEYS] = 1
            present[-1] = self.terms
            all_reduce_sum(present)
            terms = self.terms = int(present[-1])
            for key in (present[:-1].nonzero().flatten() - self._KEYS).tolist():
                part = self.parts.get(key)
                if part is None:
                    part = self.parts[key] = torch.zeros(self.shape, dtype=torch.float64, device=self.device)
                all_reduce_sum(part)  # on one grid: exact in any order
            self._shared = True
        if terms > self.MAX_TERMS:
            raise UserError(f"{terms} calibration batches are more than an exact sum takes ({self.MAX_TERMS}); "
                            "use fewer samples or larger batches")
        out = torch.empty(self.shape, dtype=dtype, device=self.device)
        into = out.view(-1)
        parts = [self.parts[key].view(-1) for key in sorted(self.parts)]  # the same classes in the same order on every rank
        for start in range(0, into.numel(), self.CHUNK):
            piece = torch.zeros(min(self.CHUNK, into.numel() - start), dtype=torch.float64, device=self.device)
            for part in parts:
                piece += part[start : start + self.CHUNK]
            if times != 1.0:
                piece.mul_(times)
            if over != 1.0:
                piece.div_(over)
            into[start : start + self.CHUNK] = piece
        return out


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` with rank ``src``'s, in place (and returned); unchanged when alone."""
    if world()[1] > 1:
        dist.broadcast(tensor, src)
    return tensor


def broadcast_text(text: str | None, src: int = 0) -> str | None:
    """Rank ``src``'s ``text`` on every rank (a path, a name); ``text`` itself when alone. Sent as
    UTF-8 bytes in tensors, never pickled."""
    if world()[1] == 1:
        return text
    data = b"" if text is None else text.encode()
    size = broadcast(torch.tensor([len(data), text is None], dtype=torch.int64), src)
    if int(size[1]):
        return None
    buffer = torch.zeros(int(size[0]), dtype=torch.uint8)
    if world()[0] == src and data:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    if len(buffer):
        broadcast(buffer, src)
    return bytes(buffer.tolist()).decode()


def barrier() -> None:
    """Wait until every rank gets here (nothing when alone)."""
    if world()[1] > 1:
        dist.barrier()


@contextlib.contextmanager
def local() -> Iterator[None]:
    """Within this block the code runs as one process: no sharding, no reductions, no barriers."""
    global _local_depth
    _local_depth += 1
    try:
        yield
    finally:
        _local_depth -= 1


def launched() -> bool:
    """Started by torchrun with more than one process (``WORLD_SIZE > 1``)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


@contextlib.contextmanager
def process_group(device: str | torch.device = "auto") -> Iterator[tuple[int, int]]:
    """The group of one command, yielding ``(rank, world size)``.

    Launched by torchrun (``WORLD_SIZE > 1``) and no group yet: create it from the environment
    (gloo alone for ``device`` cpu; gloo for CPU tensors and NCCL for CUDA tensors otherwise, with
    this rank's GPU ``LOCAL_RANK`` made current so ``cuda`` means it), and on the way out wait for
    every rank, then destroy it. Otherwise (one process, or a group someone else made) do nothing.
    """
    if not launched() or not dist.is_available() or dist.is_initialized():
        yield world()
        return
    cuda = _wants_cuda(device)
    if cuda:
        local_rank, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local_rank >= gpus:
            raise UserError(f"torchrun started rank {local_rank} on a machine with {gpus} GPU(s); "
                            f"use --nproc_per_node {gpus} or less, or --device cpu")
        torch.cuda.set_device(local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    try:
        yield world()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _wants_cuda(device: str | torch.device) -> bool:
    name = str(device)
    if name == "auto":
        return torch.cuda.is_available()
    return name.startswith("cuda")
