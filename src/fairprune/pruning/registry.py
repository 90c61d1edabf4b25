"""The one table of pruning methods: every name the command lines, configs, compare commands and
error messages know, and what each method *does*. Callers look a method up and call its entry;
none of them branches on a method's name.

A method has a *kind*, which says what runs it:

- ``vision``: iterative pruning with retraining, the ``IterativePruning`` callback
  (``prune.py vision`` / ``compare --ckpt``, or ``trainer.callbacks`` in a ``train.py`` config).
  ``importance(context) -> {layer: scores}`` and ``selection(targets, scores, density) -> MaskChoice``
  (:mod:`fairprune.pruning.steps`);
- ``lm``: post-training pruning of a causal LM's linear weights (``prune.py <name>`` /
  ``compare --model``, or the ``PostTrainingPruning`` callback). ``statistic(columns, device)``:
  what is accumulated over the calibration inputs of each layer (None: no data);
  ``selection(W, statistic value, sparsity, **solver settings) -> W`` prunes one layer;
- ``heads``: attention-head pruning of a causal LM (``prune.py fasp --method <name>`` /
  ``compare --model --alphas``). ``selection(context) -> Selection``
  (:mod:`fairprune.pruning.fasp.selection`); ``scored``: needs the per-head scores;
- ``diff``: fine-tuning with a sparse difference (the ``DiffPruning`` callback, ``prune.py diff-compare``).

The same name may exist in several kinds (``magnitude`` prunes vision weights, LM weights and heads);
a look-up always names the kind (or the kinds it may be one of).

Behaviour is named by ``"module:attribute"`` and resolved on first use, so that reading the table
(``prune.py --help``) loads no torch. :func:`register` adds a method from outside the package (a
callable works as well as a name); ``FAIRPRUNE_PLUGINS=module[,module]`` or the entry-point group
``fairprune.methods`` name modules imported before the first look-up, so a registered method is
available to ``prune.py`` and ``train.py`` too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pkgutil import resolve_name
from typing import Any

from fairprune.errors import UserError, suggest

KINDS = {
    "vision": "iterative pruning of a vision model with retraining between steps",
    "lm": "post-training pruning of a causal LM's weights",
    "heads": "attention-head pruning of a causal LM",
    "diff": "fine-tuning with a sparse difference to a pretrained model",
}
SCOPES = ("per-layer", "global", "per-row", "heads")

Ref = str | Callable[..., Any] | type | None


def _resolve(ref: Ref) -> Any:
    return resolve_name(ref) if isinstance(ref, str) else ref


@dataclass(frozen=True)
class Method:
    """One method: its name and kind, what it computes, how it selects or solves, and its options.

    Args:
        importance: vision: scores per weight. heads: what is measured per head (documentation;
            the scored heads come from ``scored``).
        statistic: lm: the per-layer calibration statistic (None: the method needs no data).
        selection: vision: masks from scores; lm: the layer solve; heads: the heads to remove.
        options: the options type the method reads besides the shared ones (None: none).
        scope: how the sparsity budget is shared: per-layer, global, per-row or heads.
        uses_data: needs data (gradients, calibration, generations) besides the weights.
        paired: lm: calibrates on paired stereotype / anti-stereotype inputs.
        hessian: lm: its statistic's value is the layer Hessian (``--quantize *-gptq`` compensates
            with it; a method without one collects a plain Hessian beside its statistic).
        rewind: vision: the kept weights rewind to an early epoch after every step (lottery ticket).
        granularities: vision: what the method may prune: ``weight`` (masks) and / or ``channel``
            (whole channels removed, :mod:`fairprune.pruning.channels`).
        channel_reduce: vision, channel granularity: how the weight scores of a channel combine,
            ``sum`` or ``l2`` (root of the summed squares).
        channel_selection: vision, channel granularity: channels from channel scores
            (``selection(groups, scores, density)``); None: by scope (per-layer: each channel group
            alone, global: all channels ranked together).
        scored: heads: needs every head's perplexity and bias scores (the costly FASP pass).
        protects: heads: protects the top-γ heads for perplexity (γ is searched when unset).
    """

    name: str
    kind: str
    summary: str
    selection: Ref
    importance: Ref = None
    statistic: Ref = None
    options: Ref = None
    scope: str = "per-layer"
    uses_data: bool = True
    paired: bool = False
    hessian: bool = False
    rewind: bool = False
    granularities: tuple[str, ...] = ("weight", "channel")
    channel_reduce: str = "sum"
    channel_selection: Ref = None
    scored: bool = False
    protects: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.name

    def score(self, *args: Any, **kwargs: Any) -> Any:
        """Call the method's importance."""
        return _resolve(self.importance)(*args, **kwargs)

    def select(self, *args: Any, **kwargs: Any) -> Any:
        """Call the method's selection (or, for an LM method, its layer solve)."""
        return _resolve(self.selection)(*args, **kwargs)

    def select_takes(self, name: str) -> bool:
        """Whether the method's selection (its LM layer solve) takes a parameter ``name``."""
        import inspect

        return name in inspect.signature(_resolve(self.selection)).parameters

    def select_channels(self, *args: Any, **kwargs: Any) -> Any:
        """Call the method's channel selection (vision, channel granularity)."""
        default = {"per-layer": f"{_CHANNELS}:per_group", "global": f"{_CHANNELS}:global_"}.get(self.scope)
        return _resolve(self.channel_selection or default)(*args, **kwargs)

    def make_statistic(self, columns: int, device: Any = None) -> Any:
        """A fresh calibration statistic for a layer with ``columns`` inputs (LM methods with data)."""
        return _resolve(self.statistic)(columns, device=device)

    @property
    def options_type(self) -> type | None:
        return _resolve(self.options)


_STEPS, _SOLVE, _HEADS = "fairprune.pruning.steps", "fairprune.pruning.llm", "fairprune.pruning.fasp.selection"
_CHANNELS = "fairprune.pruning.channels"
_SOLVER_OPTIONS, _HEAD_OPTIONS = "fairprune.pruning.options:SolverOptions", "fairprune.pruning.options:HeadOptions"

_BUILTIN = (
    Method("fairgrape", "vision", "per-group importance (g·w)², greedy selection keeping each group's share",
           importance=f"{_STEPS}:group_importance", selection=f"{_STEPS}:fair_shares",
           channel_selection=f"{_CHANNELS}:fair_shares"),
    Method("magnitude", "vision", "weight magnitude |w| (WS); channels: L2 norm", importance=f"{_STEPS}:magnitude",
           selection=f"{_STEPS}:per_layer", uses_data=False, channel_reduce="l2"),
    Method("snip", "vision", "connection sensitivity |g·w| on a few batches", importance=f"{_STEPS}:snip",
           selection=f"{_STEPS}:global_", scope="global"),
    Method("grasp", "vision", "gradient-flow preservation −w·Hg", importance=f"{_STEPS}:grasp",
           selection=f"{_STEPS}:global_", scope="global"),
    Method("random", "vision", "uniformly random weights", importance=f"{_STEPS}:random",
           selection=f"{_STEPS}:per_layer", uses_data=False),
    Method("lottery", "vision", "magnitude, kept weights rewound to an early epoch", importance=f"{_STEPS}:magnitude",
           selection=f"{_STEPS}:per_layer", uses_data=False, rewind=True, granularities=("weight",)),
    Method("magnitude", "lm", "weight magnitude |w| within each output row", selection=f"{_SOLVE}:magnitude_solve",
           scope="per-row", uses_data=False),
    Method("wanda", "lm", "|w|·‖x‖₂ within each output row, no weight update", statistic="fairprune.pruning.wanda:InputNorms",
           selection="fairprune.pruning.wanda:wanda_solve", scope="per-row"),
    Method("sparsegpt", "lm", "OBS mask and weight update from the layer Hessian XXᵀ",
           statistic="fairprune.pruning.sparsegpt:Hessian", selection="fairprune.pruning.sparsegpt:sparsegpt_solve",
           options=_SOLVER_OPTIONS, scope="per-row", hessian=True),
    Method("debias-sparsegpt", "lm", "SparseGPT with the paired Hessian X0X0ᵀ + X1X1ᵀ + 2ΔXΔXᵀ",
           statistic="fairprune.pruning.sparsegpt:PairedHessian", selection="fairprune.pruning.sparsegpt:sparsegpt_solve",
           options=_SOLVER_OPTIONS, scope="per-row", paired=True, hessian=True),
    Method("fasp", "heads", "protect the top-γ heads for perplexity, remove those whose removal lowers bias most",
           selection=f"{_HEADS}:select_fasp_heads", options=_HEAD_OPTIONS, scope="heads", scored=True, protects=True),
    Method("fairness", "heads", "remove the heads whose removal lowers bias most (γ = 0)",
           selection=f"{_HEADS}:select_fairness_heads", options=_HEAD_OPTIONS, scope="heads", scored=True),
    Method("performance", "heads", "remove the heads whose removal raises perplexity least",
           selection=f"{_HEADS}:select_performance_heads", options=_HEAD_OPTIONS, scope="heads", scored=True),
    Method("magnitude", "heads", "remove the heads with the smallest output-projection norm",
           selection=f"{_HEADS}:select_magnitude_heads", options=_HEAD_OPTIONS, scope="heads", uses_data=False),
    Method("gradient", "heads", "remove the heads with the smallest |gate gradient| of the LM loss",
           selection=f"{_HEADS}:select_gradient_heads", options=_HEAD_OPTIONS, scope="heads"),
    Method("random", "heads", "remove random heads", selection=f"{_HEADS}:select_random_heads",
           options=_HEAD_OPTIONS, scope="heads", uses_data=False),
    Method("diff-pruning", "diff", "θ₀ + z ⊙ δ with hard-concrete gates, then magnitude pruning of δ",
           importance="fairprune.pruning.diff.hard_concrete:sample_gate", selection="fairprune.pruning.diff.selection:magnitude_prune", scope="global"),
)

REGISTRY: dict[tuple[str, str], Method] = {m.key: m for m in _BUILTIN}
#: prune.py's own subcommands (:func:`fairprune.cli.prune.commands`); every ``lm`` method is a
#: subcommand of its own too, so an ``lm`` method may not take one of these names.
SUBCOMMANDS = ("vision", "recipe", "fasp", "diff-compare", "evaluate", "export", "compare")
_plugins_loaded = False


def register(method: Method, *, replace: bool = False) -> Method:
    """Add ``method`` to the table (``replace=True`` to redefine one); returns it.

    What a kind needs: vision ``importance`` and ``selection``; lm ``selection`` (and
    ``statistic`` when it uses data); heads ``selection``."""
    _check_kind(method.kind)
    if not isinstance(method.name, str) or not re.fullmatch(r"[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*", method.name):
        raise UserError(f"method name {method.name!r} is not a name: use lower-case letters and digits, words joined by "
                        "'-' or '_', starting with a letter (e.g. 'my-method'); it becomes a command and a config value")
    if method.scope not in SCOPES:
        raise UserError(f"method {method.name!r}: scope must be one of {', '.join(SCOPES)}, got {method.scope!r}")
    if not set(method.granularities) <= {"weight", "channel"} or method.channel_reduce not in ("sum", "l2"):
        raise UserError(f"method {method.name!r}: granularities must be among weight, channel and channel_reduce "
                        f"sum or l2, got {method.granularities!r} and {method.channel_reduce!r}")
    needs = {"vision": ("importance", "selection"), "lm": ("selection",), "heads": ("selection",), "diff": ()}[method.kind]
    if method.kind == "lm" and method.uses_data:
        needs += ("statistic",)
    missing = [n for n in needs if getattr(method, n) is None]
    if missing:
        raise UserError(f"{method.kind} method {method.name!r} needs {' and '.join(missing)}")
    if method.kind == "lm" and method.name in SUBCOMMANDS:
        raise UserError(f"lm method {method.name!r} clashes with the prune.py subcommand {method.name!r} (every lm "
                        "method is a prune.py subcommand of its own); give the method another name")
    others = [m.kind for m in _BUILTIN if m.name == method.name and m.kind != method.kind]
    if others and method.key not in {m.key for m in _BUILTIN}:
        raise UserError(f"{method.kind} method {method.name!r} clashes with the built-in {others[0]} method "
                        f"{method.name!r}; give the method another name")
    if method.key in REGISTRY and not replace:
        raise UserError(f"a {method.kind} method named {method.name!r} exists already; pass replace=True to redefine it")
    REGISTRY[method.key] = method
    return method


def unregister(name: str, kind: str) -> None:
    """Remove a method (a registered one; built-in ones come back on the next start)."""
    REGISTRY.pop((kind, name), None)


def names(kind: str) -> tuple[str, ...]:
    """Method names of one kind, in registration order."""
    _check_kind(kind)
    _load_plugins()
    return tuple(m.name for m in REGISTRY.values() if m.kind == kind)


def get(name: str, kind: str | tuple[str, ...], what: str | None = None) -> Method:
    """The method ``name`` of ``kind`` (or of the first of several kinds that has it); an unknown
    name is a one-line error listing the choices."""
    kinds = (kind,) if isinstance(kind, str) else tuple(kind)
    for k in kinds:
        _check_kind(k)
    _load_plugins()
    for k in kinds:
        method = REGISTRY.get((k, name))
        if method is not None:
            return method
    choices = tuple(dict.fromkeys(n for k in kinds for n in names(k)))
    label = what or " / ".join(KINDS[k].split(" of ")[0] for k in kinds)
    raise UserError(f"unknown {label} method '{name}'{suggest(str(name), choices)}; choose one of {', '.join(choices)}")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise UserError(f"unknown method kind '{kind}'; choose one of {', '.join(KINDS)}")


def _load_plugins() -> None:
    """Import the modules that register methods: ``FAIRPRUNE_PLUGINS`` and the
    ``fairprune.methods`` entry points (once per process)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    from importlib import import_module
    from importlib.metadata import entry_points

    for module in filter(None, (m.strip() for m in os.environ.get("FAIRPRUNE_PLUGINS", "").split(","))):
        try:
            import_module(module)
        except UserError as err:  # e.g. a method name that clashes (register)
            raise UserError(f"plugin module {module!r} (FAIRPRUNE_PLUGINS): {_one_line(err)}") from None
        except ModuleNotFoundError as err:
            if err.name is not None and (module == err.name or module.startswith(err.name + ".")):  # the plugin itself is not found
                raise UserError(f"FAIRPRUNE_PLUGINS names {module!r}, which does not import ({err}); "
                                "put it on PYTHONPATH or fix the name") from None
            raise _plugin_failed(module, "FAIRPRUNE_PLUGINS", err) from None
        except Exception as err:  # noqa: BLE001 - the plugin's own bug: one line naming it
            raise _plugin_failed(module, "FAIRPRUNE_PLUGINS", err) from None
    for point in entry_points(group="fairprune.methods"):
        try:
            point.load()
        except UserError as err:
            raise UserError(f"plugin {point.value!r} (entry point fairprune.methods {point.name!r}): "
                            f"{_one_line(err)}") from None
        except Exception as err:  # noqa: BLE001
            raise _plugin_failed(point.value, f"entry point fairprune.methods {point.name!r}", err) from None


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def _plugin_failed(module: str, where: str, err: BaseException) -> UserError:
    return UserError(f"plugin module {module!r} ({where}) failed to import: {type(err).__name__}: "
                     f"{_one_line(err)[:300]}; fix the plugin, or leave it out ({'drop it from FAIRPRUNE_PLUGINS' if where == 'FAIRPRUNE_PLUGINS' else 'uninstall its package'})")
