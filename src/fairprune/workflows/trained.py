"""The checkpoint a vision command reads: rebuilt as it was trained (model and data module classes
from the checkpoint's own hyper-parameters, read as data), checked for what the vision commands
need before any Trainer is built; and a compare cell's per-item outcomes measured again from it."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path
from pkgutil import resolve_name
from typing import Any

import lightning as L

from fairprune.errors import UserError
from fairprune.pruning import channels
from fairprune.storage.checkpoints import read_bytes, read_checkpoint, state_dict_mismatch
from fairprune.workflows.options import DataOptions
from fairprune.workflows.paired import item_outcomes, save_items

#: What the vision commands take as --ckpt, for error messages.
VISION_CKPT = ("a checkpoint of a vision classifier with class and group names, written by train.py fit "
               "(e.g. runs/demo/dense/checkpoints/last.ckpt)")


@dataclass(frozen=True)
class Trained:
    """A vision checkpoint read once: the path as given (``source``), its bytes, their SHA-256 and
    the dictionary they hold (read as data, checked by :func:`open_trained`). Everything a command
    needs of the checkpoint comes from here; the file is not opened again."""

    source: str
    raw: bytes = field(repr=False)
    sha256: str
    meta: dict[str, Any] = field(repr=False)

    def build(self, data_overrides: dict[str, Any] | None = None) -> tuple[L.LightningModule, L.LightningDataModule]:
        """The model and data module the checkpoint was trained with (``data_overrides`` e.g. a new
        root), rebuilt from the bytes in memory."""
        hp, dhp = self.meta["hyper_parameters"], self.meta["datamodule_hyper_parameters"]
        try:
            model = resolve_name(hp["_class_path"]).load_from_checkpoint(io.BytesIO(self.raw), map_location="cpu",
                                                                          weights_only=True)
        except UserError as err:
            raise UserError(f"checkpoint '{self.source}': {err}") from None
        except RuntimeError as err:
            reason = state_dict_mismatch(err)
            if reason is None:
                raise
            raise UserError(f"checkpoint '{self.source}' holds weights that do not fit the model its settings build "
                            f"({reason}); the file was edited or damaged: pass {VISION_CKPT}") from None
        try:
            data = resolve_name(dhp["_class_path"]).load_from_checkpoint(io.BytesIO(self.raw), weights_only=True,
                                                                          **(data_overrides or {}))
        except UserError as err:  # a data setting the checkpoint records (or an override of it) refused
            raise UserError(f"checkpoint '{self.source}' (its data settings, with any --data overrides): {err}") from None
        return model, data


def open_trained(ckpt: str | Path) -> Trained:
    """Read a vision checkpoint once and check it.

    Everything that makes the checkpoint unusable for the vision commands (no such file, a folder,
    not a torch checkpoint, a checkpoint of another kind of model such as a causal LM) is a
    :class:`UserError` raised here, before any Trainer is built."""
    path = Path(ckpt)
    if path.is_dir():
        # A run folder, its checkpoints/ folder or an experiment folder: look a few levels down, not the whole tree.
        patterns = ("last.ckpt", "checkpoints/last.ckpt", "*/checkpoints/last.ckpt", "*/*/checkpoints/last.ckpt",
                    "*.ckpt", "checkpoints/*.ckpt", "*/checkpoints/*.ckpt", "*/*/checkpoints/*.ckpt")
        found = next((hit for pattern in patterns for hit in sorted(path.glob(pattern))), None)
        hint = f", e.g. '{found}'" if found else ""
        raise UserError(f"checkpoint '{ckpt}' is a directory; pass the checkpoint file inside it{hint}: {VISION_CKPT}")
    if not path.is_file():
        raise UserError(f"checkpoint '{ckpt}' does not exist; train first (python train.py fit ...) and pass its checkpoints/last.ckpt")
    raw = read_bytes(path, "checkpoint", f"pass {VISION_CKPT}")
    meta = read_checkpoint(path, "checkpoint", f"pass {VISION_CKPT}", raw=raw)  # as data: a crafted file runs nothing
    hp, dhp = meta.get("hyper_parameters") or {}, meta.get("datamodule_hyper_parameters")
    if "_class_path" not in hp or not dhp or "_class_path" not in dhp:
        raise UserError(f"checkpoint '{ckpt}' does not record its model and data classes; use one written by train.py")
    if not hp.get("class_names") or "group_names" not in hp:
        exported = path.parent.parent / "model"  # <run>/checkpoints/x.ckpt → <run>/model, the LM's transformers folder
        folder = f"'{exported}'" if exported.is_dir() else "<its transformers folder>"
        raise UserError(f"checkpoint '{ckpt}' is a {hp['_class_path']} checkpoint, without class and group names; the "
                        f"vision commands (prune.py vision, compare --ckpt) need {VISION_CKPT}. A causal LM is pruned "
                        f"with prune.py magnitude / wanda / sparsegpt --model {folder}")
    check_state_dict(meta, ckpt)
    if channels.CHECKPOINT_KEY in meta:  # a channel-pruned model's architecture, checked before anything is built
        channels.check_architecture(meta[channels.CHECKPOINT_KEY], meta.get("state_dict"), f"checkpoint '{ckpt}'")
    return Trained(str(ckpt), raw, hashlib.sha256(raw).hexdigest(), meta)


def load_trained(ckpt: str | Path, data_overrides: dict[str, Any] | None = None) -> tuple[L.LightningModule, L.LightningDataModule]:
    """The model and data module a checkpoint was trained with (``data_overrides`` e.g. a new root),
    the checkpoint checked as :func:`open_trained` checks it."""
    return open_trained(ckpt).build(data_overrides)


#: State-dict entries that hold floating-point values in every model (a weight read as integers
#: would be copied into the model silently, rounded).
FLOAT_ENTRIES = ("weight", "bias", "weight_orig", "running_mean", "running_var")


def check_state_dict(meta: dict[str, Any], ckpt: str | Path) -> None:
    """The checkpoint's weights are a mapping of names to tensors, the weights, biases and
    BatchNorm statistics floating-point: one line naming the entry otherwise."""
    import torch

    state = meta.get("state_dict")
    if not isinstance(state, dict) or not state:
        raise UserError(f"checkpoint '{ckpt}' holds no weights (state_dict is {type(state).__name__}); pass {VISION_CKPT}")
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise UserError(f"checkpoint '{ckpt}': state_dict entry {key} is a {type(value).__name__}, not a tensor; "
                            f"the file was edited or damaged: pass {VISION_CKPT}")
        if str(key).rsplit(".", 1)[-1] in FLOAT_ENTRIES and not value.is_floating_point():
            raise UserError(f"checkpoint '{ckpt}': state_dict entry {key} holds {value.dtype} values, not floating-point "
                            f"weights; the file was edited or damaged: pass {VISION_CKPT}")


def checkpoint_file(ckpt: str) -> str | None:
    """The checkpoint a run reads, which its output must not replace (a folder given as ``--ckpt``
    is refused later, with the checkpoints it holds named)."""
    return ckpt if Path(ckpt).is_file() else None


def measure_items_again(folder: Path, data: DataOptions | None = None) -> None:
    """Write a cell's ``test_items.npz`` afresh (compare found it missing or bad): the model of its
    ``checkpoints/last.ckpt`` (the one its report tested) on the test split, item by item."""
    import torch

    model, datamodule = load_trained(folder / "checkpoints" / "last.ckpt", data)
    datamodule.setup("test")
    if torch.cuda.is_available():
        model = model.cuda()
    save_items(folder, item_outcomes(model, datamodule.test_dataloader()))
