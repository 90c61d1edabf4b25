"""Post-training pruning when ``fit`` ends: train a causal LM, then prune it in the same run.

``train.py fit --config configs/lm/tiny_gpt2_sparsegpt.yaml`` trains the bundled LM, writes it to
``<run>/model``, then this callback prunes a copy with the chosen method (the same code as
``prune.py <method>`` / ``prune.py fasp``) and writes ``<run>/pruned-<method>/`` (HF folder,
``report.json`` with the before / after perplexity and stereotype score). Calibration and
evaluation text come from the data module (its train / validation text), the paired set from
``calibration.pairs`` (bundled by default).

The options are the commands' own types, with their names and defaults: ``calibration``
(:class:`~fairprune.pruning.options.CalibrationOptions`: nsamples, seqlen, device, seed, ...),
``solver`` (:class:`~fairprune.pruning.options.SolverOptions`) and ``heads``
(:class:`~fairprune.pruning.options.HeadOptions`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict
from typing import Any

import lightning as L

from fairprune import distributed
from fairprune.callbacks.report import run_dir
from fairprune.data.pairs import LMTexts, read_pairs, split_pairs
from fairprune.data.text import calibration_ids, paired_ids, stereo_pairs
from fairprune.errors import UserError
from fairprune.hub import resolve_device
from fairprune.hub.checks import check_input_model, saved_bytes
from fairprune.metrics.language import eval_ids, measure_lm_items
from fairprune.pruning import registry
from fairprune.pruning.llm import calibration_facts, evaluation_facts, lm_report, prune_causal_lm
from fairprune.pruning.options import CalibrationOptions, HeadOptions, SolverOptions
from fairprune.pruning.sparsity import Sparsity
from fairprune.reporting.runs import write_head_run, write_run
from fairprune.storage.folders import check_free_space


class PostTrainingPruning(L.Callback):
    """Prune the trained LM when fit ends: its weights (an ``lm`` method: magnitude, wanda,
    sparsegpt, debias-sparsegpt) or its attention heads (a ``heads`` method: fasp, fairness, ...).

    Args:
        method: an ``lm`` or ``heads`` method of the registry.
        sparsity: weight methods: fraction in [0, 1) or ``"N:M"`` (e.g. ``"2:4"``).
        calibration: calibration and measuring settings (as prune.py's LM commands).
        solver: SparseGPT's settings.
        heads: head pruning settings (as prune.py fasp).
        save_format: weight methods: dense (save_pretrained) or compressed (compressed-tensors' sparse layouts).
    """

    def __init__(self, method: str = "sparsegpt", sparsity: str = "0.5",
                 calibration: CalibrationOptions = CalibrationOptions(), solver: SolverOptions = SolverOptions(),
                 heads: HeadOptions = HeadOptions(), save_format: str = "dense") -> None:
        from fairprune.hub.compressed import check_can_compress

        self.entry = registry.get(method, ("lm", "heads"), what="post-training")
        # Fail before training, not after it.
        self.sparsity = Sparsity.parse(sparsity) if self.entry.kind == "lm" else None
        check_can_compress(save_format)
        if save_format != "dense" and self.entry.kind != "lm":
            raise UserError(f"save_format {save_format} applies to weight pruning; {method} removes heads and writes "
                            "a dense folder")
        self.save_format = save_format
        self.method, self.calibration, self.solver, self.heads = method, calibration, solver, heads
        self.report: dict[str, Any] | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        run_dir(trainer)  # resolved on every process (a collective under DDP); rank 0 writes with it later

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        # Rank 0 alone, as one process: no sharding of the calibration, no waiting for the
        # other DDP processes (which have finished fitting and do not come).
        with distributed.local():
            if self.entry.kind == "heads":
                self._prune_heads(trainer, pl_module)
            else:
                self._prune_weights(trainer, pl_module)

    def _config(self) -> dict[str, Any]:
        return {"method": self.method, "sparsity": None if self.sparsity is None else str(self.sparsity),
                "save_format": self.save_format,
                "calibration": asdict(self.calibration), "solver": asdict(self.solver), "heads": asdict(self.heads)}

    @staticmethod
    def _checked_copy(trainer: L.Trainer, pl_module: L.LightningModule, out) -> Any:
        """A CPU copy of the trained model (which stays as it is in ``<run>/model``), refused when its
        weights are not finite or its result cannot fit on the disk, before any work."""
        model = copy.deepcopy(pl_module.model).cpu()
        check_input_model(model, str(run_dir(trainer) / "model"))
        check_free_space(out, saved_bytes(model, pl_module.tokenizer), option="the pruned model's folder")
        return model

    def _prune_weights(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        train_text, val_text = trainer.datamodule.texts()
        c = self.calibration
        calib_pairs, eval_pairs = split_pairs(read_pairs(c.pairs) if c.pairs else stereo_pairs(), c.seed)
        out = run_dir(trainer) / f"pruned-{self.method}"
        model = self._checked_copy(trainer, pl_module, out)
        texts = LMTexts(train_text, val_text, calib_pairs, eval_pairs)
        tokenizer, device, talk = pl_module.tokenizer, resolve_device(c.device), trainer.progress_bar_callback is not None
        ids = eval_ids(val_text, tokenizer, c.eval_tokens)
        start = time.perf_counter()
        before, before_items = measure_lm_items(model, tokenizer, ids, eval_pairs, c.window, device, progress=talk)
        calib = calibration_ids(tokenizer, train_text, c.nsamples, c.seqlen, c.seed) if self.entry.uses_data else None
        pairs = paired_ids(tokenizer, calib_pairs, c.seqlen) if self.entry.paired else None
        measured = time.perf_counter()
        result = prune_causal_lm(model.cpu(), self.method, self.sparsity, calib, pairs, device, self.solver.percdamp,
                                 self.solver.blocksize, progress=talk)
        pruned = time.perf_counter()
        after, items = measure_lm_items(model, tokenizer, ids, eval_pairs, c.window, device, progress=talk)
        model.to("cpu")
        self.report = lm_report(  # the report every LM run writes, the commands' own builder
            result, after, items, before, before_items, model=str(run_dir(trainer) / "model"),
            calibration=calibration_facts(texts, c.nsamples if calib is not None else 0, c.seqlen, pairs is not None),
            evaluation=evaluation_facts(ids, c.window, c.eval_tokens, eval_pairs, tokenizer),
            seconds={"prune": pruned - measured, "solve": result["seconds"]["solve"],
                     "evaluate": (measured - start) + (time.perf_counter() - pruned), "total": time.perf_counter() - start})
        write_run(out, model, tokenizer, self.report, self._config(), result["layers"], save_format=self.save_format,
                  nm=self.sparsity.nm, items=(items, None))
        print(f"[{self.method}] perplexity {before['perplexity']:.2f} → {after['perplexity']:.2f}; written to {out}", flush=True)

    def _prune_heads(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from fairprune.data.prompts import read_prompts
        from fairprune.pruning.fasp import FaspSettings, run_fasp

        _, val_text = trainer.datamodule.texts()
        out = run_dir(trainer) / f"pruned-{self.method}"
        model = self._checked_copy(trainer, pl_module, out)
        c, h = self.calibration, self.heads
        result = run_fasp(model, pl_module.tokenizer, read_prompts(h.prompts) if h.prompts else None, val_text,
                          self.method, h, out, calibration=c,
                          settings=FaspSettings(progress=trainer.progress_bar_callback is not None))
        result.report = self.report = {**result.report, "model": str(run_dir(trainer) / "model")}
        write_head_run(out, model, pl_module.tokenizer, result, self._config())
        print(f"[{self.method}] removed {len(self.report['heads_removed'])} heads; written to {out}")
