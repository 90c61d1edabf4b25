"""The LightningCLI behind ``train.py`` (see :mod:`fairprune.cli.train`), with fairprune's defaults.

- Model and data are chosen in YAML (``class_path`` / ``init_args``); any LightningModule and
  LightningDataModule of the project (or of the user) works.
- What the model needs to know about the data (class names, group names) is taken from the
  data module before the model is built, so configs never repeat it.
- Every run writes to ``runs/<experiment>/<method>/``: ``config.yaml``, ``metrics.csv``,
  checkpoints and ``report.json``; ``validate``, ``test`` and ``predict`` write theirs into a
  subfolder of it named after the subcommand (``<run>/test/report.json``), never over the fit's.
- A checkpoint (``--ckpt_path``) is read as data only (``weights_only=True``): one that holds code,
  is cut short or is missing is refused in one line before anything runs.
- A user mistake prints one line, ``error: ...``, and exits with status 2; SIGTERM ends a fit with
  one line and status 143 after writing ``last.ckpt`` (resume with ``--ckpt_path``), Ctrl-C with
  one line and status 130.
- ``--threads N`` sets the CPU threads (torch, numba, OpenMP / MKL, the tokenizers) before the
  model and data are built; unset, every library keeps its own choice. ``report.json`` says how
  many torch ran with.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from pkgutil import resolve_name
from typing import Any

import torch
from lightning.pytorch.cli import LightningCLI

from fairprune.callbacks.guards import FiniteCheck, RunFolderLock
from fairprune.callbacks.history import remember_metrics
from fairprune.callbacks.progress import ProgressBar
from fairprune.callbacks.report import ReportWriter
from fairprune.callbacks.saving import AtomicSaveConfig, atomic_checkpoints
from fairprune.callbacks.signals import CheckpointOnStop, stops_reported
from fairprune.cli.guard import guarded
from fairprune.errors import UserError
from fairprune.storage.atomic import check_writable, write_bytes
from fairprune.storage.checkpoints import read_checkpoint, state_dict_mismatch
from fairprune.workflows.options import MachineOptions, check_trainer

TRAINER_DEFAULTS: dict[str, Any] = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": "runs", "name": "default", "version": "dense"},
    },
}


# Facts a data module knows that a model needs: linked when the model takes them and the config
# leaves them unset.
LINKED = ("class_names", "group_names", "tokenizer_path", "vocab_size")


# --ckpt_path values Lightning resolves itself (not files); "registry" may carry a suffix.
CKPT_KEYWORDS = ("last", "best", "hpc", "registry")

# Subcommands that measure or use a trained model: their files go into <run>/<subcommand>/.
BESIDE_THE_FIT = ("validate", "test", "predict")


def check_ckpt_path(ckpt_path: str) -> None:
    """A ``--ckpt_path`` file must exist and load as data (no code, not cut short): one line
    otherwise, before Lightning reads it."""
    if ckpt_path.split(":")[0] in CKPT_KEYWORDS or "://" in ckpt_path:
        return
    state = read_checkpoint(ckpt_path, "--ckpt_path", "pass a checkpoint written by train.py fit, e.g. "
                            "runs/<experiment>/<name>/checkpoints/last.ckpt")
    from fairprune.pruning.channels import CHECKPOINT_KEY, check_architecture

    if CHECKPOINT_KEY in state:  # a channel-pruned model's architecture, checked before anything is built
        check_architecture(state[CHECKPOINT_KEY], state.get("state_dict"), f"--ckpt_path '{ckpt_path}'")


class FolderKept:
    """The files of a folder as they were (its top level, files up to 16 MB), to put back when a
    run that writes there fails: a failed ``train.py test`` leaves no ``test/config.yaml`` (nor
    ``metrics.csv``) of its own behind, and an earlier test's files as they were."""

    LIMIT = 16 * 1024 * 1024

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.missing = [p for p in (self.folder, *self.folder.parents) if not p.exists()]
        self.files: dict[str, bytes] = {}
        if self.folder.is_dir():
            for entry in self.folder.iterdir():
                if entry.is_file() and entry.stat().st_size <= self.LIMIT:
                    self.files[entry.name] = entry.read_bytes()

    def restore(self) -> None:
        if not self.folder.is_dir():
            return
        for entry in self.folder.iterdir():
            if not entry.is_file() or entry.name.startswith(".lock"):
                continue
            before = self.files.get(entry.name)
            if before is None:
                entry.unlink(missing_ok=True)
            elif entry.read_bytes() != before:
                write_bytes(entry, before)
        for folder in self.missing:  # the folders the run made, if it left them empty
            try:
                folder.rmdir()
            except OSError:
                break


def beside_the_fit(trainer: Any, subcommand: str) -> None:
    """Point a validate / test / predict run's logger (or, without one, its root folder) at
    ``<the fit's folder>/<subcommand>``: its ``config.yaml``, ``metrics.csv``, ``report.json`` and
    tables go there, and the fit's stay as they are. A logger that numbers its versions itself
    (``version: null``) already starts a new folder."""
    loggers = trainer.get("logger")
    if loggers is False or loggers == [] or trainer.get("fast_dev_run"):
        root = str(trainer.get("default_root_dir") or os.getcwd())
        if Path(root).name != subcommand:
            trainer["default_root_dir"] = str(Path(root) / subcommand)
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        init_args = logger.get("init_args") if hasattr(logger, "get") else None
        if init_args is None or "version" not in init_args or init_args.get("version") is None:
            continue
        version = init_args["version"]
        version = f"version_{version}" if isinstance(version, int) else str(version)
        if Path(version).name != subcommand:  # a config.yaml written by an earlier test already says so
            init_args["version"] = f"{version.rstrip('/')}/{subcommand}"


class FairpruneCLI(LightningCLI):
    """LightningCLI that links data facts into the model and writes reports."""

    def parse_arguments(self, parser: Any, args: Any) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        cfg = self.config.get(subcommand) if subcommand else None
        if cfg is None:
            return
        # Before Lightning reads the checkpoint (for its hyper-parameters, then to restore it).
        if cfg.get("weights_only") is False:
            raise UserError("--weights_only false is not offered: checkpoints are read as data only, so a file "
                            "cannot run code; leave --weights_only out")
        if "weights_only" in cfg:
            cfg["weights_only"] = True
        if cfg.get("ckpt_path"):
            check_ckpt_path(str(cfg["ckpt_path"]))
        check_trainer(cfg.get("trainer"), "--trainer.max_epochs")

    def add_arguments_to_parser(self, parser: Any) -> None:
        # Always present, whatever callbacks a config lists: every run writes its report.
        parser.add_lightning_class_args(ReportWriter, "report")
        parser.add_lightning_class_args(ProgressBar, "progress_bar")
        # ... stops at a NaN / inf loss or weight before anything is saved, and holds its folder's lock.
        parser.add_lightning_class_args(FiniteCheck, "finite")
        parser.add_lightning_class_args(RunFolderLock, "lock")
        parser.add_argument("--threads", type=int | None, default=None,
                            help="CPU threads for torch, numba, OpenMP / MKL and the tokenizers (default: torch's own choice)")

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list) -> Any:
        # The always-present progress bar steps aside when the user turns progress bars off
        # (Lightning refuses a progress-bar callback with enable_progress_bar: false).
        if config.get("enable_progress_bar") is False:
            callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
        trainer = super()._instantiate_trainer(config, [*callbacks, CheckpointOnStop()])  # SIGTERM keeps a last.ckpt
        return atomic_checkpoints(trainer)  # checkpoints whole or not at all (a full disk leaves none cut short)

    def _run_subcommand(self, subcommand: str) -> None:
        kept = FolderKept(self.trainer.log_dir) if subcommand in BESIDE_THE_FIT and self.trainer.log_dir else None
        try:
            # A SIGTERM / Ctrl-C ends the run as one line naming the epoch and the checkpoint to resume from.
            with stops_reported(self.trainer, "--ckpt_path"):
                super()._run_subcommand(subcommand)
        except BaseException as err:
            if kept is not None and self.trainer.is_global_zero:
                kept.restore()  # a failed validate / test / predict leaves its folder as it was
            reason = state_dict_mismatch(err)
            ckpt_path = (self.config.get(subcommand) or {}).get("ckpt_path")
            if isinstance(err, UserError) and ckpt_path and str(err).startswith("the checkpoint"):
                raise UserError(f"--ckpt_path '{ckpt_path}': {err}") from None  # refused while Lightning loaded it
            if reason is None or not ckpt_path:
                raise
            raise UserError(f"--ckpt_path '{ckpt_path}' holds weights that do not fit the model the config builds "
                            f"({reason}); pass a checkpoint of this model, written by train.py fit or prune.py "
                            "vision, with the settings it was trained with") from None

    def before_fit(self) -> None:
        self._check_run_folder()
        remember_metrics(self.trainer)  # --ckpt_path: the resumed run's metrics.csv keeps the rows before it

    def before_validate(self) -> None:
        self._check_run_folder()

    def before_test(self) -> None:
        self._check_run_folder()

    def _check_run_folder(self) -> None:
        """One line before any work when the run folder cannot be written (read-only, not a folder):
        the logger's folder (no collective: the logger computes it from its settings), else the root dir."""
        logger = self.trainer.logger
        folder = getattr(logger, "log_dir", None) if logger is not None else None
        check_writable(folder or self.trainer.default_root_dir, "the run folder (--trainer.logger.init_args.save_dir)")

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        MachineOptions(threads=cfg.get("threads")).apply()  # before the model, the data and their pools exist
        if self.subcommand in BESIDE_THE_FIT and cfg.get("trainer") is not None:
            beside_the_fit(cfg["trainer"], self.subcommand)
        data_cfg, model_cfg = cfg.get("data"), cfg.get("model")
        if not data_cfg or not model_cfg or "class_path" not in data_cfg or "class_path" not in model_cfg:
            return
        data_cls = resolve_name(data_cfg.class_path)
        accepted = inspect.signature(resolve_name(model_cfg.class_path).__init__).parameters
        wanted = [k for k in LINKED if k in accepted and model_cfg.init_args.get(k) is None]
        if not wanted:
            return
        # Data modules build cheaply (they read no files in __init__), and building one here also
        # validates the data settings before anything heavy starts.
        data = data_cls(**dict(data_cfg.get("init_args") or {}))
        for key in wanted:
            if hasattr(data, key):
                value = getattr(data, key)
                model_cfg.init_args[key] = list(value) if isinstance(value, (list, tuple)) else value


def dispatch(args: list[str] | None = None) -> int:
    """Run the training CLI; return the process exit status."""
    torch.set_float32_matmul_precision("high")
    return guarded(lambda: FairpruneCLI(
        model_class=None,
        datamodule_class=None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_callback=AtomicSaveConfig,  # config.yaml whole or not at all
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"exit_on_error": False},
        args=args,
    ))


