"""Where things live inside each transformer family.

Pruning methods never branch on the model type: they ask a :class:`Family` for the embedding
front (the modules that run before the first block), the list of transformer blocks, the
prunable linear layers of a block, the attention output projection, the head counts and where
each head lives (q/k/v projections and head-count attributes, read by
:mod:`fairprune.pruning.heads`).

For a causal LM the structure (front, blocks, prunable layers, tail) is found from the model
itself (:mod:`fairprune.causal.structure`), so any ``*ForCausalLM`` whose decoder layers form one
``nn.ModuleList`` is read, Qwen, Gemma and Phi included. :data:`FAMILIES` keeps what discovery
cannot know: where the attention heads are (FASP, head removal) for families whose attention is
not named the common way (:func:`generic_heads` reads ``q_proj`` / ``k_proj`` / ``v_proj`` or a
fused ``qkv_proj``, and ``o_proj``), and a row may override any structure field. The encoders
(BERT, RoBERTa) are stated whole.

All paths are relative to ``model.base_model`` (``GPT2Model`` inside ``GPT2LMHeadModel``, ...),
so a bare backbone and a model with a task head resolve the same way.

GPT-2 stores its projections as ``Conv1D`` whose weight is ``[in, out]``; :func:`linear_weight`
and :func:`set_linear_weight` present every prunable layer as a ``[out, in]`` matrix.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from fairprune.causal.structure import LINEAR_TYPES, Structure, block_kinds, discover, find_blocks, linear_names, merge_orders
from fairprune.errors import UserError


@dataclass(frozen=True)
class Family:
    """One row of the table: where a family keeps its attention heads (module paths relative to one
    block, config keys), and optionally its structure (paths relative to ``model.base_model``).

    For a causal LM the structure fields (``front``, ``blocks``, ``linears``, ``tail``) are found
    from the model (:mod:`fairprune.causal.structure`); a row sets them only to override discovery
    (or for the encoders, which discovery does not read). :func:`family_of` returns a complete row."""

    name: str
    model_types: tuple[str, ...]
    attn_out: str | None = None  # attention output projection, relative to one block (None: no head layout)
    attention: str | None = None  # the attention module, relative to one block
    qkv: tuple[str, ...] = ()  # (q, k, v) relative to ``attention``; a single entry is a fused [q | k | v] layer
    heads_key: str = "num_attention_heads"
    kv_heads_key: str | None = None  # grouped-query attention; None: same as heads
    head_dim_key: str | None = None  # None: hidden_size // heads
    # Attributes of the attention module that head removal keeps in step with the tensors:
    head_counts: tuple[str, ...] = ()  # the number of query heads
    head_widths: tuple[str, ...] = ()  # query heads × head_dim
    head_groups: str | None = None  # query heads per key/value head
    kv_head_counts: tuple[str, ...] = ()  # the number of key/value heads
    # The structure (None: found from the model):
    front: tuple[str, ...] | None = None  # modules that run before block 0 (embeddings, rotary tables)
    blocks: str | None = None  # the ``nn.ModuleList`` of transformer blocks
    linears: tuple[str, ...] | None = None  # prunable layers, relative to one block, in forward order
    # Modules that run after the last block, before the head (causal LMs; in order): what a model
    # read block by block runs last. Empty for an encoder.
    tail: tuple[str, ...] | None = None
    returns_tuple: bool = False  # a block returns (hidden, ...) rather than the hidden states
    mixed: bool = False  # blocks of several kinds (dense and expert MLPs): each holds some of ``linears``

    @property
    def has_heads(self) -> bool:
        """Whether the row says where the attention heads are (FASP and head removal need it)."""
        return self.attn_out is not None

    def require_heads(self, what: str = "head pruning") -> None:
        """One line, before any work, when this family's attention cannot be cut by heads."""
        if not self.has_heads:
            raise UserError(f"{what} needs the attention heads' layout, and the {self.name} family's attention was "
                            "not recognised (separate q/k/v or one fused projection with an output projection); add "
                            "a row to fairprune.causal.families.FAMILIES (see docs/extending.md)")

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
        """The prunable ``nn.Linear`` / ``Conv1D`` layers of one block, by relative name (of a model
        whose blocks differ, those of ``linears`` the block has)."""
        if not self.mixed:
            return {path: _get(block, path) for path in self.linears}
        found = ((path, _get(block, path, missing_ok=True)) for path in self.linears)
        return {path: layer for path, layer in found if isinstance(layer, LINEAR_TYPES)}

    def block_units(self, block: nn.Module) -> dict[str, nn.Module]:
        """What the LM methods prune in one block, by relative name: its linear layers but the
        routers (:func:`fairprune.causal.experts.is_router`), then every expert of every fused
        expert parameter as a layer of its own (:class:`fairprune.causal.experts.ExpertSlice`,
        named ``"<parameter>.<expert>"``)."""
        from fairprune.causal.experts import expert_slices, has_experts, is_router

        moe = has_experts(block)
        units = {path: layer for path, layer in self.block_linears(block).items() if not is_router(path, moe)}
        return {**units, **expert_slices(block)}

    def attention_out(self, block: nn.Module) -> nn.Module:
        """The attention output projection (its input is the concatenation of all heads)."""
        self.require_heads()
        return _get(block, self.attn_out)

    def attention_module(self, block: nn.Module) -> nn.Module:
        """The attention module of one block (it holds the head-count attributes)."""
        self.require_heads()
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


FAMILIES: tuple[Family, ...] = (
    Family(name="gpt2", model_types=("gpt2",), attn_out="attn.c_proj", attention="attn", qkv=("c_attn",),
           head_counts=("num_heads",), head_widths=("split_size",)),
    Family(name="gpt-neo", model_types=("gpt_neo",), attn_out="attn.attention.out_proj", attention="attn.attention",
           qkv=("q_proj", "k_proj", "v_proj"), head_counts=("num_heads",)),
    Family(name="opt", model_types=("opt",), attn_out="self_attn.out_proj", attention="self_attn",
           qkv=("q_proj", "k_proj", "v_proj"), head_counts=("num_heads",)),
    Family(name="llama", model_types=("llama", "mistral"), attn_out="self_attn.o_proj", attention="self_attn",
           qkv=("q_proj", "k_proj", "v_proj"), kv_heads_key="num_key_value_heads", head_dim_key="head_dim",
           head_groups="num_key_value_groups"),
    # Encoders (text classifiers, Diff-Pruning): not causal LMs, so their structure is stated here.
    Family(
        name="bert", model_types=("bert", "roberta"), front=("embeddings",), blocks="encoder.layer",
        linears=(
            "attention.self.query", "attention.self.key", "attention.self.value",
            "attention.output.dense", "intermediate.dense", "output.dense",
        ),
        attn_out="attention.output.dense",
        attention="attention.self", qkv=("query", "key", "value"),
        head_counts=("num_attention_heads",), head_widths=("all_head_size",), tail=(),
    ),
)

_STRUCTURE = ("front", "blocks", "linears", "tail")
#: Families found from the model, by model object (a model keeps its structure while it lives).
_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def family_of(model: nn.Module, load=None, device="cpu") -> Family:
    """The complete row of ``model``: the table's row where it has one, the structure of a causal LM
    found from the model (:func:`fairprune.causal.structure.discover`; ``load`` and ``device`` as
    there, for a model whose weights are not resident) and, for a family the table does not list,
    the head layout read from its attention module (:func:`generic_heads`). A model that cannot be
    read block by block raises :class:`UserError` saying why."""
    found = _FOUND.get(model)
    if found is not None:
        return found
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    row = next((f for f in FAMILIES if model_type in f.model_types), None)
    if row is not None and all(getattr(row, k) is not None for k in _STRUCTURE):
        return row
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise UserError(f"model type {model_type!r} is not a causal LM (no output head); the LM methods take a "
                        "*ForCausalLM model, and the encoder families are: bert, roberta")
    if load is None and any(p.device.type == "meta" for p in model.parameters()):
        return _merged(row, model, _static(model))  # weights not loaded: the layers by kind, not cached
    family = _merged(row, model, discover(model, load, device))
    _FOUND[model] = family
    return family


def _merged(row: Family | None, model: nn.Module, found: Structure) -> Family:
    row = row or generic_heads(model, found)
    fields = {k: getattr(found, k) for k in _STRUCTURE if getattr(row, k) is None}
    return replace(row, **fields, returns_tuple=found.returns_tuple, mixed=found.mixed)


def _static(model: nn.Module) -> Structure:
    """The blocks and their linear layers without running the model (module order; no front or tail)."""
    path, blocks = find_blocks(model)
    kinds = block_kinds(blocks)
    return Structure(blocks=path, front=(), tail=(), linears=merge_orders([linear_names(blocks[i]) for i in kinds]),
                     returns_tuple=False, mixed=len(kinds) > 1)


def generic_heads(model: nn.Module, found: Structure) -> Family:
    """A row for a family the table does not list: its name, and where its heads are when block 0
    has an attention module with separate ``q_proj`` / ``k_proj`` / ``v_proj`` or one fused
    ``qkv_proj``, and an ``o_proj`` (the transformers naming of Llama's descendants: Qwen, Gemma,
    Phi-3, ...), with the head counts in the config. Otherwise the row has no head layout
    (:meth:`Family.require_heads` says so)."""
    config = model.config
    model_type = str(getattr(config, "model_type", type(model).__name__))
    plain = Family(name=model_type, model_types=(model_type,))
    if not hasattr(config, "num_attention_heads"):
        return plain
    block = _get(_base(model), found.blocks)[0]
    for path, module in block.named_modules():
        children = {n for n, m in module.named_children() if isinstance(m, LINEAR_TYPES)}
        if "o_proj" not in children:
            continue
        qkv = ("q_proj", "k_proj", "v_proj") if {"q_proj", "k_proj", "v_proj"} <= children else \
            ("qkv_proj",) if "qkv_proj" in children else None
        if qkv is None:
            continue
        kv_key = "num_key_value_heads" if getattr(config, "num_key_value_heads", None) else None
        return replace(
            plain, attention=path, attn_out=f"{path}.o_proj" if path else "o_proj", qkv=qkv, kv_heads_key=kv_key,
            # the saved config can state a head count of its own only where it states head_dim apart
            head_dim_key="head_dim" if "head_dim" in config.to_dict() else None,
            head_counts=tuple(a for a in ("num_heads",) if isinstance(getattr(module, a, None), int)),
            head_groups="num_key_value_groups" if hasattr(module, "num_key_value_groups") else None,
            kv_head_counts=tuple(a for a in ("num_key_value_heads",) if isinstance(getattr(module, a, None), int)),
        )
    return plain


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
                "fairprune.causal.families does not match this model"
            )
    return obj
