"""DDP: Lightning's ``ddp`` strategy, two processes on the CPU (gloo), through the real command lines.

Every run must finish and write its report once (rank 0), measure every sample of a split exactly
once (no padded repeats, no reference counted once per process), and prune every replica alike —
with the figures and masks one process gets.

Lightning's launcher starts rank 1 by running the command again, so the commands run as
subprocesses (``python train.py ...`` / ``python prune.py ...``, in the test's folder, absolute
paths), never pytest itself. Every process runs one thread (``OMP_NUM_THREADS=1`` for the
commands, ``one_thread`` for the one-process runs in this process): the same float summation
order on both sides, so a pruning step taken on the same weights yields the same masks.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pandas as pd
import pytest
import torch
from torch.utils.data import DistributedSampler

from fairprune.callbacks.pruning import IterativePruning
from fairprune.pruning.masks import prunable_targets
from processes import clean_env, run_ranks

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 300  # seconds per command: far above the ~20 s one takes, bounded if a rank ever hangs
DDP = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
# One pruning step at the start of the first epoch, before any training: DDP and one process prune
# the same weights.
ONE_STEP = {"method": "fairgrape", "target_sparsity": 0.5, "keep_per_iter": 0.5, "retrain_epochs": 1, "start_epoch": 0}


class RankProbe(L.Callback):
    """Loaded by class path into the commands below: each process saves what it holds when fit
    ends (masks, the pruning callback's reference) and what the sanity check measured."""

    def __init__(self, folder: str) -> None:
        self.folder, self.sanity = Path(folder), None

    def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.sanity = copy.deepcopy(pl_module.last_results.get("val"))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pruning = next(c for c in trainer.callbacks if isinstance(c, IterativePruning))
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.save({"masks": {t.name: t.mask.clone() for t in prunable_targets(pl_module)},
                    "reference": pruning.reference, "sanity": self.sanity}, self.folder / f"rank{trainer.global_rank}.pt")


def launch(script: str, args: list[str], cwd: Path) -> str:
    """Run ``python <script> args`` in ``cwd`` (bounded); its output, once it succeeded."""
    env = clean_env()
    paths = [str(ROOT / "tests"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(paths))
    cwd.mkdir(parents=True, exist_ok=True)
    # A session of its own: rank 1 is rank 0's child, and a hung run is killed with all its ranks.
    proc = subprocess.Popen([sys.executable, str(ROOT / script), *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{script} {args[0]} under DDP did not finish in {TIMEOUT} s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-5000:]
    return out


def masks(ckpt: Path) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    found = {k: v for k, v in state.items() if k.endswith("weight_mask")}
    assert found, f"{ckpt} holds no pruning masks"
    return found


def same_masks(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].bool(), b[k].bool()) for k in a)


def counts(report: dict) -> dict[str, int]:
    return {g: v["count"] for g, v in report["groups"].items()}


def split_counts(dataset, names: list[str]) -> dict[str, int]:
    """Samples per group of a split, as FaceDataset holds them."""
    per_group = torch.bincount(dataset.groups, minlength=len(names))
    return {name: int(per_group[k]) for k, name in enumerate(names)}


# ----------------------------------------------------------------------------------------------
# train.py fit with the FairGRAPE callback


@pytest.fixture(scope="module")
def fit_runs(tmp_path_factory, one_thread) -> dict:
    """``train.py fit`` on the demo config (tiny) with one FairGRAPE step at epoch 0, under DDP
    (a subprocess) and in one process (here), from the same seed."""
    from fairprune.cli.train import main as train_main

    root = tmp_path_factory.mktemp("ddp-fit")
    runs = {}
    for name in ("ddp", "one"):
        extra = root / f"{name}.yaml"
        extra.write_text(json.dumps({"trainer": {"callbacks": [
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}},
            {"class_path": "fairprune.callbacks.pruning.IterativePruning", "init_args": ONE_STEP},
            {"class_path": "test_ddp.RankProbe", "init_args": {"folder": str(root / name / "probe")}},
        ]}}))
        args = ["fit", "--config", str(ROOT / "configs" / "vision" / "demo.yaml"), "--config", str(extra),
                "--data.synthetic_size", "400", "--data.image_size", "32", "--data.batch_size", "16",
                "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
                "--trainer.num_sanity_val_steps", "-1",  # the whole split, before any training
                "--trainer.logger.init_args.save_dir", str(root / name)]
        if name == "ddp":
            runs["printed"] = launch("train.py", [*args, *DDP], root / "cwd")
        else:
            assert train_main([*args, "--trainer.accelerator", "cpu"]) == 0
        runs[name] = root / name
    return runs


def _run(runs: dict, name: str) -> Path:
    return runs[name] / "demo" / "dense"


def test_fit_under_ddp_finishes_and_writes_its_report_once(fit_runs):
    run = _run(fit_runs, "ddp")
    for file in ("report.json", "groups.csv", "sparsity.csv", "group_shares.csv", "metrics.csv", "checkpoints/last.ckpt"):
        assert (run / file).is_file(), file
    # Two processes joined (Lightning's start-up notes, the backend among them, are not printed).
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in fit_runs["printed"]
    assert fit_runs["printed"].count("val results (") == 1  # rank 0 alone wrote (and printed) the report
    report = json.loads((run / "report.json").read_text())
    assert report["split"] == "val" and report["method"] == "fairgrape"
    assert report["achieved_sparsity"] == pytest.approx(0.5, abs=1e-3)


def test_fit_under_ddp_counts_every_sample_once(fit_runs):
    from fairprune.data.faces import FaceDataModule

    data = FaceDataModule("synthetic", image_size=32, batch_size=16, synthetic_size=400)
    data.setup("fit")
    val = split_counts(data.val_set, data.group_names)
    ddp, one = (json.loads((_run(fit_runs, n) / "report.json").read_text()) for n in ("ddp", "one"))
    assert counts(ddp) == counts(one) == val
    # The dense reference (taken at the pruning step, before any training: the same weights on
    # both sides) is one process's, counts and rates alike.
    assert ddp["reference"]["groups"] == one["reference"]["groups"]
    assert ddp["reference"]["metrics"] == one["reference"]["metrics"]
    assert counts(ddp["reference"]) == val
    # Every logged validation counts each sample once (39 images are not measured as 40).
    metrics = pd.read_csv(_run(fit_runs, "ddp") / "metrics.csv")
    logged = metrics.dropna(subset=[f"val/count/{g}" for g in val])
    assert len(logged) >= 1
    for group, n in val.items():
        assert (logged[f"val/count/{group}"] == n).all(), group
    # Lightning's validation loop on the same (initial) weights: the sanity check over the whole
    # split gives one process's figures on every rank.
    probes = [torch.load(fit_runs[n] / "probe" / f"rank{r}.pt", weights_only=False) for n, r in
              (("ddp", 0), ("ddp", 1), ("one", 0))]
    assert probes[0]["sanity"] == probes[1]["sanity"] == probes[2]["sanity"]
    assert counts(probes[0]["sanity"]) == val


def test_fit_under_ddp_prunes_every_replica_alike(fit_runs):
    rank0, rank1 = (torch.load(fit_runs["ddp"] / "probe" / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert same_masks(rank0["masks"], rank1["masks"])
    assert rank0["reference"] == rank1["reference"]
    saved = masks(_run(fit_runs, "ddp") / "checkpoints" / "last.ckpt")
    assert same_masks({f"{k}.weight_mask": v for k, v in rank0["masks"].items()}, saved)
    assert same_masks(saved, masks(_run(fit_runs, "one") / "checkpoints" / "last.ckpt"))


# ----------------------------------------------------------------------------------------------
# prune.py vision


def test_prune_vision_under_ddp_matches_one_process(dense_ckpt, tmp_path, one_thread):
    from fairprune.cli.prune import main as prune_main
    from fairprune.workflows.vision import load_trained

    pruning = {k: v for k, v in ONE_STEP.items() if k != "start_epoch"}
    trainer = {"accelerator": "cpu", "limit_train_batches": 2, "enable_progress_bar": False}
    args = ["vision", "--ckpt", str(dense_ckpt), "--pruning", json.dumps(pruning)]
    launch("prune.py", [*args, "--output", str(tmp_path / "ddp"),
                        "--trainer", json.dumps({**trainer, "strategy": "ddp", "devices": 2})], tmp_path / "cwd")
    assert prune_main([*args, "--output", str(tmp_path / "one"), "--trainer", json.dumps(trainer)]) == 0

    ddp_run, one_run = tmp_path / "ddp" / "fairgrape", tmp_path / "one" / "fairgrape"
    for file in ("report.json", "groups.csv", "sparsity.csv", "group_shares.csv", "checkpoints/last.ckpt"):
        assert (ddp_run / file).is_file(), file
    ddp, one = (json.loads((r / "report.json").read_text()) for r in (ddp_run, one_run))
    _, data = load_trained(dense_ckpt)
    data.setup("test")
    test = split_counts(data.test_set, data.group_names)
    assert ddp["split"] == "test" and counts(ddp) == counts(one) == test
    assert ddp["dense"]["groups"] == one["dense"]["groups"]  # the dense checkpoint, measured once
    assert counts(ddp["dense"]) == test
    # The compute-matched reference trained under DDP too, measured on the whole test split once.
    assert ddp["reference"]["method"] == "continued" and counts(ddp["reference"]) == test
    assert same_masks(masks(ddp_run / "checkpoints" / "last.ckpt"), masks(one_run / "checkpoints" / "last.ckpt"))


# ----------------------------------------------------------------------------------------------
# The other Lightning paths: post-training pruning of a causal LM, Diff-Pruning


def test_post_training_pruning_under_ddp(tmp_path):
    gpt2 = json.dumps({"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 64})
    launch("train.py", ["fit", "--config", str(ROOT / "configs" / "lm" / "tiny_gpt2_sparsegpt.yaml"),
                        "--data.corpus_docs", "150", "--data.seqlen", "32", "--data.batch_size", "8",
                        "--data.bpe_vocab_size", "400", "--model.init_args.config", gpt2,
                        "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2",
                        "--trainer.callbacks.init_args.calibration.nsamples", "4",
                        "--trainer.callbacks.init_args.calibration.seqlen", "32",
                        "--trainer.callbacks.init_args.calibration.device", "cpu",
                        "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), *DDP], tmp_path / "cwd")
    run = tmp_path / "runs" / "lm" / "tiny_gpt2_sparsegpt"
    assert (run / "model" / "config.json").is_file()  # the trained model, exported when training ended
    report = json.loads((run / "pruned-sparsegpt" / "report.json").read_text())
    assert report["achieved_sparsity"] == pytest.approx(0.5, abs=0.01)
    assert (run / "report.json").is_file()


def test_diff_pruning_under_ddp(tmp_path):
    from fairprune.models.text_classifier import tiny_bert_config

    launch("train.py", ["fit", "--config", str(ROOT / "configs" / "text" / "diffprune_bios_tiny.yaml"),
                        "--model.init_args.config", json.dumps(tiny_bert_config(max_position_embeddings=128)),
                        "--data.init_args.bios_size", "300", "--data.init_args.vocab_size_local", "400",
                        "--data.init_args.batch_size", "16",
                        "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "3",
                        "--trainer.callbacks.init_args.gated_epochs", "1", "--trainer.callbacks.init_args.finetune_epochs", "1",
                        "--trainer.callbacks.init_args.target_fraction", "0.02",
                        "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), *DDP], tmp_path / "cwd")
    run = tmp_path / "runs" / "bios" / "diff-pruning-tiny"
    assert (run / "diff").is_dir() and (run / "base" / "config.json").is_file()
    report = json.loads((run / "report.json").read_text())
    assert report["fraction_changed"] == pytest.approx(0.02, abs=0.005)
    assert sum(counts(report).values()) == 30  # the validation split (10 % of 300), each sample once


# ----------------------------------------------------------------------------------------------
# The pieces


def test_shard_sampler_covers_a_split_once_and_lightning_keeps_it():
    from fairprune.data.shards import ShardSampler, eval_sampler

    shards = [list(ShardSampler(39, rank=r, num_replicas=2)) for r in range(2)]
    assert sorted(shards[0] + shards[1]) == list(range(39))
    assert [len(ShardSampler(39, rank=r, num_replicas=2)) for r in range(2)] == [20, 19]
    assert isinstance(ShardSampler(39, rank=0, num_replicas=2), DistributedSampler)  # Lightning leaves it alone
    assert eval_sampler(39) is None  # no process group: every sample, in order


# Two fresh interpreters importing torch and the importance code only.
_IMPORTANCE = """
import sys, torch, torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from fairprune.pruning import importance as imp
from fairprune.pruning.masks import Target
rank, init_file, out_file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,), generator=g),
            torch.arange(5) % 2) for _ in range(4)]
targets = [Target("0", model[0]), Target("2", model[2])]
def scores(loader, n):
    return [imp.snip_scores(model, targets, loader, F.cross_entropy, "cpu", n),
            imp.grasp_scores(model, targets, loader, F.cross_entropy, "cpu", n),
            imp.group_scores(model, targets, loader, F.cross_entropy, "cpu", 2)]
if rank < 0:  # one process, every batch
    torch.save(scores(batches, 4), out_file)
    sys.exit()
dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
mine = batches[:1] if rank == 0 else batches[1:]  # uneven shards: the batch count must be the whole run's
got = scores(mine, 4)
if rank == 0:
    torch.save(got, out_file)
dist.destroy_process_group()
"""


def test_importance_scores_of_two_processes_are_one_process_scores(tmp_path):
    """SNIP, GraSP and FairGRAPE's per-group scores from two shards (gloo) equal the scores of one
    process over every batch: sums, sample and batch counts are all reduced."""
    run_ranks(_IMPORTANCE, lambda r: [str(r), str(tmp_path / "init"), str(tmp_path / f"{r}.pt")])
    one, two = torch.load(tmp_path / "-1.pt"), torch.load(tmp_path / "0.pt")
    for method, a, b in zip(("snip", "grasp", "fairgrape"), one, two):
        for name in a:
            # Summation order differs (and the per-group sums are float32): equal up to rounding.
            torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-9, msg=f"{method} {name}")
