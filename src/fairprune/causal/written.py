"""The sparsity a pruned LM's folder holds, measured on the weights as written.

A report states what its files hold, not what the run aimed at. :func:`measure_written` reads
the output folder's tensors one at a time (a pack-quantized folder's layers decompressed as a
loader reads them) and counts exact zeros in every parameter of at least two dimensions inside
the blocks, each classed by kind:

- ``attention``, ``mlp`` (a dense MLP), ``experts`` (fused or listed experts), ``shared_experts``,
  ``router`` (the layer that scores experts) and ``other`` (anything else, e.g. a weight a block
  uses directly rather than through a layer);
- pruned (a unit the methods prune: :meth:`~fairprune.causal.families.Family.block_units`) or left
  dense with its reason (the router by design; a bias; a parameter discovery cannot reach).

The model's parameter names are mapped to the checkpoint's by transformers' own reverse conversion
(``revert_weight_conversion``, what ``save_pretrained`` applies: Mixtral's fused
``mlp.experts.gate_up_proj`` is written as ``block_sparse_moe.experts.<e>.w1`` / ``w3``), run on
meta tensors, so no table of names is copied here. :func:`check_written` fails a run whose
pruned units miss the target by more than rounding (one row's worth: ``1 / columns``), naming them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from fairprune.causal.experts import fused_experts, has_experts, is_router
from fairprune.errors import UserError
from fairprune.hub.conversion import checkpoint_names

KINDS = ("attention", "mlp", "experts", "shared_experts", "router", "other")
REASONS = {
    "router": "the router scores the experts; left dense by design (pruning it changes which experts run)",
    "bias": "a bias; the methods prune weights",
    "unreached": "not reached: the block uses it directly, not through a linear layer or a fused expert "
                 "parameter, so no method prunes it",
}
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _kind(path: str, fused: bool, moe: bool, ndim: int) -> str:
    """The kind of the block parameter at ``path`` of ``ndim`` dimensions; ``fused``: a fused expert
    parameter. Any other parameter of more than two (a convolution's kernel: Mamba's, a
    short-convolution layer's) is ``other``."""
    module = path.rpartition(".")[0]
    if is_router(module, moe):
        return "router"
    if "shared_expert" in path:
        return "shared_experts"
    if fused or ".experts." in f".{path}":
        return "experts"
    if ndim > 2:
        return "other"
    if "attn" in path or "attention" in path:
        return "attention"
    return "mlp"


def _reader(folder: Path):
    from fairprune.hub.compressed import is_compressed

    if is_compressed(folder):
        return _CompressedReader(folder)
    from fairprune.hub.quantized_stream import open_reader

    return open_reader(folder)


class _CompressedReader:
    """A compressed-tensors sparse folder (``--save_format compressed``) read whole, decompressed."""

    def __init__(self, folder: Path):
        from fairprune.hub.compressed import _read_weights, decompress_state_dict, sparsity_config

        self.state = decompress_state_dict(_read_weights(folder), sparsity_config(folder)["format"])

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def read(self, name: str) -> torch.Tensor:
        return self.state[name]


def _counts(tensor: torch.Tensor, key: str, experts: int | None) -> Iterable[tuple[int | None, int, int, int]]:
    """``(expert, zeros, numel, columns)`` of one written tensor: per expert for a fused 3-D one or
    one named ``experts.<e>``, whole otherwise."""
    if experts is not None and tensor.dim() == 3:
        for e in range(tensor.shape[0]):
            yield e, int((tensor[e] == 0).sum()), tensor[e].numel(), tensor.shape[-1]
        return
    match = _EXPERT.search(f".{key}")
    yield (int(match.group(1)) if match else None), int((tensor == 0).sum()), tensor.numel(), tensor.shape[-1]


def measure_written(folder: str | Path, blocks) -> dict[str, Any]:
    """The sparsity ``folder`` (a pruned model written by the run of block model ``blocks``) holds
    in its blocks, by kind (see the module docstring): ``achieved`` (zeros over the pruned units
    as written), ``by_kind``, ``experts`` (each expert's sparsity over its parameters, per experts
    module), ``left_dense`` and ``units`` (each pruned unit's sparsity, for :func:`check_written`)."""
    folder = Path(folder)
    reader = _reader(folder)
    params: dict[str, tuple[str, torch.Size, str, str | None, bool]] = {}  # name -> (path in block, shape, kind, reason, fused)
    for block in blocks.blocks:
        prefix = blocks.prefix(block)
        moe = has_experts(block)
        fused_paths = {f.path for f in fused_experts(block)}
        units = blocks.family.block_units(block)
        pruned = {f"{p}.weight" for p, u in units.items() if not hasattr(u, "fused")}
        pruned |= {u.fused.path for u in units.values() if hasattr(u, "fused")}
        for path, param in block.named_parameters():
            if param.dim() < 2:
                continue
            kind = _kind(path, path in fused_paths, moe, param.dim())
            reason = None if path in pruned else "router" if kind == "router" else \
                "bias" if path.endswith("bias") else "unreached"
            params[prefix + path] = (path, param.shape, kind, reason, path in fused_paths)
    names = checkpoint_names(blocks.model, {n: v[1] for n, v in params.items()})
    by_kind: dict[str, dict[str, int]] = {}
    units: dict[str, list[int]] = {}  # unit -> [zeros, numel, columns]
    experts: dict[str, dict[int, list[int]]] = {}
    left = []
    for name, (_path, shape, kind, reason, is_fused) in params.items():
        keys = [k for k in names[name] if k in reader] or ([name] if name in reader else [])
        if not keys:
            keys = [blocks.key(name)] if hasattr(blocks, "key") else []
        zeros = numel = 0
        for key in keys:
            fused = shape[0] if is_fused else None
            for expert, z, n, cols in _counts(reader.read(key), key, fused):
                zeros, numel = zeros + z, numel + n
                if reason is None:
                    unit = name if expert is None else f"{name}[{expert}]"
                    u = units.setdefault(unit, [0, 0, cols])
                    u[0], u[1] = u[0] + z, u[1] + n
                if expert is not None and kind == "experts":
                    owner = name.rsplit(".", 1)[0] if is_fused else name.split(".experts.")[0] + ".experts"
                    e = experts.setdefault(owner, {}).setdefault(expert, [0, 0])
                    e[0], e[1] = e[0] + z, e[1] + n
        entry = by_kind.setdefault(kind, {"zeros": 0, "numel": 0, "dense_zeros": 0, "dense_numel": 0})
        if reason is None:
            entry["zeros"] += zeros
            entry["numel"] += numel
        else:
            entry["dense_zeros"] += zeros
            entry["dense_numel"] += numel
            left.append({"parameter": name, "kind": kind, "reason": REASONS[reason], "numel": numel,
                         "sparsity": zeros / numel if numel else 0.0})
    zeros = sum(e["zeros"] for e in by_kind.values())
    total = sum(e["numel"] for e in by_kind.values())
    kinds = {k: {"sparsity": e["zeros"] / e["numel"] if e["numel"] else None, "pruned_numel": e["numel"],
                 "left_dense_numel": e["dense_numel"]}
             for k in KINDS if (e := by_kind.get(k))}
    per_expert = {owner: [z / n if n else 0.0 for _, (z, n) in sorted(found.items())] for owner, found in experts.items()}
    return {"achieved": zeros / total if total else 0.0, "measured_on": "the written weights",
            "by_kind": kinds, **({"experts": per_expert} if per_expert else {}), "left_dense": left,
            "units": {u: {"sparsity": z / n if n else 0.0, "columns": c} for u, (z, n, c) in units.items()}}


def check_written(measured: dict[str, Any], target: float, output) -> None:
    """Fail, in one line naming them, when pruned units as written miss ``target`` by more than
    rounding (one element per row: ``1 / columns``)."""
    short = [(u, f["sparsity"]) for u, f in measured["units"].items() if f["sparsity"] < target - 1.0 / f["columns"] - 1e-9]
    if short:
        names = ", ".join(f"{u} ({s:.3f})" for u, s in short[:4]) + (f" and {len(short) - 4} more" if len(short) > 4 else "")
        raise UserError(f"the weights written to {output} miss the target sparsity {target:.4f}: {names}; the report "
                        "would state a sparsity they do not hold, so the run stops (this is a fault in fairprune for "
                        "this model's layout: report it with the model's config.json)")


def summary(measured: dict[str, Any]) -> str:
    """One line of the measured sparsity by kind, for the terminal."""
    parts = []
    for kind, facts in measured["by_kind"].items():
        if facts["pruned_numel"]:
            text = f"{kind} {facts['sparsity']:.3f}"
            if kind == "experts" and measured.get("experts"):
                low = min(min(v) for v in measured["experts"].values())
                text += f" (lowest expert {low:.3f})"
            parts.append(text)
    dense = sorted({d["kind"] for d in measured["left_dense"]})
    if dense:
        parts.append(f"left dense: {', '.join(dense)} ({len(measured['left_dense'])} parameters, see report.json)")
    return "; ".join(parts)
