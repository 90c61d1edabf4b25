"""The compute-matched reference: degradation measured against the dense model trained as long as
the pruning schedule retrains, and a warning when a pruned model outgrows its dense model."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from fairprune.cli.prune import main as prune_main
from fairprune.workflows.reference import outgrown

ROOT = Path(__file__).resolve().parents[1]

# Trains a dense model and prunes it three times with retraining (about 2 min): run by make test-slow;
# the continued reference itself is exercised in make test by test_compare_report, test_pruning_callback and
# test_signals.
pytestmark = pytest.mark.slow

# A dense model trained for one batch is far from convergence: three epochs of retraining lift the
# pruned model well above it (race, which shows in the skin tone, is quick to learn).
PRUNE = ["--pruning.method", "magnitude", "--pruning.target_sparsity", "0.3", "--pruning.keep_per_iter", "0.7",
         "--pruning.retrain_epochs", "3", "--pruning.bn_recalibration", "0",
         "--trainer", "{accelerator: cpu, enable_progress_bar: false}"]


def degradation(reference: dict, report: dict) -> dict[str, float]:
    return {g: reference["groups"][g]["accuracy"] - v["accuracy"] for g, v in report["groups"].items()
            if v.get("accuracy") is not None and reference["groups"][g].get("accuracy") is not None}


@pytest.fixture(scope="module")
def undertrained(tmp_path_factory) -> Path:
    from fairprune.cli.train import main

    out = tmp_path_factory.mktemp("undertrained")
    assert main(["fit", "--config", str(ROOT / "configs" / "vision" / "demo.yaml"), "--trainer.max_epochs", "1",
                 "--trainer.limit_train_batches", "1", "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
                 "--trainer.logger.init_args.save_dir", str(out), "--data.synthetic_size", "1200", "--data.image_size", "32",
                 "--data.batch_size", "16", "--data.target", "race", "--data.sensitive", "gender"]) == 0
    return out / "demo" / "dense" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def runs(undertrained, tmp_path_factory) -> dict[str, dict]:
    dense_ckpt = undertrained
    out = tmp_path_factory.mktemp("reference")
    reports = {}
    for reference in ("continued", "dense"):
        assert prune_main(["vision", "--ckpt", str(dense_ckpt), *PRUNE, "--reference", reference,
                           "--output", str(out), "--name", reference]) == 0
        reports[reference] = json.loads((out / reference / "report.json").read_text())
    return reports


def test_an_undertrained_dense_model_is_outgrown_and_the_warning_fires(runs):
    report = runs["continued"]
    dense, reference = report["dense"], report["reference"]
    assert reference["method"] == "continued" and reference["epochs"] == 3
    # The pruned model beats the dense checkpoint; the continued reference trained as long beats it too.
    assert report["metrics"]["accuracy"] > dense["metrics"]["accuracy"]
    assert reference["metrics"]["accuracy"] > dense["metrics"]["accuracy"]
    assert any("not trained to convergence" in w for w in report["warnings"])
    # Degradation is measured against the continued reference, not the dense checkpoint.
    got = {g: v["degradation"] for g, v in report["groups"].items() if v.get("degradation") is not None}
    assert got and got == pytest.approx(degradation(reference, report), abs=1e-6)
    assert got != pytest.approx(degradation(dense, report), abs=1e-3)


def test_reference_dense_measures_against_the_checkpoint_and_says_so(runs):
    report = runs["dense"]
    assert report["reference"]["method"] == "dense"
    got = {g: v["degradation"] for g, v in report["groups"].items() if v.get("degradation") is not None}
    assert got == pytest.approx(degradation(report["dense"], report), abs=1e-6)
    assert any("use --reference continued" in w for w in report["warnings"])


def test_compare_shows_both_dense_rows_and_reuses_the_cached_reference(undertrained, runs, tmp_path):
    args = ["compare", "--ckpt", str(undertrained), "--methods", "[magnitude, random]", "--sparsities", "[0.3]",
            "--pruning", "{keep_per_iter: 0.7, retrain_epochs: 3, bn_recalibration: 0}",
            "--trainer", "{accelerator: cpu, enable_progress_bar: false}", "--output", str(tmp_path)]
    assert prune_main(args) == 0
    table = pd.read_csv(tmp_path / "comparison.csv")
    assert list(table["method"]) == ["dense", "dense +3 epochs", "magnitude", "random"]
    reports = [json.loads((tmp_path / f"{m}_s0.3" / "report.json").read_text()) for m in ("magnitude", "random")]
    # Trained once (or taken from the cache the module's runs left), the same figures for both cells.
    assert reports[0]["reference"]["metrics"] == reports[1]["reference"]["metrics"]
    assert reports[1]["reference"]["from_cache"]
    assert table.loc[1, "accuracy"] == pytest.approx(reports[0]["reference"]["metrics"]["accuracy"])
    # Intervals on every row, and random against the baseline (the first method) on the same items.
    assert (table["accuracy_ci_low"] <= table["accuracy"]).all() and (table["accuracy"] <= table["accuracy_ci_high"]).all()
    assert table["accuracy_diff"].isna().tolist() == [True, True, True, False]
    assert table.loc[3, "accuracy_diff"] == pytest.approx(table.loc[3, "accuracy"] - table.loc[2, "accuracy"], abs=1e-6)
    assert table.loc[3, "accuracy_diff_ci_low"] <= table.loc[3, "accuracy_diff"] <= table.loc[3, "accuracy_diff_ci_high"]
    markdown = (tmp_path / "comparison.md").read_text()
    assert "accuracy 95% CI" in markdown and "Δ accuracy vs magnitude" in markdown


def test_outgrown_needs_more_than_noise():
    groups = {"a": {"count": 50}, "b": {"count": 50}}
    dense = {"method": "dense", "metrics": {"accuracy": 0.70}}
    close = {"metrics": {"accuracy": 0.74}, "groups": groups, "reference": dense, "dense": dense}
    assert outgrown(close) == []  # 0.04 on 100 items is noise (±0.12)
    far = {**close, "metrics": {"accuracy": 0.90}}
    assert len(outgrown(far)) == 1 and "use --reference continued" in outgrown(far)[0]
