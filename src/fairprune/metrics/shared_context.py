"""Multiple-choice scoring that reads each context once: lm-eval's ``HFLM`` with a shared-context
``_loglikelihood_tokens``.

lm-eval scores a multiple-choice item as one log-likelihood request per answer, and ``HFLM`` runs
the context and the answer together for each (it shares the context only when every answer is one
token). :class:`SharedContextLM` groups the requests by their context tokens, runs each context
once, left-padded with up to ``batch_size`` other contexts in one forward, keeps its key/value cache
(transformers' ``DynamicCache``), and scores every answer of those contexts in one more forward from
the cache, the cache's rows repeated for the answers (``Cache.reorder_cache``). An answer's first
token is scored by the context's last logits, the rest by the answer's own forward; a one-token
answer needs no second forward. The figures are HFLM's: the same per-request ``(log-likelihood,
is_greedy)`` in the same order, the same partial-cache entries and progress bar; what differs is
floating-point rounding (other matrix shapes, the padding masked rather than absent), which the
oracle tests bound (``tests/test_shared_context.py``).

A request it cannot share exactly goes to HFLM's own ``_loglikelihood_tokens``: one whose context
and answer exceed ``max_length + 1`` tokens (HFLM cuts it from the left, by an amount that depends
on the answer), an empty one, every request of a model that takes no cache, position ids or
attention mask in its forward or is not causal, rolling windows (``loglikelihood_rolling``, whose
contexts differ) and ``batch_size="auto"``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

Request = tuple[tuple[str, str] | None, list[int], list[int]]
#: The answers one forward scores at most, as a multiple of ``batch_size`` (each holds a copy of its
#: context's cache); a context with more answers than that is scored alone.
ROWS_PER_CONTEXT = 4


@dataclass
class _Context:
    """One context's tokens and the requests that continue it (their indices and answers)."""

    tokens: list[int]
    indices: list[int] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)

    @property
    def rows(self) -> int:
        """Answers of more than one token: those the answers' forward runs."""
        return sum(len(a) > 1 for a in self.answers)


class SharedContextLM(HFLM):
    """lm-eval's ``HFLM`` scoring each context once (see the module docstring); built and used as
    ``HFLM`` is. ``rows_per_context``: the answers one forward scores, as a multiple of
    ``batch_size`` (:data:`ROWS_PER_CONTEXT`)."""

    def __init__(self, *args, rows_per_context: int = ROWS_PER_CONTEXT, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows_per_context = rows_per_context

    # -- what can be shared ---------------------------------------------------------------------
    def _forward_names(self) -> dict[str, str] | None:
        """The model forward's names for the cache (``cache``, or ``past_key_values`` before
        transformers named it so) and whether it takes ``logits_to_keep``; None when it cannot
        continue from a cache with padding (no cache, position ids or attention mask)."""
        names = inspect.signature(self.model.forward).parameters
        cache = next((n for n in ("cache", "past_key_values") if n in names), None)
        if cache is None or "position_ids" not in names or "attention_mask" not in names:
            return None
        return {"cache": cache, "keep": "logits_to_keep" if "logits_to_keep" in names else ""}

    def _shareable(self, request: Request) -> bool:
        _, context, answer = request
        return bool(context) and bool(answer) and len(context) + len(answer) <= self.max_length + 1

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        names = self._forward_names() if self.backend == "causal" else None
        if override_bs is not None or not isinstance(self.batch_size, int) or names is None:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        pbar = tqdm(total=len(requests), disable=(disable_tqdm or (self.rank != 0)),
                    desc="Running loglikelihood requests")
        rest = [i for i, r in enumerate(requests) if not self._shareable(r)]
        if rest:  # HFLM's own path, its partial-cache entries its own
            for i, answer in zip(rest, super()._loglikelihood_tokens([requests[i] for i in rest], disable_tqdm=True)):
                results[i] = answer
            pbar.update(len(rest))
        contexts: dict[tuple[int, ...], _Context] = {}
        for i, (_, context, answer) in enumerate(requests):
            if results[i] is None:
                entry = contexts.setdefault(tuple(context), _Context(list(context)))
                entry.indices.append(i)
                entry.answers.append(list(answer))
        for batch in self._batches(list(contexts.values())):
            for i, answer in self._score(batch, names):
                results[i] = answer
                if requests[i][0] is not None:  # rolling windows (no request string) are cached by their caller
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                pbar.update(1)
        pbar.close()
        return results

    def _batches(self, contexts: list[_Context]) -> list[list[_Context]]:
        """Contexts longest first, ``batch_size`` at most per forward, their answers of more than
        one token ``rows_per_context × batch_size`` at most (a context with more answers is read
        once for each such share of them)."""
        size = max(1, self.batch_size)
        most_rows = size * self.rows_per_context
        contexts = [piece for c in sorted(contexts, key=lambda c: (-len(c.tokens), c.tokens))
                    for piece in _pieces(c, most_rows)]
        batches: list[list[_Context]] = []
        rows = 0
        for context in contexts:
            if not batches or len(batches[-1]) >= size or (batches[-1] and rows + context.rows > most_rows):
                batches.append([])
                rows = 0
            batches[-1].append(context)
            rows += context.rows
        return batches

    # -- the forwards ---------------------------------------------------------------------------
    def _call(self, names: dict[str, str], keep_last: bool, **inputs) -> torch.Tensor:
        """The model's log-probabilities, under HFLM's no-grad, autocast and softmax dtype."""
        if names["keep"]:
            inputs[names["keep"]] = 1 if keep_last else 0
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                             enabled=self.mixed_precision_dtype is not None):
            logits = self.model(**inputs, use_cache=True).logits
        if keep_last:
            logits = logits[:, -1:]
        return F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)

    def _score(self, batch: list[_Context], names: dict[str, str]) -> list[tuple[int, tuple[float, bool]]]:
        """Every request of ``batch``'s contexts: ``(index, (log-likelihood, is_greedy))``."""
        from transformers import DynamicCache

        device = self.device
        width = max(len(c.tokens) for c in batch)
        ids = torch.full((len(batch), width), self._pad_id(), dtype=torch.long, device=device)
        mask = torch.zeros((len(batch), width), dtype=torch.long, device=device)
        for row, context in enumerate(batch):  # left padding: every context ends at the last column
            ids[row, width - len(context.tokens):] = torch.tensor(context.tokens, dtype=torch.long, device=device)
            mask[row, width - len(context.tokens):] = 1
        cache = DynamicCache(config=self.model.config)
        last = self._call(names, True, input_ids=ids, attention_mask=mask,
                          position_ids=(mask.cumsum(-1) - 1).clamp(min=0), **{names["cache"]: cache})[:, 0]
        rows = [(b, k) for b, context in enumerate(batch) for k, answer in enumerate(context.answers) if len(answer) > 1]
        rest = self._continue(batch, rows, cache, mask, names) if rows else None
        row_of = {key: r for r, key in enumerate(rows)}
        out = []
        for b, context in enumerate(batch):
            for k, (index, answer) in enumerate(zip(context.indices, context.answers)):
                logprobs = last[b:b + 1] if len(answer) == 1 else torch.cat([last[b:b + 1],
                                                                           rest[row_of[b, k], :len(answer) - 1]])
                out.append((index, _answer(logprobs, answer)))
        return out

    def _continue(self, batch: list[_Context], rows: list[tuple[int, int]], cache, mask: torch.Tensor,
                  names: dict[str, str]) -> torch.Tensor:
        """The log-probabilities after each answer's tokens but the last (``rows``: context, answer),
        continuing the contexts' cache, its rows repeated for the answers."""
        device = self.device
        length = max(len(batch[b].answers[k]) for b, k in rows) - 1
        ids = torch.full((len(rows), length), self._pad_id(), dtype=torch.long, device=device)
        for r, (b, k) in enumerate(rows):  # right padding: after the answer, where nothing scored reads it
            answer = batch[b].answers[k][:-1]
            ids[r, :len(answer)] = torch.tensor(answer, dtype=torch.long, device=device)
        which = torch.tensor([b for b, _ in rows], dtype=torch.long, device=device)
        cache.reorder_cache(which)
        mask = torch.cat([mask[which], torch.ones((len(rows), length), dtype=torch.long, device=device)], dim=1)
        start = mask[:, :-length].sum(-1, keepdim=True)  # each context's length: the answer's first position
        fed = torch.tensor([[len(batch[b].answers[k]) - 2] for b, k in rows], device=device)
        positions = start + torch.minimum(torch.arange(length, device=device), fed)  # padding: the last position again
        return self._call(names, False, input_ids=ids, attention_mask=mask, position_ids=positions,
                          **{names["cache"]: cache})

    def _pad_id(self) -> int:
        """A token id for padding (masked, or after what is scored): the tokenizer's pad, else its end."""
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.eot_token_id)


def _pieces(context: _Context, most_rows: int) -> list[_Context]:
    """``context`` with its answers in shares of at most ``most_rows`` of more than one token."""
    pieces = [_Context(context.tokens)]
    for index, answer in zip(context.indices, context.answers):
        if len(answer) > 1 and pieces[-1].rows >= most_rows:
            pieces.append(_Context(context.tokens))
        pieces[-1].indices.append(index)
        pieces[-1].answers.append(answer)
    return pieces


def _answer(logprobs: torch.Tensor, answer: list[int]) -> tuple[float, bool]:
    """HFLM's ``(log-likelihood, is_greedy)`` of ``answer`` from its positions' log-probabilities."""
    tokens = torch.tensor(answer, dtype=torch.long, device=logprobs.device)
    greedy = bool((logprobs.argmax(dim=-1) == tokens).all())
    return float(torch.gather(logprobs, 1, tokens.unsqueeze(-1)).sum()), greedy
