"""How much smaller head removal made a model: parameters and attention FLOPs per token, before
and after, counted honestly.

:func:`~fairprune.pruning.heads.remove_heads` cuts heads out of the tensors where the family's
config and the attention layout can describe the result, and zeroes them in place where they
cannot: with ``loadable=True``, GPT-2, GPT-Neo, OPT and BERT configs hold one head count and derive
``head_dim`` from it, and Llama / Mistral configs hold one head count for every layer (layers are
padded to the largest count still needed); under grouped-query attention every key/value group of
a layer must serve as many query heads as the others, also with ``loadable=False``. A zeroed head
still occupies its tensors: it costs memory and, run as is, compute. So every figure comes twice:

* **stored** — what the tensors hold: parameters are ``sum(p.numel())`` over the model's (unique)
  parameters; zeroed heads count as present;
* **effective** — zeroed heads left out: stored parameters minus the zeroed heads' weights (a zeroed
  query head's q rows, q bias and output-projection columns; a zeroed key/value head's k and v rows
  and biases), FLOPs of the heads that still compute something.

Attention FLOPs per token of one layer (multiply and add counted as 2 FLOPs, biases, softmax and
rotary embeddings left out), for a token attending to ``context`` positions:

    2·(q_in·n_q·d_h + 2·kv_in·n_kv·d_h + n_q·d_h·o_out)     # q, k, v and output projections
    + 2·n_q·d_h·context + 2·n_q·d_h·context                  # scores Q·Kᵀ and the weighted sum A·V

with ``n_q`` / ``n_kv`` the query / key-value heads of the layer, ``d_h`` the head width and
``q_in``, ``kv_in``, ``o_out`` the projections' outer widths (the hidden size). The model's figure is
the sum over layers; ``context`` is the scoring window (``--seqlen``), an upper bound for the
tokens of a causal window.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from fairprune.causal.families import family_of, linear_weight
from fairprune.pruning.heads import HeadRemoval


@dataclass(frozen=True)
class LayerHeads:
    """The attention shape of one layer as its tensors hold it."""

    heads: int  # query heads in the tensors (zeroed ones included)
    kv_heads: int  # key/value heads in the tensors
    zeroed: int = 0  # query heads in the tensors whose weights are zeroed
    kv_zeroed: int = 0  # key/value heads in the tensors whose weights are zeroed
    q_params: int = 0  # parameters of one query head: its q rows, q bias and output-projection columns
    kv_params: int = 0  # parameters of one key/value head: its k and v rows and biases
    flops_fixed: int = 0  # per-token FLOPs of the layer's projections, per query head (q + o) ...
    flops_kv: int = 0  # ... and per key/value head (k + v)
    flops_per_context: int = 0  # score and value FLOPs per query head and attended position


@dataclass
class ModelSize:
    """Parameters and per-token attention FLOPs of a model, stored and effective."""

    context: int
    parameters: int
    effective_parameters: int
    attention_flops: int
    effective_attention_flops: int
    layers: list[LayerHeads] = field(default_factory=list)


def measure(model: nn.Module, context: int, removal: HeadRemoval | None = None) -> ModelSize:
    """The model's size as it stands; heads listed as zeroed in ``removal`` count as stored, not effective."""
    family = family_of(model)
    head_dim = family.head_dim(model.config)
    layers, params, effective, flops, effective_flops = [], 0, 0, 0, 0
    zeroed = _per_layer(removal.zeroed if removal else [])
    kv_zeroed = _per_layer(removal.kv_zeroed if removal else [])
    for index, block in enumerate(family.block_list(model)):
        out = linear_weight(family.attention_out(block))  # [o_out, n_q·d_h]
        projections = family.qkv_layers(block)
        n_q = out.shape[1] // head_dim
        q_bias = _has_bias(projections[0])
        if len(projections) == 1:  # fused [q | k | v]
            fused = linear_weight(projections[0])
            n_kv = (fused.shape[0] - n_q * head_dim) // (2 * head_dim)
            q_in = kv_in = fused.shape[1]
            kv_bias = q_bias
        else:
            q, k, _ = (linear_weight(p) for p in projections)
            n_kv, q_in, kv_in = k.shape[0] // head_dim, q.shape[1], k.shape[1]
            kv_bias = _has_bias(projections[1])
        layer = LayerHeads(
            heads=n_q, kv_heads=n_kv, zeroed=zeroed.get(index, 0), kv_zeroed=kv_zeroed.get(index, 0),
            q_params=head_dim * (q_in + q_bias + out.shape[0]), kv_params=2 * head_dim * (kv_in + kv_bias),
            flops_fixed=2 * head_dim * (q_in + out.shape[0]), flops_kv=2 * 2 * head_dim * kv_in,
            flops_per_context=2 * 2 * head_dim,
        )
        layers.append(layer)
        per_q = layer.flops_fixed + layer.flops_per_context * context
        flops += n_q * per_q + n_kv * layer.flops_kv
        effective_flops += (n_q - layer.zeroed) * per_q + (n_kv - layer.kv_zeroed) * layer.flops_kv
        effective += layer.zeroed * layer.q_params + layer.kv_zeroed * layer.kv_params
    params = sum(p.numel() for p in model.parameters())
    return ModelSize(context, params, params - effective, flops, effective_flops, layers)


def size_report(before: ModelSize, after: ModelSize, family_name: str, shrinkable: bool, loadable: bool,
                element_size: int = 4) -> dict:
    """The ``size`` section of ``report.json``: totals before / stored / effective, per-layer head
    counts with the parameters and bytes physically cut out of that layer's tensors (heads zeroed
    in place count 0: their tensors keep their size), and a one-line note when removed heads were
    zeroed rather than cut out. ``element_size``: bytes per stored parameter."""
    layers = []
    for index, (old, new) in enumerate(zip(before.layers, after.layers)):
        cut = (old.heads - new.heads) * old.q_params + (old.kv_heads - new.kv_heads) * old.kv_params
        layers.append({"layer": index, "heads_kept": new.heads - new.zeroed, "heads_removed": old.heads - new.heads,
                       "heads_zeroed": new.zeroed, "kv_heads_kept": new.kv_heads - new.kv_zeroed,
                       "kv_heads_removed": old.kv_heads - new.kv_heads, "kv_heads_zeroed": new.kv_zeroed,
                       "parameters_removed": cut, "bytes_removed": cut * element_size})
    zeroed = sum(layer["heads_zeroed"] for layer in layers)
    note = None
    if zeroed:
        pruned = zeroed + sum(layer["heads_removed"] for layer in layers)
        reasons = []
        if loadable:
            reasons.append(f"a {family_name} config holds one head count for all layers" if shrinkable else
                           f"a {family_name} config holds one head count and derives the head width from it")
        if any(layer.kv_heads < layer.heads for layer in before.layers):
            reasons.append("grouped-query attention needs as many query heads in every key/value group of a layer")
        note = (f"{zeroed} of {pruned} pruned heads were zeroed in place, not cut out ({'; '.join(reasons)}): "
                f"stored parameters {before.parameters:,} → {after.parameters:,}, effective {after.effective_parameters:,}"
                + ("; loadable=False cuts out what the tensors allow, but from_pretrained cannot rebuild that model"
                   if loadable else ""))
    return {
        "context": after.context,
        "parameters": {"before": before.parameters, "stored": after.parameters, "effective": after.effective_parameters},
        "attention_flops_per_token": {"before": before.attention_flops, "stored": after.attention_flops,
                                      "effective": after.effective_attention_flops},
        "layers": layers,
        "note": note,
    }


def removal_size(before: ModelSize, model: nn.Module, removal: HeadRemoval, loadable: bool = True) -> dict:
    """:func:`size_report` for ``model`` after ``remove_heads(..., loadable=loadable)``, given its size ``before``."""
    family = family_of(model)
    return size_report(before, measure(model, before.context, removal), family.name, family.heads_shrinkable, loadable,
                       next(model.parameters()).element_size())


@torch.no_grad()
def tokens_per_second(model: nn.Module, ids: torch.Tensor, seqlen: int, repeats: int = 3) -> float:
    """Measured forward throughput: tokens of one ``seqlen`` window of ``ids`` (batch 1, no cache)
    per second, the median of ``repeats`` timings after one untimed forward, on torch's threads."""
    window = ids.reshape(-1)[:seqlen].reshape(1, -1).to(next(model.parameters()).device)
    was_training = model.training
    model.eval()
    model(input_ids=window, use_cache=False)
    timings = []
    for _ in range(repeats):
        tick = time.perf_counter()
        model(input_ids=window, use_cache=False)
        timings.append(time.perf_counter() - tick)
    model.train(was_training)
    return window.numel() / statistics.median(timings)


def summary(size: dict) -> str:
    """One line for the console: parameters and attention FLOPs, stored and effective."""
    p, f = size["parameters"], size["attention_flops_per_token"]
    return (f"parameters {p['before']:,} → {p['stored']:,} stored ({p['effective']:,} effective); attention "
            f"FLOPs/token at context {size['context']}: {f['before']:,} → {f['stored']:,} ({f['effective']:,} effective)")


def _per_layer(heads) -> dict[int, int]:
    counts: dict[int, int] = {}
    for layer, _ in heads:
        counts[layer] = counts.get(layer, 0) + 1
    return counts


def _has_bias(layer: nn.Module) -> int:
    return int(getattr(layer, "bias", None) is not None)
