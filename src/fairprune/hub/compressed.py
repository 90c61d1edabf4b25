"""Pruned LM folders whose sparse weights take the room their nonzeros need, and the bytes weights take.

``--save_format compressed`` writes a transformers folder in the sparse layouts of compressed-tensors
(the format names, ``config.json`` entry and tensor names its sparse compressors used before they
were removed, e.g. in its releases 0.9.4 and 0.12.2; the installed compressed-tensors supplies the
config classes and the bit packing):

- ``sparse-24-bitmask`` (2:4 along the stored rows): for each compressed weight ``W`` [rows, cols],
  ``<module>.compressed`` [rows, cols / 2] (the two entries kept in every group of 4, in row order),
  ``<module>.bitmask`` (uint8 [rows, ceil(cols / 8)], one bit per entry, little-endian along the
  row: bit set = entry stored) and ``<module>.shape`` (int64 [2, 1]);
- ``sparse-bitmask`` (any pattern): ``<module>.compressed`` (the stored entries, 1-D, row order),
  ``<module>.bitmask`` (as above), ``<module>.row_offsets`` (int64 [rows]: where each row's entries
  start) and ``<module>.shape`` (int64 [2]).

Values keep the weight's dtype; an entry is stored when any bit of it is set, so a ``-0.0`` comes back
as ``-0.0`` and the weights reload bit for bit. The compressed modules are the prunable layers of the
transformer blocks (:mod:`fairprune.causal.families`); embeddings, norms and the LM head stay dense tensors.
``config.json`` gains ``quantization_config = {"quant_method": "compressed-tensors", "format":
"dense", "sparsity_config": {format, targets, ignore, global_sparsity, sparsity_structure, ...},
"version": ...}``.

2:4 is written as ``sparse-24-bitmask`` when every compressed tensor holds at most 2 stored entries in
each 4 consecutive entries of its stored rows; otherwise (another N:M pattern, or GPT-2's ``Conv1D``
whose weight is stored [in, out], so its input-wise groups run down the stored columns) the folder
uses ``sparse-bitmask`` and the facts say why (``note``).

Reading: :func:`load_compressed` (what :func:`fairprune.hub.load_model` calls for such a folder)
rebuilds the dense tensors and loads the model from them. The transformers 5 and compressed-tensors
0.20 releases installed here no longer decompress sparse checkpoints: plain ``from_pretrained`` would
leave these layers newly initialised with a warning only. So ``config.json`` also gets
``transformers_weights`` (:data:`REFUSAL`), which plain ``from_pretrained`` refuses with an error
that says to load the folder with ``fairprune.hub.load_model`` or to save with ``--save_format dense``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fairprune.errors import UserError
from fairprune.hub.checks import saved_bytes
from fairprune.hub.formats import DTYPES, SAVE_FORMATS

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPARSE_24 = "sparse-24-bitmask"
SPARSE_BITMASK = "sparse-bitmask"
_PARTS = {SPARSE_24: ("shape", "compressed", "bitmask"), SPARSE_BITMASK: ("shape", "compressed", "bitmask", "row_offsets")}
_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")
#: A ``config.json`` entry that plain ``from_pretrained`` (transformers 5) refuses with this value in
#: its error ("... neither a safetensors file (*.safetensors) nor a safetensors index file
#: (*.safetensors.index.json): <REFUSAL>"), so that no plain load builds the model with the
#: compressed layers newly initialised; :func:`load_compressed` drops it.
REFUSAL_KEY = "transformers_weights"
REFUSAL = ("fairprune sparse-compressed weights, which plain transformers loads wrongly: load this folder with "
           "fairprune.hub.load_model(folder), or prune with --save_format dense for a plain transformers folder")


def torch_dtype(name: str | None) -> torch.dtype | None:
    """``--dtype`` as a torch dtype (None stays None: the loader's own choice)."""
    if name is None:
        return None
    if name not in _TORCH_DTYPES:
        raise UserError(f"--dtype {name!r} is not one of {', '.join(DTYPES)}")
    return _TORCH_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


# -- bytes ----------------------------------------------------------------------------------------
def dense_weight_bytes(model: nn.Module) -> int:
    """Bytes of the tensors ``save_pretrained`` writes for ``model`` in its present dtype: every
    state-dict tensor once (tied ones share storage), without the files' small headers."""
    return saved_bytes(model)


def weight_file_bytes(folder: str | os.PathLike) -> int:
    """Bytes on disk of a model folder's weight files (``*.safetensors``, ``pytorch_model*.bin``)."""
    folder = Path(folder)
    return sum(p.stat().st_size for pattern in _WEIGHT_FILES for p in folder.glob(pattern) if p.is_file())


# -- which tensors are compressed ---------------------------------------------------------------
def _present(tensor: torch.Tensor) -> torch.Tensor:
    """Entries with any bit set (``-0.0`` counts: it is stored and comes back as it was)."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().view(bits) != 0


def _follows_nm(tensor: torch.Tensor, n: int, m: int) -> bool:
    """At least ``n`` zeros (so at most ``m - n`` stored entries) in every ``m`` consecutive
    entries of each stored row: the pattern N:M as :class:`~fairprune.pruning.sparsity.Sparsity`
    reads it (1:4: one zero in four)."""
    rows, cols = tensor.shape
    return cols % m == 0 and int(_present(tensor).reshape(rows, cols // m, m).sum(-1).max()) <= m - n


def choose_format(weights: dict[str, torch.Tensor], nm: tuple[int, int] | None) -> tuple[str, str, str | None]:
    """``(format, sparsity_structure, note)`` for these weights pruned to ``nm`` (None: unstructured)."""
    if nm is None:
        return SPARSE_BITMASK, "unstructured", None
    n, m = nm
    structure = f"{n}:{m}"
    if not all(_follows_nm(w, n, m) for w in weights.values()):
        return SPARSE_BITMASK, "unstructured", (
            f"{structure}: the groups run along the layers' inputs, which this model stores down the columns of its "
            "weights (e.g. GPT-2's Conv1D [in, out]); written as sparse-bitmask, which stores any pattern")
    if nm == (2, 4):
        return SPARSE_24, structure, None
    return SPARSE_BITMASK, structure, (f"{structure}: compressed-tensors has a dedicated layout for 2:4 only; "
                                       "written as sparse-bitmask, which stores any pattern")


# -- compress / decompress one tensor --------------------------------------------------------------
def _pack(mask: torch.Tensor) -> torch.Tensor:
    from compressed_tensors.utils.helpers import pack_bitmasks

    return pack_bitmasks(mask.cpu())


def compress_tensor(weight: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """The parts of one 2-D weight in ``fmt`` (keys without the module prefix)."""
    weight = weight.detach().cpu().contiguous()
    rows, cols = weight.shape
    present = _present(weight)
    if fmt == SPARSE_24:
        # Two entries per group of 4: the stored ones, then the first unstored ones (zeros) to fill.
        groups = present.reshape(rows, cols // 4, 4) if cols % 4 == 0 else None
        if groups is None or int(groups.sum(-1).max()) > 2:
            raise ValueError(f"a [{rows}, {cols}] weight is not 2:4 along its rows; choose_format picks the layout")
        order = torch.argsort((~groups).to(torch.int8), dim=-1, stable=True)[..., :2]
        keep = torch.zeros_like(groups).scatter_(-1, order, True).reshape(rows, cols)
        return {"shape": torch.tensor([rows, cols]).reshape(-1, 1),
                "compressed": weight[keep].reshape(rows, cols // 2).clone(), "bitmask": _pack(keep)}
    counts = present.sum(-1)
    return {"shape": torch.tensor([rows, cols]), "compressed": weight[present].clone(), "bitmask": _pack(present),
            "row_offsets": torch.cumsum(counts, 0) - counts}


def decompress_tensor(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The dense weight from its parts (either format: the bitmask says where the values go)."""
    from compressed_tensors.utils.helpers import unpack_bitmasks

    shape = [int(s) for s in parts["shape"].flatten().tolist()]
    values = parts["compressed"].flatten()
    mask = unpack_bitmasks(parts["bitmask"], shape)
    if int(mask.sum()) != values.numel():
        raise UserError(f"a compressed weight holds {values.numel()} values for {int(mask.sum())} set bits of its "
                        "bitmask; the folder is damaged: write it again")
    dense = torch.zeros(shape, dtype=values.dtype)
    dense[mask] = values
    return dense


# -- a whole model --------------------------------------------------------------------------------
def _targets_and_ignore(model: nn.Module, compressed: Iterable[str]) -> tuple[list[str], list[str] | None]:
    """compressed-tensors' ``targets`` (the compressed modules' class names) and ``ignore`` (the other
    modules of those classes, e.g. ``lm_head``)."""
    compressed = set(compressed)
    modules = dict(model.named_modules())
    classes = sorted({type(modules[name]).__name__ for name in compressed})
    ignore = [name for name, module in modules.items() if type(module).__name__ in classes and name not in compressed]
    return classes, ignore or None


def _zero_percent(model: nn.Module) -> float:
    """Exact zeros among all parameters, in percent (compressed-tensors' ``global_sparsity``)."""
    zeros = total = 0
    for p in model.parameters():
        zeros += int((p.detach() == 0).sum())
        total += p.numel()
    return 100.0 * zeros / max(total, 1)


def save_compressed(model: nn.Module, folder: str | os.PathLike, layers: dict[str, nn.Module],
                    nm: tuple[int, int] | None = None) -> dict[str, Any]:
    """Write ``model`` into ``folder`` (``save_pretrained`` with ``layers``, the prunable block layers
    by full module name, compressed) and add the sparsity config to its ``config.json``; ``nm``: the
    N:M pattern it was pruned to (None: unstructured). Returns the facts: format, structure,
    compressed layers, note."""
    try:
        from compressed_tensors.config import SparsityCompressionConfig
    except ImportError as err:  # a declared dependency; an environment without it cannot write the format
        raise UserError("--save_format compressed needs the compressed-tensors package (pip install "
                        "'compressed-tensors>=0.20'); or use --save_format dense") from err
    modules = layers
    weights = {name: module.weight.detach() for name, module in modules.items()}
    for name, w in weights.items():
        if w.dim() != 2:
            raise UserError(f"--save_format compressed: layer {name} has a {w.dim()}-D weight; only 2-D weights "
                            "can be compressed (use --save_format dense)")
    fmt, structure, note = choose_format(weights, nm)
    state = dict(model.state_dict())
    for name, w in weights.items():
        state.pop(f"{name}.weight")
        state.update({f"{name}.{part}": value for part, value in compress_tensor(w, fmt).items()})
    targets, ignore = _targets_and_ignore(model, modules)
    sparsity = SparsityCompressionConfig.load_from_registry(
        fmt, format=fmt, targets=targets, ignore=ignore, global_sparsity=_zero_percent(model),
        sparsity_structure=structure).model_dump()
    folder = Path(folder)
    model.save_pretrained(folder, state_dict=state)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "dense",
                                     "sparsity_config": sparsity, "transform_config": {}, "version": _version()}
    config[REFUSAL_KEY] = REFUSAL
    from fairprune.storage.atomic import write_text

    write_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return {"format": fmt, "sparsity_structure": structure, "compressed_layers": len(weights), "note": note}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("compressed-tensors")
    except PackageNotFoundError:
        return "unknown"


def sparsity_config(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The compressed-tensors sparsity config of a model folder, when it has a sparse one."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config") or config.get("compression_config") or {}
    sparsity = quant.get("sparsity_config") if isinstance(quant, dict) else None
    if isinstance(sparsity, dict) and sparsity.get("format") in _PARTS:
        return sparsity
    return None


def is_compressed(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` is a model folder with sparse compressed weights."""
    return Path(folder).is_dir() and sparsity_config(folder) is not None


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"'{folder}' holds a compressed-tensors sparsity config but no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                state[key] = f.get_tensor(key)
    return state


def decompress_state_dict(state: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """A compressed state dict with every compressed weight rebuilt as ``<module>.weight``."""
    parts = _PARTS[fmt]
    prefixes = {key.removesuffix(".bitmask") for key in state if key.endswith(".bitmask")}
    stored = {f"{prefix}.{p}" for prefix in prefixes for p in parts}
    dense = {key: value for key, value in state.items() if key not in stored}  # biases and the rest, as they are
    for prefix in sorted(prefixes):
        missing = [p for p in parts if f"{prefix}.{p}" not in state]
        if missing:
            raise UserError(f"compressed weight {prefix} lacks {', '.join(missing)} (format {fmt}); the folder is damaged: "
                            "write it again")
        dense[f"{prefix}.weight"] = decompress_tensor({p: state[f"{prefix}.{p}"] for p in parts})
    return dense


def load_compressed(folder: str | os.PathLike, task_class: Any, dtype: torch.dtype | None = None,
                    trust_remote_code: bool = False, **kwargs: Any):
    """The model of a compressed folder, its weights rebuilt dense: ``task_class`` is the transformers
    auto class (``AutoModelForCausalLM``); ``dtype`` None keeps the stored dtype."""
    import transformers
    from transformers.models.auto.auto_factory import _get_model_class

    folder = Path(folder)
    fmt = sparsity_config(folder)["format"]
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    for key in ("quantization_config", "compression_config", REFUSAL_KEY):
        if hasattr(config, key):
            delattr(config, key)
    state = decompress_state_dict(_read_weights(folder), fmt)
    if dtype is None:
        dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    if type(config) in task_class._model_mapping:
        model_class = _get_model_class(config, task_class._model_mapping)
        model, info = model_class.from_pretrained(None, config=config, state_dict=state, dtype=dtype,
                                                  output_loading_info=True, **kwargs)
        missing, unexpected = set(info["missing_keys"]), set(info["unexpected_keys"])
    else:  # remote code: build, then load the tensors
        model = task_class.from_config(config, trust_remote_code=trust_remote_code, dtype=dtype)
        result = model.load_state_dict(state, strict=False)
        model.tie_weights()
        own = model.state_dict()
        loaded = {own[k].data_ptr() for k in state if k in own}
        tied = {k for k in result.missing_keys if own[k].data_ptr() in loaded}  # shares a loaded tensor
        missing, unexpected = set(result.missing_keys) - tied, set(result.unexpected_keys)
    if missing or unexpected:
        what = sorted(missing)[:3] or sorted(unexpected)[:3]
        raise UserError(f"the compressed folder '{folder}' does not match its model class "
                        f"({len(missing)} tensors missing, {len(unexpected)} unexpected, e.g. {', '.join(what)})")
    generation = folder / "generation_config.json"
    if generation.is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    model.config._name_or_path = str(folder)
    return model.eval()


def dense_facts(folder: str | os.PathLike, dense: int, dtype: torch.dtype) -> dict[str, Any]:
    """The ``weights`` block of dense weight files in ``folder`` (``dense``: what ``save_pretrained``
    writes in ``dtype``, computed; the files' bytes measured)."""
    written = weight_file_bytes(folder)
    return {"save_format": "dense", "dtype": dtype_name(dtype), "format": "dense", "dense_bytes": dense,
            "file_bytes": written, "ratio": written / dense if dense else None}


def save_weights(model: nn.Module, folder: str | os.PathLike, save_format: str = "dense",
                 nm: tuple[int, int] | None = None, layers: dict[str, nn.Module] | None = None) -> dict[str, Any]:
    """Write ``model``'s weights into ``folder`` in ``save_format`` (``compressed``: ``layers``, the
    prunable block layers by full module name, are the ones compressed) and measure them: the
    ``weights`` block of a run's report (``dense_bytes``: what ``save_pretrained`` writes in the
    same dtype, computed; ``file_bytes``: the weight files written, measured; ``ratio``)."""
    check_save_format(save_format)
    dense = dense_weight_bytes(model)
    facts: dict[str, Any] = {"save_format": save_format, "dtype": dtype_name(next(model.parameters()).dtype)}
    if save_format == "compressed":
        if layers is None:
            raise ValueError("save_weights: --save_format compressed needs the prunable layers (a block model's layers())")
        facts.update(save_compressed(model, folder, layers, nm))
    else:
        model.save_pretrained(folder)
        facts["format"] = "dense"
    written = weight_file_bytes(folder)
    facts.update(dense_bytes=dense, file_bytes=written, ratio=written / dense if dense else None)
    return facts


def megabytes(count: int | float) -> str:
    """``176.4 MB``; three significant digits below 10 MB (``0.0613 MB``)."""
    mb = count / 1e6
    return f"{mb:.1f} MB" if mb >= 10 else f"{mb:.3g} MB"


def weights_summary(facts: dict[str, Any]) -> str:
    """One line of a ``weights`` block: ``weights 176.4 MB on disk (sparse-24-bitmask, bfloat16), 0.656 of dense (269.1 MB)``."""
    ratio = "" if facts.get("ratio") is None else f", {facts['ratio']:.3f} of dense ({megabytes(facts['dense_bytes'])})"
    note = f"; {facts['note']}" if facts.get("note") else ""
    quant = facts.get("quantization") or {}
    groups = ", ".join(quant.get("group_sizes") or {}) or quant.get("group_size")
    fmt = (f"{facts['format']} {quant['scheme']}: {quant['bits']}-bit, groups of {groups}"
           if quant else facts["format"])
    return f"weights {megabytes(facts['file_bytes'])} on disk ({fmt}, {facts['dtype']}){ratio}{note}"


def check_can_compress(save_format: str) -> None:
    """Refuse ``--save_format compressed`` before any work when compressed-tensors is missing."""
    if check_save_format(save_format) == "compressed":
        try:
            import compressed_tensors  # noqa: F401
        except ImportError as err:
            raise UserError("--save_format compressed needs the compressed-tensors package (pip install "
                            "'compressed-tensors>=0.20'); or use --save_format dense") from err


def check_save_format(value: str) -> str:
    """``--save_format`` must be dense or compressed."""
    if value not in SAVE_FORMATS:
        raise UserError(f"--save_format {value!r} is not one of {', '.join(SAVE_FORMATS)}")
    return value
