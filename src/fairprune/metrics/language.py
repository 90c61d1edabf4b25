"""Language-model metrics: perplexity and the paired stereotype score.

* :func:`perplexity` follows the standard protocol of the LLM-pruning literature (SparseGPT,
  Wanda): join the documents with ``"\\n\\n"``, tokenize once, cut the ids into non-overlapping
  windows of ``seqlen`` tokens (the tail shorter than a window is dropped), and return
  ``exp`` of the mean negative log-likelihood over every predicted token.
* :func:`stereotype_score` is the share of (stereotypical, anti-stereotypical) pairs for which
  the model gives the stereotypical sentence the higher total log-likelihood: 0.5 is unbiased,
  1.0 always prefers the stereotype. Exact ties count one half.
* :func:`read_stereoset` / :func:`read_crows_pairs` turn the two public formats into such pairs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from fairprune.data.text import encode_sentence, join_documents
from fairprune.errors import UserError


@torch.no_grad()
def perplexity(
    model: nn.Module,
    text_or_ids: str | Iterable[str] | torch.Tensor,
    tokenizer=None,
    seqlen: int | None = None,
    device: str | torch.device | None = None,
    batch_size: int = 1,
) -> float:
    """Perplexity over non-overlapping ``seqlen`` windows (default: the model's context length).

    ``text_or_ids`` is a text, a list of documents, or already tokenized ids (1-D or [1, n]).
    """
    ids = _token_stream(text_or_ids, tokenizer)
    limit = _context_length(model)
    seqlen = seqlen or limit
    if limit is not None and seqlen > limit:
        raise UserError(f"seqlen {seqlen} exceeds the model's context length {limit}; use --seqlen {limit} or less")
    windows = ids.numel() // seqlen
    if windows == 0:
        raise UserError(f"evaluation text has {ids.numel()} tokens, fewer than one window of {seqlen}; give more text or a smaller seqlen")
    ids = ids[: windows * seqlen].view(windows, seqlen)
    with _on_device(model, device) as run_device:
        nll, count = 0.0, 0
        for batch in ids.split(batch_size):
            batch = batch.to(run_device)
            logits = model(input_ids=batch, use_cache=False).logits.float()
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
            nll += float(loss.double())
            count += batch[:, 1:].numel()
    return math.exp(nll / count)


@torch.no_grad()
def sentence_log_likelihoods(
    model: nn.Module, tokenizer, sentences: list[str], device=None, batch_size: int = 16
) -> torch.Tensor:
    """Total log-likelihood of each sentence (every token after the leading BOS/EOS), float64 [n]."""
    encoded = [encode_sentence(tokenizer, s) for s in sentences]
    scores = []
    with _on_device(model, device) as run_device:
        for start in range(0, len(encoded), batch_size):
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


def stereotype_score(model: nn.Module, tokenizer, pairs: list[tuple[str, str]], device=None, batch_size: int = 16) -> float:
    """Share of (stereotypical, anti-stereotypical) pairs where the stereotype is more likely (0.5 ideal)."""
    if not pairs:
        raise UserError("no sentence pairs given; pass (stereotypical, anti-stereotypical) pairs, e.g. from read_stereoset")
    scores = sentence_log_likelihoods(model, tokenizer, [s for pair in pairs for s in pair], device, batch_size)
    stereo, anti = scores[0::2], scores[1::2]
    wins = (stereo > anti).double() + 0.5 * (stereo == anti).double()
    return float(wins.mean())


def read_stereoset(path: str | Path) -> list[tuple[str, str]]:
    """(stereotype, anti-stereotype) pairs from StereoSet JSON ``data.intrasentence[*].sentences[*]``."""
    data = _read_json(path)
    items = data.get("data", {}).get("intrasentence") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise UserError(f"{path}: no 'data.intrasentence' list; expected StereoSet intrasentence JSON")
    pairs = []
    for k, item in enumerate(items):
        sentences = item.get("sentences") if isinstance(item, dict) else None
        by_label = {s.get("gold_label"): s.get("sentence") for s in sentences or [] if isinstance(s, dict)}
        stereo, anti = by_label.get("stereotype"), by_label.get("anti-stereotype")
        if not (isinstance(stereo, str) and isinstance(anti, str)):
            raise UserError(f"{path}: intrasentence item {k} lacks a 'stereotype' or 'anti-stereotype' sentence (gold_label)")
        pairs.append((stereo, anti))
    return pairs


def read_crows_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(stereotypical, anti-stereotypical) pairs from a CrowS-Pairs CSV (``sent_more,sent_less``).

    When the file has the ``stereo_antistereo`` column, rows marked ``antistereo`` are swapped:
    there ``sent_less`` is the stereotypical sentence (as in the CrowS-Pairs metric).
    """
    import pandas as pd

    from fairprune.data.files import read_user_csv

    frame = read_user_csv(path, "CrowS-Pairs", "CrowS-Pairs columns sent_more,sent_less")
    missing = {"sent_more", "sent_less"} - set(frame.columns)
    if missing:
        raise UserError(f"{path}: missing column(s) {', '.join(sorted(missing))}; expected CrowS-Pairs columns sent_more,sent_less")
    if frame.empty or frame[["sent_more", "sent_less"]].isna().any().any():
        raise UserError(f"{path}: empty file or empty sent_more/sent_less cells; every row needs both sentences")
    anti = frame.get("stereo_antistereo", pd.Series(["stereo"] * len(frame))).eq("antistereo")
    return [(less, more) if flip else (more, less) for more, less, flip in zip(frame.sent_more, frame.sent_less, anti)]


def read_pairs(path: str | Path) -> list[tuple[str, str]]:
    """Read StereoSet (``.json``) or CrowS-Pairs (``.csv``) into (stereotypical, anti) pairs."""
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        return read_stereoset(path)
    if suffix == ".csv":
        return read_crows_pairs(path)
    raise UserError(f"{path}: unknown pair-set format {suffix!r}; give StereoSet .json or CrowS-Pairs .csv")


def _read_json(path: str | Path):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"StereoSet file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: not valid JSON ({err}); expected StereoSet intrasentence JSON") from None


def _token_stream(text_or_ids, tokenizer) -> torch.Tensor:
    """1-D token ids: tokenize the joined documents once, or flatten given ids."""
    if isinstance(text_or_ids, torch.Tensor):
        if text_or_ids.dim() > 2 or (text_or_ids.dim() == 2 and text_or_ids.shape[0] != 1):
            raise UserError("token ids for perplexity must be 1-D or [1, n]; concatenate the documents first")
        return text_or_ids.flatten().long()
    if tokenizer is None:
        raise UserError("perplexity of raw text needs a tokenizer; pass tokenizer=... or token ids")
    return tokenizer(join_documents(text_or_ids), return_tensors="pt", verbose=False).input_ids[0]


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
