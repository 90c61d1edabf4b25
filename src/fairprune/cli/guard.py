"""One rule for every command line: a user mistake prints one line, ``error: ...``, and exits
with status 2; anything else is a bug and keeps its traceback."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any

from jsonargparse import ArgumentError

from fairprune.errors import UserError


def guarded(run: Callable[[], Any]) -> int:
    """Run ``run``; a user mistake prints one line and gives status 2, a bug keeps its traceback."""
    try:
        run()
    except Exception as err:  # noqa: BLE001 - re-raised unless it is the user's mistake
        user = user_error_in(err)
        if user is None:
            raise
        print(f"error: {one_line(user)}", file=sys.stderr)
        return 2
    return 0


def user_error_in(err: BaseException) -> BaseException | None:
    """The user mistake behind ``err``: itself, or a UserError it wraps (jsonargparse wraps
    errors raised while instantiating classes), a command-line parsing error, or Lightning's
    refusal of the Trainer's hardware settings."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (UserError, ArgumentError)):
            return err
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
