"""Vision classifier: a backbone by name, trained with Lightning, measured per demographic group.

A batch is ``(images, targets, groups)``; ``groups`` holds the sensitive-attribute index of each
sample (``-1`` where unknown). Every validation and test epoch logs the group-fairness metrics
under stable names (``val/acc/<group>``, ``val/fpr/<group>``, ``val/acc_gap``, ...; for binary
tasks also ``val/demographic_parity`` and ``val/equal_opportunity``), and, once a reference (the
dense model's per-group accuracy) is set, each group's degradation and their standard deviation.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import timm
import torch
import torchvision
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn

from fairprune.errors import UserError, suggest
from fairprune.models.grouped import GroupEvaluation
from fairprune.pruning import channels
from fairprune.pruning.masks import attach_masks_for, ordered_parameters


def _torchvision_names() -> list[str]:
    return torchvision.models.list_models(module=torchvision.models)


def _is_timm(model: nn.Module) -> bool:
    """A timm model: it splits its forward into ``forward_features`` and ``forward_head``."""
    return callable(getattr(model, "forward_features", None)) and callable(getattr(model, "forward_head", None))


def _last_linear(model: nn.Module) -> tuple[str, nn.Linear]:
    """The classifier layer: the last ``nn.Linear`` in registration order."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not found:
        raise UserError(f"backbone {type(model).__name__} has no Linear classifier layer; choose a classification backbone")
    return found[-1]


def build_backbone(name: str, num_classes: int, pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """Build a classification network by name.

    ``name`` may carry a source prefix (``torchvision:resnet34``, ``timm:convnext_atto``); without
    one, torchvision's builder is used when it knows the name (the FairGRAPE paper's ResNet-34 and
    MobileNet-V2 are torchvision's), else timm's. Weights are random unless ``pretrained`` is set,
    in which case ImageNet weights are loaded and only the classifier is replaced (timm builds its
    own head for ``num_classes``; a torchvision model gets a new last ``nn.Linear``). ``kwargs`` go
    to the builder (e.g. ``width_mult=0.5`` for torchvision's MobileNet-V2).
    """
    source, _, bare = name.rpartition(":")
    tv_names, timm_names = _torchvision_names(), None
    if source in ("", "torchvision") and bare in tv_names:
        weights = "DEFAULT" if pretrained else None
        if pretrained:
            model = torchvision.models.get_model(bare, weights=weights, **kwargs)
            path, old = _last_linear(model)
            parent = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
            setattr(parent, path.rpartition(".")[2], nn.Linear(old.in_features, num_classes))
            return model
        return torchvision.models.get_model(bare, weights=None, num_classes=num_classes, **kwargs)
    if source in ("", "timm"):
        timm_names = timm.list_models()
        if bare in timm_names or timm.is_model(bare):
            return timm.create_model(bare, pretrained=pretrained, num_classes=num_classes, **kwargs)
    if source not in ("", "timm", "torchvision"):
        raise UserError(f"unknown backbone source '{source}' in '{name}'; use 'torchvision:<name>', 'timm:<name>' or a bare name")
    timm_names = timm_names or timm.list_models()
    raise UserError(
        f"unknown backbone '{name}'{suggest(bare, tv_names + timm_names)}; "
        "any torchvision classification model or timm model name works"
    )


class VisionClassifier(GroupEvaluation, L.LightningModule):
    """Image classifier whose every evaluation is broken down by demographic group.

    Args:
        backbone: model name (``mobilenet_v2``, ``resnet34``, ``timm:resnet18``, ...).
        class_names: the target classes (linked from the data module by the CLI).
        group_names: the sensitive-attribute groups (linked from the data module by the CLI).
        pretrained: load ImageNet weights (downloads once through torchvision / timm).
        optimizer: optimizer factory, configurable from YAML (``class_path`` / ``init_args``).
        scheduler: optional learning-rate scheduler factory.
        label_smoothing: cross-entropy label smoothing.
        backbone_kwargs: extra arguments for the backbone builder (``{width_mult: 0.5}``).
    """

    def __init__(
        self,
        backbone: str = "mobilenet_v2",
        class_names: list[str] | None = None,
        group_names: list[str] | None = None,
        pretrained: bool = False,
        optimizer: OptimizerCallable = lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=1e-4),
        scheduler: LRSchedulerCallable | None = None,
        label_smoothing: float = 0.0,
        backbone_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if not class_names or len(class_names) < 2:
            raise UserError("VisionClassifier needs at least two class_names (the CLI links them from the data module)")
        self.save_hyperparameters()
        self.class_names = list(class_names)
        self.group_names = list(group_names or ["all"])
        self.net = build_backbone(backbone, len(self.class_names), pretrained, **(backbone_kwargs or {}))
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.loss = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.init_group_metrics(self.class_names, self.group_names)
        # The channel-pruned architecture as plain data (fairprune.pruning.channels.architecture);
        # None while the network is the one the hyper-parameters build.
        self.architecture: dict[str, Any] | None = None

    # -- model ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @torch.no_grad()
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate features (the classifier's input), used to cluster samples into groups.

        timm models give them themselves (``forward_head(..., pre_logits=True)``); for torchvision
        models they are the input of the last ``nn.Linear``, caught by a forward pre-hook.
        """
        if _is_timm(self.net):
            return self.net.forward_head(self.net.forward_features(x), pre_logits=True).flatten(1)
        _, head = _last_linear(self.net)
        captured: list[torch.Tensor] = []
        handle = head.register_forward_pre_hook(lambda _m, args: captured.append(args[0].flatten(1)))
        try:
            self.net(x)
        finally:
            handle.remove()
        return captured[0]

    def dense_weight_numels(self) -> dict[str, int]:
        """Entries of every Conv2d / Linear weight in the network the hyper-parameters build (before
        any channel was removed), by module name (``net.<path>``); built on the meta device, so it
        costs no memory and downloads nothing."""
        hp = self.hparams
        with torch.device("meta"):
            dense = build_backbone(hp.backbone, len(self.class_names), False, **(hp.backbone_kwargs or {}))
        return {f"net.{name}": module.weight.numel() for name, module in dense.named_modules()
                if isinstance(module, (nn.Conv2d, nn.Linear))}

    # -- reference for degradation ---------------------------------------------------------------
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A pruned checkpoint holds weight_orig / weight_mask: mirror that before the state loads.
        attach_masks_for(self, checkpoint["state_dict"])
        # A channel-pruned one holds its architecture: remove the same channels before the state loads.
        record = checkpoint.get(channels.CHECKPOINT_KEY)
        if channels.CHECKPOINT_KEY in checkpoint:
            channels.check_architecture(record, checkpoint.get("state_dict"))  # before anything is built from it
            channels.apply_architecture(self, record, dense=not self.architecture)
            self.architecture = record

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.architecture:
            checkpoint[channels.CHECKPOINT_KEY] = self.architecture

    def report_fields(self) -> dict[str, Any]:
        """A channel-pruned model's granularity, channel sparsity and parameter counts (for reports)."""
        return channels.report_fields(self, self.architecture) if self.architecture else {}

    # -- steps -----------------------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        loss = self.loss(self(x), y)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=len(y))
        return loss

    def _eval_step(self, stage: str, batch: Any) -> None:
        x, y, g = batch
        logits = self(x)
        # sync_dist: under DDP every rank sees the same figure (it drives the LR scheduler's monitor).
        self.log(f"{stage}/loss", self.loss(logits, y), prog_bar=stage == "val", batch_size=len(y), sync_dist=True)
        self.update_group_metrics(stage, logits, y, g)

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(ordered_parameters(self))
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer), "monitor": "val/loss"}}
