"""The model card's sections on how an LM folder's weights are stored: ``--save_format compressed``
(compressed-tensors' sparse layouts, which fairprune alone reads today) and ``--quantize``
(pack-quantized integers that plain transformers loads)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fairprune.reporting.report import markdown_text


def weights_sections(report: Mapping[str, Any]) -> list[str]:
    """The card's lines on the stored weights (none for a plain dense folder)."""
    return _compressed_weights(report) + _quantized_weights(report)


def _compressed_weights(report: Mapping[str, Any]) -> list[str]:
    """How a folder written with ``--save_format compressed`` loads, and what its weights take."""
    weights = _mapping(report.get("weights"))
    if weights.get("save_format") != "compressed":
        return []
    size = _number(weights.get("file_bytes"))
    ratio = _number(weights.get("ratio"))
    share = f", {ratio:.3f} of the dense {_text(weights.get('dtype') or '')} tensors" if ratio is not None else ""
    lines = [f"**Compressed weights.** The prunable layers are stored in compressed-tensors' "
             f"**{_text(weights.get('format') or '')}** layout (nonzeros and a bitmask; config.json's "
             f"`quantization_config.sparsity_config`)" + (f": {size / 1e6:.3g} MB of weights{share}." if size is not None else "."),
             "Plain transformers (5.x with compressed-tensors 0.20) no longer decompresses sparse checkpoints and "
             "would leave these layers newly initialised, so `config.json`'s `transformers_weights` entry makes "
             "`AutoModelForCausalLM.from_pretrained` refuse the folder with an error. Load it with fairprune "
             "(or prune again with `--save_format dense` for a folder plain transformers loads):", "",
             "```python", "from fairprune.hub import load_model", "",
             "model = load_model(\"path/to/this/folder\")  # the dense weights, bit for bit", "```", ""]
    return lines


def _quantized_weights(report: Mapping[str, Any]) -> list[str]:
    """What a folder written with ``--quantize`` holds, what it takes, and that its figures are its own."""
    quantization = _mapping(report.get("quantization"))
    if not quantization:
        return []
    weights = _mapping(report.get("weights"))
    size, ratio = _number(weights.get("file_bytes")), _number(weights.get("ratio"))
    layer_ratio = _number(quantization.get("layer_ratio"))
    share = f", {ratio:.3f} of the dense {_text(weights.get('dtype') or '')} model" if ratio is not None else ""
    layers = (f"; the quantized layers take {layer_ratio:.3f} of their {_text(weights.get('dtype') or '')} bytes"
              if layer_ratio is not None else "")
    return [f"**Quantized weights: {_text(str(quantization.get('scheme', '')))}.** The prunable layers of the blocks "
            f"({_text(str(quantization.get('quantized_layers', '')))} layers) are stored as "
            f"{_text(str(quantization.get('bits', '')))}-bit symmetric integers, one scale per group of "
            f"{_text(str(quantization.get('group_size', '')))} inputs (a layer whose width it does not divide: the "
            f"largest power of two below it that does; a pruned zero stays exactly zero), in compressed-tensors' "
            f"**{_text(str(quantization.get('format', '')))}** format"
            + (f": {size / 1e6:.3g} MB of weights{share}{layers}." if size is not None else "."),
            "The figures above were measured on this folder as `AutoModelForCausalLM.from_pretrained` loads it "
            "(transformers decompresses the layers on load; compressed-tensors must be installed), not on the "
            "float model before quantization.", ""]


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _number(value: Any) -> float | int | None:
    """A finite plain number, else None."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def _text(value: Any) -> str:
    """A name from the data as Markdown text."""
    return str(markdown_text(str(value)))
