"""The ``prune.py`` command line (jsonargparse, the same YAML conventions as ``train.py``).

Subcommands:

- ``vision``: prune a trained vision checkpoint with one method, retraining between steps;
- ``compare``: several methods × sparsities from one dense checkpoint, one table and plots.

Every subcommand takes ``--config file.yaml`` (keys = the option names) and command-line
overrides; ``--print_config`` shows the resolved configuration.
"""

from __future__ import annotations

import sys
from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser

from fairprune.callbacks.pruning import IterativePruning
from fairprune.cli import one_line, user_error_in


def _common(parser: ArgumentParser) -> None:
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file with any of these options")
    parser.add_argument("--ckpt", type=str, required=True, help="dense checkpoint written by train.py")
    parser.add_argument("--output", type=str, default="runs/prune", help="folder the run folder(s) go in")
    parser.add_argument("--trainer", type=dict[str, Any], default={}, help="Trainer arguments (accelerator, limit_train_batches, ...)")
    parser.add_argument("--data", type=dict[str, Any], default={}, help="data module overrides (root, batch_size, num_workers, ...)")
    parser.add_argument("--seed", type=int, default=0)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="prune.py", description="Prune trained models and measure what it costs each group.",
                            exit_on_error=False)
    commands = parser.add_subcommands(dest="command")

    vision = ArgumentParser(description="Prune a trained vision checkpoint (FairGRAPE, magnitude, SNIP, GraSP, random, lottery).",
                            exit_on_error=False)
    _common(vision)
    vision.add_class_arguments(IterativePruning, "pruning", help="pruning method and schedule")
    vision.add_argument("--name", type=str | None, default=None, help="run folder name (default: the method)")
    vision.add_argument("--resume", type=str | None, default=None, help="checkpoint of an interrupted pruning run to resume")
    commands.add_subcommand("vision", vision)

    compare = ArgumentParser(description="Compare methods x sparsities from one dense checkpoint.", exit_on_error=False)
    _common(compare)
    compare.add_argument("--methods", type=list[str], default=["magnitude", "fairgrape"])
    compare.add_argument("--sparsities", type=list[float], default=[0.9])
    compare.add_argument("--pruning", type=dict[str, Any], default={}, help="settings shared by every method (keep_per_iter, retrain_epochs, ...)")
    commands.add_subcommand("compare", compare)
    return parser


def run(args: list[str] | None = None) -> Any:
    cfg = build_parser().parse_args(args)
    sub = cfg[cfg.command]
    if cfg.command == "vision":
        from fairprune.vision_runs import prune_vision

        report = prune_vision(sub.ckpt, dict(sub.pruning), sub.output, sub.name, dict(sub.trainer), dict(sub.data),
                              sub.resume, sub.seed)
        print(f"[prune] {report['method']}: accuracy {report['metrics'].get('accuracy', float('nan')):.4f}, "
              f"sparsity {report['achieved_sparsity']:.4f}")
        return report
    if cfg.command == "compare":
        from fairprune.reports import markdown
        from fairprune.vision_runs import compare_vision

        table = compare_vision(sub.ckpt, sub.methods, sub.sparsities, dict(sub.pruning), sub.output, dict(sub.trainer),
                               dict(sub.data), sub.seed)
        print("\n" + markdown(table.set_index("method")) + "\n")
        print(f"[compare] written to {sub.output}/comparison.csv, comparison.md and plots")
        return table
    raise AssertionError(cfg.command)


def main(args: list[str] | None = None) -> int:
    try:
        run(args)
    except Exception as err:  # noqa: BLE001 - user mistakes become one line, bugs keep their traceback
        user = user_error_in(err)
        if user is None:
            raise
        print(f"error: {one_line(user)}", file=sys.stderr)
        return 2
    return 0
