"""Reading files the user names: a missing or unreadable file is a one-line UserError.

CSV tables, plain text (a file or a folder of ``*.txt``) and chat rows in UltraChat's jsonl form
(:func:`read_chat_jsonl`)."""

from __future__ import annotations

import json
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


def read_calib_text(path: str | Path) -> str | Chats:
    """What ``--calib_text`` names: chat rows (:func:`read_chat_jsonl`) for a ``.jsonl`` file or a
    file whose content is chat jsonl (:func:`is_chat_jsonl`), else plain text (:func:`read_text`)."""
    return read_chat_jsonl(path) if is_chat_jsonl(path) else read_text(path)


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text (byte {err.start}); save it as UTF-8") from None


# --------------------------------------------------------------------------------------------
# Chat rows (UltraChat jsonl) for calibration
# --------------------------------------------------------------------------------------------

CHAT_ROLES = ("system", "user", "assistant")
CHAT_FORMAT = ('one JSON object per line, {"prompt": ..., "prompt_id": ..., "messages": [{"role": "user" or '
               '"assistant", "content": "..."}, ...]} (HuggingFaceH4/ultrachat_200k rows)')


class Chats(list):
    """Rows of a chat jsonl file, each a list of ``{"role", "content"}`` messages (roles ``system``,
    ``user``, ``assistant``); ``source``: the file, ``lines``: each row's line number in it. The
    rows are rendered where the tokenizer is known (:func:`fairprune.data.text.render_chats`)."""

    def __init__(self, rows: list[list[dict[str, str]]], source: str, lines: list[int]):
        super().__init__(rows)
        self.source, self.lines = source, list(lines)


def is_chat_jsonl(path: str | Path) -> bool:
    """Whether ``path`` holds chat rows: a ``.jsonl`` file, or a file whose first non-blank line is
    a JSON object with a ``messages`` list (chat rows saved under another name)."""
    path = Path(path)
    if path.suffix.lower() == ".jsonl":
        return True
    if not path.is_file():
        return False
    try:
        with path.open(encoding="utf-8", errors="replace") as handle:
            first = next((line for line in handle if line.strip()), "")
        row = json.loads(first)
    except (OSError, ValueError):
        return False
    return isinstance(row, dict) and isinstance(row.get("messages"), list)


def read_chat_jsonl(path: str | Path) -> Chats:
    """UltraChat-style chat rows (``HuggingFaceH4/ultrachat_200k``): one JSON object per line with
    a ``messages`` list of ``{"role", "content"}`` (``prompt`` / ``prompt_id`` are not needed and
    not read). Blank lines are skipped. A missing file, a line that is not such an object or a
    message without a known role and a string content is a one-line :class:`UserError` naming the
    file and the line."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"chat file {path} is a directory; give the .jsonl file itself ({CHAT_FORMAT})")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"chat file '{path}' does not exist; give a .jsonl file of {CHAT_FORMAT}") from None
    except OSError as err:
        raise UserError(f"chat file '{path}' cannot be read ({err.strerror or type(err).__name__})") from None
    rows, lines = [], []
    for number, line in enumerate(raw.splitlines(), start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise UserError(f"{path}: line {number} is not UTF-8 text (byte {err.start} of the line); save it as UTF-8") from None
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except ValueError as err:
            reason = f"{err.msg} at column {err.colno}" if isinstance(err, json.JSONDecodeError) else str(err)
            raise UserError(f"{path}: line {number} is not valid JSON ({reason}); expected {CHAT_FORMAT}") from None
        rows.append(_chat_messages(row, path, number))
        lines.append(number)
    if not rows:
        raise UserError(f"{path}: no chat rows; expected {CHAT_FORMAT}")
    return Chats(rows, str(path), lines)


def _chat_messages(row: Any, path: Path, number: int) -> list[dict[str, str]]:
    where = f"{path}: line {number}"
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
        got = "an object without a 'messages' list" if isinstance(row, dict) else f"a JSON {type(row).__name__}"
        raise UserError(f"{where} is {got}; expected {CHAT_FORMAT}")
    if not row["messages"]:
        raise UserError(f"{where} has an empty 'messages' list; each row needs at least one message")
    messages = []
    for k, message in enumerate(row["messages"], start=1):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in CHAT_ROLES or not isinstance(content, str):
            raise UserError(f"{where}, message {k}: needs a 'role' ({', '.join(CHAT_ROLES)}) and a string 'content', "
                            f"got {_short(message)}")
        messages.append({"role": role, "content": content})
    return messages


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."
