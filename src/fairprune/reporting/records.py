"""Typed hand-offs between a run's report and a comparison table: one report shape and one row per
kind of comparison (vision, LM weights, attention heads, Diff-Pruning).

Each row is built from a report in one place (``from_report``, and ``dense`` for the dense
model's row), so a workflow never reaches into nested report dicts by string keys, and
``as_dict`` gives the columns the comparison files hold, in their order. Per-group columns
(``acc/<group>``, ``bias/<axis>``) and the LM's metrics are dynamic: they follow the report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fairprune.reporting.report import Report


class VisionReport(Report, total=False):
    """A vision pruning run's ``report.json`` (ReportWriter); ``reference`` holds the dense
    model's ``metrics`` / ``groups`` / ``fairness``."""

    threads: int
    resumed: dict[str, Any]
    steps: list[dict[str, Any]]
    bn_recalibration: dict[str, Any]
    deploy: dict[str, Any]  # pruned / dense size, MACs, latency and how they were measured (deploy_columns)


class LMReport(Report, total=False):
    """A post-training LLM pruning run's ``report.json``; ``metrics`` holds perplexity and
    stereotype score, ``seconds`` load / prune / solve / evaluate / total."""

    family: str
    nm: str | None
    sparsity: dict[str, Any]
    calibration: dict[str, Any]
    evaluation: dict[str, Any]
    threads: int
    weights: dict[str, Any]  # save_format, dtype, format, dense_bytes, file_bytes, ratio (hub.compressed.save_weights)


class HeadReport(Report, total=False):
    """An attention-head pruning run's ``report.json``; ``fairness`` holds ``bias`` per axis."""

    gamma: float | None
    alpha: float
    axes: list[str]
    heads_total: int
    heads_removed: list[list[int]]
    protected: list[list[int]]
    removal: dict[str, Any]
    size: dict[str, Any]
    scorer: str
    gamma_search: dict[str, Any]


class DiffReport(Report, total=False):
    """What a Diff-Pruning method is measured by: the module's validation results (``metrics``,
    ``groups``, ``fairness``); no file of its own."""


def deploy_columns(report: Mapping[str, Any], network: str) -> dict[str, float | None]:
    """The table columns of one network's figures in a vision report's ``deploy`` entry
    (``pruned`` or ``dense``; :func:`fairprune.models.deploy.deploy_side_by_side`): ``params (M)``
    (numbers its state dict stores), ``MB`` (its safetensors file), ``MMACs`` (per image) and
    ``ms/img b<batch> (<runtime>)`` (median CPU milliseconds per image, torch and ort); none
    when the run did not measure them."""
    figures = (report.get("deploy") or {}).get(network)
    if not isinstance(figures, Mapping):
        return {}
    columns: dict[str, float | None] = {"params (M)": figures["stored_numel"] / 1e6, "MB": figures["bytes"] / 1e6,
                                        "MMACs": figures["macs"] / 1e6}
    for runtime, per_batch in (figures.get("ms_per_image") or {}).items():
        columns.update({f"ms/img b{batch} ({runtime})": ms for batch, ms in per_batch.items()})
    return columns


@dataclass(frozen=True)
class VisionRow:
    """One method at one sparsity in a vision compare (``seed`` only for repeated runs;
    ``granularity``, weight or channel, for the method rows of a compare that has the column)."""

    method: str
    target_sparsity: float | None
    achieved_sparsity: float | None
    accuracy: float | None
    group_accuracy: dict[str, float | None]
    acc_gap: float | None
    degradation_std: float | None
    seconds: float | None
    seed: int | None = None
    granularity: str | None = None
    deploy: dict[str, float | None] = field(default_factory=dict)  # deploy_columns: size, MACs, latency

    @classmethod
    def from_report(cls, report: VisionReport, method: str, target_sparsity: float | None,
                    seed: int | None = None, granularity: str | None = None) -> VisionRow:
        fairness = report.get("fairness", {})
        return cls(method=method, target_sparsity=target_sparsity,
                   achieved_sparsity=report.get("achieved_sparsity", 0.0),
                   accuracy=report["metrics"].get("accuracy"),
                   group_accuracy={group: values.get("accuracy") for group, values in report["groups"].items()},
                   acc_gap=fairness.get("acc_gap"), degradation_std=fairness.get("degradation_std"),
                   seconds=report.get("seconds", {}).get("total"), seed=seed, granularity=granularity,
                   deploy=deploy_columns(report, "pruned"))

    @classmethod
    def dense(cls, report: VisionReport, seed: int | None = None, granularity: str | None = None) -> VisionRow:
        """The dense checkpoint's row, from a pruned run's ``dense`` (older reports: ``reference``)."""
        row = cls.from_report(report.get("dense") or report["reference"], "dense", 0.0, seed, granularity)
        return replace(row, deploy=deploy_columns(report, "dense"))

    @classmethod
    def continued(cls, report: VisionReport, seed: int | None = None, granularity: str | None = None) -> VisionRow | None:
        """The compute-matched reference's row (the dense model trained as long as the pruning
        schedule retrains), when the run measured against it."""
        reference = report.get("reference") or {}
        if reference.get("method") != "continued":
            return None
        row = cls.from_report(reference, f"dense +{reference.get('epochs', '?')} epochs", 0.0, seed, granularity)
        return replace(row, deploy=deploy_columns(report, "dense"))  # the dense network: same size and speed

    def as_dict(self) -> dict[str, Any]:
        row: dict[str, Any] = {"method": self.method, **({"granularity": self.granularity} if self.granularity is not None else {}),
                               "target_sparsity": self.target_sparsity, "achieved_sparsity": self.achieved_sparsity,
                               "accuracy": self.accuracy}
        row.update({f"acc/{group}": value for group, value in self.group_accuracy.items()})
        row.update(acc_gap=self.acc_gap, degradation_std=self.degradation_std, seconds=self.seconds)
        row.update(self.deploy)
        if self.seed is not None:
            row["seed"] = self.seed
        return row


@dataclass(frozen=True)
class LMRow:
    """One method at one sparsity (``"0.5"``, ``"2:4"``) in an LM weight-pruning compare."""

    method: str
    sparsity: str
    achieved_sparsity: float
    metrics: dict[str, float] = field(default_factory=dict)
    prune_seconds: float = 0.0
    seconds: float | None = None
    weights_mb: float | None = None  # the weights' bytes on disk / 1e6 (the dense row: what save_pretrained writes)
    validity: dict[str, dict[str, Any]] = field(default_factory=dict)  # per task figure: chance level, invalid (--tasks)

    @classmethod
    def from_report(cls, report: LMReport, method: str, sparsity: str) -> LMRow:
        weights = report.get("weights") or {}
        return cls(method=method, sparsity=sparsity, achieved_sparsity=report["achieved_sparsity"],
                   metrics=dict(report["metrics"]), prune_seconds=report["seconds"]["prune"],
                   seconds=report["seconds"]["total"],
                   weights_mb=None if weights.get("file_bytes") is None else weights["file_bytes"] / 1e6,
                   validity=_validity((report.get("tasks") or {}).get("validity")))

    @classmethod
    def dense(cls, metrics: Mapping[str, float], achieved_sparsity: float, seconds: float,
              weight_bytes: int | None = None, validity: Mapping[str, Any] | None = None) -> LMRow:
        """The dense model's row: measured once per compare, not a run of its own (``weight_bytes``:
        what its weights take as ``save_pretrained`` writes them, in the runs' dtype; ``validity``:
        its task figures' chance levels and marks)."""
        return cls(method="dense", sparsity="0", achieved_sparsity=achieved_sparsity, metrics=dict(metrics),
                   prune_seconds=0.0, seconds=seconds, weights_mb=None if weight_bytes is None else weight_bytes / 1e6,
                   validity=_validity(validity))

    def as_dict(self) -> dict[str, Any]:
        row = {"method": self.method, "sparsity": self.sparsity, "achieved_sparsity": self.achieved_sparsity,
               **task_columns(self.metrics, self.validity), "prune_seconds": self.prune_seconds, "seconds": self.seconds}
        if self.weights_mb is not None:
            row["weights_mb"] = self.weights_mb
        return row


@dataclass(frozen=True)
class HeadRow:
    """One method at one α in an attention-head compare (``gamma`` is FASP's alone)."""

    method: str
    alpha: float
    gamma: float | None
    heads_removed: int
    perplexity: float
    bias: dict[str, float]
    tasks: dict[str, float] = field(default_factory=dict)  # lm-eval's headline figures, ``<task>/<metric>`` (--tasks)
    validity: dict[str, dict[str, Any]] = field(default_factory=dict)  # per task figure: chance level, invalid

    @classmethod
    def from_report(cls, report: HeadReport, method: str, alpha: float, protects: bool) -> HeadRow:
        """``protects``: the method protects heads for perplexity (its registry entry), so its γ is shown."""
        return cls(method=method, alpha=alpha, gamma=report["gamma"] if protects else None,
                   heads_removed=len(report["heads_removed"]), perplexity=report["metrics"]["perplexity"],
                   bias=dict(report["fairness"]["bias"]), tasks=_task_figures(report["metrics"]),
                   validity=_validity((report.get("tasks") or {}).get("validity")))

    @classmethod
    def dense(cls, report: HeadReport) -> HeadRow:
        """The unpruned model's row, from a run's ``reference``."""
        reference = report["reference"]
        return cls(method="dense", alpha=0.0, gamma=None, heads_removed=0,
                   perplexity=reference["metrics"]["perplexity"], bias=dict(reference["fairness"]["bias"]),
                   tasks=_task_figures(reference["metrics"]), validity=_validity(reference.get("tasks_validity")))

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.method, "alpha": self.alpha, "gamma": self.gamma, "heads_removed": self.heads_removed,
                "perplexity": self.perplexity, **{f"bias/{axis}": value for axis, value in self.bias.items()},
                **task_columns(self.tasks, self.validity)}


def _task_figures(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {key: value for key, value in metrics.items() if "/" in key}


def _validity(found: Any) -> dict[str, dict[str, Any]]:
    """A report's ``tasks.validity`` (or ``reference.tasks_validity``), the well-formed entries only."""
    if not isinstance(found, Mapping):
        return {}
    return {str(k): dict(v) for k, v in found.items() if isinstance(v, Mapping)}


#: The suffixes of the columns a task figure brings along: its chance level, and why it is invalid.
CHANCE, INVALID = "_chance", "_invalid"


def task_columns(figures: Mapping[str, Any], validity: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``figures`` in order, each task figure followed by its chance level (``<figure>_chance``,
    where it is an accuracy) and why its run marks it invalid (``<figure>_invalid``, empty when
    valid), where the run gave its figures' validity."""
    row: dict[str, Any] = {}
    for key, value in figures.items():
        row[key] = value
        marks = validity.get(key)
        if marks is None:
            continue
        if marks.get("chance") is not None:
            row[f"{key}{CHANCE}"] = marks["chance"]
        row[f"{key}{INVALID}"] = marks.get("invalid") or ""
    return row


@dataclass(frozen=True)
class DiffRow:
    """One method of the Diff-Pruning comparison: its validation figures and what it stores."""

    method: str
    accuracy: float
    group_accuracy: dict[str, float]
    acc_gap: float
    fraction_changed: float
    stored_bytes: int
    full_bytes: int

    @classmethod
    def from_report(cls, report: DiffReport, method: str, fraction_changed: float, stored_bytes: int,
                    full_bytes: int) -> DiffRow:
        """Groups without an accuracy (none of their samples seen) get no column."""
        return cls(method=method, accuracy=report["metrics"]["accuracy"],
                   group_accuracy={g: v["accuracy"] for g, v in report["groups"].items() if "accuracy" in v},
                   acc_gap=report["fairness"]["acc_gap"], fraction_changed=fraction_changed,
                   stored_bytes=stored_bytes, full_bytes=full_bytes)

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.method, "accuracy": self.accuracy,
                **{f"acc/{group}": value for group, value in self.group_accuracy.items()},
                "acc_gap": self.acc_gap, "fraction_changed": self.fraction_changed,
                "stored_bytes": self.stored_bytes, "full_bytes": self.full_bytes}


#: A comparison row of any kind.
Row = VisionRow | LMRow | HeadRow | DiffRow


def as_dicts(rows: Sequence[Row | dict[str, Any]]) -> list[dict[str, Any]]:
    """Plain row dicts for pandas and ``report.json``; dicts pass through as they are."""
    return [row if isinstance(row, dict) else row.as_dict() for row in rows]
