"""What every classifier in fairprune shares: per-group evaluation every epoch.

A LightningModule that mixes in :class:`GroupEvaluation` calls :meth:`init_group_metrics` in its
``__init__`` and defines ``_eval_step(stage, batch)``, which calls :meth:`update_group_metrics`; the mixin logs the
group-fairness figures at each epoch end under stable names (``val/acc/<group>``,
``val/acc_gap``, ...), keeps ``last_results[stage]`` for the report writer, and carries the dense
reference that turns accuracies into degradations.
"""

from __future__ import annotations

import torch
from torch import nn

from fairprune.metrics.group import GroupRates, flatten_result, result_values

STAGES = ("val", "test")


class GroupEvaluation:
    """Mixin for LightningModules: group metrics per evaluation stage."""

    def init_group_metrics(self, class_names: list[str], group_names: list[str]) -> None:
        self.stage_metrics = nn.ModuleDict({
            stage: GroupRates(len(class_names), len(group_names), group_names, class_names) for stage in STAGES
        })
        self.last_results: dict[str, dict] = {}  # per stage: {"metrics", "groups", "fairness"}

    def set_reference(self, accuracy_by_group: dict[str, float], stage: str | None = None) -> None:
        """Store the dense model's per-group accuracy (for one stage, or all); later evaluations
        of that stage report each group's degradation."""
        for name, metric in self.stage_metrics.items():
            if stage in (None, name):
                metric.set_reference(accuracy_by_group)

    def update_group_metrics(self, stage: str, logits: torch.Tensor, target: torch.Tensor, groups: torch.Tensor) -> None:
        self.stage_metrics[stage].update(logits, target, groups)

    def _eval_step(self, stage: str, batch) -> None:  # pragma: no cover - each classifier defines it
        raise NotImplementedError

    def validation_step(self, batch, batch_idx: int) -> None:
        self._eval_step("val", batch)

    def test_step(self, batch, batch_idx: int) -> None:
        self._eval_step("test", batch)

    def _group_epoch_end(self, stage: str) -> None:
        result = self.stage_metrics[stage].result()
        self.stage_metrics[stage].reset()
        self.last_results[stage] = result_values(result)
        flat = {k: float(v) for k, v in flatten_result(result).items()}
        self.log_dict({f"{stage}/{k}": v for k, v in flat.items() if k != "acc"})
        self.log(f"{stage}/acc", flat["acc"], prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self._group_epoch_end("val")

    def on_test_epoch_end(self) -> None:
        self._group_epoch_end("test")
