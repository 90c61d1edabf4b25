"""Loss terms and optimizer groups that callbacks add to a model, so that a model never knows the
training method that needs them.

The Diff-Pruning callback, for one, registers its expected-L0 penalty and its gates' ``log α``
group (own learning rate, no weight decay) in ``setup``, before Lightning builds the optimizer. A
LightningModule that mixes in :class:`TrainingTerms` adds every registered term to its training
loss (logging each as ``train/<name>``) and builds its optimizer from :meth:`optimizer_groups`.

A term or a group is a function of the module, not a closure over it, so a copied module
(``copy.deepcopy``) computes its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

LossTerm = Callable[[nn.Module], torch.Tensor]  # module → scalar added to the training loss
ParamGroup = Callable[[nn.Module], dict[str, Any]]  # module → {"params": [...], **optimizer options}


class TrainingTerms:
    """Mixin for LightningModules: callback-registered loss terms and optimizer groups."""

    def init_training_terms(self) -> None:
        self.loss_terms: dict[str, LossTerm] = {}
        self.param_group_terms: dict[str, ParamGroup] = {}

    def add_loss_term(self, name: str, term: LossTerm) -> None:
        """Add ``term(module)`` to every training loss, logged as ``train/<name>`` (same name: replaced)."""
        self.loss_terms[name] = term

    def add_param_group(self, name: str, group: ParamGroup) -> None:
        """Give the parameters of ``group(module)`` their own optimizer group (same name: replaced)."""
        self.param_group_terms[name] = group

    def with_loss_terms(self, loss: torch.Tensor, batch_size: int) -> torch.Tensor:
        """``loss`` plus every registered term; a term that trains something is logged per epoch."""
        for name, term in self.loss_terms.items():
            value = term(self).to(loss.device)
            if value.requires_grad:
                self.log(f"train/{name}", value, on_step=False, on_epoch=True, batch_size=batch_size)
            loss = loss + value
        return loss

    def optimizer_groups(self) -> list[dict[str, Any]]:
        """The trainable parameters: registered groups apart, every other one in the first group."""
        special = [group for make in self.param_group_terms.values() if (group := make(self))["params"]]
        taken = {id(p) for group in special for p in group["params"]}
        rest = [p for p in self.parameters() if p.requires_grad and id(p) not in taken]
        return [{"params": rest}, *special]
