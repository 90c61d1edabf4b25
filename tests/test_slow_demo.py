"""The demo's workflow at full size (minutes): run with `make test-slow`."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from fairprune.cli.prune import main as prune_main
from fairprune.cli.train import main as train_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_trains_every_group_and_prunes_to_eighty_percent(tmp_path):
    config = str(ROOT / "configs/vision/demo.yaml")
    assert train_main(["fit", "--config", config, "--trainer.logger.init_args.save_dir", str(tmp_path)]) == 0
    ckpt = tmp_path / "demo" / "dense" / "checkpoints" / "last.ckpt"
    assert train_main(["test", "--config", config, "--trainer.logger.init_args.save_dir", str(tmp_path),
                       "--ckpt_path", str(ckpt)]) == 0
    dense = json.loads((tmp_path / "demo" / "dense" / "test" / "report.json").read_text())
    # Every group's gender cue is learnable: the dense model itself is good for every group.
    assert all(g["accuracy"] >= 0.8 for g in dense["groups"].values()), dense["groups"]
    assert prune_main(["compare", "--config", str(ROOT / "configs/compare/demo.yaml"), "--ckpt", str(ckpt),
                       "--output", str(tmp_path / "compare")]) == 0
    table = pd.read_csv(tmp_path / "compare" / "comparison.csv").set_index("method")
    assert table.loc[["magnitude", "fairgrape"], "achieved_sparsity"].sub(0.8).abs().max() < 1e-3
    assert (table.loc[["magnitude", "fairgrape"], "accuracy"] > 0.6).all()  # both clearly above chance (0.5)
    assert (tmp_path / "compare" / "error_rate_changes.png").exists()
