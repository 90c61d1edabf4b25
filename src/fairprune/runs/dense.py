"""The dense model's figures, measured once: ``compare`` measures the dense model once for every
method, and the single LM commands reuse a measurement an earlier run made, from the project cache
(``<cache>/dense/<key>.json``, :func:`fairprune.hub.cache_dir`), unless ``--dense_cache false``.

The key is everything the figures depend on, each as a digest of what is actually measured:

- ``model``: SHA-256 of the weights' bytes (every tensor of the state dict, by name, with its dtype
  and shape) and of the model config. The weights, not the folder, because the figures are a
  function of the weights: a hub name or a folder can be rewritten under the same name (and a
  copied folder gets new file times while holding the same model), so sizes and modification
  times would both miss changes and miss hits. Hashing costs one pass over the weights, as much
  memory traffic as a single forward pass, small next to a perplexity measurement.
- ``eval_ids``: the evaluation text as token ids, after the ``--eval_tokens`` cap; this covers the
  text, the tokenizer and the cap at once.
- ``pairs``: the evaluation half of the stereotype pairs as the token ids the score reads, and
  each pair's direction (the score's stereo / antistereo parts); this covers the pair file, the
  seeded split (``--seed``) and the tokenizer.
- ``window``, ``eval_tokens``, the device type and the weights' dtype, plus a format version and
  fairprune's version (a new version of the measuring code measures again).

Under ``torchrun`` every rank computes the key, rank 0 alone reads and writes the cache, and rank
0's answer (hit or miss, and the figures on a hit) reaches every rank through one all-reduce, so
all ranks either skip the measurement together or measure together.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import fairprune
from fairprune import distributed
from fairprune.causal.blocks import as_blocks
from fairprune.data.pairs import direction
from fairprune.data.text import bos_of, encode_sentence
from fairprune.hub import cache_dir
from fairprune.metrics.language import STEREOTYPE_KEYS, LMItems, measure_lm_items
from fairprune.reporting.environment import environment
from fairprune.reporting.report import write_json

CACHE_VERSION = 3  # 2: the stereotype score is the CrowS-Pairs metric with its parts; 3: per-item outcomes kept
METRICS = ("perplexity", *STEREOTYPE_KEYS)  # what measure_lm returns, in the order the ranks exchange them
OPTIONAL = {"stereotype_score_stereo", "stereotype_score_antistereo"}  # NaN (null on disk): no pair of that direction decided


@dataclass
class DenseFigures:
    """The dense model's metrics, whether they came from the cache, the seconds spent getting
    them (measuring, or computing the key and reading the cache) and the per-item outcomes they
    are made of (for intervals and paired comparisons; on rank 0 alone after a cache hit under
    ``torchrun``, where only rank 0 writes reports)."""

    metrics: dict[str, float]
    from_cache: bool
    seconds: float
    items: LMItems | None = None
    tasks: Any = None  # the dense model's lm-eval results (fairprune.metrics.harness.TaskResults), with --tasks

    def all_metrics(self) -> dict[str, float]:
        """Perplexity and the stereotype score, and the headline task figures when tasks ran."""
        if self.tasks is None:
            return dict(self.metrics)
        from fairprune.metrics.harness import headline

        return {**self.metrics, **headline(self.tasks.figures)}


def weights_digest(model) -> str:
    """SHA-256 of the model's class, config and every state-dict tensor
    (:meth:`fairprune.causal.blocks.BlockModel.digest`). ``model``: an ``nn.Module`` or a block
    model, which keeps it once computed."""
    return as_blocks(model).digest()


def _ids_digest(rows: list[list[int]] | torch.Tensor) -> str:
    if isinstance(rows, torch.Tensor):
        return hashlib.sha256(rows.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def cache_key(model, tokenizer, eval_ids: torch.Tensor, eval_pairs: list, window: int,
              eval_tokens: int | None, device: torch.device | str) -> dict[str, Any]:
    """What the dense figures depend on (see the module docstring), as a JSON-able dict."""
    pair_ids = [encode_sentence(tokenizer, sentence) for pair in eval_pairs for sentence in pair]
    return {
        "version": CACHE_VERSION, "fairprune": fairprune.__version__,
        "model": weights_digest(model), "eval_ids": _ids_digest(eval_ids),
        "pairs": _ids_digest([*pair_ids, [int(direction(pair) == "antistereo") for pair in eval_pairs]]),
        "window": int(window), "eval_tokens": eval_tokens,
        "device": torch.device(device).type, "dtype": str(as_blocks(model).dtype),
        "libraries": library_versions(), "bos": bos_of(tokenizer),
    }


def library_versions() -> dict[str, str | None]:
    """The versions the figures depend on (Python, torch, transformers, lm-eval, numpy, ...): a
    cached figure measured under other libraries is measured again."""
    from fairprune.reporting.environment import versions

    return dict(versions())


def cache_path(key: dict[str, Any], kind: str = "dense"):
    """The cache file of ``key`` (``kind``: the cache's folder, ``dense`` or ``tasks``)."""
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir() / kind / f"{name}.json"


def _read(key: dict[str, Any]) -> tuple[dict[str, float], LMItems] | None:
    """The cached figures and items of ``key``, or None (no file, another key, a damaged file)."""
    path = cache_path(key)
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    metrics = stored.get("metrics") if isinstance(stored, dict) else None
    if stored.get("key") != key or not isinstance(metrics, dict):
        return None
    values = [metrics.get(name) for name in METRICS]
    if not all((v is None and name in OPTIONAL) or (isinstance(v, (int, float)) and math.isfinite(v))
               for name, v in zip(METRICS, values)):
        return None
    items = LMItems.from_json(stored.get("items"))
    if items is None:
        return None
    return {name: math.nan if v is None else v for name, v in zip(METRICS, values)}, items


def _agree(found: dict[str, float] | None) -> dict[str, float] | None:
    """Rank 0's cache answer on every rank (unchanged in one process)."""
    if distributed.world()[1] == 1:
        return found
    shared = torch.zeros(1 + len(METRICS), dtype=torch.float64)
    if distributed.is_main() and found is not None:
        shared[0] = 1.0
        shared[1:] = torch.tensor([found[name] for name in METRICS], dtype=torch.float64)
    distributed.all_reduce_sum(shared)  # only rank 0 adds anything: every rank gets its values
    if shared[0] < 0.5:
        return None
    return {name: int(v) if name == "stereotype_pairs_neutral" else v for name, v in zip(METRICS, shared[1:].tolist())}


def dense_figures(model, tokenizer, eval_ids: torch.Tensor, eval_pairs: list, window: int,
                  device: torch.device | str, *, eval_tokens: int | None = None, use_cache: bool = True,
                  progress: bool = True) -> DenseFigures:
    """Perplexity and stereotype score of the (dense) ``model`` (an ``nn.Module`` or a block
    model, in memory or streamed): from the cache when an earlier run measured the same weights
    on the same texts with the same settings, else measured (and then cached by rank 0).
    ``use_cache`` False measures without reading or writing the cache."""
    blocks = as_blocks(model)
    key = cache_key(blocks, tokenizer, eval_ids, eval_pairs, window, eval_tokens, device) if use_cache else None
    how = ", streamed" if blocks.reads_files else ""
    return cached_figures(key, lambda: measure_lm_items(blocks, tokenizer, eval_ids, eval_pairs, window, device, progress=progress),
                          progress, how=how)


def cached_figures(key: dict[str, Any] | None, measure: Callable[[], tuple[dict[str, float], LMItems]],
                   progress: bool = True, how: str = "") -> DenseFigures:
    """The figures of ``key`` from the cache (rank 0 reads it, every rank gets its answer), else
    ``measure()`` (collective under torchrun), then cached by rank 0; ``key`` None: measured, not
    cached. ``how``: what the measuring line adds (``", streamed"``)."""
    start = time.perf_counter()
    talk = progress and distributed.is_main()
    if key is not None:
        read = _read(key) if distributed.is_main() else None
        found = _agree(None if read is None else read[0])
        if found is not None:
            if talk:
                print(f"[dense] figures from the cache ({cache_path(key)})", flush=True)
            return DenseFigures(found, True, time.perf_counter() - start, None if read is None else read[1])
    if talk:
        print(f"[dense] measuring the dense model{how} ...", flush=True)
    metrics, items = measure()
    seconds = time.perf_counter() - start
    if key is not None and distributed.is_main():
        try:
            write_json(cache_path(key), {"key": key, "metrics": metrics, "seconds": seconds, "items": items.as_json()})
        except OSError as err:  # a read-only cache costs the next run a measurement, not this run its result
            warnings.warn(f"could not write the dense-figures cache {cache_path(key)}: {err}", stacklevel=2)
    return DenseFigures(metrics, False, seconds, items)


# -- what the LM commands print and write about their figures ----------------------------------------
def ci_text(report: dict[str, Any], figure: str, spec: str) -> str:
    """`` [lo, hi]``: the 95 % interval of a report's figure, when it has one."""
    interval = (report.get("ci") or {}).get(figure)
    return "" if not interval else f" [{interval[0]:{spec}}, {interval[1]:{spec}}]"


def pruned_line(method: str, report: dict[str, Any], output: Any) -> str:
    """The line a pruning run prints: perplexity and stereotype score before → after, with the
    pruned model's intervals, the sparsity and where the run was written."""
    before, after = report["reference"]["metrics"], report["metrics"]
    cached = " (dense figures from the cache)" if report["reference"]["from_cache"] else ""
    quant = report.get("quantization")
    if quant:
        method = f"{method} + {quant['scheme']}"
        cached += f"; measured on the {quant['format']} {quant['bits']}-bit folder as loaded back"
    return (f"[{method}] perplexity {before['perplexity']:.2f} → {after['perplexity']:.2f}{ci_text(report, 'perplexity', '.2f')}, "
            f"stereotype score {before['stereotype_score']:.3f} → {after['stereotype_score']:.3f}"
            f"{ci_text(report, 'stereotype_score', '.3f')}, sparsity {report['achieved_sparsity']:.4f} "
            f"(dense zeros {report['sparsity']['dense_zero_fraction']:.4f}){cached}; written to {output}")


def finish_evaluation(report: dict[str, Any], figures: DenseFigures, output: Any, model: str) -> dict[str, Any]:
    """An ``evaluate`` run's end (main rank): ``eval_items.npz`` and ``report.json`` into ``output``
    when given, and its line printed."""
    from pathlib import Path

    if output:
        Path(output).mkdir(parents=True, exist_ok=True)
        if figures.items is not None:
            figures.items.save(output)
        if figures.tasks is not None:
            figures.tasks.items.save(output)
        report["environment"] = environment()
        write_json(Path(output) / "report.json", report)
    cached = " (from the cache)" if figures.from_cache else ""
    print(f"[evaluate] {model}: perplexity {report['metrics']['perplexity']:.2f}{ci_text(report, 'perplexity', '.2f')}, "
          f"stereotype score {report['metrics']['stereotype_score']:.3f}{ci_text(report, 'stereotype_score', '.3f')}, "
          f"sparsity {report['achieved_sparsity']:.4f}{cached}")
    from fairprune.reporting.terminal import task_lines

    for line in task_lines(report):
        print(line)
    return report
