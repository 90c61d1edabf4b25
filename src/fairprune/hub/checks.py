"""Checks of a loaded model, shared by every layer above: are its weights finite, and how many bytes
does saving it take.

The finiteness check is the one the vision guards use during training
(:mod:`fairprune.callbacks.guards`) and the one the LM commands use on the model they load and on the
model they are about to save: a NaN or inf weight is never pruned, measured or kept as a result.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from fairprune.errors import UserError
from fairprune.hub.shards import check_weights, float16_overflow


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    found = [(n, p.detach()) for n, p in module.named_parameters() if p.is_floating_point()]  # integers: no NaN
    for prefix, sub in module.named_modules():  # normalisation statistics (not metric states: NaN is a value there)
        if isinstance(sub, nn.modules.batchnorm._NormBase):
            found += [(f"{prefix}.{n}", b) for n, b in sub.named_buffers(recurse=False) if b.is_floating_point()]
    return [(n, t) for n, t in found if t.numel() and t.device.type != "meta"]


def nonfinite(module: nn.Module) -> tuple[str, str] | None:
    """``(name, "NaN" or "inf")`` of the first parameter or normalisation statistic of ``module``
    that is not finite, or None.

    One fused norm over all tensors (one device sync); the per-tensor scan runs only on failure.
    """
    tensors = _tensors(module)
    if not tensors:
        return None
    total = torch.nn.utils.get_total_norm([t for _, t in tensors], norm_type=2.0)
    if bool(torch.isfinite(total)):
        return None
    for name, t in tensors:
        if not bool(torch.isfinite(t).all()):
            return name, "NaN" if bool(torch.isnan(t).any()) else "inf"
    return None  # finite tensors whose norm overflowed: large, not broken


def nonfinite_tensor(module: nn.Module) -> str | None:
    """The name of the first parameter or normalisation statistic of ``module`` holding NaN or inf, or None."""
    found = nonfinite(module)
    return None if found is None else found[0]


def _stored_code(model: nn.Module, name: str, source: str) -> str | None:
    """The safetensors dtype code tensor ``name`` of ``model`` has in the local folder ``source``
    (None: not a local safetensors folder, or not found)."""
    from pathlib import Path

    if not Path(source).is_dir():
        return None
    try:
        stored = check_weights(source)
    except UserError:
        return None
    base = getattr(model, "base_model_prefix", "") or ""
    for key in (name, name.removeprefix(f"{base}.")):
        if key in stored:
            return stored[key]["dtype"]
    return None


def check_input_model(model: nn.Module, source: str) -> None:
    """Refuse a loaded model whose weights are not finite, before any work is done with it. An inf
    in a float16 model whose checkpoint stores that tensor wider (or where that is not known) is
    the float16 cast overflowing: the message says so and names ``--dtype``."""
    found = nonfinite(model)
    if found is not None:
        tensor = dict(_tensors(model)).get(found[0])
        if found[1] == "inf" and tensor is not None and tensor.dtype == torch.float16 \
                and _stored_code(model, found[0], source) not in ("F16",):
            raise float16_overflow(found[0], source)
        raise UserError(f"the input model '{source}' is broken: parameter {found[0]} holds {found[1]}; nothing was "
                        "pruned, measured or written (give a model whose weights are finite, e.g. re-export it from a "
                        "run that did not diverge)")


def check_result(model, output: str | os.PathLike, method: str | None = None) -> None:
    """Refuse to save a model whose weights are not finite (the input was checked when it was
    loaded, so the pruning produced it): one line, nothing written."""
    found = nonfinite(model)
    if found is not None:
        what = f"pruning with {method}" if method else "the pruning"
        raise UserError(f"{what} produced a broken model: parameter {found[0]} holds {found[1]} (the input model "
                        f"was finite); nothing was written to '{output}' (try another method, sparsity or "
                        "calibration set)")


def saved_bytes(model: nn.Module, tokenizer: Any = None) -> int:
    """About how many bytes ``save_pretrained`` of ``model`` and ``tokenizer`` writes: the tensors
    (shared ones once) and the tokenizer files (estimated from the vocabulary size)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in model.state_dict().values():
        if tensor.device.type == "meta":
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    if tokenizer is not None:
        try:
            entries = len(tokenizer)
        except TypeError:
            entries = 0
        total += 128 * entries + 64 * 1024  # vocabulary, merges and the small json files, generously
    return total


def available_memory(swap: bool = False) -> int | None:
    """Bytes of memory the system can still give this process (``MemAvailable`` of /proc/meminfo,
    plus ``SwapFree`` with ``swap``; elsewhere the free pages ``os.sysconf`` reports), or None when
    it cannot tell."""
    import os

    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.strip().endswith("kB")}
        if "MemAvailable" in info:
            return info["MemAvailable"] + (info.get("SwapFree", 0) if swap else 0)
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


def human_bytes(count: float) -> str:
    """``count`` bytes for a message: ``512 B``, ``3.2 GB``, ``4.1e+03 TB``."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(count) < 1000:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB" if count < 1000 else f"{count:.2g} TB"
