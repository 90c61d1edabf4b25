"""One run per output folder: a lock file, ``<folder>/.lock``, held while a run writes the folder.

The lock is a small JSON file (``pid``, ``host``, ``started``, ``command``) created atomically (it
appears with its content or not at all), so a second run into the same folder refuses at once with
one line saying who holds it. A lock whose process is gone (same host, pid not alive) is taken over
with a warning; a lock of another host cannot be checked and is never taken over (delete it by hand
once that run is known to be gone). The lock is released when the run ends, also on error.

Under ``torchrun`` / Lightning's DDP launcher / SLURM only the first process (rank 0) takes it: the
other ranks of the same run write nothing and must not refuse their own run.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from fairprune.errors import UserError
from fairprune.storage.atomic import check_writable

LOCK_NAME = ".lock"
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")
F = TypeVar("F", bound=Callable[..., Any])

_held: set[Path] = set()  # the locks this process holds (a second run in one process is refused too)


def _secondary_rank() -> bool:
    """True in every process of a multi-process run but the first."""
    for name in RANK_VARIABLES:
        try:
            if int(os.environ.get(name) or 0) != 0:
                return True
        except ValueError:
            continue
    return False


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, under another user
        return True
    return True


def _read(path: Path) -> dict[str, Any]:
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


class RunLock:
    """The lock of one run folder; a context manager (``with RunLock(folder): ...``).

    Args:
        folder: the run's output folder (created when missing).
        name: the lock file's name inside it.
    """

    def __init__(self, folder: str | os.PathLike, name: str = LOCK_NAME) -> None:
        self.folder = Path(folder)
        self.path = self.folder / name
        self.token = uuid.uuid4().hex
        self.held = False

    def _info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv), "token": self.token}

    def _create(self) -> bool:
        """Create the lock file with its content in one step; False when one exists."""
        tmp = self.folder / f".lock.{os.getpid()}.{self.token}.tmp"
        tmp.write_text(json.dumps(self._info()) + "\n")
        try:
            os.link(tmp, self.path)  # fails when the lock exists: never half a lock file
            return True
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as handle:
                handle.write(tmp.read_text())
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def _try_create(self) -> bool:
        """:meth:`_create` in a folder made first; a folder that cannot be written is a user error."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            return self._create()
        except OSError as err:
            if self.folder.exists() and not self.folder.is_dir():
                raise UserError(f"'{self.folder}' is a file, not a folder; pass an output folder to write the run to") from None
            reason = err.strerror or type(err).__name__
            raise UserError(f"cannot write to '{self.folder}' ({reason}); pass an output folder you can write to") from None

    def _stale(self, holder: dict[str, Any]) -> bool:
        """A lock whose process is gone: same host and that pid is not alive (or is this process,
        which holds no such lock)."""
        if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
            return False
        if holder["pid"] == os.getpid():
            return self.path.resolve() not in _held
        return not pid_alive(holder["pid"])

    def _busy(self, holder: dict[str, Any]) -> UserError:
        who = (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}" if holder
               else "a run that is starting")
        return UserError(f"'{self.folder}' is in use by another run ({who}); wait for it to end or choose another "
                         f"output folder (if that run is gone, delete {self.path})")

    def acquire(self) -> RunLock:
        """Take the lock, or raise a :class:`UserError` naming the run that holds it."""
        if self.held or _secondary_rank():
            return self
        for _ in range(5):
            if self._try_create():
                self.held = True
                _held.add(self.path.resolve())
                return self
            holder = _read(self.path)
            if not holder and self.path.exists():
                raise self._busy(holder)  # unreadable or being written: never take it over
            if holder and not self._stale(holder):
                raise self._busy(holder)
            if holder:
                self._take_over(holder)
        raise self._busy(_read(self.path))

    def _take_over(self, holder: dict[str, Any]) -> None:
        """Move a stale lock aside; if it changed since it was read (a live run took it), put it back."""
        aside = self.folder / f".lock.stale.{os.getpid()}.{self.token}"
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return  # another run removed it first: try again
        if _read(aside) != holder:
            try:
                os.link(aside, self.path)
            except OSError:
                pass
            aside.unlink(missing_ok=True)
            raise self._busy(_read(self.path))
        aside.unlink(missing_ok=True)
        print(f"warning: taking over the lock of '{self.folder}' left by pid {holder.get('pid')} (started "
              f"{holder.get('started')}), which is no longer running", file=sys.stderr, flush=True)

    def release(self) -> None:
        """Remove the lock if this run holds it (a lock taken over by another run is left alone)."""
        if not self.held:
            return
        self.held = False
        _held.discard(self.path.resolve())
        if _read(self.path).get("token") == self.token:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def locked(folder: Callable[..., str | os.PathLike | None]) -> Callable[[F], F]:
    """Decorator: run the function holding the lock of ``folder(**its arguments)`` (None: no lock).

    ``@locked(lambda output, **_: output)`` locks a command's ``--output`` for as long as it runs,
    after checking that the folder can be written (the one place every command checks it).
    The signature and docstring stay the function's (``prune.py`` builds its options from them).
    """

    def wrap(function: F) -> F:
        signature = inspect.signature(function)

        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            path = folder(**bound.arguments)
            if path is None:
                return function(*args, **kwargs)
            check_writable(path)  # an unwritable folder fails here, before any work, with one line
            with RunLock(path):
                return function(*args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap
