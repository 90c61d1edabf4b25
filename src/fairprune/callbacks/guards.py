"""Always-on guards of a run: no non-finite model is ever kept as a result, and one run per folder.

- :class:`FiniteCheck` stops a fit as soon as the training loss or a weight is NaN / inf, with one
  line naming the epoch, the step and the likely cause (the learning rate), before any checkpoint
  or report of the diverged model is written; a model that is non-finite when a fit or a test
  starts (a diverged checkpoint) is refused the same way.
- :class:`RunFolderLock` holds ``<run>/.lock`` (:mod:`fairprune.storage.lock`) while a
  ``train.py`` run writes its folder, so a second run into the same folder refuses at once.

``train.py`` adds both to every run; ``prune.py vision`` adds :class:`FiniteCheck` to its Trainer
(and locks its run folder itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch

from fairprune.callbacks.report import run_dir
from fairprune.errors import UserError
from fairprune.hub.checks import nonfinite_tensor
from fairprune.storage.lock import RunLock


def learning_rate(trainer: L.Trainer) -> float | None:
    """The first optimizer's current learning rate (None without an optimizer)."""
    for optimizer in getattr(trainer, "optimizers", None) or []:
        for group in optimizer.param_groups:
            if "lr" in group:
                return float(group["lr"])
    return None


class FiniteCheck(L.Callback):
    """Stop a run whose training loss or weights become NaN / inf, before anything is saved.

    After every training batch the loss and the weights are checked (one fused reduction); when a
    checkpoint is about to be saved, and when a fit or a test starts, the weights are checked again.
    A failure raises a :class:`UserError` (``error: ...``, exit status 2): Lightning then stops
    without saving a checkpoint, and no report is written for the diverged model.

    Args:
        check_weights_every_n_steps: how often the weights are checked during training (the loss
            is checked every step; weights are checked again before every checkpoint). 0: only
            before checkpoints.
    """

    def __init__(self, check_weights_every_n_steps: int = 1) -> None:
        if check_weights_every_n_steps < 0:
            raise UserError(f"check_weights_every_n_steps must be >= 0, got {check_weights_every_n_steps}")
        self.every = check_weights_every_n_steps

    @staticmethod
    def _where(trainer: L.Trainer) -> str:
        return f"epoch {trainer.current_epoch}, step {trainer.global_step}"

    @staticmethod
    def _cause(trainer: L.Trainer) -> str:
        lr = learning_rate(trainer)
        rate = f"the learning rate ({lr:g})" if lr is not None else "the learning rate"
        return (f"{rate} is likely too high: lower it (or clip gradients with trainer.gradient_clip_val) and train "
                "again; no checkpoint or report was written for the diverged model")

    def _diverged(self, trainer: L.Trainer, what: str) -> UserError:
        return UserError(f"training diverged at {self._where(trainer)}: {what}; {self._cause(trainer)}")

    def _check_start(self, pl_module: L.LightningModule, stage: str) -> None:
        name = nonfinite_tensor(pl_module)
        if name is not None:
            raise UserError(f"the model's weights are not finite before {stage} ({name} holds NaN or inf): the "
                            "checkpoint comes from a diverged run; retrain it with a lower learning rate")

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_start(pl_module, "training")

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_start(pl_module, "testing")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss.detach()).all()):
            raise self._diverged(trainer, f"the training loss is {loss.detach().float().mean().item()}")
        if self.every and trainer.global_step % self.every == 0:
            self._check_weights(trainer, pl_module)

    def _check_weights(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        name = nonfinite_tensor(pl_module)
        if name is not None:
            raise self._diverged(trainer, f"weight {name} became NaN / inf")

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # Raised while the checkpoint is being assembled, before anything is written.
        self._check_weights(trainer, pl_module)


class RunFolderLock(L.Callback):
    """Hold ``<run folder>/.lock`` from a run's setup until its end (also on error), so a second
    ``train.py`` run into the same folder refuses at once (see :mod:`fairprune.storage.lock`)."""

    def __init__(self) -> None:
        self._lock: RunLock | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        folder = run_dir(trainer)  # on every process (a collective under DDP); rank 0 alone locks
        if trainer.is_global_zero and self._lock is None:
            self._lock = RunLock(folder).acquire()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._release()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._release()
