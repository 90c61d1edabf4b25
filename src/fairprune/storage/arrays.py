"""``.npz`` files read as data: their sizes checked before numpy inflates them.

An ``.npz`` is a zip of ``.npy`` members, and a zip member's stated size is what it inflates to:
a few megabytes of zeros can state gigabytes. :func:`open_npz` refuses a file whose members would
inflate past a bound before any is read, and never unpickles (``allow_pickle=False``).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np

#: What the members of one ``.npz`` may inflate to together (per-item outcomes of a test split or
#: an evaluation: 8 bytes an item, far below this for any real set).
MAX_NPZ_BYTES = 256 * 1024 * 1024


class TooLarge(ValueError):
    """An ``.npz`` whose members would inflate past the bound (the message says how far)."""


def open_npz(path: str | os.PathLike, limit: int = MAX_NPZ_BYTES):
    """``np.load(path, allow_pickle=False)`` once the zip's stated member sizes add up to at most
    ``limit`` bytes (else :class:`TooLarge`; a file that is not a zip is left to numpy)."""
    try:
        with zipfile.ZipFile(Path(path)) as archive:
            stated = sum(info.file_size for info in archive.infolist())
    except zipfile.BadZipFile:
        stated = 0
    if stated > limit:
        raise TooLarge(f"its arrays would take {stated / 2**20:,.0f} MiB once read, more than the {limit / 2**20:,.0f} MiB "
                       "allowed (a damaged or crafted file)")
    return np.load(path, allow_pickle=False)
