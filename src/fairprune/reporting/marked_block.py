"""Generated text inside a Markdown page: a block between two marker lines that a command writes,
so a table on a page is what a run produced, never a hand copy.

A page holds a block named ``demo-table`` as::

    <!-- demo-table:start -->
    | method | accuracy |
    |---|---|
    | dense | 0.912 |
    <!-- demo-table:end -->

The markers are HTML comments, so GitHub and the documentation site show only the text between
them. :func:`replace_marked_block` rewrites that text and leaves every other line of the page as it
was; :func:`marked_block` reads it, to check a page against what a run wrote without touching it.
"""

from __future__ import annotations

import os
from pathlib import Path

from fairprune.errors import UserError
from fairprune.storage.atomic import write_text


def markers(name: str) -> tuple[str, str]:
    """The start and end marker lines of the block ``name``."""
    if not name or any(c.isspace() for c in name) or "--" in name:
        raise UserError(f"a block name is one word without '--', got {name!r}")
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def _span(lines: list[str], path: Path, name: str) -> tuple[int, int]:
    """The line numbers of the block's start and end markers (each alone on its line, once)."""
    start, end = markers(name)
    starts = [i for i, line in enumerate(lines) if line.strip() == start]
    ends = [i for i, line in enumerate(lines) if line.strip() == end]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        found = "none" if not starts and not ends else f"{len(starts)} start and {len(ends)} end marker(s)"
        raise UserError(f"{path} needs one '{start}' line followed by one '{end}' line around the block "
                        f"'{name}' ({found} found)")
    return starts[0], ends[0]


def _read(path: str | os.PathLike) -> tuple[Path, list[str]]:
    path = Path(path)
    try:
        return path, path.read_text(encoding="utf-8").splitlines(keepends=True)
    except FileNotFoundError:
        raise UserError(f"{path} does not exist: give the Markdown page that holds the block") from None


def marked_block(path: str | os.PathLike, name: str) -> str:
    """The text between the markers of block ``name`` in ``path`` (the marker lines excluded)."""
    path, lines = _read(path)
    start, end = _span(lines, path, name)
    return "".join(lines[start + 1:end])


def replace_marked_block(path: str | os.PathLike, name: str, text: str) -> bool:
    """Write ``text`` (Markdown) between the markers of block ``name`` in the page ``path``; every
    line outside the block stays as it was. The page is written atomically and only when the block
    changes; returns whether it changed. A page without the two markers is refused in one line."""
    path, lines = _read(path)
    start, end = _span(lines, path, name)
    if any(line.strip() in markers(name) for line in text.splitlines()):
        raise UserError(f"the text for block '{name}' of {path} holds one of its marker lines itself")
    body = text if not text or text.endswith("\n") else text + "\n"
    if "".join(lines[start + 1:end]) == body:
        return False
    write_text(path, "".join([*lines[:start + 1], body, *lines[end:]]))
    return True
