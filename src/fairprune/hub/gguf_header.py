"""A GGUF file's header checked as its format defines it, before any reader trusts it.

A GGUF file (ggml's ``docs/gguf.md``, versions 2 and 3; little-endian) is: the magic ``GGUF``,
the version (uint32), the tensor count and the metadata count (uint64); each metadata entry a key
(a string: uint64 length, bytes), a value type (uint32) and a value (a scalar, a string, or an
array: element type uint32, count uint64, elements); each tensor's info: name, dimension count
(uint32), the dimensions (uint64 each), the ggml type (uint32) and the offset of its data (uint64)
from the start of the data section, which begins at the header's end rounded up to
``general.alignment`` (32 by default). A tensor's data takes ``numel / block · type_size`` bytes
(``gguf.GGML_QUANT_SIZES``).

:func:`check_gguf` walks the header without reading any array into memory: every count and length
must fit in the bytes left in the file (an array claiming 2^40 entries is refused at once, not
read), every tensor's data must lie inside the file, aligned, and no two tensors' data may overlap
(a file whose tensors share bytes would be measured with the wrong weights). A file that breaks
any of these is refused in one line naming what is wrong.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from fairprune.errors import UserError

#: Sizes of the scalar value types, by GGUF value type id.
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4


class _Cursor:
    def __init__(self, f, size: int, path: Path):
        self.f, self.size, self.path = f, size, path

    @property
    def left(self) -> int:
        return self.size - self.f.tell()

    def bad(self, what: str) -> UserError:
        return UserError(f"'{self.path}' is not a valid GGUF file: {what}; give a GGUF file as llama.cpp writes it")

    def read(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        if n > self.left:
            raise self.bad(f"{what} runs past the end of the file")
        return struct.unpack(fmt, self.f.read(n))[0]

    def string(self, what: str) -> bytes:
        length = self.read("<Q", f"the length of {what}")
        if length > self.left:
            raise self.bad(f"{what} claims {length} bytes, more than the file holds")
        return self.f.read(length)

    def skip(self, count: int, what: str) -> None:
        if count > self.left:
            raise self.bad(f"{what} claims {count} bytes, more than the file holds")
        self.f.seek(count, os.SEEK_CUR)


def _value(cur: _Cursor, kind: int, key: str, nested: bool = False):
    """Read (scalars and strings) or skip (arrays) one value; returns the value of a scalar."""
    if kind in _SCALARS:
        fmt = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[_SCALARS[kind]]
        return cur.read(fmt, f"the value of {key}")
    if kind == _STRING:
        return cur.string(f"the value of {key}")
    if kind == _ARRAY and not nested:
        element = cur.read("<I", f"the element type of {key}")
        count = cur.read("<Q", f"the length of {key}")
        if element in _SCALARS:
            cur.skip(count * _SCALARS[element], f"{key} ({count} entries)")
        elif element == _STRING:
            if count * 8 > cur.left:  # each string is at least its 8-byte length
                raise cur.bad(f"{key} claims {count} strings, more than the file can hold")
            for _ in range(count):
                cur.string(f"an entry of {key}")
        else:
            raise cur.bad(f"{key} is an array of value type {element}, which GGUF does not define")
        return None
    raise cur.bad(f"{key} has value type {kind}, which GGUF does not define")


def check_gguf(path: str | os.PathLike) -> dict[str, int]:
    """Check ``path``'s header and tensor layout (see the module docstring); returns its counts."""
    import gguf

    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        cur = _Cursor(f, size, path)
        if f.read(4) != b"GGUF":
            raise cur.bad("it does not start with the magic 'GGUF'")
        version = cur.read("<I", "the version")
        if version not in (2, 3):
            raise cur.bad(f"version {version} (fairprune reads versions 2 and 3)")
        tensors, entries = cur.read("<Q", "the tensor count"), cur.read("<Q", "the metadata count")
        if entries * 12 > cur.left or tensors * 24 > cur.left:
            raise cur.bad(f"{entries} metadata entries and {tensors} tensors claimed, more than the file can hold")
        alignment = 32
        for _ in range(entries):
            key = cur.string("a metadata key").decode("utf-8", "replace")
            kind = cur.read("<I", f"the type of {key}")
            value = _value(cur, kind, key)
            if key == "general.alignment":
                alignment = int(value) if isinstance(value, int) else 0
                if alignment <= 0 or alignment & (alignment - 1):
                    raise cur.bad(f"general.alignment is {value}, not a power of two")
        spans = []
        for _ in range(tensors):
            name = cur.string("a tensor name").decode("utf-8", "replace")
            dims = cur.read("<I", f"the dimension count of {name}")
            if not 1 <= dims <= _MAX_DIMS:
                raise cur.bad(f"tensor {name} has {dims} dimensions (GGUF allows 1 to {_MAX_DIMS})")
            shape = [cur.read("<Q", f"a dimension of {name}") for _ in range(dims)]
            qtype = cur.read("<I", f"the type of {name}")
            offset = cur.read("<Q", f"the data offset of {name}")
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
            except (ValueError, KeyError):
                raise cur.bad(f"tensor {name} has ggml type {qtype}, which this gguf package does not know") from None
            numel = 1
            for d in shape:
                numel *= d
            if shape[0] % block:
                raise cur.bad(f"tensor {name}'s rows of {shape[0]} are no multiple of its type's block of {block}")
            if offset % alignment:
                raise cur.bad(f"tensor {name}'s data offset {offset} is not aligned to {alignment} bytes")
            spans.append((offset, offset + numel // block * type_size, name))
        start = -(-f.tell() // alignment) * alignment
    for _begin, end, name in spans:
        if start + end > size:
            raise cur.bad(f"tensor {name}'s data ends {start + end - size} bytes past the end of the file")
    spans.sort()
    for (_, e1, n1), (b2, _, n2) in zip(spans, spans[1:]):
        if b2 < e1:
            raise cur.bad(f"the data of tensors {n1} and {n2} overlap (bytes {b2} to {e1} of the data section)")
    return {"version": version, "tensors": tensors, "metadata": entries}
