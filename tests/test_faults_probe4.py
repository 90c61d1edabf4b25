"""Faults found by probing quantization, GGUF, task files and compares (4): each test fails on
the code before its fix."""

from __future__ import annotations

import os
import stat

import pytest

from fairprune.cli.prune import main as prune_main
from tiny_models import tiny_gpt2_folder

FAST = ["--nsamples", "2", "--seqlen", "32", "--eval_tokens", "256", "--device", "cpu", "--quiet", "true"]


@pytest.fixture
def gpt2(tmp_path):
    tiny_gpt2_folder(tmp_path)
    return tmp_path


def _modes(folder) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")}


def test_file_modes_do_not_depend_on_the_stream_mode(gpt2):
    texts = ["--eval_text", str(gpt2 / "eval.txt"), "--calib_text", str(gpt2 / "eval.txt")]
    old = os.umask(0o022)
    try:
        for stream in ("false", "true"):
            assert prune_main(["sparsegpt", "--model", str(gpt2 / "dense"), "--sparsity", "0.5", "--stream", stream,
                               "--output", str(gpt2 / stream), *FAST, *texts]) == 0
    finally:
        os.umask(old)
    memory, streamed = _modes(gpt2 / "false"), _modes(gpt2 / "true")
    assert memory["model.safetensors"] == streamed["model.safetensors"] == 0o644
    assert set(memory.values()) == {0o644} and set(streamed.values()) == {0o644}
