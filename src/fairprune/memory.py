"""The process's memory, for a run that holds one block of a model at a time: glibc's allocator
told to give freed memory back (``mallopt`` / ``malloc_trim``; elsewhere nothing), and the peak
resident memory a report records."""

from __future__ import annotations

import ctypes
import resource
import sys

import torch

from fairprune import distributed

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


_LIBC = _glibc()


def return_freed_memory() -> None:
    """On glibc, serve every buffer of 256 KiB or more from its own mapping, so a freed block's
    weights or activations go back to the system at once. By default glibc raises that threshold
    to the size of the largest buffer freed so far, and later buffers below it come from a heap
    that does not shrink: a streamed run would keep the memory of blocks long gone."""
    if _LIBC is not None:
        _LIBC.mallopt(M_MMAP_THRESHOLD, 256 * 1024)


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``): the weights and
    activations of a block just let go leave free holes in the heap that would otherwise stay
    resident while the next block loads."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far: ``ru_maxrss`` (KiB on Linux, bytes on macOS),
    on Linux taken from ``/proc/self/status`` (``VmHWM``, the same high-water mark) because
    ``ru_maxrss`` also keeps the resident size the parent had when it started this program."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


def available_bytes() -> int | None:
    """Memory the system can give this process now without swapping (``MemAvailable`` of
    ``/proc/meminfo``; None where it is not known)."""
    try:
        with open("/proc/meminfo") as info:
            return next(int(line.split()[1]) * 1024 for line in info if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def rank_peaks() -> list[int]:
    """Every rank's peak resident memory so far, by rank (this process's alone); collective under torchrun."""
    rank, size = distributed.world()
    peaks = torch.zeros(size, dtype=torch.float64)
    peaks[rank] = peak_rss_bytes()
    return [int(v) for v in distributed.all_reduce_sum(peaks).tolist()]
