"""Atomic file writes: every result file (``report.json``, the CSV tables, ``config.yaml``) is written
to a temporary file beside it and renamed over the target, so a reader never sees half a file and
an interrupted run leaves the previous version, not a truncated one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable


def replace_atomically(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Call ``write(tmp)`` on a temporary path in ``path``'s folder, then rename it to ``path``
    (``os.replace``: atomic on one filesystem). The folder is created; on failure the temporary
    file is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically."""
    return replace_atomically(path, lambda tmp: tmp.write_text(text))


def write_csv(path: str | os.PathLike, frame, **to_csv: Any) -> Path:
    """Write a pandas frame to ``path`` atomically (``to_csv`` keywords: ``index=False``, ...)."""
    return replace_atomically(path, lambda tmp: frame.to_csv(tmp, **to_csv))
