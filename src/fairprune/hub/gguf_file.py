"""A causal LM (pruned or dense) as a GGUF file, the format llama.cpp and Ollama load.

The file follows llama.cpp's ``convert_hf_to_gguf.py`` for the families in :data:`FAMILIES` (Gemma 2 / 3:
every norm stored as ``1 + w``; Phi-3: fused ``qkv_proj`` / ``gate_up_proj`` as they are):

- tensors renamed by the ``gguf`` package's own map (``blk.N.attn_q.weight``, ``token_embd.weight``,
  ...); the LM head is left out when it is tied to the embedding (llama.cpp reads a missing
  ``output.weight`` as tied);
- Llama-style models (llama, mistral) have their ``q_proj`` / ``k_proj`` rows permuted as
  ``LlamaModel.permute`` does (rotary pairs interleaved; transformers' reader undoes it), Qwen2 and
  Qwen3 not (Qwen3's query / key norms are plain tensors of the map);
- metadata under llama.cpp's keys (context, widths, heads, rope base, norm epsilon, file type;
  Gemma's head width, soft-capping and sliding window), and the tokenizer (:func:`tokenizer_fields`):
  byte-level BPE or SentencePiece BPE, the vocabulary padded to the model's vocabulary with
  ``[PADn]`` tokens, merges, token types (control for special added tokens, user-defined for the
  other added ones, byte for ``<0xXX>`` pieces), SentencePiece scores, the pre-tokenizer's llama.cpp
  name, BOS / EOS / UNK / PAD ids, whether BOS / EOS are added, and the chat template;
- 1-D tensors (norms, biases) in F32; every 2-D tensor in the chosen type (``f16``, ``q8_0``,
  ``q4_0``), rounded by ``gguf.quants`` (the reference implementation of ggml's rounding), except
  that ``q4_0`` keeps the embedding and the LM head in Q8_0 (llama.cpp's quantizer keeps them
  above 4 bits too; ``gguf.quants`` cannot write its Q6_K) and a row whose length is no multiple of
  the block size falls back to F16, as convert_hf_to_gguf does.

All three types keep an exact zero exact: F16 stores it, Q8_0 rounds it to the integer 0, Q4_0 to
the code 8, which is 0 after its offset of -8. :func:`write_gguf` returns, beside the facts of the
file, every tensor as the file holds it, dequantized and in transformers' layout: the source model
with its weights rounded to the format, which the loaded-back model must match.

Mistral is written as llama.cpp writes it, as architecture ``llama``: transformers' reader gives
it back as a Llama model, the same computation up to Mistral's sliding window (which llama.cpp does
not apply either; the report notes a window shorter than the context).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from fairprune.errors import UserError
from fairprune.hub.gguf_tokenizer import add_tokenizer, tokenizer_fields

#: ``--gguf_type`` (:data:`fairprune.hub.formats.GGUF_TYPES`): the ggml type of the 2-D tensors and
#: its nominal bits per weight.
GGML_TYPES = {"f16": ("F16", 16), "q8_0": ("Q8_0", 8), "q4_0": ("Q4_0", 4)}
#: The ``general.file_type`` of each ``--gguf_type`` (``gguf.LlamaFileType``).
FILE_TYPES = {"f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0"}


@dataclass(frozen=True)
class GGUFFamily:
    """How one transformers ``model_type`` is written: llama.cpp's architecture name, whether the
    query / key rows are permuted (convert_hf_to_gguf's ``LlamaModel``), and whether the vocabulary
    size and rotary width are written (keys llama.cpp's llama architecture reads)."""

    arch: str
    permute_qk: bool
    llama_keys: bool = False
    #: Gemma's norms compute ``x * (1 + w)``; llama.cpp's file holds ``1 + w`` (convert_hf_to_gguf's
    #: ``Gemma2Model`` / ``Gemma3Model`` add 1 to every ``*norm.weight``, transformers' reader takes it off).
    norm_plus_one: bool = False
    #: the head width always written (``attention.key_length`` / ``value_length``): Gemma's reader
    #: otherwise takes its config's default of 256.
    head_dim_keys: bool = False


FAMILIES = {
    "llama": GGUFFamily("llama", permute_qk=True, llama_keys=True),
    "mistral": GGUFFamily("llama", permute_qk=True, llama_keys=True),
    "qwen2": GGUFFamily("qwen2", permute_qk=False),
    "qwen3": GGUFFamily("qwen3", permute_qk=False),
    "qwen3_moe": GGUFFamily("qwen3moe", permute_qk=False),
    "gemma2": GGUFFamily("gemma2", permute_qk=False, norm_plus_one=True, head_dim_keys=True),
    "gemma3_text": GGUFFamily("gemma3", permute_qk=False, norm_plus_one=True, head_dim_keys=True),
    "phi3": GGUFFamily("phi3", permute_qk=False),
}



class Written(NamedTuple):
    """What :func:`write_gguf` wrote: the file's facts and each tensor as the file holds it."""

    facts: dict[str, Any]
    rounded: dict[str, torch.Tensor]


def family_for(model: nn.Module) -> GGUFFamily:
    """The row of ``model``'s family, or a one-line error naming the families that can be exported."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise UserError(f"--format gguf: model family {model_type!r} cannot be exported; supported: "
                        f"{', '.join(FAMILIES)} (those transformers' GGUF reader reads back)")
    return FAMILIES[model_type]


def check_gguf_type(gguf_type: str) -> None:
    if gguf_type not in GGML_TYPES:
        raise UserError(f"--gguf_type {gguf_type!r} is not one of {', '.join(GGML_TYPES)}")


def rope_bases(config: Any) -> dict[str, float]:
    """The rotary bases of ``config`` by attention kind (``default``, or Gemma 3's ``full_attention``
    and ``sliding_attention``); rope scaling (llama3, yarn, linear, ...) and a partial rotary width
    are refused in one line, since transformers' GGUF reader reads the bases only."""
    params = getattr(config, "rope_parameters", None) or {}
    nested = {kind: value for kind, value in params.items() if isinstance(value, dict)}
    bases = {}
    for kind, one in (nested or {"default": params}).items():
        scaling = one.get("rope_type", "default")
        if scaling != "default":
            raise UserError(f"--format gguf: rope scaling {scaling!r} cannot be exported (transformers' GGUF reader "
                            "reads the rope base only); export a model with plain rotary embeddings")
        if float(one.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UserError("--format gguf: a partial rotary width (partial_rotary_factor) cannot be exported; "
                            "transformers' GGUF reader rotates the whole head")
        theta = one.get("rope_theta", getattr(config, "rope_theta", None))
        if theta is None:
            raise UserError("--format gguf: the model's config states no rope_theta")
        bases[kind] = float(theta)
    return bases


def rope_theta(config: Any) -> float:
    """The rotary base llama.cpp's ``rope.freq_base`` holds: the full-attention layers' where the
    model has two (:func:`rope_bases`)."""
    bases = rope_bases(config)
    return bases.get("full_attention", bases.get("default", next(iter(bases.values()))))


def check_llama_cpp(config: Any, family: GGUFFamily) -> None:
    """Settings llama.cpp computes otherwise than transformers for this family, refused in one line:
    Gemma's query scale (llama.cpp divides by the square root of the head width, transformers by
    that of ``query_pre_attn_scalar``). Settings transformers' reader would lose are refused after
    the read-back (:func:`fairprune.workflows.export.config_differences`)."""
    if family.norm_plus_one:
        scalar = getattr(config, "query_pre_attn_scalar", None)
        if scalar is not None and int(scalar) != head_dim(config):
            raise UserError(f"--format gguf: this {config.model_type} model scales its queries by "
                            f"query_pre_attn_scalar {scalar}, not its head width {head_dim(config)} as llama.cpp does; "
                            "the file would compute another model")


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf's ``LlamaModel.permute``: within each head, the two rotary halves
    interleaved (llama.cpp rotates adjacent pairs, transformers the two halves)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def unpermute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """The inverse of :func:`permute`."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


# -- the model -------------------------------------------------------------------------------------
def _add_hyperparameters(writer: Any, model: nn.Module, family: GGUFFamily, gguf_type: str) -> None:
    import gguf

    config = model.config
    writer.add_type("model")
    writer.add_name(model_name(config))
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(config.num_attention_heads))
    writer.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads))
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    if family.head_dim_keys or head_dim(config) != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim(config))
        writer.add_value_length(head_dim(config))
    bases = rope_bases(config)
    if "sliding_attention" in bases:  # Gemma 3's local layers
        writer.add_rope_freq_base_swa(bases["sliding_attention"])
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(int(config.sliding_window))
    for key, add in (("attn_logit_softcapping", writer.add_attn_logit_softcapping),
                     ("final_logit_softcapping", writer.add_final_logit_softcapping)):
        if getattr(config, key, None) is not None:  # Gemma 2
            add(float(getattr(config, key)))
    if family.arch == "phi3":
        writer.add_rope_dimension_count(head_dim(config))
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:  # mixture of experts: as convert_hf_to_gguf writes them
        if getattr(config, "mlp_only_layers", None) or int(getattr(config, "decoder_sparse_step", 1) or 1) != 1:
            raise UserError("--format gguf: this model mixes dense and mixture-of-experts layers "
                            "(mlp_only_layers / decoder_sparse_step), which llama.cpp's file does not hold")
        if getattr(config, "norm_topk_prob", True) is False:
            raise UserError("--format gguf: this model does not renormalise its top-k expert weights "
                            "(norm_topk_prob false); llama.cpp's file and transformers' reader both do, so the file "
                            "would compute another model")
        writer.add_expert_count(int(experts))
        writer.add_expert_used_count(int(config.num_experts_per_tok))
        writer.add_expert_feed_forward_length(int(config.moe_intermediate_size))
    if family.llama_keys:
        writer.add_vocab_size(int(config.vocab_size))
        writer.add_rope_dimension_count(head_dim(config))
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[gguf_type]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def model_name(config: Any) -> str:
    """``general.name``: the last part of the model's name or folder, else its family. Never exactly
    ``mistral``: transformers' reader takes a ``llama`` file of that name for a Mistral one and then
    fails (the ``gguf`` package has no Mistral tensor map)."""
    name = str(getattr(config, "_name_or_path", "") or config.model_type).rstrip("/").split("/")[-1]
    return f"{name}-model" if name == "mistral" else name


def _tensors(model: nn.Module, family: GGUFFamily) -> list[tuple[str, str, torch.Tensor]]:
    """``(gguf name, transformers name, tensor)`` of every tensor the file holds, in state-dict
    order; a tied LM head is left out."""
    import gguf

    config = model.config
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == family.arch)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    found = []
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        if tensor.dim() == 3 and hf_name.endswith(".gate_up_proj"):  # fused [gate; up] experts: two tensors in the file
            half = tensor.shape[1] // 2
            for part, start in (("gate_proj", 0), ("up_proj", half)):
                name = names.get_name(f"{hf_name.rsplit('.', 1)[0]}.{part}")
                if name is None:
                    raise UserError(f"--format gguf: tensor {hf_name} of this {config.model_type} model has no llama.cpp "
                                    "name; it cannot be exported")
                found.append((f"{name}.weight", hf_name, Part(tensor, 1, start, half)))
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise UserError(f"--format gguf: tensor {hf_name} of this {config.model_type} model has no llama.cpp name; "
                            "it cannot be exported")
        found.append((f"{name}.weight" if tensor.dim() == 3 and not name.endswith(".weight") else name, hf_name, tensor))
    return found


class Part(NamedTuple):
    """A slice of a transformers tensor written as a tensor of its own (fused experts' gate or up
    half): ``whole`` narrowed along ``dim`` from ``start`` for ``length``."""

    whole: torch.Tensor
    dim: int
    start: int
    length: int

    @property
    def shape(self) -> torch.Size:
        return self.whole.narrow(self.dim, self.start, self.length).shape

    def detach(self) -> torch.Tensor:
        return self.whole.detach().narrow(self.dim, self.start, self.length)


def tensor_type(name: str, shape: tuple[int, ...], gguf_type: str) -> Any:
    """The ggml type a tensor of ``shape`` named ``name`` is stored in (see the module's rules)."""
    import gguf

    types = gguf.GGMLQuantizationType
    if len(shape) < 2:
        return types.F32
    chosen = getattr(types, GGML_TYPES[gguf_type][0])
    if gguf_type == "q4_0" and name in ("token_embd.weight", "output.weight"):
        chosen = types.Q8_0
    block, _ = gguf.GGML_QUANT_SIZES[chosen]
    return chosen if shape[-1] % block == 0 else types.F16


def _qk_heads(gguf_name: str, config: Any) -> tuple[int, int | None] | None:
    """The head counts ``permute`` takes for a query or key tensor, None for any other tensor."""
    heads = int(config.num_attention_heads)
    if ".attn_q." in gguf_name:
        return heads, heads
    if ".attn_k." in gguf_name:
        return heads, int(getattr(config, "num_key_value_heads", None) or heads)
    return None


class _Plan(NamedTuple):
    gguf_name: str
    hf_name: str
    tensor: torch.Tensor
    qtype: Any
    heads: tuple[int, int | None] | None


def _nbytes(shape: tuple[int, ...], qtype: Any) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    numel = 1
    for n in shape:
        numel *= n
    return numel // block * size


def write_gguf(model: nn.Module, tokenizer: Any, path: str | os.PathLike, gguf_type: str = "f16",
               progress: bool = True) -> Written:
    """Write ``model`` and ``tokenizer`` to ``path`` as a GGUF file of ``gguf_type``, one tensor in
    memory at a time (the header and tensor table first, then each tensor rounded and written);
    returns the file's facts and each tensor as the file holds it (:class:`Written`)."""
    import gguf
    from tqdm.auto import tqdm

    check_gguf_type(gguf_type)
    family = family_for(model)
    config = model.config
    rope_theta(config)  # rope scaling refused before anything is written
    check_llama_cpp(config, family)
    fields = tokenizer_fields(tokenizer, int(config.vocab_size))
    plans = []
    for gguf_name, hf_name, tensor in _tensors(model, family):
        heads = _qk_heads(gguf_name, config) if family.permute_qk else None
        plans.append(_Plan(gguf_name, hf_name, tensor, tensor_type(gguf_name, tuple(tensor.shape), gguf_type), heads))
    writer = gguf.GGUFWriter(str(path), family.arch)
    try:
        _add_hyperparameters(writer, model, family, gguf_type)
        add_tokenizer(writer, fields)
        for plan in plans:
            shape = tuple(plan.tensor.shape)
            writer.add_tensor_info(plan.gguf_name, shape, np.dtype(np.float32), _nbytes(shape, plan.qtype), raw_dtype=plan.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rounded, counts = {}, {}
        for plan in tqdm(plans, desc=f"gguf {gguf_type}", unit="tensor", leave=False, disable=not progress):
            data = plan.tensor.detach().to("cpu", torch.float32).numpy()
            if plan.heads is not None:
                data = permute(data, *plan.heads)
            plus_one = family.norm_plus_one and plan.gguf_name.endswith("norm.weight")
            if plus_one:
                data = data + np.float32(1)
            stored = gguf.quants.quantize(data, plan.qtype)
            writer.write_tensor_data(stored)
            back = gguf.quants.dequantize(stored, plan.qtype).reshape(data.shape)
            if plus_one:  # as transformers' reader takes it off
                back = back - np.float32(1)
            if plan.heads is not None:
                back = unpermute(back, *plan.heads)
            back = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32))
            if isinstance(plan.tensor, Part):  # its slice of the transformers tensor
                whole = rounded.setdefault(plan.hf_name, torch.empty(plan.tensor.whole.shape, dtype=torch.float32))
                whole.narrow(plan.tensor.dim, plan.tensor.start, plan.tensor.length).copy_(back)
            else:
                rounded[plan.hf_name] = back
            counts[plan.qtype.name] = counts.get(plan.qtype.name, 0) + 1
    finally:
        writer.close()
    facts = {"architecture": family.arch, "gguf_type": gguf_type, "tensors": len(plans),
             "tensor_types": dict(sorted(counts.items())), "tokenizer_model": fields["model"], "tokenizer_pre": fields["pre"],
             "vocab_size": len(fields["tokens"]), "chat_template": fields["chat_template"] is not None}
    return Written(facts, rounded)


def rounded_copy(model: nn.Module, rounded: dict[str, torch.Tensor]) -> nn.Module:
    """A float32 copy of ``model`` whose tensors are ``rounded`` (the file's values): the source
    as the format holds it."""
    import copy

    reference = copy.deepcopy(model).to(torch.float32)
    state = reference.state_dict()
    with torch.no_grad():
        for name, value in rounded.items():
            state[name].copy_(value)
    return reference.eval()


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any]:
    """The model and tokenizer of a GGUF file as transformers' own reader builds them
    (``from_pretrained(folder, gguf_file=name)``)."""
    import warnings
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    where = dict(pretrained_model_name_or_path=str(path.parent.resolve()), gguf_file=path.name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(**where)
    return model, tokenizer
