"""Which weights Diff-Pruning gates, attaching the gates, reading them back, and the optimizer's
parameter groups (the gates' ``log α`` get their own learning rate)."""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from fairprune.errors import UserError, suggest
from fairprune.pruning.diff.hard_concrete import DiffGate, GateConfig

GATED_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding)


# ----------------------------------------------------------------------------------------------
# Which weights to gate


def head_prefixes(root: nn.Module) -> list[str]:
    """Module names of the task head: trained in full, never gated.

    For a transformers model the head is every child outside the base model
    (``base_model_prefix``: ``bert``, ``roberta``, ...), e.g. ``classifier`` or ``score``;
    for any other model, the last Linear.
    """
    heads: list[str] = []
    for name, module in root.named_modules():
        prefix = getattr(module, "base_model_prefix", None)
        if prefix and isinstance(getattr(module, prefix, None), nn.Module):
            heads += [_join(name, child) for child, _ in module.named_children() if child != prefix]
    if heads:
        return heads
    linears = [n for n, m in root.named_modules() if isinstance(m, nn.Linear) and n]
    return linears[-1:]


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _is_gate_part(name: str) -> bool:
    """A parameter or buffer that belongs to a parametrization (θ₀, δ, log α, mask)."""
    return name.startswith("parametrizations.") or ".parametrizations." in name


def _plain_name(name: str) -> str:
    """``a.parametrizations.weight.original`` → ``a.weight``."""
    return name.replace("parametrizations.", "").removesuffix(".original")


def _in_head(name: str, heads: list[str]) -> bool:
    return any(name == h or name.startswith(h + ".") for h in heads)


def default_gate_names(root: nn.Module) -> list[str]:
    """Weights of every Linear and Embedding outside the head, each shared tensor once."""
    heads, seen, names = head_prefixes(root), set(), []
    for mname, module in root.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, GATED_TYPES) and isinstance(weight, nn.Parameter) and not _in_head(mname, heads):
            # A tied tensor (shared embeddings) is gated where it first appears.
            if id(weight) not in seen:
                seen.add(id(weight))
                names.append(_join(mname, "weight"))
    return names


def resolve_gate_names(root: nn.Module, names: list[str] | None) -> list[str]:
    """Parameter names to gate: the defaults, or exact names / glob patterns (``*.query.weight``)."""
    if names is None:
        return default_gate_names(root)
    available = [n for n, _ in root.named_parameters()]
    chosen: list[str] = []
    for pattern in names:
        found = fnmatch.filter(available, pattern) if any(c in pattern for c in "*?[") else [n for n in available if n == pattern]
        if not found:
            raise UserError(f"no parameter named '{pattern}' to gate{suggest(pattern, available)}; names are relative to the transformers model")
        chosen += [n for n in found if n not in chosen]
    return chosen


# ----------------------------------------------------------------------------------------------
# Attaching gates and reading them back


def gates(root: nn.Module) -> dict[str, DiffGate]:
    """``{gated parameter name: its gate}`` in registration order."""
    found: dict[str, DiffGate] = {}
    for mname, module in root.named_modules():
        if parametrize.is_parametrized(module):
            for pname, plist in module.parametrizations.items():
                for p in plist:
                    if isinstance(p, DiffGate):
                        found[_join(mname, pname)] = p
    return found


def base_tensor(root: nn.Module, name: str) -> torch.Tensor:
    """The frozen base weight ``θ₀`` of a gated parameter, or the parameter itself when not gated."""
    mname, _, pname = name.rpartition(".")
    module = root.get_submodule(mname)
    if parametrize.is_parametrized(module, pname):
        return module.parametrizations[pname].original
    return getattr(module, pname)


def attach_gates(root: nn.Module, names: list[str] | None = None, cfg: GateConfig | None = None,
                 train_ungated: bool = False) -> list[str]:
    """Gate ``names`` (default: Linear and Embedding weights outside the head); return the names.

    Afterwards the trainable parameters are the δ and log α of every gate, the head, and (with
    ``train_ungated``) the base's other parameters (biases, LayerNorm); the rest is frozen.
    """
    cfg = cfg or GateConfig()
    chosen = resolve_gate_names(root, names)
    heads = head_prefixes(root)
    for name in chosen:
        mname, _, pname = name.rpartition(".")
        module = root.get_submodule(mname)
        weight = getattr(module, pname)
        parametrize.register_parametrization(module, pname, DiffGate(weight.shape, cfg, weight.device))
    for name, param in root.named_parameters():
        if name.endswith(".original"):
            param.requires_grad_(False)
        elif not _is_gate_part(name) and not _in_head(name, heads):
            param.requires_grad_(train_ungated)
    return chosen


def attach_gates_for(root: nn.Module, state_dict: dict[str, Any], prefix: str = "") -> int:
    """Attach gates wherever ``state_dict`` holds a gated weight, so a Diff-Pruning checkpoint loads
    strictly into a freshly built model. Returns how many gates were attached."""
    names = [_plain_name(k[len(prefix):]) for k in state_dict
             if k.startswith(prefix) and k.endswith(".original") and _is_gate_part(k[len(prefix):])]
    todo = [n for n in names if n not in gates(root)]
    if todo:
        attach_gates(root, todo)
    return len(todo)


def l0_penalty(root: nn.Module) -> torch.Tensor:
    """``λ Σ P(z > 0)`` over every gate still in the gated stage (0 when there is none)."""
    terms = [g.cfg.lam * g.expected_l0() for g in gates(root).values() if not g.fixed]
    return torch.stack(terms).sum() if terms else torch.zeros(())


def gated_total(root: nn.Module) -> int:
    """Number of gated entries."""
    return sum(g.delta.numel() for g in gates(root).values())


def expected_l0_fraction(root: nn.Module) -> float:
    """Expected fraction of non-zero gates (the mask's density once fixed)."""
    with torch.no_grad():
        return float(sum(g.expected_l0() for g in gates(root).values())) / max(gated_total(root), 1)


def nonzero_fraction(root: nn.Module) -> float:
    """Fraction of gated entries the model changes at evaluation (non-zero effective δ)."""
    return sum(int(g.effective_delta().count_nonzero()) for g in gates(root).values()) / max(gated_total(root), 1)


def alpha_parameters(root: nn.Module) -> list[nn.Parameter]:
    return [p for g in gates(root).values() for p in g.alpha_parameters()]


def param_groups(module: nn.Module) -> list[dict[str, Any]]:
    """Trainable parameters for an optimizer, with the gates' log α in their own group
    (``lr = alpha_lr``, no weight decay); a model without gates gets one group."""
    alphas = [p for p in alpha_parameters(module) if p.requires_grad]
    alpha_ids = {id(p) for p in alphas}
    rest = [p for p in module.parameters() if p.requires_grad and id(p) not in alpha_ids]
    groups: list[dict[str, Any]] = [{"params": rest}]
    if alphas:
        lr = next(iter(gates(module).values())).cfg.alpha_lr
        groups.append({"params": alphas, "lr": lr, "weight_decay": 0.0})
    return groups


def separate_alpha_group(optimizer: torch.optim.Optimizer, root: nn.Module) -> bool:
    """Move log α out of the optimizer's other groups into their own; True when anything moved.

    For LightningModules whose ``configure_optimizers`` passes plain ``parameters()``.
    """
    alphas = [p for p in alpha_parameters(root) if p.requires_grad]
    alpha_ids = {id(p) for p in alphas}
    moved = False
    for group in optimizer.param_groups:
        if any(id(p) in alpha_ids for p in group["params"]) and len(group["params"]) > len(alpha_ids & {id(p) for p in group["params"]}):
            group["params"] = [p for p in group["params"] if id(p) not in alpha_ids]
            moved = True
    if moved:
        lr = next(iter(gates(root).values())).cfg.alpha_lr
        optimizer.add_param_group({"params": alphas, "lr": lr, "weight_decay": 0.0})
    return moved
