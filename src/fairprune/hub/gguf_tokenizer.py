"""A tokenizer as GGUF fields, the way llama.cpp's ``convert_hf_to_gguf.py`` writes it
(:func:`tokenizer_fields`, :func:`add_tokenizer`): byte-level BPE (``tokenizer.ggml.model`` ``gpt2``)
or SentencePiece BPE with byte fallback (``llama``). Used by :mod:`fairprune.hub.gguf_file`."""

from __future__ import annotations

import json
from typing import Any

from fairprune.errors import UserError

#: llama.cpp's name of a byte-level pre-tokenizer, by its shape in ``tokenizer.json``.
BYTE_LEVEL = "gpt-2"
DIGITS_THEN_BYTE_LEVEL = "smollm"


def _pre_tokenizer(spec: dict[str, Any]) -> str:
    """llama.cpp's name (``tokenizer.ggml.pre``) of the pre-tokenizer in ``tokenizer.json``'s
    ``spec``: GPT-2's plain byte level, SmolLM's digits then byte level, or a split whose regex
    transformers' GGUF reader knows by name; anything else is refused in one line."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return BYTE_LEVEL
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return DIGITS_THEN_BYTE_LEVEL
    if kinds == ["Split", "ByteLevel"]:
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        for name, regex in GGUF_PRE_TOKENIZER_SPLITS.items():
            if regex == pattern:
                return name
    raise UserError(f"--format gguf: the tokenizer's pre-tokenizer ({' + '.join(map(str, kinds)) or 'none'}) has no "
                    "llama.cpp name known here; byte-level BPE tokenizers of the GPT-2, SmolLM, Llama 3 and Qwen2 "
                    "kinds can be exported")


def tokenizer_fields(tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """The tokenizer of a model with ``vocab_size`` embeddings as GGUF fields: ``model``, ``tokens``,
    ``token_types``, ``scores``, ``merges``, ``pre``, ``space_prefix``, the special ids,
    ``add_bos`` / ``add_eos`` and ``chat_template``.

    Two kinds are written, as convert_hf_to_gguf writes them: byte-level BPE (GPT-2, SmolLM, Llama 3,
    Qwen; ``tokenizer.ggml.model`` ``gpt2``, with merges and the pre-tokenizer's name) and
    SentencePiece BPE with byte fallback (Gemma, Phi-3, Llama 2; ``llama``, byte tokens typed
    ``BYTE``). llama.cpp tokenizes the latter by scores, merging first the adjacent pair whose joined
    piece scores highest; each piece's score is minus the rank of the merge that makes it, which
    gives the merge order of ``tokenizer.json`` (a SentencePiece model's own scores are that order).
    The merges are written too: transformers' reader builds its tokenizer from them."""
    import gguf

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UserError("--format gguf: the model's tokenizer is not a fast (tokenizers) tokenizer; export needs "
                        "its tokenizer.json")
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") == "BPE" and (spec.get("decoder") or {}).get("type") == "ByteLevel":
        kind, pre, space_prefix = "gpt2", _pre_tokenizer(spec), None
    elif model.get("type") == "BPE" and model.get("byte_fallback"):
        kind, pre, space_prefix = "llama", None, _space_prefix(spec)
    else:
        raise UserError(f"--format gguf: the tokenizer is a {model.get('type')} tokenizer that is neither byte-level BPE "
                        "nor SentencePiece BPE with byte fallback; only those two kinds are exported")
    vocab = {int(i): t for t, i in model["vocab"].items()}
    added = {int(i): token for i, token in tokenizer.added_tokens_decoder.items()}
    size = max([*vocab, *added], default=-1) + 1
    if size > vocab_size:
        raise UserError(f"--format gguf: the tokenizer has {size} tokens, more than the model's {vocab_size} embeddings")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    made_by: dict[str, int] = {}
    for rank, merge in enumerate(merges):
        made_by.setdefault(merge.replace(" ", ""), rank)
    unk = tokenizer.unk_token_id
    tokens, types, scores = [], [], []
    for i in range(vocab_size):  # convert_hf_to_gguf's get_vocab_base: padding ids get [PADn], unused
        if i in added:
            tokens.append(added[i].content)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        elif i in vocab:
            tokens.append(vocab[i])
            byte = kind == "llama" and len(vocab[i]) == 6 and vocab[i].startswith("<0x") and vocab[i].endswith(">")
            types.append(gguf.TokenType.BYTE if byte else
                         gguf.TokenType.UNKNOWN if kind == "llama" and i == unk else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        scores.append(-float(made_by[tokens[-1]]) if tokens[-1] in made_by and i not in added else 0.0)
    with_special = tokenizer("a", add_special_tokens=True).input_ids
    without = tokenizer("a", add_special_tokens=False).input_ids
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    template = getattr(tokenizer, "chat_template", None)
    return {"model": kind, "tokens": tokens, "token_types": types, "scores": scores, "merges": merges, "pre": pre,
            "space_prefix": space_prefix, "bos": bos, "eos": eos, "unk": unk, "pad": tokenizer.pad_token_id,
            "add_bos": bos is not None and len(with_special) > len(without) and with_special[0] == bos,
            "add_eos": eos is not None and len(with_special) > len(without) and with_special[-1] == eos,
            "chat_template": template if isinstance(template, str) else None}


def _space_prefix(spec: dict[str, Any]) -> bool:
    """Whether a SentencePiece ``tokenizer.json`` puts ``▁`` before the text (a ``Prepend``
    normalizer or a ``Metaspace`` pre-tokenizer that prepends): ``tokenizer.ggml.add_space_prefix``."""
    def steps(part: Any, key: str) -> list[dict[str, Any]]:
        part = part or {}
        return part.get(key, []) if part.get("type") == "Sequence" else [part]

    normalized = steps(spec.get("normalizer"), "normalizers")
    pre = steps(spec.get("pre_tokenizer"), "pretokenizers")
    return (any(n.get("type") == "Prepend" for n in normalized)
            or any(p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never" for p in pre))


def add_tokenizer(writer: Any, fields: dict[str, Any]) -> None:
    writer.add_tokenizer_model(fields["model"])
    if fields["pre"] is not None:
        writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["token_types"])
    if fields["model"] == "llama":
        writer.add_token_scores(fields["scores"])
        writer.add_add_space_prefix(bool(fields["space_prefix"]))
    writer.add_token_merges(fields["merges"])
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if fields[key] is not None:
            add(int(fields[key]))
    writer.add_add_bos_token(bool(fields["add_bos"]))
    writer.add_add_eos_token(bool(fields["add_eos"]))
    if fields["chat_template"]:
        writer.add_chat_template(fields["chat_template"])
