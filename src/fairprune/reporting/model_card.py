"""A run folder's model card: ``README.md`` in the Hugging Face form, so a model shared on the Hub
carries its fairness audit.

The front matter is what the Hub reads (``library_name``, ``tags``, ``base_model`` and a
``model-index`` with the run's headline figures), built with :class:`huggingface_hub.ModelCardData`
and :class:`huggingface_hub.EvalResult` (offline: nothing is fetched). The body says what the model
is, what it was measured against, how each group fared and how to load it.

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
    _cell,
    _figure,
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

#: Below this many samples a group's rates are flagged as noisy in the card.
SMALL_GROUP = 30
_NOT_PRUNED = {None, "dense", "evaluate"}
_FAIRNESS = {  # vision report fairness keys: how the card names them
    "acc_gap": "accuracy gap (best − worst group)", "acc_std": "accuracy std over groups",
    "demographic_parity": "demographic parity (lowest / highest positive rate)",
    "equal_opportunity": "equal opportunity (lowest / highest true-positive rate)",
    "degradation_std": "degradation std (spread of the accuracy each group lost)", "degradation_var": "degradation variance",
}


def write_model_card(folder: str | os.PathLike, report: Mapping[str, Any], config: Mapping[str, Any] | None = None, *,
                     checkpoint: str | os.PathLike | None = None, model_class: str | None = None) -> Path:
    """Write ``folder/README.md`` for the run of ``report`` (``config``: the settings it ran with).

    ``checkpoint`` (with ``model_class``, ``module.Class``): the Lightning checkpoint that holds the
    model (vision runs); without it the folder itself is the model (``from_pretrained(folder)``)."""
    path = Path(folder) / CARD
    write_text(path, model_card(report, config, checkpoint=checkpoint, model_class=model_class, folder=folder))
    return path


def model_card(report: Mapping[str, Any], config: Mapping[str, Any] | None = None, *,
               checkpoint: str | os.PathLike | None = None, model_class: str | None = None,
               folder: str | os.PathLike | None = None) -> str:
    """The text of the card (see :func:`write_model_card`)."""
    report = report if isinstance(report, Mapping) else {}
    config = config if isinstance(config, Mapping) else {}
    kind = _kind(report)
    method = report.get("method") if isinstance(report.get("method"), str) else None
    name = _model_name(report, kind)
    base = _base_model(report, config, kind)
    tags = ["fairprune", "fairness"] + ([] if method in _NOT_PRUNED else [method, "pruned"])
    if kind == "heads":
        tags.append("attention-head-pruning")
    quantization = _mapping(report.get("quantization"))
    if quantization:
        tags += ["compressed-tensors", f"{_text(str(quantization.get('bits', '')))}-bit"]
    if kind == "classifier":
        task = "text-classification" if "text" in (model_class or "").lower() else "image-classification"
        results = _classifier_results(report, task)
    else:
        task = "text-generation"
        results = _lm_results(report, config, kind)
    data = ModelCardData(library_name="transformers" if checkpoint is None and kind != "classifier" else "pytorch",
                         pipeline_tag=task, tags=tags, base_model=base, model_name=name, eval_results=results or None)
    body = [f"# {_text(name)}", "", _summary(report, kind, method, base), ""]
    body += _reference(report, kind)
    if kind == "classifier":
        body += _classifier_body(report)
    else:
        body += _lm_body(report, kind)
    warnings = report.get("warnings") if isinstance(report.get("warnings"), list) else []
    if warnings:
        body += ["## Warnings", "", *(f"- {_text(w)}" for w in warnings), ""]
    body += _settings(report, config, kind)
    body += card_section(report.get("environment"))
    body += _loading(method, kind, checkpoint, model_class, folder, report.get("granularity") == "channel")
    body += weights_sections(report)
    body += ["Written by fairprune from the run's `report.json`, which holds every figure above at full precision."]
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n")
    return str(card)


# -- what the run is ------------------------------------------------------------------------------
def _kind(report: Mapping[str, Any]) -> str:
    metrics = _mapping(report.get("metrics"))
    if "heads_removed" in report or isinstance(_mapping(report.get("fairness")).get("bias"), Mapping):
        return "heads"
    if "perplexity" in metrics or "stereotype_score" in metrics:
        return "lm"
    return "classifier"


def _model_name(report: Mapping[str, Any], kind: str) -> str:
    model = report.get("model")
    stem = (Path(model).name if isinstance(model, str) else "") or "model"
    parts = [stem, str(report.get("method") or "dense")]
    alpha, target = _number(report.get("alpha")), _number(report.get("target_sparsity"))
    if kind == "heads" and alpha is not None:
        parts.append(f"a{alpha:g}")
    elif report.get("nm"):
        parts.append(str(report["nm"]).replace(":", "of"))
    elif target:
        parts.append(f"s{target:g}")
    return "-".join(parts)


def _base_model(report: Mapping[str, Any], config: Mapping[str, Any], kind: str) -> str | None:
    """The LM's ``--model`` (hub name or folder); a vision run's dense checkpoint."""
    candidates = [config.get("ckpt")] if kind == "classifier" else [report.get("model"), config.get("model")]
    return next((str(c) for c in candidates if isinstance(c, (str, os.PathLike)) and str(c)), None)


def _summary(report: Mapping[str, Any], kind: str, method: str | None, base: str | None) -> str:
    what = {"classifier": "classifier", "lm": "causal language model", "heads": "causal language model"}[kind]
    if method in _NOT_PRUNED:
        text = f"A {what} ({_text(report.get('model') or 'model')}) trained or measured with fairprune, not pruned."
    elif kind == "heads":
        removed = report.get("heads_removed")
        count = len(removed) if isinstance(removed, list) else "some"
        total = f" of {report['heads_total']}" if isinstance(report.get("heads_total"), int) else ""
        text = f"A {what} with {count}{total} attention heads removed by **{_text(method)}** (fairprune)."
    else:
        target, achieved = _number(report.get("target_sparsity")), _number(report.get("achieved_sparsity"))
        pattern = f"{_text(report['nm'])} pattern, " if report.get("nm") else ""
        sparsity = (f" to {pattern}target sparsity {_fmt(target)}" if target is not None or pattern else "")
        if achieved is not None:
            pruned = ("prunable channels are removed" if report.get("granularity") == "channel"
                      else "prunable weights are zero")
            sparsity += f" (achieved: {_fmt(achieved)} of the {pruned})"
        text = f"A {what} pruned by **{_text(method)}** (fairprune){sparsity}."
    if base:
        text += f" Base model: {_text(base)}."
    facts = [(label, report.get(key)) for key, label in (("dataset", "dataset"), ("task", "task"), ("sensitive", "groups"),
                                                        ("split", "measured on split"))]
    facts = [f"{label}: {_text(value)}" for label, value in facts if isinstance(value, str) and value]
    return text + (f" ({'; '.join(facts)})" if facts else "")


def _reference(report: Mapping[str, Any], kind: str) -> list[str]:
    reference = report.get("reference")
    if not isinstance(reference, Mapping):
        return ["No reference was measured: the figures below stand alone.", ""]
    facts = [f"{_text(k)}: {_text(v)}" for k, v in reference.items()  # e.g. epochs, seed; not timings nor cache files
             if k not in ("method", "cache") and isinstance(v, (str, int, bool))]
    label = _text(reference.get("method") or "dense")
    extra = f" ({', '.join(facts)})" if facts else ""
    role = " and the baseline of each group's degradation" if kind == "classifier" else ""
    return [f"Measured against the **{label}** model{extra}: its figures are the reference column below{role}.", ""]


# -- vision / classifiers ---------------------------------------------------------------------------
def _classifier_results(report: Mapping[str, Any], task: str) -> list[EvalResult]:
    metrics, fairness, groups = (_mapping(report.get(k)) for k in ("metrics", "fairness", "groups"))
    dataset = str(report.get("dataset") or "unknown")
    sensitive = str(report.get("sensitive") or "group")
    common = {"task_type": task, "task_name": f"{report.get('task') or 'class'} classification",
              "dataset_type": dataset, "dataset_name": dataset,
              "dataset_split": str(report["split"]) if isinstance(report.get("split"), str) else None}
    figures = [("accuracy", "accuracy", _figure(metrics, "accuracy")[0]),
               ("accuracy_gap", f"accuracy gap across {sensitive} groups", _figure(fairness, "acc_gap")[0]),
               ("degradation_std", "degradation std (accuracy lost per group against the reference)",
                _figure(fairness, "degradation_std")[0])]
    figures += [(f"accuracy/{g}", f"accuracy ({sensitive}: {g})", _figure(v, "accuracy")[0]) for g, v in groups.items()]
    return [EvalResult(**common, metric_type=t, metric_name=n, metric_value=v) for t, n, v in figures if v is not None]


def _classifier_body(report: Mapping[str, Any]) -> list[str]:
    metrics, fairness, groups = (_mapping(report.get(k)) for k in ("metrics", "fairness", "groups"))
    reference = report.get("reference") if isinstance(report.get("reference"), Mapping) else None
    ref_metrics, ref_fairness, ref_groups = (_mapping(_mapping(reference).get(k)) for k in ("metrics", "fairness", "groups"))
    intervals = _intervals(report)
    # A compute-matched reference (not the dense checkpoint itself): the dense figures get a column too.
    dense = _mapping(report.get("dense")) if _mapping(reference).get("method", "dense") != "dense" else {}
    rows = [["accuracy", _cell(ref_metrics, "accuracy"), _cell(_mapping(dense.get("metrics")), "accuracy"),
             _cell(metrics, "accuracy", intervals)]]
    rows += [[label, _cell(ref_fairness, key), _cell(_mapping(dense.get("fairness")), key), _cell(fairness, key, intervals)]
             for key, label in _FAIRNESS.items() if key in fairness or key in ref_fairness]
    rows += [[key.replace("_", " "), _cell(ref_metrics, key), _cell(_mapping(dense.get("metrics")), key),
              _cell(metrics, key, intervals)] for key in metrics if key != "accuracy" and _figure(metrics, key)[0] is not None]
    if "achieved_sparsity" in report:
        label = "prunable channels removed" if report.get("granularity") == "channel" else "prunable weights zero"
        rows.append([f"sparsity ({label})", "–", "–", _cell(report, "achieved_sparsity")])
    if isinstance(report.get("parameters"), int) and isinstance(report.get("dense_parameters"), int):
        dense_count = f"{report['dense_parameters']:,}"
        rows.append(["parameters", dense_count, dense_count, f"{report['parameters']:,}"])
    keep = [0] + ([1] if reference is not None else []) + ([2] if dense else []) + [3]  # no empty column
    header = ["figure", f"reference ({_text(_mapping(reference).get('method') or 'dense')})", "dense", "this model"]
    lines = ["## Results", "", _table([header[i] for i in keep], [[row[i] for i in keep] for row in rows]), ""]
    if groups:
        columns = [("count", "count"), ("accuracy", "accuracy"), ("fpr", "FPR"), ("fnr", "FNR"), ("degradation", "degradation")]
        if not any("degradation" in _mapping(f) for f in groups.values()):
            columns.pop()
        group_intervals = _mapping(intervals[0].get("groups"))
        header = ["group", *(label for _, label in columns)] + (["reference accuracy"] if ref_groups else [])
        table = [[name, *(_cell(figures, key, ({"accuracy": group_intervals.get(name)}, intervals[1])) for key, _ in columns)]
                 + ([_cell(ref_groups.get(name), "accuracy")] if ref_groups else []) for name, figures in groups.items()]
        lines += [f"## Per group ({_text(report.get('sensitive') or 'group')})", "", _table(header, table), ""]
        if columns[-1][0] == "degradation":
            lines += ["Degradation: the accuracy the group lost against the reference; their spread is the degradation std.", ""]
        counts = [_number(_mapping(f).get("count")) for f in groups.values()]
        if not report.get("warnings") and any(c is not None and 0 < c < SMALL_GROUP for c in counts):
            lines += [f"Groups with fewer than {SMALL_GROUP} samples give noisy figures: read their rates with care.", ""]
    return lines


def _intervals(report: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """The report's own section of intervals for this model's figures (``ci``: ``{figure: [low,
    high], "groups": {group: [low, high]}, "level": 0.95}``, or ``ci95``) and their label."""
    for key, label in (("ci", "CI"), ("ci95", "95 % CI")):
        section = report.get(key)
        if isinstance(section, Mapping):
            level = _number(section.get("level"))
            return section, (f"{level * 100:g} % CI" if level is not None and 0 < level < 1 else label)
    return {}, "CI"


# -- language models ------------------------------------------------------------------------------
def _texts(config: Mapping[str, Any], key: str, bundled: str, slug: str) -> dict[str, str]:
    given = config.get(key)
    return {"dataset_name": str(given), "dataset_type": str(given)} if isinstance(given, str) and given else \
        {"dataset_name": bundled, "dataset_type": slug}


def _lm_results(report: Mapping[str, Any], config: Mapping[str, Any], kind: str) -> list[EvalResult]:
    metrics, fairness = _mapping(report.get("metrics")), _mapping(report.get("fairness"))
    results = []
    perplexity = _figure(metrics, "perplexity")[0]
    if perplexity is not None:
        results.append(EvalResult(task_type="text-generation", task_name="causal language modeling",
                                  **_texts(config, "eval_text", "fairprune bundled corpus (validation)", "fairprune-corpus"),
                                  metric_type="perplexity", metric_name="perplexity", metric_value=perplexity))
    stereotype = _figure(metrics, "stereotype_score")[0]
    if stereotype is not None:
        results.append(EvalResult(task_type="text-generation", task_name="stereotype preference on sentence pairs",
                                  **_texts(config, "pairs", "fairprune bundled stereotype pairs", "fairprune-pairs"),
                                  metric_type="stereotype_score", metric_name="stereotype score (0.5: no preference)",
                                  metric_value=stereotype))
    tasks = _mapping(report.get("tasks"))
    validity = _mapping(tasks.get("validity"))
    for key, value in metrics.items():  # lm-eval figures, ``<task>/<metric>``: named as lm-eval names them
        task, slash, metric = key.partition("/")
        facts = _mapping(_mapping(tasks.get("facts")).get(task))
        if _mapping(validity.get(key)).get("invalid"):  # the Hub ranks model-index figures: never an invalid one
            continue
        if slash and task != "bias" and _number(value) is not None:
            data = str(facts.get("data") or "lm-eval stock data")
            results.append(EvalResult(task_type="text-generation", task_name=task, dataset_name=data, dataset_type=task,
                                      metric_type=metric, metric_name=f"{metric} ({facts.get('scoring', 'lm-eval')} scoring)",
                                      metric_value=_number(value)))
    for axis, _ in _mapping(fairness.get("bias")).items():
        value = _figure(_mapping(fairness.get("bias")), axis)[0]
        if value is not None:
            results.append(EvalResult(task_type="text-generation", task_name="toxicity disparity across groups",
                                      **_texts(config, "prompts", "fairprune bundled prompts", "fairprune-prompts"),
                                      metric_type=f"bias/{axis}", metric_name=f"bias ({axis})", metric_value=value))
    return results


def _lm_body(report: Mapping[str, Any], kind: str) -> list[str]:
    metrics, fairness = _mapping(report.get("metrics")), _mapping(report.get("fairness"))
    reference = _mapping(report.get("reference"))
    ref_metrics, ref_bias = _mapping(reference.get("metrics")), _mapping(_mapping(reference.get("fairness")).get("bias"))
    bias = _mapping(fairness.get("bias"))
    intervals = _intervals(report)
    marks = (_mapping(reference.get("tasks_validity")), _mapping(_mapping(report.get("tasks")).get("validity")))
    rows = [[_task_label(key, marks), _marked(ref_metrics, key, marks[0]), _marked(metrics, key, marks[1], intervals),
             _change(ref_metrics, metrics, key) if not any(_invalid(m, key) for m in marks) else "–"]
            for key in dict.fromkeys([*ref_metrics, *metrics])]
    bias_intervals = {**_mapping(intervals[0].get("bias")),  # ``ci["bias/<axis>"]`` (FASP), or nested
                      **{key[len("bias/"):]: value for key, value in _mapping(intervals[0]).items() if key.startswith("bias/")}}
    rows += [[f"bias ({axis})", _cell(ref_bias, axis), _cell(bias, axis, (bias_intervals, intervals[1])),
              _change(ref_bias, bias, axis)]
             for axis in dict.fromkeys([*ref_bias, *bias])]
    sparsity = _mapping(report.get("sparsity"))
    if "achieved_sparsity" in report or sparsity:
        rows.append(["sparsity (prunable weights zero)", _cell(sparsity, "dense_zero_fraction"),
                     _cell(report, "achieved_sparsity"), "–"])
    lines = ["## Before and after pruning", "", _table(["figure", "reference", "this model", "change"], rows), ""]
    lines += _marks_notes(marks)
    if "stereotype_score" in metrics:
        lines += ["Stereotype score: the share of sentence pairs where the model prefers the stereotypical "
                  "sentence (0.5: no preference).", ""]
    if kind == "heads":
        lines += ["Bias: the disparity of toxicity across the groups of each axis of the prompts (lower is fairer).", ""]
    return lines


def _invalid(validity: Mapping[str, Any], key: str) -> str:
    """Why the run marks a task figure invalid; empty when it does not."""
    reason = _mapping(validity.get(key)).get("invalid")
    return reason if isinstance(reason, str) else ""


def _task_label(key: str, marks: tuple[Mapping[str, Any], ...]) -> str:
    """A figure's name, with its chance level where it is a task's accuracy."""
    chance = next((_number(_mapping(m.get(key)).get("chance")) for m in marks
                   if _number(_mapping(m.get(key)).get("chance")) is not None), None)
    return key.replace("_", " ") + (f" (chance {chance:.3f})" if chance is not None else "")


def _marked(figures: Mapping[str, Any], key: str, validity: Mapping[str, Any],
            outer: tuple[Mapping[str, Any], str] | None = None) -> str:
    """A figure's cell: struck out with ✗ where its run marks it invalid, ≤ where it is at or below
    its chance level."""
    text = _cell(figures, key, outer)
    if text == "–":
        return text
    if _invalid(validity, key):
        return f"~~{text}~~ ✗"
    return f"{text} ≤" if _mapping(validity.get(key)).get("at_or_below_chance") else text


def _marks_notes(marks: tuple[Mapping[str, Any], ...]) -> list[str]:
    """What the marks of the table mean, and why each figure struck out is invalid."""
    reasons: dict[tuple[str, str], list[str]] = {}
    for side, validity in zip(("reference", "this model"), marks):
        for key in validity:
            why = _invalid(validity, key)
            sides = reasons.setdefault((key.partition("/")[0], why), []) if why else []
            if why and side not in sides:
                sides.append(side)
    lines = []
    if reasons:
        lines += ["✗ (struck out): the run marks the task's figures invalid; they are left out of the model index above "
                  "and of DTO.", ""]
        lines += [f"- {_text(task)} ({', '.join(sides)}): {_text(why)}" for (task, why), sides in reasons.items()] + [""]
    if any(_mapping(v).get("at_or_below_chance") for m in marks for v in m.values()):
        lines += ["≤: at or below its chance level (what uniform answers over the task's own choices score): uniform "
                  "answers would match or beat it.", ""]
    return lines


def _change(before: Mapping[str, Any], after: Mapping[str, Any], key: str) -> str:
    a, b = _figure(before, key)[0], _figure(after, key)[0]
    return "–" if a is None or b is None else f"{b - a:+.4f}"


# -- settings and loading ---------------------------------------------------------------------------
def _settings(report: Mapping[str, Any], config: Mapping[str, Any], kind: str) -> list[str]:
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


def _loading(method: str | None, kind: str, checkpoint: str | os.PathLike | None, model_class: str | None,
             folder: str | os.PathLike | None, channels: bool = False) -> list[str]:
    if checkpoint is not None:
        path, where = Path(checkpoint), ""
        if folder is not None:
            try:
                path, where = path.resolve().relative_to(Path(folder).resolve()), " (its path relative to this folder)"
            except ValueError:
                pass
        module, _, cls = (model_class or "").rpartition(".")
        if not module:
            module, cls = "fairprune.models.vision", "VisionClassifier"
        masks = [] if method in _NOT_PRUNED else ["# the pruned architecture is part of the checkpoint: the model loads "
                                                  "with its channels removed" if channels else
                                                  "# the pruning masks are part of the checkpoint: the model loads pruned"]
        code = [f"from {module} import {cls}", "", *masks,
                f"model = {cls}.load_from_checkpoint({str(path)!r}, map_location=\"cpu\", weights_only=False)"]
        intro = f"The model is this run's Lightning checkpoint{where}; with fairprune installed:"
    elif kind == "classifier":
        return ["## How to load", "", "This run saved no checkpoint.", ""]
    else:
        code = ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                "folder = \"path/to/this/folder\"  # or the Hub repository it was pushed to",
                "model = AutoModelForCausalLM.from_pretrained(folder)",
                "tokenizer = AutoTokenizer.from_pretrained(folder)"]
        intro = "This folder is a transformers model folder:"
    fence = "```"
    while fence in "\n".join(code):
        fence += "`"
    return ["## How to load", "", intro, "", f"{fence}python", *code, fence, ""]
