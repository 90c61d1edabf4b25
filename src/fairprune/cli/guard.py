"""One rule for every command line: a user mistake prints one line, ``error: ...``, and exits
with status 2; anything else is a bug and keeps its traceback."""

from __future__ import annotations

import sys
from typing import Any, Callable

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
    errors raised while instantiating classes), or a command-line parsing error."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (UserError, ArgumentError)):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__
