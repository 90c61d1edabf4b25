"""A user's ``--task_data`` file checked against its data set's public format, before any model loads.

Each format (BBQ, HellaSwag, MMLU as JSON lines or parquet; CrowS-Pairs' CSV) names the fields lm-eval
reads and their types; :func:`check_format` reads the file one row at a time and refuses, in one line
naming the file, the line and the field, the first row that lacks a field, has the wrong type, or a
value out of range (a BBQ label outside 0-2, an MMLU answer outside 0-3), and a file or line past
its size bound. Nothing is repaired: a reader only reads.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fairprune.errors import UserError

NAMES = ("bbq", "hellaswag", "mmlu", "crows_pairs", "unqover")

# --- Checking a user's file --------------------------------------------------------------------

# name -> (the format, where the public set is published, the fields lm-eval reads and their types)
_FORMATS: dict[str, tuple[str, str, dict[str, type | tuple[type, ...]]]] = {
    "bbq": ("BBQ JSON lines", "github.com/nyu-mll/BBQ data/*.jsonl", {
        "example_id": int, "question_polarity": str, "context_condition": str, "category": str, "answer_info": dict,
        "additional_metadata": dict, "context": str, "question": str, "ans0": str, "ans1": str, "ans2": str, "label": int}),
    "hellaswag": ("HellaSwag JSON lines", "github.com/rowanz/hellaswag data/hellaswag_val.jsonl", {
        "activity_label": str, "ctx_a": str, "ctx_b": str, "endings": list, "label": (int, str)}),
    "mmlu": ("MMLU JSON lines or parquet", "huggingface.co/datasets/cais/mmlu", {
        "question": str, "subject": str, "choices": list, "answer": int}),
    "crows_pairs": ("the CrowS-Pairs CSV", "github.com/nyu-mll/crows-pairs data/crows_pairs_anonymized.csv", {
        "sent_more": str, "sent_less": str, "stereo_antistereo": str, "bias_type": str}),
}
#: A task file's bounds: the public sets' rows take kilobytes, their files megabytes.
MAX_ROW_BYTES = 1024 * 1024
MAX_FILE_BYTES = 2 * 1024**3
_ALLOWED = {"context_condition": ("ambig", "disambig"), "question_polarity": ("neg", "nonneg"),
            "stereo_antistereo": ("stereo", "antistereo")}


def _refuse(name: str, path: Path, reason: str) -> UserError:
    what, where, fields = _FORMATS[name]
    reason = " ".join(str(reason).split())  # one line, whatever an exception said
    kinds = ", ".join(f"{k} ({' or '.join(t.__name__ for t in (v if isinstance(v, tuple) else (v,)))})" for k, v in fields.items())
    expected = f"columns {', '.join(fields)}" if name == "crows_pairs" else f"rows with {kinds}"
    return UserError(f"--task_data {name}={path}: {reason}; expected {what}, {expected} (the public set: {where})")


def _row_problem(name: str, row, n: str) -> str | None:
    if not isinstance(row, dict):
        return f"{n} is not an object"
    for field, types in _FORMATS[name][2].items():
        if field not in row:
            return f"{n} lacks the field {field!r}"
        if not isinstance(row[field], types) or (types is int and isinstance(row[field], bool)):
            return f"{n} has {field} of type {type(row[field]).__name__}"
        if field in _ALLOWED and row[field] not in _ALLOWED[field]:
            return f"{n} has {field} {row[field]!r}, not {' or '.join(_ALLOWED[field])}"
    if name == "mmlu" and not (len(row["choices"]) == 4 and 0 <= row["answer"] < 4):
        return f"{n} needs 4 choices and an answer 0-3"
    if name == "hellaswag" and (len(row["endings"]) != 4 or str(row["label"]) not in ("0", "1", "2", "3")):
        return f"{n} needs 4 endings and a label 0-3"
    if name == "bbq" and not (isinstance(row["additional_metadata"].get("stereotyped_groups"), list)
                              and all(isinstance(row["answer_info"].get(f"ans{i}"), list) for i in range(3))):
        return f"{n} needs additional_metadata.stereotyped_groups and answer_info.ans0-ans2 (lists)"
    if name == "bbq":
        answers = [row[f"ans{i}"].strip() for i in range(3)]
        empty = [f"ans{i}" for i, a in enumerate(answers) if not a]
        if empty:
            return f"{n} has an empty {empty[0]} (every BBQ question has three non-empty answers)"
        same = next(((i, j) for i in range(3) for j in range(i + 1, 3) if answers[i] == answers[j]), None)
        if same:
            return f"{n} has ans{same[0]} equal to ans{same[1]} ({answers[same[0]]!r}): the three answers must differ"
    if name == "bbq" and row["label"] not in (0, 1, 2):
        return f"{n} has label {row['label']}, not 0, 1 or 2 (the index of the right answer among ans0-ans2)"
    return None


def _lines(name: str, path: Path) -> Iterator[tuple[int, str]]:
    """The file's non-blank lines, numbered, read one at a time: a line longer than
    :data:`MAX_ROW_BYTES` or text that is not UTF-8 is refused naming the line."""
    try:
        with path.open("rb") as handle:
            n = 0
            while raw := handle.readline(MAX_ROW_BYTES + 1):
                n += 1
                if len(raw) > MAX_ROW_BYTES and not raw.endswith(b"\n"):
                    raise _refuse(name, path, f"line {n} is longer than {MAX_ROW_BYTES // 2**20} MiB (the public sets' rows "
                                              "take a few kilobytes)")
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise _refuse(name, path, f"line {n} is not UTF-8 text (byte 0x{raw[err.start:err.start + 1].hex()})") from None
                if line.strip():
                    yield n, line
    except OSError as err:
        raise _refuse(name, path, f"cannot be read ({type(err).__name__})") from None


def _rows(name: str, path: Path) -> Iterator[tuple[str, Any]]:
    """Every row of a task file, with where it is (``row 12``, ``line 12``), read as lm-eval will
    read it (JSON lines, parquet, or CrowS-Pairs' CSV), one at a time."""
    if path.suffix.lower() == ".parquet" and name != "crows_pairs":
        try:
            import pyarrow.parquet as pq

            n = 0
            for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
                for row in batch.to_pylist():
                    n += 1
                    yield f"row {n}", row
        except UserError:
            raise
        except Exception as err:  # pyarrow raises several kinds for a file that is not parquet
            raise _refuse(name, path, f"not a readable parquet file ({type(err).__name__})") from None
        return
    if name == "crows_pairs":  # csv's own reader, lazily: a quoted field may hold a line break
        try:
            with path.open("rb") as raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as text:
                reader = csv.reader(text)  # a field past csv's limit (128 KiB) is a csv.Error
                header = next(reader, None)
                missing = [c for c in _FORMATS[name][2] if c not in (header or [])]
                if header is not None and missing:
                    raise _refuse(name, path, f"the header lacks {', '.join(missing)}")
                for cells in reader:
                    if not cells:
                        continue
                    if len(cells) != len(header):
                        raise _refuse(name, path, f"line {reader.line_num} has {len(cells)} cells, the header {len(header)}")
                    yield f"line {reader.line_num}", dict(zip(header, cells))
        except UnicodeDecodeError as err:
            raise _refuse(name, path, f"not UTF-8 text (byte 0x{err.object[err.start:err.start + 1].hex()})") from None
        except csv.Error as err:
            raise _refuse(name, path, f"not a readable CSV ({err})") from None
        except OSError as err:
            raise _refuse(name, path, f"cannot be read ({type(err).__name__})") from None
        return
    for n, line in _lines(name, path):
        try:
            yield f"line {n}", json.loads(line)
        except json.JSONDecodeError as err:
            hint = " (a JSON array, not JSON lines?)" if n == 1 and line.lstrip().startswith("[") else ""
            raise _refuse(name, path, f"line {n} is not JSON ({err.msg}){hint}") from None


def check_format(name: str, path: str | Path) -> None:
    """Refuse (one-line :class:`UserError`, naming the file, the line and the field) a task file that is
    missing or not in the task's public format: UTF-8 text (or parquet, for the JSON-row sets) whose every
    row carries the fields lm-eval reads, with values in range, within :data:`MAX_ROW_BYTES` a line and
    :data:`MAX_FILE_BYTES` a file. Read one row at a time, before any model loads."""
    if name == "unqover":  # the generator's JSON objects (a file or a folder of them), read by their own reader
        from fairprune.data.unqover import check_source

        check_source(path)
        return
    if name not in _FORMATS:
        raise UserError(f"--task_data: unknown task {name!r}; give one of {', '.join(NAMES)}")
    path = Path(path)
    if not path.is_file():
        raise _refuse(name, path, "not a file (a folder?)" if path.exists() else "no such file")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise _refuse(name, path, f"it takes {path.stat().st_size / 2**30:.1f} GiB, more than the {MAX_FILE_BYTES // 2**30} GiB "
                                  "a task file may (the public sets take megabytes); split it")
    count, conditions = 0, {}
    for where, row in _rows(name, path):
        count += 1
        problem = _row_problem(name, row, where)
        if problem:
            raise _refuse(name, path, problem)
        if name == "bbq":
            conditions[row["context_condition"]] = conditions.get(row["context_condition"], 0) + 1
    if not count:
        raise _refuse(name, path, "no rows")
    _FACTS[str(path)] = {"rows": count, "context_condition": conditions}


#: What :func:`check_format` counted in each file it passed (by path): its rows and, for BBQ, its
#: rows per context condition.
_FACTS: dict[str, dict[str, Any]] = {}


def check_condition(task: str, path: str | Path, condition: str) -> None:
    """Refuse, before any work, a BBQ file (checked by :func:`check_format`) with no row of the
    ``condition`` (ambig or disambig) that ``task`` reads: lm-eval would keep no document."""
    facts = _FACTS.get(str(Path(path)))
    if facts is None:
        check_format("bbq", path)
        facts = _FACTS[str(Path(path))]
    if not facts["context_condition"].get(condition):
        found = ", ".join(f"{v} {k}" for k, v in facts["context_condition"].items())
        raise _refuse("bbq", Path(path), f"{task} reads the rows whose context_condition is {condition!r}, and the file "
                                         f"has none ({found}); give a BBQ file with {condition} rows or drop {task}")
