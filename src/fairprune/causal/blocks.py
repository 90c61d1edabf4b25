"""A causal LM as a sequence of blocks: the one interface the LM pipeline works through.

Every post-training step — capturing block 0's inputs, the layer-by-layer calibration and solve,
perplexity and pair scores, FASP's head scores, the lm-eval pass, the dense cache's weights digest —
sees a model through :class:`BlockModel`, written down here as an abstract class:

- the parts: ``model`` (the transformers module: parameters real, or on ``meta`` until loaded),
  ``family`` (its structure, found from the model: :func:`fairprune.causal.families.family_of`),
  :meth:`~BlockModel.front_modules` (embeddings), ``blocks``, :meth:`~BlockModel.tail_modules`
  (final norm, then the head) and :meth:`~BlockModel.layers` (the prunable layers by name);
- loading a part: :meth:`~BlockModel.loaded`, a context in which the given modules are resident on
  the compute device;
- reading and writing a part: :meth:`~BlockModel.read_output` (a state-dict entry as
  ``save_pretrained`` writes it) and :meth:`~BlockModel.writer` (where solved blocks go as they are
  solved);
- saving: :meth:`~BlockModel.save` with :class:`SaveOptions`;
- running: :meth:`~BlockModel.forward`, the block forward (:mod:`fairprune.causal.pipeline`) over
  batches, every block loaded once for all of them, and :meth:`~BlockModel.head`, the logits of
  its output; :meth:`~BlockModel.runnable`, the whole model for a library that calls its forward
  (lm-evaluation-harness);
- measuring: the one implementation, :func:`fairprune.metrics.language.measure_lm_items`, runs on
  this interface (through :meth:`forward` and :meth:`head`), whichever kind the model is.

Two kinds implement it. :class:`Resident` is a model in memory: loading a part moves it to the
compute device and back (nothing on a CPU run). :class:`fairprune.causal.streamed.StreamedModel`
keeps its weights in the folder's safetensors files and reads a part only while it is loaded, so a
model larger than memory is pruned and measured with one block resident. Which one a run uses is
decided once, where the model is opened (:func:`fairprune.workflows.opened.open_blocks`).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fairprune.causal import pipeline
from fairprune.causal.families import family_of
from fairprune.causal.pipeline import CalibInput, capture


def device_of(module: nn.Module) -> torch.device:
    """Where a module's first parameter (or buffer) lives; CPU for an empty one."""
    tensor = next(module.parameters(), None)
    if tensor is None:
        tensor = next(module.buffers(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


@dataclass(frozen=True)
class SaveOptions:
    """How a pruned LM is saved, whichever way it was held (``save`` of the resident and the
    streamed block model both take it; each uses what applies to it).

    Args:
        save_format: dense, or compressed (the sparse layouts; a model in memory only).
        nm: the N:M pattern pruned to, for the 2:4 layout.
        trust_remote_code: passed to transformers when the saved folder is loaded back.
        progress: progress bars while writing and loading back.
        method: the run's method, for messages.
        output: the run's folder, for messages and as the saved model's source.

    Whether the folder is quantized is the block model's own state (:meth:`BlockModel.quantize_with`).
    """

    save_format: str = "dense"
    nm: tuple[int, int] | None = None
    trust_remote_code: bool = False
    progress: bool = True
    method: str = ""
    output: str = ""


class BlockModel(abc.ABC):
    """The block-model interface (see the module docstring): the parts by the family's structure
    and their state-dict names, the block forward; what loads, reads, writes and saves a part is
    each kind's own."""

    streamed = False
    dtype: torch.dtype

    def __init__(self, model: nn.Module, source: str, load=None, device=None):
        self.model, self.config, self.source = model, model.config, source
        self._device = device  # where the blocks run (None: where the model is)
        self._prefix = {id(m): name for name, m in model.named_modules()}
        self.family = family_of(model, load)  # ``load``: how discovery makes parts resident (streamed)
        self.blocks = list(self.family.block_list(model))
        self._quantizer = None  # the quantization plan the model is written with (None: not quantized)
        self._digest: str | None = None  # the weights' digest once computed, until they change
        self._writer = None  # where its changed blocks are written as they are changed (streamed)

    # -- its state ----------------------------------------------------------------------------------
    def quantize_with(self, plan) -> None:
        """Write the model quantized by ``plan`` (:class:`fairprune.pruning.gptq.LayerQuantizer`:
        the scheme and group size; GPTQ's scales as the pass solves them)."""
        self._quantizer = plan

    @property
    def quantizer(self):
        """The quantization plan the model is written with (None: it is written in floats)."""
        return self._quantizer

    def changed(self) -> None:
        """Its weights changed: a digest taken before no longer holds."""
        self._digest = None

    def digest(self) -> str:
        """SHA-256 of the model's class, config and every state-dict tensor (name, dtype, shape,
        bytes), read one at a time (a streamed model's from its files, in the run's dtype: the bytes
        ``from_pretrained`` would load, so the same digest); kept until :meth:`changed`."""
        if self._digest is None:
            import hashlib
            import json

            digest = hashlib.sha256(type(self.model).__name__.encode())
            settings = {k: v for k, v in self.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
            digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
            state = self.model.state_dict(keep_vars=True)
            for name in sorted(state):
                digest.update(f"{name}|{state[name].dtype}|{tuple(state[name].shape)}".encode())
                flat = self.read_output(name).detach().to("cpu").contiguous().reshape(-1)
                digest.update(memoryview(flat.view(torch.uint8).numpy()))
            self._digest = digest.hexdigest()
        return self._digest

    @property
    def reads_files(self) -> bool:
        """Whether every pass reads the blocks from the model's files (streamed: a pass is slow,
        and a library's forward finds the parameters on ``meta`` until a hook reads them)."""
        return self.streamed

    def pass_facts(self) -> dict[str, Any]:
        """What a report says of how a pass held the model (streamed: one part resident)."""
        if not self.streamed:
            return {}
        return {"streamed": {"how": "one part resident, read from the model's files as the forward reaches it",
                             "largest_part_bytes": self.facts()["largest_part_bytes"]}}

    @property
    def holds_changes(self) -> bool:
        """Whether a change made by a pass stays in this object (a model in memory, changed in
        place) rather than going to the files its writer writes (streamed)."""
        return not self.streamed

    @property
    def how(self) -> str:
        """``streamed`` or ``in memory``: how the run holds the model, for messages and reports."""
        return "streamed" if self.streamed else "in memory"

    # -- the parts --------------------------------------------------------------------------------
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

    def layers(self) -> dict[str, nn.Module]:
        """The prunable layers of every block by full module name (no weights read)."""
        return {self.prefix(layer)[:-1]: layer for block in self.blocks
                for layer in self.family.block_linears(block).values()}

    @property
    def owner(self) -> nn.Module:
        """The module whose forward runs the blocks (``LlamaModel``, OPT's decoder)."""
        parent, _, _ = self._prefix[id(self.family.block_list(self.model))].rpartition(".")
        return self.model.get_submodule(parent)

    def state_of(self, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The (loaded) state-dict entries of ``module`` under their full names."""
        yield from module.state_dict(prefix=self.prefix(module)).items()

    # -- what each kind does its own way ----------------------------------------------------------
    @abc.abstractmethod
    def loaded(self, *modules: nn.Module, device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
        """A context in which ``modules`` are resident on ``device``, as they were after it."""

    @abc.abstractmethod
    def read_output(self, name: str) -> torch.Tensor:
        """The state-dict entry ``name`` as ``save_pretrained`` of the model writes it."""

    @abc.abstractmethod
    def writer(self, out):
        """Where changed blocks are written as they are changed (None: the model is saved whole),
        remembered for :meth:`save`."""

    @abc.abstractmethod
    def save(self, out, tokenizer, options: SaveOptions) -> tuple[BlockModel, dict | None]:
        """The changed model into ``out`` (None: this rank does not write): the model the run
        measures, and the ``weights`` facts written."""

    def run_on(self, device) -> None:
        """Run the blocks on ``device`` from now on (a model in memory moves there)."""
        self._device = device

    @abc.abstractmethod
    def restructured(self, change, fields: dict[str, Any], out, progress: bool = False) -> BlockModel:
        """The model with every block changed in its structure by ``change(index, block)`` (head
        removal slices q/k/v and the output projection) and its config's ``fields`` set: this
        model changed in place, or (streamed) a copy written into ``out`` block by block and opened
        from there; :meth:`save` then finishes its folder."""

    @abc.abstractmethod
    def runnable(self, device) -> contextlib.AbstractContextManager:
        """A context giving the whole model, its forward callable as transformers' (lm-eval)."""

    @abc.abstractmethod
    def weight_bytes(self) -> int:
        """Bytes of the weights ``save_pretrained`` writes."""

    @abc.abstractmethod
    def saved_bytes(self, tokenizer) -> int:
        """About what the pruned model's folder takes on disk (weights and tokenizer files)."""

    @abc.abstractmethod
    def facts(self) -> dict[str, int]:
        """The sizes a report's ``memory`` records."""

    # -- running ----------------------------------------------------------------------------------
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

    @torch.no_grad()
    def forward(self, calls: list[dict[str, torch.Tensor]], device, progress: bool = False,
                desc: str = "blocks") -> list[torch.Tensor]:
        """The hidden states after the last block and the final norm (the head's input) of each
        call (``input_ids`` and optionally ``attention_mask``), every block loaded once for all of them."""
        inputs = [CalibInput(call["input_ids"], attention=call.get("attention_mask")) for call in calls]
        batches = pipeline.run(self, batches=capture(self, inputs, device), device=device, progress=progress, desc=desc)
        return self.tail([b.hidden for b in batches], device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits for final hidden states (after the tail; the head loaded): the
        head and whatever the model's own forward does after it (Gemma's soft-capping)."""
        from fairprune.causal.structure import head_logits

        return head_logits(self.model, self.owner, hidden)

    @contextlib.contextmanager
    def head(self, device) -> Iterator[Any]:
        """The logits of final hidden states (:meth:`logits`), the output head loaded for the time
        of the block."""
        with self.loaded(self.model.get_output_embeddings(), device=device):
            yield self.logits

    def run_device(self) -> torch.device:
        """Where the blocks run when the caller names no device: a model in memory where it is, a
        streamed one where :meth:`run_on` said (CPU unless said)."""
        return torch.device(self._device) if self._device is not None else device_of(self.model)


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
        """None: a model in memory is saved whole once changed (:meth:`save`)."""
        return None

    def run_on(self, device) -> None:
        self.model.to(device)  # where it is is where it runs

    def save(self, out, tokenizer, options: SaveOptions) -> tuple[Resident, dict | None]:
        """The changed model into ``out`` (None on ranks that do not write), refused when not
        finite on every rank: the model the run measures and the ``weights`` facts of the files
        written. That model is this one (changed in place), or when quantized (:meth:`quantize_with`:
        w4a16, w8a16, their -gptq forms, :mod:`fairprune.hub.quantized`) the one plain
        ``from_pretrained`` loads back from ``out``, in this model's dtype, so the figures are
        those of the folder as it ships (under ``torchrun`` every rank loads the folder rank 0
        wrote: its staging folder must be readable by every rank, as a streamed run's is)."""
        from fairprune.hub.checks import check_result
        from fairprune.hub.compressed import save_weights

        check_result(self.model, options.output, options.method)
        plan = self._quantizer
        if plan is None:
            if out is None:
                return self, None
            weights = save_weights(self.model, out, options.save_format, options.nm, self.layers())
            tokenizer.save_pretrained(out)
            return self, weights
        from fairprune.distributed import broadcast_text
        from fairprune.hub.quantized import load_quantized, save_quantized

        weights = None
        if out is not None:
            weights = save_quantized(self.model, out, plan.quantize, plan.asked, layers=self.layers(),
                                     progress=options.progress, scales=plan.scales)
            tokenizer.save_pretrained(out)
        folder = broadcast_text(None if out is None else str(out))  # torchrun: every rank loads rank 0's files
        loaded = load_quantized(folder, self.dtype, options.trust_remote_code, progress=options.progress and out is not None)
        return Resident(loaded, source=self.source), weights

    @torch.no_grad()
    def restructured(self, change, fields: dict[str, Any], out=None, progress: bool = False) -> Resident:
        pipeline.run(self, [pipeline.Each(change=change)])
        for name, value in fields.items():
            setattr(self.model.config, name, value)
        self.changed()
        return self

    @contextlib.contextmanager
    def runnable(self, device) -> Iterator[nn.Module]:
        """The model itself on ``device``, back where it was afterwards."""
        home = device_of(self.model)
        try:
            yield self.model.to(device)
        finally:
            self.model.to(home)

    def facts(self) -> dict[str, int]:
        """The sizes a report's ``memory`` records."""
        return {"model_bytes": self.weight_bytes()}


def as_blocks(model) -> BlockModel:
    """``model`` as blocks: a :class:`Resident` for an ``nn.Module``, a block model as it is."""
    return model if isinstance(model, BlockModel) else Resident(model)


@torch.no_grad()
def zero_fraction(blocks) -> float:
    """The share of exact zeros in what the methods prune in every block (its linear layers but the
    routers, and each expert of a fused expert parameter), one block loaded at a time."""
    counts = [0, 0]

    def count(index: int, block: nn.Module) -> None:
        for unit in blocks.family.block_units(block).values():
            counts[0] += int((unit.weight == 0).sum())
            counts[1] += unit.weight.numel()

    pipeline.run(blocks, [pipeline.Each(change=count)], device="cpu")
    return counts[0] / counts[1] if counts[1] else 0.0
