"""What a pruned LM run leaves on disk, in one place for the commands and the callbacks: the model
folder (``save_pretrained``, so ``from_pretrained(output)`` loads it), its config, per-layer
sparsity, plots and, written last, ``report.json`` (which always says how many CPU threads torch ran
with, ``threads``, and the library versions and machine, ``environment``).

A run is written beside its folder and swapped in whole (:func:`fairprune.storage.folders.replace_folder`):
an interrupted save or a full disk leaves the previous run as it was, never a mix of two runs. A
model that is not finite is never saved.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import yaml

from fairprune.causal.blocks import Resident
from fairprune.hub.checks import check_result
from fairprune.reporting.card_lm import HeadCard, LMCard
from fairprune.reporting.environment import environment
from fairprune.reporting.model_card import Card, write_model_card
from fairprune.reporting.plots import plot_axis_correlation, plot_head_heatmap
from fairprune.reporting.report import write_json
from fairprune.storage.atomic import write_csv, write_text
from fairprune.storage.folders import replace_folder

# FASP's scoring journal: an interrupted run resumes from it, so it stays in the folder through a swap
# (a run of another method replaces it with the rest).
JOURNAL = ("head_scores.csv", "head_scores.json")
# Every file an LM run of any method writes (a folder's previous run leaves as a whole, also one
# written before runs listed their files): the model and tokenizer (``save_pretrained``), the tables,
# the plots, the journal and the report.
RUN_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin",
             "pytorch_model*.bin.index.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja", "vocab.txt",
             "sparsity.csv", "config.yaml", "report.json", "heads_heatmap.png", "axis_correlation.png", "README.md",
             "eval_items.npz", "task_items.json", *JOURNAL)


def write_run(output: str | os.PathLike, model, tokenizer, report: dict[str, Any], config: dict[str, Any],
              layers: dict[str, float] | None = None, save_format: str | None = None, nm: tuple[int, int] | None = None,
              items: tuple[Any, Any] = (None, None), heads: Any = None) -> Path:
    """Write the run into a staging folder beside ``output`` and swap it in whole. ``save_format``
    (dense or compressed) adds the report's ``weights`` block; None: ``save_pretrained`` alone.
    ``heads``: a head-pruning run's result (a ``FaspResult``): its plots are written, its scoring
    journal stays in the folder and the card is a head run's."""
    check_result(model, output, report.get("method"))

    def write(out: Path) -> None:
        if save_format is None:
            model.save_pretrained(out)
        else:  # the bytes are measured in the staged folder, before the report is written
            from fairprune.hub.compressed import save_weights

            report["weights"] = save_weights(model, out, save_format, nm,
                                             Resident(model).layers() if save_format == "compressed" else None)
        _beside_model(out, tokenizer, report, config, (layers, *items), heads)

    return replace_folder(output, write, keep=() if heads is None else JOURNAL, owned=RUN_FILES)


def _beside_model(out: Path, tokenizer, report: dict[str, Any], config: dict[str, Any], tables: tuple,
                  heads: Any = None) -> None:
    """Everything a run's staging folder ``out`` holds beside the model's weights: a head run's
    plots, the tokenizer and the run files (``tables``: per-layer sparsity, eval and task items)."""
    report.setdefault("threads", torch.get_num_threads())
    if heads is not None:
        _head_plots(out, heads)
    tokenizer.save_pretrained(out)
    write_run_files(out, report, config, *tables, card=LMCard if heads is None else HeadCard)


def write_run_files(out: Path, report: dict[str, Any], config: dict[str, Any], layers: dict[str, float] | None = None,
                    items: Any = None, task_items: Any = None, card: type[Card] = LMCard) -> None:
    """What every LM run writes beside its model, into its staging folder ``out``: the per-item
    outcomes (``eval_items.npz``, ``task_items.json``, when given), ``sparsity.csv`` (when
    given), ``config.yaml``, the model card (``README.md``) and, last, ``report.json``."""
    import pandas as pd  # here, not at the top: a streamed run holds it only once its work is done

    for found in (items, task_items):
        if found is not None:
            found.save(out)
    if layers is not None:
        write_csv(out / "sparsity.csv", pd.DataFrame([{"layer": k, "sparsity": v} for k, v in layers.items()]),
                  index=False)
    write_text(out / "config.yaml", yaml.safe_dump(config, sort_keys=False))
    report["environment"] = environment()
    write_model_card(out, report, config, card=card)  # README.md: the Hub's model card, the run's figures in it
    write_json(out / "report.json", report)


def write_head_run(output: str | os.PathLike, model, tokenizer, result: Any, config: dict[str, Any],
                   task_items: Any = None) -> Path:
    """A head-pruning run's folder: the plots of ``result`` (a ``FaspResult``), ``task_items.json``
    when ``--tasks`` ran, then the model and its report; the scoring journal (``head_scores.csv``)
    stays in the folder."""
    return write_run(output, model, tokenizer, result.report, config, items=(None, task_items), heads=result)


def write_head_files(out: Path, tokenizer, result: Any, config: dict[str, Any], task_items: Any = None) -> None:
    """What :func:`write_head_run` writes beside the model, into a staging folder ``out`` whose
    weights are already in (a streamed model's, written block by block as its heads went)."""
    _beside_model(out, tokenizer, result.report, config, (None, None, task_items), result)


def _head_plots(out: Path, result: Any) -> None:
    """The plots of a ``FaspResult``: ``impact``, ``axes``, ``protected``, ``removed``, ``bias_by_axis``."""
    if result.impact is not None:
        plot_head_heatmap(result.impact, result.axes, result.protected, result.removed, out / "heads_heatmap.png")
    if result.bias_by_axis is not None:
        plot_axis_correlation(result.bias_by_axis, out / "axis_correlation.png")
