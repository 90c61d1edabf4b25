"""A model loaded by transformers' own disk offload, for a pass over a model too big to hold."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any


def offloaded(folder: str | Path, lm, budget_bytes: int) -> tuple[Any, dict[str, Any]]:
    """A loader of the model in ``folder`` by transformers' own disk offload (accelerate's
    ``device_map="auto"`` with at most ``budget_bytes`` of weights in memory, the rest read from
    an offload folder module by module as the forward pass reaches it), for the lm-eval pass of a
    streamed run; and the facts the report records. The offload folder is removed afterwards."""
    facts: dict[str, Any] = {"how": "accelerate disk offload", "budget_bytes": int(budget_bytes)}

    @contextlib.contextmanager
    def load():
        import torch
        from transformers import AutoModelForCausalLM

        from fairprune.hub.quantized import dequantizing, is_quantized

        # a pack-quantized folder: its layers decompressed on load, as the streamed run measured it
        extra = {"quantization_config": dequantizing()} if is_quantized(folder) else {}
        with tempfile.TemporaryDirectory(prefix="fairprune-offload-") as spill:
            model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=getattr(torch, lm.dtype), device_map="auto", max_memory={"cpu": int(budget_bytes)},
                offload_folder=spill, trust_remote_code=lm.trust_remote_code, **extra)
            where = getattr(model, "hf_device_map", None) or {}  # none: the whole model fitted the budget
            facts["on_disk"] = sorted(name or "(the whole model)" for name, device in where.items() if device == "disk")
            try:
                yield model.eval()
            finally:
                del model

    return load, facts
