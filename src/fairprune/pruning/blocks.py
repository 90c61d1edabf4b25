"""A causal LM as a sequence of blocks: the one interface the LM pipeline works through.

Every post-training step — capturing block 0's inputs, the layer-by-layer calibration and solve,
the perplexity and pair measurements, the dense cache's weights digest — sees a model as

- ``model``: the transformers module (its parameters real, or on ``meta`` until loaded),
  ``family`` (its row, structure found from the model: :func:`fairprune.families.family_of`) and ``blocks``;
- :meth:`front_modules` (embeddings), the blocks, :meth:`tail_modules` (final norm, then the head);
- :meth:`loaded`: a context in which the given parts are resident on the compute device;
- :meth:`state_of` (a part's state-dict entries under their full names) and :meth:`tensors`
  (every state-dict entry, for the digest);
- :meth:`measure`: perplexity and pair outcomes of the whole model.

Two kinds implement it. :class:`Resident` is a model in memory: loading a part moves it to the
compute device and back (nothing on a CPU run). :class:`fairprune.pruning.streamed.StreamedModel`
keeps its weights in the folder's safetensors files and reads a part only while it is loaded, so a
model larger than memory is pruned and measured with one block resident. Which one a run uses is
decided once, where the model is opened (:func:`fairprune.workflows.opened.open_lm`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from fairprune.families import family_of
from fairprune.pruning.options import SaveOptions


def device_of(module: nn.Module) -> torch.device:
    """Where a module's first parameter (or buffer) lives; CPU for an empty one."""
    tensor = next(module.parameters(), None)
    if tensor is None:
        tensor = next(module.buffers(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


class BlockModel:
    """What both kinds share: the model's parts by the family table, and their state-dict names."""

    streamed = False
    #: ``--quantize``'s plan (:class:`fairprune.pruning.gptq.LayerQuantizer`), set by the run that
    #: writes the model quantized: GPTQ solves each layer after its prune, the writer stores its scales.
    quantizer = None

    def __init__(self, model: nn.Module, source: str, load=None):
        self.model, self.config, self.source = model, model.config, source
        self._prefix = {id(m): name for name, m in model.named_modules()}
        self.family = family_of(model, load)  # ``load``: how discovery makes parts resident (streamed)
        self.blocks = list(self.family.block_list(model))

    def prefix(self, module: nn.Module) -> str:
        """The state-dict prefix of a submodule (``"model.layers.3."``)."""
        name = self._prefix[id(module)]
        return f"{name}." if name else ""

    def front_modules(self) -> list[nn.Module]:
        """The modules that run before block 0."""
        return self.family.front_modules(self.model)

    def tail_modules(self) -> list[nn.Module]:
        """The modules that run after the last block, the head last."""
        return self.family.tail_modules(self.model)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits for final hidden states (after the tail; the head loaded): the
        head and whatever the model's own forward does after it (Gemma's soft-capping)."""
        from fairprune.causal.structure import head_logits

        return head_logits(self.model, self.owner, hidden)

    @property
    def owner(self) -> nn.Module:
        """The module whose forward runs the blocks (``LlamaModel``, OPT's decoder)."""
        parent, _, _ = self._prefix[id(self.family.block_list(self.model))].rpartition(".")
        return self.model.get_submodule(parent)

    def state_of(self, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The (loaded) state-dict entries of ``module`` under their full names."""
        yield from module.state_dict(prefix=self.prefix(module)).items()

    def each_block(self, device, progress: bool = False, desc: str = "blocks") -> Iterator[tuple[int, nn.Module]]:
        """``(index, block)`` of every block in order, each loaded on ``device`` while the caller
        works on it: a pass over the model with one block resident (a streamed model's read once)."""
        for index, block in enumerate(tqdm(self.blocks, desc=desc, unit="block", leave=False, disable=not progress)):
            with self.loaded(block, device=device):
                yield index, block

    def tail(self, hidden: list[torch.Tensor], device) -> list[torch.Tensor]:
        """Hidden states after the last block through the tail (the final norm; OPT's
        ``project_out``): the head's input. The tail is loaded once for all of them."""
        tails = self.tail_modules()[:-1]
        out = []
        with self.loaded(*tails, device=device):
            for h in hidden:
                for module in tails:
                    h = module(h)
                out.append(h)
        return out

    @contextlib.contextmanager
    def head(self, device) -> Iterator[Any]:
        """The logits of final hidden states (:meth:`logits`), the output head loaded for the time
        of the block."""
        with self.loaded(self.model.get_output_embeddings(), device=device):
            yield self.logits

    def run_device(self) -> torch.device:
        """Where the blocks run when the caller names no device: a model in memory where it is, a
        streamed one on :attr:`device` (CPU unless set)."""
        return torch.device(getattr(self, "device", None) or device_of(self.model))


class Resident(BlockModel):
    """A model in memory, as blocks (see the module docstring)."""

    def __init__(self, model: nn.Module, source: str | None = None):
        super().__init__(model, source or getattr(model.config, "_name_or_path", "") or type(model).__name__)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @contextlib.contextmanager
    def loaded(self, *modules: nn.Module, device: str | torch.device = "cpu") -> Iterator[None]:
        """``modules`` on ``device`` for the time of the block, back where they were after it."""
        homes = [device_of(m) for m in modules]
        try:
            for module in modules:
                module.to(device)
            yield
        finally:
            for module, home in zip(modules, homes):
                module.to(home)

    def read_output(self, name: str) -> torch.Tensor:
        """A state-dict entry (what ``save_pretrained`` writes under ``name``), found by its path:
        the digest reads every entry, and building the whole state dict for each would be quadratic."""
        path, _, leaf = name.rpartition(".")
        return getattr(self.model.get_submodule(path) if path else self.model, leaf).detach()

    def weight_bytes(self) -> int:
        """Bytes of the weights ``save_pretrained`` writes (a shared tensor once)."""
        from fairprune.hub.compressed import dense_weight_bytes

        return dense_weight_bytes(self.model)

    def saved_bytes(self, tokenizer) -> int:
        """About what the pruned model's folder takes on disk (weights and tokenizer files)."""
        from fairprune.hub.checks import saved_bytes

        return saved_bytes(self.model, tokenizer)

    def writer(self, out) -> None:
        """None: a model in memory is saved whole once pruned (:meth:`save`)."""
        return None

    def save(self, out, output, tokenizer, writer, method: str, options: SaveOptions) -> tuple[Resident, dict | None]:
        """The pruned model into ``out`` (None on ranks that do not write; ``output``: the run's
        folder, for messages), refused when not finite on every rank: the model the run measures
        and the ``weights`` facts of the files written. That model is this one (pruned in place),
        or with ``quantize`` (w4a16, w8a16, their -gptq forms: :mod:`fairprune.hub.quantized`) the one plain
        ``from_pretrained`` loads back from ``out``, in this model's dtype, so the figures are
        those of the folder as it ships."""
        from fairprune.hub.compressed import save_weights
        from fairprune.reporting.runs import check_result

        check_result(self.model, output, method)
        if out is None:
            return self, None
        quantize, progress = options.quantize, options.progress
        if quantize != "none":
            from fairprune.hub.quantized import load_quantized, save_quantized

            scales = self.quantizer.scales if self.quantizer is not None else None
            weights = save_quantized(self.model, out, quantize, options.quant_group_size, progress=progress, scales=scales)
            tokenizer.save_pretrained(out)
            loaded = load_quantized(out, self.dtype, options.trust_remote_code, progress=progress)
            return Resident(loaded, source=self.source), weights
        weights = save_weights(self.model, out, options.save_format, options.nm)
        tokenizer.save_pretrained(out)
        return self, weights

    def task_model(self, lm) -> tuple[nn.Module | None, Any]:
        """What lm-eval runs on: the model itself (no offload)."""
        return self.model, None

    def facts(self) -> dict[str, int]:
        """The sizes a report's ``memory`` records."""
        return {"model_bytes": self.weight_bytes()}

    def measure(self, tokenizer, ids: torch.Tensor, pairs: list, window: int, device, progress: bool = False) -> tuple[dict, Any]:
        """:func:`fairprune.metrics.language.measure_lm_items` of the model; it ends on the CPU."""
        from fairprune.metrics.language import measure_lm_items

        try:
            return measure_lm_items(self.model, tokenizer, ids, pairs, window, device, progress=progress)
        finally:
            self.model.to("cpu")


def as_blocks(model) -> BlockModel:
    """``model`` as blocks: a :class:`Resident` for an ``nn.Module``, a block model as it is."""
    return model if isinstance(model, BlockModel) else Resident(model)


@torch.no_grad()
def zero_fraction(blocks) -> float:
    """The share of exact zeros in the prunable layers of every block, one block loaded at a time."""
    zeros = total = 0
    for block in blocks.blocks:
        layers = list(blocks.family.block_linears(block).values())
        with blocks.loaded(*layers):
            for layer in layers:
                zeros += int((layer.weight == 0).sum())
                total += layer.weight.numel()
    return zeros / total if total else 0.0
