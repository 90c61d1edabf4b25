import errno
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


@pytest.fixture(scope="session", autouse=True)
def _session_environment(tmp_path_factory):
    """For the whole session, session- and module-scoped fixtures included (they are set up before
    any function-scoped fixture): synthetic data goes to one cache shared by every test (generating
    it is the slow part), the hub is offline, and the working directory is a scratch folder, so
    nothing lands in the working tree."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FAIRPRUNE_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.chdir(tmp_path_factory.mktemp("session-cwd"))
        yield


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path, monkeypatch):
    """Every test runs in its own ``tmp_path``: relative outputs (``runs/``, ``lightning_logs/``, a
    ``default_root_dir`` left unset) land there. Reach repository files through ``repo_root`` /
    ``ROOT`` (absolute), never through the working directory."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def repo_root() -> Path:
    """The repository checkout (configs/, data/), absolute."""
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
    status = main(["fit", "--config", str(ROOT / "configs" / "vision" / "demo.yaml"), "--trainer.max_epochs", "1",
                   "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2", "--trainer.accelerator", "cpu",
                   "--trainer.logger.init_args.save_dir", str(out), "--data.synthetic_size", "300",
                   "--data.image_size", "32", "--data.batch_size", "16"])
    assert status == 0
    return out / "demo" / "dense" / "checkpoints" / "last.ckpt"


@pytest.fixture
def locked(tmp_path, monkeypatch) -> Path:
    """A folder nobody may write to (mode 0555). Root ignores modes, so for root the two system
    calls that create things, ``os.open`` with O_CREAT / O_TMPFILE and ``os.mkdir``, are refused
    there as the kernel would refuse them for anyone else."""
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:
        real_open, real_mkdir = os.open, os.mkdir
        creating = os.O_CREAT | getattr(os, "O_TMPFILE", 0)

        def inside(path) -> bool:
            return Path(os.path.abspath(os.fspath(path))).is_relative_to(folder)

        def guarded_open(path, flags, *args, **kwargs):
            if flags & creating and inside(path):
                raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
            return real_open(path, flags, *args, **kwargs)

        def guarded_mkdir(path, *args, **kwargs):
            if inside(path):
                raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
            return real_mkdir(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", guarded_open)
        monkeypatch.setattr(os, "mkdir", guarded_mkdir)
    yield folder
    folder.chmod(0o755)
