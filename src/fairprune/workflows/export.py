"""``prune.py export``: a trained or pruned vision checkpoint as an ONNX file, checked against PyTorch.

The checkpoint is rebuilt as the vision commands rebuild it (:func:`fairprune.workflows.vision.load_trained`:
read as data, never unpickled as code), its pruning masks made permanent in a copy, and the network
exported with a dynamic batch dimension. Before the file is put in place, ONNX Runtime runs it on a
random batch of 2 and one of 5 and its outputs are compared with PyTorch's: a difference over the
tolerance leaves no file behind.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from fairprune.errors import UserError
from fairprune.hub.checks import available_memory, human_bytes
from fairprune.models.deploy import input_shape_of, plain_copy
from fairprune.models.onnx_export import DYNAMO_MIN_OPSET, export_onnx, max_abs_differences, ort_session
from fairprune.storage.atomic import replace_atomically
from fairprune.storage.lock import check_apart
from fairprune.workflows.vision import load_trained

#: The batch sizes ONNX Runtime's outputs are checked at (two: the batch dimension is dynamic).
CHECK_BATCHES = (2, 5)


def _check_writable(path: Path, output: str) -> None:
    """A one-line error unless ``path``'s folder is (or can be created as) one this process can
    write to; creates nothing."""
    probe = path.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"--output '{output}' cannot be created: '{probe}' is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        raise UserError(f"cannot write --output '{output}' ({err.strerror or type(err).__name__} in '{probe}'); "
                        "pass a file in a folder you can write to") from None


def activation_numel(network: Any, shape: tuple[int, ...], batch: int) -> int | None:
    """Numbers every layer of ``network`` outputs for a ``batch`` of images of ``shape``, summed:
    the network run on the meta device (shapes only, nothing allocated); None when it cannot be."""
    import copy

    import torch

    outputs = [0]

    def count(_module: Any, _inputs: Any, output: Any) -> None:
        for tensor in output if isinstance(output, (tuple, list)) else [output]:
            if isinstance(tensor, torch.Tensor):
                outputs[0] += tensor.numel()

    try:
        meta = copy.deepcopy(network).to("meta")
        handles = [m.register_forward_hook(count) for m in meta.modules() if not list(m.children())]
        with torch.no_grad():
            meta(torch.empty(batch, *shape, device="meta"))
        for handle in handles:
            handle.remove()
    except Exception:  # noqa: BLE001 - a layer meta tensors cannot run: the input alone is checked
        return None
    return outputs[0]


def check_memory(shape: tuple[int, ...], network: Any = None, source: str = "the checkpoint's image_size") -> None:
    """Refuse, in one line, an input size whose check batches cannot fit in the memory available
    now: the largest check batch's input (float32) and, given the network, every layer's output for
    it (a rough bound on the activations PyTorch, the exporter and ONNX Runtime hold)."""
    available = available_memory()
    batch = max(CHECK_BATCHES)
    numel = batch
    for size in shape:
        numel *= int(size)
    needed = 4 * numel
    activations = activation_numel(network, shape, batch) if network is not None else None
    needed += 4 * (activations or 0)
    if available is not None and needed > available:
        what = "input and activations" if activations else "input"
        raise UserError(f"images of {' x '.join(map(str, shape))} ({source}) need about {human_bytes(needed)} for the "
                        f"{what} of a check batch of {batch}, more than the {human_bytes(available)} of memory "
                        "available; pass a smaller --image_size (the size the model was trained at)")


def export_vision(ckpt: str, output: str = "model.onnx", opset: int = DYNAMO_MIN_OPSET, atol: float = 1e-4,
                  image_size: int | None = None, dynamo: bool = True) -> dict[str, Any]:
    """Export a vision checkpoint (train.py fit / prune.py vision) to ONNX with a dynamic batch
    dimension, and check ONNX Runtime's outputs against PyTorch's before writing the file.

    Args:
        ckpt: checkpoint written by train.py fit or prune.py vision (e.g. runs/demo/dense/checkpoints/last.ckpt).
        output: the ONNX file to write (written atomically; input 'images', output 'logits').
        opset: ONNX opset (torch's current exporter writes 18 or later).
        atol: largest absolute difference allowed between ONNX Runtime's and PyTorch's outputs.
        image_size: input height and width (default: the checkpoint's data setting).
        dynamo: torch's current exporter (torch.export); false: the TorchScript exporter, faster, older opsets.
    """
    path = Path(output)
    if path.is_dir():
        raise UserError(f"--output '{output}' is a directory; pass the ONNX file to write, e.g. '{path / 'model.onnx'}'")
    if not atol > 0:
        raise UserError(f"--atol must be a positive tolerance, e.g. 1e-4; got {atol}")
    if image_size is not None and image_size < 1:
        raise UserError(f"--image_size must be a positive number of pixels; got {image_size}")
    check_apart([path], [ckpt])  # the ONNX file must not replace the checkpoint it is exported from
    _check_writable(path, output)  # before the checkpoint is loaded
    source = f"--image_size {image_size}" if image_size else "the checkpoint's image_size"
    if image_size:
        check_memory((3, image_size, image_size), source=source)  # the input alone, before anything is loaded
    model, datamodule = load_trained(ckpt)
    shape = (3, image_size, image_size) if image_size else input_shape_of(datamodule)
    if shape is None:
        raise UserError(f"checkpoint '{ckpt}' records no image_size for its data; pass --image_size")
    network = plain_copy(getattr(model, "net", model))
    check_memory(shape, network, source)
    found: dict[str, Any] = {}

    def write(tmp: Path) -> None:
        export_onnx(network, tmp, shape, opset, dynamo)
        found.update(max_abs_differences(network, ort_session(tmp, 1), shape, CHECK_BATCHES))
        worst = max(found.values())
        if not worst <= atol:  # a NaN difference fails too
            raise UserError(f"ONNX Runtime's outputs differ from PyTorch's by up to {worst:.3g}, over --atol {atol:g} "
                            f"(batches of {' and '.join(map(str, CHECK_BATCHES))}); '{output}' was not written")

    try:
        replace_atomically(path, write)
    except OSError as err:
        raise UserError(f"cannot write --output '{output}' ({err.strerror or type(err).__name__}); pass a file "
                        "in a folder you can write to") from None
    worst = max(found.values())
    print(f"[export] {path} ({path.stat().st_size / 1e6:.2f} MB, opset {opset}, input images: batch x "
          f"{' x '.join(map(str, shape))}, dynamic batch); ONNX Runtime vs PyTorch on batches of "
          f"{' and '.join(map(str, CHECK_BATCHES))}: max abs difference {worst:.3g} (tolerance {atol:g})", flush=True)
    return {"output": str(path), "bytes": path.stat().st_size, "opset": opset, "input_shape": list(shape),
            "exporter": "dynamo" if dynamo else "torchscript", "max_abs_difference": worst,
            "max_abs_difference_per_batch": {str(b): d for b, d in found.items()}, "atol": atol}
