import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Synthetic data goes to a per-session cache, never into the working tree."""
    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield


@pytest.fixture
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices gain nothing from threads, and on a shared 2-core machine they thrash."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def dense_ckpt(tmp_path_factory) -> Path:
    """A small dense vision checkpoint trained by the real CLI on the bundled synthetic faces."""
    from fairprune.cli.train import main

    out = tmp_path_factory.mktemp("dense")
    os.environ["FAIRPRUNE_CACHE"] = str(tmp_path_factory.getbasetemp() / "cache")
    status = main(["fit", "--config", str(ROOT / "configs" / "vision" / "demo.yaml"), "--trainer.max_epochs", "1",
                   "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2", "--trainer.accelerator", "cpu",
                   "--trainer.logger.init_args.save_dir", str(out), "--data.synthetic_size", "300",
                   "--data.image_size", "32", "--data.batch_size", "16"])
    assert status == 0
    return out / "demo" / "dense" / "checkpoints" / "last.ckpt"
