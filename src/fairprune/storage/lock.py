"""One run per output folder: a lock file, ``<folder>/.lock``, held while a run writes the folder.

The lock is a small JSON file (``pid``, ``host``, ``started``, ``command``, and where the system
tells them the process's start time ``pid_start`` and the ``boot_id``) created atomically (it
appears with its content or not at all), so a second run into the same folder refuses at once with
one line saying who holds it. A lock whose process is gone is taken over with a warning: same host
and the pid is not alive, or the pid is alive but is another process (its start time or the boot
differs: a pid reused after a reboot or a container restart). A lock of another host cannot be
checked and is never taken over (delete it by hand once that run is known to be gone). The lock is
released when the run ends, also on error; folders the lock created are removed again if the run
left them empty (refused, or failed before its first file).

The ranks of one multi-process run must not refuse their own run; which process is "another rank"
is decided from the processes themselves, never from ``RANK``-like variables (a stray one would
switch the lock off):

- while a ``torch.distributed`` group exists (torchrun's, made before the LM commands lock;
  Lightning's, before ``train.py``'s callback locks), only its rank 0 takes the lock;
- before any group exists, a process running the same command as the lock's live holder is a
  rank of the holder's run when the holder is its ancestor (Lightning's DDP launcher runs the
  command again in a child) or when both were started by one launch of torchrun or of a SLURM
  step with several tasks (recorded in the lock with the command's arguments: an id of one launch,
  which a second launch does not share): it takes no lock, in this folder or any other, for as long
  as it runs. A torchrun launch is told by its own rendezvous, never by what two launches share
  (``TORCHELASTIC_RUN_ID`` is ``none`` for every launch without ``--rdzv-id``): the store's
  address and a token the first of its ranks draws and the others read from the store; a SLURM
  step by ``SLURM_JOB_ID.SLURM_STEP_ID``;
- the rank 0 of a process group never follows another holder (the ranks of its run are its
  group's): a live lock of the same command is another run, and the whole group fails with its
  one line.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from fairprune.errors import UserError
from fairprune.storage.atomic import check_writable

LOCK_NAME = ".lock"
F = TypeVar("F", bound=Callable[..., Any])

_held: set[Path] = set()  # the locks this process holds (a second run in one process is refused too)
_launched_by: dict[str, Any] | None = None  # the lock holder whose run started this process, once seen


def _other_rank() -> bool:
    """True in a rank of a process group other than its first, and in a rank a locked run launched."""
    if _launched_by is not None:
        return True
    if "torch.distributed" not in sys.modules:  # no torch loaded, no process group: the lock needs no torch
        return False
    from fairprune import distributed

    return distributed.world()[0] != 0


def _in_group() -> bool:
    """A ``torch.distributed`` group of more than one process exists (checked without importing torch)."""
    if "torch.distributed" not in sys.modules:
        return False
    from fairprune import distributed

    return distributed.world()[1] > 1


def _agreed(take: Callable[[], None]) -> None:
    """``take()`` (the locks of one command), its refusal shared by every rank of a process group:
    rank 0 takes the locks and sends its error's message, or none, to the others (collective: every
    rank calls it), so every rank of a refused run ends with the same one line instead of waiting
    for a rank 0 that has gone. Alone, ``take()``."""
    if not _in_group():
        take()
        return
    from fairprune import distributed

    error = None
    try:
        take()
    except UserError as err:
        error = str(err)
    error = distributed.broadcast_text(error)
    if error is not None:
        raise UserError(error)


def _stat(pid: int) -> list[str] | None:
    """Fields 3 on of ``/proc/<pid>/stat`` (after the command name, which may hold spaces and
    parentheses), or None where there is no such file."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    _, bracket, rest = text.rpartition(")")
    fields = rest.split()
    return fields if bracket and len(fields) > 19 else None


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (field 22 of /proc/<pid>/stat);
    None where the system does not say."""
    fields = _stat(pid)
    try:
        return int(fields[19]) if fields else None
    except ValueError:
        return None


def boot_id() -> str | None:
    """This boot's id (Linux), None elsewhere: a pid and a start time mean one process within one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


_TOKEN_KEY = "fairprune/launch-token"
_launch_tokens: dict[tuple[str, str], str | None] = {}  # by store address: the token of this process's launch, once read


def _rendezvous_token() -> str | None:
    """A token of this torchrun launch alone: the first of its ranks to ask draws it and sets it in
    the launch's own store (torchrun's agent store, at ``MASTER_ADDR:MASTER_PORT``), the others read
    it there. None where there is no such store to ask."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if (addr, port) in _launch_tokens:
        return _launch_tokens[addr, port]
    token = None
    if addr and port.isdigit() and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        import datetime

        import torch.distributed as dist

        try:
            store = dist.TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))
            token = store.compare_set(_TOKEN_KEY, "", uuid.uuid4().hex).decode()  # the first token set wins
        except Exception:  # noqa: BLE001 - no store to ask: the launch is told by its address alone
            token = None
    _launch_tokens[addr, port] = token
    return token


def launch_id() -> str | None:
    """The id of the launch that started this process with others (torchrun, a SLURM step of
    several tasks); None for a process started alone. A torchrun launch's id comes from its own
    rendezvous (the store's address and the token :func:`_rendezvous_token` agreed on), never from
    what two launches of one command share alone (``TORCHELASTIC_RUN_ID`` is ``none`` for both
    where no ``--rdzv-id`` was given)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run:
        where = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
        token = _rendezvous_token()
        return f"torchelastic:{run}@{where}" + (f"#{token}" if token else "")
    job, step, tasks = (os.environ.get(name) for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NTASKS"))
    if job and step and (tasks or "").isdigit() and int(tasks) > 1:
        return f"slurm:{job}.{step}"
    return None


def _ancestors() -> list[int]:
    """The pids of this process's parent, its parent, ... (the parent alone where /proc is missing)."""
    found, pid = [], os.getppid()
    while pid > 0 and pid not in found and len(found) < 64:
        found.append(pid)
        fields = _stat(pid)
        if fields is None:
            break
        try:
            pid = int(fields[1])
        except ValueError:
            break
    return found


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
        self._made: list[Path] = []  # the folders acquire() created, deepest first

    def _info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "command": " ".join(sys.argv), "argv": sys.argv[1:], "pid_start": process_start(os.getpid()),
                "boot_id": boot_id(), "launch": launch_id(), "token": self.token}

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
            for attempt in range(3):
                missing = [p for p in (self.folder, *self.folder.parents) if not p.exists()]
                self.folder.mkdir(parents=True, exist_ok=True)
                self._made += [p for p in missing if p not in self._made]
                try:
                    return self._create()
                except FileNotFoundError:  # removed meanwhile, empty, by a run releasing its lock: make it again
                    if attempt == 2 or self.folder.is_dir():
                        raise
        except OSError as err:
            if self.folder.exists() and not self.folder.is_dir():
                raise UserError(f"'{self.folder}' is a file, not a folder; pass an output folder to write the run to") from None
            reason = err.strerror or type(err).__name__
            raise UserError(f"cannot write to '{self.folder}' ({reason}); pass an output folder you can write to") from None

    @staticmethod
    def _reused(holder: dict[str, Any]) -> bool:
        """The lock's pid names another process now: another boot, or a start time other than the
        one recorded (only what both the lock and the system tell is compared)."""
        boot = boot_id()
        if isinstance(holder.get("boot_id"), str) and boot is not None and holder["boot_id"] != boot:
            return True
        start = process_start(holder["pid"])
        return isinstance(holder.get("pid_start"), int) and start is not None and holder["pid_start"] != start

    def _stale(self, holder: dict[str, Any]) -> bool:
        """A lock whose process is gone: same host and that pid is not alive, or names another
        process now, or is this process, which holds no such lock."""
        if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
            return False
        if self._reused(holder):
            return True
        if holder["pid"] == os.getpid():
            return self.path.resolve() not in _held
        return not pid_alive(holder["pid"])

    @staticmethod
    def _launched_this(holder: dict[str, Any]) -> bool:
        """The (live, not reused) holder and this process run the same command as ranks of one
        run, not as two runs: one launch started both (any host), or the holder started this
        process. An ancestor must have recorded its start time where the system tells it, so an
        old lock of an ancestor is never followed. The rank 0 of a process group follows no one:
        its run's ranks are its group's, so a holder is another run."""
        if holder.get("argv") != sys.argv[1:] or _in_group():
            return False
        launch = launch_id()
        if launch is not None and holder.get("launch") == launch:
            return True
        if holder.get("host") != socket.gethostname() or holder.get("pid") not in _ancestors():
            return False
        return process_start(holder["pid"]) is None or isinstance(holder.get("pid_start"), int)

    def _busy(self, holder: dict[str, Any]) -> UserError:
        command = " ".join(str(holder.get("command") or "").split())
        command = f": {command[:97]}..." if len(command) > 100 else f": {command}" if command else ""
        who = (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}{command}" if holder
               else "a run that is starting")
        return UserError(f"'{self.folder}' is in use by another run ({who}); wait for it to end or choose another "
                         f"output folder (if that run is gone, delete {self.path})")

    def acquire(self) -> RunLock:
        """Take the lock, or raise a :class:`UserError` naming the run that holds it."""
        global _launched_by
        if self.held or _other_rank():
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
                if self._launched_this(holder):
                    # Every folder this rank goes on to "write" is its run's, locked by the holder.
                    _launched_by = holder
                    return self
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
        reused = f" (pid {holder.get('pid')} is another process now)" if self._reused(holder) else ""
        print(f"warning: taking over the lock of '{self.folder}' left by pid {holder.get('pid')} (started "
              f"{holder.get('started')}), which is no longer running{reused}", file=sys.stderr, flush=True)

    def release(self) -> None:
        """Remove the lock if this run holds it (a lock taken over by another run is left alone)."""
        if not self.held:
            return
        self.held = False
        _held.discard(self.path.resolve())
        if _read(self.path).get("token") == self.token:
            self.path.unlink(missing_ok=True)
        # A run that wrote nothing (refused or failed before its first file) leaves no empty folders.
        for folder in self._made:
            try:
                folder.rmdir()
            except OSError:  # not empty (a run's files, another run's lock): kept, and its parents too
                break
        self._made = []

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


Folders = str | os.PathLike | Sequence[str | os.PathLike] | None


def _paths(found: Folders) -> list[Path]:
    if found is None:
        return []
    return [Path(found)] if isinstance(found, (str, os.PathLike)) else [Path(p) for p in found if p is not None]


def check_apart(outputs: Sequence[str | os.PathLike], inputs: Sequence[str | os.PathLike], option: str = "--output") -> None:
    """Refuse, in one line and before anything is written, an output that is an input the run
    reads, lies inside one, or holds one: writing it would replace the input (a model folder
    pruned into itself loses its weights). Inputs that are not on disk (a hub name) are skipped;
    paths are compared resolved, so a symlink or ``..`` cannot hide the overlap."""
    for source in inputs:
        src = Path(source)
        if not src.exists():
            continue
        real = src.resolve()
        for out in outputs:
            target = Path(out).resolve()
            if target == real:
                how = "is"
            elif real in target.parents:
                how = "lies inside"
            elif target in real.parents:
                how = "holds"
            else:
                continue
            raise UserError(f"{option} '{out}' {how} the input '{source}' the run reads; writing there would replace "
                            f"it: choose an output outside '{source}'")


def locked(folder: Callable[..., Folders], reads: Callable[..., Folders] | None = None) -> Callable[[F], F]:
    """Decorator: run the function holding the lock of ``folder(**its arguments)`` (None: no lock);
    a sequence of folders (a compare's output and its cells) is locked as one, in order, the first
    being the command's output. ``reads(**its arguments)``: the inputs the run reads from disk (a
    model folder, a checkpoint), which no locked folder may be, lie inside or hold
    (:func:`check_apart`).

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
            paths = _paths(folder(**bound.arguments))
            if not paths:
                return function(*args, **kwargs)
            if reads is not None:
                check_apart(paths, _paths(reads(**bound.arguments)))
            check_writable(paths[0])  # an unwritable folder fails here, before any work, with one line
            with contextlib.ExitStack() as locks:

                def take() -> None:
                    for path in dict.fromkeys(paths):  # a folder named twice is one folder
                        locks.enter_context(RunLock(path))

                _agreed(take)
                return function(*args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap
