"""The model card of a pruned causal LM's report (:class:`~fairprune.reporting.records.LMReport`) and
of an attention-head pruning run's (:class:`~fairprune.reporting.records.HeadReport`): perplexity,
stereotype score, lm-eval task figures (invalid ones struck out and kept out of the model index)
and, for heads, the toxicity bias per axis, before and after pruning."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from huggingface_hub import EvalResult

from fairprune.reporting.card_values import _cell, _figure, _intervals, _mapping, _number, _table, _text
from fairprune.reporting.model_card import Card


class LMCard(Card):
    """The card of a pruned causal LM's report (:class:`~fairprune.reporting.records.LMReport`):
    perplexity, stereotype score and task figures before and after pruning."""

    what = "causal language model"

    def results(self) -> list[EvalResult]:
        return _lm_results(self.report, self.config)

    def body(self) -> list[str]:
        return _lm_body(self.report)


class HeadCard(LMCard):
    """The card of an attention-head pruning run's report (:class:`~fairprune.reporting.records.HeadReport`):
    the LM's figures and the toxicity bias per axis."""

    tags = ("attention-head-pruning",)

    def name_parts(self) -> list[str]:
        alpha = _number(self.report.get("alpha"))
        return [f"a{alpha:g}"] if alpha is not None else super().name_parts()

    def pruned(self, method: str | None) -> str:
        removed = self.report.get("heads_removed")
        count = len(removed) if isinstance(removed, list) else "some"
        total = f" of {self.report['heads_total']}" if isinstance(self.report.get("heads_total"), int) else ""
        return f"A {self.what} with {count}{total} attention heads removed by **{_text(method)}** (fairprune)."

    def body(self) -> list[str]:
        return super().body() + ["Bias: the disparity of toxicity across the groups of each axis of the prompts "
                                 "(lower is fairer).", ""]


def _texts(config: Mapping[str, Any], key: str, bundled: str, slug: str) -> dict[str, str]:
    given = config.get(key)
    return {"dataset_name": str(given), "dataset_type": str(given)} if isinstance(given, str) and given else \
        {"dataset_name": bundled, "dataset_type": slug}


def _lm_results(report: Mapping[str, Any], config: Mapping[str, Any]) -> list[EvalResult]:
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


def _lm_body(report: Mapping[str, Any]) -> list[str]:
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
        rows += [[f"sparsity as written: {kind}", "–", _cell(_mapping(facts), "sparsity"), "–"]
                 for kind, facts in _mapping(sparsity.get("by_kind")).items() if _mapping(facts).get("pruned_numel")]
    lines = ["## Before and after pruning", "", _table(["figure", "reference", "this model", "change"], rows), ""]
    left = [d for d in sparsity.get("left_dense") or [] if isinstance(d, Mapping)]
    if left:
        kinds = sorted({str(d.get("kind")) for d in left})
        lines += [f"Left dense: {len(left)} block parameters ({', '.join(kinds)}); each with its reason in "
                  "report.json (`sparsity.left_dense`). The sparsity rows are measured on the weights as written.", ""]
    lines += _marks_notes(marks)
    if "stereotype_score" in metrics:
        lines += ["Stereotype score: the share of sentence pairs where the model prefers the stereotypical "
                  "sentence (0.5: no preference).", ""]
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
