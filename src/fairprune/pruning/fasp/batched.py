"""Many head configurations per forward pass: FASP's perplexity without a pass per head.

A *configuration* is a ``[layers, heads]`` gate tensor (1 = on, 0 = off) applied on top of the
model's current gates; ``configs`` stacks ``C`` of them. Every row of a batch carries its own
configuration (:meth:`~fairprune.pruning.heads.HeadGates.per_row`), so one forward evaluates
``rows_per_pass`` (window, configuration) pairs.

Perplexity reuses prefixes: a configuration whose first switched-off head is in layer ``l``
computes exactly what the unchanged model computes below ``l``. Every forward is a pass over the
block model (:mod:`~fairprune.causal.pipeline`: each block loaded once for all the pass's
batches, so a streamed model is read once per pass): the windows run under the model's own gates
(the *base*) up to the deepest first layer among the pass's configurations, and each
configuration's rows join at their first layer from the base's hidden states there and run the
remaining blocks under their own gates. The arguments each block gets (masks, rotary tables) come
from the model's own forward (:func:`fairprune.causal.structure.block_calls`), and the logits from
its own forward after the blocks (the head and, for Gemma, the final soft-capping:
:func:`fairprune.causal.structure.head_logits`); the tests check this against the full forward for
every family they build. The loss is summed as :func:`fairprune.metrics.language.perplexity` sums
it (float32 per batch of ``batch_size`` windows, each window's NLL in float64, the windows added in
order), so on a CPU both give the same number bit for bit. With ``configs`` None the windows run
in batches of ``batch_size`` under the model's gates as they stand: the one-configuration
measurement (:meth:`~fairprune.pruning.fasp.scoring.Evaluator.__call__`).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fairprune.causal import pipeline
from fairprune.causal.blocks import as_blocks
from fairprune.causal.pipeline import capture, element_size, hidden_size, passes, through
from fairprune.metrics.language import eval_windows
from fairprune.pruning.heads import HeadGates

ROW_BUDGET_CPU = 512 * 2**20  # bytes of activations one forward may use on a CPU
MAX_ROWS = 4096


def auto_rows(model, tokens: int, device=None) -> int:
    """Rows per forward for sequences of ``tokens`` tokens: a rough activation size per row against a
    budget (a quarter of the free GPU memory on ``device``, or :data:`ROW_BUDGET_CPU` on a CPU).
    ``model``: an ``nn.Module`` or a block model; ``device``: where it runs (None: its own)."""
    blocks = as_blocks(model)
    config = blocks.config
    device = torch.device(device or blocks.run_device())
    hidden = hidden_size(config)
    inner = int(getattr(config, "intermediate_size", 0) or getattr(config, "n_inner", 0) or getattr(config, "ffn_dim", 0) or 4 * hidden)
    heads = blocks.family.num_heads(config)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    per_row = tokens * (12 * hidden + 2 * inner + heads * tokens) * element_size(blocks) + 8 * vocab
    budget = torch.cuda.mem_get_info(device)[0] // 4 if device.type == "cuda" else ROW_BUDGET_CPU
    return int(max(1, min(MAX_ROWS, budget // max(per_row, 1))))


def start_layers(configs: torch.Tensor) -> list[int]:
    """For each configuration the first layer with a gate other than 1 (``layers`` when none)."""
    changed = (configs != 1).any(-1)  # [C, layers]
    layers = configs.shape[1]
    return [int(row.nonzero()[0]) if bool(row.any()) else layers for row in changed]


@dataclass
class _Chunk:
    """One forward's rows: (configuration, (first window, end)) units that join the base at block
    ``start``, and their per-row gates (None: the model's gates as they stand)."""

    start: int
    units: list[tuple[int, tuple[int, int]]]
    gates: torch.Tensor | None

    def rows(self) -> int:
        return sum(b - a for _, (a, b) in self.units)


@torch.no_grad()
def window_nll(blocks, windows: torch.Tensor, configs: torch.Tensor | None, batch_size: int, rows_per_pass: int,
               device, progress: bool = False) -> torch.Tensor:
    """The summed NLL of every window's predicted tokens under every configuration, float64
    ``[C, windows]`` (``configs`` None: one row, the model as it stands). ``windows``: ``[n, seqlen]``
    token ids; ``blocks``: a block model, run on ``device``."""
    layers, count = len(blocks.blocks), len(windows)
    batches = [(s, min(s + batch_size, count)) for s in range(0, count, batch_size)]
    if configs is None:
        chunks = [_Chunk(0, [(0, batch)], None) for batch in batches]
    else:
        starts = [min(s, layers - 1) for s in start_layers(configs)]
        chunks = []
        for start in sorted(set(starts)):
            units = [(c, batch) for c in range(configs.shape[0]) if starts[c] == start for batch in batches]
            chunks += [_Chunk(start, part, torch.cat([configs[c].expand(b - a, -1, -1) for c, (a, b) in part]))
                       for part in passes(units, lambda unit: unit[1][1] - unit[1][0], rows_per_pass)]
    sums = torch.zeros(1 if configs is None else configs.shape[0], count, dtype=torch.float64)
    row_bytes = windows.shape[1] * hidden_size(blocks.config) * element_size(blocks)
    gates = None if configs is None else HeadGates(blocks)
    with gates if gates is not None else nullcontext():
        for group in passes(chunks, lambda chunk: chunk.rows() * row_bytes):
            _pass(blocks, windows, group, sums, (rows_per_pass, device, gates, progress))
    return sums


def _pass(blocks, windows: torch.Tensor, group: list[_Chunk], sums: torch.Tensor, how: tuple) -> None:
    """One pass over the blocks for the chunks of ``group``, their NLL written into ``sums``."""
    rows_per_pass, device, gates, progress = how
    top = max(chunk.start for chunk in group)  # the base runs the blocks below it
    base_inputs = [{"input_ids": windows[s : s + rows_per_pass]} for s in range(0, len(windows), rows_per_pass)] if top else []
    captured = capture(blocks, base_inputs + [{"input_ids": torch.cat([windows[a:b] for _, (a, b) in chunk.units])}
                                              for chunk in group], device)
    base, batches = captured[: len(base_inputs)], captured[len(base_inputs):]
    for batch, chunk in zip(batches, group):
        batch.gates = chunk.gates

    def flow(index: int, block, _) -> None:  # the base joins each chunk at the block where its heads start to differ
        joining = [(batch, chunk) for batch, chunk in zip(batches, group) if 0 < chunk.start == index]
        if joining:
            state = torch.cat([b.hidden for b in base])
            for batch, chunk in joining:
                batch.hidden = torch.cat([state[a:b] for _, (a, b) in chunk.units])
        through(index, block, [batch for batch, chunk in zip(batches, group) if chunk.start <= index], gates)
        if index < top:
            through(index, block, base)

    pipeline.run(blocks, batches=captured, device=device, flow=flow, progress=progress, desc="perplexity")
    finals = blocks.tail([batch.hidden for batch in batches], device)
    with blocks.head(device) as head:
        for hidden, chunk in zip(finals, group):
            offset = 0
            for c, (a, b) in chunk.units:
                logits = head(hidden[offset : offset + b - a]).float()
                offset += b - a
                ids = windows[a:b].to(logits.device)
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
                sums[c, a:b] = loss.view(b - a, -1).double().sum(1).cpu()


def perplexities(model, ids: torch.Tensor, seqlen: int, batch_size: int, configs: torch.Tensor, rows_per_pass: int,
                 device=None, progress: bool = False, bos: int | None = None) -> list[float]:
    """Perplexity of every configuration on the non-overlapping ``seqlen`` windows of ``ids``
    (``model``: an ``nn.Module`` or a block model; ``device``: where it runs, None: its own;
    ``bos``: the BOS every window starts with, as :func:`fairprune.metrics.language.eval_windows`)."""
    blocks = as_blocks(model)
    windows = eval_windows(blocks.model, ids, seqlen, bos=bos)
    sums = window_nll(blocks, windows, configs, batch_size, rows_per_pass, device or blocks.run_device(), progress)
    # Per configuration and window, as metrics.language.perplexity sums them: each window's NLL in
    # float64, the windows added in order with math.fsum, so both paths give the same figure.
    count = math.fsum([float(windows.shape[1] - 1)] * len(windows))
    return [math.exp(math.fsum(nll) / count) for nll in sums.tolist()]
