"""Write ``report.json``, the per-group table and the model card (``README.md``) at the end of every
fit and test, and the trained model's transformers folder (``<run>/model``) when training ends."""

from __future__ import annotations

import time
import weakref
from pathlib import Path
from typing import Any

import lightning as L
import pandas as pd
import torch
import yaml

from fairprune.callbacks.history import continue_metrics
from fairprune.pruning.masks import achieved_sparsity, prunable_targets, sparsity_table
from fairprune.reporting.card_classifier import ClassifierCard
from fairprune.reporting.card_lm import LMCard
from fairprune.reporting.environment import environment
from fairprune.reporting.model_card import write_model_card
from fairprune.reporting.report import Report, group_table, markdown, write_json
from fairprune.storage.atomic import write_csv

_RUN_DIRS: weakref.WeakKeyDictionary[L.Trainer, Path] = weakref.WeakKeyDictionary()


def run_dir(trainer: L.Trainer) -> Path:
    """The run folder: the logger's folder (``runs/<experiment>/<method>``) or the root dir.

    Under DDP ``trainer.log_dir`` is a broadcast from rank 0 that every process must join, so the
    folder is resolved once per trainer in a hook every process runs (each callback that writes
    calls this in its ``setup``) and remembered: later calls, rank 0's alone included, start no
    collective.
    """
    found = _RUN_DIRS.get(trainer)
    if found is None:
        found = _RUN_DIRS[trainer] = Path(trainer.log_dir or trainer.default_root_dir)
    return found


def _write_card(trainer: L.Trainer, pl_module: L.LightningModule, out: Path, report: Report) -> None:
    """The run folder's model card, by the writer of the module's kind (a causal LM's, or a
    classifier's): the checkpoint this run saved (or the one it was given), the
    model class that loads it, and the settings in the folder's ``config.yaml`` (a pruning run's, or
    the CLI's) when it has one."""
    saver = trainer.checkpoint_callback
    checkpoint = (getattr(saver, "last_model_path", "") or getattr(saver, "best_model_path", "")
                  or trainer.ckpt_path or None)
    try:
        config = yaml.safe_load((out / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        config = None
    from fairprune.models.language import CausalLM  # here: a classifier's run never loads the LM stack

    card = LMCard if isinstance(pl_module, CausalLM) else ClassifierCard
    write_model_card(out, report, config, card=card, checkpoint=checkpoint,
                     model_class=f"{type(pl_module).__module__}.{type(pl_module).__qualname__}")


class ReportWriter(L.Callback):
    """Collects what a run measured and writes ``report.json``, ``groups.csv`` and ``sparsity.csv``
    when a fit ends (validation split), when a test ends and when a ``validate`` run ends.

    Other callbacks contribute fields by defining ``report_fields() -> dict`` (a pruning callback
    gives its method, target sparsity, reference and timings); the data module and the model may
    define it too (a channel-pruned vision model gives its granularity, channel sparsity and
    parameter counts).

    A model that defines ``export_parts() -> list`` (a causal LM: its transformers model and
    tokenizer) has each part written with ``save_pretrained`` to ``<run>/model`` when training
    ends, by the first process only; models never write run folders themselves.

    A fit resumed from a checkpoint keeps its history: ``metrics.csv`` continues (when the caller
    remembered it before the fit: :func:`fairprune.callbacks.history.remember_metrics`),
    ``seconds.total`` adds the time before the checkpoint (kept in this callback's checkpoint state)
    and the report says ``"resumed": {"from_epoch", "from_step"}``.
    """

    def __init__(self, filename: str = "report.json", print_table: bool = True) -> None:
        self.filename = filename
        self.print_table = print_table
        self._start = time.perf_counter()
        self._fitted = False
        self.reports: dict[str, Report] = {}  # the last report written per split, for the caller
        self._seconds_before = self._seconds_restored = 0.0  # the run's seconds before the checkpoint it resumed from
        self._resuming = False
        self.resumed: dict[str, int] | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # A fit followed by a test on the same trainer (pruning runs) counts from the fit's start.
        if stage == "fit" or not self._fitted:
            self._start = time.perf_counter()
        self._fitted = self._fitted or stage == "fit"
        if stage == "fit":
            self._seconds_before, self._seconds_restored, self._resuming, self.resumed = 0.0, 0.0, False, None
        run_dir(trainer)  # on every process: later, rank 0 alone writes without a collective

    def _fields(self, trainer: L.Trainer, pl_module: L.LightningModule | None = None) -> dict[str, Any]:
        fields: dict[str, Any] = {"method": "dense"}
        hp = getattr(trainer.datamodule, "hparams", {})
        for key, name in (("dataset", "dataset"), ("target", "task"), ("sensitive", "sensitive")):
            if key in hp:
                fields[name] = hp[key]
        sources = [trainer.datamodule, pl_module, *trainer.callbacks]  # a model tells its own architecture
        for source in sources:
            if source is not None and source is not self and hasattr(source, "report_fields"):
                fields.update(source.report_fields())
        return fields

    def write(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> Report | None:
        results = getattr(pl_module, "last_results", {}).get(stage)
        if not results or trainer.sanity_checking:
            return None
        targets = prunable_targets(pl_module)
        report: Report = {
            "method": "dense",
            "model": pl_module.hparams.get("backbone") or pl_module.hparams.get("model")
            or (pl_module.hparams.get("config") or {}).get("model_type") or type(pl_module).__name__,
            "split": stage,
        }
        report.update(self._fields(trainer, pl_module))
        for key in ("reference", "dense"):  # per-split figures: keep this split's (and the facts beside them)
            figures = report.get(key)
            if isinstance(figures, dict) and stage in figures:
                facts = {k: v for k, v in figures.items() if k not in ("val", "test")}
                report[key] = {"method": "dense", **facts, **figures[stage]}
        report.setdefault("achieved_sparsity", achieved_sparsity(targets))  # a channel-pruned model gives its own
        report.update({"metrics": {}, "groups": {}, "fairness": {}, **results})  # as the module measured them
        report.setdefault("seconds", {})["total"] = self._elapsed()
        report["threads"] = torch.get_num_threads()  # CPU threads torch ran with (train.py / prune.py --threads)
        report["environment"] = environment()  # library versions and the machine
        if self.resumed is not None:
            report["resumed"] = dict(self.resumed)
        if not trainer.is_global_zero:  # under DDP every process returns the (synced) figures; rank 0 alone writes
            self.reports[stage] = report
            return report
        out = run_dir(trainer)
        _write_card(trainer, pl_module, out, report)  # README.md, before the report that marks the run finished
        write_json(out / self.filename, report)
        table = group_table(report)
        if len(table):
            write_csv(out / "groups.csv", table)
        write_csv(out / "sparsity.csv", layer_table(pl_module, targets), index=False)
        if self.print_table:
            print(f"\n{stage} results ({report['method']}, {out / self.filename}):")
            if len(table):
                print(markdown(table))
            figures = {**report["metrics"], **report["fairness"]}
            print("  ".join(f"{k}={v:.4f}" for k, v in figures.items() if isinstance(v, (int, float))) + "\n")
        self.reports[stage] = report
        return report

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Before any on_fit_end callback (post-training pruning) touches the weights.
        parts = getattr(pl_module, "export_parts", lambda: [])()
        if not parts or not trainer.is_global_zero or trainer.sanity_checking:
            return
        out = run_dir(trainer) / "model"
        for part in parts:
            part.save_pretrained(out)
        print(f"[report] model written to {out}", flush=True)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write(trainer, pl_module, "val")

    # -- resume: the history before the checkpoint -----------------------------------------------
    def _elapsed(self) -> float:
        return self._seconds_before + time.perf_counter() - self._start

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._resuming = trainer.state.fn == "fit"  # a fit resumed from a checkpoint (not a test of one)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The training state is restored now: epoch and step are where the resumed run goes on.
        if self._resuming:
            self._seconds_before = self._seconds_restored
            self.resumed = {"from_epoch": trainer.current_epoch, "from_step": trainer.global_step}
            continue_metrics(trainer, trainer.current_epoch, trainer.global_step)  # remembered before the fit

    def state_dict(self) -> dict[str, Any]:
        return {"seconds": self._elapsed()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._seconds_restored = float(state.get("seconds", 0.0))

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write(trainer, pl_module, "test")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # ``train.py validate``: its own report (a fit's validations are reported when the fit ends).
        if trainer.state.fn == "validate":
            self.write(trainer, pl_module, "val")


def layer_table(pl_module: L.LightningModule, targets: list) -> pd.DataFrame:
    """``sparsity.csv``: per prunable layer its entries now (``numel``), the zero ones among them
    and their share (``sparsity``). A channel-pruned model adds ``dense_numel`` (the layer's entries
    in the network its hyper-parameters build), ``removed`` (the share of those cut out with their
    channels) and ``effective_sparsity`` (the share of the dense entries that are gone or zero)."""
    table = pd.DataFrame(sparsity_table(targets))
    dense_numels = getattr(pl_module, "dense_weight_numels", None)
    if not getattr(pl_module, "architecture", None) or dense_numels is None or table.empty:
        return table
    dense = table["layer"].map(dense_numels())
    table["dense_numel"] = dense.astype("Int64")
    table["removed"] = 1.0 - table["numel"] / dense
    table["effective_sparsity"] = 1.0 - (table["numel"] - table["zeros"]) / dense
    return table
