"""What a pruned LM run leaves on disk, in one place for the commands and the callbacks: the model
folder (``save_pretrained``, so ``from_pretrained(output)`` loads it), its config, per-layer
sparsity, plots and, written last, ``report.json`` (which always says how many CPU threads torch ran
with: ``threads``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import yaml

from fairprune.reporting.plots import plot_axis_correlation, plot_head_heatmap
from fairprune.reporting.report import write_json
from fairprune.storage.atomic import write_csv, write_text


def write_lm_run(output: str | os.PathLike, model, tokenizer, report: dict[str, Any], config: dict[str, Any],
                 layers: dict[str, float] | None = None) -> Path:
    """A pruned LM's folder: the transformers model and tokenizer (``save_pretrained``: the
    folder itself loads with ``from_pretrained``), ``sparsity.csv`` (per layer, when given),
    ``config.yaml`` and, last, ``report.json`` (with ``threads`` added when the caller left it out)."""
    report.setdefault("threads", torch.get_num_threads())
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if layers is not None:
        write_csv(out / "sparsity.csv", pd.DataFrame([{"layer": k, "sparsity": v} for k, v in layers.items()]), index=False)
    write_text(out / "config.yaml", yaml.safe_dump(config, sort_keys=False))
    write_json(out / "report.json", report)
    return out


def write_head_run(output: str | os.PathLike, model, tokenizer, result: Any, config: dict[str, Any]) -> Path:
    """A head-pruning run's folder: the plots of ``result`` (a ``FaspResult``: ``impact``, ``axes``,
    ``protected``, ``removed``, ``bias_by_axis``), then the model and its report."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    if result.impact is not None:
        plot_head_heatmap(result.impact, result.axes, result.protected, result.removed, out / "heads_heatmap.png")
    if result.bias_by_axis is not None:
        plot_axis_correlation(result.bias_by_axis, out / "axis_correlation.png")
    return write_lm_run(out, model, tokenizer, result.report, config)
