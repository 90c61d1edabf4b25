"""Reading files the user names: a missing or unreadable file is a one-line UserError."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fairprune.errors import UserError


def read_user_csv(path: str | Path, what: str, expected: str) -> pd.DataFrame:
    """``pandas.read_csv`` of a user's file; ``what`` names the file kind, ``expected`` its columns."""
    try:
        return pd.read_csv(path)
    except FileNotFoundError:
        raise UserError(f"{what} file not found: {path}") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: not a readable CSV ({type(err).__name__}); expected {expected}") from None
