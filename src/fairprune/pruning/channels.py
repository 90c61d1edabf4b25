"""Structured (channel) pruning of vision models: whole channels leave the network, which becomes
physically smaller (fewer parameters, fewer operations), instead of weights being masked to zero.

Which channels are *coupled* comes from torch-pruning's dependency graph
(``tp.DependencyGraph().build_dependency``): a residual addition ties the outputs of every
convolution feeding it, a depthwise convolution ties its input and output channels, a BatchNorm
follows its convolution, and the classifier's input columns follow the last convolution. One
*channel group* is such a coupled set (``DG.get_all_groups``); removing channel ``c`` of a group
removes it from every layer of the group at once (``group.prune``), so the network stays
consistent. The classifier's outputs (the classes) are never pruned, and every group keeps at least
``floor`` channels.

A method scores weights as it does at weight granularity (``entry.importance``); a channel's
score combines the scores of every Conv2d / Linear weight of the group at that channel — its
output row in the layers whose outputs are the channel, its input column in the layers that read
it (:func:`channel_scores`): summed (SNIP / Taylor ``|g·w|``, GraSP, random, FairGRAPE's per-group
``(g·w)²``, one sum per demographic group) or as the root of the summed squares (magnitude: the L2
norm of the channel's weights). The selection then keeps, per group, ``density`` of the group's
channels in the dense model (:func:`per_group`, FairGRAPE's :func:`fair_shares`), or that share of
all channels ranked together (:func:`global_`).

Sparsity at channel granularity is the fraction of prunable channels removed: the channels of
every channel group, each coupled channel counted once, against the dense model's
(:func:`channel_sparsity`); the report adds the parameter count before and after.

A pruned model is described by plain data (:func:`architecture`: per group its layers and its dense
and kept channel counts, the example input shape, the dense parameter count), stored in its
checkpoint under :data:`CHECKPOINT_KEY`; :func:`apply_architecture` removes the same number of
channels from a freshly built dense model, which the checkpoint's weights then fill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch_pruning as tp
from torch import nn

from fairprune.errors import UserError
from fairprune.pruning import select
from fairprune.pruning.fairgrape import layer_quota, select_layer_masks
from fairprune.pruning.steps import MaskChoice

GRANULARITIES = ("weight", "channel")
#: Where a checkpoint holds its model's pruned architecture (:func:`architecture`).
CHECKPOINT_KEY = "pruned_architecture"
#: How a method's weight scores combine into a channel score.
REDUCTIONS = ("sum", "l2")
ROOT_TYPES = (nn.Conv2d, nn.Linear)


@dataclass
class Member:
    """The weights of one Conv2d / Linear layer that belong to a channel group: along ``axis`` (0:
    output channels, 1: input channels) the layer's indices ``idxs``, channel ``root[i]`` of the
    group for ``idxs[i]``."""

    name: str
    module: nn.Module
    axis: int
    idxs: list[int]
    root: list[int]


@dataclass
class ChannelGroup:
    """One coupled set of channels: ``size`` now, ``dense`` in the dense model, ``floor`` at least
    kept. ``name`` is the layer the group is rooted at, ``layers`` every Conv2d / Linear whose
    outputs are these channels."""

    name: str
    group: Any  # torch_pruning Group
    size: int
    dense: int
    floor: int
    layers: list[str]
    members: list[Member] = field(default_factory=list)
    multiple: int = 1

    def quota(self, density: float) -> int:
        """Channels kept at ``density`` of the dense model's channels, never fewer than the floor,
        rounded up to a multiple of ``multiple`` (never more than the group has now)."""
        kept = max(min(self.floor, self.size), min(self.size, layer_quota(self.dense, density)))
        return min(self.size, -(-kept // self.multiple) * self.multiple)


def classifier(model: nn.Module) -> nn.Linear:
    """The classifier layer (the last ``nn.Linear``), whose outputs are never pruned."""
    found = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not found:
        raise UserError(f"{type(model).__name__} has no Linear classifier layer; channel pruning needs a classifier")
    return found[-1]


def _example(model: nn.Module, input_shape: Sequence[int]) -> torch.Tensor:
    """A zero input of ``input_shape`` on the model's device, in its floating-point type."""
    first = next(iter(model.parameters()), None)
    return torch.zeros(*input_shape, device=first.device if first is not None else "cpu",
                       dtype=first.dtype if first is not None and first.is_floating_point() else torch.float32)


def check_unmasked(model: nn.Module) -> None:
    """Channel pruning rebuilds layers: a model holding weight masks (a weight-pruned checkpoint)
    is refused."""
    masked = [n for n, m in model.named_modules() if hasattr(m, "weight_mask")]
    if masked:
        raise UserError(f"the model holds weight masks ({masked[0]}, ...: a weight-pruned checkpoint); channel "
                        "granularity prunes a dense or channel-pruned model; pass the dense checkpoint")


def channel_groups(model: nn.Module, input_shape: Sequence[int], ignored: Sequence[nn.Module] = (),
                   record: dict[str, Any] | None = None, floor: int = 1, multiple: int = 1) -> list[ChannelGroup]:
    """The channel groups of ``model`` (traced on a zero input of ``input_shape``), the classifier's
    outputs and the groups of ``ignored`` layers' outputs left out. ``record`` (the model's
    :func:`architecture`) gives each group's dense channel count; without one the model is dense.
    ``floor``: channels a group keeps at least; ``multiple``: its kept count is rounded up to a
    multiple of it by every selection (ONNX Runtime's and oneDNN's convolutions work on
    blocks of 8 channels: a count between multiples wastes the rest of a block, and can be slower
    than the dense network)."""
    check_unmasked(model)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()  # tracing runs a forward: no dropout, no BatchNorm statistics updated
    try:
        with torch.enable_grad():
            graph = tp.DependencyGraph().build_dependency(model, example_inputs=_example(model, input_shape),
                                                          verbose=False)
    finally:
        for m, training in modes:
            m.training = training
    names = {m: n for n, m in model.named_modules()}
    dense = _dense_counts(record)
    groups = []
    for group in graph.get_all_groups(ignored_layers=[classifier(model), *ignored], root_module_types=list(ROOT_TYPES)):
        root = group[0].dep.target.module
        members, layers = [], []
        for item in group:
            module = item.dep.target.module
            if not isinstance(module, ROOT_TYPES) or module not in names:
                continue
            out = graph.is_out_channel_pruning_fn(item.dep.handler)
            if out:
                layers.append(names[module])
            axis = (0 if out else 1) if not getattr(module, "transposed", False) else (1 if out else 0)
            pairs = [(i, r) for i, r in zip(item.idxs, item.root_idxs) if r is not None]
            members.append(Member(names[module], module, axis, [i for i, _ in pairs], [r for _, r in pairs]))
        size = len(group[0].idxs)
        known = next((dense[n] for n in layers if n in dense), size)
        groups.append(ChannelGroup(names[root], group, size, known, floor, layers, members, multiple))
    return groups


def _dense_counts(record: dict[str, Any] | None) -> dict[str, int]:
    return {layer: int(g["dense"]) for g in (record or {}).get("groups", []) for layer in g["layers"]}


def _per_index(module: nn.Module, score: torch.Tensor, axis: int) -> torch.Tensor:
    """``score`` (shaped like the weight, or ``[K, *weight]``) summed per index of ``axis``:
    ``[(K,) out]`` or ``[(K,) in]``; a grouped convolution's input channel ``c`` reads the weights
    of its group's outputs only."""
    lead = score.dim() - module.weight.dim()
    head = score.shape[:lead]
    if axis == 0:
        return score.reshape(*head, score.shape[lead], -1).sum(-1)
    groups = getattr(module, "groups", 1)
    out, per_group = score.shape[lead], score.shape[lead + 1]
    summed = score.reshape(*head, groups, out // groups, per_group, -1).sum(dim=(-1, -3))
    return summed.reshape(*head, groups * per_group)


def channel_scores(groups: Sequence[ChannelGroup], scores: dict[str, torch.Tensor], reduce: str = "sum") -> list[torch.Tensor]:
    """Per group the score of each of its channels, float64 on the CPU: ``[size]``, or ``[K, size]``
    for per-group scores. The scores of every scored layer of the group at that channel are
    summed (``reduce="sum"``), or squared, summed and rooted (``"l2"``). Layers without a score
    (not targeted) add nothing."""
    if reduce not in REDUCTIONS:
        raise UserError(f"channel score reduction must be one of {', '.join(REDUCTIONS)}, got {reduce!r}")
    # Per-group scores (FairGRAPE's [K, *weight]) have a leading dimension the weights lack.
    head = next((scores[m.name].shape[:scores[m.name].dim() - m.module.weight.dim()]
                 for g in groups for m in g.members if m.name in scores), torch.Size())
    out = []
    for g in groups:
        total = torch.zeros(*head, g.size, dtype=torch.float64)
        for m in g.members:
            score = scores.get(m.name)
            if score is None:
                continue
            score = score.detach().to(device="cpu", dtype=torch.float64)
            per_index = _per_index(m.module, score.square() if reduce == "l2" else score, m.axis)
            root = torch.tensor(m.root).expand(*head, len(m.root))
            total.scatter_add_(-1, root, per_index.index_select(-1, torch.tensor(m.idxs)))
        out.append(total.sqrt() if reduce == "l2" else total)
    return out


# -- selection ----------------------------------------------------------------------------------
def per_group(groups: Sequence[ChannelGroup], scores: Sequence[torch.Tensor], density: float) -> MaskChoice:
    """The top ``density`` of every group's dense channel count (ties keep the lower index)."""
    return MaskChoice([select.top_k(s, g.quota(density)) for g, s in zip(groups, scores)])


def global_(groups: Sequence[ChannelGroup], scores: Sequence[torch.Tensor], density: float) -> MaskChoice:
    """The top ``density`` of all channels ranked together (SNIP and GraSP as published); each
    group's ``floor`` best channels are kept first and count towards the total."""
    if not groups:
        return MaskChoice([])
    total = min(layer_quota(sum(g.dense for g in groups), density), sum(g.size for g in groups))
    flat = torch.cat([s.reshape(-1) for s in scores])
    mandatory = torch.cat([select.top_k(s, min(g.floor, g.size)) for g, s in zip(groups, scores)])
    rest = select.top_k(flat, max(0, min(total - int(mandatory.sum()), int((~mandatory).sum()))), ~mandatory)
    keeps = torch.split(mandatory | rest, [g.size for g in groups])
    return MaskChoice([_round_up(keep, s, g.multiple) for keep, s, g in zip(keeps, scores, groups)])


def _round_up(keep: torch.Tensor, score: torch.Tensor, multiple: int) -> torch.Tensor:
    """``keep`` grown by its best channels not yet kept until their count is a multiple of
    ``multiple`` (or all of them): the global ranking's counts rounded as the per-group ones are."""
    kept = int(keep.sum())
    target = min(len(keep), -(-kept // max(1, multiple)) * max(1, multiple))
    return keep if target == kept else keep | select.top_k(score, target - kept, ~keep)


def fair_shares(groups: Sequence[ChannelGroup], scores: Sequence[torch.Tensor], density: float) -> MaskChoice:
    """FairGRAPE over channels: per group, the greedy selection that keeps each demographic group's
    share of the importance (:func:`fairprune.pruning.fairgrape.greedy_select`) on ``[K, size]``
    channel importances instead of ``[K, weights]``. It is the compiled core the weight version
    uses, so the channel masks are the ones its plain-loop oracle gives on the same importances."""
    # Hand-written rather than torch-pruning's: its importances and pruners rank one score per
    # channel, while FairGRAPE keeps every demographic group's share of a [K, channels] importance.
    candidates = [torch.ones(g.size, dtype=torch.bool) for g in groups]
    chosen = select_layer_masks(list(scores), candidates, [g.quota(density) for g in groups], report=True)
    return MaskChoice([keep for keep, _ in chosen], [share for _, share in chosen])


# -- removal and the architecture record --------------------------------------------------------
def remove(groups: Sequence[ChannelGroup], keeps: Sequence[torch.Tensor]) -> None:
    """Remove every channel not kept, from every layer of its group (torch-pruning)."""
    for g, keep in zip(groups, keeps):
        keep = torch.as_tensor(keep, dtype=torch.bool).cpu()
        if keep.numel() != g.size or not bool(keep.any()):
            raise ValueError(f"channel group {g.name}: a keep mask of {keep.numel()} channels with "
                             f"{int(keep.sum())} kept, for {g.size} channels")
        pruned = (~keep).nonzero().squeeze(1).tolist()
        if pruned:
            g.group.prune(pruned)
        g.size = int(keep.sum())


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def architecture(groups: Sequence[ChannelGroup], input_shape: Sequence[int], dense_parameters: int) -> dict[str, Any]:
    """The pruned architecture as plain data (what a checkpoint stores)."""
    return {"input_shape": [int(s) for s in input_shape], "dense_parameters": int(dense_parameters),
            "groups": [{"name": g.name, "layers": list(g.layers), "dense": int(g.dense), "kept": int(g.size)}
                       for g in groups]}


#: The most numbers a recorded example input may hold (3 × 1182², far above any image size a model
#: is pruned at): the network is traced on it, so a larger one would allocate gigabytes for nothing.
MAX_INPUT_NUMEL = 1 << 22


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_architecture(record: Any, state_dict: dict[str, Any] | None = None, where: str = "the checkpoint") -> None:
    """Refuse, in one line naming ``where`` and the bad entry, a pruned architecture that is not
    what :func:`architecture` writes, before any model is built or traced: the example input
    (``[1, channels, height, width]``, whole numbers, at most :data:`MAX_INPUT_NUMEL` numbers), the
    dense parameter count, and per group a name, its layers (each in one group), whole channel counts
    with ``1 <= kept <= dense``; given the checkpoint's ``state_dict``, every group's layers must
    hold ``kept`` output channels there."""

    def bad(entry: str, what: str) -> UserError:
        return UserError(f"{where}: {CHECKPOINT_KEY}{entry} {what}; the file was edited or damaged: pass a checkpoint "
                         "written by prune.py vision")

    if not isinstance(record, dict):
        raise bad("", f"is a {type(record).__name__}, not the mapping prune.py vision writes")
    shape = record.get("input_shape")
    if not isinstance(shape, list) or len(shape) != 4 or not all(_whole(s) for s in shape):
        raise bad(".input_shape", f"is {shape!r}, not four whole numbers [1, channels, height, width]")
    numel = shape[1] * shape[2] * shape[3]
    if shape[0] != 1 or min(shape) < 1 or numel > MAX_INPUT_NUMEL:
        raise bad(".input_shape", f"is {shape}: one image [1, channels, height, width] of at most "
                                  f"{MAX_INPUT_NUMEL} numbers is traced, each size 1 or more")
    if not _whole(record.get("dense_parameters")) or record["dense_parameters"] < 1:
        raise bad(".dense_parameters", f"is {record.get('dense_parameters')!r}, not a parameter count of 1 or more")
    groups = record.get("groups")
    if not isinstance(groups, list):
        raise bad(".groups", f"is {type(groups).__name__}, not a list of channel groups")
    seen: set[str] = set()
    for i, entry in enumerate(groups):
        tag = f".groups[{i}]"
        if not isinstance(entry, dict):
            raise bad(tag, f"is a {type(entry).__name__}, not a channel group")
        if not isinstance(entry.get("name"), str) or not entry["name"]:
            raise bad(f"{tag}.name", f"is {entry.get('name')!r}, not a layer name")
        layers = entry.get("layers")
        if not isinstance(layers, list) or not layers or not all(isinstance(n, str) and n for n in layers):
            raise bad(f"{tag}.layers", f"is {layers!r}, not a list of layer names")
        again = next((n for n in layers if n in seen), None)
        if again is not None:
            raise bad(f"{tag}.layers", f"names {again}, which another group names too")
        seen.update(layers)
        for key in ("dense", "kept"):
            if key not in entry:
                raise bad(tag, f"({entry['name']}) has no '{key}' channel count")
            if not _whole(entry[key]):
                raise bad(f"{tag}.{key}", f"({entry['name']}) is {entry[key]!r}, not a whole number of channels")
        if not 1 <= entry["kept"] <= entry["dense"]:
            raise bad(f"{tag}.kept", f"({entry['name']}) is {entry['kept']} of {entry['dense']} dense channels; "
                                     "a group keeps 1 to all of them")
    for i, entry in enumerate(groups if state_dict is not None else []):
        for layer in entry["layers"]:
            weight = state_dict.get(f"{layer}.weight", state_dict.get(f"{layer}.weight_orig"))
            if isinstance(weight, torch.Tensor) and weight.dim() >= 1 and weight.shape[0] != entry["kept"]:
                raise bad(f".groups[{i}].kept", f"({entry['name']}) is {entry['kept']}, but the checkpoint's weights of "
                                                f"{layer} hold {weight.shape[0]} output channels")


def apply_architecture(model: nn.Module, record: dict[str, Any], dense: bool = False) -> None:
    """Remove channels from ``model`` (the dense one, or one already pruned less) until every group
    of ``record`` has its kept channel count; the weights are then the checkpoint's to fill.
    ``dense``: ``model`` is the dense network, whose group sizes must be the record's dense counts."""
    check_architecture(record)
    shape, entries = record["input_shape"], record["groups"]
    by_layer = {layer: entry for entry in entries for layer in entry["layers"]}
    try:
        found = channel_groups(model, shape)
    except (RuntimeError, ValueError, IndexError) as err:  # the example input does not fit the network
        raise UserError(f"the checkpoint's {CHECKPOINT_KEY}.input_shape {shape} is no input of this model "
                        f"({' '.join(str(err).split())[:160]}); pass a checkpoint written by prune.py vision") from None
    matched = set()
    for g in found:
        entry = next((by_layer[n] for n in g.layers if n in by_layer), None)
        if entry is None:
            continue
        matched.add(id(entry))
        kept = entry["kept"]
        if not 1 <= kept <= g.size:
            raise UserError(f"the checkpoint keeps {kept} channels of layer {g.name}, which has {g.size}: it was pruned "
                            "from another model; load it with the model settings it was trained with")
        if dense and entry["dense"] != g.size:
            raise UserError(f"the checkpoint's {CHECKPOINT_KEY} says layer {g.name} has {entry['dense']} dense channels, "
                            f"but the model its settings build has {g.size}: the file was edited, or it was pruned from "
                            "another model; pass a checkpoint written by prune.py vision")
        if kept < g.size:
            g.group.prune(list(range(kept, g.size)))
    missing = [e["name"] for e in entries if id(e) not in matched]
    if missing:
        raise UserError(f"the checkpoint's pruned layers {', '.join(missing[:3])} are not channel groups of this model: "
                        "it was pruned from another model; load it with the model settings it was trained with")


def channel_sparsity(record: dict[str, Any] | None) -> float:
    """The fraction of prunable channels removed (each coupled channel counted once)."""
    entries = (record or {}).get("groups", [])
    dense = sum(int(e["dense"]) for e in entries)
    return 1.0 - sum(int(e["kept"]) for e in entries) / dense if dense else 0.0


def report_fields(model: nn.Module, record: dict[str, Any]) -> dict[str, Any]:
    """What a report says about a channel-pruned model."""
    entries = record.get("groups", [])
    parameters, dense_parameters = parameter_count(model), int(record.get("dense_parameters") or 0)
    return {
        "granularity": "channel",
        "sparsity_definition": "fraction of prunable channels removed (the channels of every coupled channel group, "
                               "each counted once, against the dense model)",
        "achieved_sparsity": channel_sparsity(record),
        "channels_kept": {"kept": sum(int(e["kept"]) for e in entries), "dense": sum(int(e["dense"]) for e in entries),
                          "groups": {e["name"]: [int(e["kept"]), int(e["dense"])] for e in entries}},
        "parameters": parameters,
        "dense_parameters": dense_parameters,
        "parameters_removed": 1.0 - parameters / dense_parameters if dense_parameters else 0.0,
    }
