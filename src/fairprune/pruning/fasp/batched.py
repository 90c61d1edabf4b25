"""Many head configurations per forward pass: FASP's scoring without a pass per head.

A *configuration* is a ``[layers, heads]`` gate tensor (1 = on, 0 = off) applied on top of the
model's current gates; ``configs`` stacks ``C`` of them. Every row of a batch carries its own
configuration (:meth:`~fairprune.pruning.heads.HeadGates.per_row`), so one forward evaluates
``rows_per_pass`` (window or prompt, configuration) pairs.

Perplexity reuses prefixes: a configuration whose first switched-off head is in layer ``l``
computes exactly what the unchanged model computes below ``l``. The hidden states entering each
block are computed once for all windows (:class:`PrefixStates`, advancing one layer boundary at a
time) and each configuration runs only blocks ``l ..``. Blocks are run through the model's own
forward with the blocks before ``l`` passing their input on and the stored states put in place of
block ``l``'s input, so each family's embeddings, position ids, rotary tables and attention
masks are made by its own code, and the logits by its own forward after the blocks (the head and,
for Gemma, the final soft-capping: :func:`fairprune.causal.structure.head_logits`); this works for
every causal LM whose heads :func:`fairprune.causal.families.family_of` locates, which the tests check
against the full forward for every family they build. The loss is summed as :func:`fairprune.metrics.language.perplexity` sums it (float32
per batch of ``batch_size`` windows, added in float64 in window order), so on a CPU both give the
same number bit for bit.

Generation batches prompts × configurations (:func:`~fairprune.pruning.fasp.sampling.generate_configurations`);
its prompt prefill is not shared between configurations.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from fairprune.causal.families import family_of
from fairprune.causal.structure import head_logits, stubbed
from fairprune.errors import UserError
from fairprune.pruning.heads import HeadGates

ROW_BUDGET_CPU = 512 * 2**20  # bytes of activations one forward may use on a CPU
MAX_ROWS = 4096


def auto_rows(model: nn.Module, tokens: int) -> int:
    """Rows per forward for sequences of ``tokens`` tokens: a rough activation size per row against a
    budget (a quarter of the free GPU memory, or :data:`ROW_BUDGET_CPU` on a CPU)."""
    config = model.config
    first = next(model.parameters())
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0) or 768)
    inner = int(getattr(config, "intermediate_size", 0) or getattr(config, "n_inner", 0) or getattr(config, "ffn_dim", 0) or 4 * hidden)
    heads = family_of(model).num_heads(config)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    per_row = tokens * (12 * hidden + 2 * inner + heads * tokens) * first.element_size() + 8 * vocab
    if first.device.type == "cuda":
        budget = torch.cuda.mem_get_info(first.device)[0] // 4
    else:
        budget = ROW_BUDGET_CPU
    return int(max(1, min(MAX_ROWS, budget // max(per_row, 1))))


def start_layers(configs: torch.Tensor) -> list[int]:
    """For each configuration the first layer with a gate other than 1 (``layers`` when none)."""
    changed = (configs != 1).any(-1)  # [C, layers]
    layers = configs.shape[1]
    return [int(row.nonzero()[0]) if bool(row.any()) else layers for row in changed]


class _Captured(Exception):
    def __init__(self, value: torch.Tensor):
        self.value = value


@contextmanager
def _cut(model: nn.Module, start: int, stop: int, state: torch.Tensor | None, capture: bool) -> Iterator[None]:
    """Within the block, ``model`` runs only blocks ``[start, stop)``; the first takes ``state`` as its
    input (when given); with ``capture`` the last block's output (or, for an empty range, the
    input of block ``start``) is raised as :class:`_Captured`. The blocks before ``start`` stay in
    the model's list as stubs that pass the hidden states on, so every block keeps its index and
    gets the arguments the model gives that layer (Gemma's sliding-window and global layers)."""
    family = family_of(model)
    blocks = list(family.block_list(model))
    handles = []
    kept = blocks[start:stop] if stop > start else [blocks[start]]

    def inject(module, args, kwargs):
        if args:
            return (state, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": state}

    def catch_input(module, args, kwargs):
        raise _Captured(args[0] if args else kwargs["hidden_states"])

    def catch_output(module, args, output):
        raise _Captured(output[0] if isinstance(output, tuple) else output)

    def passthrough(index, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden,) if family.returns_tuple else hidden

    if state is not None:
        handles.append(kept[0].register_forward_pre_hook(inject, with_kwargs=True))
    if capture and stop <= start:
        handles.append(kept[0].register_forward_pre_hook(catch_input, with_kwargs=True))
    elif capture:
        handles.append(kept[-1].register_forward_hook(catch_output))
    try:
        with stubbed(blocks[:start], passthrough):
            yield
    finally:
        for handle in handles:
            handle.remove()


def _owner(model: nn.Module, family) -> nn.Module:
    """The module whose forward runs the blocks (the parent of the blocks' ``ModuleList``)."""
    parent = family.blocks.rpartition(".")[0]
    return model.base_model.get_submodule(parent) if parent else model.base_model


def _run(model: nn.Module, ids: torch.Tensor, start: int, stop: int, state: torch.Tensor | None) -> torch.Tensor:
    """The input of block ``stop`` (``stop < layers``) or the model's last hidden state (``stop ==
    layers``), running blocks ``[start, stop)`` on ``state`` (the input of block ``start``; None:
    the embeddings of ``ids``, only with ``start == 0``)."""
    layers = len(family_of(model).block_list(model))
    final = stop == layers
    with _cut(model, start, stop, state, capture=not final):
        try:
            return model.base_model(input_ids=ids, use_cache=False).last_hidden_state
        except _Captured as caught:
            return caught.value


class PrefixStates:
    """The hidden states entering block ``layer`` for every window, under the model's current gates;
    :meth:`at` moves forward one block at a time (and starts again from the embeddings to go back)."""

    def __init__(self, model: nn.Module, windows: torch.Tensor, rows_per_pass: int):
        self.model, self.windows, self.rows = model, windows, max(1, rows_per_pass)
        self.layer, self.state = 0, None

    def at(self, layer: int) -> torch.Tensor:
        if layer < self.layer or self.state is None:
            self.layer = 0
            self.state = self._map(lambda ids, _: _run(self.model, ids, 0, 0, None), None)
        while self.layer < layer:
            self.state = self._map(lambda ids, state: _run(self.model, ids, self.layer, self.layer + 1, state), self.state)
            self.layer += 1
        return self.state

    def _map(self, step, state):
        parts = []
        for start in range(0, len(self.windows), self.rows):
            part = slice(start, start + self.rows)
            parts.append(step(self.windows[part], None if state is None else state[part]))
        return torch.cat(parts)


def windows_of(model: nn.Module, ids: torch.Tensor, seqlen: int) -> torch.Tensor:
    """``ids`` cut into non-overlapping ``[windows, seqlen]`` windows (the tail is dropped), on the
    model's device; the checks :func:`fairprune.metrics.language.perplexity` makes."""
    config = model.config
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and seqlen > limit:
        raise UserError(f"seqlen {seqlen} exceeds the model's context length {limit}; use --seqlen {limit} or less")
    count = ids.numel() // seqlen
    if count == 0:
        raise UserError(f"evaluation text has {ids.numel()} tokens, fewer than one window of {seqlen}; give more text or a smaller seqlen")
    return ids.flatten()[: count * seqlen].view(count, seqlen).to(next(model.parameters()).device)


@torch.no_grad()
def perplexities(model: nn.Module, ids: torch.Tensor, seqlen: int, batch_size: int, configs: torch.Tensor,
                 rows_per_pass: int, reuse: dict | None = None) -> list[float]:
    """Perplexity of every configuration on the non-overlapping ``seqlen`` windows of ``ids``.

    ``reuse``, a dict the caller keeps between calls on the same model and text, carries the
    prefix states over (cheapest when later calls start at the same or a deeper layer)."""
    windows = windows_of(model, ids, seqlen)
    family = family_of(model)
    layers = len(family.block_list(model))
    owner = _owner(model, family)
    reuse = {} if reuse is None else reuse
    if "states" not in reuse:
        reuse["states"] = PrefixStates(model, windows, rows_per_pass)
    states = reuse["states"]
    batches = [(s, min(s + batch_size, len(windows))) for s in range(0, len(windows), batch_size)]
    # Per configuration and window, as metrics.language.perplexity sums them: each window's NLL in
    # float64, the windows added in order with math.fsum, so both paths give the same figure.
    sums = torch.zeros(configs.shape[0], len(windows), dtype=torch.float64, device=windows.device)
    gates = HeadGates(model)
    starts = [min(s, layers - 1) for s in start_layers(configs)]
    with gates:
        for start in sorted(set(starts)):
            state = states.at(start)
            units = [(c, batch) for c in range(configs.shape[0]) if starts[c] == start for batch in batches]
            for chunk in _chunks(units, rows_per_pass):
                rows = torch.cat([state[a:b] for _, (a, b) in chunk])
                gate_rows = torch.cat([configs[c].expand(b - a, -1, -1) for c, (a, b) in chunk])
                with gates.per_row(gate_rows):
                    hidden = _run(model, torch.cat([windows[a:b] for _, (a, b) in chunk]), start, layers, rows)
                offset = 0
                for c, (a, b) in chunk:
                    logits = head_logits(model, owner, hidden[offset : offset + b - a]).float()
                    offset += b - a
                    batch = windows[a:b]
                    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="none")
                    sums[c, a:b] = loss.view(b - a, -1).double().sum(1)
    count = math.fsum([float(windows.shape[1] - 1)] * len(windows))
    return [math.exp(math.fsum(nll) / count) for nll in sums.tolist()]


def _chunks(units: Sequence[tuple[int, tuple[int, int]]], rows: int) -> Iterator[list]:
    """Consecutive units whose rows add up to at most ``rows`` (one unit at least)."""
    chunk, size = [], 0
    for unit in units:
        width = unit[1][1] - unit[1][0]
        if chunk and size + width > rows:
            yield chunk
            chunk, size = [], 0
        chunk.append(unit)
        size += width
    if chunk:
        yield chunk
