"""Which warnings a command prints: fairprune's own (data left out, groups without samples, a cache
not written, ...) and the libraries' notes on the run's settings (Lightning's, e.g. a logging
interval longer than an epoch) stay; the libraries' notes to their own callers do not: deprecations
and future changes of the APIs that Lightning, torch, transformers, jsonargparse or lm-eval call
inside themselves (Lightning's ``isinstance(treespec, LeafSpec)``, jsonargparse's
``add_instantiator``, ...), which no option of a fairprune command changes.

Installed at the start of ``prune.py`` and ``train.py`` (and so of ``make demo``), before the
libraries are imported (some warn while importing)."""

from __future__ import annotations

import sys
import warnings

#: Warnings about API use that a library raises from its own or another library's code.
LIBRARY_CATEGORIES = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
#: Single library notes that are not the user's to act on: (message regex, why).
LIBRARY_MESSAGES = (
    # train.py hands LightningCLI its arguments explicitly; under another program (make demo,
    # prune.py diff-compare) sys.argv holds that program's, which LightningCLI never reads.
    "LightningCLI's args parameter",
    # A pruning run writes its config.yaml (and lock) into its folder before Lightning's CSV logger
    # starts there, so every run would say that the folder is not empty.
    "Experiment logs directory .* exists and is not empty",
)


def quiet_library_warnings() -> None:
    """Leave out :data:`LIBRARY_CATEGORIES` raised outside fairprune and :data:`LIBRARY_MESSAGES`;
    fairprune's own warnings of any category still show. Python's ``-W`` options and
    ``PYTHONWARNINGS``, where given, decide alone."""
    if sys.warnoptions:
        return
    for category in LIBRARY_CATEGORIES:
        warnings.filterwarnings("ignore", category=category)
        warnings.filterwarnings("default", category=category, module=r"fairprune(\.|$)")  # checked first
    for message in LIBRARY_MESSAGES:
        warnings.filterwarnings("ignore", message=message)
