"""File digests: what a file holds, by its bytes (a file rewritten under the same path is another file)."""

from __future__ import annotations

import hashlib
from pathlib import Path

_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes, remembered per (path, size, modification time)."""
    try:
        stat = Path(path).stat()
    except OSError:
        return ""
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]
