"""Atomic file writes: every result file (``report.json``, the CSV tables, ``config.yaml``) is written
to a temporary file beside it and renamed over the target, so a reader never sees half a file and
an interrupted run leaves the previous version, not a truncated one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fairprune.errors import UserError


def replace_atomically(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Call ``write(tmp)`` on a temporary path in ``path``'s folder, then rename it to ``path``
    (``os.replace``: atomic on one filesystem). The folder is created; on failure the temporary
    file is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        plain_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def plain_mode(path: str | os.PathLike) -> None:
    """Give a written file the mode a plain ``open`` gives under the user's umask (0644 under 022):
    writers that go through a private temporary file (``mkstemp``: 0600) would otherwise leave
    their files unreadable by the group, so the same run's files would differ by how they were
    written."""
    os.chmod(path, 0o666 & ~_umask())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def remove_dead_temporaries(path: str | os.PathLike) -> list[Path]:
    """Remove the ``.<name>.<pid>.tmp`` files of ``path`` that processes no longer running left
    (a run killed while it wrote): the temporary names :func:`replace_atomically` writes under,
    never a live writer's. Returns the removed files."""
    path = Path(path)
    removed = []
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = tmp.name[len(path.name) + 2:-len(".tmp")]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            try:
                tmp.unlink()
                removed.append(tmp)
            except OSError:
                pass
    return removed


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically."""
    return replace_atomically(path, lambda tmp: tmp.write_text(text))


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""
    return replace_atomically(path, lambda tmp: tmp.write_bytes(data))


def write_csv(path: str | os.PathLike, frame, **to_csv: Any) -> Path:
    """Write a pandas frame to ``path`` atomically (``to_csv`` keywords: ``index=False``, ...)."""
    return replace_atomically(path, lambda tmp: frame.to_csv(tmp, **to_csv))


def check_writable(path: str | os.PathLike, option: str = "--output") -> Path:
    """Fail at once, before any work, unless ``path`` is (or can be created as) a folder this
    process can write to; ``option`` names it in the message. Creates nothing: it writes and
    removes a nameless temporary file in ``path`` or in its nearest existing parent."""
    path = Path(path)
    try:
        probe = path
        while not probe.exists() and probe != probe.parent:  # '.' and '/' exist, so this ends
            probe = probe.parent
        if not probe.is_dir():
            where = "is a file" if probe == path else f"cannot be created: '{probe}' is a file"
            raise UserError(f"{option} '{path}' {where}, not a folder; pass {option} a folder to write the results to")
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise UserError(f"cannot write to {option} '{path}' ({reason} in '{probe}'); pass {option} a folder "
                        f"you can write to, or fix its permissions, before the run starts") from None
    return path
