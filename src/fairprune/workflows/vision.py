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

from fairprune import distributed
from fairprune.callbacks.guards import FiniteCheck
from fairprune.callbacks.history import remember_metrics
from fairprune.callbacks.progress import ProgressBar
from fairprune.callbacks.pruning import IterativePruning
from fairprune.callbacks.report import ReportWriter
from fairprune.callbacks.saving import atomic_checkpoints
from fairprune.callbacks.signals import CheckpointOnStop, stop_in, stops_reported
from fairprune.errors import UserError
from fairprune.metrics.bootstrap import bootstrap
from fairprune.models.deploy import deploy_report, input_shape_of, slower_than_dense
from fairprune.reporting.compare import write_comparison
from fairprune.reporting.plots import plot_error_rate_changes, plot_group_shares
from fairprune.reporting.records import VisionReport, VisionRow
from fairprune.reporting.report import write_json
from fairprune.storage.atomic import write_text
from fairprune.storage.checkpoints import read_checkpoint
from fairprune.storage.lock import locked
from fairprune.workflows import paired as compare_cells
from fairprune.workflows.options import DataOptions, TrainerOptions, check_trainer, result_settings
from fairprune.workflows.paired import cell_name, compare_statistics, item_outcomes, save_items
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


def _same_config(run: Path, config: dict[str, Any]) -> bool:
    """Whether the run in ``run`` had the settings of ``config``, leaving out what changes no
    result: the compare's own folder (a moved compare is reused) and progress, summary and
    logging settings (``--quiet`` does not start finished cells again)."""
    def identity(found: Any) -> Any:
        if not isinstance(found, dict):
            return found
        return {**{k: v for k, v in found.items() if k != "output"}, "trainer": result_settings(found.get("trainer"))}

    try:
        earlier = yaml.safe_load((run / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return False
    return identity(earlier) == identity(yaml.safe_load(yaml.safe_dump(config, sort_keys=False)))


def _earlier_cell(run: Path, config: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """What an earlier compare left in a cell's folder under the same settings: its test report
    (the cell finished: reuse it), else its last checkpoint (interrupted: resume from it), else
    nothing. A folder from other settings is run again from the start."""
    if not _same_config(run, config):
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


def _compare_folders(output: str, methods: list[str], sparsities: list[float], seed: int = 0,
                     seeds: list[int] | None = None, dense_per_seed: bool = False, granularities: list[str] | None = None,
                     pruning: dict[str, Any] | None = None, **_: Any) -> list[Path]:
    """Every folder :func:`compare_vision` writes, its output first: the per-seed dense runs and the
    cells, named as its loop names them. All are locked before the first cell runs, so a run into
    one of them (``prune.py vision --name <cell>``) is refused while compare runs, and compare is
    refused at once by such a run."""
    seeds = list(seeds) if seeds else [seed]
    bases = [Path(output) / f"seed{s}" if len(seeds) > 1 else Path(output) for s in seeds]
    levels = compare_cells.compare_granularities(granularities, pruning)
    return [Path(output)] + [folder for base in bases for folder in ([base / "dense"] if dense_per_seed else [])
                             + [base / cell_name(method, sparsity, g) for g in levels for method in methods or []
                                for sparsity in sparsities or []]]


@locked(_compare_folders, reads=lambda ckpt, **_: checkpoint_file(ckpt))
def compare_vision(
    ckpt: str,
    methods: list[str],
    sparsities: list[float],
    pruning: dict[str, Any] | None = None,
    output: str = "runs/compare",
    trainer: TrainerOptions | None = None,
    data: DataOptions | None = None,
    seed: int = 0,
    seeds: list[int] | None = None,
    dense_per_seed: bool = False,
    reference: str = "continued",
    baseline: str | None = None,
    granularities: list[str] | None = None,
    deploy: bool = True,
) -> pd.DataFrame:
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
    cell whose settings changed runs again from the start.

    ``granularities`` (default: ``pruning``'s, weight) runs every method at each (channel cells in
    ``<method>_channel_s<sparsity>``, a ``granularity`` column; paired at the same granularity). ``deploy``: each cell's report measures its network and the dense one
    (``report.json``'s ``deploy``; the table's size, MACs and latency columns).
    """
    if not methods or not sparsities:
        raise UserError("compare needs at least one method and one sparsity")
    check_reference(reference)
    check_trainer(trainer)
    baseline = baseline or methods[0]
    if baseline not in methods:
        raise UserError(f"--baseline {baseline!r} is not one of the compared methods ({', '.join(methods)}); "
                        "the paired differences are taken against one of them")
    seeds = list(seeds) if seeds else [seed]
    if len(set(seeds)) != len(seeds):
        raise UserError(f"seeds must differ from each other, got {seeds}")
    # Every cell's settings and callback, built (and so checked) once, before the first long run starts.
    levels = compare_cells.compare_granularities(granularities, pruning)
    shown = levels != ["weight"]  # a granularity column (and key) once a compare prunes channels
    plan = {key: (settings, IterativePruning(**settings))
            for key, settings in compare_cells.cell_settings(pruning, seeds, levels, methods, sparsities).items()}
    output = Path(output)
    repeated = len(seeds) > 1
    rows: list[VisionRow] = []
    reports: dict[str, list[VisionReport]] = {}
    runs: dict[str, str] = {}
    shares: dict[str, list[pd.DataFrame]] = {}
    cells, start, recalibration = len(plan), time.perf_counter(), None
    firsts: list[VisionReport] = []  # per seed, the first cell's report: it holds the dense figures
    folders: dict[str, list[Path]] = {}  # per cell, its run folder per seed
    original = open_trained(ckpt)  # read once: every cell of every seed is pruned from what was read
    for s in seeds:
        base = output / f"seed{s}" if repeated else output
        try:
            source = open_trained(train_dense(original, base / "dense", s, trainer, data)) if dense_per_seed else original
        except BaseException as err:
            stop = stop_in(err, f"the dense model of seed {s}", f"run the same command again (the dense model of "
                           f"seed {s} trains again from the start, finished ones are reused)")
            if stop is None:
                raise
            raise stop from None
        dense_seen = False
        for granularity, method in [(g, m) for g in levels for m in methods]:
            for sparsity in sparsities:
                name = cell_name(method, sparsity, granularity)
                settings, callback = plan[s, granularity, method, sparsity]
                done = sum(len(r) for r in reports.values())
                label = f"[compare] {name}{f' seed {s}' if repeated else ''} ({done + 1}/{cells})"
                report, resume = _earlier_cell(base / name, _run_config(source, settings, str(base), name, trainer, data, s,
                                                                         reference))
                if report is not None:
                    print(f"{label}: finished earlier with the same settings, reusing {base / name}", flush=True)
                    recalibration = callback.bn_recalibration
                    shares_file = base / name / "group_shares.csv"
                    share_rows = pd.read_csv(shares_file) if shares_file.is_file() else pd.DataFrame()
                else:
                    print(f"{label}{f': resuming from {resume}' if resume else ''} ...", flush=True)
                    try:
                        report, _ = _prune(source, (settings, callback), str(base), name, trainer, data, resume=resume,
                                           seed=s, reference=reference, deploy=deploy)
                    except BaseException as err:
                        # Run again, compare reuses the finished cells and resumes this one from its last.ckpt.
                        kept = "resumes from its last checkpoint" if (base / name / "checkpoints" / "last.ckpt").is_file() \
                            else "starts again"
                        stop = stop_in(err, f"cell {name}{f' seed {s}' if repeated else ''}", "run the same command "
                                       f"again to resume (finished cells are reused, this one {kept})")
                        if stop is None:
                            raise
                        raise stop from None
                    recalibration = callback.bn_recalibration
                    share_rows = pd.DataFrame(callback.share_rows())
                reports.setdefault(name, []).append(report)
                folders.setdefault(name, []).append(base / name)
                runs[f"seed{s}/{name}" if repeated else name] = str(base / name)
                if len(share_rows):
                    shares.setdefault(name, []).append(share_rows.assign(seed=s))
                if not dense_seen and "reference" in report:
                    dense_seen = True
                    firsts.append(report)
                    blank = "" if shown else None  # the dense rows' granularity cell
                    rows.append(VisionRow.dense(report, seed=s if repeated else None, granularity=blank))
                    continued = VisionRow.continued(report, seed=s if repeated else None, granularity=blank)
                    if continued is not None:
                        rows.append(continued)
                rows.append(VisionRow.from_report(report, method, sparsity, seed=s if repeated else None,
                                                  granularity=granularity if shown else None))
    table = pd.DataFrame([row.as_dict() for row in rows])
    if not distributed.is_main():  # under DDP every rank ran the cells; rank 0 writes the comparison
        return table
    figures = [(plot_error_rate_changes({n: (r if repeated else r[0]) for n, r in reports.items()},
                                        output / "error_rate_changes.png"),
                f"Change of each group's FPR and FNR against the {'continued reference' if reference == 'continued' else 'dense model'}" + (" (mean ± sd over seeds)" if repeated else ""))]
    if shares:
        last = list(shares)[-1]
        figures.append((plot_group_shares(pd.concat(shares[last], ignore_index=True), output / "group_shares.png"),
                        f"FairGRAPE ({last}): kept share of each group's importance per layer, last step"))
    warnings = sorted({w for cell in reports.values() for r in cell for w in r.get("warnings", [])})
    for warning in warnings:
        print(f"[compare] warning: {warning}", flush=True)
    dense_rows = [(row.method, key) for row, key in ((VisionRow.dense(firsts[0]), "dense"),
                                                     (VisionRow.continued(firsts[0]), "reference")) if row] if firsts else []
    intervals, paired = compare_statistics(reports, {n: [Path(p) for p in folders[n]] for n in folders}, firsts, methods,
                                           sparsities, baseline, dense_rows, seed, granularities=levels if shown else None,
                                           remeasure=lambda folder: measure_items_again(folder, data), notes=warnings)
    extra = {"runs": runs, "seeds": seeds, "dense_per_seed": dense_per_seed, "bn_recalibration": recalibration,
             "reference": reference, "warnings": warnings, "seconds": {"total": time.perf_counter() - start},
             "data": next((r["data"] for cell in reports.values() for r in cell if r.get("data")), {})}  # kept / left out
    keys = ["method", "granularity", "target_sparsity"] if shown else ["method", "target_sparsity"]
    return write_comparison(rows, output, {**extra, "granularities": levels}, keys=keys, figures=figures,
                            title=f"Vision pruning comparison ({', '.join(methods)})", intervals=intervals,
                            paired=paired, baseline=baseline)
