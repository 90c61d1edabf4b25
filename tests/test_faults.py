"""Runs that go wrong: a diverging fit stops before a non-finite model is saved, one run per output
folder (a lock), atomic result files, a corrupted FASP journal, and a resumed run that keeps its
history (metrics.csv, group_shares.csv, seconds)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pandas as pd
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from cli_output import last_error as _last_error
from fairprune.callbacks.guards import FiniteCheck, nonfinite_tensor
from fairprune.callbacks.history import logged_before
from fairprune.callbacks.pruning import IterativePruning
from fairprune.cli.prune import main as prune_main
from fairprune.cli.train import main as train_main
from fairprune.errors import UserError
from fairprune.pruning.fasp.scoring import head_bias_impact, read_scores, score_heads
from fairprune.pruning.masks import Target, achieved_sparsity, apply_mask, sparsity_table
from fairprune.storage.atomic import replace_atomically, write_csv
from fairprune.storage.lock import RunLock, locked
from fairprune.workflows.vision import prune_vision
from tiny_models import BUILDERS

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models on a shared 2-core machine: threads only thrash

FAST = {"limit_train_batches": 2, "limit_val_batches": 2, "limit_test_batches": 2, "accelerator": "cpu",
        "enable_progress_bar": False, "enable_model_summary": False}


def _finite_checkpoint(path: Path) -> bool:
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    return all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


# --------------------------------------------------------------------------------------------
# 1. No non-finite model is ever saved as a result
# --------------------------------------------------------------------------------------------


def test_a_masked_weight_counts_as_pruned_whatever_it_holds():
    layer = torch.nn.Linear(8, 4)
    target = Target("layer", layer)
    keep = torch.arange(32).reshape(4, 8) % 2 == 0
    apply_mask(target, keep)
    with torch.no_grad():
        layer.weight_orig.fill_(float("nan"))  # diverged training: NaN · 0 is NaN, not 0
        layer(torch.zeros(1, 8))  # the forward recomputes weight = weight_orig · weight_mask
    assert torch.isnan(layer.weight).all()
    assert achieved_sparsity([target]) == pytest.approx(0.5)
    assert sparsity_table([target])[0]["zeros"] == 16
    assert nonfinite_tensor(layer) == "weight_orig"


class _Diverging(L.LightningModule):
    """A linear model whose loss turns NaN at ``nan_at`` (an optimizer step)."""

    def __init__(self, nan_at: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.nan_at = nan_at

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).square().mean()
        return loss * float("nan") if self.global_step >= self.nan_at else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=4)


def test_a_nan_loss_stops_the_fit_before_any_checkpoint_of_it(tmp_path):
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, save_last=True)
    trainer = L.Trainer(max_epochs=2, logger=False, callbacks=[FiniteCheck(), checkpoints], default_root_dir=tmp_path,
                        **{k: v for k, v in FAST.items() if not k.startswith("limit")})
    with pytest.raises(UserError, match=r"training diverged at epoch 1, step 6: the training loss is nan; the learning rate \(0.1\)"):
        trainer.fit(_Diverging(nan_at=5))
    saved = sorted(tmp_path.glob("*.ckpt"))
    assert saved and all(_finite_checkpoint(p) for p in saved)
    assert max(torch.load(p, weights_only=False)["global_step"] for p in saved) == 5  # the NaN update was never saved


def test_a_pruning_step_refuses_nan_weights():
    """FairGRAPE scores (g·w)²: with NaN weights every score is NaN; the step says why instead."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with torch.no_grad():
        model[1].weight[0, 0] = float("inf")
    trainer = SimpleNamespace(current_epoch=3, optimizers=[torch.optim.SGD(model.parameters(), lr=1000.0)])
    with pytest.raises(UserError, match=r"pruning step 1 at epoch 3: weight 1.weight is NaN / inf; .*learning rate 1000"):
        IterativePruning("fairgrape", target_sparsity=0.5).prune_step(trainer, model)


def test_a_diverging_fit_with_pruning_is_one_line_and_saves_nothing_diverged(tmp_path, capsys):
    """SGD at lr 1000 with the magnitude callback: stopped with exit 2, no NaN checkpoint, no report."""
    config = tmp_path / "diverge.yaml"
    config.write_text("""
trainer:
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {save_last: true}
    - class_path: fairprune.callbacks.pruning.IterativePruning
      init_args: {method: magnitude, target_sparsity: 0.19, keep_per_iter: 0.9}
model:
  init_args:
    optimizer: {class_path: torch.optim.SGD, init_args: {lr: 1000}}
""")
    status = train_main(["fit", "--config", str(ROOT / "configs" / "vision" / "demo.yaml"), "--config", str(config),
                         "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2",
                         "--trainer.accelerator", "cpu", "--trainer.logger.init_args.save_dir", str(tmp_path),
                         "--data.synthetic_size", "200", "--data.image_size", "32", "--data.batch_size", "16"])
    assert status == 2
    last = _last_error(capsys)
    assert "training diverged at epoch" in last and "learning rate (1000)" in last
    run = tmp_path / "demo" / "dense"
    assert not (run / "report.json").exists()
    assert all(_finite_checkpoint(p) for p in run.rglob("*.ckpt"))
    assert not (run / ".lock").exists()  # released on error


def test_a_diverged_checkpoint_is_refused_before_pruning(dense_ckpt, tmp_path, capsys):
    state = torch.load(dense_ckpt, map_location="cpu", weights_only=False)
    name = next(k for k, v in state["state_dict"].items() if k.endswith("weight") and v.is_floating_point())
    state["state_dict"][name] = torch.full_like(state["state_dict"][name], float("nan"))
    broken = tmp_path / "nan.ckpt"
    torch.save(state, broken)
    status = prune_main(["vision", "--ckpt", str(broken), "--pruning.method", "fairgrape", "--output", str(tmp_path / "out"),
                         "--trainer", json.dumps(FAST)])
    assert status == 2
    assert "not finite before training" in _last_error(capsys)
    assert not list((tmp_path / "out").rglob("*.ckpt")) and not list((tmp_path / "out").rglob("report.json"))


# --------------------------------------------------------------------------------------------
# 2. One run per output folder; atomic files; a FASP journal other runs wrote into
# --------------------------------------------------------------------------------------------


def _held_by(folder: Path, pid: int, host: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / ".lock"
    lock.write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "started": "2024-01-01T00:00:00"}))
    return lock


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_lock_refuses_a_second_run_and_is_released(tmp_path):
    with RunLock(tmp_path / "run") as lock:
        holder = json.loads(lock.path.read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname() and holder["started"]
        with pytest.raises(UserError, match=f"in use by another run \\(pid {os.getpid()}"):
            RunLock(tmp_path / "run").acquire()
    assert not (tmp_path / "run" / ".lock").exists()

    @locked(lambda output, **_: output)
    def failing(output: str) -> None:
        assert (Path(output) / ".lock").exists()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        failing(str(tmp_path / "other"))
    assert not (tmp_path / "other" / ".lock").exists()  # released on error too


def test_a_live_lock_is_kept_and_a_stale_one_taken_over(tmp_path, capsys):
    live = _held_by(tmp_path / "live", os.getppid())
    with pytest.raises(UserError, match=f"pid {os.getppid()}"):
        RunLock(tmp_path / "live").acquire()
    assert json.loads(live.read_text())["pid"] == os.getppid()
    with pytest.raises(UserError, match="in use"):  # another host's lock cannot be checked: never taken over
        RunLock(_held_by(tmp_path / "remote", _dead_pid(), host="elsewhere").parent).acquire()

    dead = _dead_pid()
    _held_by(tmp_path / "stale", dead)
    with RunLock(tmp_path / "stale") as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    warning = capsys.readouterr().err
    assert warning.startswith("warning: taking over") and f"pid {dead}" in warning and "no longer running" in warning


@pytest.mark.parametrize("command", [
    lambda out: ["vision", "--ckpt", "missing.ckpt", "--pruning.method", "magnitude", "--output", str(out), "--name", "run"],
    lambda out: ["fasp", "--model", "missing-model", "--output", str(out / "run")],
    lambda out: ["sparsegpt", "--model", "missing-model", "--output", str(out / "run")],
    lambda out: ["evaluate", "--model", "missing-model", "--output", str(out / "run")],
])
def test_a_second_prune_run_into_a_folder_refuses_at_once(command, tmp_path, capsys):
    _held_by(tmp_path / "run", os.getppid())
    assert prune_main(command(tmp_path)) == 2
    last = _last_error(capsys)
    assert "in use by another run" in last and str(os.getppid()) in last
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".lock"]  # nothing else was written


def test_a_second_train_run_into_a_log_dir_refuses(tmp_path, capsys):
    _held_by(tmp_path / "demo" / "dense", os.getppid())
    status = train_main(["fit", "--config", str(ROOT / "configs" / "vision" / "demo.yaml"), "--trainer.max_epochs", "1",
                         "--trainer.accelerator", "cpu", "--trainer.logger.init_args.save_dir", str(tmp_path),
                         "--data.synthetic_size", "150", "--data.image_size", "32"])
    assert status == 2
    assert "in use by another run" in _last_error(capsys)
    assert not (tmp_path / "demo" / "dense" / "metrics.csv").exists()


def test_files_are_replaced_atomically(tmp_path):
    path = write_csv(tmp_path / "table.csv", pd.DataFrame({"a": [1, 2]}), index=False)

    def half(tmp: Path) -> None:
        tmp.write_text("a\n3\n")
        raise KeyboardInterrupt  # killed while writing

    with pytest.raises(KeyboardInterrupt):
        replace_atomically(path, half)
    assert pd.read_csv(path)["a"].tolist() == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.csv"]  # no temporary file left


class _FakeEvaluator:
    """Scores that differ per call, so rows of two runs can be told apart."""

    def __init__(self, model, offset: float = 0.0) -> None:
        self.model, self.offset, self.calls = model, offset, 0
        self.prompts = pd.DataFrame({"text": ["x", "y"], "axis": ["a", "b"], "bucket": ["p", "q"]})

    def fingerprint(self) -> str:
        return "fake"

    def __call__(self) -> dict:
        self.calls += 1
        return {"perplexity": self.offset + self.calls, "bias": {"a": self.offset + 0.5 * self.calls, "b": 0.25}}


def test_head_scores_of_two_runs_and_a_cut_line_do_not_corrupt_the_journal(tmp_path):
    torch.manual_seed(0)
    model = BUILDERS["gpt2"]()
    path = tmp_path / "head_scores.csv"
    first = score_heads(_FakeEvaluator(model), path, progress=False)
    assert len(first) == 9
    # A second run appended its own rows for the same heads, and a kill cut a line short.
    other = first.assign(perplexity=first.perplexity + 100)
    with path.open("a", newline="") as handle:
        handle.write(other.to_csv(index=False, header=False) + "0,1,3.5")
    scores = read_scores(path)
    pd.testing.assert_frame_equal(scores, first)  # one row per head, the first written
    assert head_bias_impact(scores, ["a"]).shape == (2, 4)
    rerun = _FakeEvaluator(model, offset=1000)
    again = score_heads(rerun, path, progress=False)
    assert rerun.calls == 0
    pd.testing.assert_frame_equal(again, first)
    assert len(path.read_text().splitlines()) == 1 + 9  # rewritten clean

    # A journal cut mid-row resumes the missing heads only.
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:5]) + "\n" + lines[5][:4])
    resumed = _FakeEvaluator(model, offset=1000)
    scores = score_heads(resumed, path, progress=False)
    assert resumed.calls == 9 - 4 and len(scores) == 9 and not scores.duplicated(["layer", "head"]).any()


# --------------------------------------------------------------------------------------------
# 3. A resumed run keeps its history
# --------------------------------------------------------------------------------------------


def test_rows_logged_after_the_checkpoint_are_dropped():
    assert logged_before({"epoch": "1", "step": "3"}, epoch=2, step=4)
    assert not logged_before({"epoch": "2", "step": "5"}, epoch=2, step=4)
    assert logged_before({"epoch": "2", "step": "3"}, epoch=2, step=4)  # a checkpoint inside an epoch
    assert not logged_before({"epoch": "", "step": "4"}, epoch=2, step=4)


def test_a_resumed_pruning_run_keeps_metrics_shares_and_seconds(dense_ckpt, tmp_path, monkeypatch):
    pruning = {"method": "fairgrape", "target_sparsity": 0.8, "keep_per_iter": 0.5}  # 3 steps, epochs 0-2
    original = IterativePruning.on_train_epoch_start

    def killed(self, trainer, pl_module):
        if trainer.current_epoch == 2:
            raise RuntimeError("killed")
        original(self, trainer, pl_module)

    monkeypatch.setattr(IterativePruning, "on_train_epoch_start", killed)
    with pytest.raises(RuntimeError, match="killed"):
        prune_vision(str(dense_ckpt), pruning, str(tmp_path), trainer=FAST)
    monkeypatch.setattr(IterativePruning, "on_train_epoch_start", original)
    run = tmp_path / "fairgrape"
    last = run / "checkpoints" / "last.ckpt"
    before = torch.load(last, map_location="cpu", weights_only=False)["callbacks"]["ReportWriter"]["seconds"]
    assert not (run / ".lock").exists()

    report = prune_vision(str(dense_ckpt), pruning, str(tmp_path), trainer=FAST, resume=str(last))
    assert report["resumed"] == {"from_epoch": 2, "from_step": 4}
    assert report["seconds"]["total"] > before
    metrics = pd.read_csv(run / "metrics.csv")
    validated = metrics.dropna(subset=["val/acc"])
    assert validated["epoch"].tolist() == [0, 1, 2]  # every epoch once, the ones before the kill included
    assert "val/degradation_std" in metrics and "prune/sparsity" in metrics
    shares = pd.read_csv(run / "group_shares.csv")
    assert sorted(shares["step"].unique()) == [1, 2, 3]
    assert len(report["steps"]) == 3


@pytest.mark.slow  # about 40 s; make test keeps test_signals' compare resume and test_faults_probe4's LM reuse
def test_a_compare_run_again_reuses_finished_cells_and_resumes_the_cut_one(dense_ckpt, tmp_path, monkeypatch, capsys):
    """A compare killed in its second cell: run again with the same settings it keeps the finished
    cell (its files untouched), resumes the cut one from its last checkpoint and writes the whole
    table; with other settings every cell runs again from the start."""
    from fairprune.reporting.records import VisionRow
    from fairprune.workflows.options import VisionCompareOptions
    from fairprune.workflows.vision import compare_vision

    pruning = {"keep_per_iter": 0.5, "bn_recalibration": 2}  # 80 %: 3 steps, epochs 0-2
    original = IterativePruning.on_train_epoch_start

    def killed(self, trainer, pl_module):
        if self.method == "fairgrape" and trainer.current_epoch == 2:
            raise RuntimeError("killed")
        original(self, trainer, pl_module)

    monkeypatch.setattr(IterativePruning, "on_train_epoch_start", killed)
    with pytest.raises(RuntimeError, match="killed"):
        compare_vision(str(dense_ckpt), VisionCompareOptions(["magnitude", "fairgrape"], [0.8], pruning, FAST), str(tmp_path))
    monkeypatch.setattr(IterativePruning, "on_train_epoch_start", original)
    finished, cut = tmp_path / "magnitude_s0.8", tmp_path / "fairgrape_s0.8"
    assert json.loads((finished / "report.json").read_text())["split"] == "test"
    assert not (cut / "report.json").exists() and (cut / "checkpoints" / "last.ckpt").is_file()
    assert not (tmp_path / "comparison.csv").exists()
    kept = {f: f.stat().st_mtime_ns for f in finished.rglob("*") if f.is_file()}
    capsys.readouterr()

    table = compare_vision(str(dense_ckpt), VisionCompareOptions(["magnitude", "fairgrape"], [0.8], pruning, FAST), str(tmp_path))
    printed = capsys.readouterr().out
    assert "finished earlier with the same settings, reusing" in printed and "resuming from" in printed
    assert {f: f.stat().st_mtime_ns for f in finished.rglob("*") if f.is_file()} == kept
    resumed = json.loads((cut / "report.json").read_text())
    assert resumed["split"] == "test" and resumed["resumed"]["from_epoch"] == 2 and len(resumed["steps"]) == 3
    assert sorted(pd.read_csv(cut / "group_shares.csv")["step"].unique()) == [1, 2, 3]
    assert [m for m in table["method"] if not m.startswith("dense +")] == ["dense", "magnitude", "fairgrape"]
    magnitude = json.loads((finished / "report.json").read_text())
    reused = VisionRow.from_report(magnitude, "magnitude", 0.8)
    assert table.set_index("method").loc["magnitude", "accuracy"] == pytest.approx(reused.accuracy)
    assert (tmp_path / "group_shares.png").is_file() and (tmp_path / "report.html").is_file()

    compare_vision(str(dense_ckpt), VisionCompareOptions(["magnitude", "fairgrape"], [0.8], {**pruning, "bn_recalibration": 3},
                                                         FAST), str(tmp_path))
    printed = capsys.readouterr().out
    assert "reusing" not in printed and "resuming" not in printed
    assert json.loads((cut / "report.json").read_text())["bn_recalibration"]["batches"] == 3
    assert "resumed" not in json.loads((cut / "report.json").read_text())

    # The same path, other bytes (a dense model trained again): nothing is reused.
    moved = tmp_path / "dense.ckpt"
    state = torch.load(dense_ckpt, map_location="cpu", weights_only=False)
    torch.save(state, moved)
    compare_vision(str(moved), VisionCompareOptions(["magnitude"], [0.8], pruning, FAST), str(tmp_path / "again"))
    state["state_dict"] = {k: v + 0.01 if v.is_floating_point() else v for k, v in state["state_dict"].items()}
    torch.save(state, moved)
    capsys.readouterr()
    compare_vision(str(moved), VisionCompareOptions(["magnitude"], [0.8], pruning, FAST), str(tmp_path / "again"))
    assert "reusing" not in capsys.readouterr().out


def test_train_py_resumed_with_ckpt_path_keeps_its_metrics(tmp_path):
    args = ["--config", str(ROOT / "configs" / "vision" / "demo.yaml"), "--trainer.limit_train_batches", "2",
            "--trainer.limit_val_batches", "2", "--trainer.accelerator", "cpu", "--trainer.logger.init_args.save_dir",
            str(tmp_path), "--data.synthetic_size", "150", "--data.image_size", "32", "--data.batch_size", "16"]
    assert train_main(["fit", *args, "--trainer.max_epochs", "1"]) == 0
    run = tmp_path / "demo" / "dense"
    first = json.loads((run / "report.json").read_text())
    assert "resumed" not in first
    last = run / "checkpoints" / "last.ckpt"
    # The seconds the checkpoint carries (the run up to its save, not the report written after it).
    before = torch.load(last, map_location="cpu", weights_only=False)["callbacks"]["ReportWriter"]["seconds"]
    assert 0 < before <= first["seconds"]["total"]
    assert train_main(["fit", *args, "--trainer.max_epochs", "2", "--ckpt_path", str(last)]) == 0
    report = json.loads((run / "report.json").read_text())
    assert report["resumed"] == {"from_epoch": 1, "from_step": 2}
    assert report["seconds"]["total"] > before
    assert pd.read_csv(run / "metrics.csv").dropna(subset=["val/acc"])["epoch"].tolist() == [0, 1]
