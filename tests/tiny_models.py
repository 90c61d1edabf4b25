"""Tiny randomly initialised transformers models, one per supported family, shared by the tests.

``BUILDERS[model_type]()`` builds a fresh model (seed torch first for repeatable weights): two
layers, four attention heads of width 16, a vocabulary of :data:`VOCAB` tokens. ``builder(model_type,
**overrides)`` gives the same model with some config fields changed (``None`` drops a field, so the
config's default applies).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import transformers as tf

VOCAB = 96
TOKENS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
_SHAPE = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                vocab_size=VOCAB, max_position_embeddings=64)

# model_type → (model class, config class, config fields)
SPECS: dict[str, tuple[type, type, dict[str, Any]]] = {
    "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config,
             dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, **TOKENS)),
    "gpt_neo": (tf.GPTNeoForCausalLM, tf.GPTNeoConfig,
                dict(num_layers=2, hidden_size=64, num_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
                     attention_types=[[["global", "local"], 1]], window_size=8, intermediate_size=128, **TOKENS)),
    "opt": (tf.OPTForCausalLM, tf.OPTConfig,
            dict(num_hidden_layers=2, hidden_size=64, ffn_dim=128, num_attention_heads=4, vocab_size=VOCAB,
                 max_position_embeddings=64, word_embed_proj_dim=32, **TOKENS)),  # exercises project_in
    "llama": (tf.LlamaForCausalLM, tf.LlamaConfig, dict(**_SHAPE, num_key_value_heads=2, **TOKENS)),
    "mistral": (tf.MistralForCausalLM, tf.MistralConfig, dict(**_SHAPE, num_key_value_heads=2, **TOKENS)),
    "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config, dict(**_SHAPE, num_key_value_heads=2, **TOKENS)),
    "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config, dict(**_SHAPE, num_key_value_heads=2, head_dim=16, **TOKENS)),
    # Gemma 2 / 3 alternate sliding-window and global layers: a window of 4 makes them differ on short text.
    "gemma2": (tf.Gemma2ForCausalLM, tf.Gemma2Config,
               dict(**_SHAPE, num_key_value_heads=2, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                    layer_types=["sliding_attention", "full_attention"], **TOKENS)),
    "gemma3_text": (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig,
                    dict(**_SHAPE, num_key_value_heads=2, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                         layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0, **TOKENS)),
    "phi3": (tf.Phi3ForCausalLM, tf.Phi3Config, dict(**_SHAPE, num_key_value_heads=2, **TOKENS)),
    "bert": (tf.BertForMaskedLM, tf.BertConfig, dict(**_SHAPE, pad_token_id=0)),
    "roberta": (tf.RobertaForMaskedLM, tf.RobertaConfig,
                dict(_SHAPE, max_position_embeddings=68, pad_token_id=1)),  # RoBERTa offsets positions by pad + 1
}


# Mixture-of-experts families (transformers 5 fuses their experts into 3-D parameters): four small
# experts, two per token. Kept apart from SPECS, whose families every dense test runs.
_MOE_SHAPE = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=32, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, num_experts_per_tok=2, **TOKENS)
MOE_SPECS: dict[str, dict[str, Any]] = {
    "mixtral": dict(_MOE_SHAPE, num_local_experts=4),
    "qwen3_moe": dict(_MOE_SHAPE, num_experts=4, moe_intermediate_size=32, head_dim=16),
    "qwen2_moe": dict(_MOE_SHAPE, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "olmoe": dict(_MOE_SHAPE, num_experts=4),
    "gpt_oss": dict(_MOE_SHAPE, num_local_experts=4, head_dim=16, layer_types=["sliding_attention", "full_attention"]),
    "granitemoe": dict(_MOE_SHAPE, num_local_experts=4),
    "phimoe": dict(_MOE_SHAPE, num_local_experts=4),
}
#: Mixture-of-experts families whose blocks are of two kinds: the first layer's MLP dense, the
#: second's routed through experts (DeepSeek-V3's and GLM-4.5's ``first_k_dense_replace``,
#: Qwen2-MoE's ``mlp_only_layers``); DeepSeek-V3's attention is MLA (low-rank key / value). The
#: fields a :func:`moe_model` call adds to the family's row (or to the common shape).
MIXED_MOE_SPECS: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=4, moe_intermediate_size=32,
                        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "glm4_moe": dict(n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1,
                     first_k_dense_replace=1, n_group=1, topk_group=1, head_dim=16),
    "qwen2_moe": dict(mlp_only_layers=[0]),
}
#: LFM2: a short-convolution block (a ``Conv1d`` kernel, 3-D like fused experts but no stack of
#: them) and an attention block; no experts.
LFM2 = dict(num_key_value_heads=2, layer_types=["conv", "full_attention"])
#: Llama 4: a dense MLP and an expert layer in turn (``interleave_moe_layer_step``), its experts
#: module fed tokens already routed (calibrated methods refuse it; magnitude prunes it).
LLAMA4 = dict(num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
              intermediate_size_mlp=64, interleave_moe_layer_step=2)


def moe_model(model_type: str, vocab: int = VOCAB, **overrides: Any) -> tf.PreTrainedModel:
    """The tiny ``model_type`` mixture-of-experts model (seed torch first), from its config."""
    fields = {**MOE_SPECS.get(model_type, _MOE_SHAPE), "vocab_size": vocab, **overrides}
    return tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(model_type, **fields))


def lm_folder(root, model: Callable[[int, int], tf.PreTrainedModel], name: str = "dense") -> str:
    """``model(vocab, eos_id)`` saved with a BPE tokenizer trained on the bundled corpus in
    ``root / name``, the corpus's validation text in ``root / "eval.txt"``; returns the folder."""
    from fairprune.data.text import lm_corpus, train_bpe_tokenizer

    corpus = lm_corpus(train_docs=40, validation_docs=6, seed=3)
    tokenizer = train_bpe_tokenizer(corpus.train, 300, root / "tok")
    built = model(len(tokenizer), tokenizer.eos_token_id)
    built.save_pretrained(root / name)
    tokenizer.save_pretrained(root / name)
    (root / "eval.txt").write_text(corpus.validation)
    return str(root / name)


def moe_folder(root, model_type: str, **overrides: Any) -> str:
    """The tiny ``model_type`` mixture-of-experts model saved with a trained tokenizer (:func:`lm_folder`)."""
    import torch

    torch.manual_seed(0)
    return lm_folder(root, lambda vocab, eos: moe_model(model_type, vocab, bos_token_id=eos, eos_token_id=eos,
                                                        pad_token_id=eos, **overrides))


def builder(model_type: str, **overrides: Any) -> Callable[[], tf.PreTrainedModel]:
    """A zero-argument function building the tiny ``model_type`` model, config fields overridden."""
    model_class, config_class, fields = SPECS[model_type]
    fields = {k: v for k, v in {**fields, **overrides}.items() if v is not None}
    return lambda: model_class(config_class(**fields))


BUILDERS: dict[str, Callable[[], tf.PreTrainedModel]] = {name: builder(name) for name in SPECS}


def tiny_gpt2_folder(root) -> str:
    """A tiny GPT-2 saved with a BPE tokenizer trained on the bundled corpus in ``root / "dense"``,
    and that corpus's validation text in ``root / "eval.txt"``: an LM folder the commands load like
    any other. Returns the corpus's validation text."""
    import torch

    from fairprune.data.text import lm_corpus, train_bpe_tokenizer

    corpus = lm_corpus(train_docs=40, validation_docs=6, seed=3)
    tokenizer = train_bpe_tokenizer(corpus.train, 300, root / "tok")
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=len(tokenizer), n_positions=64,
                                             bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(root / "dense")
    tokenizer.save_pretrained(root / "dense")
    (root / "eval.txt").write_text(corpus.validation)
    return corpus.validation


def write_gguf(model, tokenizer, path, add_bos: bool | None = None) -> None:
    """``model`` (a llama.cpp-named architecture: qwen2, ...) and its byte-level BPE ``tokenizer``
    as a float32 GGUF file, tensors named by the ``gguf`` package's own map: the file a user's
    llama.cpp conversion gives, made offline (``add_bos``: ``tokenizer.ggml.add_bos_token``, when given)."""
    import json

    import gguf

    config = model.config
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == config.model_type)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), config.model_type)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    tokens = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(config.model_type)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    writer.add_bos_token_id(tokenizer.eos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    for name, tensor in model.state_dict().items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def train_sentencepiece_bpe(texts: str, vocab_size: int, path, prefix_space: bool):
    """A SentencePiece-style BPE tokenizer trained on ``texts`` and saved to ``path``, in the
    ``tokenizer.json`` shape Gemma (``prefix_space`` false: spaces become ``▁``) and Llama 2 / Phi-3
    (true: a ``▁`` put before the text too) ship: ids 0-3 ``<pad> <eos> <bos> <unk>``, then the 256
    byte-fallback pieces ``<0x00>``..``<0xFF>``, then the learned pieces; BOS added to each text."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    learner.train_from_iterator([texts], trainers.BpeTrainer(vocab_size=vocab_size - 260, show_progress=False))
    learned = json.loads(learner.to_str())["model"]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for token, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    space = normalizers.Replace(" ", "\u2581")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), space]) if prefix_space else space
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix_space else steps)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.save_pretrained(str(path))
    return fast
