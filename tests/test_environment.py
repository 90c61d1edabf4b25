"""``environment()``: the library versions and the machine every ``report.json`` records (each
report kind is checked on real runs in tests/test_docs.py), and the model card's Environment
section built from them."""

from __future__ import annotations

import os
from importlib import metadata

import lightning
import torch

from fairprune.reporting.card_classifier import ClassifierCard
from fairprune.reporting.environment import LIBRARIES, environment
from fairprune.reporting.model_card import model_card


def test_the_versions_are_the_installed_ones():
    versions = environment()["versions"]
    assert versions["torch"] == torch.__version__ and versions["lightning"] == lightning.__version__
    assert versions["numpy"] == metadata.version("numpy") and versions["lm_eval"] == metadata.version("lm_eval")
    assert set(LIBRARIES) | {"python", "cuda"} == set(versions) and versions["cuda"] == torch.version.cuda


def test_the_hardware_is_this_machine_with_the_threads_torch_runs_now():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        hardware = environment()["hardware"]
    finally:
        torch.set_num_threads(before)
    assert hardware["torch_threads"] == 1 and hardware["logical_cores"] == os.cpu_count()
    assert 1 <= hardware["usable_cores"] <= hardware["logical_cores"]
    assert isinstance(hardware["cpu"], str) and hardware["cpu"] and hardware["os"]
    cuda = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    assert hardware["gpus"] == cuda or (not cuda and hardware["gpus"] == ["Apple MPS"])
    assert hardware["cpu_kernels"]["torch"] == torch.backends.cpu.get_cpu_capability()


def test_the_kernel_variables_that_are_set_are_recorded(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    kernels = environment()["hardware"]["cpu_kernels"]
    assert kernels["MKL_CBWR"] == "AVX2" and "DNNL_MAX_CPU_ISA" not in kernels
    card = model_card({"method": "dense", "model": "mobilenet_v2", "metrics": {"accuracy": 0.9},
                       "environment": environment()}, card=ClassifierCard)
    assert "MKL_CBWR=AVX2" in card[card.index("## Environment"):]


def test_gpus_are_named_when_torch_sees_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"GPU {i}")
    assert environment()["hardware"]["gpus"] == ["GPU 0", "GPU 1"]


def test_the_model_card_shows_the_environment():
    report = {"method": "dense", "model": "mobilenet_v2", "metrics": {"accuracy": 0.9}, "environment": environment()}
    report["environment"]["hardware"].update(gpus=["GPU|0"], cpu="Some CPU")
    card = model_card(report, card=ClassifierCard)
    section = card[card.index("## Environment"):card.index("## How to load")]
    assert f"torch {torch.__version__}" in section and f"lightning {lightning.__version__}" in section
    assert "Some CPU" in section and "GPU&#124;0" in section  # a name with a table bar stays text
    assert "## Environment" not in model_card({"method": "dense", "metrics": {"accuracy": 0.9}}, card=ClassifierCard)
