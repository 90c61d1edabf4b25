"""What a network costs where it is deployed: its size, its arithmetic and its CPU latency.

:func:`deploy_figures` measures one network, :func:`deploy_side_by_side` several in one run (a
pruned model and its dense reference), each as the plain network a deployment runs
(:func:`plain_copy`: pruning masks made permanent, eval mode, on the CPU):

- ``stored_numel``: numbers a saved state dict holds (parameters and buffers, BatchNorm
  statistics included); ``parameters`` and ``nonzero_parameters`` count the parameters alone;
- ``bytes``: that state dict written as safetensors, the file's size; ``onnx_bytes``: the ONNX file's;
- ``macs``: multiply-accumulates of one image through every convolution and linear layer
  (``nonzero_macs``: those whose weight is not zero, what a kernel that skipped zeros would do);
- ``ms_per_image``: median milliseconds per image over the timings of a batch's forward (each
  timing as many forwards in a row as take ``min_timing_s``, so a fast network is timed warm),
  after ``warmup`` untimed ones, in PyTorch (eval, ``no_grad``) and in ONNX Runtime (the network
  exported with a dynamic batch dimension), per batch size, on ``threads`` CPU threads in both
  (``ms_per_image_best``: the fastest timing, what an idle machine approaches). The timings of
  all networks and both runtimes take turns, so load on the machine hits them alike; there are
  ``repeats`` of each, fewer (at least ``min_repeats``) when a round of them takes longer than
  ``budget_s`` per network and runtime, so a large model costs seconds, not minutes.

Zeroed weights (unstructured sparsity) change ``nonzero_*`` only: the tensors keep their shapes, so
bytes, MACs and latency stay the dense model's. Removing channels (structured pruning) shrinks them all.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from copy import deepcopy
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize, prune

from fairprune.models.onnx_export import INPUT, export_onnx, ort_session


@dataclass(frozen=True)
class DeploySettings:
    """How :func:`deploy_figures` measures; the defaults take a few seconds per small model.

    Args:
        batch_sizes: batch sizes timed.
        warmup: untimed forwards per network, runtime and batch size before the timings.
        repeats: most timings per network, runtime and batch size; the median is reported.
        min_repeats: fewest timings, whatever the budget.
        budget_s: seconds of timings per network, runtime and batch size after which no new round
            starts (None: always ``repeats``).
        min_timing_s: a timing makes as many forwards in a row as take this long (one for a slow forward).
        onnx: also export to ONNX and time ONNX Runtime.
        opset: ONNX opset of the exported file.
        dynamo: export with torch's current exporter (seconds per model) instead of the TorchScript one.
    """

    batch_sizes: tuple[int, ...] = (1, 32)
    warmup: int = 2
    repeats: int = 25
    min_repeats: int = 3
    budget_s: float | None = 0.1
    min_timing_s: float = 0.01
    onnx: bool = True
    opset: int = 18
    dynamo: bool = False


def plain_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the CPU in eval mode, with every ``torch.nn.utils.prune`` mask made
    permanent (``weight = weight_orig * weight_mask``, the mask gone) and every parametrization
    folded into its tensor, so it holds and runs exactly what a deployment would."""
    # A masked tensor (weight = weight_orig * weight_mask, recomputed every forward) may be a
    # non-leaf of an autograd graph, which deepcopy refuses: it is copied detached.
    memo = {id(getattr(module, hook._tensor_name)): getattr(module, hook._tensor_name).detach().clone()
            for module in model.modules() for hook in module._forward_pre_hooks.values()
            if isinstance(hook, prune.BasePruningMethod) and isinstance(getattr(module, hook._tensor_name, None), torch.Tensor)}
    copy = deepcopy(model, memo).cpu().eval()
    for module in copy.modules():
        for hook in list(module._forward_pre_hooks.values()):
            if isinstance(hook, prune.BasePruningMethod):
                prune.remove(module, hook._tensor_name)
        if parametrize.is_parametrized(module):
            for name in list(module.parametrizations):
                parametrize.remove_parametrizations(module, name, leave_parametrized=True)
    return copy


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run torch on ``threads`` CPU threads inside the block, then restore the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(int(threads))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def count_macs(model: nn.Module, input_shape: Sequence[int]) -> tuple[int, int]:
    """Multiply-accumulates of one image (``input_shape``: channels, height, width) through every
    convolution and linear layer of ``model``, and those of them whose weight is not zero.

    A convolution's output element takes ``in_channels / groups × kernel size`` of them, a linear
    layer's ``in_features``; a weight is used once per output position (the spatial size of a
    convolution's output, the tokens of a linear layer's)."""
    macs, nonzero = [0], [0]

    def count(module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        weight = module.weight
        if isinstance(module, nn.Linear):
            per_element = module.in_features
            positions = output.numel() // module.out_features
        else:
            per_element = weight.shape[1] * math.prod(weight.shape[2:])
            positions = output.numel() // module.out_channels
        macs[0] += output.numel() * per_element
        nonzero[0] += int(torch.count_nonzero(weight)) * positions

    handles = [m.register_forward_hook(count) for m in model.modules()
               if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)) and not isinstance(m, nn.modules.conv._ConvTransposeNd)]
    training = model.training
    device = next(model.parameters(), torch.zeros(0)).device
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, *input_shape, device=device))
    finally:
        model.train(training)
        for handle in handles:
            handle.remove()
    return macs[0], nonzero[0]


def stored_size(model: nn.Module) -> dict[str, int]:
    """What saving ``model``'s state dict stores: its numbers (``stored_numel``), its parameters
    (``parameters``, ``nonzero_parameters``) and the bytes of the safetensors file it makes."""
    from safetensors.torch import save_file

    state = {name: tensor.detach().cpu().contiguous().clone() for name, tensor in model.state_dict().items()}
    params = [p.detach() for p in model.parameters()]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.safetensors")
        save_file(state, path)
        size = os.path.getsize(path)
    return {"stored_numel": sum(t.numel() for t in state.values()), "parameters": sum(p.numel() for p in params),
            "nonzero_parameters": sum(int(torch.count_nonzero(p)) for p in params), "bytes": size}


def time_side_by_side(runs: Mapping[Any, Callable[[], None]], warmup: int, repeats: int, min_repeats: int = 1,
                      budget_s: float | None = None, min_timing_s: float = 0.0) -> dict[Any, list[float]]:
    """Seconds per call of each run (name → call), one figure per timing, timed after ``warmup``
    untimed calls each (fewer, at least one, once they took ``budget_s``). A timing makes as many calls in a row as take ``min_timing_s`` (one, for a
    call that long), so a fast call is timed warm, not dominated by the first. The runs take turns,
    in an order that rotates every round; rounds go on up to ``repeats``, and stop after
    ``min_repeats`` once the timings took ``budget_s`` per run (so every run gets as many)."""
    calls: dict[Any, int] = {}
    for name, run in runs.items():
        warm = 0.0
        for i in range(max(warmup, 1 if min_timing_s > 0 else 0)):
            if i >= 1 and budget_s is not None and warm >= budget_s:
                break  # one call that long warms up as well as several
            start = time.perf_counter()
            run()
            took = time.perf_counter() - start
            warm += took
            calls[name] = max(1, math.ceil(min_timing_s / max(took, 1e-9)))
        calls.setdefault(name, 1)
    names = list(runs)
    seconds: dict[Any, list[float]] = {name: [] for name in names}
    spent = 0.0
    for r in range(max(1, repeats)):
        if r >= max(1, min_repeats) and budget_s is not None and spent >= budget_s * len(names):
            break
        for name in names[r % len(names):] + names[:r % len(names)]:
            run, n = runs[name], calls[name]
            start = time.perf_counter()
            for _ in range(n):
                run()
            took = time.perf_counter() - start
            seconds[name].append(took / n)
            spent += took
    return seconds


def _torch_run(model: nn.Module, images: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            model(images)
    return run


def _ort_run(session: Any, images: torch.Tensor) -> Callable[[], None]:
    feed = {INPUT: images.numpy()}
    return lambda: session.run(None, feed)


def deploy_side_by_side(models: Mapping[str, nn.Module], input_shape: Sequence[int], threads: int | None = None,
                        settings: DeploySettings = DeploySettings()) -> dict[str, Any]:
    """The deploy figures of every network in ``models`` (name → network), measured in one run
    with their timings taking turns; returns ``{name: figures, ..., "settings": how}``.

    ``threads``: CPU threads for PyTorch and ONNX Runtime alike (default: torch's count now)."""
    if "settings" in models:
        raise ValueError("'settings' names how the figures were measured; give the network another name")
    threads = int(threads or torch.get_num_threads())
    input_shape = tuple(int(s) for s in input_shape)
    start = time.perf_counter()
    plain = {name: plain_copy(model) for name, model in models.items()}
    figures: dict[str, dict[str, Any]] = {}
    for name, model in plain.items():
        macs, nonzero_macs = count_macs(model, input_shape)
        figures[name] = {**stored_size(model), "macs": macs, "nonzero_macs": nonzero_macs, "onnx_bytes": None,
                         "ms_per_image": {"torch": {}, "ort": {}}, "ms_per_image_best": {"torch": {}, "ort": {}}}
    with tempfile.TemporaryDirectory() as folder, torch_threads(threads):
        sessions = {}
        if settings.onnx:
            for name, model in plain.items():
                path = export_onnx(model, Path(folder) / f"{len(sessions)}.onnx", input_shape, settings.opset,
                                   settings.dynamo)
                figures[name]["onnx_bytes"] = os.path.getsize(path)
                sessions[name] = ort_session(path, threads)
        generator, timings = torch.Generator().manual_seed(0), {}
        for batch in settings.batch_sizes:
            images = torch.randn(batch, *input_shape, generator=generator)
            runs = {(name, "torch"): _torch_run(model, images) for name, model in plain.items()}
            runs.update({(name, "ort"): _ort_run(session, images) for name, session in sessions.items()})
            found = time_side_by_side(runs, settings.warmup, settings.repeats, settings.min_repeats, settings.budget_s,
                                      settings.min_timing_s)
            for (name, runtime), seconds in found.items():
                figures[name]["ms_per_image"][runtime][str(batch)] = 1000.0 * statistics.median(seconds) / batch
                figures[name]["ms_per_image_best"][runtime][str(batch)] = 1000.0 * min(seconds) / batch
                timings[str(batch)] = len(seconds)
    facts = {**asdict(settings), "batch_sizes": list(settings.batch_sizes), "timings": timings, "threads": threads,
             "input_shape": list(input_shape), "exporter": "dynamo" if settings.dynamo else "torchscript",
             "ort_spinning": False,
             "onnxruntime": _ort_version() if settings.onnx else None, "torch": torch.__version__,
             "seconds": time.perf_counter() - start}
    return {**figures, "settings": facts}


def deploy_figures(model: nn.Module, input_shape: Sequence[int], threads: int | None = None,
                   settings: DeploySettings = DeploySettings()) -> dict[str, Any]:
    """The deploy figures of one network (see the module's description), with ``settings``: how
    they were measured (thread count, batch sizes, repeats, exporter, seconds taken)."""
    found = deploy_side_by_side({"model": model}, input_shape, threads, settings)
    return {**found["model"], "settings": found["settings"]}


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def input_shape_of(datamodule: Any) -> tuple[int, int, int] | None:
    """One image's (channels, height, width) from a data module's settings (``image_size``, square,
    three channels), or None when it has no such setting."""
    hparams = getattr(datamodule, "hparams", None) or {}
    size = hparams.get("image_size") if hasattr(hparams, "get") else None
    return (3, int(size), int(size)) if size else None


def deploy_report(models: Mapping[str, nn.Module], input_shape: Sequence[int] | None, threads: int | None = None,
                  settings: DeploySettings = DeploySettings()) -> dict[str, Any]:
    """The ``deploy`` entry of a pruning run's report: :func:`deploy_side_by_side` of ``models``
    (the pruned network and its dense reference). A run's other results do not depend on it, so a
    network that cannot be measured (no known input size, an export that fails) gives
    ``{"error": why}`` and a printed warning instead of an exception."""
    if input_shape is None:
        reason = "the data module has no image_size setting, so the input size is not known"
    else:
        try:
            return deploy_side_by_side(models, input_shape, threads, settings)
        except Exception as err:  # export or runtime failures of one network; the run's figures stand
            reason = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
    print(f"[prune] warning: no deploy figures ({reason})", flush=True)
    return {"error": reason}


#: Where :func:`slower_than_dense` reads the latency, in order: ONNX Runtime at batch 32 (what the
#: comparison's trade-off plot reads), then PyTorch.
LATENCY_PREFERENCE = (("ort", "32"), ("torch", "32"))
RUNTIME_NAMES = {"ort": "ONNX Runtime", "torch": "PyTorch"}


def slower_than_dense(deploy: Mapping[str, Any] | None, granularity: str = "channel", channel_multiple: int | None = None,
                      tolerance: float = 0.05) -> str | None:
    """A one-line warning when a channel-pruned run's deploy figures (report.json's ``deploy``) show
    the pruned network slower than the dense one by more than ``tolerance`` (timing noise), saying
    by how much and what to change; None otherwise (without both networks' figures, and at weight
    granularity, where both networks have the same shapes and a gap is timing noise)."""
    if not isinstance(deploy, Mapping) or granularity != "channel":
        return None  # weight pruning keeps every shape: its latencies are the dense network's, any gap is noise
    pruned, dense = deploy.get("pruned"), deploy.get("dense")
    if not isinstance(pruned, Mapping) or not isinstance(dense, Mapping):
        return None

    def ms(figures: Mapping[str, Any], runtime: str, batch: str) -> float | None:
        value = ((figures.get("ms_per_image") or {}).get(runtime) or {}).get(batch)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None

    batches = sorted({b for f in (pruned, dense) for r in (f.get("ms_per_image") or {}).values() if isinstance(r, Mapping)
                      for b in r}, key=lambda b: -int(b) if str(b).isdigit() else 0)
    for runtime, batch in [*LATENCY_PREFERENCE, *((r, b) for r in ("ort", "torch") for b in batches)]:
        slow, fast = ms(pruned, runtime, batch), ms(dense, runtime, batch)
        if slow is not None and fast is not None:
            break
    else:
        return None
    if slow <= fast * (1 + tolerance):
        return None
    where = f"{RUNTIME_NAMES[runtime]} at batch {batch} ({slow:.3g} vs {fast:.3g} ms per image)"
    now = f" (this run: {channel_multiple})" if channel_multiple is not None else ""
    advice = (f"kept channel counts that CPU kernels do not block well are slow: prune with "
              f"--pruning.channel_multiple 8 or 16{now}")
    return f"the pruned network is {slow / fast:.2g}x slower than the dense one in {where}; {advice}"
