"""Pruning runs for trained vision checkpoints: one method (``prune.py vision``) or a grid of
methods × sparsities compared in one table (``prune.py compare``).

Both rebuild the model and the data module from the checkpoint alone (Lightning stores their
class paths and arguments), attach :class:`~fairprune.callbacks.pruning.IterativePruning`, retrain
between steps with a real Trainer, test, and write the usual run folder.
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path
from pkgutil import resolve_name
from typing import Any

import lightning as L
import pandas as pd
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only

from fairprune.callbacks.guards import FiniteCheck
from fairprune.callbacks.history import remember_metrics
from fairprune.callbacks.progress import ProgressBar
from fairprune.callbacks.pruning import IterativePruning
from fairprune.callbacks.report import ReportWriter
from fairprune.callbacks.saving import atomic_checkpoints
from fairprune.callbacks.signals import CheckpointOnStop, stops_reported
from fairprune.errors import UserError, stop_in
from fairprune.metrics.bootstrap import bootstrap
from fairprune.models.deploy import deploy_report, input_shape_of, slower_than_dense
from fairprune.reporting.plots import plot_error_rate_changes, plot_group_shares
from fairprune.reporting.records import VisionRow
from fairprune.reporting.report import write_json
from fairprune.storage.atomic import write_text
from fairprune.storage.checkpoints import read_checkpoint
from fairprune.storage.lock import locked
from fairprune.workflows import paired as compare_cells
from fairprune.workflows.compare import Cell, Written, compare_folders, run_compare
from fairprune.workflows.options import DataOptions, TrainerOptions, VisionCompareOptions, check_trainer, result_settings
from fairprune.workflows.paired import item_outcomes, save_items, vision_cells
from fairprune.workflows.reference import (
    check_reference,
    continued_reference,
    outgrown,
    schedule_epochs,
    small_group_warnings,
)
from fairprune.workflows.trained import (  # noqa: F401 - load_trained is the vision commands' loader, imported from here
    VISION_CKPT,
    Trained,
    checkpoint_file,
    load_trained,
    measure_items_again,
    open_trained,
)


def _run_folder(output: str, name: str | None, pruning: dict[str, Any], **_: Any) -> Path:
    """``<output>/<name>``, the folder a ``prune.py vision`` run writes (and locks)."""
    method = (pruning or {}).get("method", inspect.signature(IterativePruning).parameters["method"].default)
    return Path(output) / (name or method)


@locked(_run_folder, reads=lambda ckpt, **_: checkpoint_file(ckpt))
def prune_vision(
    ckpt: str,
    pruning: dict[str, Any],
    output: str = "runs/prune",
    name: str | None = None,
    trainer: TrainerOptions | None = None,
    data: DataOptions | None = None,
    resume: str | None = None,
    seed: int = 0,
    reference: str = "continued",
    deploy: bool = True,
) -> dict[str, Any]:
    """Prune a trained checkpoint with one method, retraining between steps; return its report
    (test split, with the figures degradation is measured against under ``reference`` and the
    dense checkpoint's under ``dense``).

    The run folder is ``<output>/<name>`` (default name: the method) and holds ``config.yaml``,
    ``metrics.csv``, ``checkpoints/last.ckpt``, ``report.json``, ``groups.csv``, ``sparsity.csv``
    and, for FairGRAPE, ``group_shares.csv``.

    Args:
        ckpt: dense checkpoint written by train.py.
        pruning: the IterativePruning callback's settings (method, target_sparsity, ...).
        output: folder the run folder goes in.
        name: run folder name (default: the method).
        trainer: Trainer arguments (accelerator, devices, strategy, max_epochs, limit_train_batches, ...).
        data: overrides of the checkpoint's data settings (root, batch_size, num_workers, max_samples).
        resume: checkpoint of an interrupted pruning run to resume.
        seed: global seed.
        reference: what degradation is measured against: continued (the dense model trained on for as many epochs as the pruning schedule retrains, without pruning; cached) or dense (the checkpoint as it is).
        deploy: measure the pruned and the dense network's size, MACs and CPU latency (PyTorch, ONNX Runtime) into report.json's deploy (a few seconds per small model).
    """
    check_reference(reference)
    check_trainer(trainer)
    cell = pruning, IterativePruning(**pruning)  # its settings checked before the checkpoint is read
    report, _ = _prune(open_trained(ckpt), cell, output, name, trainer, data, resume, seed, reference, deploy)
    print(f"[prune] {report.get('method')}: accuracy {report.get('metrics', {}).get('accuracy', float('nan')):.4f}, "
          f"sparsity {report.get('achieved_sparsity', float('nan')):.4f}")
    return report


def _prune(trained: Trained, cell: tuple[dict[str, Any], IterativePruning], output: str, name: str | None,
           trainer: TrainerOptions | None, data: DataOptions | None, resume: str | None = None,
           seed: int = 0, reference: str = "continued", deploy: bool = True) -> tuple[dict[str, Any], IterativePruning]:
    """The run behind :func:`prune_vision`: its report and the pruning callback (FairGRAPE's shares).
    ``trained``: the dense checkpoint, read once; the model, the reference and the deploy figures'
    dense network are built from it. ``cell``: the pruning settings and the callback built from them."""
    pruning, callback = cell
    L.seed_everything(seed, workers=True, verbose=False)
    name = name or callback.method
    run = Path(output) / name
    model, datamodule = trained.build(data)
    if resume is not None:
        _check_resume(resume, callback)  # before anything is written or trained
    run.mkdir(parents=True, exist_ok=True)
    if resume is None and rank_zero_only.rank == 0:
        # A fresh start: an earlier run's result and checkpoint go before the new settings are
        # written, so no process (a DDP rank starting later) can take them for this run's.
        for stale in (run / "report.json", run / "README.md", run / "checkpoints" / "last.ckpt"):  # README.md: its model card
            stale.unlink(missing_ok=True)
    config = _run_config(trained, pruning, output, name, trainer, data, seed, reference)
    write_text(run / "config.yaml", yaml.safe_dump(config, sort_keys=False))
    if reference == "continued" and resume is None:  # a resumed run's checkpoint holds its reference
        figures, facts = continued_reference(lambda: trained.build(data), trained.sha256,
                                             schedule_epochs(callback, dict(trainer or {})), seed, dict(trainer or {}),
                                             dict(data or {}))
        callback.use_reference(figures, facts)
    settings = {"accelerator": "auto", "devices": 1, "log_every_n_steps": 10, **(trainer or {})}
    settings.setdefault("max_epochs", callback.last_epoch_needed)
    writer = ReportWriter()
    fit = L.Trainer(
        logger=CSVLogger(str(output), name="", version=name),
        # _RecordClasses: the checkpoints hold the dense model's settings as plain data (class paths and
        # arguments), not the objects the model was rebuilt with, so they load with weights_only=True.
        callbacks=[callback, writer, FiniteCheck(), ModelCheckpoint(dirpath=run / "checkpoints", save_last=True),
                   _RecordClasses(trained.meta), CheckpointOnStop()]
        + ([ProgressBar()] if settings.get("enable_progress_bar", True) else []),
        **settings,
    )
    atomic_checkpoints(fit)  # a full disk leaves no checkpoint cut short under its name
    remember_metrics(fit)  # a resumed run's metrics.csv keeps the rows before the checkpoint
    with stops_reported(fit, "--resume"):  # SIGTERM: last.ckpt is written, and the line says how to resume
        fit.fit(model, datamodule=datamodule, ckpt_path=resume, weights_only=True)
        fit.test(model, datamodule=datamodule, verbose=False)
    report = writer.reports.get("test", {})
    if report:
        report["ci"] = bootstrap([report], seed=seed)
        report["warnings"] = outgrown(report) + small_group_warnings(report["ci"], report)
        if fit.is_global_zero:
            save_items(run, item_outcomes(model, datamodule.test_dataloader()))
            if deploy:  # the pruned network beside the dense checkpoint's, measured in one run
                report["deploy"] = deploy_report({"pruned": model.net, "dense": trained.build(data)[0].net},
                                                 input_shape_of(datamodule))
                slower = slower_than_dense(report["deploy"], callback.granularity, callback.channel_multiple)
                if slower:  # the deploy figures say pruning cost speed: one line with what to change
                    report["warnings"].append(slower)
            write_json(run / writer.filename, report)
            for warning in report["warnings"]:
                print(f"[prune] warning: {warning}", flush=True)
    return report, callback


def _check_resume(resume: str, callback: IterativePruning) -> None:
    """``--resume`` takes only the last checkpoint of this run under the same settings: any other
    file (a dense model, another method's or schedule's run, a cut or missing file) is one line,
    raised before the run folder is touched."""
    hint = ("pass the checkpoints/last.ckpt of the interrupted prune.py vision run with the same --pruning settings, "
            "or leave --resume out to start afresh")
    saved = (read_checkpoint(resume, "--resume", hint).get("callbacks") or {}).get(callback.state_key)
    if not isinstance(saved, dict):
        raise UserError(f"--resume '{resume}' holds no IterativePruning state, so it is not a checkpoint of a pruning "
                        f"run (the dense model goes to --ckpt); {hint}")
    callback.check_state(saved, f"--resume '{resume}'")


def _run_config(trained: Trained, pruning: dict[str, Any], output: str, name: str, trainer: TrainerOptions | None,
                data: DataOptions | None, seed: int, reference: str = "continued") -> dict[str, Any]:
    """What a pruning run's ``config.yaml`` holds: everything its result depends on (the checkpoint
    by path and content: a dense model trained again under the same path is another start)."""
    return {"ckpt": trained.source, "ckpt_sha256": trained.sha256, "pruning": pruning, "trainer": trainer or {},
            "data": data or {}, "seed": seed, "output": str(output), "name": name, "reference": reference}


def _earlier_cell(run: Path, config: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """What an earlier compare left in a cell's folder under the same settings (``config.yaml``,
    leaving out what changes no result: the compare's own folder, so a moved compare is reused, and
    progress, summary and logging settings, so ``--quiet`` does not start finished cells again):
    its test report (the cell finished: reuse it), else its last checkpoint (interrupted: resume
    from it), else nothing. A folder from other settings is run again from the start."""
    def identity(found: Any) -> Any:
        if not isinstance(found, dict):
            return found
        return {**{k: v for k, v in found.items() if k != "output"}, "trainer": result_settings(found.get("trainer"))}

    try:
        if identity(yaml.safe_load((run / "config.yaml").read_text())) != identity(yaml.safe_load(yaml.safe_dump(config))):
            return None, None
    except (OSError, yaml.YAMLError):
        return None, None
    try:
        report = json.loads((run / "report.json").read_text())
    except (OSError, ValueError):
        report = None
    if isinstance(report, dict) and report.get("split") == "test":
        return report, None
    last = run / "checkpoints" / "last.ckpt"
    try:
        read_checkpoint(last)  # a checkpoint cut by a kill (or not data) is not resumed
    except UserError:
        return None, None
    return None, str(last)


def _epochs_in(last: Path) -> int:
    """Epochs a run's checkpoint finished; 0 for one cut by a kill (or not data): trained again."""
    try:
        return int(read_checkpoint(last).get("epoch", -1)) + 1
    except UserError:
        return 0


class _RecordClasses(L.Callback):
    """Writes the source checkpoint's model and data settings (class paths, arguments in their
    configuration form) into every checkpoint saved, as train.py's hold them, so
    :func:`load_trained` rebuilds the run from it."""

    def __init__(self, meta: dict[str, Any]) -> None:
        self.parts = {part: dict(meta[part]) for part in ("hyper_parameters", "datamodule_hyper_parameters") if meta.get(part)}

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint.update({part: dict(values) for part, values in self.parts.items()})


def train_dense(dense: Trained, folder: Path, seed: int, trainer: TrainerOptions | None = None,
                data: DataOptions | None = None) -> Path:
    """Train the model of a dense checkpoint afresh from ``seed``: the same model and data settings
    and the same number of epochs as the checkpoint, a new initialisation and data order. The run
    goes to ``folder`` (``checkpoints/last.ckpt``, ``metrics.csv``, ``report.json``); a finished one
    already there is reused. Returns its ``last.ckpt``."""
    meta = dense.meta
    epochs = int(meta.get("epoch", 0)) + 1
    last = folder / "checkpoints" / "last.ckpt"
    if last.is_file() and _epochs_in(last) >= epochs:
        print(f"[compare] reusing the dense model of seed {seed}: {last}", flush=True)
        return last
    _, datamodule = dense.build(data)  # the data it was trained on
    L.seed_everything(seed, workers=True, verbose=False)
    hp = dict(meta["hyper_parameters"])
    instantiator = hp.pop("_instantiator", None)
    cls = resolve_name(hp["_class_path"])
    model = resolve_name(instantiator)(cls, hp) if instantiator else cls(**{k: v for k, v in hp.items() if k != "_class_path"})
    settings = {"accelerator": "auto", "devices": 1, "log_every_n_steps": 10,
                **{k: v for k, v in (trainer or {}).items() if k != "max_epochs"}, "max_epochs": epochs}
    if last.is_file() and rank_zero_only.rank == 0:
        # A run cut short: trained again from the start, so its checkpoint goes first (ModelCheckpoint
        # would write last-v1.ckpt beside it, and this function return the cut one).
        last.unlink()
    print(f"[compare] training the dense model of seed {seed} ({epochs} epochs) into {folder}", flush=True)
    fit = L.Trainer(logger=CSVLogger(str(folder.parent), name="", version=folder.name),
                    callbacks=[_RecordClasses(meta), ReportWriter(), FiniteCheck(),
                               ModelCheckpoint(dirpath=folder / "checkpoints", save_last=True)]
                    + ([ProgressBar()] if settings.get("enable_progress_bar", True) else []), **settings)
    atomic_checkpoints(fit)
    with stops_reported(fit, None):
        fit.fit(model, datamodule=datamodule)
    return last


def _compare_folders(output: str, compare: VisionCompareOptions, **_: Any) -> list[Path]:
    """Every folder :func:`compare_vision` writes (:func:`compare_folders`): the per-seed dense runs too."""
    cells = vision_cells(output, compare)
    dense = dict.fromkeys(cell.folder.parent / "dense" for cell in cells) if compare.dense_per_seed else {}
    return compare_folders(output, cells, *dense)


@locked(_compare_folders, reads=lambda ckpt, **_: checkpoint_file(ckpt))
def compare_vision(ckpt: str, compare: VisionCompareOptions, output: str = "runs/compare") -> pd.DataFrame:
    """Run every method at every sparsity (and granularity) from one dense checkpoint; one table.

    Writes ``comparison.csv``, ``comparison.md``, ``report.json``, ``report.html``,
    ``group_accuracy.png``, ``error_rate_changes.png`` (per-group FPR / FNR change with 95 %
    ellipses per method) and ``group_shares.png`` (FairGRAPE's per-layer share of group
    importance) into ``output``.

    With several ``seeds`` every cell runs once per seed (global seed and the pruning callback's
    seed), in ``<output>/seed<s>/<method>_s<sparsity>``; the table gives each figure's mean, sd and
    n over the seeds, the plots error bars. ``dense_per_seed`` trains the dense model afresh per
    seed (``<output>/seed<s>/dense``, the checkpoint's settings and epochs) instead of pruning the
    one checkpoint every time.

    Run again on the same ``output`` (after a kill, or to add methods or seeds), a cell whose
    folder holds a finished run (``report.json`` of the test split) under the same settings
    (``config.yaml``) is reused as it is, and one cut short resumes from its last checkpoint; a
    cell whose settings changed runs again from the start. Channel cells (``granularities``) are
    ``<method>_channel_s<sparsity>``, a ``granularity`` column, paired at the same granularity.
    """
    methods = compare.methods
    if not methods or not compare.sparsities:
        raise UserError("compare needs at least one method and one sparsity")
    check_reference(compare.reference)
    check_trainer(compare.trainer)
    if (compare.baseline or methods[0]) not in methods:
        raise UserError(f"--baseline {compare.baseline!r} is not one of the compared methods ({', '.join(methods)}); "
                        "the paired differences are taken against one of them")
    if len(set(compare.every_seed)) != len(compare.every_seed):
        raise UserError(f"seeds must differ from each other, got {compare.every_seed}")
    cells = vision_cells(output, compare)
    # Every cell's settings and callback, built (and so checked) before the first long run: a weight cell's have no
    # granularity key (the config.yaml earlier versions wrote: their finished cells are reused), a seed only with several.
    shared = {k: v for k, v in (compare.pruning or {}).items() if k != "granularity"}
    plan = {(s, g, m, sp): (settings, IterativePruning(**settings)) for s, g, m, sp in (cell.key for cell in cells)
            for settings in [{**shared, "method": m, "target_sparsity": sp, **({"granularity": g} if g != "weight" else {}),
                              **({"seed": s} if len(compare.every_seed) > 1 else {})}]}
    c, start, original, sources = compare, time.perf_counter(), open_trained(ckpt), {}  # the checkpoint read once

    def source(cell: Cell) -> Trained:  # what the cells of a seed are pruned from: the checkpoint, or its dense model
        seed = cell.key[0]
        if seed not in sources:
            try:
                sources[seed] = open_trained(train_dense(original, cell.folder.parent / "dense", seed, c.trainer,
                                                         c.data)) if c.dense_per_seed else original
            except BaseException as err:
                stop_in(err, f"the dense model of seed {seed}", f"run the same command again (the dense model of seed {seed} "
                        "trains again from the start, finished ones are reused)")
                raise
        return sources[seed]

    def earlier(cell: Cell) -> tuple[dict[str, Any] | None, str | None]:
        return _earlier_cell(cell.folder, _run_config(source(cell), plan[cell.key][0], str(cell.folder.parent),
                                                      cell.name, c.trainer, c.data, cell.key[0], c.reference))

    def run(cell: Cell, resume: str | None) -> dict[str, Any]:
        try:
            return _prune(source(cell), plan[cell.key], str(cell.folder.parent), cell.name, c.trainer, c.data,
                          resume=resume, seed=cell.key[0], reference=c.reference, deploy=c.deploy)[0]
        except BaseException as err:
            # Run again, compare reuses the finished cells and resumes this one from its last.ckpt.
            kept = "resumes from its last checkpoint" if (cell.folder / "checkpoints" / "last.ckpt").is_file() \
                else "starts again"
            stop_in(err, f"cell {cell.name}{cell.tag}", f"run the same command again to resume (finished cells are reused, "
                    f"this one {kept})")
            raise

    return run_compare(output, cells, run, lambda done: _vision_comparison(done, c, plan, Path(output), start), earlier)


def _vision_comparison(done: list[tuple[Cell, dict[str, Any]]], c: VisionCompareOptions, plan: dict[tuple, tuple],
                       output: Path, start: float) -> Written:
    """The rows of every cell (the dense model's and the continued reference's before each seed's
    first), its intervals and paired differences, the plots and the report's fields."""
    repeated, levels = len(c.every_seed) > 1, compare_cells.compare_granularities(c.granularities, c.pruning)
    shown = levels != ["weight"]  # a granularity column (and key) once a compare prunes channels
    # Per cell, its reports and run folders over the seeds; per seed, the first report (it holds the dense figures).
    reports, folders, firsts, runs, shares, rows, dense_rows = {}, {}, {}, {}, {}, [], []
    for cell, report in done:
        (seed, granularity, method, sparsity), labelled = cell.key, cell.key[0] if repeated else None
        reports.setdefault(cell.name, []).append(report)
        folders.setdefault(cell.name, []).append(cell.folder)
        runs[cell.folder.relative_to(output).as_posix()] = str(cell.folder)
        if (cell.folder / "group_shares.csv").is_file():  # FairGRAPE's, written by its run
            shares.setdefault(cell.name, []).append(pd.read_csv(cell.folder / "group_shares.csv").assign(seed=seed))
        if seed not in firsts and "reference" in report:
            firsts[seed], blank = report, "" if shown else None  # blank: the dense rows' granularity cell
            found = [(row, key) for row, key in ((VisionRow.dense(report, seed=labelled, granularity=blank), "dense"),
                     (VisionRow.continued(report, seed=labelled, granularity=blank), "reference")) if row is not None]
            rows += [row for row, _ in found]
            dense_rows = dense_rows or [(row.method, key) for row, key in found]
        rows.append(VisionRow.from_report(report, method, sparsity, seed=labelled, granularity=granularity if shown else None))
    against = ("continued reference" if c.reference == "continued" else "dense model") + \
        (" (mean ± sd over seeds)" if repeated else "")
    figures = [(plot_error_rate_changes({n: (r if repeated else r[0]) for n, r in reports.items()},
                                        output / "error_rate_changes.png"),
                f"Change of each group's FPR and FNR against the {against}")]
    if shares:
        last = list(shares)[-1]
        figures.append((plot_group_shares(pd.concat(shares[last], ignore_index=True), output / "group_shares.png"),
                        f"FairGRAPE ({last}): kept share of each group's importance per layer, last step"))
    warnings = sorted({w for cell in reports.values() for r in cell for w in r.get("warnings", [])})
    for warning in warnings:
        print(f"[compare] warning: {warning}", flush=True)
    statistics = compare_cells.compare_statistics(reports, folders, list(firsts.values()), c, dense_rows, notes=warnings,
                                                  remeasure=lambda folder: measure_items_again(folder, c.data))
    extra = {"runs": runs, "seeds": c.every_seed, "dense_per_seed": c.dense_per_seed,
             "bn_recalibration": plan[done[-1][0].key][1].bn_recalibration if done else None,
             "reference": c.reference, "warnings": warnings, "seconds": {"total": time.perf_counter() - start},
             "data": next((r["data"] for cell in reports.values() for r in cell if r.get("data")), {}),  # kept / left out
             "granularities": levels}
    keys = ["method", "granularity", "target_sparsity"] if shown else ["method", "target_sparsity"]
    return Written(rows, extra, f"Vision pruning comparison ({', '.join(c.methods)})", statistics, keys, figures)
