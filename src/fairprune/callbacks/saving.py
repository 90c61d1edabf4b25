"""Whole files or none: a Trainer's checkpoints and ``train.py``'s ``config.yaml`` are written beside
their target and renamed over it, so a full disk, a file-size limit or a kill in the middle leaves
the previous file (or none), never a cut-short one under a valid-looking name; a write the operating
system refuses is a one-line :class:`~fairprune.errors.UserError` naming the file.

Lightning's own checkpoint writer goes through fsspec's transaction, which on a local disk writes a
temporary file in the system's temporary folder and then *copies* it to the target when that lies on
another filesystem: a full target disk leaves the copy cut short under its final name.
"""

from __future__ import annotations

import io
import os
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.cli import SaveConfigCallback

from fairprune.errors import UserError
from fairprune.storage.atomic import replace_atomically

ADVICE = "free some space there (or write elsewhere) and run the command again"


def refused_write(what: str, path: str | os.PathLike, err: OSError, advice: str = ADVICE) -> UserError:
    """The one line of a write the operating system refused (a full disk, a quota, a size limit)."""
    return UserError(f"cannot write {what} '{path}' ({err.strerror or err}); nothing was left half-written: {advice}")


class AtomicCheckpointIO(TorchCheckpointIO):
    """:class:`TorchCheckpointIO` whose local checkpoints are serialised in memory, written to a
    temporary file beside the target and renamed over it (remote paths: Lightning's own way)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        try:
            replace_atomically(path, lambda tmp: tmp.write_bytes(buffer.getbuffer()))
        except OSError as err:
            raise refused_write("the checkpoint", path, err, f"the checkpoints written before it are whole; {ADVICE}") from None


def atomic_checkpoints(trainer: L.Trainer) -> L.Trainer:
    """Give ``trainer`` an :class:`AtomicCheckpointIO` where it would use Lightning's default writer."""
    if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
        trainer.strategy.checkpoint_io = AtomicCheckpointIO()
    return trainer


def _has_skip_unset() -> bool:
    import jsonargparse

    major, minor = (int(part) for part in jsonargparse.__version__.split(".")[:2])
    return (major, minor) >= (4, 49)


#: Whether jsonargparse's save takes ``skip_unset`` (4.49 on), which replaced ``skip_none``.
_SKIP_UNSET = _has_skip_unset()


class _AtomicSave:
    """A jsonargparse parser whose ``save`` writes beside the target and renames."""

    def __init__(self, parser: Any) -> None:
        self._parser = parser

    def save(self, cfg: Any, path: str, **kwargs: Any) -> None:
        kwargs["overwrite"] = True  # the temporary file is this run's own
        if "skip_none" in kwargs and _SKIP_UNSET:  # Lightning's name for it, which jsonargparse 4.49 renamed
            kwargs["skip_unset"] = kwargs.pop("skip_none")
        try:
            replace_atomically(path, lambda tmp: self._parser.save(cfg, str(tmp), **kwargs))
        except OSError as err:
            raise refused_write("the run's configuration", path, err) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


class AtomicSaveConfig(SaveConfigCallback):
    """LightningCLI's ``config.yaml`` writer, writing the file whole or not at all."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        parser, self.parser = self.parser, _AtomicSave(self.parser)
        try:
            super().setup(trainer, pl_module, stage)
        finally:
            self.parser = parser

