"""FASP's text generation: one KV-cached sampling loop for the one-at-a-time and the batched paths.

The continuations of a prompt must not depend on which other prompts, or which other head
configurations, share its batch: the one-at-a-time scoring loop (one configuration, prompts in
batches of ``Generation.batch_size``) and the batched one (prompts × configurations, rows in
batches of ``max_batch``) must write the same text for the same (prompt, configuration). So:

* every prompt is left-padded to the longest prompt of the *whole* set, so a row has the same
  shape whatever batch it is in;
* the random numbers of prompt ``i`` come from its own ``torch.Generator`` seeded by
  ``(seed, i)``: ``max_new_tokens`` uniforms drawn once, step ``t`` of every row of that prompt
  uses the ``t``-th (inverse-CDF top-k sampling), whatever its configuration or batch;
* each step keeps only the last position's logits and samples row by row (top-k, softmax and the
  cumulative sum are per-row operations).

On a CPU the model's per-row results do not depend on the batch size, so both paths give the
same tokens bit for bit; a GPU may pick different kernels for different batch shapes, and a
near-tie can then flip a sampled token.

A row that emits an end-of-sequence token is finished: it gets pad tokens from then on and its
text ends there; the loop stops when every row is finished or after ``max_new_tokens``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fairprune.pruning.heads import HeadGates


@dataclass(frozen=True)
class Generation:
    """How continuations are generated: seeded top-k sampling (or greedy), left-padded batches of
    ``batch_size`` prompts on the one-at-a-time path."""

    max_new_tokens: int = 20
    batch_size: int = 32
    do_sample: bool = True
    top_k: int = 50
    seed: int = 0


@dataclass
class Prompts:
    """A prompt set ready for the loop: ids left-padded to the longest prompt, the attention mask and
    each prompt's uniforms ``[prompts, max_new_tokens]``."""

    ids: torch.Tensor
    mask: torch.Tensor
    uniforms: torch.Tensor
    pad_id: int
    eos_ids: tuple[int, ...]

    def __len__(self) -> int:
        return self.ids.shape[0]


def encode_prompts(model: nn.Module, tokenizer, texts: Sequence[str], settings: Generation) -> Prompts:
    """Tokenize ``texts`` once, left-pad them to one length, draw each prompt's random numbers."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    encoded = tokenizer(list(texts), verbose=False).input_ids if len(texts) else []
    width = max((len(e) for e in encoded), default=0)
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, tokens in enumerate(encoded):
        if tokens:  # left padding: every prompt's last token sits at the end, where generation goes on
            ids[row, width - len(tokens):] = torch.tensor(tokens)
            mask[row, width - len(tokens):] = 1
    uniforms = torch.stack([
        torch.rand(settings.max_new_tokens, dtype=torch.float64,
                   generator=torch.Generator().manual_seed((settings.seed * 1_000_003 + index) % 2**63))
        for index in range(len(encoded))
    ]) if encoded else torch.zeros(0, settings.max_new_tokens, dtype=torch.float64)
    return Prompts(ids, mask, uniforms, int(pad), tuple(sorted(set(eos))))


def _pick(logits: torch.Tensor, uniforms: torch.Tensor, settings: Generation) -> torch.Tensor:
    """One token per row: greedy, or top-k sampling by inverse CDF with the row's uniform."""
    if not settings.do_sample:
        return logits.argmax(-1)
    k = min(settings.top_k, logits.shape[-1]) if settings.top_k else logits.shape[-1]
    top, index = logits.topk(k, dim=-1)  # sorted, largest first
    cdf = top.double().softmax(-1).cumsum(-1)
    choice = (cdf < uniforms[:, None] * cdf[:, -1:]).sum(-1).clamp_(max=k - 1)
    return index.gather(1, choice[:, None]).squeeze(1)


def _cache_keyword(model: nn.Module) -> str:
    """The name under which this transformers version takes the KV cache."""
    names = inspect.signature(model.forward).parameters
    return "cache" if "cache" in names else "past_key_values"


@torch.no_grad()
def sample_rows(model: nn.Module, prompts: Prompts, rows: Sequence[int], settings: Generation) -> torch.Tensor:
    """New tokens ``[len(rows), steps]`` for the prompts ``rows`` (indices into ``prompts``) in one batch,
    with whatever gates are active (:meth:`HeadGates.per_row` gates the rows one by one)."""
    device = next(model.parameters()).device
    index = torch.as_tensor(list(rows), dtype=torch.long)
    ids, mask = prompts.ids[index].to(device), prompts.mask[index].to(device)
    uniforms = prompts.uniforms[index].to(device)
    positions = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)
    eos = torch.tensor(prompts.eos_ids, dtype=torch.long, device=device)
    keyword = _cache_keyword(model)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    unfinished = torch.ones(len(index), dtype=torch.bool, device=device)
    out, cache, step_ids, step_positions = [], None, ids, positions
    for step in range(settings.max_new_tokens):
        result = model(input_ids=step_ids, attention_mask=mask, position_ids=step_positions, use_cache=True,
                       **{keyword: cache}, **keep)
        cache = getattr(result, keyword, None)
        if cache is None:
            cache = getattr(result, "past_key_values", None)
        token = _pick(result.logits[:, -1].float(), uniforms[:, step], settings)
        token = torch.where(unfinished, token, torch.full_like(token, prompts.pad_id))
        out.append(token)
        unfinished &= ~torch.isin(token, eos)
        if not bool(unfinished.any()):
            break
        mask = torch.cat([mask, mask.new_ones(len(index), 1)], dim=1)
        step_ids, step_positions = token[:, None], step_positions[:, -1:] + 1
    return torch.stack(out, dim=1).cpu() if out else torch.zeros(len(index), 0, dtype=torch.long)


def decode(tokenizer, tokens: torch.Tensor, prompts: Prompts) -> list[str]:
    """The text of each row, up to its first end-of-sequence token."""
    texts = []
    for row in tokens.tolist():
        for position, token in enumerate(row):
            if token in prompts.eos_ids:
                row = row[:position]
                break
        texts.append(row)
    return tokenizer.batch_decode(texts, skip_special_tokens=True)


@torch.no_grad()
def generate_continuations(model: nn.Module, tokenizer, texts: Sequence[str], settings: Generation = Generation()) -> list[str]:
    """The model's continuation of each prompt (new tokens only), in batches of ``settings.batch_size``
    prompts. The result depends on the model and the settings alone: not on what ran before (the
    global RNG is neither read nor changed) nor on the batch size."""
    prompts = encode_prompts(model, tokenizer, texts, settings)
    order = list(range(len(prompts)))
    tokens = [sample_rows(model, prompts, order[i : i + settings.batch_size], settings)
              for i in range(0, len(order), max(1, settings.batch_size))]
    return [text for chunk in tokens for text in decode(tokenizer, chunk, prompts)]


@torch.no_grad()
def generate_configurations(model: nn.Module, tokenizer, texts: Sequence[str], configs: torch.Tensor,
                            settings: Generation, rows_per_pass: int) -> list[list[str]]:
    """Continuations of every prompt under every head configuration of ``configs`` (``[C, layers,
    heads]`` gates, on top of the model's current gates): ``C`` lists of ``len(texts)`` texts.
    Rows are (configuration, prompt) pairs, configuration-major, ``rows_per_pass`` per forward."""
    prompts = encode_prompts(model, tokenizer, texts, settings)
    n = len(prompts)
    pairs = [(c, p) for c in range(configs.shape[0]) for p in range(n)]
    gates = HeadGates(model)
    texts_out: list[str] = []
    with gates:
        for start in range(0, len(pairs), max(1, rows_per_pass)):
            chunk = pairs[start : start + max(1, rows_per_pass)]
            rows = configs[torch.tensor([c for c, _ in chunk])]
            with gates.per_row(rows):
                tokens = sample_rows(model, prompts, [p for _, p in chunk], settings)
            texts_out += decode(tokenizer, tokens, prompts)
    return [texts_out[c * n : (c + 1) * n] for c in range(configs.shape[0])]
