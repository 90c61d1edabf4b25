"""Channel (structured) pruning with a real Trainer and the real CLI: the optimizer rebuilt over the
smaller model after each step, resume, checkpoints that reload into the smaller architecture
(identical outputs), prune.py vision --pruning.granularity channel then train.py test on its
checkpoint, and prune.py compare over granularities."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pandas as pd
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fairprune.callbacks.pruning import IterativePruning
from fairprune.cli.prune import main as prune_main
from fairprune.cli.train import main as train_main
from fairprune.pruning import channels
from fairprune.storage.checkpoints import read_checkpoint
from fairprune.workflows.vision import _RecordClasses, load_trained

ROOT = Path(__file__).resolve().parents[1]
FAST = {"limit_train_batches": 2, "limit_val_batches": 2, "limit_test_batches": 2, "accelerator": "cpu",
        "enable_progress_bar": False, "enable_model_summary": False}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models on a shared 2-core machine: one thread."""


class _Watch(L.Callback):
    """After every training epoch: the optimizer holds exactly the model's parameters (rebuilt
    after a step), and training changed them."""

    def __init__(self, kill_at: int | None = None) -> None:
        self.kill_at, self.epochs, self.lrs = kill_at, [], []

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.kill_at:
            raise RuntimeError("killed")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:  # after the callback's pruning step of this epoch
            self.start = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_epoch_end(self, trainer, pl_module):
        optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
        assert optimized == {id(p) for p in pl_module.parameters()}
        changed = [n for n, p in pl_module.named_parameters() if n.endswith("weight") and not torch.equal(p, self.start[n])]
        self.epochs.append((channels.parameter_count(pl_module), len(changed)))
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def _fit(ckpt, folder, kill_at=None, resume=None):
    L.seed_everything(0, verbose=False)
    model, data = load_trained(ckpt)
    callback = IterativePruning("fairgrape", target_sparsity=0.5, keep_per_iter=0.7, granularity="channel",
                                bn_recalibration=2, seed=0)
    watch = _Watch(kill_at)
    trainer = L.Trainer(max_epochs=callback.last_epoch_needed, logger=False, default_root_dir=folder,
                        callbacks=[callback, watch, ModelCheckpoint(dirpath=folder, save_last=True),
                                   _RecordClasses(read_checkpoint(ckpt))], **FAST)
    trainer.fit(model, datamodule=data, ckpt_path=resume, weights_only=True)
    return model, data, watch


def test_trainer_rebuilds_the_optimizer_resumes_and_reloads_the_smaller_model(dense_ckpt, tmp_path):
    model, data, watch = _fit(dense_ckpt, tmp_path / "a")
    dense = model.architecture["dense_parameters"]
    assert len(watch.epochs) == 2 and dense > watch.epochs[0][0] > watch.epochs[1][0]
    assert all(changed > 0 for _, changed in watch.epochs)  # the rebuilt optimizer trains the new parameters
    assert channels.channel_sparsity(model.architecture) == pytest.approx(0.5, abs=0.01)

    # Reloaded through the project's loader (weights only): the smaller architecture, the same outputs.
    reloaded, _ = load_trained(tmp_path / "a" / "last.ckpt")
    assert reloaded.architecture == model.architecture
    x = next(iter(data.val_dataloader()))[0]
    model.eval()
    reloaded.eval()
    with torch.no_grad():
        assert torch.equal(model(x), reloaded(x))
    assert channels.parameter_count(reloaded) == channels.parameter_count(model) < dense

    # Killed after the first step's epoch, resumed: the same architecture as the straight run.
    with pytest.raises(RuntimeError, match="killed"):
        _fit(dense_ckpt, tmp_path / "b", kill_at=1)
    resumed, _, _ = _fit(dense_ckpt, tmp_path / "b", resume=str(tmp_path / "b" / "last.ckpt"))
    assert resumed.architecture == model.architecture


def test_prune_vision_channel_cli_end_to_end(dense_ckpt, tmp_path):
    status = prune_main(["vision", "--ckpt", str(dense_ckpt), "--pruning.method", "fairgrape", "--pruning.granularity",
                         "channel", "--pruning.target_sparsity", "0.5", "--pruning.keep_per_iter", "0.7",
                         "--pruning.bn_recalibration", "2", "--output", str(tmp_path), "--reference", "dense",
                         "--trainer", json.dumps(FAST)])
    assert status == 0
    run = tmp_path / "fairgrape"
    report = json.loads((run / "report.json").read_text())
    assert report["granularity"] == "channel" and len(report["steps"]) == 2
    assert report["achieved_sparsity"] == pytest.approx(0.5, abs=0.01)
    assert report["achieved_sparsity"] == pytest.approx(1 - report["channels_kept"]["kept"] / report["channels_kept"]["dense"])
    assert report["parameters"] < 0.4 * report["dense_parameters"]
    assert "channels removed" in report["sparsity_definition"]
    assert (run / "group_shares.csv").is_file()
    assert "prunable channels removed" in (run / "README.md").read_text()
    # sparsity.csv: per layer the entries cut out with their channels, against the dense network.
    layers = pd.read_csv(run / "sparsity.csv")
    assert {"dense_numel", "removed", "effective_sparsity"} <= set(layers.columns)
    assert (layers["dense_numel"] >= layers["numel"]).all() and layers["removed"].between(0, 1).all()
    assert layers["removed"].max() > 0.5 and (layers["effective_sparsity"] >= layers["removed"]).all()
    import torchvision

    dense_net = torchvision.models.mobilenet_v2(num_classes=2, width_mult=0.5)  # what the checkpoint's settings build
    want = {f"net.{n}": m.weight.numel() for n, m in dense_net.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))}
    assert dict(zip(layers["layer"], layers["dense_numel"])) == want
    # Half the channels gone takes more than half the weights: a layer loses inputs and outputs alike.
    assert 1 - layers["numel"].sum() / layers["dense_numel"].sum() > report["achieved_sparsity"]

    # train.py test reads the pruned checkpoint into the smaller model: the same test figures.
    args = ["test", "--config", str(ROOT / "configs" / "vision" / "demo.yaml"), "--ckpt_path",
            str(run / "checkpoints" / "last.ckpt"), "--trainer.accelerator", "cpu", "--trainer.limit_test_batches", "2",
            "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path / "tested"),
            "--data.synthetic_size", "300", "--data.image_size", "32", "--data.batch_size", "16"]
    assert train_main(args) == 0
    tested = json.loads((tmp_path / "tested" / "demo" / "dense" / "test" / "report.json").read_text())
    assert tested["metrics"]["accuracy"] == pytest.approx(report["metrics"]["accuracy"])
    assert tested["granularity"] == "channel" and tested["parameters"] == report["parameters"]


def test_compare_runs_every_method_at_each_granularity(dense_ckpt, tmp_path):
    status = prune_main(["compare", "--ckpt", str(dense_ckpt), "--methods", "[magnitude, random]", "--sparsities", "[0.5]",
                         "--granularities", "[weight, channel]", "--pruning", "{keep_per_iter: 0.5, bn_recalibration: 0}",
                         "--reference", "dense", "--deploy", "false", "--output", str(tmp_path), "--trainer", json.dumps(FAST)])
    assert status == 0
    table = pd.read_csv(tmp_path / "comparison.csv")
    cells = table[table["method"].isin(["magnitude", "random"])]
    assert list(zip(cells["method"], cells["granularity"])) == [("magnitude", "weight"), ("random", "weight"),
                                                                ("magnitude", "channel"), ("random", "channel")]
    assert (cells["achieved_sparsity"] - 0.5).abs().max() < 0.01
    assert (tmp_path / "magnitude_s0.5").is_dir() and (tmp_path / "magnitude_channel_s0.5").is_dir()
    # Paired differences against the baseline at the same granularity: random against magnitude in each.
    assert cells["accuracy_diff"].notna().tolist() == [False, True, False, True]
    channel = json.loads((tmp_path / "random_channel_s0.5" / "report.json").read_text())
    assert channel["granularity"] == "channel" and channel["parameters"] < channel["dense_parameters"]
