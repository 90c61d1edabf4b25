"""The one mask core: which weights a method may prune, masks through ``torch.nn.utils.prune``,
and sparsity accounting.

Every pruning method in fairprune decides *which* weights to keep and hands a boolean keep-mask
to :func:`apply_mask`; this module owns how masks are stored (``weight_orig`` and ``weight_mask``
via ``torch.nn.utils.prune``, so checkpoints hold them and training keeps pruned weights at zero)
and how sparsity is counted (exact zeros and masked-out entries over the weights a method targets).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import prune

PRUNABLE_TYPES: tuple[type[nn.Module], ...] = (nn.Conv2d, nn.Linear)


@dataclass(frozen=True)
class Target:
    """One prunable weight: the module that owns it and its qualified name."""

    name: str
    module: nn.Module

    @property
    def weight(self) -> torch.Tensor:
        """The effective weight (masked when a mask is attached)."""
        return self.module.weight

    @property
    def mask(self) -> torch.Tensor:
        """The current keep-mask (all ones when the weight has never been pruned)."""
        existing = getattr(self.module, "weight_mask", None)
        return existing.bool() if existing is not None else torch.ones_like(self.module.weight, dtype=torch.bool)


def prunable_targets(
    model: nn.Module,
    types: tuple[type[nn.Module], ...] = PRUNABLE_TYPES,
    include_first: bool = True,
    include_classifier: bool = True,
) -> list[Target]:
    """The Conv2d / Linear weights a method prunes, in registration order.

    ``include_first`` / ``include_classifier`` keep the first layer or the last Linear dense;
    many pruning papers leave them out because they are small and sensitive.
    """
    found = [Target(n, m) for n, m in model.named_modules() if isinstance(m, types) and getattr(m, "weight", None) is not None]
    if not include_first and found:
        found = found[1:]
    if not include_classifier:
        linears = [i for i, t in enumerate(found) if isinstance(t.module, nn.Linear)]
        if linears:
            found.pop(linears[-1])
    return found


def apply_mask(target: Target, keep: torch.Tensor) -> None:
    """Attach ``keep`` as the weight's mask, replacing (never loosening) any earlier mask."""
    keep = keep.to(device=target.weight.device, dtype=torch.bool)
    if keep.shape != target.weight.shape:
        raise ValueError(f"mask shape {tuple(keep.shape)} does not match weight {target.name} {tuple(target.weight.shape)}")
    combined = keep & target.mask.to(keep.device)
    if prune.is_pruned(target.module) and hasattr(target.module, "weight_mask"):
        prune.remove(target.module, "weight")
    prune.custom_from_mask(target.module, "weight", combined)


def sparsity_table(targets: list[Target]) -> list[dict[str, float | int | str]]:
    """Per-layer zero counts of the effective weights: exact zeros and masked-out entries (a
    masked weight counts as pruned whatever ``weight_orig`` holds, NaN included)."""
    rows = []
    for t in targets:
        w = t.weight.detach()
        zeros = int(((w == 0) | ~t.mask.to(w.device)).sum())
        rows.append({"layer": t.name, "numel": w.numel(), "zeros": zeros, "sparsity": zeros / max(w.numel(), 1)})
    return rows


def achieved_sparsity(targets: list[Target]) -> float:
    """Fraction of zero or masked-out entries over all target weights."""
    rows = sparsity_table(targets)
    total = sum(r["numel"] for r in rows)
    return sum(r["zeros"] for r in rows) / total if total else 0.0


def attach_masks_for(model: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str = "") -> int:
    """Attach identity masks wherever ``state_dict`` holds ``<module>.weight_mask``.

    A pruned checkpoint stores ``weight_orig`` / ``weight_mask``; a freshly built model has plain
    ``weight``. Giving the model the same reparametrisation first lets the checkpoint load
    strictly. Returns how many masks were attached.
    """
    attached = 0
    for key in state_dict:
        if not key.startswith(prefix) or not key.endswith(".weight_mask"):
            continue
        module = model.get_submodule(key[len(prefix): -len(".weight_mask")])
        if not hasattr(module, "weight_mask"):
            prune.identity(module, "weight")
            attached += 1
    return attached


def ordered_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters in the order the unpruned model registers them.

    Attaching a mask moves ``weight`` to ``weight_orig`` at the end of its module's parameters,
    so a model rebuilt with masks (on resume) would list them in another order than the run that
    pruned it, and its optimizer state would land on the wrong tensors. Within each module the
    weight goes first again (as every torch / timm layer registers it), the rest keep their order.
    """
    ordered: list[nn.Parameter] = []
    for module in model.modules():
        own = list(module._parameters.items())
        own.sort(key=lambda item: 0 if item[0] in ("weight", "weight_orig") else 1)
        ordered.extend(p for _, p in own if p is not None)
    return ordered
