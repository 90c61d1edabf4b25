"""Opening the model of an LM command, in memory or streamed from disk: decided once, here.

``--stream auto`` (the default) streams when the model's weights, in the run's ``--dtype``, would
take more than half the memory the system has available (``MemAvailable``): an in-memory run
holds the model, the solver's buffers and the measurement's activations beside it, so a model
above half of what is free risks swapping or the kernel's OOM killer; below it the in-memory run
is the faster one (no weights read twice from disk). The run prints which way it goes and why.
``--stream true`` and ``false`` force it. Only a local folder of safetensors weights (a cached
hub model, a converted GGUF) of a causal family can stream, and only with ``--save_format
dense``; ``auto`` runs anything else in memory.

Everything after the opening is the one pipeline (:mod:`fairprune.workflows.lm`,
:mod:`fairprune.runs.lm`): the model is a block model (:mod:`fairprune.causal.blocks`),
and which kind it is changes only how a part is loaded, saved and scored by lm-eval.
"""

from __future__ import annotations

import math

from fairprune import distributed
from fairprune.causal.blocks import Resident
from fairprune.errors import UserError
from fairprune.hub import check_local_path, load_model, resolve_name
from fairprune.memory import available_bytes, return_freed_memory
from fairprune.pruning.options import LMOptions

#: ``--stream auto`` streams a model whose weights exceed this share of the available memory.
STREAM_SHARE = 0.5
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _streamable_bytes(lm: LMOptions) -> int | None:
    """The weights' bytes in ``--dtype`` when the model could stream (a local safetensors folder,
    read headers only), else None."""
    from fairprune.hub.shards import ShardReader, local_folder

    if lm.save_format != "dense":
        return None
    try:
        reader = ShardReader(local_folder(lm.model, resolve_name(lm.model)))
        return sum(math.prod(reader.info(key)[1]) for key in reader.keys()) * _DTYPE_BYTES[lm.dtype]
    except (UserError, OSError, ValueError, KeyError):
        return None


def stream_choice(lm: LMOptions, talk: bool = True) -> bool:
    """Whether the run streams (``--stream``; ``auto`` as the module docstring says, the same
    answer on every rank: rank 0's). ``talk``: print the choice ``auto`` made. A local path that is
    not there is refused first, so its error line is all the run prints."""
    check_local_path(lm.model)
    if isinstance(lm.stream, bool):
        return lm.stream
    answer, why = False, ""
    if distributed.is_main():
        size, free = _streamable_bytes(lm), available_bytes()
        if size is None:
            why = "in memory (--stream auto: the model is not a local safetensors folder, or --save_format is not dense)"
        elif free is None:
            why = "in memory (--stream auto: the available memory is not known here; --stream true streams)"
        else:
            answer = size > STREAM_SHARE * free
            way = "streamed from disk, one block resident" if answer else "in memory"
            why = (f"{way} (--stream auto: weights {size / 1e9:.2f} GB in {lm.dtype}, {free / 1e9:.1f} GB available; "
                   f"it streams above {STREAM_SHARE:.0%} of that; --stream true|false forces a way)")
    answer = distributed.broadcast_text("1" if answer else "0") == "1"
    if talk and distributed.is_main():
        print(f"[lm] {why}", flush=True)
    return answer


def open_blocks(lm: LMOptions, stream: bool):
    """The model of ``--model`` as a block model: a :class:`~fairprune.causal.streamed.StreamedModel`
    reading its safetensors files, or a :class:`~fairprune.causal.blocks.Resident` loaded whole
    (a model with NaN / inf weights is refused here, before any work)."""
    if stream:
        from fairprune.causal.streamed import StreamedModel
        from fairprune.hub.compressed import torch_dtype
        from fairprune.hub.shards import local_folder

        if lm.save_format != "dense":
            raise UserError(f"--stream true writes the pruned model block by block as plain safetensors; --save_format "
                            f"{lm.save_format} needs the whole model in memory: use --save_format dense with --stream true")
        return_freed_memory()
        folder = local_folder(lm.model, resolve_name(lm.model))
        return StreamedModel(folder, torch_dtype(lm.dtype), lm.trust_remote_code, source=lm.model)
    from fairprune.hub.checks import check_input_model
    from fairprune.hub.compressed import check_can_compress

    check_can_compress(lm.save_format)  # --save_format compressed without its package: refused before loading
    model = load_model(lm.model, "causal-lm", lm.trust_remote_code, dtype=lm.dtype)
    check_input_model(model, lm.model)
    return Resident(model, source=lm.model)
