"""Language-model metrics: perplexity and the paired stereotype score.

* :func:`perplexity` follows the standard protocol of the LLM-pruning literature (SparseGPT,
  Wanda): join the documents with ``"\\n\\n"``, tokenize once, cut the ids into non-overlapping
  windows of ``seqlen`` tokens (the tail shorter than a window is dropped), and return
  ``exp`` of the mean negative log-likelihood over every predicted token.
* :func:`stereotype_score` is the share of (stereotypical, anti-stereotypical) pairs for which
  the model gives the stereotypical sentence the higher total log-likelihood: 0.5 is unbiased,
  1.0 always prefers the stereotype. Exact ties count one half. Each sentence is scored as a
  document of its own, after :func:`document_start` (re-exported here; reports record its token).
* :func:`measure_lm` gives both for a model, the figures every LM report carries;
  :func:`eval_ids` tokenizes an evaluation text once (optionally capped at its first N tokens) so
  several measurements of it share one tokenization.

Both loops show a progress bar when asked (``progress=True``, on the main rank only).

Under ``torch.distributed`` (``torchrun``, see :mod:`fairprune.distributed`) both are collective:
each rank scores its shard of the windows / pairs and the sums (NLL and token count; wins and pair
count) are added across ranks, so every rank returns the figure of the whole set.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fairprune import distributed
from fairprune.data.text import document_start, encode_sentence, join_documents  # noqa: F401 (document_start: public here too)
from fairprune.errors import UserError


@torch.no_grad()
def perplexity(
    model: nn.Module,
    text_or_ids: str | Iterable[str] | torch.Tensor,
    tokenizer=None,
    seqlen: int | None = None,
    device: str | torch.device | None = None,
    batch_size: int = 1,
    max_tokens: int | None = None,
    progress: bool = False,
) -> float:
    """Perplexity over non-overlapping ``seqlen`` windows (default: the model's context length).

    ``text_or_ids`` is a text, a list of documents, or already tokenized ids (1-D or [1, n]);
    ``max_tokens`` keeps only the first N tokens of it (the windows are cut from those).
    Under ``torch.distributed`` each rank runs its share of the windows (every rank must call).
    """
    ids = eval_ids(text_or_ids, tokenizer, max_tokens)
    limit = _context_length(model)
    seqlen = seqlen or limit
    if limit is not None and seqlen > limit:
        raise UserError(f"seqlen {seqlen} exceeds the model's context length {limit}; use --seqlen {limit} or less")
    windows = ids.numel() // seqlen
    if windows == 0:
        capped = f" (capped by --eval_tokens {max_tokens})" if max_tokens is not None else ""
        raise UserError(f"evaluation text has {ids.numel()} tokens{capped}, fewer than one window of {seqlen}; "
                        "give more text or a smaller seqlen")
    ids = distributed.shard(ids[: windows * seqlen].view(windows, seqlen))
    bar = tqdm(total=len(ids), desc="perplexity", unit="window", leave=False,
               disable=not progress or not distributed.is_main())
    with bar, _on_device(model, device) as run_device:
        sums = torch.zeros(2, dtype=torch.float64, device=run_device)  # NLL, predicted tokens
        for batch in ids.split(batch_size) if len(ids) else ():
            batch = batch.to(run_device)
            logits = model(input_ids=batch, use_cache=False).logits.float()
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
            sums[0] += loss.double()
            sums[1] += batch[:, 1:].numel()
            bar.update(len(batch))
        nll, count = distributed.all_reduce_sum(sums).tolist()
    return math.exp(nll / count)


@torch.no_grad()
def sentence_log_likelihoods(
    model: nn.Module, tokenizer, sentences: list[str], device=None, batch_size: int = 16, progress: bool = False
) -> torch.Tensor:
    """Total log-likelihood of each sentence, float64 [n]: every token of the sentence, each scored
    after the ones before it, the first after :func:`document_start` (the model's plain document
    start: BOS, unless that is a chat token such as SmolLM2's ``<|im_start|>``)."""
    encoded = [encode_sentence(tokenizer, s) for s in sentences]
    scores = []
    with _on_device(model, device) as run_device:
        for start in tqdm(range(0, len(encoded), batch_size), desc="sentence pairs", unit="batch", leave=False,
                          disable=not progress or not distributed.is_main()):
            chunk = encoded[start : start + batch_size]
            length = max(len(e) for e in chunk)
            # Right padding: a causal model's real tokens never attend to the pads.
            ids = torch.zeros(len(chunk), length, dtype=torch.long)
            keep = torch.zeros(len(chunk), length, dtype=torch.bool)
            for i, e in enumerate(chunk):
                ids[i, : len(e)] = torch.tensor(e)
                keep[i, : len(e)] = True
            ids, keep = ids.to(run_device), keep.to(run_device)
            logits = model(input_ids=ids, attention_mask=keep.long(), use_cache=False).logits.double()
            logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            scores.append((logp * keep[:, 1:]).sum(-1).cpu())
    return torch.cat(scores)


def stereotype_score(model: nn.Module, tokenizer, pairs: list[tuple[str, str]], device=None, batch_size: int = 16,
                     progress: bool = False) -> float:
    """Share of (stereotypical, anti-stereotypical) pairs where the stereotype is more likely (0.5 ideal).
    Under ``torch.distributed`` each rank scores its share of the pairs (every rank must call)."""
    if not pairs:
        raise UserError("no sentence pairs given; pass (stereotypical, anti-stereotypical) pairs, e.g. from read_stereoset")
    mine = distributed.shard(list(pairs))
    sums = torch.zeros(2, dtype=torch.float64)  # wins (ties count one half), pairs
    if mine:
        scores = sentence_log_likelihoods(model, tokenizer, [s for pair in mine for s in pair], device, batch_size, progress)
        stereo, anti = scores[0::2], scores[1::2]
        sums[0] = ((stereo > anti).double() + 0.5 * (stereo == anti).double()).sum()
        sums[1] = len(mine)
    wins, count = distributed.all_reduce_sum(sums).tolist()
    return wins / count


def eval_ids(text_or_ids: str | Iterable[str] | torch.Tensor, tokenizer=None, max_tokens: int | None = None) -> torch.Tensor:
    """1-D token ids of an evaluation text (the documents joined, tokenized once) or of given ids
    (flattened), keeping the first ``max_tokens`` when given."""
    if max_tokens is not None and max_tokens < 1:
        raise UserError(f"--eval_tokens must be at least 1, got {max_tokens}")
    if isinstance(text_or_ids, torch.Tensor):
        if text_or_ids.dim() > 2 or (text_or_ids.dim() == 2 and text_or_ids.shape[0] != 1):
            raise UserError("token ids for perplexity must be 1-D or [1, n]; concatenate the documents first")
        ids = text_or_ids.flatten().long()
    elif tokenizer is None:
        raise UserError("perplexity of raw text needs a tokenizer; pass tokenizer=... or token ids")
    else:
        ids = tokenizer(join_documents(text_or_ids), return_tensors="pt", verbose=False).input_ids[0]
    return ids[:max_tokens]


def _context_length(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


class _on_device:
    """Context: put the model on ``device`` in eval mode, restore place and mode afterwards."""

    def __init__(self, model: nn.Module, device):
        self.model, self.device = model, device
        first = next(model.parameters())
        self.home, self.was_training = first.device, model.training

    def __enter__(self) -> torch.device:
        target = torch.device(self.device) if self.device is not None else self.home
        self.model.to(target).eval()
        return target

    def __exit__(self, *exc) -> None:
        self.model.to(self.home).train(self.was_training)


def measure_lm(model: nn.Module, tokenizer, eval_text: str | torch.Tensor, eval_pairs: list, seqlen: int, device,
               eval_tokens: int | None = None, progress: bool = False) -> dict[str, float]:
    """Perplexity (non-overlapping windows over the first ``eval_tokens`` tokens of ``eval_text``,
    all of it by default; text or :func:`eval_ids`) and paired stereotype score (0.5 ideal)."""
    model.eval()
    return {
        "perplexity": float(perplexity(model, eval_text, tokenizer, seqlen=seqlen, device=device, batch_size=8,
                                       max_tokens=eval_tokens, progress=progress)),
        "stereotype_score": float(stereotype_score(model, tokenizer, eval_pairs, device=device, progress=progress)),
    }
