"""Modifiers: what a post-training run changes in each block, in the order a recipe gives.

A run of the LM weight pipeline is an ordered list of modifiers (:func:`fairprune.pruning.recipe.read_recipe`
reads one from ``--recipe FILE``; the command-line flags build the same list,
:func:`from_flags`). The block pass (:func:`fairprune.pruning.calibration.modify`, one
:func:`fairprune.causal.pipeline.run`) asks each modifier, for every prunable unit of a block
(a linear layer, or one expert of a fused expert parameter), what it **collects**
(:meth:`Modifier.statistic`: a calibration statistic fed with the unit's inputs, or None), runs the
block's calibration batches once for all of them, then lets each modifier **change** each unit in
turn (:meth:`Modifier.apply`). Every modifier of a block collects from the inputs the block had
before any change, so the order of the modifiers is the order of their changes, and a later one
works on what the earlier ones left (GPTQ rounds the pruned weights, the mask held fixed).

A modifier that needs the layer Hessian takes the one an earlier modifier collects when that
one's statistic is a Hessian (:attr:`Modifier.hessian`: SparseGPT's, Debias-SparseGPT's paired
one), so a Hessian is accumulated and held once per layer.

Registered modifiers (:data:`MODIFIERS`): every LM pruning method of the registry (``magnitude``,
``wanda``, ``sparsegpt``, ``debias-sparsegpt``: :class:`Prune`) and ``quantize``
(:class:`Quantize`: GPTQ inside the pass, or round-to-nearest when the folder is written).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from fairprune import distributed
from fairprune.causal.families import linear_weight, set_linear_weight
from fairprune.errors import UserError
from fairprune.pruning.masks import Target, sparsity_table
from fairprune.pruning.select import magnitude, n_m, top_k
from fairprune.pruning.sparsity import Sparsity


def solve_layers(entry: Any, layers: list[nn.Module], stat, sparsity: Sparsity, settings: dict) -> None:
    """Prune ``layers`` in place from their statistic (None for a weights-only method); several
    layers read one input and share it (a Llama block's q, k and v projections). Where the method's
    solve takes ``segments`` (SparseGPT's), they are solved as one, their weights stacked by rows,
    each keeping its own quota: each layer's own solve exactly, one inverse Hessian for all; else
    one after another. The value is taken and the statistic let go before the solve, so its sums
    are gone when the solver's buffers come (pass it straight from its container, holding no other
    reference). Collective under ``torchrun``: every rank solved from the same reduced statistics;
    rank 0's result makes them identical."""
    if len(layers) > 1 and not (stat is not None and entry.hessian and entry.select_takes("segments")):
        for layer in layers:
            solve_layers(entry, [layer], stat, sparsity, settings)
        return
    weights = [linear_weight(layer) for layer in layers]
    if stat is None and entry.statistic is not None:  # an expert no calibration token reached
        W = magnitude_solve(weights[0], None, sparsity)
    else:
        value = None if stat is None else stat.value()
        stat = None
        stacked = {"segments": [len(w) for w in weights]} if len(weights) > 1 else {}
        W = entry.select(torch.cat(weights) if stacked else weights[0], value, sparsity, **stacked, **settings)
    W = distributed.broadcast(W.contiguous())
    for layer, part in zip(layers, W.split([len(w) for w in weights])):
        set_linear_weight(layer, part)


def magnitude_solve(W: torch.Tensor, _: None, sparsity: Sparsity, **__) -> torch.Tensor:
    """Magnitude pruning of one layer: the lowest ``|W|``, ``floor(fraction·numel)`` layer-wide,
    or N of every M consecutive input columns of each row."""
    score = magnitude(W)
    keep = n_m(score, *sparsity.nm) if sparsity.nm else top_k(score, W.numel() - int(W.numel() * sparsity.fraction))
    return W.masked_fill(~keep, 0)


class Modifier:
    """The interface of a modifier (see the module docstring)."""

    #: the name a recipe gives it
    name = "modifier"
    #: its statistic's value is the unit's Hessian: a later modifier needing one takes it
    hessian = False
    #: it collects from calibration data (the run then needs calibration windows or pairs)
    calibrates = False

    def begin(self, blocks) -> None:
        """Before the pass (and before the block model's writer opens): checks that refuse in one
        line, and what the block model is told. Called again for the same model, it does nothing."""

    def statistic(self, name: str, unit: nn.Module, held: list[tuple[Modifier, Any]], device) -> Any:
        """What it collects for ``unit`` (an object with ``add_batch(x, mask)`` / ``add_pair(x0, x1,
        mask)`` and ``value()``), None for nothing; ``held``: the statistics the modifiers before it
        collect for this unit."""
        return None

    def apply(self, name: str, unit: nn.Module, stat: Any) -> None:
        """Change ``unit`` (named ``"<block>.<path>"``) in place from its statistic (None: it
        collected none, or no calibration token reached the unit)."""

    def apply_shared(self, units: list[tuple[str, nn.Module]], stat: Any) -> None:
        """Change ``units`` ((name, unit) pairs that read one input and so share ``stat``): by
        default each as :meth:`apply` does."""
        for name, unit in units:
            self.apply(name, unit, stat)

    def facts(self) -> dict[str, Any]:
        """What it did, for the run's result."""
        return {}


class Prune(Modifier):
    """A pruning method of the registry (``magnitude``, ``wanda``, ``sparsegpt``,
    ``debias-sparsegpt``) at ``sparsity``: its statistic from each unit's inputs, its selection
    solving the unit; the zeros before and after counted per unit."""

    def __init__(self, method: str, sparsity: Sparsity, settings: dict[str, Any] | None = None):
        from fairprune.pruning import registry

        self.entry = registry.get(method, "lm")
        self.name, self.sparsity = method, sparsity
        self.settings = dict(settings or {"blocksize": 128, "percdamp": 0.01})
        self.hessian = bool(self.entry.hessian)
        self.calibrates = self.entry.statistic is not None
        self.before: list[dict[str, Any]] = []
        self.after: list[dict[str, Any]] = []
        self.seconds = 0.0

    def statistic(self, name, unit, held, device):
        if self.entry.statistic is None:
            return None
        return self.entry.make_statistic(linear_weight(unit).shape[1], device=device)

    def apply(self, name, unit, stat):
        self.apply_shared([(name, unit)], stat)

    def apply_shared(self, units, stat):
        targets = [Target(name, unit) for name, unit in units]
        self.before.extend(sparsity_table(targets))
        tick = time.perf_counter()
        solve_layers(self.entry, [unit for _, unit in units], stat, self.sparsity, self.settings)
        self.seconds += time.perf_counter() - tick
        self.after.extend(sparsity_table(targets))

    def facts(self) -> dict[str, Any]:
        total = sum(r["numel"] for r in self.after)
        return {"achieved_sparsity": sum(r["zeros"] for r in self.after) / total if total else 0.0,
                "dense_zero_fraction": sum(r["zeros"] for r in self.before) / total if total else 0.0,
                "layers": {r["layer"]: r["sparsity"] for r in self.after}, "solve": self.seconds}


class Quantize(Modifier):
    """``--quantize``: weights to ``bits``-bit integers in groups of ``group_size`` columns (``w4a16``,
    ``w8a16``: rounded to nearest when the folder is written; their ``-gptq`` forms: GPTQ inside
    the pass, each unit's rounding error compensated from its Hessian, the sparsity mask fixed).
    Tells the block model (:meth:`~fairprune.causal.blocks.BlockModel.quantize_with`) so that its
    writer stores the integers and scales."""

    name = "quantize"

    def __init__(self, scheme: str, group_size: int = 128, settings: dict[str, Any] | None = None):
        from fairprune.hub.quantized import BITS, is_gptq

        if scheme not in BITS:
            raise UserError(f"quantize scheme {scheme!r} is not one of {', '.join(BITS)}")
        self.scheme, self.group_size = scheme, int(group_size)
        self.calibrates = is_gptq(scheme)  # GPTQ compensates from the Hessian
        self.settings = dict(settings or {"blocksize": 128, "percdamp": 0.01})
        self.plan = None
        self.blocks = None

    def begin(self, blocks) -> None:
        if self.blocks is blocks:  # once per model: the writer holds the plan's scales
            return
        from fairprune.causal.experts import refuse_quantize
        from fairprune.hub.quantized import check_groups, linear_layers
        from fairprune.pruning.gptq import LayerQuantizer

        refuse_quantize(blocks, self.scheme)
        groups = check_groups(linear_layers(blocks.layers()), self.group_size)
        self.plan = LayerQuantizer(self.scheme, min(groups.values(), default=self.group_size), self.group_size)
        self.blocks = blocks
        blocks.quantize_with(self.plan)

    @property
    def gptq(self) -> bool:
        return self.plan is not None and self.plan.gptq

    def statistic(self, name, unit, held, device):
        if not self.gptq:
            return None
        from fairprune.pruning.sparsegpt import Hessian

        earlier = next((stat for modifier, stat in held if modifier.hessian and stat is not None), None)
        return earlier if earlier is not None else Hessian(linear_weight(unit).shape[1], device)

    def apply(self, name, unit, stat):
        if not self.gptq:
            return  # round-to-nearest: when the folder is written
        from fairprune.hub.quantized import save_dtype

        self.plan.solve(self.blocks.prefix(unit)[:-1], unit, stat, self.settings, save_dtype(self.blocks.dtype))


#: Modifiers registered beside the pruning methods and ``quantize``: name -> ``build(options, settings)``.
MODIFIERS: dict[str, Any] = {}


def register_modifier(name: str, build) -> None:
    """Make ``name`` a recipe entry: ``build(options, settings)`` returns the :class:`Modifier`
    (``options``: the entry's mapping; ``settings``: the solver's block size and damping)."""
    if name in modifier_names():
        raise UserError(f"modifier {name!r} exists already; give the new one another name")
    MODIFIERS[name] = build


def modifier_names() -> list[str]:
    """The modifiers a recipe can name: the LM pruning methods, ``quantize`` and the registered ones."""
    from fairprune.pruning import registry

    return [*registry.names("lm"), "quantize", *MODIFIERS]


def make_modifier(name: str, options: dict[str, Any], settings: dict[str, Any]) -> Modifier:
    """The modifier ``name`` built from a recipe entry's ``options`` (a method: ``sparsity``;
    ``quantize``: ``scheme``, ``group_size``)."""
    from fairprune.errors import suggest

    if name == "quantize":
        unknown = set(options) - {"scheme", "group_size"}
        if unknown or "scheme" not in options:
            raise UserError(f"recipe: quantize takes scheme (e.g. w4a16-gptq) and optionally group_size; got "
                            f"{', '.join(sorted(options)) or 'nothing'}")
        return Quantize(str(options["scheme"]), int(options.get("group_size", 128)), settings)
    if name not in modifier_names():
        raise UserError(f"recipe: no modifier {name!r}{suggest(name, modifier_names())}; modifiers: {', '.join(modifier_names())}")
    if name in MODIFIERS:
        return MODIFIERS[name](dict(options), dict(settings))
    unknown = set(options) - {"sparsity"}
    if unknown or "sparsity" not in options:
        raise UserError(f"recipe: {name} takes sparsity (a fraction such as 0.5, or N:M such as 2:4); got "
                        f"{', '.join(sorted(options)) or 'nothing'}")
    return Prune(name, Sparsity.parse(options["sparsity"], what=f"recipe: {name} sparsity"), settings)


def from_flags(method: str, sparsity: Sparsity, quantize: str = "none", group_size: int = 128,
               settings: dict[str, Any] | None = None) -> list[Modifier]:
    """The modifiers the command-line flags name: the method at ``sparsity``, then ``--quantize``."""
    modifiers: list[Modifier] = [Prune(method, sparsity, settings)]
    if quantize != "none":
        modifiers.append(Quantize(quantize, group_size, settings))
    return modifiers


def statistics_for(modifiers: list[Modifier], name: str, unit: nn.Module, device) -> list[Any]:
    """Each modifier's statistic for ``unit``, in order (a Hessian shared where one is taken)."""
    held: list[tuple[Modifier, Any]] = []
    for modifier in modifiers:
        held.append((modifier, modifier.statistic(name, unit, held, device)))
    return [stat for _, stat in held]


def fed(stats: list[Any]) -> list[Any]:
    """The distinct statistics of ``stats`` (one fed once however many modifiers share it)."""
    seen: dict[int, Any] = {}
    for stat in stats:
        if stat is not None:
            seen.setdefault(id(stat), stat)
    return list(seen.values())
