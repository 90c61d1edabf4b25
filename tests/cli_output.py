"""What a command printed: the one-line error a user mistake must end in."""

from __future__ import annotations


def last_error(capsys) -> str:
    """The last stderr line, which must be ``error: ...``, with no traceback before it."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith("error: ")
    return last
