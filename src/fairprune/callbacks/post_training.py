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

from fairprune import distributed
from fairprune.callbacks.report import run_dir
from fairprune.data.pairs import LMTexts, read_pairs, split_pairs
from fairprune.data.text import stereo_pairs
from fairprune.errors import UserError, suggest
from fairprune.hub import resolve_device
from fairprune.pruning import registry
from fairprune.pruning.llm import parse_sparsity, prune_and_measure
from fairprune.reporting.runs import write_head_run, write_lm_run


HEAD_METHOD = "fasp"


class PostTrainingPruning(L.Callback):
    """Prune the trained LM when fit ends: weights (magnitude / Wanda / SparseGPT /
    Debias-SparseGPT) or attention heads (FASP).

    Args:
        method: ``magnitude``, ``wanda``, ``sparsegpt``, ``debias-sparsegpt`` or ``fasp``.
        sparsity: fraction in [0, 1) or ``"N:M"`` (e.g. ``"2:4"``).
        nsamples / seqlen: calibration windows from the training text.
        pairs: StereoSet JSON / CrowS-Pairs CSV; unset = the bundled paired set.
        percdamp / blocksize: SparseGPT settings. device: ``auto``, ``cpu``, ``cuda``.
        gamma / alpha / axis / scorer / max_new_tokens: FASP settings (see ``prune.py fasp``).
    """

    def __init__(self, method: str = "sparsegpt", sparsity: str = "0.5", nsamples: int = 64, seqlen: int = 128,
                 pairs: str | None = None, percdamp: float = 0.01, blocksize: int = 128, device: str = "auto",
                 seed: int = 0, gamma: float | None = 0.3, alpha: float = 0.1, axis: str = "gender_and_sex",
                 scorer: str = "auto", max_new_tokens: int = 20) -> None:
        choices = (*registry.names("lm"), HEAD_METHOD)
        if method not in choices:
            raise UserError(f"unknown post-training method '{method}'{suggest(method, choices)}; choose one of {', '.join(choices)}")
        if method == HEAD_METHOD:
            for name, value in (("alpha", alpha), ("gamma", gamma)):
                if value is not None and not 0.0 <= value <= 1.0:
                    raise UserError(f"{name} must be in [0, 1], got {value}")
        else:
            parse_sparsity(sparsity)  # fail before training, not after it
        self.fasp = {"gamma": gamma, "alpha": alpha, "axis": axis, "scorer": scorer, "max_new_tokens": max_new_tokens}
        self.method, self.sparsity, self.pairs, self.seed = method, sparsity, pairs, seed
        self.settings = {"nsamples": nsamples, "seqlen": seqlen, "percdamp": percdamp, "blocksize": blocksize, "device": device}
        self.report: dict[str, Any] | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        run_dir(trainer)  # resolved on every process (a collective under DDP); rank 0 writes with it later

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        # Rank 0 alone, as one process: no sharding of the calibration, no waiting for the
        # other DDP processes (which have finished fitting and do not come).
        with distributed.local():
            self._prune(trainer, pl_module)

    def _prune(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        train_text, val_text = trainer.datamodule.texts()
        if self.method == HEAD_METHOD:
            self._prune_heads(trainer, pl_module, val_text)
            return
        calib_pairs, eval_pairs = split_pairs(read_pairs(self.pairs) if self.pairs else stereo_pairs(), self.seed)
        model = copy.deepcopy(pl_module.model).cpu()  # the trained model stays as it is in <run>/model
        out = run_dir(trainer) / f"pruned-{self.method}"
        texts = LMTexts(train_text, val_text, calib_pairs, eval_pairs)
        settings = {**self.settings, "device": resolve_device(self.settings["device"])}
        report, layers = prune_and_measure(model, pl_module.tokenizer, self.method, self.sparsity, texts, seed=self.seed,
                                           progress=trainer.progress_bar_callback is not None, **settings)
        self.report = {"method": self.method, "model": str(run_dir(trainer) / "model"), **report}
        write_lm_run(out, model, pl_module.tokenizer, self.report,
                     {"method": self.method, "sparsity": str(self.sparsity), "pairs": self.pairs, **self.settings}, layers)
        print(f"[{self.method}] perplexity {report['reference']['metrics']['perplexity']:.2f} → "
              f"{report['metrics']['perplexity']:.2f}; written to {out}", flush=True)

    def _prune_heads(self, trainer: L.Trainer, pl_module: L.LightningModule, val_text: str) -> None:
        from fairprune.pruning.fasp import Generation, run_fasp

        out = run_dir(trainer) / "pruned-fasp"
        model = copy.deepcopy(pl_module.model).cpu()
        f = self.fasp
        run = run_fasp(model, pl_module.tokenizer, None, val_text, "fasp", f["gamma"], f["alpha"], f["axis"],
                       f["scorer"], out, generation=Generation(max_new_tokens=f["max_new_tokens"], seed=self.seed),
                       seqlen=self.settings["seqlen"], seed=self.seed, progress=trainer.progress_bar_callback is not None)
        self.report = {**run.report, "model": str(run_dir(trainer) / "model")}
        run.report = self.report
        write_head_run(out, model, pl_module.tokenizer, run, {"method": "fasp", **f, "seed": self.seed, **self.settings})
        print(f"[fasp] removed {len(self.report['heads_removed'])} heads; written to {out}")
