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

Imports torch only (and the project's error type).
"""

from __future__ import annotations

import contextlib
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


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` with rank ``src``'s, in place (and returned); unchanged when alone."""
    if world()[1] > 1:
        dist.broadcast(tensor, src)
    return tensor


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
