"""Post-training pruning of causal LMs: magnitude, Wanda, SparseGPT and Debias-SparseGPT.

:func:`prune_causal_lm` is the one entry point of every LM run (:func:`fairprune.runs.lm.prune_run`,
which the commands and the post-training callback run) and of the library. It
validates the request, asks the family table where the prunable layers are, runs the shared
layer-sequential calibration (except for magnitude, which needs no data) and reports the
achieved sparsity: exact zeros over the prunable linear weights of the transformer blocks.

Under ``torch.distributed`` (``torchrun``, see :mod:`fairprune.distributed`) every rank calls these
functions: each calibrates on its share of the calibration batches (of windows, and of pairs), the
statistics are summed across ranks exactly (:class:`~fairprune.distributed.ExactSum`), every rank
solves the same layers from the same statistics, and rank 0's solution is broadcast so all ranks
hold identical weights, those one process reaches; the measurements are sharded the same way.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fairprune import distributed
from fairprune.causal.blocks import as_blocks
from fairprune.causal.experts import fused_experts
from fairprune.causal.families import Family, family_of, linear_weight
from fairprune.errors import UserError
from fairprune.hub.checks import nonfinite
from fairprune.pruning.calibration import PAIR_BATCH, modify, rank_inputs
from fairprune.pruning.masks import Target, achieved_sparsity, sparsity_table
from fairprune.pruning.modifiers import Modifier, from_flags, magnitude_solve, solve_layers  # noqa: F401 (the registry names magnitude_solve here)
from fairprune.pruning.options import SolverOptions
from fairprune.pruning.registry import Method
from fairprune.pruning.sparsity import Sparsity


@dataclass(frozen=True)
class Batching:
    """How calibration data is batched: ``windows`` windows and ``pairs`` aligned pairs make one
    calibration batch (one forward, one statistics term each; :func:`fairprune.pruning.calibration.make_inputs`)."""

    windows: int = 1
    pairs: int = PAIR_BATCH


def prune_causal_lm(
    model,
    method: str,
    sparsity: Sparsity,
    calib_ids: torch.Tensor | None = None,
    pairs: tuple[torch.Tensor, ...] | None = None,
    device: str | torch.device = "cpu",
    solver: SolverOptions = SolverOptions(),
    progress: bool = True,
    writer=None,
    batching: Batching = Batching(),
) -> dict:
    """Prune ``model`` in place and return ``{"layers": {name: sparsity}, "achieved_sparsity",
    "dense_zero_fraction", "seconds", ...}``.

    ``model``: an ``nn.Module`` or a block model (:mod:`fairprune.causal.blocks`: in memory, or
    streamed from its safetensors files with one block resident). ``method``: an ``lm`` method of
    the registry; its entry's ``statistic`` is accumulated over each layer's calibration inputs
    and its ``selection`` solves the layer (a method without a statistic prunes from the weights
    alone). ``sparsity``: :meth:`Sparsity.parse` of a fraction or N:M. ``calib_ids`` [n, seq]:
    calibration token ids (optional extra data for a paired method). ``pairs``: ``(ids0, ids1)``
    or ``(ids0, ids1, mask)`` token-aligned stereotypical / anti-stereotypical batches (paired
    methods only), e.g. from ``fairprune.data.text.paired_ids``. ``solver``: SparseGPT's damping
    and block size. ``batching``: how many windows and pairs make one calibration batch.
    ``writer``: a :class:`~fairprune.hub.shards.ShardWriter` each solved block is written to while
    it is loaded (checked finite first), then every tensor the blocks do not hold; the caller
    closes it.

    Under ``torch.distributed`` every rank passes the same full ``calib_ids`` / ``pairs`` and
    calibrates on its share of the batches; all ranks end with one process's weights.

    Mixture-of-experts blocks: each expert of a fused expert parameter is pruned as a layer of its
    own, from its own inputs (``solver.moe_calibrate``: ``all`` sends every calibration token
    through every expert, ``routed`` gives each expert the tokens its router sends it; a paired
    method needs ``all``). An expert that no calibration token reached (routed) is pruned by
    magnitude, and the result's ``experts`` says which and the tokens each expert saw.
    """
    return prune_with(model, from_flags(method, sparsity, settings={"blocksize": solver.blocksize, "percdamp": solver.percdamp}),
                      calib_ids, pairs, device, solver.moe_calibrate, progress, writer, batching)


def prune_with(model, modifiers: list[Modifier], calib_ids: torch.Tensor | None = None,
               pairs: tuple[torch.Tensor, ...] | None = None, device: str | torch.device = "cpu",
               moe_calibrate: str = "all", progress: bool = True, writer=None,
               batching: Batching = Batching()) -> dict:
    """:func:`prune_causal_lm` with the run's modifiers given (a recipe's, or the flags':
    :mod:`fairprune.pruning.modifiers`): one pruning method, optionally followed by ``quantize``."""
    from fairprune.pruning.modifiers import Quantize
    from fairprune.pruning.recipe import check_recipe

    start = time.perf_counter()
    check_recipe(modifiers, "the run's modifiers")
    prune, method, sparsity = modifiers[0], modifiers[0].name, modifiers[0].sparsity
    entry = prune.entry
    blocks = as_blocks(model)
    family = blocks.family
    _validate(blocks.model, family, entry, sparsity, calib_ids, pairs)
    moe = any(fused_experts(block) for block in blocks.blocks[:1])
    if moe and entry.paired and moe_calibrate != "all":
        raise UserError(f"{method} compares both sides of each pair inside the same expert, so it calibrates with every "
                        f"token through every expert: drop --moe_calibrate {moe_calibrate} (or give all)")
    gptq = next((m for m in modifiers if isinstance(m, Quantize) and m.calibrates), None)
    if gptq is not None and calib_ids is None and pairs is None:
        raise UserError(f"--quantize {gptq.scheme} compensates from the layer Hessian: it needs calibration data "
                        "(calib_ids), also for a method that prunes from the weights alone")
    needing = next((m for m in modifiers[1:] if m.calibrates), None)
    if needing is not None and calib_ids is None and pairs is None:
        raise UserError(f"modifier {needing.name} collects from calibration data: pass calib_ids")

    def solved(index: int, block: nn.Module, layers: dict[str, nn.Module]) -> None:
        if writer is None:
            return
        found = nonfinite(block)
        if found is not None:
            raise UserError(f"pruning with {method} produced a broken model: parameter {blocks.prefix(block)}{found[0]} "
                            f"holds {found[1]} (the input model was finite); nothing was written (try another method, "
                            "sparsity or calibration set)")
        planned = set(writer.missing())
        writer.write_many((name, t) for name, t in blocks.state_of(block) if name in planned)

    calibrated = any(m.calibrates for m in modifiers)
    inputs = rank_inputs(calib_ids, pairs, batching.windows, batching.pairs) if calibrated else None  # this rank's share
    tokens = modify(blocks, inputs, device, modifiers, progress and distributed.is_main(), desc=method, after=solved,
                    moe_calibrate=moe_calibrate)
    if writer is not None:
        for name in writer.missing():  # the front, the final norm, the head: as they are
            writer.write(name, blocks.read_output(name))
    done = prune.facts()
    return {
        "method": method,
        "family": family.name,
        "target_sparsity": float(sparsity.fraction),
        "nm": str(sparsity) if sparsity.nm else None,
        "achieved_sparsity": done["achieved_sparsity"],
        "dense_zero_fraction": done["dense_zero_fraction"],
        "layers": done["layers"],
        "seconds": {"solve": done["solve"], "total": time.perf_counter() - start},
        **({"experts": _expert_facts(tokens, moe_calibrate if calibrated else None)} if moe else {}),
    }


def _expert_facts(tokens: dict, mode: str | None) -> dict[str, Any]:
    """A mixture-of-experts run's ``experts`` facts: how experts were calibrated, the tokens the
    router sent each expert and those each was calibrated on, and the experts pruned by magnitude
    for want of any token."""
    fallback = [f"{param}.{e}" for param, counts in tokens["calibrated"].items() for e, c in enumerate(counts) if c == 0]
    return {"calibrate": mode, "routed_tokens": tokens["routed"], "calibrated_tokens": tokens["calibrated"],
            "magnitude_fallback": fallback}


def block_targets(model: nn.Module, family: Family) -> list[Target]:
    """The prunable layers of every block, named ``"<block>.<path>"``."""
    return [
        Target(f"{index}.{name}", layer)
        for index, block in enumerate(family.block_list(model))
        for name, layer in family.block_linears(block).items()
    ]


def sparsity_by_layer(model: nn.Module, family: Family) -> dict[str, float]:
    """Share of exact zeros per prunable block layer, plus ``"__total__"`` over all of them."""
    targets = block_targets(model, family)
    out = {row["layer"]: row["sparsity"] for row in sparsity_table(targets)}
    out["__total__"] = achieved_sparsity(targets)
    return out


def check_pattern_fits(model: nn.Module, sparsity: Sparsity) -> None:
    """Raise a :class:`UserError` unless ``sparsity`` can be applied to ``model``: its family is
    known and an N:M pattern's M divides the input width of every prunable layer (fractions always
    fit). Cheap (shapes only): call it right after loading, before the dense model is measured."""
    family = family_of(model)
    if sparsity.nm is not None:
        _check_nm_widths(model, family, sparsity.nm)


def _check_nm_widths(model: nn.Module, family: Family, nm: tuple[int, int]) -> None:
    """N:M groups M consecutive inputs of each row: M must divide every prunable layer's input width."""
    n, m = nm
    widths: dict[int, str] = {}  # input width → the first layer that has it
    for index, block in enumerate(family.block_list(model)):
        for name, layer in family.block_units(block).items():
            widths.setdefault(int(linear_weight(layer).shape[1]), f"{index}.{name}")
    bad = [w for w in widths if w % m]
    if bad:
        common = math.gcd(*widths)
        fits = [f"{k // 2}:{k}" for k in (4, 8, 16) if common % k == 0]
        hint = f", e.g. {' or '.join(fits)}" if fits else ""
        raise UserError(f"N:M sparsity {n}:{m}: M={m} does not divide the input width {bad[0]} of layer {widths[bad[0]]} "
                        f"(this model's prunable widths: {', '.join(map(str, sorted(widths)))}); pick an M that divides "
                        f"them all{hint}, or give a fraction such as 0.5")


def _validate(model, family, entry: Method, sparsity: Sparsity, calib_ids, pairs) -> None:
    """Reject bad requests before any work is done, with one-line fixes (the sparsity was parsed
    where it entered; here only whether it fits this model's widths)."""
    if not isinstance(sparsity, Sparsity):
        raise TypeError(f"sparsity must be a Sparsity (Sparsity.parse({sparsity!r})), got {type(sparsity).__name__}")
    if sparsity.nm is not None:
        _check_nm_widths(model, family, sparsity.nm)
    _check_float_weights(model, family)
    method = entry.name
    if pairs is not None and not entry.paired:
        raise UserError(f"paired data is used only by the paired methods (debias-sparsegpt), not {method}; drop the pairs or switch method")
    if entry.uses_data and not entry.paired and calib_ids is None:
        raise UserError(f"{method} needs calibration data: pass calib_ids [n, seqlen] (see fairprune.data.text.calibration_ids)")
    if entry.paired and pairs is None:
        raise UserError(f"{method} needs paired data: pass pairs=(ids0, ids1) (see fairprune.data.text.paired_ids)")
    vocab = model.get_input_embeddings().num_embeddings
    for ids in ([calib_ids] if calib_ids is not None else []) + list(pairs[:2] if pairs is not None else []):
        _check_ids(ids, vocab)
    if pairs is not None and pairs[0].shape != pairs[1].shape:
        raise UserError(
            f"pair sides must align token-wise, got shapes {tuple(pairs[0].shape)} and {tuple(pairs[1].shape)}; "
            "pad or truncate both sides to the same length (fairprune.data.text.paired_ids does)"
        )


def _check_float_weights(model, family) -> None:
    """Only float weights are pruned: an integer (quantized) weight would be pruned as if its
    integers were values."""
    names = {id(m): n for n, m in model.named_modules()}
    for block in family.block_list(model):
        for path, layer in family.block_units(block).items():
            if not layer.weight.is_floating_point():
                raise UserError(f"weight {names.get(id(layer), path)}.weight is {layer.weight.dtype}, not floating point: only "
                                "float weights can be pruned (a quantized model cannot); give the model in float16, "
                                "bfloat16 or float32")


def _check_ids(ids: torch.Tensor, vocab: int) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.long, torch.int):
        raise UserError("calibration ids must be an integer tensor [n, seqlen]; tokenize the text first")
    if ids.numel() and (int(ids.max()) >= vocab or int(ids.min()) < 0):
        raise UserError(f"token id {int(ids.max())} outside the model vocabulary ({vocab}); use the model's own tokenizer")
