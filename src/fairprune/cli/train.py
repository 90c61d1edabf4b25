"""The ``train.py`` command line: ``fit``, ``validate``, ``test`` or ``predict`` a model from a YAML
config, a LightningCLI (:mod:`fairprune.cli.lightning_cli`).

The top-level ``--help`` is answered here without importing Lightning (seconds of start-up); a
subcommand's help lists every Trainer, model and data option and needs it.
"""

from __future__ import annotations

import sys

SUBCOMMANDS = {
    "fit": "Runs the full optimization routine.",
    "validate": "Perform one evaluation epoch over the validation set.",
    "test": "Perform one evaluation epoch over the test set.",
    "predict": "Run inference on your data.",
}


def main(args: list[str] | None = None) -> int:
    """Run the training CLI; return the process exit status."""
    argv = sys.argv[1:] if args is None else list(args)
    if not argv or argv[0] in ("-h", "--help"):
        top_level_parser().print_help()
        return 0 if argv else 2
    from fairprune.cli.quiet import quiet_library_warnings

    quiet_library_warnings()  # before Lightning is imported: some libraries warn while importing
    from fairprune.cli.lightning_cli import dispatch

    return dispatch(args)


def top_level_parser():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="train.py", description="Train, validate or test a model from a YAML config "
                            "(python train.py fit --config configs/vision/demo.yaml); "
                            "'train.py <subcommand> --help' lists every option, among them --threads N "
                            "(CPU threads; default: torch's own choice).")
    parser.add_argument("--config", help="YAML file with any of the subcommand's options")
    commands = parser.add_subcommands(dest="subcommand")
    for name, summary in SUBCOMMANDS.items():
        commands.add_subcommand(name, ArgumentParser(description=summary), help=summary)
    return parser
