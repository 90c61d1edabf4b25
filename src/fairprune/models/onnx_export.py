"""A network as an ONNX file with a dynamic batch dimension, and ONNX Runtime sessions on it.

:func:`export_onnx` writes a plain network (no pruning masks: :func:`fairprune.models.deploy.plain_copy`)
with one input, ``images`` (batch × channels × height × width; the batch dimension is dynamic), and
one output, ``logits``. Two exporters: torch's current one (``dynamo=True``, ``torch.export`` and
onnxscript; seconds per model, opset 18 or later) and the TorchScript one (``dynamo=False``, a
fraction of a second; the deploy figures use it to keep a pruning report cheap). ONNX Runtime's
graph optimisations fold BatchNorm into the convolutions either way, so the two files run equally
fast (``bench/deploy.py`` measures both).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fairprune.errors import UserError

INPUT, OUTPUT = "images", "logits"
#: The oldest opset torch's current exporter writes.
DYNAMO_MIN_OPSET = 18


@contextlib.contextmanager
def _quiet_exporter():
    """The exporters' progress lines, deprecation notices and fallback logging stay out of the output."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "onnxscript")]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def export_onnx(model: nn.Module, path: str | Path, input_shape: Sequence[int], opset: int = DYNAMO_MIN_OPSET,
                dynamo: bool = True) -> Path:
    """Write ``model`` (eval mode, plain) to ``path`` as one ONNX file whose batch dimension is
    dynamic; ``input_shape`` is one image's (channels, height, width). Not atomic: callers that
    write a user's file go through :func:`fairprune.storage.atomic.replace_atomically`.

    An opset the exporter cannot write, or a network it cannot trace, is a :class:`UserError`."""
    if dynamo and opset < DYNAMO_MIN_OPSET:
        raise UserError(f"opset {opset} is older than the {DYNAMO_MIN_OPSET} torch's current ONNX exporter writes; pass "
                        f"--opset {DYNAMO_MIN_OPSET} or later, or --dynamo false for the TorchScript exporter")
    path = Path(path)
    example = torch.randn(2, *input_shape)  # batch 2: a batch of 1 could be traced as a constant dimension
    try:
        with _quiet_exporter(), torch.no_grad():
            if dynamo:
                torch.onnx.export(model, (example,), str(path), dynamo=True, external_data=False, opset_version=opset,
                                  input_names=[INPUT], output_names=[OUTPUT],
                                  dynamic_shapes=({0: torch.export.Dim("batch")},), verbose=False)
            else:
                torch.onnx.export(model, (example,), str(path), dynamo=False, opset_version=opset,
                                  input_names=[INPUT], output_names=[OUTPUT],
                                  dynamic_axes={INPUT: {0: "batch"}, OUTPUT: {0: "batch"}})
    except UserError:
        raise
    except Exception as err:  # the exporters raise many kinds of errors for an unsupported network or opset
        reason = " ".join(str(err).split())[:200]
        raise UserError(f"cannot export {type(model).__name__} to ONNX opset {opset} "
                        f"({'dynamo' if dynamo else 'TorchScript'} exporter: {type(err).__name__}: {reason})") from None
    if not path.is_file():
        raise UserError(f"the ONNX exporter wrote no file at '{path}'")
    return path


def ort_session(path: str | Path, threads: int) -> Any:
    """An ONNX Runtime CPU session on ``path`` running each operator on ``threads`` threads
    (``intra_op_num_threads``) and one operator at a time (sequential execution, one inter-op thread).

    Its worker threads sleep when a run ends instead of spin-waiting for the next one (ONNX
    Runtime's default): a spinning pool keeps the cores busy for a while after each run, so
    whatever is timed next on the machine (PyTorch's run of the same network, in the deploy
    figures) is slowed by it — twice as slow on the demo networks on 2 cores."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = int(threads)
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3  # errors only
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as err:  # onnxruntime's own exception types (Fail, InvalidGraph, NotImplemented, ...)
        reason = " ".join(str(err).split())[:200]
        raise UserError(f"ONNX Runtime cannot load '{path}' ({type(err).__name__}: {reason})") from None


def max_abs_differences(model: nn.Module, session: Any, input_shape: Sequence[int], batch_sizes: Sequence[int] = (2, 5),
                        seed: int = 0) -> dict[int, float]:
    """Per batch size, the largest absolute difference between ONNX Runtime's outputs and
    PyTorch's (eval mode, no_grad) on the same random normal batch."""
    generator = torch.Generator().manual_seed(seed)
    found: dict[int, float] = {}
    model.eval()
    for batch in batch_sizes:
        images = torch.randn(batch, *input_shape, generator=generator)
        with torch.no_grad():
            expected = model(images).float().numpy()
        got = session.run(None, {INPUT: images.numpy()})[0]
        if got.shape != expected.shape:
            raise UserError(f"ONNX Runtime's output has shape {tuple(got.shape)} for a batch of {batch}, PyTorch's "
                            f"{tuple(expected.shape)}: the exported batch dimension is not dynamic")
        found[batch] = float(np.abs(got.astype(np.float64) - expected.astype(np.float64)).max())
    return found
