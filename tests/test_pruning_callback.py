"""Iterative pruning: schedules, exact sparsity, masks that hold, resume, and every method end to end."""

from __future__ import annotations

import json
import math

import lightning as L
import pandas as pd
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fairprune.callbacks.pruning import IterativePruning, density_schedule
from fairprune.cli.prune import main as prune_main
from fairprune.errors import UserError
from fairprune.pruning import registry
from fairprune.pruning.fairgrape import layer_quota
from fairprune.pruning.masks import Target, apply_mask, prunable_targets
from fairprune.workflows.vision import load_trained, prune_vision

FAST = {"limit_train_batches": 2, "limit_val_batches": 2, "limit_test_batches": 2, "accelerator": "cpu",
        "enable_progress_bar": False}


def test_density_schedule_reaches_the_target_exactly():
    densities = density_schedule(0.9, 0.9)
    assert len(densities) == 22  # 0.9**22 < 0.1 <= 0.9**21
    assert densities[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(densities, densities[1:]))
    assert density_schedule(0.0, 0.9) == []
    assert density_schedule(0.5, 0.5) == [0.5]


@pytest.mark.parametrize("kwargs, needle", [
    ({"method": "magnitud"}, "magnitude"),
    ({"target_sparsity": 1.0}, "target_sparsity"),
    ({"keep_per_iter": 1.0}, "keep_per_iter"),
    ({"importance_fraction": 0.0}, "importance_fraction"),
])
def test_bad_settings_are_user_errors(kwargs, needle):
    with pytest.raises(UserError, match=needle):
        IterativePruning(**kwargs)


def test_pruned_weights_stay_zero_through_optimizer_steps():
    layer = torch.nn.Linear(8, 4)
    target = Target("layer", layer)
    keep = torch.rand(4, 8, generator=torch.Generator().manual_seed(0)) > 0.5
    apply_mask(target, keep)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
    for _ in range(5):
        loss = layer(torch.randn(16, 8)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.all(layer.weight[~keep] == 0)
    assert torch.all(layer.weight[keep] != 0)
    # A later, looser mask never revives a pruned weight.
    apply_mask(target, torch.ones_like(keep))
    assert torch.all(layer.weight[~keep] == 0)


@pytest.mark.parametrize("method", registry.names("vision"))
def test_every_method_prunes_to_the_target_through_the_cli(method, dense_ckpt, tmp_path):
    status = prune_main(["vision", "--ckpt", str(dense_ckpt), "--pruning.method", method,
                         "--pruning.target_sparsity", "0.75", "--pruning.keep_per_iter", "0.5",
                         "--output", str(tmp_path), "--trainer", json.dumps(FAST)])
    assert status == 0
    run = tmp_path / method
    report = json.loads((run / "report.json").read_text())
    assert report["method"] == method and report["split"] == "test"
    assert len(report["steps"]) == 2
    # Degradation against the compute-matched reference; the dense checkpoint's figures beside it.
    assert report["reference"]["method"] == "continued" and report["reference"]["groups"] and report["dense"]["groups"]
    assert "degradation_std" in report["fairness"]
    layers = pd.read_csv(run / "sparsity.csv")
    if registry.get(method, "vision").scope == "per-layer":
        expected = layers["numel"] - layers["numel"].map(lambda n: layer_quota(n, 0.25))
        assert (layers["zeros"] >= expected).all()  # exact, unless training drove a kept weight to 0
        assert (layers["zeros"] - expected).sum() <= 2
    assert report["achieved_sparsity"] == pytest.approx(0.75, abs=1e-3)
    metrics = pd.read_csv(run / "metrics.csv")
    assert "prune/sparsity" in metrics and "val/degradation_std" in metrics
    if method == "fairgrape":
        shares = pd.read_csv(run / "group_shares.csv")
        assert set(shares["group"]) == set(report["groups"])


def test_unsupervised_groups_from_kmeans(dense_ckpt, tmp_path):
    report = prune_vision(dense_ckpt, {"method": "fairgrape", "target_sparsity": 0.5, "keep_per_iter": 0.5,
                                       "groups": "kmeans", "num_clusters": 3}, tmp_path, trainer=FAST)
    assert report["groups_from"] == "kmeans"
    assert report["achieved_sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert set(report["groups"]) == {"White", "Black", "Asian", "Indian"}  # evaluated on the true groups
    shares = pd.read_csv(tmp_path / "fairgrape" / "group_shares.csv")
    assert set(shares["group"]) == {"cluster0", "cluster1", "cluster2"}


class _Kill(L.Callback):
    """Stops a fit at the start of an epoch, as a crash would."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            raise RuntimeError("killed")


def _fit(ckpt, folder, kill_at=None, resume=None):
    L.seed_everything(0, verbose=False)
    model, data = load_trained(ckpt)
    callback = IterativePruning("fairgrape", target_sparsity=0.8, keep_per_iter=0.5, seed=0)
    callbacks = [callback, ModelCheckpoint(dirpath=folder, save_last=True)]
    if kill_at is not None:
        callbacks.append(_Kill(kill_at))
    trainer = L.Trainer(max_epochs=callback.last_epoch_needed, logger=False, callbacks=callbacks,
                        default_root_dir=folder, enable_model_summary=False, **FAST)
    trainer.fit(model, datamodule=data, ckpt_path=resume, weights_only=False)
    return {t.name: t.mask.clone() for t in prunable_targets(model)}


@pytest.mark.parametrize("kill_at", [1, 2])
def test_resume_reaches_the_same_mask(dense_ckpt, tmp_path, kill_at):
    straight = _fit(dense_ckpt, tmp_path / "a")
    assert (tmp_path / "a" / "group_shares.csv").is_file()  # in default_root_dir, not the working directory
    with pytest.raises(RuntimeError, match="killed"):
        _fit(dense_ckpt, tmp_path / "b", kill_at=kill_at)
    resumed = _fit(dense_ckpt, tmp_path / "b", resume=str(tmp_path / "b" / "last.ckpt"))
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    kept = sum(int(m.sum()) for m in straight.values()) / sum(m.numel() for m in straight.values())
    assert math.isclose(kept, 0.2, abs_tol=1e-3)
