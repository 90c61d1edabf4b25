"""BatchNorm recalibration: the routine against a by-hand oracle, two processes against one, and the
pruning callback recalibrating at every step and at the end of pruning."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from fairprune.errors import UserError
from fairprune.pruning.batchnorm import batchnorm_layers, recalibrate_batchnorm
from processes import run_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Dropout(0.5), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 4 * 4, 5), nn.BatchNorm1d(5))
    with torch.no_grad():  # stale statistics, as after a pruning step
        for bn in batchnorm_layers(model):
            bn.running_mean.fill_(3.0)
            bn.running_var.fill_(7.0)
            bn.num_batches_tracked.fill_(50)
    return model


def _batches(sizes=(5, 7, 3, 6)):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 3, 6, 6, generator=g), torch.zeros(n, dtype=torch.long)) for n in sizes]


def _oracle(model: nn.Module, batches) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's statistics by hand: the mean over batches of the per-batch mean and unbiased
    variance, the first BatchNorm normalising with its batch's (biased) statistics, dropout off."""
    conv, _, bn2, _, _, linear, bn1 = model
    means = {0: [], 1: []}
    variances = {0: [], 1: []}
    for x, _ in batches:
        h = conv(x)
        m, v = h.mean(dim=(0, 2, 3)), h.var(dim=(0, 2, 3), unbiased=True)
        means[0].append(m)
        variances[0].append(v)
        biased = h.var(dim=(0, 2, 3), unbiased=False)
        h = (h - m[None, :, None, None]) / torch.sqrt(biased[None, :, None, None] + bn2.eps)
        h = h * bn2.weight[None, :, None, None] + bn2.bias[None, :, None, None]
        z = linear(torch.relu(h).flatten(1))
        means[1].append(z.mean(0))
        variances[1].append(z.var(0, unbiased=True))
    return [(torch.stack(means[k]).mean(0), torch.stack(variances[k]).mean(0)) for k in (0, 1)]


@torch.no_grad()
def test_recalibration_equals_the_mean_of_per_batch_statistics():
    model = _model()
    model.train()
    weights = {k: v.clone() for k, v in model.state_dict().items() if "running" not in k and "tracked" not in k}
    batches = _batches()
    expected = _oracle(model, batches[:3])
    assert recalibrate_batchnorm(model, batches, 3) == 3  # the first three batches only
    for bn, (mean, var) in zip(batchnorm_layers(model), expected):
        torch.testing.assert_close(bn.running_mean, mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bn.running_var, var, rtol=1e-5, atol=1e-6)
        assert int(bn.num_batches_tracked) == 3
        assert bn.momentum == 0.1  # restored
    assert all(m.training for m in model.modules())  # modes restored
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights.items())  # no weight changed


@torch.no_grad()
def test_recalibration_keeps_eval_modes_and_handles_short_loaders():
    model = _model().eval()
    model[6].momentum = 0.3
    batches = _batches((4, 4))
    expected = _oracle(model, batches)
    assert recalibrate_batchnorm(model, batches + _batches((1,)), 20) == 2  # all there are; one sample is skipped
    assert not any(m.training for m in model.modules())
    assert model[6].momentum == 0.3
    torch.testing.assert_close(model[6].running_mean, expected[1][0], rtol=1e-5, atol=1e-6)
    before = model[2].running_mean.clone()
    assert recalibrate_batchnorm(model, batches, 0) == 0  # off
    assert recalibrate_batchnorm(model, [], 5) == 0  # nothing to see: the statistics stay
    assert torch.equal(model[2].running_mean, before) and int(model[2].num_batches_tracked) == 2


# Two fresh interpreters (gloo) and one alone: every process passes the same batches.
_SHARDED = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[4])
from test_batchnorm import _model, _batches
from fairprune.pruning.batchnorm import batchnorm_layers, recalibrate_batchnorm
from processes import run_ranks
rank, init_file, out_file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
model = _model()
if rank >= 0:
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
used = recalibrate_batchnorm(model, _batches((5, 7, 3, 6, 4)), 5)  # 3 batches on rank 0, 2 on rank 1
torch.save({"used": used, "stats": [(bn.running_mean, bn.running_var, bn.num_batches_tracked)
                                    for bn in batchnorm_layers(model)]}, out_file)
if rank >= 0:
    dist.destroy_process_group()
"""


def test_two_processes_end_with_one_process_statistics(tmp_path):
    tests = os.path.dirname(os.path.abspath(__file__))
    run_ranks(_SHARDED, lambda r: [str(r), str(tmp_path / "init"), str(tmp_path / f"{r}.pt"), tests])
    one, r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in (-1, 0, 1))
    assert one["used"] == r0["used"] == r1["used"] == 5
    for a, b, c in zip(one["stats"], r0["stats"], r1["stats"]):
        for x, y in zip(b, c):
            assert torch.equal(x, y)  # identical on every rank
        torch.testing.assert_close(b[0], a[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b[1], a[1], rtol=1e-5, atol=1e-6)
        assert int(b[2]) == int(a[2]) == 5


# ----------------------------------------------------------------------------------------------
# The pruning callback

FAST = {"limit_train_batches": 3, "limit_val_batches": 2, "limit_test_batches": 2, "accelerator": "cpu",
        "enable_progress_bar": False, "enable_model_summary": False}


def _ckpt_bn(path) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if k.endswith("running_mean")}


@pytest.mark.parametrize("batches", [4, 0])
def test_the_callback_recalibrates_after_every_retraining_epoch(dense_ckpt, tmp_path, one_thread, batches):
    from fairprune.workflows.vision import load_trained, prune_vision

    report = prune_vision(str(dense_ckpt), {"method": "magnitude", "target_sparsity": 0.75, "keep_per_iter": 0.5,
                                            "bn_recalibration": batches}, str(tmp_path), trainer=FAST)
    saved = json.loads((tmp_path / "magnitude" / "report.json").read_text())
    assert saved["bn_recalibration"]["batches"] == batches
    done = saved["bn_recalibration"]["done"]
    # The checkpoint's statistics against a fresh recalibration of the same weights on the same batches.
    dense, data = load_trained(dense_ckpt)
    model = type(dense).load_from_checkpoint(tmp_path / "magnitude" / "checkpoints" / "last.ckpt", map_location="cpu",
                                           weights_only=False)
    model.eval()
    data.setup("fit")
    stored = _ckpt_bn(tmp_path / "magnitude" / "checkpoints" / "last.ckpt")
    recalibrate_batchnorm(model, data.train_dataloader(), 4)
    layers = {id(bn) for bn in batchnorm_layers(model)}
    fresh = {f"{n}.running_mean": m.running_mean for n, m in model.named_modules() if id(m) in layers}
    assert stored.keys() == fresh.keys() and stored
    same = all(torch.allclose(stored[k], fresh[k], rtol=1e-4, atol=1e-5) for k in stored)
    if batches:
        # Pruning steps at the start of epochs 0 and 1: the end of each retraining epoch, the last included.
        assert [d["after"] for d in done] == ["epoch 0", "epoch 1"]
        assert all(d["batches"] == batches for d in done)
        assert same  # the final statistics are a recalibration of the final weights
        assert report["seconds"]["bn_recalibration"] > 0
    else:
        assert done == [] and not same  # training's moving averages, not a recalibration


def test_bad_recalibration_setting_is_a_user_error():
    from fairprune.callbacks.pruning import IterativePruning

    with pytest.raises(UserError, match="bn_recalibration"):
        IterativePruning(bn_recalibration=-1)
