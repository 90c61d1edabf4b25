"""FASP: fairness-aware structured pruning of attention heads in causal LMs.

The method in four steps, all in one process on one model:

1. **Score every head** with :class:`~fairprune.pruning.heads.HeadGates`: for head ``h`` gated
   off, ``z_ppl(h)`` is the perplexity on held-out text and ``z_bias(h, axis)`` the bias (eq. 1,
   :func:`fairprune.metrics.toxicity.axis_bias`) of continuations the model writes for identity
   prompts. Rows are appended to ``head_scores.csv`` as they are computed, so an interrupted run
   resumes where it stopped.
2. **Select** (:func:`select_fasp`): the top ``γ`` fraction of heads by perplexity importance
   (largest perplexity when removed) is protected; among the rest the ``⌊α·N_h⌋`` heads whose
   removal gives the lowest bias are pruned. Baselines (:func:`select_heads`) return head sets of
   the same size: magnitude, gradient (Michel et al. 2019), random, fairness-only (γ = 0) and
   performance-only.
3. **Choose γ** (:func:`search_gamma`) on the validation prompts when it is not given: the γ
   with the lowest bias among those whose perplexity is within ``tolerance`` (relative) of the
   best baseline's perplexity.
4. **Remove** the heads (:func:`~fairprune.pruning.heads.remove_heads`) and save the model.

:func:`run_fasp` does all of it and returns a report.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import pandas as pd
import torch
from torch import nn

from fairprune.data.prompts import check_prompts, holistic_prompts, split_prompts
from fairprune.data.text import join_documents
from fairprune.errors import UserError, suggest
from fairprune.metrics.language import perplexity
from fairprune.metrics.toxicity import ToxicityScorer, bias_by_axis, make_scorer
from fairprune.pruning import registry
from fairprune.pruning.heads import Head, HeadGates, head_weight_norms, remove_heads

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
    as it is computed. Columns: ``layer, head, perplexity, bias:<axis>...``.
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
        frame = pd.read_csv(path)
        if list(frame.columns) != columns or old.get("fingerprint") != fingerprint:
            raise UserError(f"{path} holds scores from other settings (prompts, text, generation or axes); "
                            "delete it or choose another output directory")
        return set(zip(frame.layer.astype(int), frame["head"].astype(int)))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        csv.writer(handle).writerow(columns)
    stamp.write_text(json.dumps({"fingerprint": fingerprint, "columns": columns}))
    return set()


def read_scores(path: str | Path) -> pd.DataFrame:
    """``head_scores.csv`` as a frame (one row per head; the unpruned row has layer = head = -1)."""
    try:
        return pd.read_csv(path)
    except FileNotFoundError:
        raise UserError(f"head scores not found: {path}; run the scoring step first") from None


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


# --------------------------------------------------------------------------------------------
# (3) Selection and baselines
# --------------------------------------------------------------------------------------------


@dataclass
class Selection:
    """Heads to remove and heads kept on purpose (FASP's protected set)."""

    removed: list[Head]
    protected: list[Head]


def counts(n_heads: int, gamma: float, alpha: float) -> tuple[int, int]:
    """(protected, removed) head counts for ``γ`` and ``α``; checks that they fit together."""
    for name, value in (("gamma", gamma), ("alpha", alpha)):
        if not 0.0 <= value <= 1.0:
            raise UserError(f"{name} must lie in [0, 1], got {value}")
    # The small epsilon keeps 0.3 × 10 from flooring to 2.
    protect, remove = math.floor(gamma * n_heads + 1e-9), math.floor(alpha * n_heads + 1e-9)
    if remove > n_heads - protect:
        raise UserError(f"alpha {alpha} removes {remove} of {n_heads} heads but gamma {gamma} leaves only "
                        f"{n_heads - protect} unprotected; lower alpha or gamma (alpha + gamma <= 1)")
    return protect, remove


def select_fasp(scores: pd.DataFrame, gamma: float, alpha: float, axes: Sequence[str]) -> Selection:
    """Protect the top γ by perplexity importance; prune the ⌊α·N_h⌋ lowest-bias-when-removed others."""
    heads = _heads_only(scores).assign(objective=lambda f: _bias(f, axes))
    protect, remove = counts(len(heads), gamma, alpha)
    # Stable sorts: ties fall back to (layer, head) order, so the choice is deterministic.
    by_importance = heads.sort_values("perplexity", ascending=False, kind="stable")
    protected = by_importance.iloc[:protect]
    candidates = by_importance.iloc[protect:].sort_values(["objective", "layer", "head"], kind="stable")
    return Selection(removed=_pairs(candidates.iloc[:remove]), protected=_pairs(protected))


def _pairs(frame: pd.DataFrame) -> list[Head]:
    return sorted(zip(frame.layer.astype(int).tolist(), frame["head"].astype(int).tolist()))


def _lowest(values: torch.Tensor, k: int) -> list[Head]:
    """The ``k`` heads with the smallest value in a ``[layers, heads]`` tensor (ties: layer-major order)."""
    order = torch.argsort(values.flatten().double(), stable=True)[:k]
    n = values.shape[1]
    return sorted((int(i) // n, int(i) % n) for i in order)


def gradient_importance(model: nn.Module, ids: torch.Tensor, seqlen: int, batch_size: int = 4) -> torch.Tensor:
    """Michel et al. (2019): ``Σ_batches |∂loss/∂gate_h|`` over non-overlapping windows, ``[layers, heads]``."""
    windows = ids.numel() // seqlen
    if windows == 0:
        raise UserError(f"perplexity text has {ids.numel()} tokens, fewer than one window of {seqlen}")
    device = next(model.parameters()).device
    gates = HeadGates(model)
    frozen = {p: p.requires_grad for p in model.parameters()}
    was_training = model.training
    model.eval()
    importance = torch.zeros_like(gates.values)
    try:
        # Only the gates need gradients; the weights stay frozen.
        for p in frozen:
            p.requires_grad_(False)
        gates.values.requires_grad_(True)
        with gates, torch.enable_grad():
            for batch in ids[: windows * seqlen].view(windows, seqlen).split(batch_size):
                batch = batch.to(device)
                loss = model(input_ids=batch, labels=batch, use_cache=False).loss
                (grad,) = torch.autograd.grad(loss, gates.values)
                importance += grad.abs()
    finally:
        gates.values.requires_grad_(False)
        for p, flag in frozen.items():
            p.requires_grad_(flag)
        model.train(was_training)
    return importance


def select_heads(method: str, alpha: float, *, scores: pd.DataFrame | None = None, model: nn.Module | None = None,
                 axes: Sequence[str] = (), gamma: float = 0.0, ppl_ids: torch.Tensor | None = None,
                 seqlen: int = 128, batch_size: int = 4, seed: int = 0) -> Selection:
    """The heads ``method`` removes at ratio ``α`` (FASP or a baseline, the registry's ``heads`` kind)."""
    registry.get(method, "heads")
    if method in ("fasp", "fairness", "performance") and scores is None:
        raise UserError(f"method {method!r} needs head scores; run score_heads first")
    if method == "fasp":
        return select_fasp(scores, gamma, alpha, axes)
    if method == "fairness":
        return select_fasp(scores, 0.0, alpha, axes)
    if scores is not None:
        n_layers, n_heads = int(_heads_only(scores).layer.max()) + 1, int(_heads_only(scores)["head"].max()) + 1
    else:
        gates = HeadGates(model)
        n_layers, n_heads = gates.values.shape
    _, k = counts(n_layers * n_heads, 0.0, alpha)
    if method == "performance":
        heads = _heads_only(scores)
        return Selection(_lowest(torch.tensor(heads.perplexity.to_numpy()).view(n_layers, n_heads), k), [])
    if method == "magnitude":
        return Selection(_lowest(head_weight_norms(model), k), [])
    if method == "gradient":
        if ppl_ids is None:
            raise UserError("the gradient baseline needs perplexity text (ppl_ids)")
        return Selection(_lowest(gradient_importance(model, ppl_ids, seqlen, batch_size), k), [])
    order = torch.randperm(n_layers * n_heads, generator=torch.Generator().manual_seed(seed))
    return Selection(sorted((int(i) // n_heads, int(i) % n_heads) for i in order[:k]), [])


def search_gamma(evaluate: Evaluator, scores: pd.DataFrame, alpha: float, axes: Sequence[str],
                 gammas: Sequence[float] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
                 baselines: Sequence[str] = ("performance", "magnitude", "gradient", "random"),
                 tolerance: float = 0.05, seed: int = 0, gates: HeadGates | None = None) -> dict:
    """Pick γ* on the validation prompts by the paper's rule.

    Every baseline and every feasible γ (``⌊α·N⌋ ≤ N − ⌊γ·N⌋``) is applied with gates and
    measured. γ* has the lowest bias (summed over ``axes``) among the γ whose perplexity is at most
    ``(1 + tolerance) ×`` the best baseline's; if none qualifies, the γ with the lowest perplexity.
    """
    gates = gates or HeadGates(evaluate.model)
    n = gates.values.numel()
    trials = []
    with gates:
        for method in baselines:
            chosen = select_heads(method, alpha, scores=scores, model=evaluate.model, ppl_ids=evaluate.ppl_ids,
                                  seqlen=evaluate.seqlen, batch_size=evaluate.ppl_batch_size, seed=seed)
            trials.append({"method": method, "gamma": None, **_trial(evaluate, gates, chosen.removed, axes)})
        for gamma in gammas:
            if math.floor(alpha * n + 1e-9) > n - math.floor(gamma * n + 1e-9):
                continue
            chosen = select_fasp(scores, gamma, alpha, axes)
            trials.append({"method": "fasp", "gamma": gamma, **_trial(evaluate, gates, chosen.removed, axes)})
    fasp = [t for t in trials if t["method"] == "fasp"]
    if not fasp:
        raise UserError(f"no gamma in {list(gammas)} leaves room to remove alpha={alpha} of the heads; lower alpha")
    best_baseline = min((t["perplexity"] for t in trials if t["method"] != "fasp"), default=math.inf)
    within = [t for t in fasp if t["perplexity"] <= best_baseline * (1 + tolerance)]
    pick = min(within, key=lambda t: t["objective"]) if within else min(fasp, key=lambda t: t["perplexity"])
    return {"gamma": pick["gamma"], "best_baseline_perplexity": best_baseline, "tolerance": tolerance,
            "within_tolerance": bool(within), "trials": trials}


def _trial(evaluate: Evaluator, gates: HeadGates, removed: list[Head], axes: Sequence[str]) -> dict:
    gates.set(removed)
    result = evaluate()
    gates.clear()
    return {"perplexity": result["perplexity"], "bias": result["bias"],
            "objective": sum(result["bias"][a] for a in axes), "removed": len(removed)}


# --------------------------------------------------------------------------------------------
# (4) The whole run
# --------------------------------------------------------------------------------------------


def run_fasp(
    model: nn.Module,
    tokenizer,
    prompts: pd.DataFrame | None = None,
    ppl_text: str | Sequence[str] | None = None,
    method: str = "fasp",
    gamma: float | None = 0.3,
    alpha: float = 0.1,
    axis: str | Sequence[str] = "gender_and_sex",
    scorer: str | ToxicityScorer = "lexicon",
    output_dir: str | Path = "runs/fasp",
    *,
    eval_text: str | Sequence[str] | None = None,
    generation: Generation = Generation(),
    seqlen: int = 128,
    ppl_batch_size: int = 4,
    validation: float = 0.2,
    subgroup: str = "bucket",
    gammas: Sequence[float] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
    tolerance: float = 0.05,
    seed: int = 0,
    loadable: bool = True,
    plots: bool = True,
    progress: bool = True,
) -> dict:
    """Score, select, remove and save; return the report.

    ``prompts`` defaults to the bundled HolisticBias-format set, ``ppl_text`` to the validation
    part of the bundled corpus; ``eval_text`` (default ``ppl_text``) gives the reported
    perplexity. Heads are scored and γ is searched (when ``gamma`` is None) on the validation
    prompts; the report measures the test prompts. ``axis`` is one axis, several (their biases are
    summed) or ``"all"``. Writes ``head_scores.csv``, ``model/`` (save_pretrained, with the
    tokenizer) and, with ``plots``, ``heads_heatmap.png`` and ``axis_correlation.png``.
    """
    start = time.perf_counter()
    seconds: dict[str, float] = {}
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = check_prompts(holistic_prompts() if prompts is None else prompts)
    if subgroup not in prompts.columns:
        raise UserError(f"subgroup column {subgroup!r} is not in the prompts; use bucket or descriptor")
    axes = sorted(prompts.axis.unique()) if axis == "all" else [axis] if isinstance(axis, str) else list(axis)
    val_prompts, test_prompts = split_prompts(prompts, validation, seed, stratify=subgroup)
    if ppl_text is None:
        from fairprune.data.text import lm_corpus

        ppl_text = lm_corpus().validation
    scorer = make_scorer(scorer)
    common = dict(model=model, tokenizer=tokenizer, scorer=scorer, generation=generation, seqlen=seqlen,
                  ppl_batch_size=ppl_batch_size, subgroup=subgroup)
    on_val = Evaluator(prompts=val_prompts, ppl_ids=token_ids(tokenizer, ppl_text), **common)
    on_test = Evaluator(prompts=test_prompts, ppl_ids=token_ids(tokenizer, eval_text or ppl_text), **common)
    for a in axes:
        if a not in set(val_prompts.axis):
            raise UserError(f"no prompts for axis {a!r}{suggest(a, val_prompts.axis.unique())}; "
                            f"axes present: {', '.join(sorted(val_prompts.axis.unique()))}")
    registry.get(method, "heads")
    # Fail on impossible ratios before the expensive part.
    counts(HeadGates(model).values.numel(), gamma if method == "fasp" and gamma is not None else 0.0, alpha)

    tick = time.perf_counter()
    reference = on_test()
    seconds["reference"] = time.perf_counter() - tick

    gates, scores, search = HeadGates(model), None, None
    if method in ("fasp", "fairness", "performance"):
        tick = time.perf_counter()
        scores = score_heads(on_val, out / "head_scores.csv", gates, progress)
        seconds["scoring"] = time.perf_counter() - tick
    tick = time.perf_counter()
    if method == "fasp" and gamma is None:
        search = search_gamma(on_val, scores, alpha, axes, gammas, tolerance=tolerance, seed=seed, gates=gates)
        gamma = search["gamma"]
    selection = select_heads(method, alpha, scores=scores, model=model, axes=axes, gamma=gamma or 0.0,
                             ppl_ids=on_val.ppl_ids, seqlen=seqlen, batch_size=ppl_batch_size, seed=seed)
    seconds["selection"] = time.perf_counter() - tick

    tick = time.perf_counter()
    removal = remove_heads(model, selection.removed, loadable=loadable)
    seconds["removal"] = time.perf_counter() - tick
    tick = time.perf_counter()
    pruned = on_test()
    seconds["evaluation"] = time.perf_counter() - tick
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    if plots and scores is not None:
        plot_head_heatmap(scores, axes, selection.protected, selection.removed, out / "heads_heatmap.png")
        if len(axes) > 1 or prompts.axis.nunique() > 1:
            plot_axis_correlation(scores, out / "axis_correlation.png")
    seconds["total"] = time.perf_counter() - start
    return {
        "method": method, "model": getattr(model.config, "name_or_path", "") or model.config.model_type,
        "gamma": gamma, "alpha": alpha, "axes": axes, "heads_total": gates.values.numel(),
        "heads_removed": [list(h) for h in selection.removed], "protected": [list(h) for h in selection.protected],
        "removal": removal.as_dict(),
        "metrics": {"perplexity": pruned["perplexity"]}, "fairness": {"bias": pruned["bias"]},
        "reference": {"method": "dense", "metrics": {"perplexity": reference["perplexity"]},
                      "fairness": {"bias": reference["bias"]}},
        "gamma_search": search, "seconds": seconds,
    }


# --------------------------------------------------------------------------------------------
# (5) Plots
# --------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_head_heatmap(scores: pd.DataFrame, axes: Sequence[str], protected: Sequence[Head] = (),
                      removed: Sequence[Head] = (), path: str | Path = "heads_heatmap.png") -> Path:
    """Layer × head map of each head's bias impact (bias with the head removed − unpruned bias).

    Blue heads lower the bias when removed, red ones raise it; ``P`` marks protected heads and
    ``×`` removed ones.
    """
    from matplotlib.colors import TwoSlopeNorm

    plt = _pyplot()
    heads = _heads_only(scores)
    base = scores[(scores.layer == BASELINE[0]) & (scores["head"] == BASELINE[1])]
    impact = _bias(heads, axes) - (float(_bias(base, axes).iloc[0]) if len(base) else 0.0)
    layers, n = int(heads.layer.max()) + 1, int(heads["head"].max()) + 1
    grid = torch.tensor(impact.to_numpy()).view(layers, n).numpy()
    span = max(float(abs(grid).max()), 1e-12)
    fig, ax = plt.subplots(figsize=(1 + 0.45 * n, 1 + 0.4 * layers))
    image = ax.imshow(grid, cmap="RdBu_r", norm=TwoSlopeNorm(0.0, -span, span), aspect="auto")
    for marks, symbol in ((protected, "P"), (removed, "×")):
        for layer, head in marks:
            ax.text(head, layer, symbol, ha="center", va="center", fontsize=8)
    ax.set(xlabel="head", ylabel="layer", title=f"bias impact of removing each head ({' + '.join(axes)})")
    fig.colorbar(image, ax=ax, label="Δ bias")
    return _save(fig, path)


def plot_axis_correlation(scores: pd.DataFrame, path: str | Path = "axis_correlation.png") -> Path:
    """Pearson correlation of the heads' bias scores between axes."""
    plt = _pyplot()
    columns = [c for c in scores.columns if c.startswith("bias:")]
    corr = _heads_only(scores)[columns].corr(method="pearson")
    names = [c.split(":", 1)[1] for c in columns]
    fig, ax = plt.subplots(figsize=(1.5 + 1.1 * len(names), 1 + 1.0 * len(names)))
    image = ax.imshow(corr.to_numpy(), cmap="coolwarm", vmin=-1, vmax=1)
    for i in range(len(names)):
        for j in range(len(names)):
            ax.text(j, i, f"{corr.iat[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
    ax.set_yticks(range(len(names)), names)
    ax.set_title("head bias scores: Pearson r between axes")
    fig.colorbar(image, ax=ax)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path
