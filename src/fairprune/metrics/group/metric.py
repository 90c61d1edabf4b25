"""The torchmetrics ``Metric`` of per-group rates: confusion matrices summed over batches.

:class:`GroupRates` keeps one ``[num_groups, num_classes, num_classes]`` confusion tensor as its
state (summed across processes) and a per-group reference accuracy as a buffer; ``compute``
hands both to the same function as :func:`~fairprune.metrics.group.group_rates`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from fairprune.errors import UserError
from fairprune.metrics.group.functional import (
    Reference,
    _check_sizes,
    _group_confusion,
    _group_rates_compute,
    _names,
    _reference_tensor,
    group_result,
)

__all__ = ["GroupRates"]


class GroupRates(Metric):
    r"""Accuracy, FPR and FNR per demographic group, the gap between groups, and the degradation
    of each group against a reference (dense) model.

    Accepts:

    - ``preds``: ``[N, C]`` logits or probabilities (the argmax is the prediction) or ``[N]``
      integer labels. Binary tasks use ``num_classes=2`` and ``[N, 2]`` logits.
    - ``target``: ``[N]`` integer labels in ``[0, C)``.
    - ``groups``: ``[N]`` integer group ids in ``[0, num_groups)``; a negative id marks an unknown
      group and the sample is ignored everywhere, the overall ``acc`` included.

    ``compute()`` returns a flat ``dict[str, Tensor]`` of float scalars, ready for ``log_dict``:

    - ``acc``: accuracy over all samples with a known group.
    - ``acc_gap``, ``acc_std``: max − min and population std (ddof=0) of the per-group accuracy
      over present groups; 0 with fewer than two present groups.
    - ``count/<g>``, ``present/<g>`` (1 or 0) for every group.
    - ``acc/<g>``, ``fpr/<g>``, ``fnr/<g>`` for present groups only, so that no value is NaN.
      FPR and FNR are one-vs-rest per class, macro-averaged over the classes whose denominator is
      non-zero (0 if none); with ``num_classes == 2`` they are the plain FPR and FNR of class 1.
    - With ``num_classes == 2``: ``demographic_parity`` and ``equal_opportunity``, the lowest over
      the highest positive rate (resp. true positive rate) across groups, as torchmetrics'
      ``BinaryFairness`` defines them, over present groups (resp. groups with a positive target).
    - Once :meth:`set_reference` was called: ``degradation/<g>`` = reference accuracy − accuracy
      for present groups with a reference, and ``degradation_var``, ``degradation_std`` (ddof=0)
      over them.

    The reference is a persistent buffer: it is kept by ``reset()``, moves with ``.to()`` and is
    saved in and loaded from the ``state_dict``. The confusion state sums across processes.

    Args:
        num_classes: number of classes (2 for binary tasks).
        num_groups: number of demographic groups.
        group_names: one name per group for the result keys; ``"0", "1", ...`` by default.
        class_names: one name per class, kept as ``class_names`` for tables and plots.
        kwargs: torchmetrics ``Metric`` options (``dist_sync_on_step``, ``compute_on_cpu``, ...).

    Example:
        >>> import torch
        >>> from fairprune.metrics.group import GroupRates
        >>> metric = GroupRates(num_classes=3, num_groups=3, group_names=["a", "b", "c"])
        >>> preds = torch.tensor([0, 1, 2, 2, 1, 0])
        >>> target = torch.tensor([0, 1, 1, 2, 0, 0])
        >>> groups = torch.tensor([0, 0, 0, 1, 1, -1])
        >>> metric.update(preds, target, groups)
        >>> out = metric.compute()
        >>> out["acc/a"], out["acc/b"], out["acc_gap"], out["acc"]
        (tensor(0.6667), tensor(0.5000), tensor(0.1667), tensor(0.6000))
        >>> "acc/c" in out, out["count/c"], out["present/c"]
        (False, tensor(0.), tensor(0.))
        >>> metric.set_reference({"a": 1.0, "b": 1.0})
        >>> out = metric.compute()
        >>> out["degradation/a"], out["degradation/b"], out["degradation_std"]
        (tensor(0.3333), tensor(0.5000), tensor(0.0833))
    """

    is_differentiable: bool = False
    higher_is_better: bool | None = None  # accuracy up, gaps and error rates down
    full_state_update: bool = False
    plot_lower_bound: float = 0.0
    plot_upper_bound: float = 1.0

    confusion: Tensor
    reference: Tensor

    def __init__(
        self,
        num_classes: int,
        num_groups: int,
        group_names: Sequence[str] | None = None,
        class_names: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        _check_sizes(num_classes, num_groups)
        self.num_classes = num_classes
        self.num_groups = num_groups
        self.group_names = _names(group_names, num_groups, "group_names", "num_groups")
        self.class_names = _names(class_names, num_classes, "class_names", "num_classes")
        self.add_state(
            "confusion",
            default=torch.zeros(num_groups, num_classes, num_classes, dtype=torch.long),
            dist_reduce_fx="sum",
        )
        # A buffer rather than a metric state: reset() leaves it alone and state_dict saves it.
        self.register_buffer("reference", _reference_tensor(None, self.group_names), persistent=True)

    def update(self, preds: Tensor, target: Tensor, groups: Tensor) -> None:
        """Add a batch of predictions, targets and group ids to the per-group confusion matrices."""
        self.confusion += _group_confusion(preds, target, groups, self.num_classes, self.num_groups)

    def compute(self) -> dict[str, Tensor]:
        """Rates, gaps and (with a reference) degradation from the accumulated confusion matrices."""
        return _group_rates_compute(self.confusion, self.group_names, self.reference)

    def result(self, sync: bool | None = None) -> dict[str, Any]:
        """What :meth:`compute` gives, nested the way reports hold it (``metrics``, ``groups``,
        ``fairness``; see :func:`~fairprune.metrics.group.functional.group_result`), reduced
        across processes the same way.

        Args:
            sync: sum the confusion over processes (default: the metric's ``sync_on_compute``).
                ``False`` when every process saw the whole split (a sum would count it once per
                process); ``True`` when each saw its own shard. Every process must call it alike.
        """
        should_sync = self._to_sync if sync is None else sync
        with self.sync_context(should_sync=should_sync, should_unsync=self._should_unsync):
            return group_result(self.confusion, self.group_names, self.reference)

    def set_reference(self, acc_by_group: Reference) -> None:
        """Store the reference model's per-group accuracy; None clears it.

        Args:
            acc_by_group: ``{group name: accuracy}`` (groups left out have no reference), or one
                accuracy per group as a tensor or list, NaN for a group without a reference.
        """
        self.reference.copy_(_reference_tensor(acc_by_group, self.group_names))
        self._computed = None  # compute() caches its result; the reference changes it

    def reference_from_compute(self, result: Mapping[str, Tensor]) -> None:
        """Use a result of ``compute()`` (of the dense model) as the reference."""
        if not any(f"count/{g}" in result for g in self.group_names):
            raise UserError(
                f"the result has no entries for the groups {self.group_names}; pass what compute() "
                "returned for a GroupRates with the same group names"
            )
        self.set_reference({g: float(result[f"acc/{g}"]) for g in self.group_names if f"acc/{g}" in result})

    @property
    def has_reference(self) -> bool:
        """Whether any group has a reference accuracy."""
        return bool((~self.reference.isnan()).any())

    def _load_from_state_dict(
        self,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Load as usual, but accept checkpoints written before a reference existed (no reference)."""
        key = prefix + "reference"
        if key not in state_dict:
            self.set_reference(None)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if key in missing_keys:
            missing_keys.remove(key)
        self._computed = None
