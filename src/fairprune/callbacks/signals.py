"""A run stopped from outside ends as a :class:`~fairprune.errors.Stopped` (one line, status 143 for
SIGTERM, 130 for Ctrl-C) that says where it stopped and how to resume, never as a finished run.

Lightning handles SIGTERM itself while a Trainer runs: its handler only notes the signal, and the
loops raise ``SIGTERMException`` at the next batch boundary, so the model and the loops are in a
consistent state there. That exception is a ``SystemExit`` with no status, so left alone the
process would exit 0 with nothing said. Here:

- :class:`CheckpointOnStop` writes the fit's last checkpoint at that boundary (where the run's
  ``ModelCheckpoint`` keeps ``last.ckpt``, atomically): the work since the last epoch's end is kept
  and Lightning resumes from it mid-epoch. Ctrl-C is not saved: ``KeyboardInterrupt`` can land in
  the middle of an optimizer step, so the last checkpoint of a finished epoch stays the one to
  resume from.
- :func:`stops_reported` turns what the Trainer raised into a :class:`Stopped` naming the epoch (or
  the stage) and the checkpoint to resume from.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from fairprune.errors import Stopped, UserError

_STAGES = {"validate": "while validating", "test": "while testing", "predict": "while predicting"}


def _last_checkpoint_callback(trainer: L.Trainer) -> ModelCheckpoint | None:
    """The ModelCheckpoint that keeps the run's last checkpoint (one with ``save_last``, else the first)."""
    found = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
    return next((c for c in found if c.save_last), found[0] if found else None)


def _last_path(callback: ModelCheckpoint) -> Path:
    """Where ``callback`` writes this run's ``last.ckpt``: the one it wrote already, else the name it
    would choose (a ``last-v1.ckpt`` beside an earlier run's ``last.ckpt``, which is never overwritten)."""
    if callback.last_model_path:
        return Path(callback.last_model_path)
    path, version = Path(callback.format_checkpoint_name({}, callback.CHECKPOINT_NAME_LAST)), callback.STARTING_VERSION
    while callback._enable_version_counter and path.exists():
        path = Path(callback.format_checkpoint_name({}, callback.CHECKPOINT_NAME_LAST, ver=version))
        version += 1
    return path


def saved_checkpoint(trainer: L.Trainer) -> Path | None:
    """The last checkpoint this run (or the run it resumed) wrote, if it is on disk."""
    stop = next((c for c in trainer.callbacks if isinstance(c, CheckpointOnStop)), None)
    if stop is not None and stop.saved is not None:
        return stop.saved
    callback = _last_checkpoint_callback(trainer)
    last = callback.last_model_path if callback is not None else ""
    return Path(last) if last and Path(last).is_file() else None


class CheckpointOnStop(L.Callback):
    """On SIGTERM during a fit, write the last checkpoint where the run's ``ModelCheckpoint`` keeps
    it (``last.ckpt``), so the same command resumes from the batch the run stopped at.

    The file is written beside its target and renamed over it, so a second signal during the save
    leaves the previous ``last.ckpt`` whole. A save that fails (a full disk, weights that are not
    finite) leaves the previous one too; :attr:`saved` then stays None.
    """

    def __init__(self) -> None:
        self.saved: Path | None = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != "fit":
            return
        callback = _last_checkpoint_callback(trainer)
        if callback is None:  # checkpointing is off: nothing to resume from
            return
        path = _last_path(callback)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        previous, callback.last_model_path = callback.last_model_path, str(path)  # the saved state names it
        try:
            trainer.save_checkpoint(tmp, weights_only=False)  # all of it: optimizer, loops, callbacks
            if trainer.is_global_zero:
                os.replace(tmp, path)
            trainer.strategy.barrier("checkpoint_on_stop")
        except (OSError, UserError):
            callback.last_model_path = previous
            if trainer.is_global_zero:
                tmp.unlink(missing_ok=True)
            return
        self.saved = path


def stopped(trainer: L.Trainer, cause: str, resume: str | None) -> Stopped:
    """The :class:`Stopped` of ``trainer``'s run: where it was, and how to resume (``resume``: the
    option that takes the checkpoint; None: the caller says how)."""
    fn = str(getattr(trainer.state.fn, "value", trainer.state.fn) or "")
    where = f"at epoch {trainer.current_epoch}" if fn == "fit" else _STAGES.get(fn, "")
    last = saved_checkpoint(trainer)
    if last is not None:
        advice = f"run the same command again with {resume} {last} to resume" if resume else "run the same command again to resume"
    elif fn == "fit":
        advice = "no checkpoint of this run was written yet: run the same command again"
    else:
        advice = "run the same command again"
    return Stopped(cause, where, advice)


@contextlib.contextmanager
def stops_reported(trainer: L.Trainer, resume: str | None = "--ckpt_path") -> Iterator[None]:
    """Inside: the calls of ``trainer`` (fit, test, ...). A SIGTERM or Ctrl-C that ends them leaves
    as a :class:`Stopped` saying where the run was and how to resume (``resume``: the command's
    option that takes the checkpoint)."""
    try:
        yield
    except BaseException as err:
        stop = Stopped.behind(err)
        if stop is None or stop.where:
            raise
        raise stopped(trainer, stop.cause, resume) from None
