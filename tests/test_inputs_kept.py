"""A run never writes over what it reads: an ``--output`` that is the model folder, lies inside it or
holds it is refused in one line before anything is written, in memory and streamed, for every LM
command, FASP, vision pruning and ONNX export; the input stays byte for byte as it was."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from cli_output import last_error
from fairprune.cli.prune import main as prune_main
from fairprune.errors import UserError
from fairprune.storage.lock import check_apart
from tiny_models import tiny_gpt2_folder


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative name → sha256), so any write, removal or addition shows."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory, one_thread) -> Path:
    root = tmp_path_factory.mktemp("kept")
    tiny_gpt2_folder(root)
    return root


def test_check_apart_sees_equal_inside_holding_and_symlinked_paths(tmp_path):
    model = tmp_path / "runs" / "model"
    model.mkdir(parents=True)
    (tmp_path / "alias").symlink_to(model)
    for out, how in [(model, "is"), (model / "sub", "lies inside"), (tmp_path / "runs", "holds"),
                     (tmp_path / "alias", "is"), (model / ".." / "model" / "x", "lies inside")]:
        with pytest.raises(UserError, match=how):
            check_apart([out], [model])
    check_apart([tmp_path / "runs" / "other"], [model])  # a sibling is fine
    check_apart([model], [tmp_path / "not-there"])  # a hub name (nothing on disk) is not a folder to protect
    with pytest.raises(UserError, match="lies inside"):  # a compare's cell, not only its first folder
        check_apart([tmp_path / "elsewhere", model / "cell"], [model])


@pytest.mark.parametrize("where", ["same", "inside", "holds"])
@pytest.mark.parametrize("command", [["sparsegpt", "--stream", "true"], ["wanda", "--stream", "true"], ["magnitude"],
                                     ["evaluate"], ["compare", "--methods", "[magnitude]"],
                                     ["fasp", "--alpha", "0.5"]])
def test_an_output_over_the_model_is_refused_and_the_model_kept(tiny_lm, tmp_path, capsys, command, where):
    root = tmp_path / "root"
    model = root / "model"
    shutil.copytree(tiny_lm / "dense", model)
    before = _snapshot(root)
    output = {"same": model, "inside": model / "pruned", "holds": root}[where]
    code = prune_main([*command, "--model", str(model), "--output", str(output), "--eval_text", str(tiny_lm / "eval.txt"),
                       "--nsamples", "2", "--seqlen", "16", "--device", "cpu", "--quiet"])
    assert code == 2
    line = last_error(capsys)
    assert f"the input '{model}' the run reads" in line and "choose an output outside" in line
    assert _snapshot(root) == before  # not a byte written, nothing removed, no lock or folder left


def test_vision_and_export_do_not_write_over_their_checkpoint(tmp_path, capsys):
    run = tmp_path / "runs" / "magnitude"
    ckpt = run / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"a checkpoint")
    before = _snapshot(tmp_path)
    # The run folder <output>/<method> holds the checkpoint the run would prune.
    assert prune_main(["vision", "--ckpt", str(ckpt), "--output", str(tmp_path / "runs"),
                       "--pruning.method", "magnitude"]) == 2
    assert "holds the input" in last_error(capsys)
    assert prune_main(["compare", "--ckpt", str(ckpt), "--methods", "[magnitude]", "--sparsities", "[0.5]",
                       "--output", str(run)]) == 2
    assert "holds the input" in last_error(capsys)
    assert prune_main(["export", "--ckpt", str(ckpt), "--output", str(ckpt)]) == 2
    assert "is the input" in last_error(capsys)
    assert _snapshot(tmp_path) == before
