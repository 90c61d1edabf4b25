"""Perplexity and the stereotype score of a model that is never whole in memory.

The figures of :mod:`fairprune.metrics.language`, measured on a
:class:`~fairprune.pruning.streamed.StreamedModel`: every evaluation batch (the same batches as the
in-memory measurement: 8 windows of the perplexity text, 16 right-padded sentences of the
stereotype pairs) is captured at block 0's input, each block is loaded once and runs on all of
them, the hidden states are held between blocks, and the final norm and head finish each batch.
The head's logits are made for 16 positions of one window or sentence at a time, so the
vocabulary-wide logits never sit in memory for a whole batch. The result is the in-memory one to float
tolerance (the same operations, batched the same way up to the head): per-window NLL and token
counts as :func:`~fairprune.metrics.language.window_losses` returns them, per-pair outcomes as
:func:`~fairprune.metrics.language.pair_outcomes`, and :func:`measure_streamed` gives
:func:`~fairprune.metrics.language.measure_lm_items`'s figures and items.

Under ``torchrun`` each rank runs its share of the batches (whole batches) and the per-window and
per-sentence figures, each computed by one rank, are summed across ranks: one process's figures
exactly. The hidden states of all batches are held at once up to ``max_hidden_bytes`` (default 512 MB);
a larger evaluation set is measured in chunks of batches, each chunk a pass over the blocks (the
weights are read once per chunk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fairprune import distributed
from fairprune.data.pairs import direction
from fairprune.data.text import encode_sentence
from fairprune.errors import UserError
from fairprune.metrics.language import LMItems, eval_windows, pad_right, perplexity_of, scores_of

MAX_HIDDEN_BYTES = 512 * 1024 * 1024
WINDOW_BATCH = 8  # windows per batch, as measure_lm_items runs window_losses
SENTENCE_BATCH = 16  # sentences per batch, as pair_outcomes runs sentence_log_likelihoods
LOGIT_ROWS = 16  # positions whose vocabulary-wide logits are made at once (a 49k vocabulary: 3 MB of float32)


def _windows(sm, ids: torch.Tensor, seqlen: int | None) -> torch.Tensor:
    """The evaluation ids cut into whole windows [windows, seqlen], checked as window_losses checks them."""
    return eval_windows(sm.model, ids, seqlen)


def _sentence_batches(tokenizer, pairs: list) -> list[dict[str, torch.Tensor]]:
    """The pairs' sentences (more, less, more, less, ...) as right-padded batches, as
    :func:`~fairprune.metrics.language.sentence_log_likelihoods` pads them."""
    encoded = [encode_sentence(tokenizer, s) for pair in pairs for s in pair]
    calls = []
    for start in range(0, len(encoded), SENTENCE_BATCH):
        ids, keep = pad_right(encoded[start : start + SENTENCE_BATCH])
        calls.append({"input_ids": ids, "attention_mask": keep.long()})
    return calls


def _chunks(calls: list[dict[str, torch.Tensor]], hidden_size: int, element: int, budget: int) -> list[list[int]]:
    """Indices of ``calls`` grouped so that each group's hidden states fit ``budget`` bytes."""
    groups: list[list[int]] = [[]]
    used = 0
    for i, call in enumerate(calls):
        size = call["input_ids"].numel() * hidden_size * element
        if groups[-1] and used + size > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += size
    return groups


@torch.no_grad()
def _run(sm, calls: list[dict[str, torch.Tensor]], device, budget: int, progress: bool, score) -> None:
    """Run this rank's share of ``calls`` (whole calls; all of them alone) through the model in
    chunks that fit ``budget``; ``score(index, hidden, head)`` gets each call's final hidden states
    with the head loaded."""
    hidden_size = int(sm.config.hidden_size)
    element = torch.empty(0, dtype=sm.dtype).element_size()
    mine = distributed.shard(list(range(len(calls))))
    chunks = _chunks([calls[i] for i in mine], hidden_size, element, budget)
    for group in ([mine[j] for j in chunk] for chunk in chunks if chunk):
        outputs = sm.forward([calls[i] for i in group], device, progress=progress and distributed.is_main(),
                             desc="measuring")
        with sm.head(device) as head:
            for i, hidden in zip(group, outputs):
                score(i, hidden, head)


@torch.no_grad()
def streamed_window_losses(sm, ids: torch.Tensor, seqlen: int | None, device="cpu",
                           max_hidden_bytes: int = MAX_HIDDEN_BYTES, progress: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per window, in order: the summed NLL of its predicted tokens and their number (float64
    [windows] each), as :func:`~fairprune.metrics.language.window_losses` gives them."""
    nll, count, *_ = _measure(sm, None, ids, [], seqlen, device, max_hidden_bytes, progress)
    return nll, count


@torch.no_grad()
def streamed_pair_outcomes(sm, tokenizer, pairs: list, device="cpu", max_hidden_bytes: int = MAX_HIDDEN_BYTES,
                           progress: bool = False) -> dict[str, torch.Tensor]:
    """Per pair, in order: ``win``, ``decided`` and ``anti`` (bool [pairs] each), as
    :func:`~fairprune.metrics.language.pair_outcomes` gives them."""
    if not pairs:
        raise UserError("no sentence pairs given; pass (stereotypical, anti-stereotypical) pairs, e.g. from read_stereoset")
    return _measure(sm, tokenizer, None, pairs, None, device, max_hidden_bytes, progress)[2]


@torch.no_grad()
def measure_streamed(sm, tokenizer, ids: torch.Tensor, pairs: list, seqlen: int, device="cpu",
                     max_hidden_bytes: int = MAX_HIDDEN_BYTES, progress: bool = False) -> tuple[dict[str, float], LMItems]:
    """:func:`~fairprune.metrics.language.measure_lm_items` of a streamed model: perplexity over
    the windows of ``ids`` and the stereotype scores of ``pairs``, and the per-item outcomes; one
    pass over the blocks for both (per chunk)."""
    if not pairs:
        raise UserError("no sentence pairs given; pass (stereotypical, anti-stereotypical) pairs, e.g. from read_stereoset")
    nll, count, outcomes = _measure(sm, tokenizer, ids, pairs, seqlen, device, max_hidden_bytes, progress)
    items = LMItems(nll.numpy(), count.numpy(), *(outcomes[k].numpy() for k in ("win", "decided", "anti")))
    return {"perplexity": perplexity_of(nll, count), **scores_of(**outcomes)}, items


def _measure(sm, tokenizer, ids, pairs: list, seqlen, device, budget: int, progress: bool):
    windows = _windows(sm, ids, seqlen) if ids is not None else torch.zeros(0, 2, dtype=torch.long)
    calls = [{"input_ids": windows[s : s + WINDOW_BATCH]} for s in range(0, len(windows), WINDOW_BATCH)]
    first_pair_call = len(calls)
    calls += _sentence_batches(tokenizer, pairs) if pairs else []
    sums = torch.zeros(2, len(windows), dtype=torch.float64)
    scores = torch.zeros(2 * len(pairs), dtype=torch.float64)

    def score(i: int, hidden: torch.Tensor, head) -> None:
        call = calls[i]
        if i < first_pair_call:  # perplexity windows: as window_losses scores them, one window at a time
            start = i * WINDOW_BATCH
            batch = call["input_ids"].to(hidden.device)
            for r in range(len(batch)):
                losses = []
                for a in range(0, batch.shape[1] - 1, LOGIT_ROWS):
                    logits = head(hidden[r, a : min(a + LOGIT_ROWS, batch.shape[1] - 1)]).float()
                    losses.append(F.cross_entropy(logits, batch[r, a + 1 : a + 1 + len(logits)], reduction="none"))
                sums[0, start + r] = torch.cat(losses).double().sum().cpu()
                sums[1, start + r] = batch.shape[1] - 1
        else:  # sentences: as sentence_log_likelihoods scores them, one sentence at a time
            start = (i - first_pair_call) * SENTENCE_BATCH
            ids_, keep = call["input_ids"].to(hidden.device), call["attention_mask"].to(hidden.device).bool()
            for r in range(len(ids_)):
                parts = []  # log-probabilities of the next tokens, LOGIT_ROWS positions at a time (row-wise: as whole)
                for a in range(0, ids_.shape[1] - 1, LOGIT_ROWS):
                    end = min(a + LOGIT_ROWS, ids_.shape[1] - 1)
                    logits = head(hidden[r, a:end]).double()
                    parts.append(logits.log_softmax(-1).gather(-1, ids_[r, a + 1 : end + 1, None]).squeeze(-1))
                logp = torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float64)
                scores[start + r] = (logp * keep[r, 1:]).sum().cpu()

    _run(sm, calls, device, budget, progress, score)
    distributed.all_reduce_sum(sums)  # under torchrun each slot is one rank's (the others hold 0): exact
    distributed.all_reduce_sum(scores)
    outcomes = {}
    if pairs:
        rounded = scores.round(decimals=3)  # the authors' script compares scores to 3 decimals
        more, less = rounded[0::2], rounded[1::2]
        outcomes = {"win": more > less, "decided": more != less,
                    "anti": torch.tensor([direction(pair) == "antistereo" for pair in pairs], dtype=torch.bool)}
    return sums[0], sums[1], outcomes
