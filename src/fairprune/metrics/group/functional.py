"""Per-group classification rates as functions of one confusion tensor per demographic group.

The state is ``[num_groups, num_classes, num_classes]`` (rows = target class, columns = predicted
class); sums of it are exact, so it merges by addition and every rate follows from it at the end.

- :func:`group_rates` is the functional twin of :class:`~fairprune.metrics.group.GroupRates`;
  both end in :func:`_group_rates_compute` on the confusion tensor.
- :func:`per_group_frame` turns a result into a pandas table, one row per group.
- :func:`binary_fairness` wraps torchmetrics' demographic parity and equal opportunity for
  binary tasks, leaving out samples of unknown groups and groups with no samples.

Samples whose group is negative (unknown) are ignored everywhere, the overall accuracy included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import torch
from torch import Tensor
from torchmetrics.functional.classification import binary_fairness as _torchmetrics_binary_fairness
from torchmetrics.functional.classification import equal_opportunity
from torchmetrics.utilities.data import _bincount

from fairprune.errors import UserError, suggest

__all__ = ["group_rates", "group_result", "flatten_result", "result_values", "per_group_frame", "binary_fairness"]

Reference = Mapping[str, float] | Tensor | Sequence[float] | None


# ----------------------------------------------------------------------------------------------
# Arguments and inputs


def _check_sizes(num_classes: int, num_groups: int) -> None:
    """Reject class and group counts a confusion tensor cannot have."""
    if not isinstance(num_classes, int) or num_classes < 2:
        raise UserError(f"num_classes must be an integer >= 2 (binary tasks use 2), got {num_classes!r}")
    if not isinstance(num_groups, int) or num_groups < 1:
        raise UserError(f"num_groups must be an integer >= 1, got {num_groups!r}")


def _names(names: Sequence[str] | None, count: int, arg: str, count_arg: str) -> list[str]:
    """Return ``count`` unique names, ``"0", "1", ...`` when none are given."""
    if names is None:
        return [str(i) for i in range(count)]
    names = list(names)
    if len(names) != count:
        raise UserError(f"{arg} has {len(names)} names but {count_arg} is {count}; give exactly {count} names")
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != count:
        raise UserError(f"{arg} must be distinct non-empty strings, got {names}")
    return names


def _labels(preds: Tensor, num_classes: int) -> Tensor:
    """Predicted class per sample from ``[N, C]`` scores (argmax) or ``[N]`` integer labels."""
    if preds.ndim == 2:
        if preds.shape[1] != num_classes:
            raise UserError(
                f"preds has {preds.shape[1]} scores per sample but num_classes is {num_classes}; "
                "set num_classes to the model's number of outputs"
            )
        return preds.argmax(dim=1)
    if preds.ndim != 1 or preds.is_floating_point():
        raise UserError(
            f"preds must be [N, {num_classes}] scores or [N] integer labels, "
            f"got {preds.dtype} of shape {tuple(preds.shape)}"
        )
    if preds.numel() and (preds.min() < 0 or preds.max() >= num_classes):
        values = f"{preds.min().item()}..{preds.max().item()}"
        raise UserError(f"preds labels must lie in [0, {num_classes}), got values {values}")
    return preds


def _check_target_groups(target: Tensor, groups: Tensor, n: int, num_classes: int, num_groups: int) -> None:
    """Targets are class labels and groups are group ids (negative = unknown), one per sample."""
    for name, t in (("target", target), ("groups", groups)):
        if t.ndim != 1 or t.shape[0] != n or t.is_floating_point():
            raise UserError(f"{name} must be [{n}] integers (one per sample), got {t.dtype} of shape {tuple(t.shape)}")
    if n and (target.min() < 0 or target.max() >= num_classes):
        values = f"{target.min().item()}..{target.max().item()}"
        raise UserError(f"target labels must lie in [0, {num_classes}), got values {values}")
    if n and groups.max() >= num_groups:
        raise UserError(
            f"group id {groups.max().item()} is out of range for num_groups={num_groups}; "
            "use ids 0..num_groups-1 and -1 for unknown"
        )


def _group_confusion(preds: Tensor, target: Tensor, groups: Tensor, num_classes: int, num_groups: int) -> Tensor:
    """Count ``(group, target, predicted)`` triples into a ``[G, C, C]`` long tensor.

    One flat bincount over the triple's index gives every group's confusion matrix at once;
    torchmetrics' ``_bincount`` keeps this working in deterministic mode on GPU.
    """
    labels = _labels(preds, num_classes)
    _check_target_groups(target, groups, labels.shape[0], num_classes, num_groups)
    known = groups >= 0
    flat = (groups[known].long() * num_classes + target[known].long()) * num_classes + labels[known].long()
    counts = _bincount(flat, minlength=num_groups * num_classes * num_classes)
    return counts.reshape(num_groups, num_classes, num_classes)


def _reference_tensor(reference: Reference, group_names: Sequence[str]) -> Tensor:
    """Per-group reference accuracy as a float tensor; NaN marks a group without a reference."""
    out = torch.full((len(group_names),), float("nan"))
    if reference is None:
        return out
    if isinstance(reference, Mapping):
        for name, value in reference.items():
            if name not in group_names:
                hint = suggest(str(name), group_names)
                raise UserError(f"unknown group {name!r} in the reference{hint}; groups: {list(group_names)}")
            out[group_names.index(name)] = float(value)
    else:
        values = torch.as_tensor(reference, dtype=torch.float32).detach().cpu().flatten()
        if values.numel() != len(group_names):
            raise UserError(
                f"the reference has {values.numel()} values but there are {len(group_names)} groups; "
                "give one accuracy per group"
            )
        out.copy_(values)
    known = out[~out.isnan()]
    if known.numel() and (known.min() < 0 or known.max() > 1):
        raise UserError(f"reference accuracies must lie in [0, 1], got {[round(v, 4) for v in out.tolist()]}")
    return out


# ----------------------------------------------------------------------------------------------
# From the confusion tensor to the result


def _macro_rate(num: Tensor, den: Tensor) -> Tensor:
    """Mean of ``num / den`` over the last axis, only where ``den > 0``; 0 where no entry counts."""
    valid = den > 0
    rates = torch.where(valid, num.double() / den.clamp(min=1), torch.zeros((), dtype=torch.float64, device=num.device))
    return (rates.sum(-1) / valid.sum(-1).clamp(min=1)).float()


def _error_rates(confusion: Tensor) -> tuple[Tensor, Tensor]:
    """Per-group FPR and FNR, one-vs-rest per class then macro-averaged over classes.

    A class enters the FPR average only if the group has samples of other classes, and the FNR
    average only if the group has samples of that class. With two classes the rates are those of
    the positive class 1 alone: averaging both one-vs-rest views would mix FPR and FNR.
    """
    tp = confusion.diagonal(dim1=1, dim2=2)
    actual = confusion.sum(dim=2)
    predicted = confusion.sum(dim=1)
    negatives = confusion.sum(dim=(1, 2)).unsqueeze(1) - actual
    classes = slice(1, 2) if confusion.shape[1] == 2 else slice(None)
    fpr = _macro_rate((predicted - tp)[:, classes], negatives[:, classes])
    fnr = _macro_rate((actual - tp)[:, classes], actual[:, classes])
    return fpr, fnr


def _spread(values: Tensor) -> tuple[Tensor, Tensor]:
    """Max − min and population std (ddof=0); both 0 with fewer than two values."""
    if values.numel() < 2:
        zero = values.new_zeros(())
        return zero, zero
    return values.max() - values.min(), values.std(correction=0)


def _parity_ratio(rates: Tensor) -> Tensor:
    """Lowest rate over highest, 0 when the highest is 0 or there is none (torchmetrics' convention)."""
    if rates.numel() == 0 or rates.max() == 0:
        return rates.new_zeros(())
    return rates.min() / rates.max()


def _binary_parity(confusion: Tensor, present: Tensor) -> dict[str, Tensor]:
    """Demographic parity and equal opportunity ratios as torchmetrics' ``BinaryFairness`` defines them.

    Absent groups are left out of both, and groups without a positive target out of equal
    opportunity, since their rate is undefined rather than 0.
    """
    total = confusion.sum(dim=(1, 2))
    positive_rate = confusion[:, :, 1].sum(dim=1).float() / total.clamp(min=1)
    positives = confusion[:, 1, :].sum(dim=1)
    true_positive_rate = confusion[:, 1, 1].float() / positives.clamp(min=1)
    return {
        "demographic_parity": _parity_ratio(positive_rate[present]),
        "equal_opportunity": _parity_ratio(true_positive_rate[positives > 0]),
    }


def group_result(confusion: Tensor, group_names: Sequence[str], reference: Tensor | None) -> dict[str, Any]:
    """The result from a ``[G, C, C]`` confusion tensor, nested the way reports hold it:
    ``{"metrics": {"accuracy"}, "groups": {name: {"accuracy", "fpr", "fnr", "count", "present",
    "degradation"}}, "fairness": {"acc_gap", "acc_std", ...}}`` (0-d tensors; an absent group has
    only ``count`` 0 and ``present`` false). :func:`flatten_result` gives the logged names."""
    counts = confusion.sum(dim=(1, 2))
    correct = confusion.diagonal(dim1=1, dim2=2).sum(dim=1)
    present = counts > 0
    acc = correct.float() / counts.clamp(min=1)
    fpr, fnr = _error_rates(confusion)
    gap, std = _spread(acc[present])
    groups: dict[str, dict[str, Tensor]] = {}
    for i, name in enumerate(group_names):
        groups[name] = {"count": counts[i].float(), "present": present[i].float()}
        if present[i]:
            groups[name].update(accuracy=acc[i], fpr=fpr[i], fnr=fnr[i])
    fairness: dict[str, Tensor] = {"acc_gap": gap, "acc_std": std}
    if confusion.shape[1] == 2:
        fairness.update(_binary_parity(confusion, present))
    if reference is not None and not reference.isnan().all():
        drop, spread = _degradation(acc, present, reference.to(acc), group_names)
        for name, value in drop.items():
            groups[name]["degradation"] = value
        fairness.update(spread)
    return {"metrics": {"accuracy": correct.sum().float() / counts.sum().clamp(min=1)}, "groups": groups,
            "fairness": fairness}


# Per-group figures and the names they are logged under (``acc/<group>``, ...).
_LOGGED = {"count": "count", "present": "present", "accuracy": "acc", "fpr": "fpr", "fnr": "fnr", "degradation": "degradation"}


def flatten_result(result: Mapping[str, Any]) -> dict[str, Tensor]:
    """The flat names a result is logged under: ``acc``, ``acc/<group>``, ``fpr/<group>``, ...,
    ``acc_gap``, ``degradation_std``; the one place per-group figures become strings."""
    out: dict[str, Tensor] = {"acc": result["metrics"]["accuracy"]}
    for name, figures in result["groups"].items():
        out.update({f"{_LOGGED[key]}/{name}": value for key, value in figures.items()})
    out.update(result["fairness"])
    return out


def result_values(result: Mapping[str, Any]) -> dict[str, Any]:
    """A result with plain Python values, as a report holds it: floats, ``count`` an int,
    ``present`` a bool."""
    def plain(key: str, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: plain(k, v) for k, v in value.items()}
        value = float(value)
        return int(value) if key == "count" else bool(value) if key == "present" else value

    return {part: plain(part, values) for part, values in result.items()}


def _group_rates_compute(
    confusion: Tensor, group_names: Sequence[str], reference: Tensor | None
) -> dict[str, Tensor]:
    """The flat result dict from a ``[G, C, C]`` confusion tensor; see :class:`GroupRates`."""
    return flatten_result(group_result(confusion, group_names, reference))


def _degradation(acc: Tensor, present: Tensor, reference: Tensor,
                 group_names: Sequence[str]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Reference accuracy − accuracy per present group with a reference, and its spread.

    The spread of per-group degradation (FairGRAPE's headline figure) is 0 when pruning costs
    every group the same, whatever the cost.
    """
    counted = present & ~reference.isnan()
    drop = reference - acc
    per_group = {name: drop[i] for i, name in enumerate(group_names) if counted[i]}
    values = drop[counted]
    zero = acc.new_zeros(())
    spread = {"degradation_var": values.var(correction=0) if values.numel() > 1 else zero,
              "degradation_std": values.std(correction=0) if values.numel() > 1 else zero}
    return per_group, spread


# ----------------------------------------------------------------------------------------------
# Functional form


def group_rates(
    preds: Tensor,
    target: Tensor,
    groups: Tensor,
    num_classes: int,
    num_groups: int,
    group_names: Sequence[str] | None = None,
    reference: Reference = None,
) -> dict[str, Tensor]:
    """Per-group accuracy, FPR, FNR, their gap and the degradation against a reference, in one call.

    The functional form of :class:`GroupRates`; arguments and result are described there.
    ``reference`` is a dict ``{group name: accuracy}``, a tensor of one accuracy per group, or None.

    Example:
        >>> import torch
        >>> from fairprune.metrics.group import group_rates
        >>> preds = torch.tensor([[2.0, 0.1], [0.3, 1.0], [0.2, 0.9], [1.5, 0.0]])
        >>> target = torch.tensor([0, 1, 0, 1])
        >>> groups = torch.tensor([0, 0, 1, 1])
        >>> out = group_rates(preds, target, groups, num_classes=2, num_groups=2,
        ...                   group_names=["f", "m"], reference={"f": 1.0, "m": 0.5})
        >>> out["acc/f"], out["acc/m"], out["fpr/m"], out["fnr/m"]
        (tensor(1.), tensor(0.), tensor(1.), tensor(1.))
        >>> out["degradation/f"], out["degradation/m"], out["degradation_std"]
        (tensor(0.), tensor(0.5000), tensor(0.2500))
    """
    _check_sizes(num_classes, num_groups)
    names = _names(group_names, num_groups, "group_names", "num_groups")
    confusion = _group_confusion(preds, target, groups, num_classes, num_groups)
    return _group_rates_compute(confusion, names, _reference_tensor(reference, names).to(preds.device))


# ----------------------------------------------------------------------------------------------
# Tables


def per_group_frame(result: Mapping[str, Tensor]) -> pd.DataFrame:
    """One row per group of a :class:`GroupRates` result, for tables and reports.

    Columns: ``accuracy``, ``fpr``, ``fnr``, ``degradation`` (float, NaN where the result has no
    value: absent groups, no reference), ``count`` (int) and ``present`` (bool).

    Example:
        >>> import torch
        >>> from fairprune.metrics.group import group_rates, per_group_frame
        >>> out = group_rates(torch.tensor([1, 0, 1]), torch.tensor([1, 1, 1]), torch.tensor([0, 0, 1]),
        ...                   num_classes=2, num_groups=3, group_names=["x", "y", "z"])
        >>> per_group_frame(out)[["accuracy", "count", "present"]]  # doctest: +NORMALIZE_WHITESPACE
               accuracy  count  present
        group                          
        x           0.5      2     True
        y           1.0      1     True
        z           NaN      0    False
    """
    groups = [key[len("count/") :] for key in result if key.startswith("count/")]
    if not groups:
        raise UserError(
            "the result has no count/<group> entries; pass what GroupRates.compute() or group_rates() returned"
        )

    def column(prefix: str) -> list[float]:
        return [float(result[f"{prefix}/{g}"]) if f"{prefix}/{g}" in result else float("nan") for g in groups]

    frame = pd.DataFrame(
        {
            "accuracy": column("acc"),
            "fpr": column("fpr"),
            "fnr": column("fnr"),
            "count": [int(result[f"count/{g}"]) for g in groups],
            "present": [bool(result[f"present/{g}"]) for g in groups],
            "degradation": column("degradation"),
        },
        index=pd.Index(groups, name="group"),
    )
    return frame


# ----------------------------------------------------------------------------------------------
# Binary fairness through torchmetrics


def binary_fairness(
    preds: Tensor, target: Tensor, groups: Tensor, num_groups: int, threshold: float = 0.5
) -> dict[str, Tensor]:
    """Demographic parity and equal opportunity ratios of a binary classifier, via torchmetrics.

    Calls ``torchmetrics.functional.classification.demographic_parity`` and ``equal_opportunity``
    (the lowest group rate over the highest; 1 is parity) on the samples of known groups, with the
    present groups renumbered 0..k-1: torchmetrics counts a group without samples as rate 0 and
    names groups by their rank among those present. Equal opportunity leaves out groups without a
    positive target, whose true positive rate is undefined. Both are 0 when no group qualifies or
    the highest rate is 0. :class:`GroupRates` with ``num_classes=2`` reports the same two values
    from its accumulated state.

    Args:
        preds: ``[N, 2]`` scores (argmax is the prediction), ``[N]`` 0/1 labels, or ``[N]``
            probabilities or logits of class 1 (torchmetrics applies a sigmoid outside [0, 1]).
        target: ``[N]`` 0/1 labels.
        groups: ``[N]`` group ids in ``[0, num_groups)``, negative for unknown (ignored).
        num_groups: number of groups.
        threshold: decision threshold for ``[N]`` probabilities.

    Example:
        >>> import torch
        >>> from fairprune.metrics.group import binary_fairness
        >>> preds = torch.tensor([0.9, 0.8, 0.1, 0.7, 0.2, 0.3, 0.9])
        >>> target = torch.tensor([1, 1, 0, 1, 1, 0, 1])
        >>> groups = torch.tensor([0, 0, 0, 2, 2, 2, -1])
        >>> binary_fairness(preds, target, groups, num_groups=3)
        {'demographic_parity': tensor(0.5000), 'equal_opportunity': tensor(0.5000)}
    """
    _check_sizes(2, num_groups)
    labels = _labels(preds, 2) if preds.ndim == 2 or not preds.is_floating_point() else preds
    if labels.ndim != 1:
        raise UserError(f"preds must be [N, 2] scores or [N] labels or probabilities, got {tuple(preds.shape)}")
    _check_target_groups(target, groups, labels.shape[0], 2, num_groups)
    known = groups >= 0
    labels, target, groups = labels[known], target[known].long(), groups[known]
    zero = torch.zeros((), device=labels.device)
    out = {"demographic_parity": zero, "equal_opportunity": zero}
    if groups.numel():
        # task="all" rather than demographic_parity(): the latter builds a CPU target internally,
        # which fails for preds on a GPU. Its equal opportunity is discarded (see below).
        both = _torchmetrics_binary_fairness(labels, target, _dense_ids(groups), "all", threshold)
        out["demographic_parity"] = _pick(both, "DP_")
    with_positive = torch.isin(groups, groups[target == 1])
    if with_positive.any():
        kept = labels[with_positive], target[with_positive], _dense_ids(groups[with_positive])
        out["equal_opportunity"] = _pick(equal_opportunity(*kept, threshold), "EO_")
    return out


def _dense_ids(groups: Tensor) -> Tensor:
    """Renumber the group ids present to 0..k-1 (long), the form torchmetrics expects."""
    return torch.unique(groups, return_inverse=True)[1].long()


def _pick(result: dict[str, Tensor], prefix: str) -> Tensor:
    """The value of torchmetrics' ``{'<prefix><low>_<high>': value}`` entry, whatever the groups."""
    (value,) = (v for k, v in result.items() if k.startswith(prefix))
    return value
