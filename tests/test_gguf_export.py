"""``prune.py export --format gguf``: tiny llama / mistral / qwen2 / qwen3 models (half their block weights
zeroed, as a pruned model's are) written as GGUF and read back by transformers' own GGUF reader and
by fairprune's ``--model file.gguf``; the logits must equal those of the source with every weight
rounded by ``gguf.quants`` to the file's type, computed here from the source folder."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers as tf

from cli_output import last_error
from fairprune.cli.prune import main

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
TYPES = ("f16", "q8_0", "q4_0")
GGML = {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
        "q4_0": gguf.GGMLQuantizationType.Q4_0}
SHORT = ["--eval_tokens", "96", "--eval_seqlen", "32", "--quiet"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A byte-level BPE tokenizer trained on the bundled corpus, and that corpus's validation text."""
    from fairprune.data.text import lm_corpus, train_bpe_tokenizer

    root = tmp_path_factory.mktemp("corpus")
    texts = lm_corpus(train_docs=30, validation_docs=4, seed=3)
    tokenizer = train_bpe_tokenizer(texts.train, 300, root / "tok")
    (root / "eval.txt").write_text(texts.validation)
    return tokenizer, root / "eval.txt"


def pruned_folder(root: Path, tokenizer, family: str, **config) -> Path:
    """A tiny ``family`` model, the smaller half of each block weight zeroed, saved with ``tokenizer``."""
    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=320, max_position_embeddings=128,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(family, **{**fields, **config}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".layers." in name and param.dim() >= 2 and "gate.weight" not in name:  # fused experts too; routers dense
                param[param.abs() < param.abs().median()] = 0
    folder = root / family
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def rounded_source(folder: Path, gguf_type: str) -> tf.PreTrainedModel:
    """The source model with every 2-D weight rounded to the file's type by ``gguf.quants`` (with
    q4_0 the embedding and LM head in Q8_0); norms and biases as they are (F32)."""
    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2:
                continue
            qtype = GGML[gguf_type]
            if gguf_type == "q4_0" and ("embed_tokens" in name or "lm_head" in name):
                qtype = GGML["q8_0"]
            data = param.numpy()
            param.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype).reshape(data.shape)))
    return model


def export(folder: Path, output: Path, gguf_type: str, eval_text: Path, *extra: str) -> int:
    return main(["export", "--format", "gguf", "--model", str(folder), "--gguf_type", gguf_type, "--output", str(output),
                 "--eval_text", str(eval_text), "--threads", "1", *SHORT, *extra])


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("gguf_type", TYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_through_transformers(tmp_path, corpus, one_thread, family, gguf_type):
    tokenizer, eval_text = corpus
    folder = pruned_folder(tmp_path, tokenizer, family)
    path = tmp_path / "out" / f"{family}.{gguf_type}.gguf"
    assert export(folder, path, gguf_type, eval_text) == 0
    loaded = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    # llama.cpp writes Mistral as llama; transformers reads it back as such
    assert type(loaded).__name__ == ("LlamaForCausalLM" if family == "mistral" else type(rounded_source(folder, "f16")).__name__)
    ids = tokenizer(eval_text.read_text()[:400], return_tensors="pt").input_ids[:, :48]
    reference = rounded_source(folder, gguf_type)
    torch.testing.assert_close(logits(loaded, ids), logits(reference, ids), rtol=0, atol=1e-5)
    source = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for name, param in source.named_parameters():  # every pruned zero still zero, every type
        if ".layers." in name and param.dim() == 2:
            assert (loaded.get_parameter(name)[param == 0] == 0).all(), name
    back = tf.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = eval_text.read_text()[:300]
    assert back(text).input_ids == tokenizer(text).input_ids
    report = json.loads((path.parent / f"{family}.{gguf_type}.report.json").read_text())
    assert report["format"] == "gguf" and report["gguf_type"] == gguf_type
    assert report["bytes"] == path.stat().st_size and report["logits_max_abs_difference"] <= 1e-5
    assert report["pruned_zeros"]["fraction_kept"] == 1.0 and report["pruned_zeros"]["share"] > 0.4
    assert report["ratio"] == pytest.approx(path.stat().st_size / report["dense_bf16_bytes"])
    assert report["perplexity"]["loaded"] == pytest.approx(report["perplexity"]["source"], rel=0.05 if gguf_type == "q4_0" else 0.01)
    assert report["tokenizer_matches"] is True
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, f"{family}.{gguf_type}.report.json"])


def test_fairprune_reads_it_back(tmp_path, corpus, one_thread):
    """``--model file.gguf`` (fairprune's loader) gives the model transformers' reader gives, and
    its tokenizer; the tied embedding stays tied (no output.weight in the file)."""
    from fairprune.hub import load_model, load_tokenizer

    tokenizer, eval_text = corpus
    folder = pruned_folder(tmp_path, tokenizer, "llama", tie_word_embeddings=True)
    path = tmp_path / "llama.q8_0.gguf"
    assert export(folder, path, "q8_0", eval_text) == 0
    assert "output.weight" not in [t.name for t in gguf.GGUFReader(str(path)).tensors]
    ours = load_model(str(path), dtype="float32").eval()
    assert ours.config.tie_word_embeddings
    ids = tokenizer(eval_text.read_text()[:400], return_tensors="pt").input_ids[:, :48]
    torch.testing.assert_close(logits(ours, ids), logits(rounded_source(folder, "q8_0"), ids), rtol=0, atol=1e-5)
    assert load_tokenizer(str(path))("a b c").input_ids == tokenizer("a b c").input_ids


def test_file_metadata_follows_llama_cpp(tmp_path, corpus, one_thread):
    """The keys llama.cpp's llama loader reads, the q rows permuted as convert_hf_to_gguf permutes them."""
    from fairprune.hub.gguf_file import permute

    tokenizer, eval_text = corpus
    folder = pruned_folder(tmp_path, tokenizer, "llama")
    path = tmp_path / "m.f16.gguf"
    assert export(folder, path, "f16", eval_text) == 0
    reader = gguf.GGUFReader(str(path))
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == "llama" and field("tokenizer.ggml.model") == "gpt2"
    assert field("llama.attention.head_count_kv") == 2 and field("llama.rope.dimension_count") == 16
    assert field("tokenizer.ggml.pre") == "gpt-2" and len(field("tokenizer.ggml.tokens")) == 320
    assert field("tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    assert field("general.file_type") == gguf.LlamaFileType.MOSTLY_F16
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    source = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    q = source.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    stored = np.asarray(tensors["blk.0.attn_q.weight"].data, dtype=np.float32).reshape(q.shape)
    np.testing.assert_array_equal(stored, permute(q, 4, 4).astype(np.float16).astype(np.float32))


def test_unsupported_family_is_one_line(tmp_path, corpus, capsys):
    tokenizer, eval_text = corpus
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=320, n_positions=64))
    model.save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    assert export(tmp_path / "gpt2", tmp_path / "out" / "g.gguf", "f16", eval_text) == 2
    line = last_error(capsys)
    assert "'gpt2' cannot be exported" in line and "llama, mistral, qwen2" in line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_user_mistakes_are_one_line(tmp_path, corpus, capsys):
    tokenizer, eval_text = corpus
    assert export(tmp_path / "missing", tmp_path / "x.gguf", "f16", eval_text) == 2
    assert "does not exist" in last_error(capsys)
    folder = pruned_folder(tmp_path, tokenizer, "llama")
    assert export(folder, tmp_path / "x.bin", "f16", eval_text) == 2
    assert "does not end in .gguf" in last_error(capsys)
    assert export(folder, tmp_path / "x.gguf", "q5_k", eval_text) == 2
    assert "--gguf_type 'q5_k'" in last_error(capsys)
    assert main(["export", "--format", "gguf", "--ckpt", "a.ckpt", "--quiet"]) == 2
    assert "give --model" in last_error(capsys)
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob("*.json"))


def test_failed_check_leaves_nothing(tmp_path, corpus, one_thread, capsys):
    """A Llama with attention biases: llama.cpp stores them, but transformers' reader builds the
    model without them (its config says ``attention_bias`` false), so it would compute another
    model: the command fails in one line naming the field, no temporary file or report remains (a
    file not of an export at the output is refused before any work:
    test_export_replaces_only_what_it_wrote)."""
    tokenizer, eval_text = corpus
    folder = pruned_folder(tmp_path, tokenizer, "llama", attention_bias=True)
    with torch.no_grad():  # biases far from zero, so dropping them shows
        model = tf.AutoModelForCausalLM.from_pretrained(folder)
        for layer in model.model.layers:
            layer.self_attn.q_proj.bias.fill_(1.0)
        model.save_pretrained(folder)
    out = tmp_path / "out"
    out.mkdir()
    assert export(folder, out, "f16", eval_text) == 2
    line = last_error(capsys)
    assert "attention_bias False (the source: True)" in line and "nothing was written" in line
    assert list(out.iterdir()) == []


def test_export_replaces_only_what_it_wrote(tmp_path, corpus, one_thread, capsys):
    tokenizer, eval_text = corpus
    folder = pruned_folder(tmp_path, tokenizer, "qwen2")
    path = tmp_path / "out" / "model.gguf"
    path.parent.mkdir()
    path.write_text("my notes, not a model")
    assert export(folder, path, "f16", eval_text) != 0
    assert "was not written by prune.py export" in last_error(capsys) and path.read_text() == "my notes, not a model"
    other = tmp_path / "out" / "other.gguf"
    (tmp_path / "out" / "other.report.json").write_text('{"mine": true}')
    assert export(folder, other, "f16", eval_text) != 0
    assert "is not a report of prune.py export" in last_error(capsys) and not other.exists()
    assert (tmp_path / "out" / "other.report.json").read_text() == '{"mine": true}'
    fresh = tmp_path / "out" / "fresh.gguf"
    assert export(folder, fresh, "f16", eval_text) == 0
    first = fresh.stat().st_mtime_ns
    assert export(folder, fresh, "q8_0", eval_text) == 0  # its own file and report: replaced
    assert fresh.stat().st_mtime_ns != first
    assert json.loads((tmp_path / "out" / "fresh.report.json").read_text())["gguf_type"] == "q8_0"


def test_a_killed_exports_temporary_file_is_removed(tmp_path, corpus, one_thread):
    import subprocess
    import sys

    tokenizer, eval_text = corpus
    folder = pruned_folder(tmp_path, tokenizer, "qwen2")
    path = tmp_path / "out" / "model.gguf"
    path.parent.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a process that no longer runs, as a killed export's
    dead = path.with_name(f".{path.name}.{gone.pid}.tmp")
    dead.write_bytes(b"GGUF" + b"\0" * 64)
    alive = path.with_name(f".{path.name}.{os.getppid()}.tmp")  # a live process's: left alone
    alive.write_bytes(b"GGUF")
    assert export(folder, path, "f16", eval_text) == 0
    assert not dead.exists() and alive.exists()


# Qwen3-MoE: transformers' reader takes the experts' width from its config default (768), as the
# real Qwen3-30B-A3B has it; llama.cpp's file splits the fused gate / up experts in two.
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768, head_dim=16, norm_topk_prob=True)


@pytest.mark.parametrize("gguf_type", ["f16", "q4_0"])
def test_qwen3_moe_round_trip_through_transformers(tmp_path, corpus, one_thread, gguf_type):
    tokenizer, eval_text = corpus
    folder = pruned_folder(tmp_path, tokenizer, "qwen3_moe", **MOE)
    path = tmp_path / "out" / f"moe.{gguf_type}.gguf"
    assert export(folder, path, gguf_type, eval_text) == 0
    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    assert {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight",
            "blk.0.ffn_gate_inp.weight"} <= names
    loaded = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM"
    ids = tokenizer(eval_text.read_text()[:400], return_tensors="pt").input_ids[:, :48]
    torch.testing.assert_close(logits(loaded, ids), logits(rounded_source(folder, gguf_type), ids), rtol=0, atol=1e-5)
    report = json.loads((path.parent / f"moe.{gguf_type}.report.json").read_text())
    assert report["pruned_zeros"]["fraction_kept"] == 1.0 and report["pruned_zeros"]["share"] > 0.4
    source = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    experts = source.model.layers[0].mlp.experts.gate_up_proj
    assert (loaded.model.layers[0].mlp.experts.gate_up_proj[experts == 0] == 0).all()


def test_a_moe_llama_cpp_would_compute_otherwise_is_refused(tmp_path, corpus, capsys):
    tokenizer, eval_text = corpus
    folder = pruned_folder(tmp_path, tokenizer, "qwen3_moe", **{**MOE, "norm_topk_prob": False})
    assert export(folder, tmp_path / "m.gguf", "f16", eval_text) == 2
    assert "norm_topk_prob false" in last_error(capsys) and not (tmp_path / "m.gguf").exists()


# -- SentencePiece families: Gemma 2 / 3 (norms stored as 1 + w) and Phi-3 (fused qkv / gate-up) ----
SENTENCEPIECE = {"gemma2": dict(head_dim=256, query_pre_attn_scalar=256), "gemma3_text": dict(head_dim=256, query_pre_attn_scalar=256),
                 "phi3": {}}


@pytest.fixture(scope="module")
def sp_corpus(tmp_path_factory):
    """SentencePiece-style tokenizers (Gemma's shape and Llama 2 / Phi-3's, with a space prefix)
    trained on the bundled corpus, and that corpus's validation text."""
    from fairprune.data.text import lm_corpus
    from tiny_models import train_sentencepiece_bpe

    root = tmp_path_factory.mktemp("sp")
    texts = lm_corpus(train_docs=30, validation_docs=4, seed=3)
    (root / "eval.txt").write_text(texts.validation)
    return ({prefix: train_sentencepiece_bpe(texts.train, 400, root / f"tok{prefix}", prefix_space=prefix) for prefix in (False, True)},
            root / "eval.txt")


def sp_folder(root: Path, tokenizers: dict, family: str, **config) -> tuple[Path, Any]:
    tokenizer = tokenizers[family == "phi3"]
    fields = dict(vocab_size=416, pad_token_id=0, **SENTENCEPIECE[family])
    return pruned_folder(root, tokenizer, family, **{**fields, **config}), tokenizer


def spm_oracle(text: str, tokens: list[str], scores: list[float], types: list[int], space_prefix: bool) -> list[int]:
    """llama.cpp's SentencePiece tokenizer (``llm_tokenizer_spm``), written plainly: the text's
    characters, then, while any adjacent pair joins into a vocabulary piece, join the pair whose
    piece scores highest (the leftmost on a tie); a character left outside the vocabulary becomes
    its UTF-8 bytes' ``<0xXX>`` pieces."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] in (gguf.TokenType.NORMAL, gguf.TokenType.BYTE,
                                                             gguf.TokenType.USER_DEFINED, gguf.TokenType.UNKNOWN)}
    symbols = list(((" " if space_prefix else "") + text).replace(" ", "\u2581"))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            joined = symbols[i] + symbols[i + 1]
            if joined in ids and (best is None or scores[ids[joined]] > scores[ids[best[1]]]):
                best = (i, joined)
        if best is None:
            break
        symbols[best[0]: best[0] + 2] = [best[1]]
    out = []
    for symbol in symbols:
        out += [ids[symbol]] if symbol in ids else [ids[f"<0x{b:02X}>"] for b in symbol.encode()]
    return out


@pytest.mark.parametrize("gguf_type", ["f16", "q4_0"])
@pytest.mark.parametrize("family", sorted(SENTENCEPIECE))
def test_sentencepiece_family_round_trip(tmp_path, sp_corpus, one_thread, family, gguf_type):
    tokenizers, eval_text = sp_corpus
    folder, tokenizer = sp_folder(tmp_path, tokenizers, family)
    path = tmp_path / "out" / f"{family}.gguf"
    assert export(folder, path, gguf_type, eval_text) == 0
    loaded = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    reference = rounded_source(folder, gguf_type)
    assert type(loaded) is type(reference)
    if family != "phi3":  # the file holds 1 + w, in float32, and the reader takes the 1 off
        with torch.no_grad():
            for name, param in reference.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_((param + 1) - 1)
    ids = tokenizer(eval_text.read_text()[:400], return_tensors="pt").input_ids[:, :48]
    torch.testing.assert_close(logits(loaded, ids), logits(reference, ids), rtol=0, atol=1e-5)
    source = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for name, param in source.named_parameters():
        if ".layers." in name and param.dim() == 2:
            assert (loaded.get_parameter(name)[param == 0] == 0).all(), name
    reader = gguf.GGUFReader(path)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("tokenizer.ggml.model") == "llama" and field("general.architecture") == {"gemma3_text": "gemma3"}.get(family, family)
    tokens, scores, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.scores"), field("tokenizer.ggml.token_type")
    assert types[tokens.index("<0x41>")] == gguf.TokenType.BYTE and types[tokens.index("<bos>")] == gguf.TokenType.CONTROL
    assert field("tokenizer.ggml.add_space_prefix") is (family == "phi3") and field("tokenizer.ggml.add_bos_token") is True
    text = eval_text.read_text()[:300] + " naïve café ✓"  # characters outside the vocabulary: byte fallback
    plain = tokenizer(text, add_special_tokens=False).input_ids
    assert tf.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)(text).input_ids == tokenizer(text).input_ids
    assert spm_oracle(text, tokens, scores, types, family == "phi3") == plain  # llama.cpp's rule on the file's scores
    report = json.loads((path.parent / f"{family}.report.json").read_text())
    assert report["tokenizer_model"] == "llama" and report["config_differences"] == {}
    assert report["logits_max_abs_difference"] <= 1e-5 and report["pruned_zeros"]["fraction_kept"] == 1.0


@pytest.mark.parametrize(("family", "config", "named"), [
    ("gemma2", dict(final_logit_softcapping=20.0), "final_logit_softcapping 30.0 (the source: 20.0)"),
    ("gemma3_text", dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
                                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}), "rope_parameters"),
    ("gemma2", dict(head_dim=16, query_pre_attn_scalar=16, layer_types=["full_attention", "full_attention"]), "layer_types"),
])
def test_a_setting_the_file_cannot_hold_is_refused(tmp_path, sp_corpus, one_thread, capsys, family, config, named):
    """Settings transformers' reader gives back otherwise (Gemma 2's final soft-capping, Gemma 3's
    local rotary base, a layer pattern other than the family's) are named in one line, and
    nothing is written."""
    tokenizers, eval_text = sp_corpus
    folder, _ = sp_folder(tmp_path, tokenizers, family, **config)
    out = tmp_path / "out"
    out.mkdir()
    assert export(folder, out, "f16", eval_text) == 2
    line = last_error(capsys)
    assert named in line and "nothing was written" in line and list(out.iterdir()) == []


def test_gemma_query_scale_llama_cpp_computes_otherwise_is_refused(tmp_path, sp_corpus, capsys):
    tokenizers, eval_text = sp_corpus
    folder, _ = sp_folder(tmp_path, tokenizers, "gemma2", head_dim=16)  # query_pre_attn_scalar stays 256
    assert export(folder, tmp_path / "out.gguf", "f16", eval_text) == 2
    assert "query_pre_attn_scalar 256, not its head width 16" in last_error(capsys)
    assert not (tmp_path / "out.gguf").exists()
