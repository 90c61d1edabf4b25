"""Post-training pruning when ``fit`` ends: train a causal LM, then prune it in the same run.

``train.py fit --config configs/lm/tiny_gpt2_sparsegpt.yaml`` trains the bundled LM, writes it to
``<run>/model``, then this callback prunes a copy with the chosen solver (the same code as
``prune.py <method>``) and writes ``<run>/pruned-<method>/`` (HF folder, ``report.json`` with the
before / after perplexity and stereotype score). Calibration and evaluation text come from the
data module (its train / validation text), the paired set from ``pairs`` (bundled by default).
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L

from fairprune.callbacks.report import run_dir
from fairprune.lm_runs import parse_sparsity, prune_loaded, split_pairs
from fairprune.pruning.llm import METHODS
from fairprune.errors import UserError, suggest


class PostTrainingPruning(L.Callback):
    """Prune the trained LM with magnitude / Wanda / SparseGPT / Debias-SparseGPT when fit ends.

    Args:
        method: ``magnitude``, ``wanda``, ``sparsegpt`` or ``debias-sparsegpt``.
        sparsity: fraction in [0, 1) or ``"N:M"`` (e.g. ``"2:4"``).
        nsamples / seqlen: calibration windows from the training text.
        pairs: StereoSet JSON / CrowS-Pairs CSV; unset = the bundled paired set.
        percdamp / blocksize: SparseGPT settings. device: ``auto``, ``cpu``, ``cuda``.
    """

    def __init__(self, method: str = "sparsegpt", sparsity: str = "0.5", nsamples: int = 64, seqlen: int = 128,
                 pairs: str | None = None, percdamp: float = 0.01, blocksize: int = 128, device: str = "auto",
                 seed: int = 0) -> None:
        if method not in METHODS:
            raise UserError(f"unknown post-training method '{method}'{suggest(method, METHODS)}; choose one of {', '.join(METHODS)}")
        parse_sparsity(sparsity)  # fail before training, not after it
        self.method, self.sparsity, self.pairs, self.seed = method, sparsity, pairs, seed
        self.settings = {"nsamples": nsamples, "seqlen": seqlen, "percdamp": percdamp, "blocksize": blocksize, "device": device}
        self.report: dict[str, Any] | None = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        from fairprune.data.text import stereo_pairs
        from fairprune.metrics.language import read_pairs

        train_text, val_text = trainer.datamodule.texts()
        calib_pairs, eval_pairs = split_pairs(read_pairs(self.pairs) if self.pairs else stereo_pairs(), self.seed)
        model = copy.deepcopy(pl_module.model).cpu()  # the trained model stays as it is in <run>/model
        out = run_dir(trainer) / f"pruned-{self.method}"
        self.report = prune_loaded(
            model, pl_module.tokenizer, self.method, self.sparsity, out, calib_text=train_text, eval_text=val_text,
            calib_pairs=calib_pairs, eval_pairs=eval_pairs, model_name=str(run_dir(trainer) / "model"), seed=self.seed,
            config={"method": self.method, "sparsity": str(self.sparsity), "pairs": self.pairs, **self.settings},
            **self.settings,
        )
