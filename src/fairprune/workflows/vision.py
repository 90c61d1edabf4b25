"""Pruning runs for trained vision checkpoints: one method (``prune.py vision``) or a grid of
methods × sparsities compared in one table (``prune.py compare``).

Both rebuild the model and the data module from the checkpoint alone (Lightning stores their
class paths and arguments), attach :class:`~fairprune.callbacks.pruning.IterativePruning`, retrain
between steps with a real Trainer, test, and write the usual run folder.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from pkgutil import resolve_name
from typing import Any

import lightning as L
import pandas as pd
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from fairprune.callbacks.pruning import IterativePruning
from fairprune.callbacks.progress import ProgressBar
from fairprune.callbacks.report import ReportWriter
from fairprune.errors import UserError
from fairprune.reporting.plots import plot_error_rate_changes, plot_group_shares
from fairprune.reporting.report import markdown, write_json


def load_trained(ckpt: str | Path, data_overrides: dict[str, Any] | None = None) -> tuple[L.LightningModule, L.LightningDataModule]:
    """The model and data module a checkpoint was trained with (``data_overrides`` e.g. a new root)."""
    path = Path(ckpt)
    if not path.is_file():
        raise UserError(f"checkpoint '{ckpt}' does not exist; train first (python train.py fit ...) and pass its checkpoints/last.ckpt")
    meta = torch.load(path, map_location="cpu", weights_only=False)
    hp, dhp = meta.get("hyper_parameters", {}), meta.get("datamodule_hyper_parameters")
    if "_class_path" not in hp or not dhp or "_class_path" not in dhp:
        raise UserError(f"checkpoint '{ckpt}' does not record its model and data classes; use one written by train.py")
    model = resolve_name(hp["_class_path"]).load_from_checkpoint(path, map_location="cpu")
    data = resolve_name(dhp["_class_path"]).load_from_checkpoint(path, **(data_overrides or {}))
    return model, data


def prune_vision(
    ckpt: str | Path,
    pruning: dict[str, Any],
    output: str | Path = "runs/prune",
    name: str | None = None,
    trainer: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    resume: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Prune a trained checkpoint with one method, retraining between steps; return its report.

    The run folder is ``<output>/<name>`` (default name: the method) and holds ``config.yaml``,
    ``metrics.csv``, ``checkpoints/last.ckpt``, ``report.json`` (test split, with the dense
    reference), ``groups.csv``, ``sparsity.csv`` and, for FairGRAPE, ``group_shares.csv``.
    """
    L.seed_everything(seed, workers=True, verbose=False)
    callback = IterativePruning(**pruning)
    name = name or callback.method
    run = Path(output) / name
    model, datamodule = load_trained(ckpt, data)
    run.mkdir(parents=True, exist_ok=True)
    config = {"ckpt": str(ckpt), "pruning": pruning, "trainer": trainer or {}, "data": data or {}, "seed": seed,
              "output": str(output), "name": name}
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    settings = {"accelerator": "auto", "devices": 1, "log_every_n_steps": 10, **(trainer or {})}
    settings.setdefault("max_epochs", callback.last_epoch_needed)
    fit = L.Trainer(
        logger=CSVLogger(str(output), name="", version=name),
        callbacks=[callback, ReportWriter(), ModelCheckpoint(dirpath=run / "checkpoints", save_last=True)]
        + ([ProgressBar()] if settings.get("enable_progress_bar", True) else []),
        **settings,
    )
    fit.fit(model, datamodule=datamodule, ckpt_path=resume, weights_only=False)  # our own run's checkpoint
    fit.test(model, datamodule=datamodule, verbose=False)
    return json.loads((run / "report.json").read_text())


def _row(report: dict[str, Any], method: str, target: float | None) -> dict[str, Any]:
    row: dict[str, Any] = {"method": method, "target_sparsity": target,
                           "achieved_sparsity": report.get("achieved_sparsity", 0.0),
                           "accuracy": report["metrics"].get("accuracy")}
    for group, values in report["groups"].items():
        row[f"acc/{group}"] = values.get("accuracy")
    fairness = report.get("fairness", {})
    row["acc_gap"] = fairness.get("acc_gap")
    row["degradation_std"] = fairness.get("degradation_std")
    row["seconds"] = report.get("seconds", {}).get("total")
    return row


def compare_vision(
    ckpt: str | Path,
    methods: list[str],
    sparsities: list[float],
    pruning: dict[str, Any] | None = None,
    output: str | Path = "runs/compare",
    trainer: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    seed: int = 0,
) -> pd.DataFrame:
    """Run every method at every sparsity from one dense checkpoint and write one table.

    Writes ``comparison.csv``, ``comparison.md``, ``error_rate_changes.png`` (per-group FPR / FNR
    change with 95 % ellipses per method) and ``group_shares.png`` (FairGRAPE's per-layer share of
    group importance) into ``output``.
    """
    if not methods or not sparsities:
        raise UserError("compare needs at least one method and one sparsity")
    for method in methods:  # validate every cell before the first long run starts
        for sparsity in sparsities:
            IterativePruning(**{**(pruning or {}), "method": method, "target_sparsity": sparsity})
    output = Path(output)
    rows, reports = [], {}
    start = time.perf_counter()
    for method in methods:
        for sparsity in sparsities:
            name = f"{method}_s{sparsity:g}"
            print(f"[compare] {name} ({len(reports) + 1}/{len(methods) * len(sparsities)}) ...", flush=True)
            report = prune_vision(ckpt, {**(pruning or {}), "method": method, "target_sparsity": sparsity},
                                  output, name, trainer, data, seed=seed)
            reports[name] = report
            if not rows and "reference" in report:
                rows.append(_row(report["reference"], "dense", 0.0))
            rows.append(_row(report, method, sparsity))
    table = pd.DataFrame(rows)
    output.mkdir(parents=True, exist_ok=True)
    table.to_csv(output / "comparison.csv", index=False)
    (output / "comparison.md").write_text(markdown(table.set_index("method")) + "\n")
    plot_error_rate_changes(reports, output / "error_rate_changes.png")
    shares = [output / n / "group_shares.csv" for n in reports if (output / n / "group_shares.csv").exists()]
    if shares:
        plot_group_shares(pd.read_csv(shares[-1]), output / "group_shares.png")
    write_json(output / "report.json", {"comparison": rows, "runs": {n: str(output / n) for n in reports},
                                         "seconds": {"total": time.perf_counter() - start}})
    return table
