"""Pruned LM folders with 4- or 8-bit weights that plain transformers loads: ``--quantize w4a16 | w8a16``.

After pruning, every prunable layer of the transformer blocks (:func:`fairprune.causal.families.family_of`'s
``block_linears``; embeddings, norms and the LM head stay as they are) is quantized per group along
its input: symmetric integers (``int4`` in [-8, 7] or ``int8`` in [-128, 127]), one scale per group
of ``group_size`` consecutive inputs of a row, zero point 0. A pruned zero is therefore stored as
the integer 0 and comes back as exactly 0.0. The scales come from compressed-tensors'
``calculate_qparams`` (largest magnitude of the group over half the integer range) and the rounding
is compressed-tensors' own ``quantize``; nothing is rounded by hand.

The folder is a compressed-tensors ``pack-quantized`` checkpoint (``config.json``'s
``quantization_config``: ``quant_method`` ``compressed-tensors``, ``format`` ``pack-quantized``,
one config group per group size, ``lm_head`` ignored): integers packed eight (int4) or four (int8)
to an ``int32`` (``<layer>.weight_packed``), ``<layer>.weight_scale`` and ``<layer>.weight_shape``.
Plain ``AutoModelForCausalLM.from_pretrained(folder)`` loads it with no fairprune import, on a CPU
too (its layers decompressed as they run); fairprune measures it loaded with transformers' own
``CompressedTensorsConfig(dequantize=True)`` (:func:`load_quantized`), which decompresses the layers
once into float weights, so every tool that reads a layer's ``weight`` sees them. The other tensors are stored in bfloat16 (float16 when the run's ``--dtype``
is float16): the 16-bit activations the scheme's name says.

Group size: ``group_size`` (128 by default) where it divides every quantized layer's input width;
otherwise the largest power of two below it that divides them all (SmolLM2's 576-wide inputs: 64,
for its 1,536-wide ``down_proj`` too), since compressed-tensors needs whole groups, the runtimes'
4-bit kernels take power-of-two groups and transformers' dequantize-on-load takes one group size
per checkpoint. A layer whose width allows no power-of-two group of at least
``min(group_size, 32)`` is refused in one line, as is a block layer that is not an ``nn.Linear``
(GPT-2's ``Conv1D``), which compressed-tensors does not quantize.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fairprune.errors import UserError
from fairprune.hub.formats import QUANTIZE

BITS = {"w4a16": 4, "w8a16": 8, "w4a16-gptq": 4, "w8a16-gptq": 8}
FORMAT = "pack-quantized"
SMALLEST_GROUP = 32  # below it the scales cost more than 0.5 bit a weight
GPTQ = "-gptq"


def is_gptq(quantize: str) -> bool:
    """``--quantize`` asks for GPTQ's error compensation (``w4a16-gptq``), not plain rounding."""
    return quantize.endswith(GPTQ)


def weight_args(bits: int, group: int) -> Any:
    """compressed-tensors' ``QuantizationArgs`` of the scheme: symmetric ints of ``bits``, one scale
    per ``group`` inputs of a row (zero point 0)."""
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group", group_size=group)


def group_scale(weight: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale and zero point of every group of ``weight`` [out, in] (compressed-tensors'
    ``calculate_qparams``: the group's largest magnitude over half the integer range; zero point 0)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    grouped = weight.float().view(weight.shape[0], -1, args.group_size)
    return calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)


def check_quantize(quantize: str, group_size: int) -> None:
    """``--quantize`` and ``--quant_group_size``, in one line each."""
    if quantize not in BITS:
        raise UserError(f"--quantize {quantize!r} is not one of {', '.join(q for q in QUANTIZE if q in BITS)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 8 or group_size & (group_size - 1):
        raise UserError(f"--quant_group_size must be a power of two of at least 8 (e.g. 128); got {group_size}")


def layer_group(width: int, group_size: int) -> int | None:
    """The group size of a layer with ``width`` inputs: ``group_size`` when it divides it, else the
    largest power of two below it that does; None when that is under ``min(group_size, 32)``."""
    group = group_size
    while group >= min(group_size, SMALLEST_GROUP):
        if width % group == 0:
            return group
        group //= 2
    return None


def linear_layers(layers: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """``layers`` (the prunable block layers by full module name: a block model's ``layers()``),
    each checked to be an ``nn.Linear``, the only layer compressed-tensors quantizes."""
    for name, layer in layers.items():
        if not isinstance(layer, nn.Linear):
            raise UserError(f"--quantize: block layer {name} is a {type(layer).__name__}, not a Linear; compressed-tensors "
                            "quantizes Linear layers only (GPT-2's Conv1D among them): leave --quantize out for this model")
    return layers


def check_groups(layers: dict[str, nn.Module], group_size: int) -> dict[str, int]:
    """The group size of every quantized layer (``layers``: by full name, :func:`linear_layers`),
    refused in one line when a layer has none (:func:`layer_group`): one size for the whole
    model, the smallest of the layers' own, which divides every width (powers of two). One size
    because transformers' dequantize-on-load (``CompressedTensorsConfig(dequantize=True)``, 5.x)
    applies one group size to every layer of a checkpoint."""
    groups = {}
    for name, layer in layers.items():
        group = layer_group(layer.in_features, group_size)
        if group is None:
            raise UserError(f"--quant_group_size {group_size}: layer {name} has {layer.in_features} inputs, which no "
                            f"power-of-two group of {min(group_size, SMALLEST_GROUP)} or more divides; give a "
                            "--quant_group_size that divides it")
        groups[name] = group
    common = min(groups.values(), default=group_size)
    return {name: common for name in groups}


def save_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the folder's unquantized tensors and scales: float16 for a float16 run, else bfloat16."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


@contextlib.contextmanager
def _quiet_bars(progress: bool) -> Iterator[None]:
    """compressed-tensors' own progress bars (applying the config, compressing) off unless ``progress``."""
    if progress:
        yield
        return
    from compressed_tensors.compressors.model_compressors import model_compressor
    from compressed_tensors.quantization.lifecycle import apply

    modules = [m for m in (apply, model_compressor) if hasattr(m, "tqdm")]
    bars = [m.tqdm for m in modules]
    try:
        for module, bar in zip(modules, bars):
            module.tqdm = _silenced(bar)
        yield
    finally:
        for module, bar in zip(modules, bars):
            module.tqdm = bar


def _silenced(bar: Any) -> Any:
    """``bar`` (tqdm) made with ``disable=True`` whatever its caller passes."""
    return lambda *args, **kwargs: bar(*args, **{**kwargs, "disable": True})


@torch.no_grad()
def quantization_config(groups: dict[str, int], bits: int) -> Any:
    """compressed-tensors' ``QuantizationConfig`` of the folder: one config group per group size
    naming its layers, the LM head ignored, format pack-quantized."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    schemes = {}
    for size in sorted(set(groups.values()), reverse=True):
        targets = sorted(name for name, g in groups.items() if g == size)
        schemes[f"group_{len(schemes)}"] = QuantizationScheme(targets=targets, weights=weight_args(bits, size),
                                                              format=FORMAT)
    return QuantizationConfig(config_groups=schemes, ignore=["lm_head"], format=FORMAT)


def save_quantized(model: nn.Module, folder: str | os.PathLike, quantize: str, group_size: int = 128, *,
                   layers: dict[str, nn.Module], progress: bool = True,
                   scales: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Write a quantized copy of ``model`` into ``folder`` (``model`` itself is left as it is;
    ``layers``: the prunable block layers by full module name, the ones quantized) and
    return the ``weights`` facts of the folder with its ``quantization`` facts inside. ``scales``:
    a layer's scales by full module name where GPTQ chose them (its weights on their grid),
    else they come from the weights."""
    with _quiet_bars(progress), _alone():
        return _save_quantized(model, folder, quantize, group_size, linear_layers(layers), scales or {})


def _alone():
    """A context in which compressed-tensors works in this process alone. In an initialised process
    group (``torchrun``) it would share compressing or decompressing a model among the ranks and
    send the parts between them as pickled objects; here rank 0 writes a folder by itself and every
    rank loads it by itself."""
    from compressed_tensors.offload.utils import as_single_threaded

    return as_single_threaded()


def _save_quantized(model: nn.Module, folder: str | os.PathLike, quantize: str, group_size: int,
                    layers: dict[str, nn.Module], scales: dict[str, torch.Tensor]) -> dict[str, Any]:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationStatus, apply_quantization_config

    from fairprune.hub.compressed import dense_weight_bytes, weight_file_bytes

    check_quantize(quantize, group_size)
    bits = BITS[quantize]
    groups = check_groups(layers, group_size)
    dtype = save_dtype(next(model.parameters()).dtype)
    copy_ = copy.deepcopy(model).to(dtype)
    dense_bytes = dense_weight_bytes(copy_)  # what save_pretrained writes for the dense model in this dtype
    layer_dense = sum(copy_.get_submodule(name).weight.numel() * copy_.get_submodule(name).weight.element_size()
                      for name in groups)
    apply_quantization_config(copy_, quantization_config(groups, bits))
    counts = {"zeros": 0, "total": 0}
    for name in groups:
        layer = copy_.get_submodule(name)
        scale, zero = layer_qparams(name, layer.weight.detach(), layer.quantization_scheme.weights, scales.get(name), counts)
        layer.weight_scale.data.copy_(scale.reshape(layer.weight_scale.shape))
        layer.weight_zero_point.data.copy_(zero.reshape(layer.weight_zero_point.shape).to(layer.weight_zero_point.dtype))
        layer.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(copy_, quantization_format=FORMAT)
    compressor.compress_model(copy_)
    folder = Path(folder)
    copy_.save_pretrained(folder)
    compressor.update_config(str(folder))
    layer_bytes = _stored_bytes(folder, groups)
    written = weight_file_bytes(folder)
    return weight_facts(quantize, group_size, groups, dtype, dense_bytes, written,
                        {"layer_bytes": layer_bytes, "layer_dense_bytes": layer_dense, **counts})


def layer_qparams(name: str, weight: torch.Tensor, args: Any, scale: torch.Tensor | None,
                  counts: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale (in ``weight``'s 16-bit dtype: what the folder stores) and zero point of one layer
    [out, in]: ``scale`` where GPTQ chose it, else from the weights (:func:`group_scale`). Checked:
    the zero point is 0 and every zero of ``weight`` is the integer 0 and comes back as 0.0;
    ``counts`` gains the layer's integer zeros and entries."""
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize

    own, zero = group_scale(weight, args)
    scale = (own if scale is None else scale).to(weight.device).reshape(own.shape).to(weight.dtype)
    if int(zero.abs().max()) != 0:
        raise RuntimeError(f"symmetric quantization gave layer {name} a nonzero zero point")
    q = quantize(weight, scale, zero, args)
    back = dequantize(q, scale, zero, args, dtype=weight.dtype)
    pruned = weight == 0
    if not (bool((q[pruned] == 0).all()) and bool((back[pruned] == 0).all())):
        raise RuntimeError(f"a pruned zero of layer {name} did not stay zero under symmetric quantization")
    counts["zeros"] += int((q == 0).sum())
    counts["total"] += q.numel()
    return scale, zero


def weight_facts(quantize: str, group_size: int, groups: dict[str, int], dtype: torch.dtype, dense_bytes: int,
                 written: int, counts: dict[str, int]) -> dict[str, Any]:
    """The ``weights`` facts of a written folder with its ``quantization`` facts inside (``counts``:
    the quantized layers' stored and 16-bit bytes, their integer zeros and entries)."""
    from fairprune.hub.compressed import dtype_name

    layer_bytes, layer_dense = counts["layer_bytes"], counts["layer_dense_bytes"]
    quantization = {"scheme": quantize, "bits": BITS[quantize], "group_size": group_size, "format": FORMAT,
                    "symmetric": True, "rounding": "gptq" if is_gptq(quantize) else "nearest",
                    "quantized_layers": len(groups), "group_sizes": dict(sorted(_count(groups).items(), reverse=True)),
                    "layer_bytes": layer_bytes, "layer_dense_bytes": layer_dense,
                    "layer_ratio": layer_bytes / layer_dense if layer_dense else None,
                    "zero_fraction": counts["zeros"] / counts["total"] if counts["total"] else 0.0}
    return {"save_format": "dense", "dtype": dtype_name(dtype), "format": FORMAT, "dense_bytes": dense_bytes,
            "file_bytes": written, "ratio": written / dense_bytes if dense_bytes else None, "quantization": quantization}


def _count(groups: dict[str, int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for size in groups.values():
        counts[str(size)] = counts.get(str(size), 0) + 1
    return counts


def _stored_bytes(folder: Path, layers: dict[str, int]) -> int:
    """Bytes the quantized layers' tensors (packed weights, scales, shapes) take in the folder's files."""
    from safetensors import safe_open

    prefixes = tuple(f"{name}." for name in layers)
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefixes) and not key.endswith(".bias"):
                    tensor = f.get_slice(key)
                    shape = tensor.get_shape()
                    numel = 1
                    for size in shape:
                        numel *= size
                    total += numel * _itemsize(tensor.get_dtype())
    return total


def _itemsize(name: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}.get(name, 4)


def is_quantized(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` is a model folder in compressed-tensors' pack-quantized format."""
    import json

    path = Path(folder) / "config.json"
    try:
        quant = json.loads(path.read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return False
    return isinstance(quant, dict) and quant.get("quant_method") == "compressed-tensors" and quant.get("format") == FORMAT


def dequantizing() -> Any:
    """transformers' own option to decompress a compressed-tensors folder into float weights on load."""
    from transformers import CompressedTensorsConfig

    return CompressedTensorsConfig(dequantize=True)


def load_quantized(folder: str | os.PathLike, dtype: torch.dtype | None = None, trust_remote_code: bool = False,
                   progress: bool = True) -> nn.Module:
    """The model of a quantized folder as plain transformers loads it, its layers decompressed on load
    into float weights (``AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
    quantization_config=CompressedTensorsConfig(dequantize=True))``: the integers times their
    scale, rounded to the folder's 16-bit dtype, then held in ``dtype``), so every tool that reads
    a layer's ``weight`` sees it."""
    import warnings

    from transformers import AutoModelForCausalLM

    kwargs = {} if dtype is None else {"dtype": dtype}
    with warnings.catch_warnings(), _quiet_bars(progress), _alone():  # "You passed `quantization_config` ...": the option is the point
        warnings.simplefilter("ignore", UserWarning)
        return AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=trust_remote_code,
                                                    quantization_config=dequantizing(), **kwargs).eval()
