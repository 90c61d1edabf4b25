"""Whole run folders: written beside the target and swapped in at the end, so a folder holds one
complete run or says it is incomplete; and the free-space check made before a run's work starts.

:func:`replace_folder` writes the new run into a staging folder beside the target (same parent: one
filesystem, so the swap is a handful of renames), then moves the previous run's files out and the new
ones in. The target folder itself is never renamed: its run lock (``.lock``, held by the running
command) and the files the caller keeps (a scoring journal) stay where they are. Unrelated files
(ones no run writes) and sub-folders are left alone. While the swap runs the folder holds
``INCOMPLETE``; a run stopped in that instant leaves it there, naming where both runs are.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fairprune.errors import UserError
from fairprune.storage.atomic import plain_mode, write_text
from fairprune.storage.lock import LOCK_NAME

MARKER = "INCOMPLETE"  # present only while (or when stopped while) a run is swapped in
MANIFEST = ".run-files.json"  # the files of the run the folder holds (replaced as a whole by the next run)
_LOCK_FILES = (LOCK_NAME, f"{LOCK_NAME}.*")
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _nearest_existing(path: Path) -> Path:
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def _human(size: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def check_free_space(path: str | os.PathLike, needed: int, option: str = "--output") -> None:
    """Fail at once, before any work, when the filesystem of ``path`` (its nearest existing folder)
    has less than ``needed`` bytes plus a margin free. A filesystem that cannot be asked passes."""
    path = Path(path)
    probe = _nearest_existing(path)
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return
    wanted = int(needed * 1.05) + 4 * 1024 * 1024  # plots, tables, the report, filesystem overhead
    if free < wanted:
        raise UserError(f"not enough free space for {option} '{path}': the run writes about {_human(wanted)} and "
                        f"'{probe}' has {_human(free)} free; free some space there or write elsewhere (nothing was done)")


def write_failure(err: BaseException) -> str | None:
    """The operating system's reason when ``err`` is a failed write (an ``OSError``, or a safetensors
    error wrapping one, e.g. a full disk), else None."""
    if isinstance(err, OSError):
        return err.strerror or str(err) or type(err).__name__
    if type(err).__name__ == "SafetensorError":
        found = _OS_ERROR.search(str(err))
        if found:
            return os.strerror(int(found.group(1)))
    return None


def _sibling(out: Path, kind: str) -> Path:
    """A fresh staging / old-run folder for ``out``: beside it, or inside it when ``out`` is a mount
    point (its parent is another filesystem, where a rename cannot reach)."""
    tag = f"{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return out / f".run.{tag}" if os.path.ismount(out) else out.parent / f".{out.name}.{tag}"


def _leftovers(out: Path) -> list[Path]:
    """Staging and old-run folders of earlier runs of ``out`` that were killed (the caller holds
    ``out``'s lock, so no other run is writing them)."""
    found = []
    for pattern, where in ((f".{out.name}.partial-*", out.parent), (f".{out.name}.old-*", out.parent),
                           (".run.partial-*", out), (".run.old-*", out)):
        if where.is_dir():
            found += [p for p in where.glob(pattern) if p.is_dir()]
    return found


def _old_run_files(out: Path, owned: Iterable[str]) -> set[str]:
    """The names of the files of the run ``out`` holds: those its manifest lists and those matching
    ``owned`` (what any run of the caller writes: folders written before manifests existed)."""
    names: set[str] = set()
    try:
        listed = json.loads((out / MANIFEST).read_text()).get("files", [])
        names.update(n for n in listed if isinstance(n, str) and "/" not in n and n not in ("", ".", ".."))
    except (OSError, ValueError, AttributeError):
        pass
    for entry in out.iterdir():
        if entry.is_file() and any(fnmatch.fnmatch(entry.name, p) for p in owned):
            names.add(entry.name)
    return names


def replace_folder(output: str | os.PathLike, write: Callable[[Path], Any], *, keep: Iterable[str] = (),
                   owned: Iterable[str] = ()) -> Path:
    """Write a run into ``output`` as a whole: ``write(staging)`` fills a staging folder beside it,
    then the previous run's files (its manifest's, and those matching ``owned``) leave ``output`` and
    the new ones enter, ``report.json`` last. Kept in ``output`` whatever happens: the run lock and
    the names in ``keep`` (a journal the run resumes from). When ``write`` fails (a full disk, an
    interrupt) the staging folder is removed and ``output`` is as it was; a write failure of the
    operating system is a :class:`UserError`. Earlier runs' leftover staging folders are removed."""
    keep = set(keep) | {MARKER}
    out = Path(output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    leftovers = _leftovers(out)
    if not (out / MARKER).exists():  # garbage of a run killed before its swap: its space is needed now
        for old in leftovers:
            shutil.rmtree(old, ignore_errors=True)
        leftovers = []
    staging, trash = _sibling(out, "partial"), _sibling(out, "old")
    try:  # nothing in ``out`` changes before the last step here (the marker) succeeded
        staging.mkdir()
        write(staging)
        for written in staging.rglob("*"):  # one mode whatever wrote them (save_pretrained's temporaries: 0600)
            if written.is_file() and not written.is_symlink():
                plain_mode(written)
        files = [p.name for p in staging.iterdir() if p.name not in keep]
        write_text(staging / MANIFEST, json.dumps({"files": sorted(files)}) + "\n")
        trash.mkdir()
        write_text(out / MARKER, f"A run was being saved into this folder when it stopped: the new run is complete in "
                                 f"'{staging}', the previous one in '{trash}'. Run the command again.\n")
    except BaseException as err:
        for folder in (staging, trash):
            shutil.rmtree(folder, ignore_errors=True)
        reason = write_failure(err)
        if reason is None:
            raise
        raise UserError(f"cannot write the run to '{output}' ({reason}); nothing in '{output}' was changed: free some "
                        "space (or fix the folder) and run the command again") from None
    try:
        _swap_in(out, staging, trash, keep, owned)
    except OSError as err:  # a rename refused midway: the marker stays and says where both runs are
        raise UserError(f"cannot move the run into '{output}' ({err.strerror or err}); the folder is marked "
                        f"{MARKER} and names where the new and the previous run are: run the command again") from None
    for old in leftovers:  # a swap stopped midway left these (its marker named them): no longer needed
        shutil.rmtree(old, ignore_errors=True)
    return Path(output)


def _swap_in(out: Path, staging: Path, trash: Path, keep: set[str], owned: Iterable[str]) -> None:
    """Move the previous run out of ``out`` (into ``trash``), ``report.json`` first, and the new one
    in from ``staging``, ``report.json`` last; then drop the marker and both folders."""
    new = sorted(p.name for p in staging.iterdir())
    new.sort(key=lambda n: n == "report.json")
    old = _old_run_files(out, owned) | {n for n in new if (out / n).is_file()}
    old = {n for n in old if n not in keep and not any(fnmatch.fnmatch(n, p) for p in _LOCK_FILES)
           and (out / n).is_file()}
    for name in sorted(old, key=lambda n: n != "report.json"):
        os.replace(out / name, trash / name)
    for name in new:
        os.replace(staging / name, out / name)
    (out / MARKER).unlink()
    shutil.rmtree(trash, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
