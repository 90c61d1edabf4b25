"""Magnitude pruning of the difference: keep exactly ``k = round(fraction · total)`` entries of
``|z ⊙ δ|`` (or ``|δ|``, or of given differences) over all gated tensors together and freeze that
binary mask in place of the gates. The ranking is :func:`fairprune.pruning.select.top_k`'s
(ties: the lower flat index over the gates in registration order is kept)."""

from __future__ import annotations

import torch
from torch import nn

from fairprune.errors import UserError
from fairprune.pruning.diff.attach import gated_total, gates
from fairprune.pruning.select import magnitude, top_k


def check_fraction(target_fraction: float) -> None:
    if not 0.0 < target_fraction <= 1.0:
        raise UserError(f"target_fraction must be in (0, 1] (the share of gated weights that may change), got {target_fraction}")


def keep_count(total: int, target_fraction: float) -> int:
    """``round(fraction · total)``, at least one entry."""
    check_fraction(target_fraction)
    return max(1, round(target_fraction * total))


def magnitude_prune(root: nn.Module, target_fraction: float, score: str = "gated") -> int:
    """Keep the ``k = round(fraction · total)`` largest ``|z ⊙ δ|`` (``score="gated"``) or ``|δ|``
    (``score="delta"``) over all gates and freeze the mask; return ``k``."""
    if score not in ("gated", "delta"):
        raise UserError(f"score must be 'gated' (|z·δ|) or 'delta' (|δ|), got '{score}'")
    found = gates(root)
    if not found:
        raise UserError("the model has no Diff-Pruning gates; attach them first (DiffPruning callback or attach_gates)")
    k = keep_count(gated_total(root), target_fraction)
    scores = {n: magnitude(g.effective_delta() if score == "gated" else g.delta) for n, g in found.items()}
    for name, keep in top_k(scores, k).items():
        found[name].fix(keep)
    return k


@torch.no_grad()
def fix_difference(root: nn.Module, deltas: dict[str, torch.Tensor], target_fraction: float) -> int:
    """Set gated δ to the ``k`` largest entries of given differences and freeze that mask (the
    "fine-tune, then magnitude-prune the difference" baseline); return ``k``."""
    found = gates(root)
    k = keep_count(gated_total(root), target_fraction)
    for name, keep in top_k({n: magnitude(deltas[n]) for n in found}, k).items():
        gate = found[name]
        # An all-ones fixed mask first, so that fix() takes δ as given rather than gated.
        gate.mask.fill_(True)
        gate.fixed = True
        gate.delta.copy_(deltas[name])
        gate.fix(keep)
    return k
