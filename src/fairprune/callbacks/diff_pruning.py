"""Diff-Pruning (Guo et al., 2021) as one Lightning callback, and a side-by-side comparison.

Stages inside one ``fit``:

1. gated training for ``gated_epochs``: every chosen weight is ``θ₀ + z ⊙ δ`` with hard-concrete
   gates ``z`` and an expected-L0 penalty (see :mod:`fairprune.pruning.diff`);
2. at the start of the next epoch, global magnitude pruning of ``|z ⊙ δ|`` to ``target_fraction``
   of the gated entries; the binary mask replaces the gates and the optimizer is rebuilt;
3. fixed-mask fine-tuning for ``finetune_epochs``.

The callback is the one place that knows Diff-Pruning: in ``setup`` it registers the expected-L0
penalty as a loss term and the gates' ``log α`` as their own optimizer group (learning rate
``alpha_lr``, no weight decay) on the LightningModule (:class:`fairprune.models.terms.TrainingTerms`);
a module that builds its optimizer from plain ``parameters()`` gets the ``log α`` moved into their
own group when fit starts.

When ``fit`` ends the callback writes the diff-only checkpoint (``<run>/diff``: sparse δ, the
head, a JSON naming and hashing the base). A model built from a config has no base anyone else
holds, so its starting weights are written to ``<run>/base`` (``save_pretrained``) first.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fairprune.errors import UserError
from fairprune.pruning import diff


def root_model(pl_module: L.LightningModule) -> nn.Module:
    """The transformers model inside the LightningModule (gate names are relative to it)."""
    return getattr(pl_module, "model", pl_module)


def l0_penalty_term(pl_module: nn.Module) -> torch.Tensor:
    """The loss term the callback registers: ``λ Σ P(z > 0)`` over the gates still in the gated stage."""
    return diff.l0_penalty(root_model(pl_module))


def log_alpha_group(pl_module: nn.Module) -> dict[str, Any]:
    """The optimizer group the callback registers: the trainable ``log α``, their own lr, no weight decay."""
    root = root_model(pl_module)
    alphas = [p for p in diff.alpha_parameters(root) if p.requires_grad]
    lr = next(iter(diff.gates(root).values())).cfg.alpha_lr if alphas else 0.0
    return {"params": alphas, "lr": lr, "weight_decay": 0.0}


def _rewrap_ddp(trainer: L.Trainer) -> None:
    """Under DDP, wrap the module again: DistributedDataParallel fixes the parameters it reduces
    when it wraps a module and, expecting gradients of the now frozen ``log α``, stops the next
    step with an "unused parameters" error. Every process runs this (at the same epoch start);
    the new wrapper starts from rank 0's state."""
    strategy = trainer.strategy
    if isinstance(strategy, DDPStrategy) and isinstance(strategy.model, DistributedDataParallel):
        strategy.model = strategy.lightning_module
        strategy.configure_ddp()


class DiffPruning(L.Callback):
    """Diff-Pruning: gated training, magnitude pruning of the difference, fixed-mask fine-tuning.

    Args:
        gated_epochs: epochs of training with hard-concrete gates (N >= 1).
        finetune_epochs: epochs of fine-tuning with the fixed mask (M >= 0).
        target_fraction: share of the gated entries allowed to change, in (0, 1] (paper: 0.5 %).
        lam: weight λ of the expected-L0 penalty.
        alpha_lr: learning rate of the gates' log α (their own optimizer group).
        log_alpha_init: initial log α (5: every gate starts open).
        structured: add one gate per tensor multiplying the entry gates.
        parameters: parameter names or glob patterns to gate, relative to the transformers model
            (default: every Linear and Embedding weight outside the classifier head).
        score: rank entries by ``gated`` (|z·δ|) or ``delta`` (|δ|) when pruning.
        train_ungated: train the base's ungated parameters (biases, LayerNorm) in full too.
        save: write the diff-only checkpoint to ``<run>/diff`` when fit ends.
    """

    def __init__(self, gated_epochs: int = 3, finetune_epochs: int = 1, target_fraction: float = 0.005,
                 lam: float = 1.25e-7, alpha_lr: float = 0.1, log_alpha_init: float = 5.0, structured: bool = False,
                 parameters: list[str] | None = None, score: str = "gated", train_ungated: bool = False,
                 save: bool = True) -> None:
        diff.check_fraction(target_fraction)
        if gated_epochs < 1 or finetune_epochs < 0:
            raise UserError(f"gated_epochs must be >= 1 and finetune_epochs >= 0, got {gated_epochs} and {finetune_epochs}")
        if score not in ("gated", "delta"):
            raise UserError(f"score must be 'gated' (|z·δ|) or 'delta' (|δ|), got '{score}'")
        self.cfg = diff.GateConfig(lam=lam, alpha_lr=alpha_lr, log_alpha_init=log_alpha_init, structured=structured)
        self.gated_epochs, self.finetune_epochs = gated_epochs, finetune_epochs
        self.target_fraction, self.parameters, self.score = target_fraction, parameters, score
        self.train_ungated, self.save = train_ungated, save
        self.base: str | None = None
        self.base_hash: str | None = None
        self.kept: int | None = None
        self.saved: dict[str, Any] = {}
        self.seconds: dict[str, float] = {}

    # -- stage 1: gates --------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from fairprune.callbacks.report import run_dir

        run_dir(trainer)  # resolved on every process (a collective under DDP); rank 0 writes with it later
        root = root_model(pl_module)
        self.register(pl_module)
        if diff.gates(root):  # resumed from a checkpoint, or a second fit on the same module
            return
        self.base = getattr(pl_module, "base_name_or_path", None) or self._save_base(trainer, root)
        names = diff.attach_gates(root, self.parameters, self.cfg, self.train_ungated)
        self.base_hash = diff.base_sha256(root)
        print(f"[diff] gated {len(names)} tensors ({diff.gated_total(root):,} entries); base: {self.base}", flush=True)

    def register(self, pl_module: L.LightningModule) -> None:
        """Add the L0 penalty to the module's training loss and the ``log α`` group to its optimizer."""
        if hasattr(pl_module, "add_loss_term") and hasattr(pl_module, "add_param_group"):
            pl_module.add_loss_term("l0_penalty", l0_penalty_term)
            pl_module.add_param_group("log_alpha", log_alpha_group)
        else:
            print(f"[diff] warning: {type(pl_module).__name__} takes no callback loss terms "
                  "(fairprune.models.terms.TrainingTerms); the gates train without the L0 penalty", flush=True)

    def _save_base(self, trainer: L.Trainer, root: nn.Module) -> str:
        """A model built from a config: write its starting weights, the base the diff refers to."""
        from fairprune.callbacks.report import run_dir

        out = run_dir(trainer) / "base"
        if not hasattr(root, "save_pretrained"):
            raise UserError("Diff-Pruning needs a transformers model (pl_module.model with save_pretrained) to record its base")
        if trainer.is_global_zero:
            root.save_pretrained(out)
        return str(out)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        needed = self.gated_epochs + self.finetune_epochs
        if trainer.max_epochs is not None and 0 <= trainer.max_epochs < needed:
            print(f"[diff] {self.gated_epochs} gated + {self.finetune_epochs} fine-tuning epochs need {needed}; "
                  f"raising max_epochs from {trainer.max_epochs}", flush=True)
            trainer.fit_loop.max_epochs = needed
        self._separate_alphas(trainer, pl_module)
        self.seconds.setdefault("start", time.perf_counter())

    def _separate_alphas(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A module that built its optimizer from plain parameters(): its log α share a group.
        for optimizer in trainer.optimizers:
            if diff.separate_alpha_group(optimizer, root_model(pl_module)):
                print(f"[diff] log α moved into their own optimizer group (lr {self.cfg.alpha_lr})", flush=True)

    # -- stage 2: magnitude pruning, then fixed-mask fine-tuning -----------------------------------
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch >= self.gated_epochs and not self.pruned(pl_module):
            self.prune(trainer, pl_module)

    def pruned(self, pl_module: L.LightningModule) -> bool:
        return all(g.fixed for g in diff.gates(root_model(pl_module)).values())

    def prune(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Magnitude-prune the difference to the target and rebuild the optimizer for the new stage."""
        start = time.perf_counter()
        self.kept = diff.magnitude_prune(root_model(pl_module), self.target_fraction, self.score)
        # The log α are frozen now: a fresh optimizer (and scheduler) over what still trains.
        trainer.strategy.setup_optimizers(trainer)
        _rewrap_ddp(trainer)
        self.seconds["pruning"] = time.perf_counter() - start
        print(f"[diff] epoch {trainer.current_epoch}: kept {self.kept:,} of {diff.gated_total(root_model(pl_module)):,} "
              f"entries ({self.target_fraction:.2%}); fixed-mask fine-tuning", flush=True)

    # -- logging, checkpoint, report -------------------------------------------------------------
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        root = root_model(pl_module)
        pl_module.log("diff/nonzero_fraction", diff.nonzero_fraction(root))
        pl_module.log("diff/expected_l0", diff.expected_l0_fraction(root))
        pl_module.log("diff/stage", 2.0 if self.pruned(pl_module) else 1.0)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from fairprune.callbacks.report import run_dir

        root = root_model(pl_module)
        if not self.pruned(pl_module):
            print("[diff] fit ended before the pruning epoch; the diff keeps every gated entry still open", flush=True)
        if self.save and trainer.is_global_zero and self.base is not None:
            self.saved = diff.save_diff(root, run_dir(trainer) / "diff", self.base, self.base_hash,
                                        extra={"class_names": getattr(pl_module, "class_names", None),
                                               "group_names": getattr(pl_module, "group_names", None)})
            print(f"[diff] diff written to {run_dir(trainer) / 'diff'}: {self.saved['stored_bytes']:,} bytes "
                  f"(a full checkpoint: {self.saved['full_bytes']:,})", flush=True)
        self._fraction = diff.nonzero_fraction(root)
        self.seconds["total"] = time.perf_counter() - self.seconds.get("start", time.perf_counter())

    def report_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "method": "diff-pruning", "target_fraction": self.target_fraction,
            "gated_epochs": self.gated_epochs, "finetune_epochs": self.finetune_epochs, "base": self.base,
        }
        if hasattr(self, "_fraction"):
            fields["fraction_changed"] = self._fraction
        if self.saved:
            fields["stored_bytes"] = self.saved["stored_bytes"]
            fields["full_bytes"] = self.saved["full_bytes"]
        if "pruning" in self.seconds:
            fields["seconds"] = {"pruning": self.seconds["pruning"]}
        return fields

    def state_dict(self) -> dict[str, Any]:
        return {"base": self.base, "base_hash": self.base_hash, "kept": self.kept, "target_fraction": self.target_fraction}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("target_fraction") != self.target_fraction:
            raise UserError("the checkpoint was pruned to another target_fraction; resume with the same callback settings")
        self.base, self.base_hash, self.kept = state["base"], state["base_hash"], state["kept"]
