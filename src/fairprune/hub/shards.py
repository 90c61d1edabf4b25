"""Safetensors checkpoints read and written one tensor at a time, for models bigger than memory.

:class:`ShardReader` reads single tensors from a model folder's weights: ``model.safetensors`` or
the shards listed by ``model.safetensors.index.json``. Each read opens the file with
``safetensors.safe_open``, copies the one tensor out (cast to the dtype asked for, on the device
asked for) and closes the file again: ``safe_open`` maps the file into memory, and pages of a
mapping count towards the process's resident memory for as long as it is open, so a long-lived
handle would end up holding the whole checkpoint.

:class:`ShardWriter` writes a model folder's weights in the layout ``save_pretrained`` gives them
(``huggingface_hub.split_torch_state_dict_into_shards`` plans the files from the tensors' names,
shapes and dtypes; ``model.safetensors`` when one file holds them all, else
``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json``; metadata
``{"format": "pt"}``). Because every shape is known before the first tensor is ready, each file's
safetensors header is written when the file is opened and each tensor is written at its offset
as soon as it arrives, in any order: nothing is held back to fill a shard. The files are closed
once all their tensors are in; :meth:`ShardWriter.close` refuses a checkpoint with a tensor
missing.

:func:`local_folder` turns a ``--model`` value into a local folder of safetensors weights (a hub
name: its snapshot in the local cache; nothing is downloaded).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from fairprune.errors import UserError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: torch dtypes as safetensors names them in a file header.
DTYPE_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def has_safetensors(folder: str | os.PathLike) -> bool:
    """``folder`` holds ``model.safetensors`` or ``model.safetensors.index.json``."""
    folder = Path(folder)
    return (folder / INDEX).is_file() or (folder / SINGLE).is_file()


def local_folder(name_or_path: str, resolved: str | os.PathLike) -> Path:
    """The local folder of safetensors weights a ``--model`` value names: ``resolved`` (the hub
    loader's answer: a folder, a converted GGUF's folder, or a hub name) when it is a folder, else
    the hub name's snapshot in the local Hugging Face cache (never downloaded)."""
    path = Path(resolved).expanduser()
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(str(resolved), local_files_only=True,
                                          allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))
        except Exception as err:  # not cached, not a repository name, no hub package: all mean "no local copy"
            raise UserError(f"--stream true reads the weights from a local folder: '{name_or_path}' is neither a folder "
                            f"nor a model in the local Hugging Face cache ({' '.join(str(err).split())[:160]}); "
                            "download it once (huggingface-cli download) or give its folder") from None
    if not has_safetensors(path):
        raise UserError(f"--stream true reads safetensors weights: '{name_or_path}' ({path}) holds neither {SINGLE} nor "
                        f"{INDEX}; re-save it with save_pretrained (safetensors) or run without --stream")
    return path


#: Bytes per element of the safetensors dtype codes (sub-byte ones, e.g. F4, are not size-checked).
_CODE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
               "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8}
FLOAT_CODES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
#: A header longer than this is refused unread (real ones take kilobytes to a few megabytes).
MAX_HEADER_BYTES = 100 * 1024 * 1024
_FIX = "the file is damaged or cut short: download or copy it again, or re-save the model with save_pretrained"


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """The checked JSON header of the safetensors file ``path``; a damaged file is a one-line
    :class:`UserError` naming it and what is wrong. Reads the 8-byte length and the header only."""
    path = Path(path)

    def bad(what: str) -> UserError:
        return UserError(f"weight file '{path}' is not a valid safetensors file: {what}; {_FIX}")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"it holds {len(head)} bytes, fewer than the 8 of a header length")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8 or length > MAX_HEADER_BYTES:
                raise bad(f"its header claims {length} bytes, but the file holds {size} bytes"
                          + (f" (headers over {MAX_HEADER_BYTES // 2**20} MB are refused)" if length <= size - 8 else ""))
            raw = f.read(length)
    except OSError as err:
        raise UserError(f"cannot read weight file '{path}': {' '.join(str(err).split())[:160]}") from None
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise bad(f"its header is not JSON ({' '.join(str(err).split())[:80]})") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    data = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (*shape, begin, end))
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok or not isinstance(code, str):
            raise bad(f"tensor {name!r} has no valid dtype, shape and data_offsets in the header")
        if not begin <= end <= data:
            raise bad(f"tensor {name!r} lies at bytes {begin}..{end} of the data, but the file holds {data} bytes of "
                      "data after its header")
        if code in _CODE_BYTES and (end - begin) != _CODE_BYTES[code] * torch.Size(shape).numel():
            raise bad(f"tensor {name!r} is {code} {list(shape)} ({_CODE_BYTES[code] * torch.Size(shape).numel()} bytes) "
                      f"but its data_offsets span {end - begin} bytes")
    return header


def check_weights(folder: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Check a model folder's safetensors weights before anything is loaded: every file's header
    against the file (:func:`read_header`), and ``model.safetensors.index.json`` against the files
    (each entry names a file that exists and holds that tensor). Returns every tensor's header
    entry by name (``dtype``, ``shape``); ``{}`` for a folder without safetensors weights.
    A folder with neither ``model.safetensors`` nor an index has each ``*.safetensors`` file checked."""
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not an object of file names")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UserError(f"cannot read {INDEX} of '{folder}': {' '.join(str(err).split())[:160]}; copy the folder "
                            "again or re-save it with save_pretrained") from None
        headers = {}
        for file in sorted(set(weight_map.values())):
            path = folder / file
            if Path(file).name != file or not path.is_file():
                raise UserError(f"'{folder}' lists weight file {file} in {INDEX} but does not hold it; copy the whole "
                                "folder (or re-save it with save_pretrained)")
            headers[file] = read_header(path)
        for name, file in weight_map.items():
            if name not in headers[file]:
                holder = next((f for f, h in headers.items() if name in h), None)
                where = f" (it is in {holder})" if holder else ""
                raise UserError(f"{INDEX} of '{folder}' says tensor {name} is in {file}, which does not hold it{where}; "
                                "copy the folder again or re-save it with save_pretrained")
        return {name: headers[file][name] for name, file in weight_map.items()}
    files = [folder / SINGLE] if (folder / SINGLE).is_file() else sorted(folder.glob("*.safetensors"))
    found: dict[str, dict[str, Any]] = {}
    for path in files:
        found.update((k, v) for k, v in read_header(path).items() if k != "__metadata__")
    return found


FLOAT16_MAX = 65504.0


def float16_overflow(name: str, source: str) -> UserError:
    """The error for a weight that became inf when cast to float16 (its stored values are finite)."""
    return UserError(f"the weights of '{source}' exceed float16's range (±{FLOAT16_MAX:.0f}): {name} becomes inf when "
                     "loaded with --dtype float16; use --dtype bfloat16 (float32's range) or float32; nothing was "
                     "pruned, measured or written")


def refuse_nonfloat(codes: Mapping[str, str], source: str) -> None:
    """Refuse, in one line, a prunable weight that the checkpoint stores as anything but floating
    point (``codes``: the prunable weights' names → their safetensors dtype codes): an int8 or
    packed tensor would be cast to float and pruned as if its integers were weights."""
    for name, code in codes.items():
        if code not in FLOAT_CODES:
            raise UserError(f"weight {name} of '{source}' is stored as {code}, not floating point: only float weights "
                            "can be pruned (a quantized checkpoint cannot); give the model's float16 / bfloat16 / "
                            "float32 checkpoint")


class ShardReader:
    """Single tensors of a folder's safetensors weights, read on demand (see the module docstring)."""

    CHUNK_BYTES = 4 * 1024 * 1024  # a larger tensor is read this many bytes of rows at a time

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        index, single = self.folder / INDEX, self.folder / SINGLE
        if not index.is_file() and not single.is_file():
            raise UserError(f"'{self.folder}' holds neither {SINGLE} nor {INDEX}; give a folder written by "
                            "save_pretrained (safetensors weights)")
        self._entries = check_weights(self.folder)  # every header checked against its file and the index
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.folder / file for name, file in weight_map.items()}
        else:
            self.files = dict.fromkeys(self._entries, single)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def keys(self) -> list[str]:
        return list(self.files)

    def stored_dtype(self, name: str) -> str:
        """The safetensors dtype code ``name`` is stored as (``F32``, ``I8``, ...)."""
        return self._entries[name]["dtype"]

    def info(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """The stored dtype and shape of ``name`` (from the file header; no data read)."""
        entry = self._entries[name]
        if entry["dtype"] not in _CODE_DTYPES:
            raise UserError(f"tensor {name} of '{self.files[name]}' is stored as {entry['dtype']}, which streaming does not read")
        return _CODE_DTYPES[entry["dtype"]], tuple(entry["shape"])

    def nbytes(self, name: str) -> int:
        """Bytes ``name`` takes in the file."""
        dtype, shape = self.info(name)
        return torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()

    def read(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        """Tensor ``name``, copied out of its file, as ``dtype`` (None: as stored) on ``device``.

        A tensor larger than :attr:`CHUNK_BYTES` (an embedding table) is copied a slice of rows
        at a time, the file opened and closed again for each, so no more than one slice of the
        file is ever mapped beside the result."""
        try:
            path = self.files[name]
        except KeyError:
            raise UserError(f"the weights of '{self.folder}' hold no tensor {name!r}; the folder does not match its "
                            "config.json") from None
        stored, shape = self.info(name)
        dtype = dtype if dtype is not None else stored
        size = self.nbytes(name)
        if len(shape) == 0 or size <= self.CHUNK_BYTES:
            with safe_open(path, "pt") as f:
                out = f.get_tensor(name).to(device=device, dtype=dtype, copy=True)
        else:
            out = torch.empty(shape, dtype=dtype, device=device)
            step = max(1, self.CHUNK_BYTES // max(1, size // shape[0]))
            for start in range(0, shape[0], step):
                with safe_open(path, "pt") as f:
                    out[start : start + step].copy_(f.get_slice(name)[start : start + step])
        if dtype == torch.float16 and stored.is_floating_point and stored != torch.float16 and bool(torch.isinf(out).any()):
            if bool(torch.isfinite(self.read(name)).all()):  # finite as stored: the cast overflowed
                raise float16_overflow(name, str(self.folder))
        return out


class ShardWriter:
    """A folder's safetensors weights written tensor by tensor (see the module docstring).

    ``tensors``: every tensor the checkpoint will hold, by name, as anything with ``shape`` and
    ``dtype`` (meta tensors do), in the order ``save_pretrained`` would see them in the state
    dict. ``max_shard_size``: as ``save_pretrained`` takes it (its default ``"50GB"``).
    ``total_parameters``: recorded in the index, as ``save_pretrained`` records it."""

    def __init__(self, folder: str | os.PathLike, tensors: Mapping[str, Any], max_shard_size: int | str = "50GB",
                 total_parameters: int | None = None):
        from huggingface_hub import split_torch_state_dict_into_shards

        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        metas = {name: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta") for name, t in tensors.items()}
        for name, t in metas.items():
            if t.dtype not in DTYPE_CODES:
                raise UserError(f"tensor {name} has dtype {t.dtype}, which the streamed writer does not write")
        split = split_torch_state_dict_into_shards(metas, max_shard_size=max_shard_size)
        self.sharded = split.is_sharded
        self.total_size = int(split.metadata.get("total_size", sum(_nbytes(t) for t in metas.values())))
        self.total_parameters = total_parameters
        self.weight_map = dict(split.tensor_to_filename)
        self._layout: dict[str, tuple[str, int, torch.dtype, tuple[int, ...]]] = {}  # name → file, offset, dtype, shape
        self._headers: dict[str, bytes] = {}
        self._pending: dict[str, set[str]] = {}
        for file, names in split.filename_to_tensors.items():
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for name in names:
                t = metas[name]
                size = _nbytes(t)
                header[name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
                self._layout[name] = (file, offset, t.dtype, tuple(t.shape))
                offset += size
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
            self._headers[file] = struct.pack("<Q", len(raw)) + raw
            self._pending[file] = set(names)
        self._open: dict[str, Any] = {}
        self.written_bytes = 0

    def names(self) -> list[str]:
        """Every tensor the checkpoint holds."""
        return list(self._layout)

    def missing(self) -> list[str]:
        """Tensors not written yet."""
        return sorted(name for names in self._pending.values() for name in names)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` as ``name`` (its dtype and shape must be the planned ones); a file is
        closed as soon as its last tensor is in."""
        if name not in self._layout:
            raise KeyError(f"tensor {name!r} is not part of this checkpoint")
        file, offset, dtype, shape = self._layout[name]
        if name not in self._pending[file]:
            raise RuntimeError(f"tensor {name!r} was written twice")
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {name!r}: planned {dtype} {list(shape)}, got {tensor.dtype} {list(tensor.shape)}")
        handle = self._open.get(file)
        if handle is None:
            handle = self._open[file] = open(self.folder / file, "wb")
            handle.write(self._headers[file])
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        handle.seek(len(self._headers[file]) + offset)
        if data.numel():
            handle.write(memoryview(data.view(torch.uint8).numpy()))
        self.written_bytes += data.numel() * data.element_size()
        self._pending[file].discard(name)
        if not self._pending[file]:
            handle.close()
            del self._open[file]

    def write_many(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            self.write(name, tensor)

    def close(self) -> list[str]:
        """Finish the checkpoint: every tensor must be in; the index is written when there are
        several files. Returns the files written."""
        missing = self.missing()
        self.abort()
        if missing:
            raise RuntimeError(f"the checkpoint misses {len(missing)} tensor(s), e.g. {missing[0]}")
        if self.sharded:
            metadata = {"total_size": self.total_size}
            if self.total_parameters is not None:
                metadata = {"total_parameters": self.total_parameters, **metadata}
            index = {"metadata": metadata, "weight_map": self.weight_map}
            (self.folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return sorted(self._headers) + ([INDEX] if self.sharded else [])

    def abort(self) -> None:
        """Close every open file (a failed run: the caller removes the folder)."""
        for handle in self._open.values():
            handle.close()
        self._open.clear()


def _nbytes(t: Any) -> int:
    return torch.Size(t.shape).numel() * torch.empty(0, dtype=t.dtype).element_size()
