"""Causal language models: load any transformers causal LM, or build and train a small one.

``CausalLM`` is the LightningModule ``train.py`` trains (the bundled tiny GPT-2 / Llama configs).
It names what makes up the trained model (:meth:`CausalLM.export_parts`: the transformers model
and its tokenizer); the run's report writer (:class:`fairprune.callbacks.report.ReportWriter`)
writes them to ``<run>/model`` when training ends, a plain transformers folder
(``save_pretrained``, safetensors) that loads anywhere with ``AutoModelForCausalLM.from_pretrained``.

Validation and test loss are the token-weighted mean negative log-likelihood, summed by a
torchmetrics metric (:class:`TokenNLL`) that reduces across processes; perplexity is its exp.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torchmetrics import Metric

from fairprune.errors import UserError
from fairprune.hub import build_model, load_model, load_tokenizer
from fairprune.models.terms import TrainingTerms

STAGES = ("val", "test")


class TokenNLL(Metric):
    """Token-weighted mean negative log-likelihood over every update; ``exp`` of it is the perplexity.

    Both sums reduce across processes (``dist_reduce_fx="sum"``). The NLL is summed in float64
    (float32 on MPS), as a Python float was: one process gets exactly ``Σ loss·tokens / Σ tokens``.
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("nll", torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("tokens", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, mean_nll: torch.Tensor, tokens: int) -> None:
        """Add one batch: its mean NLL over ``tokens`` predicted tokens."""
        wide = torch.float32 if self.nll.device.type == "mps" else torch.float64
        # Assigned, not added in place: the sum stays wide whatever dtype the module was cast to.
        self.nll = self.nll.to(wide) + mean_nll.detach().to(wide) * tokens
        self.tokens = self.tokens + tokens

    def compute(self) -> torch.Tensor:
        return self.nll / self.tokens.clamp(min=1)



class CausalLM(TrainingTerms, L.LightningModule):
    """Train (or fine-tune) a causal LM; validation logs loss and perplexity.

    Args:
        model: hub name or folder of a pretrained causal LM; or leave unset and give ``config``.
        config: transformers config for a new model (``model_type`` plus sizes).
        tokenizer_path: the tokenizer's folder or name (linked from the data module).
        vocab_size: vocabulary size for a new model (linked from the data module).
        export: have ``<run>/model`` (model + tokenizer, save_pretrained) written when training ends.
        trust_remote_code: allow a hub model's own code to run (off unless asked).
    """

    def __init__(
        self,
        model: str | None = None,
        config: dict[str, Any] | None = None,
        tokenizer_path: str | None = None,
        vocab_size: int | None = None,
        optimizer: OptimizerCallable = lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
        scheduler: LRSchedulerCallable | None = None,
        export: bool = True,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        if (model is None) == (config is None):
            raise UserError("CausalLM needs exactly one of model (a pretrained name or folder) or config (a new model)")
        self.save_hyperparameters()
        self.tokenizer = None
        if tokenizer_path is not None:
            self.tokenizer = load_tokenizer(tokenizer_path)
        if model is not None:
            self.model = load_model(model, "causal-lm", trust_remote_code)
            self.model.train()  # from_pretrained returns eval mode, and Lightning keeps submodule modes
        else:
            if vocab_size is None:
                raise UserError("a new model needs vocab_size (linked from the data module's tokenizer)")
            self.model = build_model(config, "causal-lm", self.tokenizer, vocab_size=vocab_size)
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.last_results: dict[str, dict] = {}  # per stage: {"metrics": {"loss", "perplexity"}}
        self.token_nll = nn.ModuleDict({stage: TokenNLL() for stage in STAGES})
        self.init_training_terms()

    def forward(self, input_ids: torch.Tensor, **kwargs: Any):
        return self.model(input_ids=input_ids, **kwargs)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=len(ids))
        return self.with_loss_terms(loss, len(ids))

    def _eval_step(self, stage: str, batch) -> None:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        tokens = ids.numel() - len(ids)  # every position but the first of each window is predicted
        self.token_nll[stage].update(loss, tokens)

    def validation_step(self, batch, batch_idx: int) -> None:
        self._eval_step("val", batch)

    def test_step(self, batch, batch_idx: int) -> None:
        self._eval_step("test", batch)

    def _epoch_end(self, stage: str) -> None:
        loss = float(self.token_nll[stage].compute())  # summed over every process
        self.token_nll[stage].reset()
        perplexity = math.exp(min(loss, 50.0))
        # The report's shape (``metrics`` / ``groups`` / ``fairness``); an LM has overall figures only.
        self.last_results[stage] = {"metrics": {"loss": loss, "perplexity": perplexity}}
        self.log(f"{stage}/loss", loss, prog_bar=True)
        self.log(f"{stage}/ppl", perplexity, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self._epoch_end("val")

    def on_test_epoch_end(self) -> None:
        self._epoch_end("test")

    def export_parts(self) -> list[Any]:
        """What ``<run>/model`` holds (each written with ``save_pretrained`` by the report writer when
        training ends): the transformers model and its tokenizer; nothing when ``export`` is off."""
        if not self.hparams.export:
            return []
        return [part for part in (self.model, self.tokenizer) if part is not None]

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.optimizer_groups())
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}
