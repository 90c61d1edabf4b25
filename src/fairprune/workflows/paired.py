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

from fairprune.metrics.group.bootstrap import bootstrap, paired_difference

ITEMS = "test_items.npz"


def cell_name(method: str, sparsity: float) -> str:
    """The folder (and table key) of one vision compare cell."""
    return f"{method}_s{sparsity:g}"


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
                       seed: int = 0) -> tuple[list, list]:
    """The intervals of every row and each method's paired difference against ``baseline`` at
    the same sparsity, as :func:`fairprune.reporting.compare.write_comparison` takes them.
    ``dense_rows``: (row label, report key) of the dense rows; ``firsts``: per seed, a report
    holding the dense figures."""
    intervals = [({"method": m, "target_sparsity": s}, bootstrap(reports[cell_name(m, s)], seed=seed))
                 for m in methods for s in sparsities if cell_name(m, s) in reports]
    for label, key in dense_rows:  # the dense rows' intervals, over the seeds' dense models
        figures = [r.get(key) or r["reference"] for r in firsts]
        intervals.append(({"method": label, "target_sparsity": 0.0}, bootstrap(figures, seed=seed)))
    paired = []
    if firsts:
        names = list(firsts[0].get("groups") or {})
        for s in sparsities:
            cells = {m: folders[cell_name(m, s)] for m in methods if cell_name(m, s) in folders}
            for method, result in paired_rows(cells, baseline, names, firsts[0].get("reference"), seed).items():
                paired.append(({"method": method, "target_sparsity": s}, result))
    return intervals, paired
