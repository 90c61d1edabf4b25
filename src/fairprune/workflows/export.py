"""``prune.py export``: a trained or pruned vision checkpoint as an ONNX file, checked against PyTorch
(``--format onnx``, the default), or a causal LM as a GGUF file, checked against transformers' own
GGUF reader (``--format gguf``, :func:`export_gguf`).

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
from fairprune.workflows.options import GGUFOptions, MachineOptions
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


def export(ckpt: str | None = None, model: str | None = None, format: str = "onnx", output: str | None = None,
           opset: int = DYNAMO_MIN_OPSET, atol: float = 1e-4, image_size: int | None = None, dynamo: bool = True,
           gguf: GGUFOptions = GGUFOptions(), machine: MachineOptions = MachineOptions()) -> dict[str, Any]:
    """Export a vision checkpoint to ONNX (--format onnx --ckpt ...; checked in ONNX Runtime against
    PyTorch), or a causal LM to GGUF for llama.cpp / Ollama (--format gguf --model ...; read back by
    transformers' GGUF reader and checked against the source with its weights rounded to the format).

    Args:
        ckpt: onnx: checkpoint written by train.py fit or prune.py vision (e.g. runs/demo/dense/checkpoints/last.ckpt).
        model: gguf: causal LM (hub name, folder written by a prune command, smollm2-135m or a *.gguf file) of the llama, mistral, qwen2, qwen3, qwen3_moe, gemma2, gemma3_text or phi3 family.
        format: onnx (a vision checkpoint) or gguf (a causal LM).
        output: the file to write (default: model.onnx; gguf: <model>.<gguf_type>.gguf); gguf: a folder takes that name inside it. Written atomically; gguf writes <name>.report.json beside it.
        opset: onnx: ONNX opset (torch's current exporter writes 18 or later).
        atol: largest absolute difference allowed (onnx: ONNX Runtime's outputs against PyTorch's; gguf: the loaded-back model's logits against the source's with its weights rounded to the format).
        image_size: onnx: input height and width (default: the checkpoint's data setting).
        dynamo: onnx: torch's current exporter (torch.export); false: the TorchScript exporter, faster, older opsets.
    """
    from fairprune.hub.formats import EXPORT_FORMATS

    if format not in EXPORT_FORMATS:
        raise UserError(f"--format {format!r} is not one of {', '.join(EXPORT_FORMATS)}")
    if format == "onnx":
        if model is not None or ckpt is None:
            raise UserError("--format onnx exports a vision checkpoint: give --ckpt (a causal LM --model exports with "
                            "--format gguf)")
        machine.apply()
        return export_vision(ckpt, output or "model.onnx", opset, atol, image_size, dynamo)
    if ckpt is not None or model is None:
        raise UserError("--format gguf exports a causal LM: give --model (a hub name, a model folder, smollm2-135m or a "
                        "*.gguf file), not --ckpt")
    return export_gguf(model, output, gguf, atol, machine)


def gguf_path(model: str, output: str | None, gguf_type: str) -> Path:
    """The file ``--output`` names: itself when it ends in ``.gguf``, ``<model>.<gguf_type>.gguf``
    inside it when it is a folder (or ends with a separator), that name here when not given."""
    import os

    name = f"{Path(model.rstrip('/')).name.removesuffix('.gguf') or 'model'}.{gguf_type}.gguf"
    if output is None:
        return Path(name)
    path = Path(output)
    if path.is_dir() or output.endswith((os.sep, "/")):
        return path / name
    if path.suffix.lower() != ".gguf":
        raise UserError(f"--output '{output}' does not end in .gguf; give the GGUF file to write (e.g. {name}) or a folder")
    return path


def _export_report(path: Path) -> dict[str, Any] | None:
    """The export report ``<name>.report.json`` beside ``path`` (None: none, or not one)."""
    import json

    try:
        found = json.loads(report_path(path).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and found.get("format") == "gguf" and "read_back_by" in found else None


def _check_ours(path: Path) -> None:
    """Refuse, before any work, to replace a file this command did not write: an existing ``path``
    is replaced only when it is a GGUF file whose export report names it, and an existing
    ``<name>.report.json`` only when it is such a report."""
    report = _export_report(path)
    if report_path(path).exists() and report is None:
        raise UserError(f"'{report_path(path)}' exists and is not a report of prune.py export; the export writes its "
                        "report there: give another --output or move that file")
    if path.exists():
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError:
            magic = b""
        if not path.is_file() or magic != b"GGUF" or report is None or Path(report.get("output", "")).name != path.name:
            raise UserError(f"--output '{path}' exists and was not written by prune.py export (only a GGUF file "
                            "with its export report beside it is replaced); give another --output or remove it")


def report_path(path: Path) -> Path:
    """``<name>.report.json`` beside ``<name>.gguf``."""
    return path.with_name(f"{path.name[: -len(path.suffix)]}.report.json")


def export_gguf(model: str, output: str | None = None, options: GGUFOptions = GGUFOptions(), atol: float = 1e-4,
                machine: MachineOptions = MachineOptions()) -> dict[str, Any]:
    """Write ``model`` as a GGUF file of ``options.gguf_type`` (:mod:`fairprune.hub.gguf_file`) and
    check it before it is put in place: transformers' GGUF reader loads it back, and its logits on
    the first evaluation window must equal, within ``atol``, those of the source with every weight
    rounded to the format; a pruned zero must still be zero. A failed check leaves no file. Then
    ``<name>.report.json`` is written beside it (:func:`gguf_report`)."""
    import json

    from fairprune.data.pairs import lm_texts
    from fairprune.hub import load_model, load_tokenizer, read_folders
    from fairprune.hub.gguf_file import check_gguf_type, family_for
    from fairprune.metrics.language import eval_ids
    from fairprune.storage.atomic import write_text

    machine.apply()
    check_gguf_type(options.gguf_type)
    if not atol > 0:
        raise UserError(f"--atol must be a positive tolerance, e.g. 1e-4; got {atol}")
    path = gguf_path(model, output, options.gguf_type)
    check_apart([path, report_path(path)], read_folders(model))  # never over the model it reads
    _check_ours(path)
    _check_writable(path, str(path))  # before the model is loaded
    source = load_model(model, trust_remote_code=options.trust_remote_code, dtype="float32").eval()
    family_for(source)  # an unsupported family refused before any work
    tokenizer = load_tokenizer(model, options.trust_remote_code)
    ids = eval_ids(lm_texts(None, options.eval_text).eval_text, tokenizer, options.eval_tokens)
    if len(ids) < options.eval_seqlen:
        raise UserError(f"--eval_text has {len(ids)} tokens, less than one --eval_seqlen window of {options.eval_seqlen}")
    found: dict[str, Any] = {}
    try:
        replace_atomically(path, lambda tmp: found.update(_write_checked(source, tokenizer, tmp, ids, options, atol,
                                                                         machine.progress)))
    except OSError as err:
        raise UserError(f"cannot write --output '{path}' ({err.strerror or type(err).__name__}); pass a file in a folder "
                        "you can write to") from None
    report = gguf_report(model, path, source, found, options)
    write_text(report_path(path), json.dumps(report, indent=1) + "\n")
    ppl = report["perplexity"]
    print(f"[export] {path} ({report['bytes'] / 1e6:.1f} MB, {options.gguf_type}, {report['ratio']:.3f} of dense bf16 "
          f"{report['dense_bf16_bytes'] / 1e6:.1f} MB); read back by transformers: logits max abs difference "
          f"{report['logits_max_abs_difference']:.3g} against the source rounded to {options.gguf_type} (tolerance {atol:g}), "
          f"{report['pruned_zeros']['kept']}/{report['pruned_zeros']['source']} pruned zeros kept, perplexity "
          f"{ppl['source']:.2f} -> {ppl['loaded']:.2f} on {ppl['tokens']} tokens; report {report_path(path)}", flush=True)
    return report


def _write_checked(source: Any, tokenizer: Any, tmp: Path, ids: Any, options: GGUFOptions, atol: float,
                   progress: bool) -> dict[str, Any]:
    """Write the file at ``tmp``, load it back with transformers' reader and measure it against
    the source; a logits difference over ``atol`` or a lost zero raises (nothing is kept)."""
    import torch

    from fairprune.hub.gguf_file import load_gguf, rounded_copy, write_gguf
    from fairprune.metrics.language import perplexity

    written = write_gguf(source, tokenizer, tmp, options.gguf_type, progress)
    loaded, loaded_tokenizer = load_gguf(tmp)
    differences = config_differences(source.config, loaded.config)
    computed = {key: pair for key, pair in differences.items() if key not in WINDOW_KEYS}
    if computed:
        named = "; ".join(f"{key} {back!r} (the source: {ours!r})" for key, (ours, back) in sorted(computed.items()))
        raise UserError(f"transformers' GGUF reader would give this {source.config.model_type} model back with {named}: "
                        "the file cannot hold these settings, so it would compute another model; nothing was written")
    reference = rounded_copy(source, written.rounded)
    written.rounded.clear()  # the reference holds them now
    window = ids[: options.eval_seqlen].unsqueeze(0)
    with torch.no_grad():
        expected = reference(input_ids=window).logits
        got = loaded(input_ids=window).logits
        against_source = (source(input_ids=window).logits - got).abs().max().item()
    worst = (expected - got).abs().max().item()
    del reference
    if not worst <= atol:  # a NaN difference fails too
        raise UserError(f"the GGUF file read back by transformers differs from the source rounded to {options.gguf_type} "
                        f"by up to {worst:.3g} in the logits, over --atol {atol:g}; nothing was written")
    zeros = pruned_zeros(source, loaded)
    if zeros["kept"] != zeros["source"]:
        raise UserError(f"{zeros['source'] - zeros['kept']} pruned zeros are not zero in the GGUF file read back; "
                        "nothing was written")
    sample = tokenizer.decode(ids[: 4 * options.eval_seqlen])
    if loaded_tokenizer(sample).input_ids != tokenizer(sample).input_ids:
        raise UserError("the tokenizer read back from the GGUF file encodes --eval_text otherwise than the source's "
                        f"{type(tokenizer).__name__} does (its shape is not one this {source.config.model_type} file "
                        "rebuilds); nothing was written")
    kw = dict(seqlen=options.eval_seqlen, progress=progress)
    return {"facts": written.facts, "logits_max_abs_difference": worst,
            "logits_max_abs_difference_to_unrounded": against_source, "pruned_zeros": zeros,
            "perplexity": {"source": perplexity(source, ids, **kw), "loaded": perplexity(loaded, ids, **kw),
                           "tokens": len(ids), "window": options.eval_seqlen},
            "tokenizer_matches": True, "config_differences": {key: list(pair) for key, pair in differences.items()},
            "loaded_class": type(loaded).__name__, "bytes": tmp.stat().st_size}


#: Config fields that name or describe the files rather than the computation.
NAMING_KEYS = {"_name_or_path", "_model_name_or_path", "architectures", "quantization_config", "dtype", "torch_dtype",
               "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "use_cache",
               "output_attentions", "output_hidden_states", "return_dict", "tie_word_embeddings", "initializer_range"}
#: Fields on which the file and the source may differ past the window only: a report note, not a refusal.
WINDOW_KEYS = {"sliding_window"}


def config_differences(ours: Any, back: Any) -> dict[str, tuple[Any, Any]]:
    """The computation's config fields on which the model transformers' GGUF reader builds differs
    from the source (floats within float32 rounding are equal), as ``{field: (source, read back)}``:
    the fields both configs have (Mistral comes back as a Llama, whose class has no other fields),
    and the sliding window."""
    import math

    a, b = ours.to_dict(), back.to_dict()
    found = {}
    for key in sorted(((set(a) & set(b)) | WINDOW_KEYS) - NAMING_KEYS - {"model_type"}):
        x, y = a.get(key), b.get(key)
        if isinstance(x, float) and isinstance(y, float) and math.isclose(x, y, rel_tol=1e-6):
            continue
        if x != y:
            found[key] = (x, y)
    return found


def pruned_zeros(source: Any, loaded: Any) -> dict[str, Any]:
    """The exact zeros of the source's prunable block layers and how many of them are zero in the
    loaded-back model, at the same places."""
    from fairprune.causal import pipeline
    from fairprune.causal.blocks import Resident

    counts = {"zeros": 0, "kept": 0, "total": 0}
    ours, theirs = Resident(source), Resident(loaded)

    def compare(index: int, block) -> None:  # every unit the methods prune: experts too
        back_units = theirs.family.block_units(theirs.blocks[index])
        for name, unit in ours.family.block_units(block).items():
            mask = unit.weight == 0
            counts["zeros"] += int(mask.sum())
            counts["kept"] += int((back_units[name].weight[mask] == 0).sum())
            counts["total"] += mask.numel()

    pipeline.run(ours, [pipeline.Each(change=compare)])
    zeros, kept, total = counts["zeros"], counts["kept"], counts["total"]
    return {"source": zeros, "kept": kept, "fraction_kept": kept / zeros if zeros else 1.0,
            "share": zeros / total if total else 0.0}


def gguf_report(model: str, path: Path, source: Any, found: dict[str, Any], options: GGUFOptions) -> dict[str, Any]:
    """``<name>.report.json``: the file, its size against the dense bf16 weights, and the checks."""
    from fairprune.hub.gguf_file import GGML_TYPES

    seen, params = set(), 0
    for tensor in source.state_dict().values():  # tied tensors once
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key not in seen:
            seen.add(key)
            params += tensor.numel()
    dense = 2 * params
    facts = found["facts"]
    report = {"format": "gguf", "gguf_type": options.gguf_type, "bits": GGML_TYPES[options.gguf_type][1],
              "bits_per_weight": 8 * found["bytes"] / params, "model": model, "output": str(path),
              "model_type": source.config.model_type, **facts, "parameters": params, "bytes": found["bytes"],
              "dense_bf16_bytes": dense, "ratio": found["bytes"] / dense,
              "read_back_by": f"transformers AutoModelForCausalLM.from_pretrained(gguf_file=...) as {found['loaded_class']}",
              "logits_max_abs_difference": found["logits_max_abs_difference"],
              "logits_max_abs_difference_to_unrounded": found["logits_max_abs_difference_to_unrounded"],
              "pruned_zeros": found["pruned_zeros"], "perplexity": found["perplexity"],
              "tokenizer_matches": found["tokenizer_matches"]}
    window = getattr(source.config, "sliding_window", None)
    if window and window < source.config.max_position_embeddings and "sliding_window" in found["config_differences"]:
        report["note"] = (f"the source attends within a sliding window of {window} tokens; the model transformers' reader "
                          "builds from the file attends to the whole context, so they differ past that length")
    report["config_differences"] = found["config_differences"]
    return report
