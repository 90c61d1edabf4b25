"""An edited ``pruned_architecture`` in a channel-pruned checkpoint is one line naming the checkpoint
and the bad entry, raised before any model is built or traced, in every command that reads it
(``prune.py export``, ``prune.py vision``, ``train.py test``); nothing is written, and a failed
``train.py test`` leaves no ``test/config.yaml`` behind.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from cli_output import last_error
from fairprune.cli.prune import main as prune_main
from fairprune.cli.train import main as train_main
from fairprune.pruning import channels

ROOT = Path(__file__).resolve().parents[1]
FAST = {"limit_train_batches": 2, "limit_val_batches": 2, "limit_test_batches": 2, "accelerator": "cpu",
        "enable_progress_bar": False, "enable_model_summary": False}


@pytest.fixture(scope="module")
def pruned(dense_ckpt, tmp_path_factory, one_thread) -> Path:
    """A channel-pruned checkpoint written by the real prune.py vision."""
    out = tmp_path_factory.mktemp("channel")
    assert prune_main(["vision", "--ckpt", str(dense_ckpt), "--pruning.method", "magnitude", "--pruning.granularity",
                       "channel", "--pruning.target_sparsity", "0.5", "--pruning.keep_per_iter", "0.5",
                       "--pruning.bn_recalibration", "0", "--output", str(out), "--reference", "dense", "--deploy",
                       "false", "--trainer", json.dumps(FAST)]) == 0
    return out / "magnitude" / "checkpoints" / "last.ckpt"


def _first(record: dict) -> dict:
    return record["groups"][0]


# name -> (edit of the checkpoint, words the one line holds)
EDITS = {
    "kept_not_the_weights": (lambda c: _first(c[channels.CHECKPOINT_KEY]).update(kept=_first(c[channels.CHECKPOINT_KEY])["kept"] - 40),
                             ["groups[0].kept", "output channels"]),
    "kept_text": (lambda c: _first(c[channels.CHECKPOINT_KEY]).update(kept="abc"), ["groups[0].kept", "'abc'"]),
    "kept_missing": (lambda c: _first(c[channels.CHECKPOINT_KEY]).pop("kept"), ["groups[0]", "no 'kept'"]),
    "kept_over_dense": (lambda c: _first(c[channels.CHECKPOINT_KEY]).update(kept=10**6), ["groups[0].kept", "1000000 of"]),
    "negative_input": (lambda c: c[channels.CHECKPOINT_KEY].update(input_shape=[1, 3, -32, 32]), ["input_shape", "-32"]),
    "huge_input": (lambda c: c[channels.CHECKPOINT_KEY].update(input_shape=[1, 3, 3000, 3000]), ["input_shape", "3000"]),
    "groups_not_a_list": (lambda c: c[channels.CHECKPOINT_KEY].update(groups=5), [".groups", "not a list"]),
    "record_not_a_mapping": (lambda c: c.update({channels.CHECKPOINT_KEY: "abc"}), ["pruned_architecture", "str"]),
    "dense_not_the_model": (lambda c: _first(c[channels.CHECKPOINT_KEY]).update(dense=4000), ["4000 dense channels"]),
    "input_channels": (lambda c: c[channels.CHECKPOINT_KEY].update(input_shape=[1, 5, 32, 32]), ["input_shape", "no input"]),
    "weights_reshaped": (lambda c: c["state_dict"].update({"net.classifier.1.bias": torch.zeros(7)}),
                         ["do not fit", "net.classifier.1.bias"]),
}


@pytest.fixture(scope="module")
def edited(pruned, tmp_path_factory) -> dict[str, Path]:
    state = torch.load(pruned, map_location="cpu", weights_only=True)
    folder = tmp_path_factory.mktemp("edited")
    paths = {}
    for name, (edit, _) in EDITS.items():
        copied = copy.deepcopy(state)
        edit(copied)
        torch.save(copied, folder / f"{name}.ckpt")
        paths[name] = folder / f"{name}.ckpt"
    return paths


def _vision(ckpt: Path, out: Path) -> int:
    return prune_main(["vision", "--ckpt", str(ckpt), "--pruning.method", "magnitude", "--pruning.granularity", "channel",
                       "--pruning.target_sparsity", "0.6", "--output", str(out), "--reference", "dense", "--deploy", "false",
                       "--trainer", json.dumps(FAST)])


def _test(ckpt: Path, out: Path) -> int:
    return train_main(["test", "--config", str(ROOT / "configs" / "vision" / "demo.yaml"), "--ckpt_path", str(ckpt),
                       "--trainer.accelerator", "cpu", "--trainer.limit_test_batches", "2", "--trainer.enable_progress_bar",
                       "false", "--trainer.logger.init_args.save_dir", str(out), "--data.synthetic_size", "300",
                       "--data.image_size", "32", "--data.batch_size", "16"])


def _export(ckpt: Path, out: Path) -> int:
    return prune_main(["export", "--ckpt", str(ckpt), "--output", str(out / "model.onnx")])


@pytest.mark.parametrize("name", list(EDITS))
@pytest.mark.parametrize("command", ["export", "vision", "test"])
def test_an_edited_architecture_is_one_line_and_nothing_is_written(command, name, edited, tmp_path, capsys, one_thread):
    out = tmp_path / "out"
    status = {"export": _export, "vision": _vision, "test": _test}[command](edited[name], out)
    line = last_error(capsys)
    assert status == 2
    words = EDITS[name][1]
    assert all(word in line for word in words), line
    assert str(edited[name]) in line  # the checkpoint is named
    # Nothing written: no run folder, no test/config.yaml.
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()], sorted(out.rglob("*"))


def test_the_architecture_check_takes_what_prune_vision_writes(pruned):
    state = torch.load(pruned, map_location="cpu", weights_only=True)
    channels.check_architecture(state[channels.CHECKPOINT_KEY], state["state_dict"], "checkpoint")
