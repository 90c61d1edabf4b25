"""Attention heads: switch them off with gates, then take them out of the weights.

* :class:`HeadGates` multiplies the input of every attention output projection (the
  concatenation of all heads, ``[..., n_heads * head_dim]``) by a per-head mask through a forward
  pre-hook. One model, one process: any head set is tried without copying or reloading weights.
  The mask is a float tensor ``[layers, heads]`` that may require grad (gradient head importance).
  :meth:`HeadGates.per_row` adds a configuration dimension: row ``b`` of a batch is multiplied by
  its own ``[layers, heads]`` gates, so one forward pass evaluates many head sets at once.
* :func:`remove_heads` slices heads out of q/k/v and the output projection and updates the
  attention module's head-count attributes, so the pruned model computes exactly what the gated
  model computes; :func:`without_heads` does the same to a streamed model, writing each
  block without its heads into a new folder (one block resident).

Where a family keeps its heads (attention module, q/k/v projections, head-count attributes) is
part of its row in :data:`fairprune.causal.families.FAMILIES`; this module has no table of its own.

Saving a pruned model. ``from_pretrained`` builds every layer with the config's one head count,
and most families derive ``head_dim`` from ``hidden_size // heads``, so a smaller head count
cannot be written into their config at all. ``remove_heads(..., loadable=True)`` (the default)
therefore keeps what the config can express and zeroes the rest:

* families whose config states ``head_dim`` on its own (Llama, Mistral) are shrunk to the
  largest per-layer count that any layer still needs; every other layer is padded up to that
  count with removed heads whose weights are zeroed;
* other families (GPT-2, GPT-Neo, OPT, BERT) keep their shapes; removed heads are zeroed
  (their q/k/v rows and output-projection columns), which is exactly equivalent.

``loadable=False`` slices every removed head out (the fastest model in memory) but such a model
has per-layer head counts that ``from_pretrained`` cannot rebuild. The returned
:class:`HeadRemoval` lists which heads were removed from the tensors and which were zeroed.

Grouped-query attention (Llama with fewer key/value heads): query head ``h`` reads key/value
head ``h // group``. A query head goes alone while its group keeps another query head; when all
query heads of a group go, the key/value head goes too. Within a layer each remaining group must
serve the same number of query heads, so groups are padded with zeroed query heads as needed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from fairprune.causal import pipeline
from fairprune.causal.blocks import BlockModel, as_blocks
from fairprune.causal.families import Family, family_of, linear_weight
from fairprune.errors import UserError

Head = tuple[int, int]  # (layer, head)


# --------------------------------------------------------------------------------------------
# (1) Gates
# --------------------------------------------------------------------------------------------


class HeadGates:
    """Per-head gates on the attention output projections of ``model`` (an ``nn.Module`` or a block
    model: the hooks sit on its modules, so they gate a streamed model's blocks as they run).

    Example::

        gates = HeadGates(model)
        with gates:                      # hooks on; all gates 1.0
            with gates.off([(0, 3)]):    # layer 0, head 3 silenced
                logits = model(ids).logits
        # hooks off, gates back to 1.0

    ``gates.values`` is a ``[layers, heads]`` float tensor; ``gates.values.requires_grad_()``
    makes ``∂loss/∂gate`` available in ``gates.values.grad`` after a backward pass.
    """

    def __init__(self, model: nn.Module | BlockModel):
        model = model.model if isinstance(model, BlockModel) else model
        self.family = family_of(model)
        self.family.require_heads()
        self.blocks = list(self.family.block_list(model))
        self.head_dim = self.family.head_dim(model.config)
        self.values = torch.ones(len(self.blocks), self.family.num_heads(model.config))
        self.rows: torch.Tensor | None = None  # [batch, layers, heads] while per_row() is active
        self._handles: list = []

    def attach(self) -> HeadGates:
        """Install the hooks (idempotent)."""
        if not self._handles:
            for layer, block in enumerate(self.blocks):
                out_proj = self.family.attention_out(block)
                self._handles.append(out_proj.register_forward_pre_hook(self._hook(layer)))
        return self

    def detach(self) -> None:
        """Remove the hooks; the model computes as if ungated."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> HeadGates:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()
        self.clear()

    def set(self, heads: Iterable[Head] | torch.Tensor, value: float = 0.0) -> None:
        """Gate ``heads`` to ``value`` and every other head to 1, or copy a full ``[layers, heads]`` tensor."""
        with torch.no_grad():
            if isinstance(heads, torch.Tensor):
                if heads.shape != self.values.shape:
                    raise UserError(f"gate tensor has shape {tuple(heads.shape)}, expected {tuple(self.values.shape)} (layers, heads)")
                self.values.copy_(heads)
                return
            self.values.fill_(1.0)
            for layer, head in heads:
                self._check(layer, head)
                self.values[layer, head] = value

    def clear(self) -> None:
        """All gates back to 1."""
        with torch.no_grad():
            self.values.fill_(1.0)

    @contextmanager
    def off(self, heads: Iterable[Head]) -> Iterator[HeadGates]:
        """Silence ``heads`` (on top of the current gates) for the duration of the block."""
        saved = self.values.detach().clone()
        with torch.no_grad():
            for layer, head in heads:
                self._check(layer, head)
                self.values[layer, head] = 0.0
        try:
            yield self
        finally:
            with torch.no_grad():
                self.values.copy_(saved)

    @contextmanager
    def per_row(self, rows: torch.Tensor) -> Iterator[HeadGates]:
        """For the duration of the block, batch row ``b`` is gated by ``rows[b]`` (a ``[batch, layers,
        heads]`` tensor) on top of :attr:`values`: one forward pass, one head configuration per row.

        Example::

            configs = torch.ones(2, *gates.values.shape)
            configs[1, 0, 3] = 0                          # row 1: layer 0, head 3 off
            with gates, gates.per_row(configs):
                logits = model(ids.expand(2, -1)).logits  # [2, T, vocab]: both configurations

        Gates of 0 and 1 multiply exactly, so a row computes what the model computes with
        :meth:`off` for the same heads (on a CPU, bit for bit; a GPU may differ in the last bits
        between batch shapes).
        """
        if rows.dim() != 3 or tuple(rows.shape[1:]) != tuple(self.values.shape):
            raise UserError(f"per-row gates have shape {tuple(rows.shape)}, expected (batch, {self.values.shape[0]}, "
                            f"{self.values.shape[1]}) (batch, layers, heads)")
        saved, self.rows = self.rows, rows
        try:
            yield self
        finally:
            self.rows = saved

    def _check(self, layer: int, head: int) -> None:
        layers, heads = self.values.shape
        if not (0 <= layer < layers and 0 <= head < heads):
            raise UserError(f"head ({layer}, {head}) does not exist; the model has {layers} layers × {heads} heads")

    def _hook(self, layer: int):
        def hook(module: nn.Module, args: tuple):
            gate = self.values[layer]
            # All-open gates skip the multiply: the gated model is then bit-identical to the plain one.
            if self.rows is None and not gate.requires_grad and bool((gate == 1).all()):
                return None
            x = args[0]
            if x.shape[-1] != gate.numel() * self.head_dim:
                raise UserError(f"layer {layer}: output projection input has width {x.shape[-1]}, "
                                f"expected {gate.numel()} heads × {self.head_dim}; gate a model before removing heads")
            if self.rows is not None:
                if x.shape[0] != self.rows.shape[0]:
                    raise UserError(f"layer {layer}: a batch of {x.shape[0]} rows under per-row gates for {self.rows.shape[0]} rows")
                # [B, H] → [B, 1, H, 1] against the input seen as [B, T, H, D].
                rows = (self.rows[:, layer] * gate).to(device=x.device, dtype=x.dtype)
                shaped = x.unflatten(-1, (gate.numel(), self.head_dim)) * rows[:, None, :, None]
                return (shaped.flatten(-2), *args[1:])
            scale = gate.to(device=x.device, dtype=x.dtype).repeat_interleave(self.head_dim)
            return (x * scale, *args[1:])

        return hook


# --------------------------------------------------------------------------------------------
# (2) Physical removal
# --------------------------------------------------------------------------------------------


@dataclass
class HeadRemoval:
    """What :func:`remove_heads` did: heads sliced out of the tensors and heads zeroed in place."""

    removed: list[Head] = field(default_factory=list)
    zeroed: list[Head] = field(default_factory=list)
    kv_removed: list[Head] = field(default_factory=list)  # (layer, key/value head) sliced out
    kv_zeroed: list[Head] = field(default_factory=list)  # (layer, key/value head) kept in the tensors, zeroed
    heads_per_layer: list[int] = field(default_factory=list)  # query heads left in each layer's tensors

    def as_dict(self) -> dict:
        return {"removed": [list(h) for h in self.removed], "zeroed": [list(h) for h in self.zeroed],
                "kv_removed": [list(h) for h in self.kv_removed], "kv_zeroed": [list(h) for h in self.kv_zeroed],
                "heads_per_layer": self.heads_per_layer}


@dataclass(frozen=True)
class _LayerPlan:
    q_keep: list[int]  # query heads kept in the tensors, in order
    kv_keep: list[int]  # key/value heads kept in the tensors, in order
    zero_q: list[int]  # kept query heads that are pruned: weights zeroed
    zero_kv: list[int]  # kept key/value heads that serve no live query head: weights zeroed


@torch.no_grad()
def without_heads(model, heads: Iterable[Head], loadable: bool = True, out=None,
                  progress: bool = False) -> tuple[BlockModel, HeadRemoval]:
    """``heads`` removed from ``model`` (an ``nn.Module`` or a block model) and the
    :class:`HeadRemoval`: every block changed by one pass and the config's head counts set
    (:meth:`~fairprune.causal.blocks.BlockModel.restructured`): a model in memory in place; a
    streamed one written into ``out`` block by block, one block resident, and opened from there
    (its files those ``save_pretrained`` of the model pruned in memory writes), itself left as it
    was. See the module docstring for ``loadable``."""
    blocks = as_blocks(model)
    change, report, fields = _removal(blocks.family, blocks.config, len(blocks.blocks), heads, loadable)
    return blocks.restructured(change, fields, out, progress), report


def remove_heads(model: nn.Module, heads: Iterable[Head], loadable: bool = True) -> HeadRemoval:
    """Prune ``heads`` from ``model`` (in memory) in place (:func:`without_heads`)."""
    return without_heads(model, heads, loadable)[1]


def _removal(family: Family, config, layers: int, heads: Iterable[Head], loadable: bool):
    """What removing ``heads`` does to a model of ``layers`` blocks: ``change(layer, block)`` (the
    block's tensors sliced and zeroed in place), the :class:`HeadRemoval` and the config fields
    it sets (with ``loadable`` on a family whose config states ``head_dim``)."""
    family.require_heads()
    n_heads, n_kv, head_dim = family.num_heads(config), family.num_kv_heads(config), family.head_dim(config)
    by_layer: list[set[int]] = [set() for _ in range(layers)]
    for layer, head in heads:
        if not (0 <= layer < layers and 0 <= head < n_heads):
            raise UserError(f"head ({layer}, {head}) does not exist; the model has {layers} layers × {n_heads} heads")
        by_layer[layer].add(head)
    plans = _plan(by_layer, n_heads, n_kv, shrink=not loadable or family.heads_shrinkable, uniform=loadable)
    report = HeadRemoval()
    for layer, plan in enumerate(plans):
        report.removed += [(layer, h) for h in sorted(by_layer[layer]) if h not in plan.q_keep]
        report.zeroed += [(layer, h) for h in plan.zero_q]
        report.kv_removed += [(layer, g) for g in range(n_kv) if g not in plan.kv_keep]
        report.kv_zeroed += [(layer, g) for g in plan.zero_kv]
        report.heads_per_layer.append(len(plan.q_keep))
    fields = {}
    if loadable and family.heads_shrinkable:
        fields = {family.head_dim_key: head_dim, family.heads_key: len(plans[0].q_keep)}
        if family.kv_heads_key:
            fields[family.kv_heads_key] = len(plans[0].kv_keep)

    def change(layer: int, block: nn.Module) -> None:
        _apply(family, block, plans[layer], n_heads, n_kv, head_dim)

    return change, report, fields


def _plan(by_layer: list[set[int]], n_heads: int, n_kv: int, shrink: bool, uniform: bool) -> list[_LayerPlan]:
    """Which heads stay in the tensors of each layer.

    Query head ``h`` belongs to key/value group ``h // group``. A layer keeps ``n_groups``
    groups of ``per_group`` query heads each (live ones first, then pruned ones as zeroed
    padding); without ``shrink`` nothing leaves the tensors; with ``uniform`` every layer gets the
    largest counts any layer needs, so one config describes them all. A layer keeps at least one
    (possibly zeroed) head so that its attention still has a shape.
    """
    group = n_heads // n_kv
    live = [[[h for h in range(g * group, (g + 1) * group) if h not in gone] for g in range(n_kv)] for gone in by_layer]
    if shrink:
        need_groups = [max(1, sum(1 for heads in layer if heads)) for layer in live]
        need_per_group = [max(1, max(len(heads) for heads in layer)) for layer in live]
    else:
        need_groups, need_per_group = [n_kv] * len(live), [group] * len(live)
    if uniform:
        need_groups = [max(need_groups)] * len(live)
        need_per_group = [max(need_per_group)] * len(live)
    plans = []
    for layer, gone in enumerate(by_layer):
        groups = sorted(sorted(range(n_kv), key=lambda g: not live[layer][g])[: need_groups[layer]])
        q_keep = []
        for g in groups:
            members = range(g * group, (g + 1) * group)
            padding = [h for h in members if h in gone][: need_per_group[layer] - len(live[layer][g])]
            q_keep += sorted(live[layer][g] + padding)
        plans.append(_LayerPlan(
            q_keep=q_keep, kv_keep=groups, zero_q=[h for h in q_keep if h in gone],
            zero_kv=[g for g in groups if not live[layer][g]],
        ))
    return plans


def _apply(family: Family, block: nn.Module, plan: _LayerPlan, n_heads: int, n_kv: int, head_dim: int) -> None:
    """Zero the pruned heads that stay, then slice the rest out of q/k/v and the output projection."""
    attention = family.attention_module(block)
    out_proj = family.attention_out(block)
    projections = family.qkv_layers(block)
    q_rows, kv_rows = _rows(plan.q_keep, head_dim), _rows(plan.kv_keep, head_dim)
    if len(projections) == 1:  # fused [q | k | v]: offsets of the k and v parts
        q_width, kv_width = n_heads * head_dim, n_kv * head_dim
        fused = projections[0]
        _zero_outputs(fused, _rows(plan.zero_q, head_dim))
        _zero_outputs(fused, [q_width + r for r in _rows(plan.zero_kv, head_dim)])
        _zero_outputs(fused, [q_width + kv_width + r for r in _rows(plan.zero_kv, head_dim)])
        _keep(fused, q_rows + [q_width + r for r in kv_rows] + [q_width + kv_width + r for r in kv_rows], dim=0)
    else:
        q, k, v = projections
        _zero_outputs(q, _rows(plan.zero_q, head_dim))
        for layer in (k, v):
            _zero_outputs(layer, _rows(plan.zero_kv, head_dim))
        _keep(q, q_rows, dim=0)
        _keep(k, kv_rows, dim=0)
        _keep(v, kv_rows, dim=0)
    linear_weight(out_proj)[:, _rows(plan.zero_q, head_dim)] = 0
    _keep(out_proj, q_rows, dim=1)
    for name in family.head_counts:
        setattr(attention, name, len(plan.q_keep))
    for name in family.head_widths:
        setattr(attention, name, len(plan.q_keep) * head_dim)
    if family.head_groups:
        setattr(attention, family.head_groups, len(plan.q_keep) // len(plan.kv_keep))
    for name in family.kv_head_counts:
        setattr(attention, name, len(plan.kv_keep))


def _rows(heads: list[int], head_dim: int) -> list[int]:
    return [h * head_dim + i for h in heads for i in range(head_dim)]


def _zero_outputs(layer: nn.Module, rows: list[int]) -> None:
    if rows:
        linear_weight(layer)[rows] = 0
        if layer.bias is not None:
            layer.bias.data[rows] = 0


def _keep(layer: nn.Module, index: list[int], dim: int) -> None:
    """Keep only ``index`` along the ``[out, in]`` dimension ``dim``, in place (hooks stay attached)."""
    weight = linear_weight(layer)
    if len(index) == weight.shape[dim]:
        return
    idx = torch.tensor(index, dtype=torch.long, device=weight.device)
    weight = weight.index_select(dim, idx)
    conv = isinstance(layer, Conv1D)
    layer.weight = nn.Parameter((weight.t() if conv else weight).contiguous(), requires_grad=layer.weight.requires_grad)
    if dim == 0 and layer.bias is not None:
        layer.bias = nn.Parameter(layer.bias.data.index_select(0, idx).clone(), requires_grad=layer.bias.requires_grad)
    out_features, in_features = weight.shape
    if conv:
        layer.nf, layer.nx = out_features, in_features
    else:
        layer.out_features, layer.in_features = out_features, in_features


@torch.no_grad()
def head_weight_norms(model) -> torch.Tensor:
    """``[layers, heads]`` L2 norm of each head's weights: its q rows, its key/value head's k/v rows
    (shared under grouped-query attention) and its columns of the output projection. ``model``:
    an ``nn.Module`` or a block model (one block loaded at a time)."""
    blocks = as_blocks(model)
    family, config = blocks.family, blocks.config
    n_heads, n_kv, head_dim = family.num_heads(config), family.num_kv_heads(config), family.head_dim(config)
    group = n_heads // n_kv
    norms = []

    def norm(index: int, block: nn.Module) -> None:  # reads only
        weights = [linear_weight(layer).float() for layer in family.qkv_layers(block)]
        q, k, v = weights if len(weights) == 3 else weights[0].split([n_heads * head_dim, n_kv * head_dim, n_kv * head_dim])
        out = linear_weight(family.attention_out(block)).float()
        sq = lambda w: w.pow(2).view(-1, head_dim, w.shape[-1]).sum((1, 2))  # noqa: E731 [heads]
        kv = (sq(k) + sq(v)).repeat_interleave(group)
        o = out.t().pow(2).reshape(n_heads, head_dim, -1).sum((1, 2))
        norms.append((sq(q) + kv + o).sqrt().cpu())

    pipeline.run(blocks, [pipeline.Each(change=norm)])
    return torch.stack(norms)
