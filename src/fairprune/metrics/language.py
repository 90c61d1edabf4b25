"""Language-model metrics: perplexity and the paired stereotype score.

* :func:`perplexity` follows the standard protocol of the LLM-pruning literature (SparseGPT,
  Wanda): join the documents with ``"\\n\\n"``, tokenize once, cut the ids into non-overlapping
  windows of ``seqlen`` tokens (the tail shorter than a window is dropped), and return
  ``exp`` of the mean negative log-likelihood over every predicted token. A window predicts its
  tokens after the first, so it needs at least 2 (a shorter one is a :class:`UserError`).
* :func:`stereotype_scores` is the CrowS-Pairs metric on ``(more, less)`` pairs
  (:class:`fairprune.data.pairs.Pair`; a plain 2-tuple is a ``stereo`` pair): a pair counts when
  the model gives its first sentence (``sent_more``) the higher total log-likelihood, in ``stereo``
  and ``antistereo`` rows alike. As in the authors' script the two scores are compared rounded to
  3 decimals and an equal pair is neutral: it counts 0 in the headline ``stereotype_score`` (wins
  over all pairs; 0.5 unbiased, 1.0 always prefers ``sent_more``) and is left out of each
  direction's part (its wins over its decided pairs, NaN when it has none); the neutral count is
  reported. :func:`stereotype_score` is the headline alone. Each sentence is scored as a document
  of its own, after :func:`document_start` (re-exported here; reports record its token).
* :func:`measure_lm` gives both for a model, the figures every LM report carries;
  :func:`eval_ids` tokenizes an evaluation text once (optionally capped at its first N tokens) so
  several measurements of it share one tokenization.

Both loops show a progress bar when asked (``progress=True``, on the main rank only).

Under ``torch.distributed`` (``torchrun``, see :mod:`fairprune.distributed`) both are collective:
the windows / pairs are cut into batches, each rank scores its share of the batches, and the
figures (each window's NLL and token count, in its own slot; wins, decided and neutral pairs) are added across
ranks, so every rank returns the figure of the whole set. A batch holds the same windows on any
number of ranks and the windows' NLLs are added in window order (``math.fsum``), so N ranks return
one process's figures exactly.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fairprune import distributed
from fairprune.data.pairs import direction
from fairprune.data.text import document_start, encode_sentence, join_documents  # noqa: F401 (document_start: public here too)
from fairprune.errors import UserError
from fairprune.storage.arrays import open_npz


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
    nll, count = window_losses(model, text_or_ids, tokenizer, seqlen, device, batch_size, max_tokens, progress)
    return perplexity_of(nll, count)


def perplexity_of(nll: torch.Tensor | Iterable[float], count: torch.Tensor | Iterable[float]) -> float:
    """``exp`` of the summed NLL over the summed predicted tokens (sums in float64, exactly rounded)."""
    nll = nll.tolist() if isinstance(nll, torch.Tensor) else list(nll)
    count = count.tolist() if isinstance(count, torch.Tensor) else list(count)
    mean = math.fsum(nll) / math.fsum(count) if all(map(math.isfinite, nll)) else math.nan
    if not mean < 709:  # nan, inf, or past what exp can hold: no model that works gives this
        raise UserError(
            f"perplexity cannot be measured: the model's loss over {int(math.fsum(count))} tokens is "
            f"{'not finite' if not math.isfinite(mean) else f'{mean:.3g} per token'}: its activations overflowed "
            "(float16 holds at most 65504: run with --dtype bfloat16 or float32) or the model is broken; nothing was written")
    return math.exp(mean)


@torch.no_grad()
def window_losses(
    model: nn.Module,
    text_or_ids: str | Iterable[str] | torch.Tensor,
    tokenizer=None,
    seqlen: int | None = None,
    device: str | torch.device | None = None,
    batch_size: int = 1,
    max_tokens: int | None = None,
    progress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per window, in order: the summed NLL of its predicted tokens and their number (float64
    [windows] each); :func:`perplexity` of the whole text is :func:`perplexity_of` them, and its
    interval over windows resamples them (:mod:`fairprune.metrics.bootstrap`). Arguments as
    :func:`perplexity`; collective under ``torch.distributed`` like it."""
    if batch_size < 1:
        raise UserError(f"perplexity batch size must be at least 1, got {batch_size}")
    ids = eval_windows(model, eval_ids(text_or_ids, tokenizer, max_tokens), seqlen, max_tokens)
    windows, seqlen = ids.shape
    starts = distributed.shard(range(0, windows, batch_size))  # whole batches: the same on any number of ranks
    bar = tqdm(total=sum(len(ids[s : s + batch_size]) for s in starts), desc="perplexity", unit="window",
               leave=False, disable=not progress or not distributed.is_main())
    with bar, _on_device(model, device) as run_device:
        sums = torch.zeros(2, windows, dtype=torch.float64, device=run_device)  # per window: NLL, predicted tokens
        for start in starts:
            batch = ids[start : start + batch_size].to(run_device)
            logits = model(input_ids=batch, use_cache=False).logits.float()
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="none")
            sums[0, start : start + len(batch)] = loss.view(len(batch), -1).double().sum(1)
            sums[1, start : start + len(batch)] = seqlen - 1
            bar.update(len(batch))
        sums = distributed.all_reduce_sum(sums).cpu()  # each slot is one rank's: exact
    return sums[0], sums[1]


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
            ids, keep = (t.to(run_device) for t in pad_right(encoded[start : start + batch_size]))
            logits = model(input_ids=ids, attention_mask=keep.long(), use_cache=False).logits.double()
            logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            scores.append((logp * keep[:, 1:]).sum(-1).cpu())
    return torch.cat(scores)


def pad_right(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as one right-padded batch: ids [n, longest] (pads 0) and the mask of real
    tokens (bool). Right padding: a causal model's real tokens never attend to the pads."""
    length = max(len(e) for e in sequences)
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    keep = torch.zeros(len(sequences), length, dtype=torch.bool)
    for i, e in enumerate(sequences):
        ids[i, : len(e)] = torch.tensor(e)
        keep[i, : len(e)] = True
    return ids, keep


STEREOTYPE_KEYS = ("stereotype_score", "stereotype_score_stereo", "stereotype_score_antistereo",
                   "stereotype_pairs_neutral")  # what stereotype_scores returns (and measure_lm after perplexity)


def pair_outcomes(model: nn.Module, tokenizer, pairs: list, device=None, batch_size: int = 16,
                  progress: bool = False) -> dict[str, torch.Tensor]:
    """Per pair, in order (bool [pairs] each): ``win`` (``sent_more`` scored higher), ``decided``
    (the two scores differ at 3 decimals; an undecided pair is neutral) and ``anti`` (an
    ``antistereo`` row). :func:`stereotype_scores` is computed from them, and its interval over
    pairs resamples them. Collective under ``torch.distributed`` like it."""
    if not pairs:
        raise UserError("no sentence pairs given; pass (stereotypical, anti-stereotypical) pairs, e.g. from read_stereoset")
    # Whole batches of pairs are dealt out: a sentence is scored beside the same ones (the same
    # padding) on any number of ranks, so its log-likelihood, hence a near tie, comes out the same.
    per = max(1, batch_size // 2)
    pairs = list(pairs)
    mine = [i for start in distributed.shard(range(0, len(pairs), per)) for i in range(start, min(start + per, len(pairs)))]
    slots = torch.zeros(3, len(pairs), dtype=torch.float64)  # win, decided, anti: each pair's slot is one rank's
    if mine:
        chosen = [pairs[i] for i in mine]
        scores = sentence_log_likelihoods(model, tokenizer, [s for pair in chosen for s in pair], device, 2 * per, progress)
        scores = scores.double().round(decimals=3)  # the authors' script compares scores to 3 decimals
        more, less = scores[0::2], scores[1::2]
        index = torch.tensor(mine)
        slots[0, index] = (more > less).double()
        slots[1, index] = (more != less).double()
        slots[2, index] = torch.tensor([direction(pair) == "antistereo" for pair in chosen], dtype=torch.float64)
    win, decided, anti = distributed.all_reduce_sum(slots).bool()
    return {"win": win, "decided": decided, "anti": anti}


def scores_of(win: torch.Tensor, decided: torch.Tensor, anti: torch.Tensor) -> dict[str, float]:
    """The figures of :func:`stereotype_scores` from per-pair outcomes (:func:`pair_outcomes`)."""
    win, decided, anti = (torch.as_tensor(x, dtype=torch.bool) for x in (win, decided, anti))
    parts = {}
    for name, rows in (("stereo", ~anti), ("antistereo", anti)):
        n = int((rows & decided).sum())
        parts[name] = int((rows & win).sum()) / n if n else math.nan
    return {"stereotype_score": int(win.sum()) / len(win),
            "stereotype_score_stereo": parts["stereo"],
            "stereotype_score_antistereo": parts["antistereo"],
            "stereotype_pairs_neutral": int((~decided).sum())}


def stereotype_scores(model: nn.Module, tokenizer, pairs: list, device=None, batch_size: int = 16,
                      progress: bool = False) -> dict[str, float]:
    """The CrowS-Pairs metric (see the module docstring): ``stereotype_score`` (wins / all pairs,
    0.5 ideal), ``stereotype_score_stereo`` / ``_antistereo`` (wins / decided pairs of that
    direction, NaN without any: null in a report) and ``stereotype_pairs_neutral``.
    Under ``torch.distributed`` each rank scores its share of the pairs (every rank must call)."""
    return scores_of(**pair_outcomes(model, tokenizer, pairs, device, batch_size, progress))


def stereotype_score(model: nn.Module, tokenizer, pairs: list, device=None, batch_size: int = 16,
                     progress: bool = False) -> float:
    """The headline of :func:`stereotype_scores`: share of pairs where ``sent_more`` is the likelier
    sentence (ties count 0; 0.5 ideal). Collective under ``torch.distributed`` like it."""
    return stereotype_scores(model, tokenizer, pairs, device, batch_size, progress)["stereotype_score"]


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


def eval_windows(model: nn.Module, ids: torch.Tensor, seqlen: int | None, max_tokens: int | None = None) -> torch.Tensor:
    """1-D evaluation ``ids`` cut into whole non-overlapping windows ``[windows, seqlen]`` (the
    tail shorter than a window dropped; ``seqlen`` None: the model's context length), each check a
    one-line :class:`UserError` (``max_tokens``: the cap the ids were cut to, named in the message)."""
    limit = _context_length(model)
    seqlen = seqlen or limit
    if seqlen is None:
        raise UserError("the model does not state its context length; give a perplexity window (--eval_seqlen)")
    if seqlen < 2:
        raise UserError(f"a perplexity window needs at least 2 tokens (one to predict from), got {seqlen}; "
                        "use --eval_seqlen 2 or more")
    if limit is not None and seqlen > limit:
        raise UserError(f"seqlen {seqlen} exceeds the model's context length {limit}; use --seqlen {limit} or less")
    ids = ids.flatten().long()
    windows = ids.numel() // seqlen
    if windows == 0:
        capped = f" (capped by --eval_tokens {max_tokens})" if max_tokens is not None else ""
        raise UserError(f"evaluation text has {ids.numel()} tokens{capped}, fewer than one window of {seqlen}; "
                        "give more text or a smaller seqlen")
    return ids[: windows * seqlen].view(windows, seqlen)


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
    all of it by default; text or :func:`eval_ids`) and the paired stereotype scores
    (:func:`stereotype_scores`: the headline, 0.5 ideal, its two directions and the neutral count)."""
    return measure_lm_items(model, tokenizer, eval_text, eval_pairs, seqlen, device, eval_tokens, progress)[0]


def measure_lm_items(model: nn.Module, tokenizer, eval_text: str | torch.Tensor, eval_pairs: list, seqlen: int, device,
                     eval_tokens: int | None = None, progress: bool = False) -> tuple[dict[str, float], LMItems]:
    """:func:`measure_lm`'s figures and the per-item outcomes they are made of (per window and
    per pair: :class:`LMItems`), which intervals and paired comparisons resample."""
    model.eval()
    nll, count = window_losses(model, eval_text, tokenizer, seqlen=seqlen, device=device, batch_size=8,
                               max_tokens=eval_tokens, progress=progress)
    outcomes = pair_outcomes(model, tokenizer, eval_pairs, device=device, progress=progress)
    items = LMItems(nll.numpy(), count.numpy(), *(outcomes[k].numpy() for k in ("win", "decided", "anti")))
    return {"perplexity": perplexity_of(nll, count), **scores_of(**outcomes)}, items


@dataclass
class LMItems:
    """What an LM's figures are made of, item by item: per evaluation window its summed NLL and
    predicted tokens; per stereotype pair whether ``sent_more`` won, whether the pair was decided
    and whether it is an ``antistereo`` row. Saved beside a run's report as plain arrays
    (``eval_items.npz``, read back without pickle)."""

    window_nll: np.ndarray
    window_tokens: np.ndarray
    pair_win: np.ndarray
    pair_decided: np.ndarray
    pair_anti: np.ndarray

    FILE: ClassVar[str] = "eval_items.npz"

    @classmethod
    def of_windows(cls, nll: np.ndarray, tokens: np.ndarray) -> LMItems:
        """Items of a perplexity measurement alone (no stereotype pairs)."""
        empty = np.zeros(0, dtype=bool)
        return cls(np.asarray(nll, dtype=np.float64), np.asarray(tokens, dtype=np.float64), empty, empty, empty)

    def figures(self) -> dict[str, float]:
        """The report's figures, recomputed from the items."""
        return {"perplexity": perplexity_of(self.window_nll, self.window_tokens),
                **scores_of(torch.from_numpy(self.pair_win), torch.from_numpy(self.pair_decided),
                            torch.from_numpy(self.pair_anti))}

    def as_json(self) -> dict[str, list]:
        return {f.name: getattr(self, f.name).tolist() for f in fields(self)}

    @classmethod
    def from_json(cls, data: Any) -> LMItems | None:
        """From :meth:`as_json` (None when ``data`` is not that)."""
        try:
            items = cls(np.asarray(data["window_nll"], dtype=np.float64), np.asarray(data["window_tokens"], dtype=np.float64),
                        *(np.asarray(data[k], dtype=bool) for k in ("pair_win", "pair_decided", "pair_anti")))
        except (KeyError, TypeError, ValueError):
            return None
        return items if items._consistent() else None

    def _consistent(self) -> bool:
        return (self.window_nll.ndim == 1 and self.window_nll.shape == self.window_tokens.shape and len(self.window_nll) > 0
                and self.pair_win.ndim == 1 and self.pair_win.shape == self.pair_decided.shape == self.pair_anti.shape
                and bool(np.isfinite(self.window_nll).all()) and bool((self.window_tokens > 0).all()))

    def save(self, folder: str | os.PathLike) -> None:
        """``eval_items.npz`` in ``folder``, written whole (a temporary file renamed)."""
        tmp = Path(folder) / (self.FILE + ".tmp.npz")
        np.savez(tmp, **{f.name: getattr(self, f.name) for f in fields(self)})
        tmp.replace(Path(folder) / self.FILE)

    @classmethod
    def load(cls, folder: str | os.PathLike) -> LMItems | None:
        """The items a run saved in ``folder`` (None when it has none or they are damaged)."""
        try:
            with open_npz(Path(folder) / cls.FILE) as data:
                return cls.from_json({k: data[k] for k in data.files})
        except (OSError, ValueError):
            return None
