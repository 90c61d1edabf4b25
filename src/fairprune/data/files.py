"""Reading files the user names: a missing or unreadable file is a one-line UserError."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fairprune.errors import UserError

if TYPE_CHECKING:
    import pandas as pd


def read_user_csv(path: str | Path, what: str, expected: str, **read_csv: Any) -> pd.DataFrame:
    """``pandas.read_csv`` of a user's file; ``what`` names the file kind, ``expected`` its columns.

    ``read_csv`` goes to :func:`pandas.read_csv` (``dtype``, ``sep``, ``header``, ...). A missing
    file, a folder, a file that is not UTF-8 text or not CSV is a :class:`UserError` naming the file.
    """
    import pandas as pd
    try:
        return pd.read_csv(path, **read_csv)
    except FileNotFoundError:
        raise UserError(f"{what} file not found: {path}") from None
    except IsADirectoryError:
        raise UserError(f"{what} file {path} is a directory; give the file itself ({expected})") from None
    except UnicodeDecodeError as err:
        byte = err.object[err.start:err.start + 1].hex() if isinstance(err.object, bytes) else "?"
        raise UserError(f"{path}: not a readable CSV (UnicodeDecodeError: byte 0x{byte} is not UTF-8); "
                        f"save it as UTF-8 text with {expected}") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        raise UserError(f"{path}: not a readable CSV ({type(err).__name__}); expected {expected}") from None


def read_text(path: str | Path) -> str:
    """A text file, or every ``*.txt`` of a folder joined with blank lines."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise UserError(f"folder '{path}' holds no .txt files; give a text file or a folder of them")
        return "\n\n".join(_read_utf8(f) for f in files)  # documents joined by a blank line
    if not path.is_file():
        raise UserError(f"text file '{path}' does not exist; give a path to a .txt file (or leave it unset for the bundled corpus)")
    return _read_utf8(path)


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text (byte {err.start}); save it as UTF-8") from None
