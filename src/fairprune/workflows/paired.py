"""Paired comparisons of vision methods on the same test items.

Every pruning run writes ``test_items.npz`` beside its report: for each test item, in the test
split's order, whether the pruned model got it right and its group (plain arrays, read back with
``allow_pickle=False``). ``compare`` then puts each method against a baseline on the very same
items: the difference of accuracy, accuracy gap and degradation std with a paired,
group-stratified bootstrap interval (:func:`fairprune.metrics.bootstrap.paired_difference`),
marked where the interval excludes 0. Paired, the shared difficulty of the items cancels, so the
interval is much narrower than the two runs' own intervals side by side.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from fairprune.errors import UserError
from fairprune.metrics.bootstrap import bootstrap, paired_difference
from fairprune.pruning.channels import GRANULARITIES
from fairprune.reporting.compare import Statistics
from fairprune.storage.arrays import TooLarge, open_npz
from fairprune.workflows.compare import Cell
from fairprune.workflows.options import VisionCompareOptions

ITEMS = "test_items.npz"


def cell_name(method: str, sparsity: float, granularity: str = "weight") -> str:
    """The folder (and table key) of one vision compare cell: ``<method>_s<sparsity>`` at weight
    granularity, ``<method>_channel_s<sparsity>`` at channel granularity."""
    return f"{method}_s{sparsity:g}" if granularity == "weight" else f"{method}_{granularity}_s{sparsity:g}"


def compare_granularities(granularities: list[str] | None, pruning: dict[str, Any] | None) -> list[str]:
    """The granularities a compare runs every method at: ``granularities``, or the one the shared
    ``pruning`` settings name (weight by default); both given, they must agree."""
    given = (pruning or {}).get("granularity")
    found = list(granularities) if granularities else [given or "weight"]
    bad = [g for g in found if g not in GRANULARITIES]
    if bad or not found or len(set(found)) != len(found):
        raise UserError(f"granularities must be distinct ones of {', '.join(GRANULARITIES)}, got {found}")
    if granularities and given is not None and found != [given]:
        raise UserError(f"pruning.granularity {given!r} and granularities {found} disagree; give the granularities "
                        "in one place (granularities: [weight, channel] runs every method at both)")
    return found


def vision_cells(output: str | Path, compare: VisionCompareOptions) -> list[Cell]:
    """Every cell of a vision compare in the order it runs: per seed, granularity, method and
    sparsity, keyed by those four, in ``<output>/seed<s>`` with several seeds (:func:`cell_name`)."""
    seeds = compare.every_seed
    return [Cell((Path(output) / f"seed{s}" if len(seeds) > 1 else Path(output)) / cell_name(m, sp, g), (s, g, m, sp),
                 f" seed {s}" if len(seeds) > 1 else "")
            for s in seeds for g in compare_granularities(compare.granularities, compare.pruning)
            for m in compare.methods or [] for sp in compare.sparsities or []]


@torch.no_grad()
def item_outcomes(pl_module: L.LightningModule, loader: DataLoader) -> dict[str, np.ndarray]:
    """Per test item, in order: correct (bool) and group (int); the whole split in this process."""
    whole = DataLoader(loader.dataset, batch_size=loader.batch_size or 64, shuffle=False)
    was_training = pl_module.training
    pl_module.eval()
    correct, groups = [], []
    for x, y, g in whole:
        prediction = pl_module(x.to(pl_module.device)).argmax(-1).cpu()
        correct.append((prediction == y).numpy())
        groups.append(g.numpy())
    pl_module.train(was_training)
    return {"correct": np.concatenate(correct).astype(bool), "group": np.concatenate(groups).astype(np.int64),
            "item": np.arange(sum(len(c) for c in correct), dtype=np.int64)}


def save_items(folder: Path, outcomes: dict[str, np.ndarray]) -> None:
    tmp = folder / (ITEMS + ".tmp.npz")
    np.savez(tmp, **outcomes)
    tmp.replace(folder / ITEMS)


class BadItems(ValueError):
    """A cell's ``test_items.npz`` that cannot be what the run measured (the message says why)."""


def read_items(folder: Path, groups: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A cell's per-item outcomes ``(correct, group, item)``, checked before anything reads them:
    three 1-D arrays of one length, bool (or 0/1) outcomes, integer group ids in ``range(groups)``
    and item ids ``0 .. n-1`` in order, read without pickle. Anything else raises :class:`BadItems`."""
    path = folder / ITEMS
    if not path.is_file():
        raise BadItems("is missing")
    arrays: dict[str, np.ndarray] = {}
    try:
        with open_npz(path) as data:
            if not hasattr(data, "files"):
                raise BadItems("is a single array, not the .npz of arrays correct, group and item")
            for key in ("correct", "group", "item"):
                if key not in data.files:
                    raise BadItems(f"has no '{key}' array")
                try:
                    arrays[key] = np.asarray(data[key])
                except ValueError:  # an object array needs pickle, which is refused
                    raise BadItems(f"holds '{key}' as an array of Python objects, not plain numbers") from None
    except BadItems:
        raise
    except TooLarge as err:
        raise BadItems(f"is too large: {err}") from None
    except Exception as err:  # not an npz, a cut or corrupt zip
        raise BadItems(f"is not a readable .npz file ({type(err).__name__}: {' '.join(str(err).split())[:80]})") from None
    correct, group, item = arrays["correct"], arrays["group"], arrays["item"]
    for key, values in arrays.items():
        if values.ndim != 1:
            raise BadItems(f"holds '{key}' with shape {values.shape}, not one value per test item")
    n = len(correct)
    if len(group) != n or len(item) != n:
        raise BadItems(f"holds arrays of different lengths (correct {n}, group {len(group)}, item {len(item)})")
    if n == 0:
        raise BadItems("holds no items")
    if correct.dtype != np.bool_:
        if not (np.issubdtype(correct.dtype, np.integer) and np.isin(correct, (0, 1)).all()):
            raise BadItems(f"holds 'correct' as {correct.dtype}, not true/false per item")
        correct = correct.astype(bool)
    if not np.issubdtype(group.dtype, np.integer):
        raise BadItems(f"holds 'group' as {group.dtype}, not integer group ids")
    if group.min() < 0 or (groups is not None and group.max() >= groups):
        raise BadItems(f"holds group ids from {group.min()} to {group.max()}, outside 0..{groups - 1} ({groups} groups)"
                       if groups is not None else f"holds a negative group id ({group.min()})")
    if not np.issubdtype(item.dtype, np.integer) or not np.array_equal(item, np.arange(n)):
        raise BadItems(f"holds item ids that are not 0..{n - 1} in the test split's order")
    return correct, group.astype(np.int64), item.astype(np.int64)


Items = tuple[np.ndarray, np.ndarray, np.ndarray]


def _warn(notes: list[str] | None, line: str) -> None:
    print(f"[compare] warning: {line}", flush=True)
    if notes is not None:
        notes.append(line)


def _measure_again(folder: Path, reason: str, groups: int | None, remeasure: Callable[[Path], None] | None,
                   notes: list[str] | None) -> Items | None:
    """One warning line saying what is wrong with ``folder``'s items; then the cell measured
    again (``remeasure``) and its new file read, or None with a warning when that is not possible."""
    path = folder / ITEMS
    if remeasure is None:
        _warn(notes, f"{path} {reason}; the cell cannot be measured again here, so its paired columns are left out")
        return None
    _warn(notes, f"{path} {reason}; the cell is measured again from its checkpoints/last.ckpt")
    try:
        remeasure(folder)
        return read_items(folder, groups)
    except Exception as err:  # noqa: BLE001 - the comparison stands without this cell's paired figures
        why = " ".join(str(err).split())[:200] or type(err).__name__
        _warn(notes, f"{path} could not be measured again ({why}); its paired columns are left out "
                     "(delete the cell's folder and run compare again to run it afresh)")
        return None


def checked_items(folders: Mapping[str, list[Path]], groups: int | None = None,
                  remeasure: Callable[[Path], None] | None = None, notes: list[str] | None = None) -> dict[Path, Items | None]:
    """Every cell's items (name → its run folder per seed), checked: each file on its own
    (:func:`read_items`), then against the other cells of its seed, which all tested the same
    items (a file whose group ids differ from most cells', e.g. one cut short, is bad too). A bad
    or missing file is one warning line, and ``remeasure(folder)`` (the cell's model tested
    again, its items written afresh) runs; None for a cell whose items stay bad (its paired columns
    are left out, with a warning)."""
    found: dict[Path, Items | None] = {}
    for cell in folders.values():
        for folder in cell:
            try:
                found[folder] = read_items(folder, groups)
            except BadItems as err:
                found[folder] = _measure_again(folder, str(err), groups, remeasure, notes)
    for i in range(max((len(cell) for cell in folders.values()), default=0)):  # per seed
        cells = [cell[i] for cell in folders.values() if i < len(cell) and found[cell[i]] is not None]
        signature = {f: (len(found[f][1]), found[f][1].tobytes()) for f in cells}  # type: ignore[index]
        if len(set(signature.values())) < 2:
            continue
        tally = Counter(signature.values())
        usual = max(tally, key=lambda key: tally[key])  # ties: the first cell's (compare's order)
        for folder in cells:
            if signature[folder] != usual:
                reason = (f"holds {signature[folder][0]} items whose groups differ from the {usual[0]} items the other "
                          f"cells of this compare tested")
                found[folder] = _measure_again(folder, reason, groups, remeasure, notes)
                if found[folder] is not None and (len(found[folder][1]), found[folder][1].tobytes()) != usual:
                    _warn(notes, f"{folder / ITEMS} measured again still differs from the other cells' test items; "
                                 "its paired columns are left out")
                    found[folder] = None
    return found


def paired_rows(cells: dict[str, list[Path]], baseline: str, group_names: list[str], reference: dict[str, Any] | None,
                items: Mapping[Path, Items | None], seed: int = 0) -> dict[str, dict[str, Any]]:
    """Each cell (name → its run folder per seed) against the ``baseline`` cell, on the cells'
    checked items by folder (:func:`checked_items`)."""
    base = [items.get(f) for f in cells.get(baseline, [])]
    if not base or any(b is None for b in base):
        return {}
    ref = None
    if reference:
        groups = reference.get("groups") or {}
        ref = np.array([np.nan if groups.get(n, {}).get("accuracy") is None else groups[n]["accuracy"] for n in group_names])
    out = {}
    for name, folders in cells.items():
        if name == baseline:
            continue
        runs = [items.get(f) for f in folders]
        if any(r is None for r in runs) or len(runs) != len(base):
            continue
        if any(not (np.array_equal(r[1], b[1]) and np.array_equal(r[2], b[2])) for r, b in zip(runs, base)):
            continue  # not the same items (checked_items has said so)
        out[name] = paired_difference(runs, base, ref, seed=seed)
    return out


def compare_statistics(reports: dict[str, list[dict[str, Any]]], folders: dict[str, list[Path]], firsts: list[dict[str, Any]],
                       compare: VisionCompareOptions, dense_rows: list[tuple[str, str]],
                       remeasure: Callable[[Path], None] | None = None, notes: list[str] | None = None) -> Statistics:
    """The intervals of every row and each method's paired difference against the baseline at the
    same sparsity and granularity (a key column once the compare runs other than weight granularity).
    ``dense_rows``: (row label, report key) of the dense rows; ``firsts``: per seed, a report holding
    the dense figures. Each cell's ``test_items.npz`` is checked first (:func:`checked_items`:
    ``remeasure`` tests a cell with a bad one again, ``notes`` collects the warnings)."""
    levels, seed = compare_granularities(compare.granularities, compare.pruning), compare.seed
    methods, sparsities, baseline = compare.methods, compare.sparsities, compare.baseline or compare.methods[0]

    def cell_key(m: str, s: float, g: str) -> dict[str, Any]:
        return {"method": m, **({"granularity": g} if levels != ["weight"] else {}), "target_sparsity": s}

    intervals = [(cell_key(m, s, g), bootstrap(reports[cell_name(m, s, g)], seed=seed))
                 for g in levels for m in methods for s in sparsities if cell_name(m, s, g) in reports]
    for label, key in dense_rows:  # the dense rows' intervals, over the seeds' dense models
        figures = [r.get(key) or r["reference"] for r in firsts]
        intervals.append(({"method": label, "target_sparsity": 0.0}, bootstrap(figures, seed=seed)))
    paired = []
    if firsts:
        names = list(firsts[0].get("groups") or {})
        items = checked_items(folders, len(names) or None, remeasure, notes)
        for g in levels:
            for s in sparsities:
                cells = {m: folders[cell_name(m, s, g)] for m in methods if cell_name(m, s, g) in folders}
                for method, result in paired_rows(cells, baseline, names, firsts[0].get("reference"), items, seed).items():
                    paired.append((cell_key(method, s, g), result))
    return Statistics(intervals, paired, baseline)
