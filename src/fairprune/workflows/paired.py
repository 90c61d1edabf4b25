"""Paired comparisons of vision methods on the same test items.

Every pruning run writes ``test_items.npz`` beside its report: for each test item, in the test
split's order, whether the pruned model got it right and its group (plain arrays, read back with
``allow_pickle=False``). ``compare`` then puts each method against a baseline on the very same
items: the difference of accuracy, accuracy gap and degradation std with a paired,
group-stratified bootstrap interval (:func:`fairprune.metrics.group.bootstrap.paired_difference`),
marked where the interval excludes 0. Paired, the shared difficulty of the items cancels, so the
interval is much narrower than the two runs' own intervals side by side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from fairprune.errors import UserError
from fairprune.metrics.group.bootstrap import bootstrap, paired_difference
from fairprune.pruning.channels import GRANULARITIES

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


def cell_settings(pruning: dict[str, Any] | None, seeds: list[int], granularities: list[str], methods: list[str],
                  sparsities: list[float]) -> dict[tuple[int, str, str, float], dict[str, Any]]:
    """Every compare cell's IterativePruning settings by (seed, granularity, method, sparsity). A
    weight cell's have no granularity key (its config.yaml is the one earlier versions wrote, so
    their finished cells are reused); the seed is the cell's only with several seeds."""
    shared = {k: v for k, v in (pruning or {}).items() if k != "granularity"}
    return {(s, g, m, sp): {**shared, "method": m, "target_sparsity": sp, **({"granularity": g} if g != "weight" else {}),
                            **({"seed": s} if len(seeds) > 1 else {})}
            for s in seeds for g in granularities for m in methods for sp in sparsities}


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


def load_items(folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    try:
        with np.load(folder / ITEMS, allow_pickle=False) as data:
            return data["correct"], data["group"], data["item"]
    except (OSError, KeyError, ValueError):
        return None


def paired_rows(cells: dict[str, list[Path]], baseline: str, group_names: list[str],
                reference: dict[str, Any] | None, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Each cell (name → its run folder per seed) against the ``baseline`` cell."""
    base = [load_items(f) for f in cells.get(baseline, [])]
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
        runs = [load_items(f) for f in folders]
        if any(r is None for r in runs) or len(runs) != len(base):
            continue
        out[name] = paired_difference(runs, base, ref, seed=seed)
    return out


def compare_statistics(reports: dict[str, list[dict[str, Any]]], folders: dict[str, list[Path]], firsts: list[dict[str, Any]],
                       methods: list[str], sparsities: list[float], baseline: str, dense_rows: list[tuple[str, str]],
                       seed: int = 0, granularities: list[str] | None = None) -> tuple[list, list]:
    """The intervals of every row and each method's paired difference against ``baseline`` at
    the same sparsity and granularity, as :func:`fairprune.reporting.compare.write_comparison` takes
    them. ``dense_rows``: (row label, report key) of the dense rows; ``firsts``: per seed, a report
    holding the dense figures; ``granularities``: None for a compare without that dimension (the
    keys then leave it out)."""
    levels = granularities or ["weight"]

    def cell_key(m: str, s: float, g: str) -> dict[str, Any]:
        return {"method": m, **({"granularity": g} if granularities else {}), "target_sparsity": s}

    intervals = [(cell_key(m, s, g), bootstrap(reports[cell_name(m, s, g)], seed=seed))
                 for g in levels for m in methods for s in sparsities if cell_name(m, s, g) in reports]
    for label, key in dense_rows:  # the dense rows' intervals, over the seeds' dense models
        figures = [r.get(key) or r["reference"] for r in firsts]
        intervals.append(({"method": label, "target_sparsity": 0.0}, bootstrap(figures, seed=seed)))
    paired = []
    if firsts:
        names = list(firsts[0].get("groups") or {})
        for g in levels:
            for s in sparsities:
                cells = {m: folders[cell_name(m, s, g)] for m in methods if cell_name(m, s, g) in folders}
                for method, result in paired_rows(cells, baseline, names, firsts[0].get("reference"), seed).items():
                    paired.append((cell_key(method, s, g), result))
    return intervals, paired
