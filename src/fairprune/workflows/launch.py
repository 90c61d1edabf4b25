"""The decorator that lets an LM command run under ``torchrun``: one process group per command.

Shared by the LM post-training commands (:mod:`fairprune.workflows.lm`) and the head-pruning ones
(:mod:`fairprune.workflows.heads`).
"""

from __future__ import annotations

import functools
import inspect

from fairprune import distributed


def torchrun(command):
    """Run an LM command inside :func:`fairprune.distributed.process_group` for its ``lm.device``
    (nothing changes in one process). The signature and docstring stay the command's, for prune.py."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        lm = inspect.signature(command).bind(*args, **kwargs).arguments["lm"]
        with distributed.process_group(lm.device):
            return command(*args, **kwargs)

    return run
