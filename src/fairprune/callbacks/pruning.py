"""Iterative pruning during training: FairGRAPE and its baselines as one Lightning callback.

Schedule: dense training for ``start_epoch`` epochs, then a pruning step every ``retrain_epochs``
epochs; each step keeps ``keep_per_iter`` of the remaining weights (density ``keep_per_iter**i``)
until the density reaches ``1 − target_sparsity`` exactly, and the model retrains between steps.
Pruned weights never return: masks live in ``torch.nn.utils.prune`` reparametrisations (see
:mod:`fairprune.pruning.masks`), so checkpoints carry them and optimizer steps keep them at zero.

Methods:

- ``fairgrape``: per-group importance ``(g·w)²`` and greedy selection that keeps each group's share
  of importance, per layer (:mod:`fairprune.pruning.fairgrape`);
- ``magnitude`` (WS, per layer), ``random`` (per layer), ``lottery`` (per-layer magnitude, then the
  kept weights rewind to their values at ``rewind_epoch``);
- ``snip`` (|g·w|, one batch, global) and ``grasp`` (−w·Hg, global).

Selection is the tested library code: FairGRAPE's :func:`~fairprune.pruning.fairgrape.select_layer_mask`,
and :func:`fairprune.pruning.select.top_k` for the others (per layer or over all layers; ties keep
the lower index; a pruned weight is never revived).

At the first step the dense model is measured on the validation and test splits (the report's
``dense``). Degradation is measured against the *reference*: by default that dense model, or — when
the workflow gives one through :meth:`IterativePruning.use_reference` — the compute-matched
reference, the dense model trained on for as many epochs as the schedule retrains
(:mod:`fairprune.workflows.reference`), so that extra training is not mistaken for a cost or a gain
of pruning. From the first step on every validation logs each group's degradation and their std /
variance; the report carries the figures under ``reference`` (with its ``method``: ``dense`` or
``continued``) and the dense model's under ``dense``.

BatchNorm recalibration (``bn_recalibration`` batches, 0 = off): at the end of every training epoch
once pruning has begun — after each step's retraining, the last one included — the BatchNorm
running statistics are re-estimated over that many training batches, so the epoch's validation, its
checkpoint, the next step's scores and the final test all read statistics of the current weights
(:func:`fairprune.pruning.batchnorm.recalibrate_batchnorm`; under DDP each process forwards its
share and the statistics are summed, so every replica holds the same ones). Right after a step,
before retraining, nothing reads them (training normalises with batch statistics and overwrites the
running ones), so no recalibration is spent there.

``granularity: channel`` removes whole channels instead of masking weights, the model becoming
smaller; sparsity is then the fraction of prunable channels removed
(:mod:`fairprune.callbacks.channels`, :mod:`fairprune.pruning.channels`).
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DistributedSampler

from fairprune import distributed
from fairprune.callbacks.channels import channel_step, check_run, check_settings
from fairprune.callbacks.guards import learning_rate, nonfinite_tensor
from fairprune.errors import UserError
from fairprune.metrics.group import GroupRates, result_values
from fairprune.pruning import channels, registry
from fairprune.pruning.batchnorm import batchnorm_layers, recalibrate_batchnorm
from fairprune.pruning.masks import Target, achieved_sparsity, apply_mask, prunable_targets
from fairprune.pruning.sparsity import Sparsity
from fairprune.pruning.steps import ScoreContext


def density_schedule(target_sparsity: float, keep_per_iter: float) -> list[float]:
    """Densities after each step: ``keep**1, keep**2, ...`` clipped to ``1 − target`` at the end."""
    final = 1.0 - target_sparsity
    densities, d = [], 1.0
    while d > final + 1e-12:
        d = max(d * keep_per_iter, final)
        densities.append(d)
    return densities


class IterativePruning(L.Callback):
    """Prune iteratively while training, with retraining between steps.

    Args:
        method: a vision method of the registry (``fairgrape, magnitude, snip, grasp, random, lottery``
            or one registered with ``fairprune.pruning.registry.register``).
        target_sparsity: final fraction of zeros in every targeted layer (over all of them for a
            method of global scope: snip, grasp).
        keep_per_iter: fraction of the remaining weights kept per step (FairGRAPE: 0.9).
        retrain_epochs: epochs of retraining after each step.
        start_epoch: dense epochs before the first step (0 when pruning a trained model).
        importance_fraction: share of the training set used to score weights (group-stratified).
        groups: ``labels`` (the data's sensitive attribute) or ``kmeans`` (clusters of backbone
            embeddings, for data without group labels; evaluation still uses true labels).
        num_clusters: clusters for ``groups: kmeans`` (default: the data's number of groups).
        include_first / include_classifier: prune the first layer / the last Linear too.
        score_batches: batches used by SNIP and GraSP.
        rewind_epoch: lottery ticket: epoch whose starting weights the kept weights rewind to.
        seed: seeds random pruning and k-means.
        bn_recalibration: training batches over which BatchNorm running statistics are
            re-estimated at the end of every retraining epoch, the last included (0: never).
        granularity: weight (masks single weights) or channel (removes whole channels: a smaller
            network; sparsity is then the fraction of prunable channels removed).
        min_channels: channel granularity: channels every coupled channel group keeps at least.
        channel_multiple: channel granularity: per-group kept counts rounded up to a multiple of this (default 8: what CPU kernels block by, so the pruned network runs faster; 1: no rounding, counts as the ratio leaves them, often slower than dense in ONNX Runtime).
    """

    def __init__(
        self,
        method: str = "fairgrape",
        target_sparsity: float = 0.9,
        keep_per_iter: float = 0.9,
        retrain_epochs: int = 1,
        start_epoch: int = 0,
        importance_fraction: float = 0.2,
        groups: str = "labels",
        num_clusters: int | None = None,
        include_first: bool = True,
        include_classifier: bool = True,
        score_batches: int = 1,
        rewind_epoch: int = 0,
        seed: int = 0,
        bn_recalibration: int = 20,
        granularity: str = "weight",
        min_channels: int = 1, channel_multiple: int = 8,
    ) -> None:
        self.entry = registry.get(method, "vision")
        check_settings(self.entry, granularity, min_channels, channel_multiple)
        target_sparsity = Sparsity.parse(target_sparsity, what="target_sparsity", nm=False).fraction
        if not 0.0 < keep_per_iter < 1.0:
            raise UserError(f"keep_per_iter must be in (0, 1), got {keep_per_iter}; FairGRAPE uses 0.9")
        if retrain_epochs < 1 or start_epoch < 0 or score_batches < 1:
            raise UserError("retrain_epochs and score_batches must be >= 1 and start_epoch >= 0")
        if not 0.0 < importance_fraction <= 1.0:
            raise UserError(f"importance_fraction must be in (0, 1], got {importance_fraction}")
        if not isinstance(bn_recalibration, int) or isinstance(bn_recalibration, bool) or bn_recalibration < 0:
            raise UserError(f"bn_recalibration is a number of batches, 0 or more (0: off), got {bn_recalibration!r}")
        if groups not in ("labels", "kmeans"):
            raise UserError(f"groups must be 'labels' or 'kmeans', got '{groups}'")
        self.method, self.target_sparsity, self.keep_per_iter = method, target_sparsity, keep_per_iter
        self.retrain_epochs, self.start_epoch = retrain_epochs, start_epoch
        self.importance_fraction, self.groups, self.num_clusters = importance_fraction, groups, num_clusters
        self.include_first, self.include_classifier = include_first, include_classifier
        self.score_batches, self.rewind_epoch, self.seed = score_batches, rewind_epoch, seed
        self.bn_recalibration = bn_recalibration
        self.granularity, self.min_channels, self.channel_multiple = granularity, min_channels, channel_multiple
        self.recalibrations: list[dict[str, Any]] = []
        self._recal_loader = None
        self.densities = density_schedule(target_sparsity, keep_per_iter)
        self.steps_done = 0
        self.reference: dict[str, Any] | None = None  # per split: what degradation is measured against
        self.dense: dict[str, Any] | None = None  # per split: the dense model at the first step
        self.reference_method, self.reference_facts = "dense", {}
        self._given_reference: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []
        self.shares: list[dict[str, Any]] = []
        self._rewind: dict[str, torch.Tensor] | None = None
        self._group_labels: list[str] = []

    # -- schedule --------------------------------------------------------------------------------
    @property
    def last_epoch_needed(self) -> int:
        """Epochs a fit needs to take every step and retrain after the last one."""
        return self.start_epoch + len(self.densities) * self.retrain_epochs

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from fairprune.callbacks.report import run_dir

        run_dir(trainer)  # resolved on every process (a collective under DDP); rank 0 writes with it later

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        needed = self.last_epoch_needed
        if trainer.max_epochs is not None and 0 <= trainer.max_epochs < needed:
            print(f"[prune] {len(self.densities)} pruning steps need {needed} epochs; raising max_epochs from {trainer.max_epochs}")
            trainer.fit_loop.max_epochs = needed
        self._push_reference(pl_module)  # after a resume, the restored reference goes back to the metrics
        datamodule = trainer.datamodule
        if self.groups == "labels" and getattr(datamodule, "hparams", {}).get("sensitive", "x") is None:
            raise UserError("the data has no sensitive attribute; set data.sensitive or use the callback's groups: kmeans")
        if self.granularity == "channel":
            check_run(trainer, pl_module)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        epoch = trainer.current_epoch
        if self.entry.rewind and epoch == self.rewind_epoch and self._rewind is None:
            self._rewind = {t.name: _weight_param(t).detach().clone() for t in self._targets(pl_module)}
        due = self.start_epoch + self.steps_done * self.retrain_epochs
        if self.steps_done < len(self.densities) and epoch >= due:
            self.prune_step(trainer, pl_module)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        seed_epoch(self.seed, trainer.current_epoch, batch_idx)

    def use_reference(self, figures: dict[str, Any], facts: dict[str, Any]) -> None:
        """Measure degradation against ``figures`` (per split, as :func:`evaluate` returns them:
        the compute-matched reference) instead of the dense model at the first step; ``facts``
        (epochs, cache) go into the report beside them."""
        self._given_reference, self.reference_method, self.reference_facts = figures, "continued", dict(facts)

    # -- one step --------------------------------------------------------------------------------
    def _targets(self, pl_module: L.LightningModule) -> list[Target]:
        return prunable_targets(pl_module, include_first=self.include_first, include_classifier=self.include_classifier)

    def prune_step(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        density = self.densities[self.steps_done]
        bad = nonfinite_tensor(pl_module)  # NaN weights cannot be scored (and NaN·0 hides a mask)
        if bad is not None:
            lr = learning_rate(trainer)
            raise UserError(f"pruning step {self.steps_done + 1} at epoch {trainer.current_epoch}: weight {bad} is NaN / inf; "
                            f"training diverged (the learning rate{f' {lr:g}' if lr is not None else ''} is likely too high: "
                            "lower it and train again)")
        was_training = pl_module.training
        pl_module.eval()  # deterministic scores: no dropout, BatchNorm uses running statistics
        start = time.perf_counter()
        if self.reference is None:
            self._set_reference(trainer, pl_module)
        if self.granularity == "channel":
            self._channel_step(trainer, pl_module, density, start)
            pl_module.train(was_training)
            return
        targets = self._targets(pl_module)
        # Every process scores the whole importance set as one process would (no sharding, no
        # reduction: the scores are bitwise one process's), then takes rank 0's masks, so the
        # replicas can never prune differently (rank 0's checkpoint is the run's).
        with torch.enable_grad(), distributed.local():
            scores = self._scores(trainer, pl_module, targets)
        scored = time.perf_counter()
        keeps = trainer.strategy.broadcast(self._select(targets, scores, density), src=0)
        for target, keep in zip(targets, keeps):
            apply_mask(target, keep)
        if self.entry.rewind and self._rewind is not None:
            with torch.no_grad():
                for t in targets:
                    _weight_param(t).copy_(self._rewind[t.name].to(_weight_param(t).device))
        selected = time.perf_counter()
        self.steps_done += 1
        pl_module.train(was_training)
        entry = {
            "step": self.steps_done, "epoch": trainer.current_epoch, "density": density,
            "achieved_sparsity": achieved_sparsity(targets),
            "seconds_importance": scored - start, "seconds_selection": selected - scored,
        }
        self.history.append(entry)
        print(f"[prune] {self.method} step {entry['step']}/{len(self.densities)} at epoch {entry['epoch']}: "
              f"sparsity {entry['achieved_sparsity']:.4f} (importance {entry['seconds_importance']:.1f} s, "
              f"selection {entry['seconds_selection']:.1f} s)", flush=True)

    def _channel_step(self, trainer: L.Trainer, pl_module: L.LightningModule, density: float, start: float) -> None:
        """One step at channel granularity (:func:`fairprune.callbacks.channels.channel_step`)."""
        def score(targets: list[Target]) -> dict[str, torch.Tensor]:
            with torch.enable_grad(), distributed.local():
                return self._scores(trainer, pl_module, targets)

        shares, scored = channel_step(trainer, pl_module, self.entry, density, self._targets(pl_module), score,
                                      self.include_first, self.min_channels, self.channel_multiple)
        self.shares += [{**share, "step": self.steps_done + 1} for share in shares]
        selected = time.perf_counter()
        self.steps_done += 1
        entry = {"step": self.steps_done, "epoch": trainer.current_epoch, "density": density,
                 "achieved_sparsity": channels.channel_sparsity(pl_module.architecture),
                 "parameters": channels.parameter_count(pl_module),
                 "seconds_importance": scored - start, "seconds_selection": selected - scored}
        self.history.append(entry)
        print(f"[prune] {self.method} step {entry['step']}/{len(self.densities)} at epoch {entry['epoch']}: channel "
              f"sparsity {entry['achieved_sparsity']:.4f}, {entry['parameters']:,} of "
              f"{pl_module.architecture['dense_parameters']:,} parameters (importance {entry['seconds_importance']:.1f} s, "
              f"selection {entry['seconds_selection']:.1f} s)", flush=True)

    # -- BatchNorm recalibration -----------------------------------------------------------------
    def recalibrate(self, trainer: L.Trainer, pl_module: L.LightningModule, after: str) -> None:
        """Re-estimate the BatchNorm running statistics over ``bn_recalibration`` training batches
        (every process calls it: under DDP the statistics are summed across processes)."""
        if self.bn_recalibration == 0 or not batchnorm_layers(pl_module):
            return
        if self._recal_loader is None:
            # A loader of its own (the whole training set, the same order on every process), so the
            # fit's running iterator is never touched.
            self._recal_loader = trainer.datamodule.train_dataloader()
        start = time.perf_counter()
        used = recalibrate_batchnorm(pl_module, self._recal_loader, self.bn_recalibration, pl_module.device)
        self.recalibrations.append({"after": after, "epoch": trainer.current_epoch, "batches": used,
                                    "seconds": time.perf_counter() - start})

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # The end of every training epoch once pruning has begun (the retraining after each step,
        # the last one included): before the epoch's validation, its checkpoint and the next step's
        # scores, the only readers of the running statistics.
        last_batch = batch_idx + 1 >= trainer.num_training_batches or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if self.steps_done and last_batch:
            self.recalibrate(trainer, pl_module, f"epoch {trainer.current_epoch}")

    def _set_reference(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Measure the dense model on the validation and test splits (each split's degradation is
        taken against the dense model on that same split)."""
        dm = trainer.datamodule
        self.dense = {stage: evaluate(pl_module, getattr(dm, f"{stage}_dataloader")()) for stage in ("val", "test")}
        self.reference = self._given_reference or self.dense
        self._push_reference(pl_module)

    def _push_reference(self, pl_module: L.LightningModule) -> None:
        for stage, results in (self.reference or {}).items():
            pl_module.set_reference({g: v["accuracy"] for g, v in results["groups"].items() if "accuracy" in v}, stage=stage)

    def _importance_loader(self, trainer: L.Trainer, pl_module: L.LightningModule):
        loader = trainer.datamodule.importance_dataloader(self.importance_fraction, seed=self.seed)
        if self.groups == "labels":
            found = loader, len(pl_module.group_names), list(pl_module.group_names)
        else:
            found = kmeans_groups(pl_module, loader, self.num_clusters or len(pl_module.group_names), self.seed)
        self._group_labels = found[2]
        return found

    def _scores(self, trainer: L.Trainer, pl_module: L.LightningModule, targets: list[Target]) -> dict[str, torch.Tensor]:
        context = ScoreContext(
            model=pl_module, targets=targets, device=pl_module.device,
            data=lambda: self._importance_loader(trainer, pl_module),
            seed=self.seed + self.steps_done, batches=self.score_batches,
            progress=trainer.progress_bar_callback is not None and trainer.is_global_zero)  # enable_progress_bar
        return self.entry.score(context)

    def _select(self, targets: list[Target], scores: dict[str, torch.Tensor], density: float) -> list[torch.Tensor]:
        """Keep masks (True = keep) at ``density`` of every layer (of all of them for a global
        method), never reviving a pruned weight; FairGRAPE's group shares are kept for the report."""
        choice = self.entry.select(targets, scores, density)
        self.shares += [{"layer": t.name, "step": self.steps_done + 1, **share} for t, share in zip(targets, choice.shares)]
        return choice.keeps

    # -- logging, report, resume -----------------------------------------------------------------
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            pl_module.log("prune/sparsity", channels.channel_sparsity(pl_module.architecture) if self.granularity == "channel"
                          else achieved_sparsity(self._targets(pl_module)))  # channels removed / weights zero
            pl_module.log("prune/steps_done", float(self.steps_done))

    def share_rows(self) -> list[dict[str, Any]]:
        """FairGRAPE's kept share of each group's importance per layer and step, against its target."""
        return [{"layer": s["layer"], "step": s["step"], "group": g, "target": t, "share": sh}
                for s in self.shares for g, t, sh in zip(self._group_labels, s["target"], s["share"])]

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.shares and trainer.is_global_zero:
            import pandas as pd

            from fairprune.callbacks.report import run_dir
            from fairprune.storage.atomic import write_csv

            write_csv(run_dir(trainer) / "group_shares.csv", pd.DataFrame(self.share_rows()), index=False)

    def report_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"method": self.method, "target_sparsity": self.target_sparsity,
                                  "keep_per_iter": self.keep_per_iter, "steps": self.history,
                                  "groups_from": self.groups, "granularity": self.granularity,
                                  **({"min_channels": self.min_channels, "channel_multiple": self.channel_multiple}
                                     if self.granularity == "channel" else {})}
        if self.reference is not None:
            fields["reference"] = {"method": self.reference_method, **self.reference_facts, **self.reference}
        if self.dense is not None:
            fields["dense"] = {"method": "dense", **self.dense}
        fields["bn_recalibration"] = {"batches": self.bn_recalibration, "done": self.recalibrations}
        fields["seconds"] = {
            "importance": sum(h["seconds_importance"] for h in self.history),
            "selection": sum(h["seconds_selection"] for h in self.history),
            "bn_recalibration": sum(r["seconds"] for r in self.recalibrations),
        }
        return fields

    def state_dict(self) -> dict[str, Any]:
        return {"steps_done": self.steps_done, "reference": self.reference, "dense": self.dense,
                "reference_method": self.reference_method, "reference_facts": self.reference_facts, "history": self.history,
                "rewind": self._rewind, "method": self.method, "densities": self.densities, "granularity": self.granularity,
                "shares": self.shares, "group_labels": self._group_labels, "recalibrations": self.recalibrations}  # a resumed run's group_shares.csv keeps every step

    def check_state(self, state: dict[str, Any], source: str = "the checkpoint") -> None:
        """Refuse, in one line, the saved state of a run with another method or schedule: resuming
        it would shift or mix the pruning steps."""
        if state.get("method") != self.method or state.get("densities") != self.densities:
            raise UserError(f"{source} was pruned with {_schedule(state.get('method'), state.get('densities'))}, this "
                            f"run with {_schedule(self.method, self.densities)}: another method or schedule; resume "
                            "with the same pruning settings, or start afresh")
        if state.get("granularity", "weight") != self.granularity:
            raise UserError(f"{source} was pruned at granularity {state.get('granularity', 'weight')}, this run prunes at "
                            f"{self.granularity}; resume with the same pruning settings, or start afresh")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.steps_done, self.reference, self.history = state["steps_done"], state["reference"], state["history"]
        self.dense = state.get("dense", self.reference)
        self.reference_method = state.get("reference_method", "dense")
        self.reference_facts = dict(state.get("reference_facts", {}))
        self._rewind = state.get("rewind")
        self.shares, self._group_labels = list(state.get("shares", [])), list(state.get("group_labels", []))
        self.recalibrations = list(state.get("recalibrations", []))



def seed_epoch(seed: int, epoch: int, batch_idx: int) -> None:
    """Randomness inside an epoch (dropout) depends only on (seed, epoch), so a run resumed from a
    checkpoint retrains exactly as an uninterrupted one and reaches the same masks (and the
    compute-matched reference trains under the same rule)."""
    if batch_idx == 0:
        L.seed_everything(seed * 1_000_003 + epoch, verbose=False)


class EpochSeeds(L.Callback):
    """:func:`seed_epoch` for a fit without pruning (the compute-matched reference)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        seed_epoch(self.seed, trainer.current_epoch, batch_idx)


def _schedule(method: Any, densities: Any) -> str:
    """A pruning schedule in words, for messages."""
    if not isinstance(densities, list) or not densities:
        return f"method {method}, no pruning steps"
    return f"method {method}, {len(densities)} step(s), densities {densities[0]:.4g} to {densities[-1]:.4g}"


def _weight_param(t: Target) -> torch.Tensor:
    return getattr(t.module, "weight_orig", t.module.weight)


@torch.no_grad()
def evaluate(pl_module: L.LightningModule, loader) -> dict[str, Any]:
    """Per-group figures of ``pl_module`` on ``loader`` (used for the dense reference), nested as
    reports hold them.

    Under DDP every process must call it: a loader with a ``DistributedSampler`` (the data
    modules' unpadded evaluation shards) is this process's share and the counts are summed over
    the processes; any other loader is the whole split on every process and is not summed."""
    metric = GroupRates(len(pl_module.class_names), len(pl_module.group_names), pl_module.group_names).to(pl_module.device)
    for x, y, g in loader:
        metric.update(pl_module(x.to(pl_module.device)), y.to(pl_module.device), g.to(pl_module.device))
    return result_values(metric.result(sync=isinstance(getattr(loader, "sampler", None), DistributedSampler)))


@torch.no_grad()
def kmeans_groups(pl_module: L.LightningModule, loader, clusters: int, seed: int):
    """Replace group labels by k-means clusters of the backbone's penultimate embeddings."""
    from sklearn.cluster import KMeans

    batches = [(x, y) for x, y, _ in loader]
    feats = torch.cat([pl_module.embed(x.to(pl_module.device)).cpu() for x, _ in batches]).numpy()
    labels = torch.as_tensor(KMeans(n_clusters=clusters, random_state=seed, n_init=10).fit_predict(feats))
    out, start = [], 0
    for x, y in batches:
        out.append((x, y, labels[start: start + len(y)]))
        start += len(y)
    return out, clusters, [f"cluster{k}" for k in range(clusters)]
