"""``--stream auto`` (the default): a model is streamed from disk when its weights, in ``--dtype``,
exceed half the memory available, else held in memory; the run says which way it went and why,
and its report records it. The choice changes how the model is held, not the figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fairprune.cli.prune import main as prune_main
from tiny_models import tiny_gpt2_folder

SEQ = 32


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory, one_thread) -> Path:
    root = tmp_path_factory.mktemp("auto-lm")
    tiny_gpt2_folder(root)
    return root


def _common(tiny_lm: Path) -> list[str]:
    return ["--model", str(tiny_lm / "dense"), "--eval_text", str(tiny_lm / "eval.txt"), "--nsamples", "4", "--seqlen",
            str(SEQ), "--eval_tokens", "512", "--device", "cpu", "--threads", "1", "--quiet", "--dense_cache", "false"]


def _weights_bytes(folder: Path) -> int:
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:  # float32 weights, as stored
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()) * 4


def test_auto_holds_a_small_model_in_memory_and_says_why(tiny_lm, tmp_path, capsys):
    assert prune_main(["sparsegpt", *_common(tiny_lm), "--output", str(tmp_path / "auto")]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("[lm] "))
    size = _weights_bytes(tiny_lm / "dense")
    assert line.startswith("[lm] in memory (--stream auto: weights ") and f"{size / 1e9:.2f} GB in float32" in line
    report = json.loads((tmp_path / "auto" / "report.json").read_text())
    assert report["stream"] is False and report["memory"]["model_bytes"] == size


def test_auto_streams_when_the_weights_exceed_half_the_available_memory(tiny_lm, tmp_path, capsys, monkeypatch):
    """With less memory available than twice the weights (the machine's answer replaced by one just
    under it), the same command streams, and its figures are the in-memory run's."""
    import fairprune.workflows.opened as opened

    size = _weights_bytes(tiny_lm / "dense")
    assert prune_main(["sparsegpt", *_common(tiny_lm), "--stream", "false", "--output", str(tmp_path / "memory")]) == 0
    monkeypatch.setattr(opened, "available_bytes", lambda: 2 * size - 1)
    capsys.readouterr()
    assert prune_main(["sparsegpt", *_common(tiny_lm), "--output", str(tmp_path / "auto")]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("[lm] "))
    assert line.startswith("[lm] streamed from disk, one block resident (--stream auto")
    auto = json.loads((tmp_path / "auto" / "report.json").read_text())
    memory = json.loads((tmp_path / "memory" / "report.json").read_text())
    assert auto["stream"] is True and memory["stream"] is False
    assert auto["memory"]["largest_block_bytes"] < size
    assert auto["achieved_sparsity"] == memory["achieved_sparsity"]
    assert auto["metrics"]["perplexity"] == pytest.approx(memory["metrics"]["perplexity"], rel=1e-5)
    monkeypatch.setattr(opened, "available_bytes", lambda: 2 * size + 1)  # just above: in memory again
    assert prune_main(["evaluate", *_common(tiny_lm), "--output", str(tmp_path / "eval")]) == 0
    assert json.loads((tmp_path / "eval" / "report.json").read_text())["stream"] is False


def test_auto_keeps_in_memory_what_cannot_stream(tiny_lm, tmp_path, capsys, monkeypatch):
    """The compressed format needs the whole model: ``auto`` runs it in memory however little memory
    there is (``--stream true`` refuses it in one line)."""
    import fairprune.workflows.opened as opened

    monkeypatch.setattr(opened, "available_bytes", lambda: 1)
    assert prune_main(["magnitude", *_common(tiny_lm), "--save_format", "compressed", "--output", str(tmp_path / "c")]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("[lm] "))
    assert line.startswith("[lm] in memory (--stream auto: the model is not a local safetensors folder, or --save_format")
    assert json.loads((tmp_path / "c" / "report.json").read_text())["stream"] is False
    assert prune_main(["magnitude", *_common(tiny_lm), "--save_format", "compressed", "--stream", "true",
                       "--output", str(tmp_path / "d")]) == 2
    assert "--save_format dense with --stream true" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
