"""What a run's figures depend on besides its settings and data: the versions of the libraries that
compute them and the machine they ran on. Every ``report.json`` holds it under ``environment``,
and every model card shows it, so two runs whose figures differ can be told apart by more than
their configs.

>>> env = environment()
>>> sorted(env)
['hardware', 'versions']
>>> import torch; env["versions"]["torch"] == torch.__version__
True
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from functools import cache
from importlib import metadata
from typing import Any

from fairprune.reporting.report import markdown_text

#: The distributions whose versions decide a report's figures, by the names pip lists them under.
LIBRARIES = ("fairprune", "torch", "torchvision", "lightning", "torchmetrics", "transformers", "lm_eval", "numpy",
             "accelerate", "compressed-tensors")


@cache
def versions() -> dict[str, str | None]:
    """``python`` and each of :data:`LIBRARIES` (None: not installed; ``torch`` as
    ``torch.__version__`` gives it, which names its build), and ``cuda``, the CUDA release torch
    was built for (None: a CPU-only build)."""
    import torch

    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    if found["fairprune"] is None:  # the source tree on sys.path, not installed
        from fairprune import __version__

        found["fairprune"] = __version__
    found["torch"] = str(torch.__version__)  # with its build's local label: ``+cpu``, ``+cu130``
    found["cuda"] = torch.version.cuda
    return found


@cache
def cpu_model() -> str | None:
    """The processor's model name from ``/proc/cpuinfo`` (Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware") and value.strip():  # x86; ARM boards
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def gpus() -> list[str]:
    """The names of the GPUs torch can use (empty: none)."""
    import torch

    if torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    return ["Apple MPS"] if mps is not None and mps.is_available() else []


#: Environment variables that choose the CPU kernels, and so the float sums (``make demo`` sets them).
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA", "MKL_CBWR")


def hardware() -> dict[str, Any]:
    """The machine: ``cpu`` (model name), ``logical_cores`` (all of the machine's),
    ``usable_cores`` (those this process may run on), ``torch_threads``, ``gpus``, ``os`` and
    ``cpu_kernels``: torch's CPU capability in use and the kernel variables that are set."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    kernels = {"torch": torch.backends.cpu.get_cpu_capability(),
               **{name: os.environ[name] for name in KERNEL_VARIABLES if name in os.environ}}
    return {"cpu": cpu_model(), "logical_cores": os.cpu_count(), "usable_cores": usable,
            "torch_threads": torch.get_num_threads(), "gpus": gpus(), "os": platform.platform(),
            "cpu_kernels": kernels,
            **({"threads_chosen": os.environ["FAIRPRUNE_THREADS_CHOSEN"]} if "FAIRPRUNE_THREADS_CHOSEN" in os.environ else {})}


def environment() -> dict[str, Any]:
    """``{"versions": ..., "hardware": ...}``: what every ``report.json`` records under ``environment``."""
    return {"versions": dict(versions()), "hardware": hardware()}


def _text(value: Any) -> str:
    return str(markdown_text(str(value)))


def card_section(environment: Any) -> list[str]:
    """The model card's ``## Environment`` lines for a report's ``environment`` (none without one;
    every name is Markdown text)."""
    environment = environment if isinstance(environment, Mapping) else {}
    versions, hardware = (environment.get(k) if isinstance(environment.get(k), Mapping) else {} for k in ("versions", "hardware"))
    lines = []
    named = [f"{_text(name)} {_text(v)}" for name, v in versions.items() if name not in ("python", "cuda") and isinstance(v, str)]
    if named:
        python = f"; Python {_text(versions['python'])}" if isinstance(versions.get("python"), str) else ""
        lines += [f"Libraries: {', '.join(named)}{python}.", ""]
    if hardware:
        cores = [f"{hardware[key]} {label}" for key, label in
                 (("logical_cores", "logical cores"), ("usable_cores", "usable"), ("torch_threads", "torch threads"))
                 if isinstance(hardware.get(key), int)]
        cpu = _text(hardware.get("cpu") or "unknown CPU") + (f" ({', '.join(cores)})" if cores else "")
        gpus = [_text(g) for g in hardware["gpus"] if isinstance(g, str)] if isinstance(hardware.get("gpus"), list) else []
        cuda = f" (CUDA {_text(versions['cuda'])})" if isinstance(versions.get("cuda"), str) else ""
        system = f"; {_text(hardware['os'])}" if isinstance(hardware.get("os"), str) else ""
        kernels = hardware.get("cpu_kernels") if isinstance(hardware.get("cpu_kernels"), Mapping) else {}
        named_kernels = ", ".join(f"{_text(k)}={_text(v)}" for k, v in kernels.items() if isinstance(v, str))
        kernel_text = f"; CPU kernels: {named_kernels}" if named_kernels else ""
        lines += [f"Machine: {cpu}; GPU: {', '.join(gpus) + cuda if gpus else 'none'}{system}{kernel_text}.", ""]
    return ["## Environment", "", *lines] if lines else []
