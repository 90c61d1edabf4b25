"""Comparison records: each kind's row built from a hand-written report holds the figures the
workflow's table has always held (same columns, same order, missing figures as before), and goes
through the comparison writer into the same files as the plain dict."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest

from fairprune.reporting.compare import write_comparison
from fairprune.reporting.records import DiffRow, HeadRow, LMRow, VisionRow, as_dicts

VISION = {
    "method": "magnitude", "split": "test", "achieved_sparsity": 0.49,
    "metrics": {"accuracy": 0.8},
    "groups": {"a": {"accuracy": 0.9, "count": 10}, "b": {"accuracy": 0.7, "count": 12}, "c": {"count": 0}},
    "fairness": {"acc_gap": 0.2, "degradation_std": 0.05},
    "seconds": {"total": 12.5},
    "reference": {"method": "dense", "metrics": {"accuracy": 0.85},
                  "groups": {"a": {"accuracy": 0.95}, "b": {"accuracy": 0.75}, "c": {"count": 0}},
                  "fairness": {"acc_gap": 0.2}},
}


def test_vision_row_from_report():
    row = VisionRow.from_report(VISION, "magnitude", 0.5)
    assert row.as_dict() == {"method": "magnitude", "target_sparsity": 0.5, "achieved_sparsity": 0.49, "accuracy": 0.8,
                             "acc/a": 0.9, "acc/b": 0.7, "acc/c": None, "acc_gap": 0.2, "degradation_std": 0.05,
                             "seconds": 12.5}
    assert list(row.as_dict()) == ["method", "target_sparsity", "achieved_sparsity", "accuracy", "acc/a", "acc/b",
                                   "acc/c", "acc_gap", "degradation_std", "seconds"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.accuracy = 0.0  # type: ignore[misc]


def test_vision_dense_row_fills_what_the_reference_lacks():
    """The reference has no sparsity, timing or degradation: 0.0, None and None, as before."""
    dense = VisionRow.dense(VISION).as_dict()
    assert dense["method"] == "dense" and dense["target_sparsity"] == 0.0 and dense["achieved_sparsity"] == 0.0
    assert dense["accuracy"] == 0.85 and dense["acc/a"] == 0.95 and dense["acc/c"] is None
    assert dense["acc_gap"] == 0.2 and dense["degradation_std"] is None and dense["seconds"] is None
    bare = VisionRow.from_report({"metrics": {}, "groups": {}}, "magnitude", None).as_dict()
    assert bare == {"method": "magnitude", "target_sparsity": None, "achieved_sparsity": 0.0, "accuracy": None,
                    "acc_gap": None, "degradation_std": None, "seconds": None}


def test_vision_seed_is_the_last_column_of_repeated_runs_only():
    assert "seed" not in VisionRow.from_report(VISION, "magnitude", 0.5).as_dict()
    row = VisionRow.from_report(VISION, "magnitude", 0.5, seed=0).as_dict()
    assert list(row)[-1] == "seed" and row["seed"] == 0
    assert VisionRow.dense(VISION, seed=3).as_dict()["seed"] == 3


LM = {"method": "wanda", "achieved_sparsity": 0.5, "metrics": {"perplexity": 31.0, "stereotype_score": 0.61},
      "seconds": {"load": 1.0, "prune": 2.0, "solve": 0.5, "evaluate": 3.0, "total": 6.0},
      "reference": {"method": "dense", "metrics": {"perplexity": 25.0, "stereotype_score": 0.6}}}


def test_lm_rows():
    row = LMRow.from_report(LM, "wanda", "2:4").as_dict()
    assert row == {"method": "wanda", "sparsity": "2:4", "achieved_sparsity": 0.5, "perplexity": 31.0,
                   "stereotype_score": 0.61, "prune_seconds": 2.0, "seconds": 6.0}
    assert list(row) == ["method", "sparsity", "achieved_sparsity", "perplexity", "stereotype_score",
                         "prune_seconds", "seconds"]
    dense = LMRow.dense(LM["reference"]["metrics"], 0.01, 4.5).as_dict()
    assert dense == {"method": "dense", "sparsity": "0", "achieved_sparsity": 0.01, "perplexity": 25.0,
                     "stereotype_score": 0.6, "prune_seconds": 0.0, "seconds": 4.5}
    with pytest.raises(KeyError):  # a report without timings is no finished LM run
        LMRow.from_report({"achieved_sparsity": 0.5, "metrics": {}}, "wanda", "0.5")


HEADS = {"method": "fasp", "gamma": 0.25, "alpha": 0.5, "heads_removed": [[0, 1], [1, 0]],
         "metrics": {"perplexity": 40.0}, "fairness": {"bias": {"gender": 0.1, "race": 0.2}},
         "reference": {"method": "dense", "metrics": {"perplexity": 35.0}, "fairness": {"bias": {"gender": 0.3, "race": 0.4}}}}


def test_head_rows():
    row = HeadRow.from_report(HEADS, "fasp", 0.5, protects=True).as_dict()
    assert row == {"method": "fasp", "alpha": 0.5, "gamma": 0.25, "heads_removed": 2, "perplexity": 40.0,
                   "bias/gender": 0.1, "bias/race": 0.2}
    assert list(row)[-2:] == ["bias/gender", "bias/race"]
    assert HeadRow.from_report(HEADS, "random", 0.5, protects=False).as_dict()["gamma"] is None  # γ is FASP's alone
    dense = HeadRow.dense(HEADS).as_dict()
    assert dense == {"method": "dense", "alpha": 0.0, "gamma": None, "heads_removed": 0, "perplexity": 35.0,
                     "bias/gender": 0.3, "bias/race": 0.4}


def test_diff_row_leaves_out_groups_without_accuracy():
    results = {"metrics": {"accuracy": 0.7}, "groups": {"female": {"accuracy": 0.75}, "male": {"accuracy": 0.65},
                                                        "other": {"count": 0}},
               "fairness": {"acc_gap": 0.1}}
    row = DiffRow.from_report(results, "diff-pruning", 0.004, 1000, 50000).as_dict()
    assert row == {"method": "diff-pruning", "accuracy": 0.7, "acc/female": 0.75, "acc/male": 0.65, "acc_gap": 0.1,
                   "fraction_changed": 0.004, "stored_bytes": 1000, "full_bytes": 50000}
    assert list(row) == ["method", "accuracy", "acc/female", "acc/male", "acc_gap", "fraction_changed",
                         "stored_bytes", "full_bytes"]


def test_as_dicts_passes_plain_rows_through():
    plain = {"method": "dense", "accuracy": 0.9}
    assert as_dicts([plain, LMRow.dense({"perplexity": 2.0}, 0.0, 1.0)]) == [
        plain, {"method": "dense", "sparsity": "0", "achieved_sparsity": 0.0, "perplexity": 2.0,
                "prune_seconds": 0.0, "seconds": 1.0}]


def test_records_go_through_the_comparison_writer_as_their_dicts(tmp_path):
    records = [VisionRow.dense(VISION), VisionRow.from_report(VISION, "magnitude", 0.5)]
    table = write_comparison(records, tmp_path / "records", echo=False)
    write_comparison([r.as_dict() for r in records], tmp_path / "dicts", echo=False)
    saved = pd.read_csv(tmp_path / "records" / "comparison.csv")
    assert list(saved.columns) == ["method", "target_sparsity", "achieved_sparsity", "accuracy", "acc/a", "acc/b",
                                   "acc/c", "acc_gap", "degradation_std", "seconds"]
    assert list(saved["method"]) == ["dense", "magnitude"] and list(table["method"]) == ["dense", "magnitude"]
    assert saved["accuracy"].tolist() == [0.85, 0.8] and saved["acc/c"].isna().all()
    for name in ("comparison.csv", "comparison.md"):
        assert (tmp_path / "records" / name).read_bytes() == (tmp_path / "dicts" / name).read_bytes(), name
    report = json.loads((tmp_path / "records" / "report.json").read_text())
    assert report["comparison"][1]["method"] == "magnitude" and report["comparison"][1]["acc/a"] == 0.9


def test_repeated_records_aggregate_over_seeds(tmp_path):
    other = {**VISION, "metrics": {"accuracy": 0.6}}
    records = [VisionRow.from_report(VISION, "magnitude", 0.5, seed=0), VisionRow.from_report(other, "magnitude", 0.5, seed=1)]
    table = write_comparison(records, tmp_path, echo=False, keys=["method", "target_sparsity"])
    assert table["n"].tolist() == [2] and table["accuracy_mean"].tolist() == pytest.approx([0.7])
    assert len(pd.read_csv(tmp_path / "comparison_runs.csv")) == 2
