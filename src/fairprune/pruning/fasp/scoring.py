"""FASP steps 1 and 2: measuring a model (seeded continuations, per-axis bias, perplexity) and
scoring every attention head gated off, resumably, into ``head_scores.csv``."""

from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from torch import nn

from fairprune.data.text import join_documents
from fairprune.errors import UserError, suggest
from fairprune.metrics.language import perplexity
from fairprune.metrics.toxicity import ToxicityScorer, bias_by_axis, make_scorer
from fairprune.pruning.heads import Head, HeadGates
from fairprune.reporting.atomic import write_text

BASELINE = (-1, -1)  # the (layer, head) key of the unpruned model's row in head_scores.csv


@dataclass(frozen=True)
class Generation:
    """How continuations are generated: seeded sampling, left-padded batches."""

    max_new_tokens: int = 20
    batch_size: int = 32
    do_sample: bool = True
    top_k: int = 50
    seed: int = 0


# --------------------------------------------------------------------------------------------
# (1) Measuring: continuations, bias, perplexity
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def generate_continuations(model: nn.Module, tokenizer, texts: Sequence[str], settings: Generation = Generation()) -> list[str]:
    """The model's continuation of each prompt (new tokens only), generated in left-padded batches.

    Each batch is sampled under its own seed (``seed + batch index``) inside a forked RNG, so the
    result depends on the model alone, not on what ran before, and the global RNG is untouched.
    """
    device = next(model.parameters()).device
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    # Left padding keeps every prompt's last token at the end, where generation continues.
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    sampling = dict(max_new_tokens=settings.max_new_tokens, do_sample=settings.do_sample)
    if settings.do_sample:
        sampling["top_k"] = settings.top_k
    out: list[str] = []
    try:
        for index, start in enumerate(range(0, len(texts), settings.batch_size)):
            batch = tokenizer(list(texts[start : start + settings.batch_size]), return_tensors="pt", padding=True).to(device)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(settings.seed + index)
                ids = model.generate(**batch, **sampling, pad_token_id=tokenizer.pad_token_id)
            out += tokenizer.batch_decode(ids[:, batch.input_ids.shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side, tokenizer.pad_token = side, pad
    return out


def measure_bias(model: nn.Module, tokenizer, prompts: pd.DataFrame, scorer: ToxicityScorer,
                 settings: Generation = Generation(), subgroup: str = "bucket") -> dict[str, float]:
    """Eq. 1 for every axis of ``prompts``, from one generation pass."""
    continuations = generate_continuations(model, tokenizer, prompts.text.tolist(), settings)
    return bias_by_axis(prompts, make_scorer(scorer).score(continuations), subgroup)


def token_ids(tokenizer, text: str | Sequence[str]) -> torch.Tensor:
    """The evaluation text tokenized once (documents joined by blank lines), 1-D."""
    return tokenizer(join_documents(text), return_tensors="pt", verbose=False).input_ids[0]


@dataclass
class Evaluator:
    """Perplexity and per-axis bias of the model as it stands (gates included)."""

    model: nn.Module
    tokenizer: object
    prompts: pd.DataFrame
    ppl_ids: torch.Tensor
    scorer: ToxicityScorer
    generation: Generation = Generation()
    seqlen: int = 128
    ppl_batch_size: int = 4
    subgroup: str = "bucket"

    def __call__(self) -> dict:
        was_training = self.model.training
        self.model.eval()
        try:
            ppl = perplexity(self.model, self.ppl_ids, seqlen=self.seqlen, batch_size=self.ppl_batch_size)
            bias = measure_bias(self.model, self.tokenizer, self.prompts, self.scorer, self.generation, self.subgroup)
        finally:
            self.model.train(was_training)
        return {"perplexity": ppl, "bias": bias}

    def fingerprint(self) -> str:
        """What the scores depend on, hashed: a resumed run must not mix two settings."""
        parts = [self.prompts[["text", "axis", self.subgroup]].to_csv(index=False),
                 hashlib.sha256(self.ppl_ids.cpu().numpy().tobytes()).hexdigest(),
                 json.dumps(asdict(self.generation), sort_keys=True), str(self.seqlen), type(self.scorer).__name__]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# (2) Head scores, resumable
# --------------------------------------------------------------------------------------------


def score_heads(evaluate: Evaluator, path: str | Path, gates: HeadGates | None = None, progress: bool = True) -> pd.DataFrame:
    """``z_ppl`` and ``z_bias`` for every head gated off, plus the unpruned row ``(-1, -1)``.

    Rows already in ``path`` are kept and skipped; each new row is appended (and flushed) as soon
    as it is computed. Columns: ``layer, head, perplexity, bias:<axis>...``. A head's first complete
    row is its score: a line cut by a kill and rows repeated by another run are dropped on reading.
    """
    path = Path(path)
    gates = gates or HeadGates(evaluate.model)
    todo = [BASELINE] + [(l, h) for l in range(gates.values.shape[0]) for h in range(gates.values.shape[1])]
    axes = sorted(evaluate.prompts.axis.unique())
    columns = ["layer", "head", "perplexity", *(f"bias:{a}" for a in axes)]
    done = _resume(path, columns, evaluate.fingerprint())
    todo = [head for head in todo if head not in done]
    if progress and todo:
        from tqdm.auto import tqdm

        todo = tqdm(todo, desc="[fasp] scoring heads", leave=False)
    with gates, path.open("a", newline="") as handle:
        writer = csv.writer(handle)
        for layer, head in todo:
            with gates.off([] if (layer, head) == BASELINE else [(layer, head)]):
                result = evaluate()
            writer.writerow([layer, head, repr(result["perplexity"]), *(repr(result["bias"][a]) for a in axes)])
            handle.flush()
    return read_scores(path)


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
