"""Reading torch checkpoint files as data, never as code.

A torch file is a pickle, and unpickling a crafted one can call any function. Every checkpoint
fairprune reads goes through :func:`read_checkpoint` (``weights_only=True``: tensors, numbers,
strings and containers, nothing else) and the checkpoints it writes hold only such values, so no
allow-list is needed. Anything else, and a file that is missing, cut short or not a checkpoint, is
a one-line :class:`~fairprune.errors.UserError`.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

from fairprune.errors import UserError

#: The one sentence every refusal of a crafted file ends with.
WRITTEN_BY_TRAIN = "pass a checkpoint written by train.py (or prune.py vision), e.g. <run>/checkpoints/last.ckpt"


def holds_code(err: BaseException) -> str | None:
    """For ``torch.load(weights_only=True)``'s refusal of a pickle that would build or call
    something other than plain data: what it refused (e.g. ``posix.system``); None for any other
    error (a file cut short, not a pickle)."""
    text = str(err)
    if not isinstance(err, pickle.UnpicklingError) or "weights only load failed" not in text.lower():
        return None
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return found.group(1)
    # The other refusals of an object to build or call; "Unsupported operand" and the like mean the
    # file is no pickle at all (a text file), not that it holds code.
    found = re.search(r"(reduce for unrecognized function \S+|Can only (?:create new object|build) [^.]*)", text)
    return found.group(1).strip() if found else None


def load_error_reason(err: BaseException, limit: int = 120) -> str:
    """A short reason for a failed ``torch.load`` (weights-only refusals carry a page of advice)."""
    text = str(err)
    found = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    reason = " ".join((found.group(1) if found else text).split())[:limit]
    return f"{type(err).__name__}: {reason}" if reason else type(err).__name__


def code_refused(what: str, path: str | Path, refused: str, hint: str = WRITTEN_BY_TRAIN) -> UserError:
    """The one-line refusal of a file :func:`holds_code` found code in."""
    return UserError(f"{what} '{path}' holds code or objects fairprune does not load ({refused}), not just weights "
                     f"and numbers; nothing in it was run; {hint}")


def read_checkpoint(path: str | Path, what: str = "checkpoint", hint: str = WRITTEN_BY_TRAIN,
                    raw: bytes | None = None) -> dict[str, Any]:
    """The dictionary a checkpoint file holds, loaded as data on the CPU (``weights_only=True``).

    ``what`` names the option in messages (``--resume``, ``--ckpt_path``); ``hint`` says what to
    pass instead; ``raw``: the file's bytes, when the caller has read them (the file is not read
    again)."""
    import io

    import torch

    path = _existing(path, what, hint)
    try:
        state = torch.load(path if raw is None else io.BytesIO(raw), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, RuntimeError, ValueError, OSError, AttributeError,
            ImportError, IndexError, KeyError, TypeError) as err:
        refused = holds_code(err)
        if refused is not None:
            raise code_refused(what, path, refused, hint) from None
        raise UserError(f"{what} '{path}' is not a torch checkpoint (cut short, or another kind of file: "
                        f"{load_error_reason(err)}); {hint}") from None
    if not isinstance(state, dict):
        raise UserError(f"{what} '{path}' holds a {type(state).__name__}, not a checkpoint dictionary; {hint}")
    return state


def _existing(path: str | Path, what: str, hint: str) -> Path:
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} '{path}' is a directory, not a checkpoint file; {hint}")
    if not path.is_file():
        raise UserError(f"{what} '{path}' does not exist; {hint}")
    return path


def read_bytes(path: str | Path, what: str = "checkpoint", hint: str = WRITTEN_BY_TRAIN) -> bytes:
    """A checkpoint file's bytes (to read once and load from memory); refused as :func:`read_checkpoint` refuses."""
    path = _existing(path, what, hint)
    try:
        return path.read_bytes()
    except OSError as err:
        raise UserError(f"{what} '{path}' is not a torch checkpoint (cut short, or another kind of file: "
                        f"{load_error_reason(err)}); {hint}") from None


def state_dict_mismatch(err: BaseException) -> str | None:
    """For torch's refusal to load a state dict into a model it does not fit (``Error(s) in
    loading state_dict``: a tensor of another shape, a key missing or unexpected), its first
    reason on one line; None for any other error."""
    text = str(err)
    if not isinstance(err, RuntimeError) or "Error(s) in loading state_dict" not in text:
        return None
    reasons = [line.strip() for line in text.splitlines()[1:] if line.strip()]
    first = " ".join((reasons[0] if reasons else text).split())
    return first[:200] + ("..." if len(first) > 200 else "")
