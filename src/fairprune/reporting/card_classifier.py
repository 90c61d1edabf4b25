"""The model card of a classifier's report (:class:`~fairprune.reporting.records.VisionReport`, and a
text classifier's validation report): accuracy overall and per group, the gap between groups and
the degradation against the reference, as the Hub's model index and as tables."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from huggingface_hub import EvalResult

from fairprune.reporting.card_values import _cell, _figure, _intervals, _mapping, _number, _table, _text
from fairprune.reporting.model_card import Card

#: Below this many samples a group's rates are flagged as noisy in the card.
SMALL_GROUP = 30
_FAIRNESS = {  # vision report fairness keys: how the card names them
    "acc_gap": "accuracy gap (best − worst group)", "acc_std": "accuracy std over groups",
    "demographic_parity": "demographic parity (lowest / highest positive rate)",
    "equal_opportunity": "equal opportunity (lowest / highest true-positive rate)",
    "degradation_std": "degradation std (spread of the accuracy each group lost)", "degradation_var": "degradation variance",
}


class ClassifierCard(Card):
    """The card of a classifier's report (:class:`~fairprune.reporting.records.VisionReport`, and a
    text classifier's validation report): accuracy overall and per group, gap and degradation."""

    what = "classifier"
    folder_is_model = False
    reference_role = " and the baseline of each group's degradation"

    def pipeline_tag(self) -> str:
        return "text-classification" if "text" in (self.model_class or "").lower() else "image-classification"

    def base_candidates(self) -> list[Any]:
        """A vision run's dense checkpoint."""
        return [self.config.get("ckpt")]

    def results(self) -> list[EvalResult]:
        return _classifier_results(self.report, self.pipeline_tag())

    def body(self) -> list[str]:
        return _classifier_body(self.report)

    def folder_loading(self) -> list[str]:
        return ["## How to load", "", "This run saved no checkpoint.", ""]


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
