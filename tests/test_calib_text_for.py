"""``--calib_text_for``: the runs at one sparsity calibrate on a text of their own (the
Debias-SparseGPT paper adds 256 UltraChat conversations at 2:4), in ``compare`` and in the
single-method commands; ``bundled:ultrachat``, the project's UltraChat-format stand-in; and
``configs/compare/debias_paper.yaml``, the paper's protocol. A tiny GPT-2 with its own tokenizer."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fairprune.cli.prune import main as prune_main
from fairprune.data.chats import read_calibration, ultrachat_rows, write_ultrachat
from fairprune.data.files import CHAT_ROLES, Chats, read_calib_text
from fairprune.errors import UserError
from fairprune.pruning.options import LMOptions
from fairprune.pruning.sparsity import Sparsity
from tiny_models import tiny_gpt2_folder

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--seqlen", "32", "--nsamples", "4", "--device", "cpu", "--eval_tokens", "256", "--quiet", "true"]
CHAT = '{"2:4": bundled:ultrachat}'
PATTERNS = '["1:4", "2:4", "0.5"]'
CELLS = ("debias-sparsegpt_1of4", "debias-sparsegpt_2of4", "debias-sparsegpt_0.5")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    tiny_gpt2_folder(root)
    return root


def _compare(tiny: Path, output: Path, *extra: str) -> int:
    return prune_main(["compare", "--model", str(tiny / "dense"), "--methods", "[debias-sparsegpt]",
                       "--sparsities", PATTERNS, "--eval_text", str(tiny / "eval.txt"), "--output", str(output),
                       *FAST, *extra])


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _report(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())


@pytest.fixture(scope="module")
def compared(tiny, tmp_path_factory) -> Path:
    """The same compare of Debias-SparseGPT at 1:4, 2:4 and 50 %, without (``plain``) and with
    ``--calib_text_for {"2:4": bundled:ultrachat}`` (``chat``)."""
    root = tmp_path_factory.mktemp("compared")
    assert _compare(tiny, root / "plain") == 0
    assert _compare(tiny, root / "chat", "--calib_text_for", CHAT) == 0
    return root


def test_the_2of4_cells_calibrate_on_their_text_and_the_others_are_unchanged(compared):
    plain, chat = compared / "plain", compared / "chat"
    facts = _report(chat / "debias-sparsegpt_2of4")["calibration"]
    assert facts["text"] == "bundled:ultrachat" and facts["chat_rows"] == 256
    assert facts["pairs"] > 0 and facts["nsamples"] == 4  # the pairs stay beside the chat windows
    assert _report(plain / "debias-sparsegpt_2of4")["calibration"]["text"] == "bundled corpus"
    for cell in ("debias-sparsegpt_1of4", "debias-sparsegpt_0.5"):
        assert _report(chat / cell)["calibration"]["text"] == "bundled corpus"
        assert _same(_weights(chat / cell), _weights(plain / cell)), cell
    assert not _same(_weights(chat / "debias-sparsegpt_2of4"), _weights(plain / "debias-sparsegpt_2of4"))
    # Each cell's settings name its own text, nothing another sparsity calibrates on.
    configs = {cell: yaml.safe_load((chat / cell / "config.yaml").read_text()) for cell in CELLS}
    assert configs["debias-sparsegpt_2of4"]["calib_text_for"] == {"2:4": "bundled:ultrachat"}
    assert configs["debias-sparsegpt_1of4"]["calib_text_for"] is None
    assert configs["debias-sparsegpt_0.5"]["calib_text_for"] is None


def test_a_cell_calibrated_on_another_text_is_not_reused(tiny, compared, tmp_path, capsys):
    """The plain compare's folder run again with the chat text: its 1:4 and 50 % cells are reused,
    its 2:4 cell runs again and then holds what the chat compare's holds."""
    again = tmp_path / "again"
    shutil.copytree(compared / "plain", again)
    capsys.readouterr()
    assert _compare(tiny, again, "--calib_text_for", CHAT) == 0
    out = capsys.readouterr().out
    reused = {cell for cell in CELLS if f"{cell} " in out and f"reusing {again / cell}" in out}
    assert reused == {"debias-sparsegpt_1of4", "debias-sparsegpt_0.5"}
    assert _same(_weights(again / "debias-sparsegpt_2of4"), _weights(compared / "chat" / "debias-sparsegpt_2of4"))
    assert _report(again / "debias-sparsegpt_2of4")["calibration"]["text"] == "bundled:ultrachat"


def test_the_single_method_command_calibrates_as_the_compare_cell(tiny, compared, tmp_path):
    """``prune.py debias-sparsegpt --sparsity 2:4 --calib_text_for ...`` prunes as the compare's 2:4
    cell did, from a user's copy of the bundled file too (the same reader)."""
    copy = tmp_path / "mine.jsonl"
    shutil.copy(write_ultrachat(), copy)
    for name, text in (("bundled", "bundled:ultrachat"), ("copy", str(copy))):
        assert prune_main(["debias-sparsegpt", "--model", str(tiny / "dense"), "--sparsity", "2:4",
                           "--calib_text_for", json.dumps({"2:4": text}), "--eval_text", str(tiny / "eval.txt"),
                           "--output", str(tmp_path / name), *FAST]) == 0
        assert _same(_weights(tmp_path / name), _weights(compared / "chat" / "debias-sparsegpt_2of4")), name
        assert _report(tmp_path / name)["calibration"]["text"] == text
        assert yaml.safe_load((tmp_path / name / "config.yaml").read_text())["calib_text_for"] == {"2:4": text}


COMPARE = ["compare", "--methods", "[sparsegpt]", "--sparsities", PATTERNS]


@pytest.mark.parametrize("command, option, match", [
    (COMPARE, '{"2:4": /no/such/chat.jsonl}', "chat file '/no/such/chat.jsonl' does not exist"),
    (COMPARE, '{"4:8": bundled:ultrachat}', r"--calib_text_for names 4:8, which --sparsities does not run \(1:4, 2:4, 0.5\)"),
    (COMPARE, '{"2:4": bundled:nothing}', "no bundled calibration text named 'bundled:nothing'"),
    (COMPARE, '{"2:4": ""}', "--calib_text_for 2:4: give a text file"),
    (["sparsegpt", "--sparsity", "0.5"], CHAT, r"--calib_text_for names 2:4, which --sparsity does not run \(0.5\)"),
    (["sparsegpt", "--sparsity", "2:4"], '{"2:4": /no/such/folder}', "text file '/no/such/folder' does not exist"),
])
def test_bad_input_is_one_line_before_the_model_loads(command, option, match, tmp_path, capsys):
    """The model folder exists but holds no model: the mistake found is the option's, so the texts
    and sparsities were checked before any loading."""
    (tmp_path / "empty").mkdir()
    code = prune_main([*command, "--model", str(tmp_path / "empty"), "--calib_text_for", option,
                       "--output", str(tmp_path / "out"), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(match, err[0]), err[0]
    assert not (tmp_path / "out").exists()


def test_an_unquoted_pattern_in_yaml_and_head_pruning_are_refused(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("calib_text_for:\n  2:4: bundled:ultrachat\n")  # YAML 1.1 reads 2:4 as 124
    assert prune_main(["sparsegpt", "--model", str(tmp_path), "--sparsity", "2:4", "--output", "out", "--config",
                       str(config)]) == 2
    assert 'quote the pattern: "2:4"' in capsys.readouterr().err
    assert prune_main(["compare", "--model", str(tmp_path), "--methods", "[fasp]", "--alphas", "[0.1]",
                       "--calib_text_for", CHAT]) == 2
    assert "head pruning (--alphas) scores heads on --calib_text" in capsys.readouterr().err


def test_the_option_is_keyed_by_sparsity():
    lm = LMOptions(model="m", calib_text="c.txt", calib_text_for={"0.50": "a.txt", "2:4": "b.jsonl"})
    assert lm.calib_text_for == {"0.5": "a.txt", "2:4": "b.jsonl"}
    assert [lm.calib_text_at(Sparsity.parse(s)) for s in ("0.5", "2:4", "1:4")] == ["a.txt", "b.jsonl", "c.txt"]
    assert lm.at_sparsity(Sparsity.parse("2:4")).calib_text_for == {"2:4": "b.jsonl"}
    assert lm.at_sparsity(Sparsity.parse("1:4")).calib_text_for is None
    assert LMOptions(model="m", calib_text_for={}).calib_text_for is None
    with pytest.raises(UserError, match="names sparsity 0.5 twice"):
        LMOptions(model="m", calib_text_for={"0.5": "a", 0.5: "b"})
    with pytest.raises(UserError, match="must map sparsities to calibration texts"):
        LMOptions(model="m", calib_text_for=["2:4"])


# --------------------------------------------------------------------------------------------
# bundled:ultrachat
# --------------------------------------------------------------------------------------------


def test_the_stand_in_has_ultrachat_rows_and_is_written_once(tmp_path):
    rows = ultrachat_rows()
    assert len(rows) == 256 and rows == ultrachat_rows() and rows != ultrachat_rows(seed=1)
    for row in rows:
        assert set(row) == {"prompt", "prompt_id", "messages"}
        assert row["prompt"] == row["messages"][0]["content"]
        assert row["prompt_id"] == hashlib.sha256(row["prompt"].encode()).hexdigest()
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and 2 <= len(roles) <= 6
        assert set(roles) <= set(CHAT_ROLES) and all(m["content"] for m in row["messages"])
    assert len({row["prompt_id"] for row in rows}) == 256  # every prompt once, as in UltraChat
    path = write_ultrachat(tmp_path)
    stamp = path.stat().st_mtime_ns
    assert write_ultrachat(tmp_path) == path and path.stat().st_mtime_ns == stamp  # the same bytes: left alone
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows


def test_the_stand_in_reads_through_the_users_reader(tmp_path):
    chats = read_calibration("bundled:ultrachat")
    copy = tmp_path / "rows.jsonl"
    shutil.copy(chats.source, copy)
    assert isinstance(chats, Chats) and chats == read_calib_text(copy) == [r["messages"] for r in ultrachat_rows()]
    assert read_calibration(str(copy)) == chats
    with pytest.raises(UserError, match="the bundled texts: bundled:ultrachat"):
        read_calibration("bundled:c4")


# --------------------------------------------------------------------------------------------
# configs/compare/debias_paper.yaml
# --------------------------------------------------------------------------------------------


def test_the_paper_config_parses_and_the_command_line_overrides_its_tasks():
    from fairprune.cli.prune import build_parser

    config = str(ROOT / "configs" / "compare" / "debias_paper.yaml")
    written = build_parser("compare").parse_args(["--config", config])
    assert written.model == "smollm2-135m" and written.baseline == "sparsegpt"
    assert written.methods == ["magnitude", "wanda", "sparsegpt", "debias-sparsegpt"]
    assert [str(Sparsity.parse(s)) for s in written.sparsities] == ["1:4", "2:4", "0.5"]
    assert written.calib_text_for == {"2:4": "bundled:ultrachat"}
    assert {"unqover_cloze3", "unqover_letter_balanced", "mmlu"} <= set(written.tasks)
    given = build_parser("compare").parse_args(["--config", config, "--tasks", "[hellaswag, mmlu]"])
    assert given.tasks == ["hellaswag", "mmlu"] and given.calib_text_for == written.calib_text_for


@pytest.mark.slow  # about 40 s; make test keeps the tests above and the paper table's in test_headline_marks
def test_the_paper_config_runs_on_a_small_model(tiny, tmp_path, monkeypatch):
    """The config as written (its methods, sparsities, 2:4 text, baseline and tasks, UnQover's among
    them, on the bundled stand-ins) on the tiny model, every cap smaller; the paper's table from it."""
    import pandas as pd

    from fairprune.cli.tables import debias_paper_table

    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "paper"
    assert prune_main(["compare", "--config", str(ROOT / "configs" / "compare" / "debias_paper.yaml"),
                       "--model", str(tiny / "dense"), "--eval_text", str(tiny / "eval.txt"),
                       "--limit", "24", "--eval_seqlen", "32", "--output", str(out), *FAST]) == 0
    table = pd.read_csv(out / "comparison.csv")
    assert len(table) == 13 and set(table["sparsity"]) == {"0", "1:4", "2:4", "0.5"} and "mmlu/acc" in table
    for figure in ("unqover_cloze3/accuracy_amb", "unqover_cloze3/mu", "unqover_letter_balanced/eta"):
        assert figure in table, figure
    # DTO reads UnQover's abstention, as the paper (the tiny model holds no valid knowledge figure, so no row has one)
    assert json.loads((out / "report.json").read_text())["dto"]["abstention"] == "unqover_cloze3/accuracy_amb"
    paper = debias_paper_table([out])
    head = paper.splitlines()[0]
    assert head.index("UnQover abstention") < head.index("DTO") < head.index("MMLU") < head.index("perplexity")
    assert "unqover_" in paper.split("read from")[1] and paper.count("\n| ") >= 13
    for method in ("wanda", "sparsegpt", "debias-sparsegpt"):
        assert _report(out / f"{method}_2of4")["calibration"]["text"] == "bundled:ultrachat"
        assert _report(out / f"{method}_1of4")["calibration"]["text"] == "bundled corpus"
    assert _report(out / "magnitude_2of4")["calibration"]["text"] is None  # magnitude draws no window
