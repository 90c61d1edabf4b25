"""Multiple-choice scoring that reads each context once: lm-eval's ``HFLM`` with a shared-context
``_loglikelihood_tokens``.

lm-eval scores a multiple-choice item as one log-likelihood request per answer, and ``HFLM`` runs
the context and the answer together for each (it shares the context only when every answer is one
token). :class:`SharedContextLM` groups the requests by their context tokens and runs each context
once, keeping its key/value cache (transformers' ``DynamicCache``); the answers of up to
``batch_size`` contexts are then scored in one more forward from that cache, its rows repeated for
the answers (``Cache.reorder_cache``). An answer's first token is scored by the context's last
logits, so one-token answers need no second forward.

Contexts that begin with the same tokens (an item asked in several answer orders, one passage in
two tasks, a shared instruction or few-shot prefix) share that prefix the same way: the first
forward runs the prefix once, the second each context's own tokens after it followed by an answer
(once for all of a context's one-token answers). A context joins the group before it (in token
order) only where that runs fewer tokens. Padding is masked: the prefixes are left-padded (each
ends at the last column), what follows them right-padded, and every token gets the position it has
in its own request. On a CPU, where padding costs as much as a token, the second forward's rows are
split by length where that saves more padding than a forward costs (:data:`FORWARD_TOKENS`; a
streamed model, which reads its weights at each forward, splits them less).

The figures are HFLM's: the same per-request ``(log-likelihood, is_greedy)`` in the same order, the
same partial-cache entries and progress bar; what differs is floating-point rounding (other matrix
shapes, padding masked rather than absent), which the oracle tests bound
(``tests/test_shared_context.py``).

A request it cannot share exactly goes to HFLM's own ``_loglikelihood_tokens``: one whose context
and answer exceed ``max_length + 1`` tokens (HFLM cuts it from the left, by an amount that depends
on the answer), an empty one, every request of a model that takes no cache, position ids or
attention mask in its forward, is not causal or has linear-attention (recurrent) layers, rolling
windows (``loglikelihood_rolling``, whose contexts differ) and ``batch_size="auto"``. A model with
sliding-window or chunked attention shares whole contexts only (masked padding inside a sequence
would count towards its window).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

Request = tuple[tuple[str, str] | None, list[int], list[int]]
#: The rows of the answers' forward at most, as a multiple of ``batch_size`` (each holds a copy of its
#: prefix's cache); a context with more answers is read once per such share of them.
ROWS_PER_CONTEXT = 4
#: Contexts whose first tokens agree read them once when they are at least this many.
SHARED_PREFIX = 8
#: The padding tokens a further forward of the answers' rows must save, by device type: the rows
#: are split by length where that saves more (on a CPU padding costs as much as a token; on an
#: accelerator a forward costs more than the padding of a batch).
FORWARD_TOKENS = {"cpu": 32, "other": 4096}
#: How many times that for a streamed model (its parameters on ``meta``, each part read from its
#: files as the forward reaches it): a forward of SmolLM2-135M streamed on a CPU takes what about
#: 250 more tokens would.
STREAMED_FORWARD = 8


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


@dataclass
class _Group:
    """Contexts whose first ``shared`` tokens agree: the prefix read once for all of them."""

    contexts: list[_Context]
    shared: int

    @property
    def prefix(self) -> list[int]:
        return self.contexts[0].tokens[:self.shared]

    def rows(self) -> list[tuple[int, list[int]]]:
        """The answers' forward's rows: (context, tokens), each context's own tokens after the
        prefix and an answer's but its last, once per distinct sequence (a context's one-token
        answers share one; none where nothing follows the prefix)."""
        found: dict[tuple[int, tuple[int, ...]], None] = {}
        for i, context in enumerate(self.contexts):
            own = context.tokens[self.shared:]
            for answer in context.answers:
                if own or len(answer) > 1:
                    found[i, tuple(own + answer[:-1])] = None
        return [(i, list(tokens)) for i, tokens in found]

    def cost(self) -> int:
        """Tokens the two forwards run for this group (padding aside)."""
        return self.shared + sum(len(tokens) for _, tokens in self.rows())


class SharedContextLM(HFLM):
    """lm-eval's ``HFLM`` scoring each context once (see the module docstring); built and used as
    ``HFLM`` is. ``rows_per_context``: the rows of the answers' forward at most, as a multiple of
    ``batch_size`` (:data:`ROWS_PER_CONTEXT`)."""

    def __init__(self, *args, rows_per_context: int = ROWS_PER_CONTEXT, forward_tokens: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows_per_context = rows_per_context
        self.forward_tokens = forward_tokens

    # -- what can be shared ---------------------------------------------------------------------
    def _forward_names(self) -> dict[str, str] | None:
        """The model forward's names for the cache (``cache``, or ``past_key_values`` before
        transformers named it so) and whether it takes ``logits_to_keep``; None when it cannot
        continue from a cache with padding (no cache, position ids or attention mask) or holds a
        recurrent state (linear-attention layers, which padding would enter)."""
        from transformers import DynamicCache

        names = inspect.signature(self.model.forward).parameters
        cache = next((n for n in ("cache", "past_key_values") if n in names), None)
        if cache is None or "position_ids" not in names or "attention_mask" not in names:
            return None
        if any(getattr(DynamicCache(config=self.model.config), "is_linear", ())):
            return None
        return {"cache": cache, "keep": "logits_to_keep" if "logits_to_keep" in names else ""}

    def _prefixes_shareable(self) -> bool:
        """Whether contexts may share a prefix: attention over every earlier token (no sliding
        window or chunks, which count masked padding as distance)."""
        config = self.model.config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        local = window or getattr(config, "window_size", None) or getattr(config, "attention_chunk_size", None)
        return not local and set(getattr(config, "layer_types", None) or ["full_attention"]) == {"full_attention"}

    def _forward_tokens(self) -> int:
        """What a forward costs in padding tokens (``forward_tokens``, else :data:`FORWARD_TOKENS` of
        the device, :data:`STREAMED_FORWARD` times that for a streamed model)."""
        if self.forward_tokens:
            return self.forward_tokens
        streamed = any(p.device.type == "meta" for p in self.model.parameters())
        return FORWARD_TOKENS.get(self.device.type, FORWARD_TOKENS["other"]) * (STREAMED_FORWARD if streamed else 1)

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
        forward = self._forward_tokens()
        for batch in self._batches(list(contexts.values())):
            for i, answer in self._score(batch, names, forward):
                results[i] = answer
                if requests[i][0] is not None:  # rolling windows (no request string) are cached by their caller
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                pbar.update(1)
        pbar.close()
        return results

    def _batches(self, contexts: list[_Context]) -> list[list[_Group]]:
        """The contexts in groups sharing a prefix (in token order, a context joins the group before
        it where that runs fewer tokens and the prefix stays :data:`SHARED_PREFIX` long), the groups
        longest prefix first, ``batch_size`` groups and ``rows_per_context × batch_size`` rows of the
        answers' forward at most per batch (a context with more answers is read once for each such
        share of them)."""
        size = max(1, self.batch_size)
        most_rows = size * self.rows_per_context
        prefixes = self._prefixes_shareable()
        groups: list[_Group] = []
        for context in sorted((p for c in contexts for p in _pieces(c, most_rows)), key=lambda c: c.tokens):
            alone = _Group([context], len(context.tokens))
            if prefixes and groups:
                merged = _Group([*groups[-1].contexts, context], _common(groups[-1].prefix, context.tokens))
                if (merged.shared >= SHARED_PREFIX and len(merged.rows()) <= most_rows
                        and merged.cost() <= groups[-1].cost() + alone.cost()):
                    groups[-1] = merged
                    continue
            groups.append(alone)
        batches: list[list[_Group]] = []
        rows = 0
        for group in sorted(groups, key=lambda g: (-g.shared, g.prefix)):
            if not batches or len(batches[-1]) >= size or rows + len(group.rows()) > most_rows:
                batches.append([])
                rows = 0
            batches[-1].append(group)
            rows += len(group.rows())
        return batches

    # -- the forwards ---------------------------------------------------------------------------
    def _call(self, names: dict[str, str], keep: int | torch.Tensor, **inputs) -> torch.Tensor:
        """The model's log-probabilities at the positions ``keep`` (``logits_to_keep``'s meaning: 1
        the last, a ``(rows, n)`` tensor those of each row), under HFLM's no-grad, autocast and
        softmax dtype."""
        if names["keep"]:
            inputs[names["keep"]] = keep
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                             enabled=self.mixed_precision_dtype is not None):
            logits = self.model(**inputs, use_cache=True).logits
        if not names["keep"]:
            logits = logits[:, -keep:] if isinstance(keep, int) else torch.take_along_dim(logits, keep[..., None], dim=1)
        expected = (len(logits), keep) if isinstance(keep, int) else tuple(keep.shape)
        if tuple(logits.shape[:2]) != expected:
            raise RuntimeError(f"{type(self.model).__name__} returned logits of shape {tuple(logits.shape)} for "
                               f"logits_to_keep of shape {expected}: not transformers' slicing")
        return F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)

    def _score(self, batch: list[_Group], names: dict[str, str], forward: int) -> list[tuple[int, tuple[float, bool]]]:
        """Every request of ``batch``'s contexts: ``(index, (log-likelihood, is_greedy))``. The
        prefixes run first (left-padded: each ends at the last column), then the rows of
        :meth:`_Group.rows` from their cache, longest first, in runs by length where a run saves
        more than ``forward`` padding tokens."""
        from transformers import DynamicCache

        device = self.device
        prefixes = [g.prefix for g in batch]
        width = max(map(len, prefixes))
        ids = torch.full((len(batch), width), self._pad_id(), dtype=torch.long, device=device)
        mask = torch.zeros((len(batch), width), dtype=torch.long, device=device)
        for row, prefix in enumerate(prefixes):
            ids[row, width - len(prefix):] = torch.tensor(prefix, dtype=torch.long, device=device)
            mask[row, width - len(prefix):] = 1
        cache = DynamicCache(config=self.model.config)
        last = self._call(names, 1, input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                          **{names["cache"]: cache})[:, 0]
        rows = sorted(((g, i, tokens) for g, group in enumerate(batch) for i, tokens in group.rows()),
                      key=lambda row: -len(row[2]))
        after: list[torch.Tensor] = []
        pieces = _split([len(tokens) for _, _, tokens in rows], forward)
        for n, (start, end) in enumerate(pieces):  # each piece from the prefixes' cache as it is now
            state = (cache if n == len(pieces) - 1 else copy.deepcopy(cache), mask)
            after.extend(self._rows(batch, rows[start:end], state, names))
        row_of = {(g, i, tuple(tokens)): r for r, (g, i, tokens) in enumerate(rows)}
        out = []
        for g, group in enumerate(batch):
            for i, context in enumerate(group.contexts):
                own = context.tokens[group.shared:]
                for index, answer in zip(context.indices, context.answers):
                    parts = [] if own else [last[g:g + 1]]  # the prefix's last position scores the first token
                    if own or len(answer) > 1:
                        parts.append(after[row_of[g, i, tuple(own + answer[:-1])]][:len(answer) - len(parts)])
                    out.append((index, _answer(torch.cat(parts), answer)))
        return out

    def _rows(self, batch: list[_Group], rows: list[tuple[int, int, list[int]]], state,
              names: dict[str, str]) -> torch.Tensor:
        """The log-probabilities of ``rows`` (group, context, tokens after the prefix; right-padded)
        continuing the prefixes' cache, its rows repeated for them, from each row's first scored
        position (its context's last token, or the first where the context is the prefix) on."""
        cache, mask = state
        device = self.device
        width = max(len(tokens) for _, _, tokens in rows)
        ids = torch.full((len(rows), width), self._pad_id(), dtype=torch.long, device=device)
        own_mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
        for r, (_, _, tokens) in enumerate(rows):
            ids[r, :len(tokens)] = torch.tensor(tokens, dtype=torch.long, device=device)
            own_mask[r, :len(tokens)] = 1
        which = torch.tensor([g for g, _, _ in rows], dtype=torch.long, device=device)
        cache.reorder_cache(which)
        start = mask[which].sum(-1, keepdim=True)  # the prefix's length: the row's first position
        ends = torch.tensor([[len(tokens) - 1] for _, _, tokens in rows], device=device)
        positions = start + torch.minimum(torch.arange(width, device=device), ends)  # padding: the last position again
        first = [max(len(batch[g].contexts[i].tokens) - batch[g].shared - 1, 0) for g, i, _ in rows]
        count = max(len(tokens) - f for (_, _, tokens), f in zip(rows, first))
        keep = (torch.tensor(first, device=device).unsqueeze(1) + torch.arange(count, device=device)).clamp(max=width - 1)
        return self._call(names, keep, input_ids=ids, attention_mask=torch.cat([mask[which], own_mask], dim=1),
                          position_ids=positions, **{names["cache"]: cache})

    def _pad_id(self) -> int:
        """A token id for padding (masked, or after what is scored): the tokenizer's pad, else its end."""
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.eot_token_id)


def _common(a: list[int], b: list[int]) -> int:
    """How many first tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _split(lengths: list[int], forward: int) -> list[tuple[int, int]]:
    """Cut rows of ``lengths`` (longest first) into runs, each padded to its first row's length,
    for the fewest padded tokens plus ``forward`` per run (exact: every cut is tried)."""
    best = [0] + [None] * len(lengths)
    cut = [0] * (len(lengths) + 1)
    for end in range(1, len(lengths) + 1):
        best[end], cut[end] = min((best[start] + (end - start) * lengths[start] + forward, start) for start in range(end))
    runs, end = [], len(lengths)
    while end:
        runs.append((cut[end], end))
        end = cut[end]
    return runs[::-1]


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
