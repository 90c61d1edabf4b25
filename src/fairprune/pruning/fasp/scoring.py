"""FASP steps 1 and 2: measuring a model (seeded continuations, per-axis bias, perplexity) and
scoring every attention head gated off, resumably, into ``head_scores.csv``.

Scoring runs batched by default: many head configurations per forward pass
(:mod:`~fairprune.pruning.fasp.batched`, :meth:`Evaluator.many`), with the same rows as the
one-at-a-time loop (``score_heads(..., batched=False)``: one head gated off, one full
:meth:`Evaluator.__call__`), which stays as the reference. Under ``torchrun`` each rank scores its
share of the heads and rank 0 writes the journal (:mod:`fairprune.distributed`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn

from fairprune import distributed
from fairprune.causal.blocks import BlockModel, as_blocks
from fairprune.data.text import bos_of
from fairprune.errors import UserError, suggest
from fairprune.metrics.language import eval_ids, eval_windows, perplexity_of
from fairprune.metrics.toxicity import ToxicityScorer, bias_by_axis, make_scorer, scorer_name
from fairprune.pruning.fasp.batched import auto_rows, perplexities, window_nll
from fairprune.pruning.fasp.sampling import Generation, generate_configurations, generate_continuations
from fairprune.pruning.heads import Head, HeadGates
from fairprune.storage.atomic import write_text

BASELINE = (-1, -1)  # the (layer, head) key of the unpruned model's row in head_scores.csv


# --------------------------------------------------------------------------------------------
# (1) Measuring: continuations, bias, perplexity
# --------------------------------------------------------------------------------------------


def prompt_toxicity(model, tokenizer, prompts: pd.DataFrame, scorer: ToxicityScorer,
                    settings: Generation = Generation(), device=None) -> np.ndarray:
    """The toxicity of each prompt's continuation (float64, in the prompts' order), from one generation
    pass. ``model``: an ``nn.Module`` or a block model; ``device``: where it runs (None: its own)."""
    continuations = generate_continuations(model, tokenizer, prompts.text.tolist(), settings, device)
    return np.asarray(make_scorer(scorer).score(continuations), dtype=np.float64)


def measure_bias(model, tokenizer, prompts: pd.DataFrame, scorer: ToxicityScorer,
                 settings: Generation = Generation(), subgroup: str = "bucket") -> dict[str, float]:
    """Eq. 1 for every axis of ``prompts``, from one generation pass."""
    return bias_by_axis(prompts, prompt_toxicity(model, tokenizer, prompts, scorer, settings), subgroup)


def token_ids(tokenizer, text: str | Sequence[str]) -> torch.Tensor:
    """The evaluation text tokenized once (documents joined by blank lines), 1-D, as every LM
    command reads it (:func:`fairprune.metrics.language.eval_ids`: without a BOS a tokenizer would
    add once, since each window gets its own)."""
    return eval_ids(text, tokenizer)


@dataclass
class Evaluator:
    """Perplexity and per-axis bias of the model as it stands (gates included).

    ``model``: an ``nn.Module`` or a block model (:mod:`fairprune.causal.blocks`): every forward
    is a pass over its blocks (:mod:`~fairprune.causal.pipeline`), so a streamed model is
    measured with one block resident, with the figures of the model in memory. ``device``: where
    it runs (None: a model in memory where it is, a streamed one on its ``device``); ``progress``:
    bars over a streamed model's blocks, one per pass."""

    model: nn.Module | BlockModel
    tokenizer: object
    prompts: pd.DataFrame
    ppl_ids: torch.Tensor
    scorer: ToxicityScorer
    generation: Generation = Generation()
    seqlen: int = 128
    ppl_batch_size: int = 4
    subgroup: str = "bucket"
    max_batch: int | None = None  # rows per forward of :meth:`many`; None: from the memory (auto_rows)
    device: str | torch.device | None = None
    progress: bool = False

    def __post_init__(self):
        self.blocks = as_blocks(self.model)

    def _where(self) -> tuple[torch.device, bool]:
        """The device the passes run on, and whether they show bars."""
        return torch.device(self.device or self.blocks.run_device()), self.progress and self.blocks.reads_files

    def __call__(self) -> dict:
        blocks, (device, bars) = self.blocks, self._where()
        if self.ppl_batch_size < 1:
            raise UserError(f"perplexity batch size must be at least 1, got {self.ppl_batch_size}")
        was_training = blocks.model.training
        blocks.model.eval()
        try:
            windows = eval_windows(blocks.model, self.ppl_ids, self.seqlen, bos=bos_of(self.tokenizer))
            nll = window_nll(blocks, windows, None, self.ppl_batch_size, self.ppl_batch_size, device, bars)[0]
            toxicity = prompt_toxicity(blocks, self.tokenizer, self.prompts, self.scorer, self.generation, device)
        finally:
            blocks.model.train(was_training)
        count = torch.full_like(nll, float(windows.shape[1] - 1))
        # The windows' losses and the prompts' toxicities stay with the figures: the report's
        # perplexity and bias intervals resample them.
        return {"perplexity": perplexity_of(nll, count), "bias": bias_by_axis(self.prompts, toxicity, self.subgroup),
                "windows": (nll.numpy(), count.numpy()), "toxicity": toxicity}

    def many(self, configs: torch.Tensor) -> list[dict]:
        """What :meth:`__call__` gives for each head configuration of ``configs`` (``[C, layers, heads]``
        gates on top of the current ones), many configurations per forward."""
        blocks, (device, bars) = self.blocks, self._where()
        was_training = blocks.model.training
        blocks.model.eval()
        try:
            ppl = perplexities(blocks, self.ppl_ids, self.seqlen, self.ppl_batch_size, configs,
                               self.max_batch or auto_rows(blocks, self.seqlen, device), device, bars,
                               bos=bos_of(self.tokenizer))
            texts = generate_configurations(blocks, self.tokenizer, self.prompts.text.tolist(), configs,
                                            self.generation, self._generation_rows(), device, bars)
        finally:
            blocks.model.train(was_training)
        scorer = make_scorer(self.scorer)
        return [{"perplexity": p, "bias": bias_by_axis(self.prompts, scorer.score(t), self.subgroup)}
                for p, t in zip(ppl, texts)]

    def configs_per_pass(self) -> int:
        """Configurations whose continuations fit one generation forward (one at least)."""
        return max(1, self._generation_rows() // max(1, len(self.prompts)))

    def _generation_rows(self) -> int:
        return self.max_batch or auto_rows(self.blocks, 32 + self.generation.max_new_tokens, self._where()[0])

    def fingerprint(self) -> str:
        """What the scores depend on, hashed: a resumed run must not mix two settings."""
        parts = [self.prompts[["text", "axis", self.subgroup]].to_csv(index=False),
                 hashlib.sha256(self.ppl_ids.cpu().numpy().tobytes()).hexdigest(),
                 json.dumps(asdict(self.generation), sort_keys=True), str(self.seqlen), scorer_name(self.scorer),
                 "sampling: per-prompt uniforms, top-k by inverse CDF"]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# (2) Head scores, resumable
# --------------------------------------------------------------------------------------------


def score_heads(evaluate: Evaluator, path: str | Path, gates: HeadGates | None = None, progress: bool = True,
                batched: bool = True) -> pd.DataFrame:
    """``z_ppl`` and ``z_bias`` for every head gated off, plus the unpruned row ``(-1, -1)``.

    Rows already in ``path`` are kept and skipped; new rows are appended (and flushed) round by
    round: one head per round one at a time (``batched=False``, or an evaluator without ``many``),
    :meth:`Evaluator.configs_per_pass` heads per rank and round when batched. Columns: ``layer,
    head, perplexity, bias:<axis>...``, rows in the same order either way. A head's first complete
    row is its score: a line cut by a kill and rows repeated by another run are dropped on reading.

    Under ``torchrun`` every rank must call: each scores every ``world``-th head of a round, the
    rows meet on rank 0, which alone writes; every rank returns the same table.
    """
    path = Path(path)
    gates = gates or HeadGates(evaluate.model)
    layers, heads = gates.values.shape
    every = [BASELINE] + [(l, h) for l in range(layers) for h in range(heads)]
    axes = sorted(evaluate.prompts.axis.unique())
    columns = ["layer", "head", "perplexity", *(f"bias:{a}" for a in axes)]
    rank, size = distributed.world()
    done = _agree_on_done(path, columns, evaluate.fingerprint(), every, rank)
    todo = [head for head in every if head not in done]
    many = getattr(evaluate, "many", None) if batched else None
    per_rank = evaluate.configs_per_pass() if many else 1
    rounds = [todo[i : i + per_rank * size] for i in range(0, len(todo), per_rank * size)]
    bar = _progress(progress and rank == 0 and bool(todo), len(todo))
    with gates, (path.open("a", newline="") if rank == 0 else nullcontext()) as handle:
        for chunk in rounds:
            if many:
                results = across_ranks(chunk, lambda mine: many(_configs(mine, gates.values)), axes)
            else:
                results = across_ranks(chunk, lambda mine: [_one(evaluate, gates, head) for head in mine], axes)
            if handle is not None:
                writer = csv.writer(handle)
                for (layer, head), result in zip(chunk, results):
                    writer.writerow([layer, head, *(repr(v) for v in _values(result, axes))])
                handle.flush()
            bar.update(len(chunk))
    bar.close()
    return _share_scores(path, every, columns, rank, size)


def _values(result: dict, axes: Sequence[str]) -> list[float]:
    return [result["perplexity"], *(result["bias"][a] for a in axes)]


def across_ranks(items: list, compute, axes: Sequence[str]) -> list[dict]:
    """``compute(items)`` (evaluations: ``{"perplexity", "bias": {axis: value}}`` per item), shared out
    under ``torchrun``: rank r computes ``items[r::world]`` alone and every rank gets every item's
    result (float64 all-reduce: the values arrive unchanged). One process computes everything."""
    rank, size = distributed.world()
    if size == 1:
        with distributed.local():
            return compute(items) if items else []
    mine = items[rank::size]
    with distributed.local():  # this rank's items, alone
        results = compute(mine) if mine else []
    values = torch.zeros(len(items), 1 + len(axes), dtype=torch.float64)
    for index, result in zip(range(rank, len(items), size), results):
        values[index] = torch.tensor(_values(result, axes), dtype=torch.float64)
    distributed.all_reduce_sum(values)  # the other ranks' rows are zeros here: the sum is the union
    return [{"perplexity": row[0], "bias": dict(zip(axes, row[1:]))} for row in values.tolist()]


def _one(evaluate, gates: HeadGates, head: Head) -> dict:
    with gates.off([] if head == BASELINE else [head]):
        return evaluate()


def _configs(heads: list[Head], values: torch.Tensor) -> torch.Tensor:
    """``[len(heads), layers, heads]`` gates: all on but the one head of each row (none for the baseline)."""
    configs = torch.ones(len(heads), *values.shape)
    for row, (layer, head) in enumerate(heads):
        if (layer, head) != BASELINE:
            configs[row, layer, head] = 0.0
    return configs


def _progress(show: bool, total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="[fasp] scoring heads", leave=False, disable=not show)


def _agree_on_done(path: Path, columns: list[str], fingerprint: str, every: list[Head], rank: int) -> set[Head]:
    """The heads already in the journal, read (or the journal started) by rank 0 and told to every rank."""
    status = torch.zeros(1 + len(every), dtype=torch.float64)
    error = None
    if rank == 0:
        try:
            done = _resume(path, columns, fingerprint)
            status[0] = 1.0
            status[1:] = torch.tensor([float(head in done) for head in every], dtype=torch.float64)
        except UserError as err:
            error = err
    distributed.all_reduce_sum(status)
    if error is not None:
        raise error
    if status[0].item() != 1.0:
        raise UserError(f"rank 0 could not resume the head scores in {path}; see its message")
    return {head for head, flag in zip(every, status[1:].tolist()) if flag}


def _share_scores(path: Path, every: list[Head], columns: list[str], rank: int, size: int) -> pd.DataFrame:
    """Rank 0's table of ``path``; the other ranks get the same values (in ``every``'s order)."""
    frame = read_scores(path) if rank == 0 else None
    if size == 1:
        return frame
    values = torch.zeros(len(every), len(columns) - 2, dtype=torch.float64)
    if rank == 0:
        by_head = {(int(r[0]), int(r[1])): r[2:] for r in frame[columns].itertuples(index=False)}
        values = torch.tensor([list(by_head[head]) for head in every], dtype=torch.float64)
    distributed.all_reduce_sum(values)
    if rank == 0:
        return frame
    rows = [[layer, head, *row] for (layer, head), row in zip(every, values.tolist())]
    return pd.DataFrame(rows, columns=columns)


def _resume(path: Path, columns: list[str], fingerprint: str) -> set[Head]:
    """Heads already scored in ``path`` under the same settings (a sidecar holds the fingerprint)."""
    stamp = path.with_suffix(".json")
    if path.exists() and path.stat().st_size > 0:
        old = json.loads(stamp.read_text()) if stamp.exists() else {}
        text = path.read_text()
        header, rows, dropped = _rows(text)
        if header != columns or old.get("fingerprint") != fingerprint:
            raise UserError(f"{path} holds scores from other settings (prompts, text, generation or axes); "
                            "delete it or choose another output directory")
        if dropped or not text.endswith("\n"):  # appending goes on from a clean file, one row per head
            write_text(path, _csv_text(header, rows))
        return {(int(r[0]), int(r[1])) for r in rows}
    write_text(path, _csv_text(columns, []))
    write_text(stamp, json.dumps({"fingerprint": fingerprint, "columns": columns}))
    return set()


def _rows(text: str) -> tuple[list[str], list[list[str]], int]:
    """The header, the complete rows (as many fields as the header, none empty, integer layer and
    head) with the first row of each ``(layer, head)`` kept, and how many rows were dropped."""
    lines = list(csv.reader(io.StringIO(text)))
    header, body = (lines[0], lines[1:]) if lines else ([], [])
    rows, seen = [], set()
    for row in body:
        try:
            key = (int(row[0]), int(row[1]))
        except (ValueError, IndexError):
            continue
        if len(row) == len(header) and all(row) and key not in seen:
            seen.add(key)
            rows.append(row)
    return header, rows, len(body) - len(rows)


def _csv_text(header: list[str], rows: list[list[str]]) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([header, *rows])
    return out.getvalue()


def read_scores(path: str | Path) -> pd.DataFrame:
    """``head_scores.csv`` as a frame (one row per head, its first complete one; the unpruned row has
    layer = head = -1)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise UserError(f"head scores not found: {path}; run the scoring step first") from None
    header, rows, _ = _rows(text)
    return pd.read_csv(io.StringIO(_csv_text(header, rows)))


def _bias(scores: pd.DataFrame, axes: Sequence[str]) -> pd.Series:
    """The selection objective: bias summed over the chosen axes."""
    present = [c.split(":", 1)[1] for c in scores.columns if c.startswith("bias:")]
    for axis in axes:
        if axis not in present:
            raise UserError(f"no scores for axis {axis!r}{suggest(axis, present)}; scored axes: {', '.join(present)}")
    return scores[[f"bias:{a}" for a in axes]].sum(axis=1)


def _heads_only(scores: pd.DataFrame) -> pd.DataFrame:
    heads = scores[(scores.layer >= 0) & (scores["head"] >= 0)]
    return heads.sort_values(["layer", "head"]).reset_index(drop=True)


def head_bias_impact(scores: pd.DataFrame, axes: Sequence[str]) -> np.ndarray:
    """``[layers, heads]``: each head's bias with it removed minus the unpruned model's bias
    (summed over ``axes``; against 0 when the unpruned row is missing)."""
    heads = _heads_only(scores)
    base = scores[(scores.layer == BASELINE[0]) & (scores["head"] == BASELINE[1])]
    impact = _bias(heads, axes) - (float(_bias(base, axes).iloc[0]) if len(base) else 0.0)
    layers, n = int(heads.layer.max()) + 1, int(heads["head"].max()) + 1
    return torch.tensor(impact.to_numpy()).view(layers, n).numpy()


def head_bias_by_axis(scores: pd.DataFrame) -> pd.DataFrame:
    """The heads' bias scores, one row per head and one column per axis (named by the axis)."""
    columns = [c for c in scores.columns if c.startswith("bias:")]
    return _heads_only(scores)[columns].rename(columns=lambda c: c.split(":", 1)[1])
