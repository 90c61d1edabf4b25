"""Per-group classification rates and what pruning costs each group.

Everything here is derived from one state: a confusion matrix per demographic group, shape
``[num_groups, num_classes, num_classes]`` (rows = target class, columns = predicted class). Sums
of confusion matrices are exact, so the state merges across batches, processes and metric objects
by addition, and the per-group rates, the gap between groups and the degradation against a
reference model all follow from it at ``compute`` time.

- :class:`GroupRates` (in :mod:`~fairprune.metrics.group.metric`) is the torchmetrics ``Metric``;
  :func:`group_rates` (in :mod:`~fairprune.metrics.group.functional`) is its functional twin and
  both end in the same function on the confusion tensor.
- :func:`per_group_frame` turns a result into a pandas table, one row per group.
- :func:`binary_fairness` wraps torchmetrics' demographic parity and equal opportunity for
  binary tasks, leaving out samples of unknown groups and groups with no samples.

Samples whose group is negative (unknown) are ignored by everything in this package, including
the overall accuracy.
"""

from fairprune.metrics.group.functional import (
    binary_fairness,
    flatten_result,
    group_rates,
    group_result,
    per_group_frame,
    result_values,
)
from fairprune.metrics.group.metric import GroupRates

__all__ = ["GroupRates", "group_rates", "group_result", "flatten_result", "result_values", "per_group_frame",
           "binary_fairness"]
