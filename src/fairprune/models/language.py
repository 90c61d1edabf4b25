"""Causal language models: load any transformers causal LM, or build and train a small one.

``CausalLM`` is the LightningModule ``train.py`` trains (the bundled tiny GPT-2 / Llama configs);
when training ends it writes a plain transformers folder (``save_pretrained``, safetensors) with
the tokenizer, so the result loads anywhere with ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from fairprune.errors import UserError
from fairprune.hub import build_model, load_model, load_tokenizer



class CausalLM(L.LightningModule):
    """Train (or fine-tune) a causal LM; validation logs loss and perplexity.

    Args:
        model: hub name or folder of a pretrained causal LM; or leave unset and give ``config``.
        config: transformers config for a new model (``model_type`` plus sizes).
        tokenizer_path: the tokenizer's folder or name (linked from the data module).
        vocab_size: vocabulary size for a new model (linked from the data module).
        export: write ``<run>/model`` (model + tokenizer, save_pretrained) when training ends.
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
        self.last_results: dict[str, dict[str, float]] = {}
        self._nll = self._tokens = 0.0

    def forward(self, input_ids: torch.Tensor, **kwargs: Any):
        return self.model(input_ids=input_ids, **kwargs)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=len(ids))
        return loss

    def _eval_step(self, batch) -> None:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        tokens = ids.numel() - len(ids)  # every position but the first of each window is predicted
        self._nll += float(loss) * tokens
        self._tokens += tokens

    def validation_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch)

    def test_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch)

    def _epoch_end(self, stage: str) -> None:
        loss = self._nll / max(self._tokens, 1)
        self._nll = self._tokens = 0.0
        self.last_results[stage] = {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}
        self.log(f"{stage}/loss", loss, prog_bar=True)
        self.log(f"{stage}/ppl", self.last_results[stage]["perplexity"], prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self._epoch_end("val")

    def on_test_epoch_end(self) -> None:
        self._epoch_end("test")

    def on_train_end(self) -> None:
        # Before any on_fit_end callback (post-training pruning) touches the weights.
        if self.hparams.export and self.trainer.is_global_zero and not self.trainer.sanity_checking:
            from fairprune.callbacks.report import run_dir

            out = run_dir(self.trainer) / "model"
            self.model.save_pretrained(out)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(out)
            print(f"[lm] model written to {out}")

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}
