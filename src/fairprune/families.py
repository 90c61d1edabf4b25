"""Where things live inside each supported transformer family.

Pruning methods never branch on the model type: they ask a :class:`Family` for the embedding
front (the modules that run before the first block), the list of transformer blocks, the
prunable linear layers of a block, the attention output projection, the head counts and where
each head lives (q/k/v projections and head-count attributes, read by
:mod:`fairprune.pruning.heads`). Adding a family means adding one row to :data:`FAMILIES`.

All paths are relative to ``model.base_model`` (``GPT2Model`` inside ``GPT2LMHeadModel``, ...),
so a bare backbone and a model with a task head resolve the same way.

GPT-2 stores its projections as ``Conv1D`` whose weight is ``[in, out]``; :func:`linear_weight`
and :func:`set_linear_weight` present every prunable layer as a ``[out, in]`` matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from fairprune.errors import UserError


@dataclass(frozen=True)
class Family:
    """One row of the table: module paths (relative to ``model.base_model``) and config keys."""

    name: str
    model_types: tuple[str, ...]
    front: tuple[str, ...]  # modules that run before block 0 (embeddings, rotary tables)
    blocks: str  # the ``nn.ModuleList`` of transformer blocks
    linears: tuple[str, ...]  # prunable layers, relative to one block, in forward order
    attn_out: str  # attention output projection, relative to one block
    attention: str  # the attention module, relative to one block
    qkv: tuple[str, ...]  # (q, k, v) relative to ``attention``; a single entry is a fused [q | k | v] layer
    heads_key: str = "num_attention_heads"
    kv_heads_key: str | None = None  # grouped-query attention; None: same as heads
    head_dim_key: str | None = None  # None: hidden_size // heads
    # Attributes of the attention module that head removal keeps in step with the tensors:
    head_counts: tuple[str, ...] = ()  # the number of query heads
    head_widths: tuple[str, ...] = ()  # query heads × head_dim
    head_groups: str | None = None  # query heads per key/value head
    # Modules that run after the last block, before the head (causal LMs; in order, an absent optional
    # one such as OPT's ``project_out`` skipped): what a model read block by block runs last.
    tail: tuple[str, ...] = ()

    @property
    def heads_shrinkable(self) -> bool:
        """The config states ``head_dim`` apart from ``hidden_size``, so a saved model may have
        fewer heads than the original (Llama, Mistral); other families keep their head count."""
        return self.head_dim_key is not None

    def block_list(self, model: nn.Module) -> nn.ModuleList:
        """The transformer blocks, in order."""
        return _get(_base(model), self.blocks)

    def front_modules(self, model: nn.Module) -> list[nn.Module]:
        """Modules that run before block 0; optional ones (e.g. OPT's ``project_in``) may be absent."""
        base = _base(model)
        found = (_get(base, path, missing_ok=True) for path in self.front)
        return [m for m in found if m is not None]

    def tail_modules(self, model: nn.Module) -> list[nn.Module]:
        """Modules that run after the last block, the output head last (causal LMs)."""
        base = _base(model)
        found = (_get(base, path, missing_ok=True) for path in self.tail)
        return [m for m in found if m is not None] + [model.get_output_embeddings()]

    def block_linears(self, block: nn.Module) -> dict[str, nn.Module]:
        """The prunable ``nn.Linear`` / ``Conv1D`` layers of one block, by relative name."""
        return {path: _get(block, path) for path in self.linears}

    def attention_out(self, block: nn.Module) -> nn.Module:
        """The attention output projection (its input is the concatenation of all heads)."""
        return _get(block, self.attn_out)

    def attention_module(self, block: nn.Module) -> nn.Module:
        """The attention module of one block (it holds the head-count attributes)."""
        return _get(block, self.attention)

    def qkv_layers(self, block: nn.Module) -> list[nn.Module]:
        """The q, k, v projections of one block, or the one fused ``[q | k | v]`` layer."""
        attention = self.attention_module(block)
        return [_get(attention, path) for path in self.qkv]

    def num_heads(self, config) -> int:
        """Number of query heads."""
        return int(getattr(config, self.heads_key))

    def num_kv_heads(self, config) -> int:
        """Number of key/value heads (fewer than query heads under grouped-query attention)."""
        value = getattr(config, self.kv_heads_key, None) if self.kv_heads_key else None
        return int(value) if value else self.num_heads(config)

    def head_dim(self, config) -> int:
        """Width of one head."""
        value = getattr(config, self.head_dim_key, None) if self.head_dim_key else None
        return int(value) if value else int(config.hidden_size) // self.num_heads(config)


_LLAMA_LINEARS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)

FAMILIES: tuple[Family, ...] = (
    Family(
        name="gpt2", model_types=("gpt2",), front=("wte", "wpe"), blocks="h",
        linears=("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"), attn_out="attn.c_proj",
        attention="attn", qkv=("c_attn",), head_counts=("num_heads",), head_widths=("split_size",), tail=("ln_f",),
    ),
    Family(
        name="gpt-neo", model_types=("gpt_neo",), front=("wte", "wpe"), blocks="h",
        linears=(
            "attn.attention.q_proj", "attn.attention.k_proj", "attn.attention.v_proj",
            "attn.attention.out_proj", "mlp.c_fc", "mlp.c_proj",
        ),
        attn_out="attn.attention.out_proj",
        attention="attn.attention", qkv=("q_proj", "k_proj", "v_proj"), head_counts=("num_heads",), tail=("ln_f",),
    ),
    Family(
        name="opt", model_types=("opt",),
        front=("decoder.embed_tokens", "decoder.embed_positions", "decoder.project_in"),
        blocks="decoder.layers",
        linears=(
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
            "fc1", "fc2",
        ),
        attn_out="self_attn.out_proj",
        attention="self_attn", qkv=("q_proj", "k_proj", "v_proj"), head_counts=("num_heads",),
        tail=("decoder.final_layer_norm", "decoder.project_out"),
    ),
    Family(
        name="llama", model_types=("llama", "mistral"), front=("embed_tokens", "rotary_emb"),
        blocks="layers", linears=_LLAMA_LINEARS, attn_out="self_attn.o_proj",
        attention="self_attn", qkv=("q_proj", "k_proj", "v_proj"),
        kv_heads_key="num_key_value_heads", head_dim_key="head_dim", head_groups="num_key_value_groups", tail=("norm",),
    ),
    Family(
        name="bert", model_types=("bert", "roberta"), front=("embeddings",), blocks="encoder.layer",
        linears=(
            "attention.self.query", "attention.self.key", "attention.self.value",
            "attention.output.dense", "intermediate.dense", "output.dense",
        ),
        attn_out="attention.output.dense",
        attention="attention.self", qkv=("query", "key", "value"),
        head_counts=("num_attention_heads",), head_widths=("all_head_size",),
    ),
)


def family_of(model: nn.Module) -> Family:
    """The table row for ``model.config.model_type``; unknown types raise :class:`UserError`."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = ", ".join(t for f in FAMILIES for t in f.model_types)
    raise UserError(
        f"model type {model_type!r} is not supported for pruning; supported: {supported} "
        "(add a row to fairprune.families.FAMILIES for a new family)"
    )


def linear_weight(layer: nn.Module) -> torch.Tensor:
    """The weight as ``[out, in]``: a view of ``nn.Linear.weight``, the transpose for ``Conv1D``."""
    return layer.weight.data.t() if isinstance(layer, Conv1D) else layer.weight.data


def set_linear_weight(layer: nn.Module, weight: torch.Tensor) -> None:
    """Write a ``[out, in]`` matrix back, in the layer's own dtype and layout."""
    linear_weight(layer).copy_(weight.to(layer.weight.dtype))


def _base(model: nn.Module) -> nn.Module:
    # ``base_model`` strips task heads (``GPT2LMHeadModel.transformer`` ...); plain modules pass.
    return getattr(model, "base_model", model)


def _get(root: nn.Module, path: str, missing_ok: bool = False):
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            if missing_ok:
                return None
            raise UserError(
                f"{type(root).__name__} has no submodule {path!r}; the family table in "
                "fairprune.families does not match this model"
            )
    return obj
