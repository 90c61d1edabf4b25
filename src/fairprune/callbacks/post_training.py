"""Post-training pruning when ``fit`` ends: train a causal LM, then prune it in the same run.

``train.py fit --config configs/lm/tiny_gpt2_sparsegpt.yaml`` trains the bundled LM, writes it to
``<run>/model``, then this callback prunes a copy with the chosen method and writes
``<run>/pruned-<method>/`` (HF folder, ``report.json`` with the before / after perplexity and
stereotype score). A weight method runs the run every ``prune.py <method>`` runs
(:func:`fairprune.runs.lm.prune_run`): the dense figures as the reference (from the project
cache when an earlier run measured the same weights on the same texts, unless ``dense_cache:
false``), lm-eval's figures with ``lm_eval.tasks``, the timings and memory, the same report and
folder, swapped in whole. A head method runs ``prune.py fasp``'s code. Calibration and evaluation
text come from the data module (its train / validation text), the paired set from
``calibration.pairs`` (bundled by default).

The options are the commands' own types, with their names and defaults: ``calibration``
(:class:`~fairprune.pruning.options.CalibrationOptions`: nsamples, seqlen, device, seed, ...),
``lm_eval`` (:class:`~fairprune.pruning.options.TaskOptions`: tasks, task_data, limit, num_fewshot),
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
from fairprune.causal.blocks import Resident
from fairprune.data.pairs import LMTexts, read_pairs, split_pairs
from fairprune.data.text import stereo_pairs
from fairprune.errors import UserError
from fairprune.hub.checks import check_input_model, saved_bytes
from fairprune.memory import peak_rss_bytes
from fairprune.pruning import registry
from fairprune.pruning.options import CalibrationOptions, HeadOptions, LMOptions, SolverOptions, TaskOptions
from fairprune.pruning.sparsity import Sparsity
from fairprune.reporting.runs import write_head_run
from fairprune.runs.lm import Start, dense_of, prune_run
from fairprune.runs.tasks import task_specs
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
        lm_eval: weight methods: lm-evaluation-harness tasks measured on the dense and the pruned model (as prune.py's --tasks).
        dense_cache: reuse the dense model's figures an earlier run measured on the same weights, texts and settings; false: measure again.
    """

    def __init__(self, method: str = "sparsegpt", sparsity: str = "0.5",
                 calibration: CalibrationOptions = CalibrationOptions(), solver: SolverOptions = SolverOptions(),
                 heads: HeadOptions = HeadOptions(), save_format: str = "dense",
                 lm_eval: TaskOptions = TaskOptions(), dense_cache: bool = True) -> None:
        from fairprune.hub.compressed import check_can_compress

        self.entry = registry.get(method, ("lm", "heads"), what="post-training")
        # Fail before training, not after it.
        self.sparsity = Sparsity.parse(sparsity) if self.entry.kind == "lm" else None
        check_can_compress(save_format)
        if save_format != "dense" and self.entry.kind != "lm":
            raise UserError(f"save_format {save_format} applies to weight pruning; {method} removes heads and writes "
                            "a dense folder")
        if lm_eval.tasks and self.entry.kind != "lm":
            raise UserError(f"lm_eval.tasks applies to weight pruning here; {method} removes heads: run prune.py fasp "
                            "--tasks [...] on the trained model for its lm-eval figures")
        self.specs = task_specs(lm_eval)  # --tasks / --task_data mistakes, before training
        self.save_format, self.lm_eval, self.dense_cache = save_format, lm_eval, dense_cache
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
                "save_format": self.save_format, "calibration": asdict(self.calibration), "solver": asdict(self.solver),
                "heads": asdict(self.heads), "lm_eval": asdict(self.lm_eval), "dense_cache": self.dense_cache}

    @staticmethod
    def _checked_copy(trainer: L.Trainer, pl_module: L.LightningModule, out) -> Any:
        """A CPU copy of the trained model (which stays as it is in ``<run>/model``), refused when its
        weights are not finite or its result cannot fit on the disk, before any work."""
        model = copy.deepcopy(pl_module.model).cpu()
        check_input_model(model, str(run_dir(trainer) / "model"))
        check_free_space(out, saved_bytes(model, pl_module.tokenizer), option="the pruned model's folder")
        return model

    def _lm_options(self, trainer: L.Trainer, model) -> LMOptions:
        """The run's options as a command's: the callback's calibration and lm-eval settings, the
        trained model (``<run>/model``) in its own dtype, kept in memory."""
        from fairprune.hub.compressed import dtype_name

        return LMOptions(model=str(run_dir(trainer) / "model"), **asdict(self.calibration), **asdict(self.lm_eval),
                         dense_cache=self.dense_cache, dtype=dtype_name(next(model.parameters()).dtype),
                         save_format=self.save_format, stream=False)

    def _prune_weights(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The run every LM weight-pruning command runs (:func:`fairprune.runs.lm.prune_run`),
        on a copy of the trained model: the dense figures (from the project cache when an earlier
        run measured the same weights), the lm-eval pass with ``lm_eval.tasks``, the report with its
        timings and memory, the folder swapped in whole."""
        start, rss_start = time.perf_counter(), peak_rss_bytes()
        train_text, val_text = trainer.datamodule.texts()
        c = self.calibration
        calib_pairs, eval_pairs = split_pairs(read_pairs(c.pairs) if c.pairs else stereo_pairs(), c.seed)
        out = run_dir(trainer) / f"pruned-{self.method}"
        model = self._checked_copy(trainer, pl_module, out)
        lm = self._lm_options(trainer, model)
        blocks, talk = Resident(model, source=lm.model), trainer.progress_bar_callback is not None
        load_seconds = time.perf_counter() - start
        texts = LMTexts(train_text, val_text, calib_pairs, eval_pairs, calib_name="the data module's training text")
        measuring = dense_of(blocks, pl_module.tokenizer, texts, lm, talk, self.specs)
        self.report = prune_run(blocks, self.method, self.sparsity, out, measuring, lm, self.solver, self._config(),
                                Start(load_seconds, rss_start), talk)

    def _prune_heads(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from fairprune.data.prompts import read_prompts
        from fairprune.runs.fasp import FaspSettings, run_fasp

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
