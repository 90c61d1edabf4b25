"""File digests: what a file holds, by its bytes (a file rewritten under the same path is another file)."""

from __future__ import annotations

import hashlib
from pathlib import Path

_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes, remembered per (path, size, modification time); of a folder, of
    its files' names and digests (a data set given as a folder of files, as UnQover's)."""
    try:
        stat = Path(path).stat()
    except OSError:
        return ""
    if Path(path).is_dir():
        files = sorted(p for p in Path(path).rglob("*") if p.is_file())
        parts = [f"{f.relative_to(path).as_posix()}:{file_sha256(f)}" for f in files]
        return hashlib.sha256("\n".join(parts).encode("utf-8")).hexdigest()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]
