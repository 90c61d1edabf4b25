"""User-facing errors.

A :class:`UserError` is a mistake in what the user gave us (a path, a name, a number out of
range). The command-line entry points print it as one line, ``error: <message>``, and exit
with status 2, without a traceback. Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(ValueError):
    """Bad user input. The message says what is wrong and how to fix it, on one line."""


def suggest(name: str, choices: Iterable[str], n: int = 3) -> str:
    """Return ' (did you mean: a, b?)' for the closest names, or '' when none is close."""
    close = difflib.get_close_matches(name, list(dict.fromkeys(choices)), n=n, cutoff=0.5)
    return f" (did you mean: {', '.join(close)}?)" if close else ""
