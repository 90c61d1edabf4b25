"""Deploy figures and ONNX export: MACs against a hand count, what channel removal and weight
masks change in size and arithmetic, the ONNX round trip with a dynamic batch, ``prune.py export``
on checkpoints real runs wrote, and the ``deploy`` entry of a vision pruning report."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch_pruning as tp
from torch import nn
from torch.nn.utils import prune

from cli_output import last_error
from fairprune.cli.prune import main as prune_main
from fairprune.models.deploy import (
    DeploySettings,
    count_macs,
    deploy_figures,
    deploy_report,
    deploy_side_by_side,
    plain_copy,
    stored_size,
)
from fairprune.models.onnx_export import export_onnx, max_abs_differences, ort_session
from fairprune.reporting.records import VisionRow

FAST = {"limit_train_batches": 2, "limit_val_batches": 2, "limit_test_batches": 2, "accelerator": "cpu",
        "enable_progress_bar": False}
QUICK = DeploySettings(batch_sizes=(1, 4), warmup=1, repeats=2, min_repeats=2)


def tiny_net(width: int = 8, bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=bias), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, width, 3, stride=2, padding=1, groups=2, bias=bias), nn.BatchNorm2d(width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 5, bias=bias),
    ).eval()


# --------------------------------------------------------------------------------------------
# Arithmetic and size


def test_macs_match_a_hand_count(one_thread):
    """3→8 conv 3x3 on 10x10 (pad 1): 8·10·10 outputs × 3·9; 8→8 conv 3x3, 2 groups, stride 2:
    8·5·5 outputs × 4·9; linear 8→5: 5 × 8. BatchNorm, ReLU and pooling are not MACs."""
    net = tiny_net()
    hand = 8 * 10 * 10 * 3 * 9 + 8 * 5 * 5 * 4 * 9 + 5 * 8
    assert count_macs(net, (3, 10, 10)) == (hand, hand)
    with torch.no_grad():
        net[0].weight[:4] = 0  # four of the first conv's eight output channels: half its MACs multiply zeros
    assert count_macs(net, (3, 10, 10)) == (hand, hand - 4 * 10 * 10 * 3 * 9)


def test_macs_agree_with_torch_pruning_on_conv_and_linear(one_thread):
    """torch-pruning's counter also counts bias, BatchNorm and activations; without them the two agree."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 6, 3, bias=False), nn.Conv2d(6, 4, 1, bias=False), nn.Flatten(),
                        nn.Linear(4 * 6 * 6, 3, bias=False)).eval()
    theirs, _ = tp.utils.count_ops_and_params(net, torch.zeros(1, 3, 8, 8))
    assert count_macs(net, (3, 8, 8))[0] == int(theirs) == 6 * 6 * 6 * 27 + 4 * 36 * 6 + 3 * 144


def test_removed_channels_shrink_what_masks_only_zero(one_thread):
    """Weight masks (unstructured) keep every tensor's shape: the same bytes, stored numbers and MACs,
    fewer nonzero ones. Channels removed by torch-pruning shrink them all."""
    dense = tiny_net(width=16)
    masked = tiny_net(width=16)
    for module in (masked[0], masked[3], masked[8]):
        prune.l1_unstructured(module, "weight", amount=0.5)
    plain = plain_copy(masked)
    assert not any(name.endswith(("_orig", "_mask")) for name in plain.state_dict())  # masks made permanent
    assert any(name.endswith("weight_mask") for name in masked.state_dict())  # the original keeps its masks
    assert torch.equal(plain[0].weight, masked[0].weight)
    thin = tiny_net(width=16)
    tp.pruner.MetaPruner(thin, torch.randn(1, 3, 10, 10), importance=tp.importance.MagnitudeImportance(p=2),
                         pruning_ratio=0.5, ignored_layers=[thin[8]]).step()
    assert thin[0].out_channels == 8

    sizes = {name: stored_size(plain_copy(net)) for name, net in (("dense", dense), ("masked", masked), ("thin", thin))}
    macs = {name: count_macs(plain_copy(net), (3, 10, 10)) for name, net in (("dense", dense), ("masked", masked),
                                                                                  ("thin", thin))}
    assert sizes["masked"]["bytes"] == sizes["dense"]["bytes"]
    assert sizes["masked"]["stored_numel"] == sizes["dense"]["stored_numel"]
    assert sizes["masked"]["nonzero_parameters"] < sizes["dense"]["nonzero_parameters"]
    assert macs["masked"][0] == macs["dense"][0] and macs["masked"][1] < macs["dense"][1]
    assert sizes["thin"]["bytes"] < sizes["dense"]["bytes"] / 1.5
    assert sizes["thin"]["stored_numel"] < sizes["dense"]["stored_numel"] / 1.5
    assert macs["thin"][0] < macs["dense"][0] / 2
    assert sizes["dense"]["stored_numel"] == sum(t.numel() for t in dense.state_dict().values())  # buffers included
    assert sizes["dense"]["bytes"] > 4 * sizes["dense"]["parameters"]  # float32, plus the header and buffers


# --------------------------------------------------------------------------------------------
# ONNX


@pytest.mark.parametrize("dynamo", [False, True])
def test_onnx_round_trip_with_a_dynamic_batch(dynamo, tmp_path, one_thread):
    net = tiny_net()
    path = export_onnx(net, tmp_path / "net.onnx", (3, 12, 12), opset=18, dynamo=dynamo)
    session = ort_session(path, threads=1)
    assert session.get_inputs()[0].name == "images" and not isinstance(session.get_inputs()[0].shape[0], int)
    # Its threads sleep between runs: a spinning pool would slow what is timed after it.
    assert session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"
    differences = max_abs_differences(net, session, (3, 12, 12), batch_sizes=(1, 2, 7))
    assert set(differences) == {1, 2, 7}
    assert max(differences.values()) < 1e-5


def test_deploy_figures_measure_both_runtimes_on_the_given_threads(one_thread):
    figures = deploy_figures(tiny_net(), (3, 12, 12), threads=1, settings=QUICK)
    assert figures["settings"]["threads"] == 1 and figures["settings"]["batch_sizes"] == [1, 4]
    assert figures["settings"]["repeats"] == 2 and figures["settings"]["exporter"] == "torchscript"
    assert figures["settings"]["ort_spinning"] is False
    for runtime in ("torch", "ort"):
        assert set(figures["ms_per_image"][runtime]) == {"1", "4"}
        assert all(ms > 0 for ms in figures["ms_per_image"][runtime].values())
    assert figures["onnx_bytes"] > 0 and figures["macs"] == count_macs(tiny_net(), (3, 12, 12))[0]
    assert torch.get_num_threads() == 1  # restored

    pair = deploy_side_by_side({"a": tiny_net(16), "b": tiny_net(8)}, (3, 12, 12), 1, QUICK)
    assert set(pair) == {"a", "b", "settings"} and pair["b"]["bytes"] < pair["a"]["bytes"]


def test_deploy_report_says_why_it_measured_nothing(capsys):
    found = deploy_report({"pruned": tiny_net()}, None, 1, QUICK)
    assert "image_size" in found["error"]
    assert "no deploy figures" in capsys.readouterr().out


def test_table_rows_carry_the_deploy_columns():
    figures = {"stored_numel": 2_000_000, "bytes": 8_000_000, "macs": 30_000_000,
               "ms_per_image": {"torch": {"1": 2.0, "32": 0.5}, "ort": {"1": 0.2, "32": 0.1}}}
    report = {"metrics": {"accuracy": 0.8}, "groups": {}, "dense": {"metrics": {"accuracy": 0.9}, "groups": {}},
              "deploy": {"pruned": figures, "dense": {**figures, "macs": 60_000_000}}}
    row, dense = VisionRow.from_report(report, "magnitude", 0.5).as_dict(), VisionRow.dense(report).as_dict()
    assert row["params (M)"] == 2.0 and row["MB"] == 8.0 and row["MMACs"] == 30.0 and dense["MMACs"] == 60.0
    assert row["ms/img b32 (ort)"] == 0.1 and dense["ms/img b1 (torch)"] == 2.0
    assert list(row)[-7:] == ["params (M)", "MB", "MMACs", "ms/img b1 (torch)", "ms/img b32 (torch)",
                              "ms/img b1 (ort)", "ms/img b32 (ort)"]


# --------------------------------------------------------------------------------------------
# Through the real commands


@pytest.fixture(scope="module")
def pruned_run(dense_ckpt, tmp_path_factory):
    """A finished ``prune.py vision`` run (magnitude 50 %, one step, measured against the checkpoint)."""
    out = tmp_path_factory.mktemp("pruned")
    assert prune_main(["vision", "--ckpt", str(dense_ckpt), "--pruning.method", "magnitude",
                       "--pruning.target_sparsity", "0.5", "--pruning.keep_per_iter", "0.5", "--output", str(out),
                       "--trainer", json.dumps(FAST), "--reference", "dense", "--threads", "1"]) == 0
    return out / "magnitude"


def test_vision_report_holds_deploy_figures(pruned_run):
    deploy = json.loads((pruned_run / "report.json").read_text())["deploy"]
    pruned, dense, settings = deploy["pruned"], deploy["dense"], deploy["settings"]
    assert settings["threads"] == 1 and settings["input_shape"] == [3, 32, 32] and settings["batch_sizes"] == [1, 32]
    # weight masks: the same tensors, half the weights of every targeted layer zero
    assert pruned["bytes"] == dense["bytes"] and pruned["macs"] == dense["macs"]
    assert pruned["nonzero_parameters"] < 0.6 * dense["nonzero_parameters"]
    assert pruned["nonzero_macs"] < 0.6 * dense["nonzero_macs"]
    for figures in (pruned, dense):
        assert all(figures["ms_per_image"][rt][b] > 0 for rt in ("torch", "ort") for b in ("1", "32"))


def test_export_cli_on_a_pruned_checkpoint(pruned_run, tmp_path, capsys):
    output = tmp_path / "onnx" / "model.onnx"
    assert prune_main(["export", "--ckpt", str(pruned_run / "checkpoints" / "last.ckpt"), "--output", str(output),
                       "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "max abs difference" in printed and "tolerance 0.0001" in printed
    assert output.is_file() and not [p for p in output.parent.iterdir() if p.name != "model.onnx"]  # no temp file left
    session = ort_session(output, threads=1)
    assert session.get_inputs()[0].shape[1:] == [3, 32, 32]
    import onnx

    graph = onnx.load(str(output)).graph
    assert not any("mask" in init.name or "orig" in init.name for init in graph.initializer)  # a plain graph
    assert session.run(None, {"images": torch.randn(3, 3, 32, 32).numpy()})[0].shape == (3, 2)


def test_channel_pruning_shrinks_the_deployed_network(dense_ckpt, tmp_path, capsys):
    """Half the channels removed: the report's pruned network is smaller and does fewer MACs than
    the dense one, and its checkpoint exports (the smaller architecture rebuilt from it)."""
    assert prune_main(["vision", "--ckpt", str(dense_ckpt), "--pruning.method", "magnitude", "--pruning.granularity",
                       "channel", "--pruning.target_sparsity", "0.5", "--pruning.keep_per_iter", "0.5", "--output",
                       str(tmp_path), "--trainer", json.dumps(FAST), "--reference", "dense", "--threads", "1"]) == 0
    deploy = json.loads((tmp_path / "magnitude" / "report.json").read_text())["deploy"]
    pruned, dense = deploy["pruned"], deploy["dense"]
    assert pruned["bytes"] < 0.5 * dense["bytes"] and pruned["stored_numel"] < 0.5 * dense["stored_numel"]
    assert pruned["macs"] < 0.5 * dense["macs"] and pruned["onnx_bytes"] < 0.5 * dense["onnx_bytes"]
    output = tmp_path / "thin.onnx"
    assert prune_main(["export", "--ckpt", str(tmp_path / "magnitude" / "checkpoints" / "last.ckpt"), "--output",
                       str(output), "--dynamo", "false", "--threads", "1"]) == 0
    assert "max abs difference" in capsys.readouterr().out
    assert 0 < output.stat().st_size < 0.5 * dense["onnx_bytes"]


def test_export_cli_mistakes_are_one_line(dense_ckpt, tmp_path, capsys):
    assert prune_main(["export", "--ckpt", str(tmp_path / "missing.ckpt"), "--output", str(tmp_path / "m.onnx")]) == 2
    line = last_error(capsys)
    assert "missing.ckpt" in line and "does not exist" in line
    assert prune_main(["export", "--ckpt", str(dense_ckpt), "--output", str(tmp_path)]) == 2
    assert "is a directory" in last_error(capsys)
    (tmp_path / "notes").write_text("a file where a folder was meant\n")
    assert prune_main(["export", "--ckpt", "missing.ckpt", "--output", str(tmp_path / "notes" / "m.onnx")]) == 2
    assert "'" + str(tmp_path / "notes") + "' is a file" in last_error(capsys)  # checked before the checkpoint
    (tmp_path / "notes").unlink()
    assert prune_main(["export", "--ckpt", str(dense_ckpt), "--output", str(tmp_path / "m.onnx"), "--opset", "13"]) == 2
    assert "--dynamo false" in last_error(capsys)
    status = prune_main(["export", "--ckpt", str(dense_ckpt), "--output", str(tmp_path / "m.onnx"), "--dynamo", "false",
                         "--atol", "1e-30", "--threads", "1"])
    assert status == 2
    line = last_error(capsys)
    assert "over --atol 1e-30" in line and "was not written" in line
    assert not os.listdir(tmp_path)  # neither the file nor its temporary twin
