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
