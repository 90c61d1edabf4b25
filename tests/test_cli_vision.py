"""The training CLI end to end: every shipped vision config, reports, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from fairprune.cli.train import main
from layouts import write_celeba, write_fairface, write_utkface

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--data.image_size", "32", "--data.batch_size", "4", "--data.num_workers", "0"]


def _config(name: str) -> str:
    return str(ROOT / "configs" / "vision" / f"{name}.yaml")


@pytest.fixture(scope="module")
def real_roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("faces")
    return {
        "utkface_resnet34": write_utkface(base / "utk"),
        "fairface_resnet34": write_fairface(base / "ff"),
        "celeba_mobilenetv2": write_celeba(base / "celeba"),
    }


@pytest.mark.parametrize("name", ["demo", "utkface_resnet34", "fairface_resnet34", "celeba_mobilenetv2"])
def test_every_shipped_config_runs_fast_dev_run(name, real_roots, tmp_path):
    args = ["fit", "--config", _config(name), "--trainer.fast_dev_run", "1", "--trainer.accelerator", "cpu",
            "--trainer.devices", "1", "--trainer.default_root_dir", str(tmp_path), *SMALL]
    if name == "demo":
        args += ["--data.synthetic_size", "150"]
    else:
        args += ["--data.root", str(real_roots[name])]
    assert main(args) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["split"] == "val" and report["method"] == "dense"
    assert 0.0 <= report["metrics"]["accuracy"] <= 1.0
    assert report["groups"], "per-group results are missing"
    for group in report["groups"].values():
        assert "count" in group and "present" in group


def test_fit_then_test_writes_run_folder(tmp_path):
    args = ["--config", _config("demo"), "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
            "--trainer.limit_val_batches", "2", "--trainer.limit_test_batches", "2", "--trainer.accelerator", "cpu",
            "--trainer.logger.init_args.save_dir", str(tmp_path), "--data.synthetic_size", "200", *SMALL]
    assert main(["fit", *args]) == 0
    run = tmp_path / "demo" / "dense"
    assert (run / "config.yaml").exists()
    metrics = pd.read_csv(run / "metrics.csv")
    groups = json.loads((run / "report.json").read_text())["groups"]
    for group in groups:
        assert f"val/acc/{group}" in metrics.columns or f"val/count/{group}" in metrics.columns
    assert {"val/acc", "val/acc_gap", "val/acc_std", "val/demographic_parity"} <= set(metrics.columns)
    assert main(["test", *args, "--ckpt_path", str(run / "checkpoints" / "last.ckpt")]) == 0
    tested = run / "test"  # beside the fit's files, not over them
    report = json.loads((tested / "report.json").read_text())
    assert report["split"] == "test" and report["task"] == "gender" and report["dataset"] == "synthetic"
    table = pd.read_csv(tested / "groups.csv", index_col="group")
    assert set(table.index) == set(report["groups"])
    assert (tested / "sparsity.csv").exists()


def _error(capsys, args) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    last = err.splitlines()[-1]  # warnings from libraries may come before it
    assert last.startswith("error: ")
    return last


def test_missing_root_is_one_line(capsys, tmp_path):
    err = _error(capsys, ["fit", "--config", _config("utkface_resnet34"), "--data.root", str(tmp_path / "nope")])
    assert "nope" in err and "--data.root" in err


def test_unknown_backbone_suggests_names(capsys, tmp_path):
    err = _error(capsys, ["fit", "--config", _config("demo"), "--model.backbone", "resnet_34",
                          "--trainer.default_root_dir", str(tmp_path)])
    assert "resnet_34" in err and "resnet34" in err


def test_unknown_celeba_attribute_lists_them(capsys, real_roots):
    err = _error(capsys, ["fit", "--config", _config("celeba_mobilenetv2"), "--data.root",
                          str(real_roots["celeba_mobilenetv2"]), "--data.target", "Smilling"])
    assert "Smilling" in err and "Smiling" in err


def test_bad_fairface_race_names_the_row(capsys, tmp_path):
    root = write_fairface(tmp_path / "ff", per_cell=1)
    csv = root / "fairface_label_train.csv"
    lines = csv.read_text().splitlines()
    lines[3] = lines[3].replace(lines[3].split(",")[3], "Martian")
    csv.write_text("\n".join(lines) + "\n")
    err = _error(capsys, ["fit", "--config", _config("fairface_resnet34"), "--data.root", str(root),
                          "--trainer.fast_dev_run", "1", "--trainer.default_root_dir", str(tmp_path), *SMALL])
    assert "Martian" in err


def test_exit_status_and_no_traceback_in_a_real_process(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "fit", "--config", _config("utkface_resnet34"),
                           "--data.root", str(tmp_path / "missing")], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")


def test_progress_bars_can_be_turned_off(tmp_path, capsys):
    """The always-present progress bar steps aside for --trainer.enable_progress_bar false."""
    args = ["fit", "--config", _config("demo"), "--trainer.fast_dev_run", "1", "--trainer.accelerator", "cpu",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path),
            "--data.synthetic_size", "150", *SMALL]
    assert main(args) == 0
    assert json.loads((tmp_path / "report.json").read_text())["split"] == "val"
    assert "it/s" not in capsys.readouterr().out  # no bar was drawn


def test_compare_refuses_an_nm_pattern_for_vision(tmp_path, capsys):
    from fairprune.cli.prune import main as prune_main

    status = prune_main(["compare", "--ckpt", str(tmp_path / "dense.ckpt"), "--methods", "[magnitude]",
                         "--sparsities", '["3:2"]', "--output", str(tmp_path / "out")])
    assert status == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "fraction in [0, 1)" in last and "not an N:M pattern" in last and "3:2" in last
