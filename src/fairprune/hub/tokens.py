"""Tokenizer facts every LM reader follows: whether a tokenizer adds a BOS token, and whether a
chat template failed through its own fault.

Kept at the bottom of the house (beside the loader) because the converted-GGUF loader, the text
readers and the metrics all ask it.
"""

from __future__ import annotations

import torch


def bos_of(tokenizer) -> int | None:
    """The BOS id when ``tokenizer`` adds one at the head of what it encodes (Llama, Gemma, a
    converted GGUF whose ``tokenizer.ggml.add_bos_token`` is true), else None (GPT-2, Qwen, SmolLM2):
    a window such a model reads starts with it, as lm-eval's requests do."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    try:
        found = tokenizer("a", verbose=False).input_ids
        plain = tokenizer("a", add_special_tokens=False, verbose=False).input_ids
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode plain text: no BOS rule to follow
        return None
    return int(bos) if found and found[0] == bos and (not plain or plain[0] != bos) else None


def with_bos(windows: torch.Tensor, bos: int | None) -> torch.Tensor:
    """``windows`` [n, L] with a column of ``bos`` before them ([n, L + 1]); as they are for None."""
    if bos is None:
        return windows
    return torch.cat([torch.full((windows.shape[0], 1), bos, dtype=windows.dtype), windows], dim=1)


def template_at_fault(err: Exception) -> bool:
    """Whether rendering failed because of the template itself rather than a row: jinja2's sandbox
    refusing what the template does (``SecurityError``: an unsafe attribute or call), a range over
    the sandbox's limit (``OverflowError``), runaway recursion or memory."""
    try:
        from jinja2.exceptions import SecurityError
    except ImportError:  # no jinja2: transformers could not have rendered a template
        SecurityError = ()  # noqa: N806
    return isinstance(err, (SecurityError, OverflowError, RecursionError, MemoryError))
