"""A run folder's model card: ``README.md`` in the Hugging Face form, so a model shared on the Hub
carries its fairness audit.

The front matter is what the Hub reads (``library_name``, ``tags``, ``base_model`` and a
``model-index`` with the run's headline figures), built with :class:`huggingface_hub.ModelCardData`
and :class:`huggingface_hub.EvalResult` (offline: nothing is fetched). The body says what the model
is, what it was measured against, how each group fared and how to load it.

The caller names the kind of report, by the writer it passes: :class:`Card` writes what every card
holds and each kind's subclass the rest (:class:`~fairprune.reporting.card_classifier.ClassifierCard`,
:class:`~fairprune.reporting.card_lm.LMCard`, :class:`~fairprune.reporting.card_lm.HeadCard`, one per
report shape of :mod:`fairprune.reporting.records`); nothing here guesses a kind from a report's keys.

Everything comes from the run's report (and its config) and is read tolerantly, since reports of
older runs and of other commands differ: a field that is missing is left out, never guessed. Where
a report gives an interval beside a value (``<name>_ci95`` / ``<name>_ci``, a ``ci95`` / ``ci``
mapping beside the values, or the value as ``{"value": ..., "ci95": [low, high]}``) the body shows
it. Names from the data (groups, methods, axes) are escaped in tables and text.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from fairprune.reporting.card_values import (
    _flatten,
    _fmt,
    _mapping,
    _number,
    _plain,
    _table,
    _text,
)
from fairprune.reporting.card_weights import weights_sections
from fairprune.reporting.environment import card_section
from fairprune.storage.atomic import write_text

#: The card's file name in a run folder (the name the Hub renders).
CARD = "README.md"

_NOT_PRUNED = {None, "dense", "evaluate"}


def write_model_card(folder: str | os.PathLike, report: Mapping[str, Any], config: Mapping[str, Any] | None = None, *,
                     card: type[Card], checkpoint: str | os.PathLike | None = None, model_class: str | None = None) -> Path:
    """Write ``folder/README.md`` for the run of ``report`` (``config``: the settings it ran with),
    by the writer of its kind (``card``: :class:`ClassifierCard`, :class:`LMCard`, :class:`HeadCard`).

    ``checkpoint`` (with ``model_class``, ``module.Class``): the Lightning checkpoint that holds the
    model (vision runs); without it the folder itself is the model (``from_pretrained(folder)``)."""
    path = Path(folder) / CARD
    write_text(path, model_card(report, config, card=card, checkpoint=checkpoint, model_class=model_class, folder=folder))
    return path


def model_card(report: Mapping[str, Any], config: Mapping[str, Any] | None = None, *, card: type[Card],
               checkpoint: str | os.PathLike | None = None, model_class: str | None = None,
               folder: str | os.PathLike | None = None) -> str:
    """The text of the card (see :func:`write_model_card`)."""
    return card(report, config, checkpoint=checkpoint, model_class=model_class, folder=folder).text()


class Card:
    """What every model card holds, in its order; a subclass per kind of report
    (:mod:`fairprune.reporting.records`) writes the parts that differ."""

    what = "model"  # what the summary calls the model
    tags: tuple[str, ...] = ()  # the kind's own tags
    folder_is_model = True  # without a checkpoint the run folder loads with transformers
    reference_role = ""  # what the reference is beside the column of figures

    def __init__(self, report: Mapping[str, Any], config: Mapping[str, Any] | None = None, *,
                 checkpoint: str | os.PathLike | None = None, model_class: str | None = None,
                 folder: str | os.PathLike | None = None) -> None:
        self.report = report if isinstance(report, Mapping) else {}
        self.config = config if isinstance(config, Mapping) else {}
        self.checkpoint, self.model_class, self.folder = checkpoint, model_class, folder
        self.method = self.report.get("method") if isinstance(self.report.get("method"), str) else None

    def text(self) -> str:
        report, config, method = self.report, self.config, self.method
        name = self.model_name()
        base = next((str(c) for c in self.base_candidates() if isinstance(c, (str, os.PathLike)) and str(c)), None)
        tags = ["fairprune", "fairness"] + ([] if method in _NOT_PRUNED else [method, "pruned"]) + list(self.tags)
        quantization = _mapping(report.get("quantization"))
        if quantization:
            tags += ["compressed-tensors", f"{_text(str(quantization.get('bits', '')))}-bit"]
        results = self.results()
        library = "transformers" if self.checkpoint is None and self.folder_is_model else "pytorch"
        data = ModelCardData(library_name=library, pipeline_tag=self.pipeline_tag(), tags=tags, base_model=base,
                             model_name=name, eval_results=results or None)
        body = [f"# {_text(name)}", "", self.summary(base), ""]
        body += self.reference()
        body += self.body()
        warnings = report.get("warnings") if isinstance(report.get("warnings"), list) else []
        if warnings:
            body += ["## Warnings", "", *(f"- {_text(w)}" for w in warnings), ""]
        body += _settings(report, config)
        body += card_section(report.get("environment"))
        body += self.loading()
        body += weights_sections(report)
        body += ["Written by fairprune from the run's `report.json`, which holds every figure above at full precision."]
        return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n"))

    # -- what the run is ---------------------------------------------------------------------------
    def pipeline_tag(self) -> str:
        return "text-generation"

    def base_candidates(self) -> list[Any]:
        """Where the base model may be named: the LM's ``--model`` (hub name or folder)."""
        return [self.report.get("model"), self.config.get("model")]

    def model_name(self) -> str:
        model = self.report.get("model")
        stem = (Path(model).name if isinstance(model, str) else "") or "model"
        return "-".join([stem, str(self.report.get("method") or "dense"), *self.name_parts()])

    def name_parts(self) -> list[str]:
        """The model name's pruning part: its N:M pattern or target sparsity."""
        report = self.report
        if report.get("nm"):
            return [str(report["nm"]).replace(":", "of")]
        target = _number(report.get("target_sparsity"))
        return [f"s{target:g}"] if target else []

    def summary(self, base: str | None) -> str:
        report, method = self.report, self.method
        if method in _NOT_PRUNED:
            text = f"A {self.what} ({_text(report.get('model') or 'model')}) trained or measured with fairprune, not pruned."
        else:
            text = self.pruned(method)
        if base:
            text += f" Base model: {_text(base)}."
        facts = [(label, report.get(key)) for key, label in (("dataset", "dataset"), ("task", "task"),
                                                            ("sensitive", "groups"), ("split", "measured on split"))]
        facts = [f"{label}: {_text(value)}" for label, value in facts if isinstance(value, str) and value]
        return text + (f" ({'; '.join(facts)})" if facts else "")

    def pruned(self, method: str | None) -> str:
        """The summary of a pruned model: its method and sparsity."""
        report = self.report
        target, achieved = _number(report.get("target_sparsity")), _number(report.get("achieved_sparsity"))
        pattern = f"{_text(report['nm'])} pattern, " if report.get("nm") else ""
        sparsity = (f" to {pattern}target sparsity {_fmt(target)}" if target is not None or pattern else "")
        if achieved is not None:
            pruned = ("prunable channels are removed" if report.get("granularity") == "channel"
                      else "prunable weights are zero")
            sparsity += f" (achieved: {_fmt(achieved)} of the {pruned})"
        return f"A {self.what} pruned by **{_text(method)}** (fairprune){sparsity}."

    def reference(self) -> list[str]:
        reference = self.report.get("reference")
        if not isinstance(reference, Mapping):
            return ["No reference was measured: the figures below stand alone.", ""]
        facts = [f"{_text(k)}: {_text(v)}" for k, v in reference.items()  # e.g. epochs, seed; not timings nor cache files
                 if k not in ("method", "cache") and isinstance(v, (str, int, bool))]
        label = _text(reference.get("method") or "dense")
        extra = f" ({', '.join(facts)})" if facts else ""
        return [f"Measured against the **{label}** model{extra}: its figures are the reference column below"
                f"{self.reference_role}.", ""]

    # -- the figures (each kind its own) -----------------------------------------------------------
    def results(self) -> list[EvalResult]:
        return []

    def body(self) -> list[str]:
        return []

    # -- loading -----------------------------------------------------------------------------------
    def loading(self) -> list[str]:
        if self.checkpoint is None:
            return self.folder_loading()
        path, where = Path(self.checkpoint), ""
        if self.folder is not None:
            try:
                path, where = path.resolve().relative_to(Path(self.folder).resolve()), " (its path relative to this folder)"
            except ValueError:
                pass
        module, _, cls = (self.model_class or "").rpartition(".")
        if not module:
            module, cls = "fairprune.models.vision", "VisionClassifier"
        channels = self.report.get("granularity") == "channel"
        masks = [] if self.method in _NOT_PRUNED else ["# the pruned architecture is part of the checkpoint: the model "
                                                       "loads with its channels removed" if channels else
                                                       "# the pruning masks are part of the checkpoint: the model loads pruned"]
        code = [f"from {module} import {cls}", "", *masks,
                f"model = {cls}.load_from_checkpoint({str(path)!r}, map_location=\"cpu\", weights_only=False)"]
        return _how_to_load(f"The model is this run's Lightning checkpoint{where}; with fairprune installed:", code)

    def folder_loading(self) -> list[str]:
        """How to load the run without a checkpoint: its folder is a transformers model folder."""
        code = ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                "folder = \"path/to/this/folder\"  # or the Hub repository it was pushed to",
                "model = AutoModelForCausalLM.from_pretrained(folder)",
                "tokenizer = AutoTokenizer.from_pretrained(folder)"]
        return _how_to_load("This folder is a transformers model folder:", code)


# -- settings ----------------------------------------------------------------------------------------
def _settings(report: Mapping[str, Any], config: Mapping[str, Any]) -> list[str]:
    rows = [[key, _plain(report.get(key))] for key in ("method", "granularity", "target_sparsity", "nm", "keep_per_iter", "groups_from",
                                                      "alpha", "gamma", "scorer", "family")
            if isinstance(report.get(key), (str, int, float)) and not isinstance(report.get(key), bool)]
    if isinstance(report.get("steps"), list):
        rows.append(["pruning steps", str(len(report["steps"]))])
    if isinstance(report.get("axes"), list):
        rows.append(["axes", ", ".join(str(a) for a in report["axes"])])
    flat = _flatten(config)
    lines = ["## Settings", "", _table(["setting", "value"], rows), ""] if rows else []
    if flat:
        lines += ["<details><summary>The run's configuration (config.yaml)</summary>", "",
                  _table(["key", "value"], [[k, _plain(v)] for k, v in flat.items()]), "", "</details>", ""]
    return lines


def _how_to_load(intro: str, code: list[str]) -> list[str]:
    fence = "```"
    while fence in "\n".join(code):
        fence += "`"
    return ["## How to load", "", intro, "", f"{fence}python", *code, fence, ""]
