"""Diff-Pruning: fine-tune a sparse difference ``δ`` on top of a frozen base model.

Every gated weight becomes ``θ = θ₀ + z ⊙ δ`` through ``torch.nn.utils.parametrize``: the base
``θ₀`` is the parametrization's ``original`` (frozen), ``δ`` starts at 0 so the gated model starts
exactly as the base, and ``z`` is a hard-concrete gate (Louizos et al., 2018) with one ``log α``
per entry, optionally times one per-tensor gate. The expected number of non-zero entries of
``z`` is differentiable and, scaled by ``λ``, is added to the task loss.

After gated training, :func:`magnitude_prune` keeps exactly ``k = round(fraction · total)``
entries of ``|z ⊙ δ|`` over all gated tensors and freezes that binary mask in place of the gates
(fixed-mask fine-tuning). :func:`save_diff` writes only the non-zero entries of the difference
(flat indices + values, safetensors), the tensors trained in full (the classifier head) and a
JSON naming the base and hashing its gated weights; :func:`load_diff` rebuilds base + δ exactly
and refuses another base.

The package, one module per stage (every public name is re-exported here, so
``from fairprune.pruning import diff; diff.attach_gates(...)`` works):

- :mod:`~fairprune.pruning.diff.hard_concrete`: the gates and the :class:`DiffGate` parametrization;
- :mod:`~fairprune.pruning.diff.attach`: which weights to gate, attaching and reading gates back,
  the L0 penalty and the optimizer's parameter groups;
- :mod:`~fairprune.pruning.diff.selection`: magnitude pruning of the difference;
- :mod:`~fairprune.pruning.diff.checkpoint`: the diff-only checkpoint (save, read, load, hashes).
"""

from __future__ import annotations

from fairprune.pruning.diff.attach import (
    GATED_TYPES,
    alpha_parameters,
    attach_gates,
    attach_gates_for,
    base_tensor,
    default_gate_names,
    expected_l0_fraction,
    gated_total,
    gates,
    head_prefixes,
    l0_penalty,
    nonzero_fraction,
    param_groups,
    resolve_gate_names,
    separate_alpha_group,
)
from fairprune.pruning.diff.checkpoint import (
    FORMAT,
    base_sha256,
    full_bytes,
    load_diff,
    read_diff,
    save_diff,
    trained_in_full,
    weights_sha256,
)
from fairprune.pruning.diff.hard_concrete import (
    DiffGate,
    GateConfig,
    _GatedSum,
    deterministic_gate,
    prob_nonzero,
    sample_gate,
)
from fairprune.pruning.diff.selection import check_fraction, fix_difference, keep_count, magnitude_prune

__all__ = [
    # hard_concrete
    "GateConfig", "DiffGate", "_GatedSum", "sample_gate", "deterministic_gate", "prob_nonzero",
    # attach
    "GATED_TYPES", "head_prefixes", "default_gate_names", "resolve_gate_names", "gates", "base_tensor",
    "attach_gates", "attach_gates_for", "l0_penalty", "gated_total", "expected_l0_fraction",
    "nonzero_fraction", "alpha_parameters", "param_groups", "separate_alpha_group",
    # selection
    "check_fraction", "keep_count", "magnitude_prune", "fix_difference",
    # checkpoint
    "FORMAT", "weights_sha256", "base_sha256", "trained_in_full", "full_bytes", "save_diff",
    "read_diff", "load_diff",
]
