"""UnQover's files read as its generator writes them, in bounded memory, and turned into the
documents the UnQover tasks score (:mod:`fairprune.metrics.lm_tasks.unqover`).

**The layout** (allenai/unqover ``templates/generate_underspecified_templates.py``): one JSON object
per bias class, keyed ``cluster1|cluster2|subj1|subj2|tid|act_cluster|act1|act2``, each value
``{"context", "q0": {"question", "ans0": {"text"}, "ans1": {"text"}}, "q1": {...}}``: ``q0`` asks
for an attribute, ``q1`` for its opposite, ``ans0`` is the subject named first. The generator's
files are large (ethnicity: 147,000 examples, 139 MB) and ordered by subject pair, so
:func:`read_examples` parses the object one example at a time from a bounded buffer, never the
whole file. A folder is read as every ``*.json`` file in it; the generator's masked-LM variants
(``*roberta*`` / ``*bert*`` subject lists, whose questions hold a mask token) are skipped there
and refused when named alone. The bias class of a file is the subject list in its name
(``slotmap_<subj>_<act>_<slot>``: ``mixedgender`` → gender, ``ethnicity``, ``country``,
``religion``), else the file's stem.

**Pairs.** UnQover's analysis (``analysis.py: pairup_ex``) pairs each example with its
subject-swapped twin by the key ``(sorted subjects, tid, act_cluster, act1, act2)`` (lower case);
a *unit* here is such a pair: up to two examples × two questions. Its bias scores need both.

**The sample** (:func:`write_docs`): the documents are written one unit after another (its four
questions together: first example's q0, q1, then the twin's), units in a seeded order stratified
over bias classes and subject pairs: the classes take turns, and within a class its subject pairs
take turns (pairs and the units of each pair shuffled by the seed). lm-eval's ``--limit N`` takes
the first N documents, so it draws a sample balanced over classes and subject pairs, the same for
the same seed, instead of the file's first subject pair.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fairprune.errors import UserError
from fairprune.hub import cache_dir
from fairprune.storage.atomic import replace_atomically

#: The third answer of every question, the only right one since the context never says: one word, as
#: the subjects are, so a cloze does not weigh it down by its length (one of BBQ's "unknown" answers).
UNKNOWN = "Unknown"
#: One example's bound (the generator's take about a kilobyte).
MAX_EXAMPLE_CHARS = 1024 * 1024
_CHUNK = 1 << 20
_WS = re.compile(r"\s*")
_MASKS = ("<mask>", "[MASK]")
_CLASS = re.compile(r"^slotmap_(?:mixed)?([a-z]+?)(?:roberta|bert)?_")
_FORMAT = 1  # the documents' layout: bumped when it changes, so cached documents are written again
WHERE = "github.com/allenai/unqover templates/generate_underspecified_templates.py"


def _refuse(path: Path, problem: str) -> UserError:
    return UserError(f"--task_data unqover={path}: {problem} (UnQover's generator layout: {WHERE})")


def bias_class(path: Path) -> str:
    """The bias class a generator file holds, from its name (see the module docstring)."""
    found = _CLASS.match(path.name)
    return found.group(1) if found else path.name.split(".")[0]


def masked_variant(path: Path) -> bool:
    """Whether the file name is one of the generator's masked-LM variants (``*_roberta`` / ``*_bert``)."""
    return bool(re.match(r"^slotmap_[a-z]+(roberta|bert)_", path.name))


def source_files(path: str | Path) -> list[Path]:
    """The generator files a ``--task_data unqover=`` value names: the file, or a folder's
    ``*.json`` files less the masked-LM variants, sorted."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.json") if p.is_file() and not masked_variant(p))
        if not files:
            raise _refuse(path, "the folder holds no *.json file of the generator (masked-LM variants are skipped)")
        return files
    if not path.is_file():
        raise _refuse(path, "no such file or folder")
    return [path]


def read_examples(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(key, value)`` of every example of one generator file, in file order, parsed one at a time
    from a buffer of about a megabyte; a malformed file is refused in one line naming where."""
    decoder = json.JSONDecoder()
    try:
        with path.open("r", encoding="utf-8") as file:
            state = {"buf": "", "pos": 0, "eof": False, "read": 0}

            def more() -> None:
                chunk = file.read(_CHUNK)
                state["read"] += state["pos"]
                state["buf"], state["pos"], state["eof"] = state["buf"][state["pos"]:] + chunk, 0, not chunk

            def skip() -> str:  # the next character after white space ("" at the end)
                while True:
                    state["pos"] = _WS.match(state["buf"], state["pos"]).end()
                    if state["pos"] < len(state["buf"]) or state["eof"]:
                        return state["buf"][state["pos"]:state["pos"] + 1]
                    more()

            def value() -> Any:
                while True:
                    try:
                        found, end = decoder.raw_decode(state["buf"], state["pos"])
                        if end < len(state["buf"]) or state["eof"]:
                            state["pos"] = end
                            return found
                    except json.JSONDecodeError as err:
                        if state["eof"]:
                            raise _refuse(path, f"not JSON at character {state['read'] + err.pos} ({err.msg})") from None
                    if len(state["buf"]) - state["pos"] > MAX_EXAMPLE_CHARS:
                        raise _refuse(path, f"an example at character {state['read'] + state['pos']} runs past "
                                            f"{MAX_EXAMPLE_CHARS // 2**20} MiB (the generator's take about a kilobyte)")
                    more()

            def expect(char: str, what: str) -> None:
                if skip() != char:
                    found = skip() or "the end of the file"
                    raise _refuse(path, f"expected {what} at character {state['read'] + state['pos']}, found {found!r}")
                state["pos"] += 1

            expect("{", "one JSON object (the generator's json.dump of its examples)")
            if skip() == "}":
                return
            while True:
                key = value()
                if not isinstance(key, str):
                    raise _refuse(path, f"a key at character {state['read'] + state['pos']} is not a string")
                expect(":", "':' after a key")
                skip()
                yield key, value()
                if skip() == "}":
                    return
                expect(",", "',' or '}' after an example")
                skip()
    except UnicodeDecodeError as err:
        raise _refuse(path, f"not UTF-8 text (byte 0x{err.object[err.start:err.start + 1].hex()})") from None
    except OSError as err:
        raise _refuse(path, f"cannot be read ({type(err).__name__})") from None


def _text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def example_problem(key: str, value: Any) -> str | None:
    """What is wrong with one example (None when it is in the generator's layout)."""
    parts = key.split("|")
    if len(parts) != 8:
        return f"key {key[:80]!r} has {len(parts)} fields, not the 8 of cluster1|cluster2|subj1|subj2|tid|act_cluster|act1|act2"
    if parts[2].strip().lower() == parts[3].strip().lower():
        return f"key {key[:80]!r} names one subject twice"
    if not isinstance(value, dict) or not _text(value.get("context")):
        return f"example {key[:80]!r} has no context text"
    for q in ("q0", "q1"):
        question = value.get(q)
        if not isinstance(question, dict) or not _text(question.get("question")):
            return f"example {key[:80]!r} has no {q}.question"
        for a in ("ans0", "ans1"):
            if not isinstance(question.get(a), dict) or not _text(question[a].get("text")):
                return f"example {key[:80]!r} has no {q}.{a}.text"
        if any(m in question["question"] or m in value["context"] for m in _MASKS):
            return (f"example {key[:80]!r} holds a mask token: this is the generator's masked-LM variant; give the "
                    "question-answering file (slotmap_<class>_..., without roberta / bert)")
    return None


@dataclass(frozen=True)
class _Example:
    line: int  # its two documents' place in the scratch file (byte offset)
    slot: int  # 0: its subjects in sorted order (the unit's first example), 1: the twin


def unit_key(key: str) -> tuple:
    """UnQover's pairing key of an example: ``(sorted subjects, tid, act_cluster, act1, act2)``, lower case."""
    parts = key.lower().split("|")
    return (tuple(sorted(p.strip() for p in parts[2:4])), *parts[4:8])


def _documents(key: str, value: dict[str, Any], cls: str, slot: int) -> list[dict[str, Any]]:
    cluster1, cluster2, subj1, subj2, tid, act_cluster, act1, _ = key.split("|")
    return [{"key": key, "class": cls, "slot": slot, "q": i, "clusters": [cluster1.lower(), cluster2.lower()],
             "subjects": [subj1.strip().lower(), subj2.strip().lower()], "attribute": act1.strip().lower(),
             "tid": tid, "act_cluster": act_cluster, "context": value["context"].strip(),
             "question": value[f"q{i}"]["question"].strip(), "ans0": value[f"q{i}"]["ans0"]["text"].strip(),
             "ans1": value[f"q{i}"]["ans1"]["text"].strip(), "ans2": UNKNOWN, "label": 2} for i in (0, 1)]


def check_source(path: str | Path) -> dict[str, Any]:
    """Read every example of the file or folder once, refusing (one line, naming the file and the
    example) the first one not in the generator's layout; returns what it holds: examples and
    units per bias class."""
    facts: dict[str, Any] = {"files": [], "examples": 0, "classes": {}}
    for file in source_files(path):
        cls, count = bias_class(file), 0
        for key, value in read_examples(file):
            problem = example_problem(key, value)
            if problem:
                raise _refuse(file, problem)
            count += 1
        if not count:
            raise _refuse(file, "no examples")
        facts["files"].append(str(file))
        facts["examples"] += count
        facts["classes"][cls] = facts["classes"].get(cls, 0) + count
    return facts


def _order(units: dict[tuple, dict[str, Any]], seed: int) -> list[tuple]:
    """The units in the stratified order of the module docstring."""
    rng = random.Random(seed)
    by_class: dict[str, dict[tuple, list[tuple]]] = {}
    for key, unit in units.items():
        by_class.setdefault(unit["class"], {}).setdefault(key[1], []).append(key)  # key: (class, subjects, ...)
    turns = []
    for cls in sorted(by_class):
        pairs = [sorted(by_class[cls][p]) for p in sorted(by_class[cls])]
        rng.shuffle(pairs)
        for keys in pairs:
            rng.shuffle(keys)
        turns.append([k for depth in range(max(map(len, pairs))) for keys in pairs if depth < len(keys) for k in [keys[depth]]])
    return [k for depth in range(max(map(len, turns), default=0)) for keys in turns if depth < len(keys) for k in [keys[depth]]]


def write_docs(path: str | Path, seed: int = 0) -> Path:
    """The documents of the UnQover tasks from a generator file or folder, in the stratified order
    (module docstring), as JSON lines in the project cache (written once per source, its size and
    time, and seed). Two passes over the source: the first writes each example's two documents
    to a scratch file and keeps only the offsets; the second writes the units in order."""
    files = source_files(path)
    stamp = json.dumps([_FORMAT, seed, *[(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]])
    out = cache_dir() / "unqover" / f"{hashlib.sha256(stamp.encode()).hexdigest()[:20]}.jsonl"
    if out.is_file():
        return out
    units: dict[tuple, dict[str, Any]] = {}

    def write(tmp: Path) -> None:
        scratch = tmp.with_suffix(".scratch")
        try:
            with scratch.open("wb") as lines:
                for file in files:
                    cls = bias_class(file)
                    for key, value in read_examples(file):
                        problem = example_problem(key, value)
                        if problem:
                            raise _refuse(file, problem)
                        pairing = (cls, *unit_key(key))
                        slot = 0 if key.split("|")[2].strip().lower() == pairing[1][0] else 1
                        unit = units.setdefault(pairing, {"class": cls, "examples": []})
                        unit["examples"].append(_Example(lines.tell(), slot))
                        lines.write((json.dumps(_documents(key, value, cls, slot)) + "\n").encode("utf-8"))
            with scratch.open("rb") as lines, tmp.open("w", encoding="utf-8") as docs:
                for number, pairing in enumerate(_order(units, seed)):
                    for example in sorted(units[pairing]["examples"], key=lambda e: (e.slot, e.line)):
                        lines.seek(example.line)
                        for doc in json.loads(lines.readline()):
                            docs.write(json.dumps({"unit": number, **doc}) + "\n")
        finally:
            scratch.unlink(missing_ok=True)

    return replace_atomically(out, write)
