"""The ``prune.py`` command line, built by jsonargparse from the workflow functions' signatures.

Each subcommand is a workflow function: its parameters are the command's options, with their types
and the help from its docstring. A parameter typed with an option group (``LMOptions``,
``SolverOptions``, ``HeadOptions``: :mod:`fairprune.pruning.options`) adds that group's options
flat (``--model``, ``--seqlen``, ...), so every LM command shares one set of names.
Every subcommand takes ``--config file.yaml`` (keys = the option names), ``--print_config`` and the
:class:`~fairprune.workflows.options.MachineOptions` (``--threads N``, ``--quiet``): the thread count is
set before the workflow starts, and ``--quiet`` reaches the workflow (a ``MachineOptions`` parameter)
or its Trainer (``enable_progress_bar: false``).

Only the chosen subcommand's workflow is imported: ``prune.py --help`` loads neither torch nor
Lightning.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
from collections.abc import Callable
from importlib import import_module
from typing import Any, NamedTuple

from fairprune.cli.guard import guarded
from fairprune.cli.quiet import quiet_library_warnings
from fairprune.errors import UserError, suggest
from fairprune.pruning import registry
from fairprune.pruning.options import HeadOptions, LMOptions, SolverOptions
from fairprune.pruning.sparsity import Sparsity
from fairprune.workflows.options import MachineOptions, TrainerOptions, VisionCompareOptions


class Command(NamedTuple):
    summary: str
    function: str  # "module:function" of the workflow it runs
    fixed: dict[str, Any] = {}  # parameters the subcommand sets itself (the LM method)
    hide: tuple[str, ...] = ()  # group options that mean nothing to this subcommand


def commands() -> dict[str, Command]:
    """The subcommands, from the registry as it is now (a method registered by a plugin has its own)."""
    table = {"vision": Command("Prune a trained vision checkpoint: " + ", ".join(registry.names("vision")) + ".",
                                 "fairprune.workflows.vision:prune_vision")}
    for method in registry.names("lm"):
        if method in registry.SUBCOMMANDS:  # register() refuses these; a method put in the table by hand too
            raise UserError(f"lm method {method!r} clashes with the prune.py subcommand {method!r}; give the method "
                            "another name")
        table[method] = Command(f"Post-training {method} pruning of a causal LM (unstructured or N:M); "
                                   "writes a transformers folder and its report.", "fairprune.workflows.lm:prune_lm",
                                   {"method": method}, hide=("quantize_methods",))
    table["recipe"] = Command("Post-training run of a causal LM by a recipe (--recipe FILE: one pruning method, then "
                              "optionally quantize); the same folder and report as the method's own command.",
                              "fairprune.workflows.lm:prune_recipe", hide=("quantize", "quant_group_size", "quantize_methods"))
    table["fasp"] = Command("FASP: remove the attention heads that most raise toxicity disparity, protecting the "
                               "heads perplexity needs (or a baseline: " + ", ".join(registry.names("heads")[1:]) + ").",
                               "fairprune.workflows.heads:fasp", hide=("save_format", "quantize", "quant_group_size",
                                                                         "quantize_methods", "calib_text_for"))
    table["diff-compare"] = Command("Full fine-tuning vs fine-tuning + magnitude-pruned difference vs Diff-Pruning, "
                                       "one table, from a train.py text config.", "fairprune.cli.prune:diff_compare")
    table["evaluate"] = Command("Perplexity, stereotype score and sparsity of a causal LM.",
                                   "fairprune.workflows.lm:evaluate_lm",
                                   hide=("save_format", "quantize", "quant_group_size", "quantize_methods",
                                         "calib_text_for"))
    table["export"] = Command("Export a vision checkpoint to ONNX (dynamic batch), checked against PyTorch in "
                                 "ONNX Runtime, or a causal LM to GGUF (--format gguf), checked against transformers' "
                                 "GGUF reader.", "fairprune.workflows.export:export")
    table["compare"] = Command("Compare methods x sparsities on a vision checkpoint (--ckpt) or a causal LM "
                                  "(--model; --alphas for head pruning); one table.", "fairprune.cli.prune:compare",
                                  hide=("alpha",))
    missing = set(registry.SUBCOMMANDS) ^ (set(table) - set(registry.names("lm")))
    assert not missing, f"registry.SUBCOMMANDS is out of date: {sorted(missing)}"
    return table




# ----------------------------------------------------------------------------------------------
# Commands whose options are not one workflow's: they choose or build what the workflow gets.


@dataclasses.dataclass(frozen=True)
class CompareOptions:
    """What is compared: methods x sparsities (or α) from one checkpoint or causal LM.

    One vision checkpoint (``--ckpt``) or one causal LM (``--model``).

    Args:
        methods: method names (see each kind's list in prune.py vision / fasp / <lm method> --help).
        output: folder for the runs, comparison.csv / .md, report.json and plots.
        ckpt: dense vision checkpoint written by train.py.
        model: causal LM (hub name or folder) instead of --ckpt.
        sparsities: vision: fractions; LM: fractions or N:M such as "2:4".
        alphas: head pruning (FASP and baselines) at these α instead of weight sparsities.
        seed: vision: the global seed; LM: the calibration sample, pair split and generation seed.
        baseline: the method every other is compared with on the same test items (vision) or the same windows and pairs (LM), with a paired 95 % interval; default: the first method; LM: also dense.
    """

    methods: list[str]
    output: str = "runs/compare"
    ckpt: str | None = None
    model: str | None = None
    sparsities: list[str | float] = dataclasses.field(default_factory=lambda: [0.9])
    alphas: list[float] | None = None
    seed: int = 0
    baseline: str | None = None


def compare(run: CompareOptions, vision: VisionCompareOptions | None = None, lm: LMOptions | None = None,
            solver: SolverOptions | None = None, heads: HeadOptions | None = None,
            machine: MachineOptions | None = None) -> Any:
    """Compare methods x sparsities from one vision checkpoint (--ckpt) or one causal LM (--model).
    Its options come flat from the groups: ``run`` (what is compared), ``vision`` (a vision
    compare's settings), ``lm`` / ``solver`` / ``heads`` (an LM's) and ``machine``; an option two
    groups share (``--seed``, ``--model``) is given once."""
    if (run.ckpt is None) == (run.model is None):
        raise UserError("compare needs exactly one of --ckpt (a vision checkpoint) or --model (a causal LM)")
    vision = vision or VisionCompareOptions(run.methods, [])
    if run.ckpt is not None:
        from fairprune.workflows.vision import compare_vision

        fractions = [Sparsity.parse(s, what="vision sparsity", nm=False).fraction for s in run.sparsities]
        return compare_vision(run.ckpt, dataclasses.replace(
            vision, methods=run.methods, sparsities=fractions, pruning=dict(vision.pruning or {}),
            trainer=dict(vision.trainer or {}), data=dict(vision.data or {}), seed=run.seed, baseline=run.baseline),
            run.output)
    if vision.granularities:
        raise UserError("--granularities is for vision compares (--ckpt); an LM compare prunes weights, N:M patterns "
                        "or heads")
    lm = dataclasses.replace(lm or LMOptions(), model=run.model, seed=run.seed)
    if run.alphas:
        if lm.save_format != "dense":
            raise UserError("--save_format compressed applies to weight pruning (--sparsities); head pruning (--alphas) "
                            "removes heads and writes dense folders")
        if lm.quantize != "none":
            raise UserError(f"--quantize {lm.quantize} applies to weight pruning (--sparsities); head pruning (--alphas) "
                            "writes dense folders")
        if lm.calib_text_for:
            raise UserError("--calib_text_for gives the runs at a sparsity their own calibration text (--sparsities); "
                            "head pruning (--alphas) scores heads on --calib_text")
        from fairprune.workflows.heads import compare_heads

        return compare_heads(lm, run.methods, run.alphas, run.output, heads or HeadOptions(), machine or MachineOptions())
    from fairprune.workflows.lm import compare_lm

    return compare_lm(lm, run.methods, [Sparsity.parse(s) for s in run.sparsities], run.output, solver or SolverOptions(),
                      machine or MachineOptions(), baseline=run.baseline)


def diff_compare(train_config: str, overrides: list[str] = [], target_fraction: float = 0.005, epochs: int = 3,
                 finetune_epochs: int = 1, trainer: TrainerOptions = {}, output: str = "runs/diff_compare") -> Any:
    """Build the model and data of a train.py config (without running it) and compare the three
    ways of fine-tuning them.

    Args:
        train_config: a train.py config (model + data), e.g. configs/text/diffprune_bios.yaml.
        overrides: extra train.py arguments, e.g. ['--data.bios_size', '400'].
        target_fraction: share of weights the difference may change.
        epochs: epochs of full fine-tuning and of gated training.
        finetune_epochs: epochs of fixed-mask fine-tuning.
        trainer: Trainer arguments (accelerator, limit_train_batches, ...).
        output: folder for the diffs, comparison.csv / .md and report.json.
    """
    import warnings

    from fairprune.cli.lightning_cli import FairpruneCLI
    from fairprune.storage.atomic import check_writable
    from fairprune.workflows.diff import compare_diff_pruning

    check_writable(output)  # before the model is built
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")  # prune.py's own argv is not train.py's
    cli = FairpruneCLI(model_class=None, datamodule_class=None, subclass_mode_model=True, subclass_mode_data=True,
                       run=False, save_config_callback=None, parser_kwargs={"exit_on_error": False},
                       args=["--config", train_config, *overrides])
    return compare_diff_pruning(cli.model, cli.datamodule, target_fraction, epochs, finetune_epochs, output, dict(trainer))


# ----------------------------------------------------------------------------------------------
# Building a parser from a signature, and calling the function with what was parsed


def _resolve(spec: str) -> Callable:
    module, _, name = spec.partition(":")
    return getattr(import_module(module), name)


def _hints(function: Callable) -> dict[str, Any]:
    return typing.get_type_hints(function)


def _groups(function: Callable) -> dict[str, type]:
    """Parameters typed with an option dataclass (``LMOptions | None`` counts as ``LMOptions``)."""
    groups = {}
    for name, hint in _hints(function).items():
        candidates = [hint, *typing.get_args(hint)]
        found = [c for c in candidates if dataclasses.is_dataclass(c)]
        if found:
            groups[name] = found[0]
    return groups


def build_parser(name: str):
    """The parser of one subcommand."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    command = commands()[name]
    function = _resolve(command.function)
    parser = ArgumentParser(prog=f"prune.py {name}", description=command.summary, exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file with any of these options")
    groups = _groups(function)
    skip = set(command.fixed) | set(groups)
    if name == "vision":
        from fairprune.callbacks.pruning import IterativePruning

        parser.add_class_arguments(IterativePruning, "pruning", help="pruning method and schedule")
        skip.add("pruning")
    parser.add_function_arguments(function, nested_key=None, skip=skip)
    given = set(inspect.signature(function).parameters) | set(command.hide)
    for group in dict.fromkeys([*groups.values(), MachineOptions]):  # every subcommand takes --threads, --quiet
        fields = {f.name for f in dataclasses.fields(group)}
        parser.add_class_arguments(group, nested_key=None, skip=given & fields)
        given |= fields  # an option two groups share is added once; each group reads it by name
    return parser


def call(name: str, cfg) -> Any:
    """Run subcommand ``name`` with the parsed ``cfg``."""
    from jsonargparse import Namespace

    command = commands()[name]
    function = _resolve(command.function)
    groups = _groups(function)
    kwargs: dict[str, Any] = dict(command.fixed)

    def options(group: type) -> Any:
        return group(**{f.name: cfg[f.name] for f in dataclasses.fields(group) if f.name in cfg})

    for param in inspect.signature(function).parameters:
        if param in kwargs:
            continue
        if param in groups:
            kwargs[param] = options(groups[param])
        elif param in cfg:
            value = cfg[param]
            kwargs[param] = value.as_dict() if isinstance(value, Namespace) else value
    machine = options(MachineOptions)
    if MachineOptions not in groups.values():
        machine.apply()  # before the workflow starts (one that takes MachineOptions applies them itself)
    if machine.quiet and "trainer" in inspect.signature(function).parameters:
        kwargs["trainer"] = {**(kwargs.get("trainer") or {}), "enable_progress_bar": False}
    return function(**kwargs)


def top_level_parser():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="prune.py", description="Prune trained models and measure what it costs each group. "
                            "'prune.py <subcommand> --help' lists a subcommand's options.")
    subcommands = parser.add_subcommands(dest="command")
    for name, command in commands().items():
        subcommands.add_subcommand(name, ArgumentParser(description=command.summary), help=command.summary)
    return parser


def dispatch(args: list[str] | None = None) -> Any:
    """Parse ``args`` (default: ``sys.argv``) and run the subcommand they name."""
    argv = sys.argv[1:] if args is None else list(args)
    if not argv or argv[0] in ("-h", "--help"):
        top_level_parser().print_help()
        if not argv:
            raise UserError("give a subcommand: " + ", ".join(commands()))
        return None
    name = argv[0]
    known = commands()
    if name not in known:
        raise UserError(f"unknown subcommand '{name}'{suggest(name, known)}; choose one of {', '.join(known)}")
    cfg = build_parser(name).parse_args(_bare_flags(argv[1:]))
    return call(name, cfg)


def _bare_flags(argv: list[str], flags: tuple[str, ...] = ("--quiet",)) -> list[str]:
    """``--quiet`` alone means ``--quiet true`` (a boolean option otherwise takes its value)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg in flags and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("true")
    return out


def main(args: list[str] | None = None) -> int:
    quiet_library_warnings()
    return guarded(lambda: dispatch(args))
