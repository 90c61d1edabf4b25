"""The Diff-Pruning comparison (``prune.py diff-compare``): full fine-tuning, fine-tuning then a
magnitude-pruned fixed mask of the difference, and Diff-Pruning, on the same data, one table."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from fairprune.callbacks.diff_pruning import DiffPruning, root_model
from fairprune.pruning import diff
from fairprune.reporting.compare import write_comparison
from fairprune.reporting.records import DiffRow
from fairprune.storage.lock import locked
from fairprune.workflows.options import check_trainer


def _trainer(max_epochs: int, callbacks: list[L.Callback], **kwargs: Any) -> L.Trainer:
    settings = {"accelerator": "auto", "devices": 1, "logger": False, "enable_checkpointing": False,
                "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0, **kwargs}
    return L.Trainer(max_epochs=max_epochs, callbacks=callbacks, **settings)


def _row(method: str, module: L.LightningModule, trainer: L.Trainer, datamodule: L.LightningDataModule,
         changed: float, stored: int, full: int) -> DiffRow:
    trainer.validate(module, datamodule=datamodule, verbose=False)
    return DiffRow.from_report(module.last_results["val"], method, changed, stored, full)


@torch.no_grad()
def _changed_fraction(before: dict[str, torch.Tensor], model: nn.Module, names: list[str]) -> float:
    params = dict(model.named_parameters())
    changed = sum(int((params[n].detach() != before[n]).sum()) for n in names)
    return changed / max(sum(before[n].numel() for n in names), 1)


@locked(lambda output=None, **_: output)
def compare_diff_pruning(module: L.LightningModule, datamodule: L.LightningDataModule, target_fraction: float = 0.005,
                         epochs: int = 3, finetune_epochs: int = 1, output: str | Path | None = None,
                         trainer_kwargs: dict[str, Any] | None = None, **diff_kwargs: Any):
    """Full fine-tuning, fine-tuning + magnitude-pruned difference, and Diff-Pruning, from the same
    starting model on the same data; returns a pandas table (one row per method).

    ``module`` is an untrained :class:`~fairprune.models.text_classifier.SequenceClassifier` (it is
    copied for each method). Full fine-tuning and Diff-Pruning's gated stage train ``epochs``; both
    fixed-mask stages fine-tune ``finetune_epochs``. Columns: accuracy, per-group accuracy, the
    accuracy gap, the fraction of the gated weights changed, and the stored size against a full
    checkpoint. Diffs and the comparison (``comparison.csv`` / ``.md``, ``report.json``) are written
    to ``output`` (diffs only, to a temporary folder, when unset).
    """
    import tempfile

    import pandas as pd

    diff.check_fraction(target_fraction)
    check_trainer(trainer_kwargs, "trainer_kwargs' max_epochs")
    out = Path(output) if output is not None else Path(tempfile.mkdtemp(prefix="diffprune_"))
    kwargs = dict(trainer_kwargs or {})
    base_root = root_model(module)
    names = diff.default_gate_names(base_root) if diff_kwargs.get("parameters") is None else diff.resolve_gate_names(base_root, diff_kwargs["parameters"])
    before = {n: p.detach().clone() for n, p in base_root.named_parameters() if n in names}
    full = diff.full_bytes(base_root)
    base_dir = out / "base"
    base_root.save_pretrained(base_dir)
    rows = []

    # 1. Full fine-tuning: every parameter changes and a full checkpoint is stored.
    dense = copy.deepcopy(module)
    trainer = _trainer(epochs, [], **kwargs)
    trainer.fit(dense, datamodule=datamodule)
    rows.append(_row("full-finetune", dense, trainer, datamodule, _changed_fraction(before, root_model(dense), names), full, full))

    # 2. The fine-tuned difference, magnitude-pruned to the target, then fixed-mask fine-tuning.
    masked = copy.deepcopy(module)
    tuned = dict(root_model(dense).named_parameters())
    diff.attach_gates(root_model(masked), names, train_ungated=diff_kwargs.get("train_ungated", False))
    diff.fix_difference(root_model(masked), {n: tuned[n].detach() - before[n] for n in names}, target_fraction)
    for n, p in root_model(masked).named_parameters():  # the head starts from the fine-tuned one
        if "parametrizations." not in n and p.requires_grad:
            p.data.copy_(tuned[n].detach())
    trainer = _trainer(finetune_epochs, [], **kwargs)
    if finetune_epochs:
        trainer.fit(masked, datamodule=datamodule)
    saved = diff.save_diff(root_model(masked), out / "finetune-magnitude", str(base_dir))
    rows.append(_row("finetune+magnitude", masked, trainer, datamodule, diff.nonzero_fraction(root_model(masked)), saved["stored_bytes"], full))

    # 3. Diff-Pruning.
    gated = copy.deepcopy(module)
    gated.base_name_or_path = str(base_dir)
    callback = DiffPruning(gated_epochs=epochs, finetune_epochs=finetune_epochs, target_fraction=target_fraction,
                           save=False, **diff_kwargs)
    trainer = _trainer(epochs + finetune_epochs, [callback], **kwargs)
    trainer.fit(gated, datamodule=datamodule)
    saved = diff.save_diff(root_model(gated), out / "diff-pruning", str(base_dir))
    rows.append(_row("diff-pruning", gated, trainer, datamodule, diff.nonzero_fraction(root_model(gated)), saved["stored_bytes"], full))
    if output is not None:
        write_comparison(rows, out, {"target_fraction": target_fraction})
    return pd.DataFrame([row.as_dict() for row in rows]).set_index("method")
