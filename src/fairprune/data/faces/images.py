"""Which face images can be used: each file is decoded once, when the splits are built.

:func:`check_images` decodes every image exactly as :class:`~fairprune.data.faces.FaceDataset`
does (:func:`load_rgb`), so an image that passes is one the dataset can load; a truncated JPEG,
a file that is not an image or one listed in a label file but absent from the disk does not.
Results are cached per file, keyed by its size and modification time, in
``$FAIRPRUNE_CACHE/image_checks/`` (one JSON file per image folder), so later runs only ``stat``
the files. :func:`drop_unreadable` leaves the failures out of a frame, warns once per reason and
counts them in ``frame.attrs["skipped"]``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
from PIL import Image

from fairprune.errors import UserError
from fairprune.hub import cache_dir

#: Why an image was left out: ``missing`` (listed, not on disk) or ``unreadable`` (does not decode).
IMAGE_PROBLEMS = ("missing", "unreadable")
_CACHE_VERSION = 1


def load_rgb(path: str) -> Image.Image:
    """The image at ``path``, fully decoded (damage surfaces here) and converted to RGB."""
    with Image.open(path) as image:
        return image.convert("RGB")


def check_images(paths: Iterable[str]) -> list[tuple[str, str] | None]:
    """For each path: ``None`` when it decodes, else ``(reason, detail)`` with reason ``missing``
    or ``unreadable`` and detail the error. Decodes only files not checked before (same size and
    modification time), in threads, and caches the results."""
    paths = [str(p) for p in paths]
    results: dict[str, tuple[str, str] | None] = {}
    todo: list[tuple[str, list[int]]] = []
    folders: dict[str, dict[str, list]] = {}
    for path in dict.fromkeys(paths):
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            results[path] = ("missing", "no such file")
            continue
        except OSError as err:
            results[path] = ("unreadable", _detail(err))
            continue
        folder, name = os.path.split(path)
        if folder not in folders:
            folders[folder] = _read_cache(folder)
        key = [stat.st_size, stat.st_mtime_ns]
        hit = folders[folder].get(name)
        if hit is not None and hit[:2] == key:
            results[path] = None if hit[2] is None else (hit[2], hit[3])
        else:
            todo.append((path, key))
    if todo:
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # decoding releases the GIL
            found = list(pool.map(_decode_problem, (path for path, _ in todo)))
        changed = set()
        for (path, key), problem in zip(todo, found):
            results[path] = problem
            folder, name = os.path.split(path)
            folders[folder][name] = key + (list(problem) if problem else [None, None])
            changed.add(folder)
        for folder in changed:
            _write_cache(folder, folders[folder])
    return [results[p] for p in paths]


def drop_unreadable(frame: pd.DataFrame) -> pd.DataFrame:
    """Leave out the rows whose image is missing or does not decode (:func:`check_images`), with
    one warning per reason; ``attrs["skipped"]`` of the result adds their counts to the frame's.

    Raises a :class:`UserError` when no image can be read at all (a wrong root, no permission).
    """
    problems = check_images(frame["path"])
    keep = [p is None for p in problems]
    if len(frame) and not any(keep):
        reason, detail = problems[0]
        raise UserError(f"none of the {len(frame)} images could be read, e.g. '{frame['path'].iloc[0]}' "
                        f"({reason}: {detail}); check --data.root and the files' permissions")
    counts = {reason: 0 for reason in IMAGE_PROBLEMS}
    for path, problem in zip(frame["path"], problems):
        if problem is not None:
            if not counts[problem[0]]:
                example = f"'{path}' ({problem[1]})"
                what = "unreadable image(s)" if problem[0] == "unreadable" else "image(s) missing from the disk"
                total = sum(p is not None and p[0] == problem[0] for p in problems)
                warnings.warn(f"dropped {total} {what} of {len(frame)}, e.g. {example}; they are left out of "
                              f"every split and counted in report.json under data.skipped.{problem[0]}",
                              stacklevel=2)
            counts[problem[0]] += 1
    kept = frame[keep].reset_index(drop=True)
    kept.attrs["skipped"] = {**frame.attrs.get("skipped", {}), **counts}
    return kept


def _decode_problem(path: str) -> tuple[str, str] | None:
    try:
        load_rgb(path)
    except FileNotFoundError:
        return ("missing", "no such file")
    except Exception as err:  # noqa: BLE001 - any failure to decode means the image is unusable
        return ("unreadable", _detail(err))
    return None


def _detail(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:200]


def _cache_file(folder: str) -> Path:
    digest = hashlib.blake2b(os.path.abspath(folder).encode(), digest_size=10).hexdigest()
    return cache_dir() / "image_checks" / f"{digest}.json"


def _read_cache(folder: str) -> dict[str, list]:
    """``{file name: [size, mtime_ns, reason or None, detail or None]}`` of ``folder``; empty
    when there is no usable cache."""
    try:
        stored = json.loads(_cache_file(folder).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(stored, dict) or stored.get("version") != _CACHE_VERSION or stored.get("folder") != os.path.abspath(folder):
        return {}
    files = stored.get("files")
    return files if isinstance(files, dict) else {}


def _write_cache(folder: str, files: dict[str, list]) -> None:
    """Write atomically (other processes may read or write it at once); a cache that cannot be
    written is skipped, the check is then repeated next time."""
    target = _cache_file(folder)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".tmp")
    except OSError:
        return
    try:
        os.chmod(tmp, 0o644)  # a shared cache, like the files it describes
        with os.fdopen(handle, "w") as out:
            json.dump({"version": _CACHE_VERSION, "folder": os.path.abspath(folder), "files": files}, out)
        os.replace(tmp, target)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
