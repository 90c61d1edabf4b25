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
text ends there; a batch stops when every row is finished, the loop after ``max_new_tokens``.

Every step is a pass over the block model (:mod:`~fairprune.causal.pipeline`): the batches
of a pass advance together, each block loaded once per step for all of them with each batch's KV
cache (the cache the model's own forward makes, filled by its blocks), and the head runs on the
last position. A streamed model is read once per step and pass; a model in memory computes what its
own forward computes.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.cache_utils import Cache

from fairprune.causal import pipeline
from fairprune.causal.blocks import as_blocks
from fairprune.causal.pipeline import capture, element_size, hidden_size, passes, through
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


@dataclass
class _Rows:
    """One batch of the sampling loop: its prompt rows' state between steps."""

    mask: torch.Tensor
    uniforms: torch.Tensor
    step_ids: torch.Tensor
    step_positions: torch.Tensor
    gates: torch.Tensor | None
    unfinished: torch.Tensor
    cache: object = None
    out: list = field(default_factory=list)


@torch.no_grad()
def sample(blocks, prompts: Prompts, groups: Sequence[tuple[Sequence[int], torch.Tensor | None]], settings: Generation,
           device, progress: bool = False) -> list[torch.Tensor]:
    """New tokens ``[len(rows), steps]`` for each batch ``(rows, gates)`` of ``groups``: the prompts
    ``rows`` (indices into ``prompts``), gated row by row by ``gates`` (``[len(rows), layers, heads]``;
    None: the model's gates as they stand). ``blocks``: a block model, run on ``device``."""
    width = prompts.ids.shape[1] + settings.max_new_tokens
    hidden = hidden_size(blocks.config)
    row_bytes = width * hidden * (1 + 2 * len(blocks.blocks)) * element_size(blocks)  # hidden states and KV cache
    gates = HeadGates(blocks) if any(g is not None for _, g in groups) else None
    tokens: list[torch.Tensor] = []
    with gates if gates is not None else nullcontext():
        for group in passes(list(groups), lambda g: len(g[0]) * row_bytes):
            tokens += _lockstep(blocks, prompts, group, settings, (device, gates, progress))
    return tokens


def _lockstep(blocks, prompts: Prompts, group, settings: Generation, how: tuple) -> list[torch.Tensor]:
    """The sampling loop for the batches of one pass, step by step together."""
    device, gates, progress = how
    states = []
    for rows, row_gates in group:
        index = torch.as_tensor(list(rows), dtype=torch.long)
        mask = prompts.mask[index].to(device)
        positions = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)
        states.append(_Rows(mask, prompts.uniforms[index].to(device), prompts.ids[index].to(device), positions,
                            row_gates, torch.ones(len(index), dtype=torch.bool, device=device)))
    eos = torch.tensor(prompts.eos_ids, dtype=torch.long, device=device)
    keyword = _cache_keyword(blocks.model)
    live = [s for s in states if len(s.mask)]
    for step in range(settings.max_new_tokens):
        if not live:
            break
        batches = capture(blocks, [{"input_ids": s.step_ids, "attention_mask": s.mask, "position_ids": s.step_positions,
                                    "use_cache": True, keyword: s.cache} for s in live], device)
        for s, batch in zip(live, batches):
            s.cache = _cache_of(batch.calls[0]) if s.cache is None else s.cache
            batch.gates = s.gates
        pipeline.run(blocks, batches=batches, device=device, flow=lambda i, block, bs: through(i, block, bs, gates),
                     progress=progress, desc=f"token {step + 1}")
        finals = blocks.tail([batch.hidden[:, -1:] for batch in batches], device)
        with blocks.head(device) as head:
            for s, final in zip(live, finals):
                token = _pick(head(final)[:, -1].float(), s.uniforms[:, step], settings)
                token = torch.where(s.unfinished, token, torch.full_like(token, prompts.pad_id))
                s.out.append(token)
                s.unfinished &= ~torch.isin(token, eos)
                s.mask = torch.cat([s.mask, s.mask.new_ones(len(s.mask), 1)], dim=1)
                s.step_ids, s.step_positions = token[:, None], s.step_positions[:, -1:] + 1
        live = [s for s in live if bool(s.unfinished.any())]
    return [torch.stack(s.out, dim=1).cpu() if s.out else torch.zeros(len(s.mask), 0, dtype=torch.long) for s in states]


def _cache_of(call) -> Cache:
    """The KV cache the model's forward made and passes to its blocks."""
    for value in (*call.args, *call.kwargs.values()):
        if isinstance(value, Cache):
            return value
    raise RuntimeError("the model passed no KV cache to its decoder layers; it cannot be sampled block by block")


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
def generate_continuations(model, tokenizer, texts: Sequence[str], settings: Generation = Generation(),
                           device=None) -> list[str]:
    """The model's continuation of each prompt (new tokens only), in batches of ``settings.batch_size``
    prompts. The result depends on the model and the settings alone: not on what ran before (the
    global RNG is neither read nor changed) nor on the batch size. ``model``: an ``nn.Module`` or a
    block model; ``device``: where it runs (None: its own)."""
    blocks = as_blocks(model)
    prompts = encode_prompts(blocks.model, tokenizer, texts, settings)
    order = list(range(len(prompts)))
    step = max(1, settings.batch_size)
    tokens = sample(blocks, prompts, [(order[i : i + step], None) for i in range(0, len(order), step)], settings,
                    device or blocks.run_device())
    return [text for chunk in tokens for text in decode(tokenizer, chunk, prompts)]


@torch.no_grad()
def generate_configurations(model, tokenizer, texts: Sequence[str], configs: torch.Tensor, settings: Generation,
                            rows_per_pass: int, device=None, progress: bool = False) -> list[list[str]]:
    """Continuations of every prompt under every head configuration of ``configs`` (``[C, layers,
    heads]`` gates, on top of the model's current gates): ``C`` lists of ``len(texts)`` texts.
    Rows are (configuration, prompt) pairs, configuration-major, ``rows_per_pass`` per forward."""
    blocks = as_blocks(model)
    prompts = encode_prompts(blocks.model, tokenizer, texts, settings)
    n = len(prompts)
    pairs = [(c, p) for c in range(configs.shape[0]) for p in range(n)]
    step = max(1, rows_per_pass)
    chunks = [pairs[start : start + step] for start in range(0, len(pairs), step)]
    groups = [([p for _, p in chunk], configs[torch.tensor([c for c, _ in chunk])]) for chunk in chunks]
    tokens = sample(blocks, prompts, groups, settings, device or blocks.run_device(), progress)
    texts_out = [text for chunk in tokens for text in decode(tokenizer, chunk, prompts)]
    return [texts_out[c * n : (c + 1) * n] for c in range(configs.shape[0])]
