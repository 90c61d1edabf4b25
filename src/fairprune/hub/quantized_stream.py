"""Pack-quantized folders streamed: written block by block as a streamed run solves its blocks
(:class:`QuantizedWriter`), and read layer by layer, each layer decompressed as it is read
(:class:`QuantizedReader`). The format, the group sizes and the rounding are
:mod:`fairprune.hub.quantized`'s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from fairprune.errors import UserError
from fairprune.hub.quantized import (
    BITS,
    is_quantized,
    layer_qparams,
    quantization_config,
    weight_args,
    weight_facts,
)
from fairprune.hub.shards import ShardReader, ShardWriter


class QuantizedWriter:
    """A quantized folder's weights written tensor by tensor as a streamed run solves its blocks:
    takes the model's state-dict entries by name (as :class:`~fairprune.hub.shards.ShardWriter`
    does) and stores each quantized layer's weight as compressed-tensors' pack-quantized parts
    (``PackedQuantizationCompressor.compress``: ``weight_packed``, ``weight_scale``,
    ``weight_shape``), every other float tensor in ``dtype``: the files :func:`save_quantized`
    writes for the model in memory. ``tensors``: every state-dict entry (meta tensors will do);
    ``groups``: the quantized layers' group size by full module name; ``scales``: the scales GPTQ
    chose by full module name (taken as each layer is written; the rest come from the weights)."""

    def __init__(self, folder: str | os.PathLike, tensors: dict[str, torch.Tensor], quantize: str,
                 groups: dict[str, int], scales: dict[str, torch.Tensor], dtype: torch.dtype,
                 total_parameters: int | None = None):
        self.quantize, self.groups, self.scales, self.dtype = quantize, groups, scales, dtype
        self.layers = {f"{name}.weight": name for name in groups}
        self.counts = {"zeros": 0, "total": 0, "layer_bytes": 0, "layer_dense_bytes": 0}
        self.dense_bytes = 0
        planned: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            meta = torch.empty(tuple(t.shape), dtype=dtype if t.is_floating_point() else t.dtype, device="meta")
            self.dense_bytes += meta.numel() * meta.element_size()
            if name in self.layers:
                self.counts["layer_dense_bytes"] += meta.numel() * meta.element_size()
                planned.update(self._parts(name, meta))
            else:
                planned[name] = meta
        self.shards = ShardWriter(folder, planned, total_parameters=total_parameters)
        self._pending = set(tensors)

    def _scheme(self, layer: str) -> Any:
        from compressed_tensors.quantization import QuantizationScheme

        return QuantizationScheme(targets=[layer], weights=weight_args(BITS[self.quantize], self.groups[layer]))

    def _parts(self, name: str, weight: torch.Tensor, scale: torch.Tensor | None = None,
               zero: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """compressed-tensors' parts of one layer's weight by full name (a meta weight: their shapes)."""
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

        layer = self.layers[name]
        if scale is None:
            groups = (weight.shape[0], weight.shape[1] // self.groups[layer])
            scale = torch.empty(groups, dtype=self.dtype, device="meta")
            zero = torch.empty(groups, dtype=torch.int8, device="meta")
        state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}
        parts = PackedQuantizationCompressor.compress(state, self._scheme(layer))
        return {f"{layer}.{part}": tensor for part, tensor in parts.items()}

    def missing(self) -> list[str]:
        """State-dict entries not written yet."""
        return sorted(self._pending)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write state-dict entry ``name``: a quantized layer's weight as its parts, the rest in ``dtype``."""
        if name in self.layers:
            layer = self.layers[name]
            weight = tensor.detach().to(self.dtype)
            scale, zero = layer_qparams(layer, weight, self._scheme(layer).weights, self.scales.pop(layer, None),
                                        self.counts)
            for part, value in self._parts(name, weight, scale, zero).items():
                self.counts["layer_bytes"] += value.numel() * value.element_size()
                self.shards.write(part, value.contiguous())
        else:
            self.shards.write(name, tensor.detach().to(self.dtype) if tensor.is_floating_point() else tensor.detach())
        self._pending.discard(name)

    def write_many(self, tensors) -> None:
        for name, tensor in tensors:
            self.write(name, tensor)

    def close(self) -> list[str]:
        return self.shards.close()

    def abort(self) -> None:
        self.shards.abort()

    def finish(self, folder: str | os.PathLike, group_size: int) -> dict[str, Any]:
        """``config.json``'s ``quantization_config`` (compressed-tensors' own writer, as for a model in
        memory) and the ``weights`` facts of the folder; after :meth:`close` and the config's writing."""
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import QuantizationStatus

        from fairprune.hub.compressed import weight_file_bytes

        config = quantization_config(self.groups, BITS[self.quantize])
        config.quantization_status = QuantizationStatus.COMPRESSED
        ModelCompressor(quantization_config=config).update_config(str(folder))
        return weight_facts(self.quantize, group_size, self.groups, self.dtype, self.dense_bytes,
                            weight_file_bytes(folder), self.counts)


def open_reader(folder: str | os.PathLike):
    """The reader of a model folder's safetensors weights: a :class:`QuantizedReader` for a
    pack-quantized folder, else a plain :class:`~fairprune.hub.shards.ShardReader`."""
    return QuantizedReader(folder) if is_quantized(folder) else ShardReader(folder)


class QuantizedReader(ShardReader):
    """A pack-quantized folder read tensor by tensor (a streamed run, :mod:`fairprune.causal.streamed`):
    each quantized layer shows as its ``<layer>.weight``, decompressed when read by
    compressed-tensors' ``PackedQuantizationCompressor.decompress`` (the integers times their
    scale, in the scale's 16-bit dtype: what ``from_pretrained`` with ``dequantize=True`` holds),
    its packed parts hidden; every other tensor as stored."""

    def __init__(self, folder: str | os.PathLike):
        import json

        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationConfig

        super().__init__(folder)
        raw = json.loads((Path(folder) / "config.json").read_text())["quantization_config"]
        config = QuantizationConfig.model_validate({k: v for k, v in raw.items() if k in QuantizationConfig.model_fields})
        self._layers: dict[str, tuple[str, Any, tuple[int, ...], str]] = {}
        hidden: set[str] = set()
        for key in [k for k in self.files if k.endswith(".weight_packed")]:
            layer = key.removesuffix(".weight_packed")
            scheme = _scheme_of(config, layer, folder)
            parts = [f"{layer}.{p}" for p in PackedQuantizationCompressor.compression_param_names(scheme)]
            shape = tuple(int(v) for v in super().read(f"{layer}.weight_shape").tolist())
            self._layers[f"{layer}.weight"] = (layer, scheme, shape, self._entries[f"{layer}.weight_scale"]["dtype"])
            self.files[f"{layer}.weight"] = self.files[key]
            hidden.update(parts)
        self._hidden = hidden

    def __contains__(self, name: str) -> bool:
        return name in self.files and name not in self._hidden

    def keys(self) -> list[str]:
        return [k for k in self.files if k not in self._hidden]

    def stored_dtype(self, name: str) -> str:
        return self._layers[name][3] if name in self._layers else super().stored_dtype(name)

    def info(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        if name in self._layers:
            return super().info(f"{self._layers[name][0]}.weight_scale")[0], self._layers[name][2]
        return super().info(name)

    def read(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        if name not in self._layers:
            return super().read(name, dtype, device)
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

        layer, scheme, _, _ = self._layers[name]
        names = PackedQuantizationCompressor.compression_param_names(scheme)
        parts = {part: super(QuantizedReader, self).read(f"{layer}.{part}") for part in names}
        weight = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
        return weight.to(device=device, dtype=dtype or weight.dtype)


def _scheme_of(config: Any, layer: str, folder) -> Any:
    """The config group of a quantized layer: the one naming it (by name, ``re:`` pattern or ``Linear``)."""
    import re

    for scheme in (config.config_groups or {}).values():
        for target in scheme.targets:
            if target in (layer, "Linear") or (target.startswith("re:") and re.match(target[3:], layer)):
                return scheme
    raise UserError(f"'{folder}': no config group of its quantization_config names layer {layer}; the folder's "
                    "config.json does not match its weights")
