"""User-facing errors.

A :class:`UserError` is a mistake in what the user gave us (a path, a name, a number out of
range). The command-line entry points print it as one line, ``error: <message>``, and exit
with status 2, without a traceback. A :class:`Stopped` run (SIGTERM, Ctrl-C) is one line too,
with status 143 or 130. Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(ValueError):
    """Bad user input. The message says what is wrong and how to fix it, on one line."""


class Stopped(BaseException):
    """A run stopped from outside: ``SIGTERM`` (a scheduler preempting or cancelling the job) or
    Ctrl-C. A ``BaseException``, like ``KeyboardInterrupt``, so no ``except Exception`` on its way
    out swallows it. The command line prints it as one line, ``error: <message>``, and exits with
    :attr:`status`: 128 + the signal's number, as a shell reports a process the signal ended (143
    for SIGTERM, 130 for Ctrl-C), so a scheduler records the run as stopped, never as finished, and a
    requeue script tells it from a user mistake (status 2).

    Args:
        cause: ``"SIGTERM"`` or ``"Ctrl-C"``.
        where: where the run was, e.g. ``"at epoch 3"`` (empty: not known).
        advice: what to do next, e.g. how to resume.
    """

    def __init__(self, cause: str = "SIGTERM", where: str = "", advice: str = "run the same command again") -> None:
        super().__init__(cause, where, advice)
        self.cause, self.where, self.advice = cause, where, advice

    @property
    def status(self) -> int:
        return 130 if self.cause == "Ctrl-C" else 143

    def __str__(self) -> str:
        what = "interrupted (Ctrl-C)" if self.cause == "Ctrl-C" else f"stopped by {self.cause}"
        return f"{what}{' ' + self.where if self.where else ''}; {self.advice}"

    @classmethod
    def behind(cls, err: BaseException) -> Stopped | None:
        """The stop ``err`` stands for, or None: itself; Lightning's ``SIGTERMException`` (a
        ``SystemExit`` its loops raise after a SIGTERM); the ``SystemExit(1)`` Lightning raises
        after catching Ctrl-C; a plain ``KeyboardInterrupt``. Told apart by name, so that this
        module needs no Lightning."""
        if isinstance(err, Stopped):
            return err
        if isinstance(err, KeyboardInterrupt):
            return cls("Ctrl-C")
        if isinstance(err, SystemExit):
            if type(err).__name__ == "SIGTERMException":
                return cls("SIGTERM")
            if isinstance(err.__context__, KeyboardInterrupt):
                return cls("Ctrl-C")
        return None


def stop_in(err: BaseException, place: str, advice: str) -> None:
    """Raise ``err`` as a :class:`Stopped` of ``place`` (a compare's cell) with ``advice`` when it
    is a stop; return when it is not (the caller raises it as it is). Here, beside :class:`Stopped`,
    so that an LM run, which has no Trainer, does not import Lightning for it."""
    stop = Stopped.behind(err)
    if stop is not None:
        raise Stopped(stop.cause, f"{stop.where} of {place}" if stop.where else f"in {place}", advice) from None


def suggest(name: str, choices: Iterable[str], n: int = 3) -> str:
    """Return ' (did you mean: a, b?)' for the closest names, or '' when none is close."""
    close = difflib.get_close_matches(name, list(dict.fromkeys(choices)), n=n, cutoff=0.5)
    return f" (did you mean: {', '.join(close)}?)" if close else ""
