"""One rule for every command line: a user mistake prints one line, ``error: ...``, and exits
with status 2; a run stopped from outside prints one line too and exits with status 143 (SIGTERM)
or 130 (Ctrl-C); anything else is a bug and keeps its traceback.

- SIGTERM (a scheduler preempting or cancelling the job) raises :class:`~fairprune.errors.Stopped`
  wherever the command is, as Ctrl-C raises ``KeyboardInterrupt``, except while a Lightning Trainer
  runs: Lightning then takes the signal itself and stops at the next batch boundary (see
  :mod:`fairprune.callbacks.signals`, which keeps a checkpoint there).
- Lightning's informational start-up lines (``Seed set to 0``, which accelerators are available,
  its tips) are not shown, so that a command that fails on a mistake prints its ``error:`` line
  alone; Lightning's warnings still are.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from jsonargparse import ArgumentError

from fairprune.errors import Stopped, UserError

#: Loggers whose INFO lines are start-up chatter: the seed, the hardware found, tips, and the notes
#: of Lightning's rank-zero helper (e.g. "Detected KeyboardInterrupt, attempting graceful shutdown").
QUIET_LOGGERS = ("lightning.fabric.utilities.seed", "lightning.fabric.utilities.rank_zero",
                 "lightning.pytorch.utilities.rank_zero", "lightning.pytorch.accelerators.cuda")


#: What the operating system says when a write cannot fit (a full disk, a quota, a file-size limit):
#: not a bug, one line.
REFUSED_WRITES = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def guarded(run: Callable[[], Any]) -> int:
    """Run ``run``; a user mistake prints one line and gives status 2, a stopped run one line and
    status 143 / 130, a bug keeps its traceback."""
    quiet_library_logs()
    with _signals_handled():
        try:
            run()
        except BaseException as err:  # noqa: BLE001 - re-raised unless it is a stop or the user's mistake
            stop = Stopped.behind(err)
            if stop is not None:
                print(f"error: {one_line(stop)}", file=sys.stderr, flush=True)
                return stop.status
            user = user_error_in(err) if isinstance(err, Exception) else None
            if user is None:
                raise
            print(f"error: {one_line(user)}", file=sys.stderr)
            return 2
    return 0


def quiet_library_logs() -> None:
    """Show only warnings and errors of :data:`QUIET_LOGGERS` (set before Lightning is imported,
    the levels hold: Lightning's modules get these same logger objects)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


@contextlib.contextmanager
def _signals_handled() -> Iterator[None]:
    """While inside, SIGTERM raises :class:`Stopped` in this process (signals reach the main thread
    only, so elsewhere nothing changes). The SIGTERM and SIGINT handlers of before come back after
    (Lightning ignores SIGINT once it caught a Ctrl-C: a caller that goes on, such as ``make demo``
    or a test, gets its Ctrl-C back)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()
    interrupt = signal.getsignal(signal.SIGINT)

    def on_sigterm(signum: int, frame: Any) -> None:
        # A running Lightning Trainer calls this from its own handler: it stops at the next batch.
        # A forked worker (a DataLoader's) leaves the stop to the main process, as under Lightning's
        # handler: a worker dying first would end the main process with "worker killed" instead.
        if signal.getsignal(signal.SIGTERM) is not on_sigterm or os.getpid() != owner:
            return
        raise Stopped("SIGTERM")

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        for signum, handler in ((signal.SIGTERM, previous), (signal.SIGINT, interrupt)):
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # None: set outside Python


def user_error_in(err: BaseException) -> BaseException | None:
    """The user mistake behind ``err``: itself, or a UserError it wraps (jsonargparse wraps
    errors raised while instantiating classes), a command-line parsing error, or Lightning's
    refusal of the Trainer's hardware settings."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (UserError, ArgumentError)):
            return err
        if isinstance(err, OSError) and err.errno in REFUSED_WRITES:
            where = f" '{err.filename}'" if err.filename else ""
            return UserError(f"cannot write{where} ({err.strerror or err}); free some space there (or write elsewhere) "
                             "and run the command again")
        if _hardware_settings_refused(err):
            return UserError(f"trainer settings: {one_line(err)} (--trainer.accelerator cpu or auto runs on what "
                             "this machine has)")
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _hardware_settings_refused(err: BaseException) -> bool:
    """Lightning's accelerator connector checks only the user's ``accelerator`` / ``devices`` /
    ``strategy`` / ``precision`` against the machine (e.g. ``accelerator: gpu`` where there is
    none): what it refuses is a setting to change, not a bug. Other Lightning misconfigurations
    (a LightningModule without a training step, say) keep their traceback."""
    if type(err).__name__ != "MisconfigurationException":
        return False
    return any("accelerator_connector" in frame.filename for frame in traceback.extract_tb(err.__traceback__))


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__
