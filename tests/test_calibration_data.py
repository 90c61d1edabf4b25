"""Calibration data as the Debias-SparseGPT paper calibrates: StereoSet intrasentence pairs read from
the official dev.json layout, and unpaired chat data in UltraChat's jsonl form rendered with the
tokenizer's chat template (plain contents joined by newlines without one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fairprune.data.files import Chats, is_chat_jsonl, read_calib_text, read_chat_jsonl
from fairprune.data.pairs import lm_texts, read_pairs, read_stereoset
from fairprune.data.text import (
    calibration_ids,
    calibration_stream,
    lm_corpus,
    render_calib_text,
    render_chats,
    train_bpe_tokenizer,
)
from fairprune.errors import UserError

# A small chat template in the style of ChatML (the form SmolLM2-Instruct and Qwen use).
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")

ROWS = [
    {"prompt": "How do bees make honey?", "prompt_id": "a1",
     "messages": [{"role": "user", "content": "How do bees make honey?"},
                  {"role": "assistant", "content": "They collect nectar and dry it in the hive."}]},
    {"prompt": "Name a river.", "prompt_id": "b2",
     "messages": [{"role": "user", "content": "Name a river."}, {"role": "assistant", "content": "The Danube."},
                  {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "The Rhine."}]},
]


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE tokenizer without a chat template (a fresh copy per use: see ``chat``)."""
    return train_bpe_tokenizer(lm_corpus(train_docs=30, validation_docs=1, seed=1).train, 300)


@pytest.fixture
def chat_tokenizer(tokenizer):
    import copy

    chat = copy.deepcopy(tokenizer)
    chat.chat_template = TEMPLATE
    return chat


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------
# UltraChat jsonl
# --------------------------------------------------------------------------------------------


def test_chat_rows_render_with_the_chat_template(tmp_path, chat_tokenizer):
    chats = read_chat_jsonl(write_jsonl(tmp_path / "ultrachat.jsonl", ROWS))
    assert isinstance(chats, Chats) and chats.lines == [1, 2] and chats.source.endswith("ultrachat.jsonl")
    assert render_chats(chat_tokenizer, chats) == [
        "<|im_start|>user\nHow do bees make honey?<|im_end|>\n"
        "<|im_start|>assistant\nThey collect nectar and dry it in the hive.<|im_end|>\n",
        "<|im_start|>user\nName a river.<|im_end|>\n<|im_start|>assistant\nThe Danube.<|im_end|>\n"
        "<|im_start|>user\nAnother?<|im_end|>\n<|im_start|>assistant\nThe Rhine.<|im_end|>\n",
    ]
    # The stream is the rendered rows one after another, each tokenized as apply_chat_template does
    # (no special tokens added: the template writes its own).
    expected = [t for text in render_chats(chat_tokenizer, chats)
                for t in chat_tokenizer(text, add_special_tokens=False).input_ids]
    assert calibration_stream(chat_tokenizer, chats).tolist() == expected
    ids = calibration_ids(chat_tokenizer, chats, nsamples=3, seqlen=8, seed=0)
    assert render_calib_text(chat_tokenizer, chats) == render_chats(chat_tokenizer, chats)
    assert render_calib_text(chat_tokenizer, "plain text") == "plain text"
    assert ids.shape == (3, 8) and ids.dtype == torch.long


def test_chat_rows_without_a_template_are_contents_joined_by_newlines(tmp_path, tokenizer):
    assert not getattr(tokenizer, "chat_template", None)
    chats = read_chat_jsonl(write_jsonl(tmp_path / "ultrachat.jsonl", ROWS))
    texts = render_chats(tokenizer, chats)
    assert texts == ["How do bees make honey?\nThey collect nectar and dry it in the hive.",
                     "Name a river.\nThe Danube.\nAnother?\nThe Rhine."]
    # Without a template the rows are documents, as plain text is: joined by a blank line.
    assert torch.equal(calibration_stream(tokenizer, chats), calibration_stream(tokenizer, "\n\n".join(texts)))


def test_calib_text_detects_jsonl_by_extension_and_content(tmp_path):
    jsonl = write_jsonl(tmp_path / "chat.jsonl", ROWS)
    disguised = write_jsonl(tmp_path / "chat.txt", ROWS)  # chat rows under a .txt name
    plain = tmp_path / "plain.txt"
    plain.write_text('{"not": "chat"}\nJust some text.\n')
    assert is_chat_jsonl(jsonl) and is_chat_jsonl(disguised) and not is_chat_jsonl(plain)
    assert read_calib_text(jsonl) == read_calib_text(disguised) == [r["messages"] for r in ROWS]
    assert read_calib_text(plain) == plain.read_text()
    texts = lm_texts(str(jsonl), str(plain))
    assert isinstance(texts.calib_text, Chats) and texts.eval_text == plain.read_text()
    assert isinstance(lm_texts(str(plain), str(plain)).calib_text, str)


def test_blank_lines_are_skipped_and_line_numbers_kept(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", ["", json.dumps(ROWS[0]), "   ", json.dumps(ROWS[1])])
    assert read_chat_jsonl(path).lines == [2, 4]


@pytest.mark.parametrize("lines,match", [
    ([json.dumps(ROWS[0]), '{"messages": [{"role": "user", "content": "hi"}'], r"line 2 is not valid JSON"),
    (["[1, 2]"], r"line 1 is a JSON list; expected one JSON object per line"),
    (['{"prompt": "x", "prompt_id": "y"}'], r"line 1 is an object without a 'messages' list"),
    (['{"messages": []}'], r"line 1 has an empty 'messages' list"),
    ([json.dumps(ROWS[0]), json.dumps(ROWS[1]), '{"messages": [{"role": "bot", "content": "hi"}]}'],
     r"line 3, message 1: needs a 'role' \(system, user, assistant\)"),
    (['{"messages": [{"role": "user", "content": 5}]}'], r"line 1, message 1: .*string 'content'"),
    (["", "  "], r"no chat rows"),
])
def test_malformed_chat_lines_are_one_line_errors_naming_file_and_line(tmp_path, lines, match):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(UserError, match=match) as info:
        read_chat_jsonl(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path))


def test_missing_and_non_utf8_chat_files(tmp_path):
    with pytest.raises(UserError, match="does not exist") as info:
        read_calib_text(tmp_path / "absent.jsonl")
    assert "\n" not in str(info.value)
    bad = tmp_path / "latin.jsonl"
    bad.write_bytes(json.dumps(ROWS[0]).encode() + b"\n" + b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    with pytest.raises(UserError, match=r"latin.jsonl: line 2 is not UTF-8"):
        read_chat_jsonl(bad)
    with pytest.raises(UserError, match="is a directory"):
        read_chat_jsonl(tmp_path)


def test_a_row_the_template_refuses_is_a_one_line_error(tmp_path, chat_tokenizer):
    chat_tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                                    "{{ raise_exception('System role not supported') }}{% endif %}"
                                    "{{ m['content'] }}{% endfor %}")
    path = write_jsonl(tmp_path / "sys.jsonl", [ROWS[0], {"messages": [{"role": "system", "content": "Be brief."}]}])
    with pytest.raises(UserError, match=r"sys.jsonl: line 2: the tokenizer's chat template refused this row .*"
                                        r"System role not supported") as info:
        calibration_ids(chat_tokenizer, read_chat_jsonl(path), 1, 4)
    assert "\n" not in str(info.value)


def test_the_cli_refuses_a_malformed_jsonl_in_one_line(tmp_path, capsys):
    from fairprune.cli.prune import main as prune_main
    from tiny_models import tiny_gpt2_folder

    tiny_gpt2_folder(tmp_path)
    bad = write_jsonl(tmp_path / "calib.jsonl", [json.dumps(ROWS[0]), "{oops"])
    code = prune_main(["sparsegpt", "--model", str(tmp_path / "dense"), "--calib_text", str(bad),
                       "--eval_text", str(tmp_path / "eval.txt"), "--output", str(tmp_path / "out"), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and f"{bad}: line 2 is not valid JSON" in err[-1]
    assert not any("Traceback" in line for line in err)


def test_debias_sparsegpt_calibrates_on_pairs_and_rendered_chat_rows(tmp_path):
    """The unpaired chat windows enter beside the pairs (the method's plain XXᵀ term)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fairprune.causal.blocks import Resident
    from fairprune.pruning.options import LMOptions, SolverOptions
    from fairprune.pruning.sparsity import Sparsity
    from fairprune.runs.lm import dense_of, prune_run
    from tiny_models import tiny_gpt2_folder

    tiny_gpt2_folder(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "dense")
    tokenizer.chat_template = TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    calib = write_jsonl(tmp_path / "calib.jsonl", ROWS * 6)
    texts = lm_texts(str(calib), str(tmp_path / "eval.txt"))
    texts = texts._replace(calib_pairs=texts.calib_pairs[:6], eval_pairs=texts.eval_pairs[:6])
    lm = LMOptions(model=str(tmp_path / "dense"), nsamples=4, seqlen=16, eval_tokens=64, dense_cache=False, stream=False)
    blocks = Resident(model)
    measuring = dense_of(blocks, tokenizer, texts, lm, progress=False)
    report = prune_run(blocks, "debias-sparsegpt", Sparsity.parse("0.5"), tmp_path / "out", measuring, lm, SolverOptions(),
                       {}, progress=False)
    assert report["calibration"]["nsamples"] == 4 and report["calibration"]["pairs"] == 6
    assert abs(report["achieved_sparsity"] - 0.5) < 0.01


# --------------------------------------------------------------------------------------------
# StereoSet intrasentence (the official dev.json layout)
# --------------------------------------------------------------------------------------------


def _item(item_id, sentences, **extra):
    return {"id": item_id, "target": "chess player", "bias_type": "profession", "context": "The chess player was BLANK.",
            "sentences": [{"sentence": text, "id": f"{item_id}-{k}", "labels": [{"label": label, "human_id": "h"}],
                           "gold_label": label} for k, (text, label) in enumerate(sentences)], **extra}


def stereoset(path: Path, items, intersentence=None) -> Path:
    path.write_text(json.dumps({"version": "1.0-dev", "data": {"intersentence": intersentence or [],
                                                               "intrasentence": items}}))
    return path


def test_stereoset_dev_json_gives_stereotype_anti_stereotype_pairs(tmp_path):
    items = [
        _item("a", [("The chess player was hispanic.", "anti-stereotype"), ("The chess player was fox.", "unrelated"),
                    ("The chess player was asian.", "stereotype")]),
        _item("b", [("Mothers are caring.", "stereotype"), ("Mothers are careless.", "anti-stereotype"),
                    ("Mothers are tables.", "unrelated")]),
    ]
    inter = [{"id": "i", "target": "x", "bias_type": "race", "context": "He is Arab.",
              "sentences": [{"sentence": "Not read.", "id": "i0", "labels": [], "gold_label": "stereotype"}]}]
    pairs = read_pairs(stereoset(tmp_path / "dev.json", items, inter))
    assert pairs == [("The chess player was asian.", "The chess player was hispanic."),
                     ("Mothers are caring.", "Mothers are careless.")]
    assert all(p.direction == "stereo" for p in pairs)


@pytest.mark.parametrize("data,match", [
    ({"version": "1.0-dev", "data": []}, r"no 'data.intrasentence' list"),
    ({"version": "1.0-dev", "data": {"intrasentence": [{"id": "x", "sentences": "oops"}]}},
     r"intrasentence item 0 \(id 'x'\) has no 'sentences' list"),
    ({"data": {"intrasentence": [_item("d", [("A.", "stereotype"), ("B.", "stereotype"), ("C.", "anti-stereotype")])]}},
     r"item 0 \(id 'd'\) has 2 stereotype and 1 anti-stereotype"),
    ({"data": {"intrasentence": [_item("u", [("A.", "stereotype"), ("C.", "unrelated")])]}},
     r"has 1 stereotype and 0 anti-stereotype"),
])
def test_stereoset_layout_errors_are_one_line(tmp_path, data, match):
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=match) as info:
        read_stereoset(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_stereoset_folder_is_a_one_line_error(tmp_path):
    folder = tmp_path / "dev.json"
    folder.mkdir()
    with pytest.raises(UserError, match="is a directory"):
        read_stereoset(folder)


@pytest.mark.parametrize("template, kind", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),  # the sandbox refuses the template
    ("{% for i in range(10 ** 12) %}{% endfor %}{{ messages[0]['content'] }}", "OverflowError"),
])
def test_a_hostile_template_is_blamed_on_the_template_not_the_data(tmp_path, chat_tokenizer, template, kind):
    chat_tokenizer.chat_template = template
    path = write_jsonl(tmp_path / "chat.jsonl", ROWS[:2])
    with pytest.raises(UserError) as info:
        calibration_ids(chat_tokenizer, read_chat_jsonl(path), 1, 4)
    message = str(info.value)
    assert kind in message and "the template" in message and "not the data" in message
    assert "fix or drop the row" not in message and "\n" not in message
