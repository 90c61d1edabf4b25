"""Post-training pruning of a causal LM that never holds the whole model: one block in memory.

:class:`StreamedModel` is a transformers model built from its config with every parameter on the
``meta`` device (``accelerate.init_empty_weights``; buffers such as rotary tables are real) whose
weights stay in the folder's safetensors files (:class:`fairprune.hub.shards.ShardReader`). A part
of it — the embedding front, one transformer block, the final norm and head — is loaded just
before it runs, in the run's dtype, and put back on ``meta`` right after (:meth:`StreamedModel.loaded`),
so at most one block's weights (or the embeddings) are resident. Every part is checked finite
as it loads. Tied weights (the head sharing the token embedding) are read from whichever name
the checkpoint stores.

It is a block model (:mod:`fairprune.causal.blocks`): the one pipeline prunes it as it prunes a
model in memory (:func:`fairprune.pruning.llm.prune_causal_lm`: the same checks, calibration,
statistics, layer solve and per-layer sparsity), each pruned block written to a
:class:`~fairprune.hub.shards.ShardWriter` (:meth:`StreamedModel.writer`) as soon as it is solved
and the untouched tensors (front, final norm, head) passed straight from the input files to the
output ones, so the output folder is what ``save_pretrained`` of the pruned model would write.

It runs as every block model does (:meth:`~fairprune.causal.blocks.BlockModel.forward`: block 0's
inputs captured, every block loaded once and run on all batches, the hidden states held between
blocks, then the final norm and the head), which is how it is measured
(:func:`fairprune.metrics.language.measure_lm_items`); for lm-eval, which calls the whole model's
forward, :meth:`StreamedModel.runnable` hooks every part so that the same reader loads it as the
forward reaches it.

Under ``torchrun`` every rank streams the model the same way (no rank holds it whole); only the
rank given a writer writes.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from fairprune.causal import pipeline
from fairprune.causal.blocks import BlockModel, SaveOptions
from fairprune.errors import UserError
from fairprune.hub.checks import nonfinite
from fairprune.hub.quantized_stream import QuantizedReader, open_reader
from fairprune.hub.shards import refuse_nonfloat
from fairprune.memory import trim_heap


def _split(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module owning parameter ``name`` (relative to ``module``) and its attribute name."""
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


class StreamedModel(BlockModel):
    """A causal LM whose weights stay in its folder's safetensors files (see the module docstring).

    ``dtype``: what parameters are loaded as (None: float32); ``device``: where blocks run when a
    caller names no device (:meth:`~fairprune.causal.blocks.BlockModel.run_device`)."""

    streamed = True

    def __init__(self, folder: str | Path, dtype: torch.dtype | None = None, trust_remote_code: bool = False,
                 source: str | None = None, device: str | torch.device = "cpu"):
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        self.folder = Path(folder)
        source = source or str(folder)  # the name the user gave, for messages
        self.reader = open_reader(self.folder)  # a pack-quantized folder: its layers read decompressed
        self.dtype = dtype or torch.float32
        self.trust_remote_code, self._restructured = trust_remote_code, False  # True: written by restructured()
        try:
            config = AutoConfig.from_pretrained(self.folder, trust_remote_code=trust_remote_code)
            if isinstance(self.reader, QuantizedReader) and hasattr(config, "quantization_config"):
                del config.quantization_config  # the model held is the float one its layers decompress to
            with init_empty_weights(include_buffers=False):
                model = AutoModelForCausalLM.from_config(config, dtype=self.dtype, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError) as err:
            hint = " (set --trust_remote_code true only if you trust it)" if "trust_remote_code" in str(err) else ""
            raise UserError(f"cannot build the model of '{source}'{hint}: {' '.join(str(err).split())[:200]}") from None
        model.tie_weights()  # empty-weight construction leaves tied weights as two parameters
        model.eval().requires_grad_(False)
        generation = self._generation_config()
        if generation is not None and model.can_generate():  # as from_pretrained reads it (its end-of-text ids)
            model.generation_config = generation
        groups: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(name)
        self._aliases = {name: names for names in groups.values() for name in names}
        self._keys: dict[str, str] = {}
        self.model, self.source = model, source
        self._find_converted()
        self._check_shapes()
        # the structure is found by a skeleton forward with the front and block 0 read from the files
        super().__init__(model, source, load=self.loaded, device=device)
        self._check_stored()

    def _check_shapes(self) -> None:
        """Before any work: every parameter is in the checkpoint with the shape the config implies."""
        for name, param in self.model.named_parameters():
            if name in self._sources:  # checked by _find_converted
                continue
            shape = self.reader.info(self.key(name))[1]
            if shape != tuple(param.shape):
                raise UserError(f"tensor {self.key(name)} of '{self.source}' has shape {list(shape)}, its config.json "
                                f"says {list(param.shape)}; the weights do not match the config (copy the folder again)")

    def _check_stored(self) -> None:
        """Before any work: the prunable layers' weights are stored as floating point."""
        weights = [key for block in self.blocks for layer in self.family.block_linears(block).values()
                   for key in self._sources.get(self.prefix(layer) + "weight", [self.key(self.prefix(layer) + "weight")])]
        refuse_nonfloat({key: self.reader.stored_dtype(key) for key in weights}, self.source)

    def key(self, name: str) -> str:
        """The checkpoint's name for the model's parameter or buffer ``name``: the same name, a
        tied alias, or either with the base-model prefix added or dropped (older checkpoints)."""
        if name in self._keys:
            return self._keys[name]
        base = getattr(self.model, "base_model_prefix", "") or ""
        for alias in self._aliases.get(name, [name]):
            candidates = [alias]
            if base and alias.startswith(base + "."):
                candidates.append(alias[len(base) + 1:])
            elif base:
                candidates.append(f"{base}.{alias}")
            for candidate in candidates:
                if candidate in self.reader:
                    self._keys[name] = candidate
                    return candidate
        raise UserError(f"the weights of '{self.source}' hold no tensor for {name}; the safetensors files do not "
                        "match the folder's config.json")

    def _direct(self, name: str) -> str | None:
        try:
            return self.key(name)
        except UserError:
            return None

    def _find_converted(self) -> None:
        """The parameters the checkpoint stores converted (renamed, or fused as transformers fuses
        them when it loads: Mixtral's per-expert ``w1`` / ``w3`` into ``gate_up_proj``), with the
        checkpoint tensors each is made from (``_sources``), checked by converting meta tensors of
        the stored shapes (no data read); a parameter neither stored nor converted is refused."""
        from fairprune.hub.conversion import checkpoint_names, to_model

        self._sources: dict[str, list[str]] = {}
        missing = {n: p.shape for n, p in self.model.named_parameters() if self._direct(n) is None}
        if not missing:
            return
        for name, keys in checkpoint_names(self.model, missing).items():
            if keys == [name] or not all(k in self.reader for k in keys):
                self.key(name)  # raises: not in the files under any name
            self._sources[name] = keys
        stored = {k: torch.empty(self.reader.info(k)[1], device="meta") for keys in self._sources.values() for k in keys}
        try:
            made = to_model(self.model, stored)
        except Exception as err:  # noqa: BLE001 - transformers' own conversion failed on these shapes
            raise UserError(f"'{self.source}': transformers' conversion of its stored tensors failed "
                            f"({' '.join(str(err).split())[:160]}); the files do not match the config.json") from None
        for name, shape in missing.items():
            if name not in made or tuple(made[name].shape) != tuple(shape):
                got = list(made[name].shape) if name in made else "nothing"
                raise UserError(f"the stored tensors {', '.join(self._sources[name][:2])} of '{self.source}' convert to "
                                f"{got} for {name}, its config.json says {list(shape)}; the weights do not match the config")

    def _read_converted(self, names: list[str], device="cpu") -> dict[str, torch.Tensor]:
        """Parameters ``names`` made from their stored tensors by transformers' conversion, each in
        its parameter's dtype on ``device``."""
        from fairprune.hub.conversion import to_model

        keys = list(dict.fromkeys(k for n in names for k in self._sources[n]))
        dtype = self.model.get_parameter(names[0]).dtype
        made = to_model(self.model, {k: self.reader.read(k, dtype, device) for k in keys})
        return {n: made[n] for n in names}

    @property
    def converted(self) -> bool:
        """Whether the checkpoint stores some parameters converted (then the output is written in
        the checkpoint's own layout, as ``save_pretrained`` writes it)."""
        return bool(self._sources)

    def output_tensors(self) -> dict[str, torch.Tensor]:
        """What ``save_pretrained`` of the loaded model writes, by name, in its order (meta tensors
        for parameters, the buffers themselves): every state-dict entry, a tied parameter once
        (its first name), in the natural order of the names that transformers gives a model
        loaded by ``from_pretrained`` when it saves it (``layers.2`` before ``layers.10``)."""
        seen: set[str] = set()
        out = {}
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            if name in seen:
                continue
            seen.update(self._aliases.get(name, [name]))
            out[name] = tensor
        if self._sources:  # the checkpoint's own layout (its names, its unfused experts)
            from fairprune.hub.conversion import to_checkpoint

            out = to_checkpoint(self.model, out)
        try:
            from transformers.core_model_loading import dot_natural_key
        except ImportError:  # an older transformers saves in state-dict order
            return out
        return dict(sorted(out.items(), key=lambda item: dot_natural_key(item[0])))

    def state_of(self, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The (loaded) entries of ``module`` as the output files hold them: under the full module
        names, or converted to the checkpoint's layout when it stores some converted."""
        state = dict(super().state_of(module))
        if self._sources:
            from fairprune.hub.conversion import to_checkpoint

            state = to_checkpoint(self.model, state)
        yield from state.items()

    def num_parameters(self) -> int:
        """Parameters, a tied one once (as ``save_pretrained`` records it in the index)."""
        return self.model.num_parameters()

    def read_output(self, name: str) -> torch.Tensor:
        """A state-dict entry read from the checkpoint in the model's dtype (a buffer the
        checkpoint does not hold: the model's own value)."""
        state = self.model.state_dict(keep_vars=True)
        if name not in state:  # a checkpoint name of the output (a converted layout): as stored, in the run's dtype
            stored = self.reader.info(name)[0]
            return self.reader.read(name, self.dtype if stored.is_floating_point else None)
        tensor = state[name]
        if name in self._sources:
            return self._read_converted([name])[name]
        if tensor.device.type != "meta" and not self._stored(name):
            return tensor.detach()
        return self.reader.read(self.key(name), tensor.dtype if tensor.is_floating_point() else None)

    def _stored(self, name: str) -> bool:
        try:
            self.key(name)
        except UserError:
            return False
        return True

    def writer(self, out: Path | None):
        """A writer of the changed model into ``out`` (None: this rank does not write), kept for
        :meth:`save`: the tensors ``save_pretrained`` writes, in its order; quantized
        (:meth:`~fairprune.causal.blocks.BlockModel.quantize_with`), a
        :class:`~fairprune.hub.quantized_stream.QuantizedWriter` that quantizes each block's layers as they
        are written."""
        from fairprune.hub.shards import ShardWriter

        self._writer = None
        if out is None:
            return None
        plan = self._quantizer
        if plan is not None:
            from fairprune.hub.quantized import linear_layers, save_dtype
            from fairprune.hub.quantized_stream import QuantizedWriter

            groups = dict.fromkeys(linear_layers(self.layers()), plan.group)
            self._writer = QuantizedWriter(out, self.output_tensors(), plan.quantize, groups, plan.scales,
                                           save_dtype(self.dtype), total_parameters=self.num_parameters())
        else:
            self._writer = ShardWriter(out, self.output_tensors(), total_parameters=self.num_parameters())
        return self._writer

    def weight_bytes(self) -> int:
        """Bytes of the weights ``save_pretrained`` writes in the run's dtype."""
        return sum(t.numel() * t.element_size() for t in self.output_tensors().values())

    def saved_bytes(self, tokenizer) -> int:
        """About what the pruned model's folder takes on disk (weights and tokenizer files)."""
        return self.weight_bytes() + 128 * len(tokenizer) + 64 * 1024

    def save(self, out: Path | None, tokenizer, options: SaveOptions) -> tuple[StreamedModel, dict | None]:
        """Finish the changed model in ``out`` (its blocks were written as they were changed, by
        the writer :meth:`writer` opened): the writer closed, config and tokenizer beside it (a
        quantized folder's ``quantization_config`` too); then the model as written, read from rank
        0's files on every rank (a quantized one's layers decompressed as read), and the ``weights``
        facts of the files."""
        from fairprune.distributed import broadcast_text
        from fairprune.hub.compressed import dense_facts

        weights = None
        if self._restructured:  # its files are in its own folder already: only the tokenizer is missing
            if out is not None:
                tokenizer.save_pretrained(out)
                weights = dense_facts(out, self.weight_bytes(), self.dtype)
            return self, weights
        if out is not None:
            writer, self._writer = self._writer, None
            writer.close()
            plan = self._quantizer
            self.write_model_files(out, writer.dtype if plan is not None else self.dtype)
            tokenizer.save_pretrained(out)
            if plan is not None:
                weights = writer.finish(out, plan.asked)
            else:
                weights = dense_facts(out, self.weight_bytes(), self.dtype)
        folder = Path(broadcast_text(None if out is None else str(out)))
        return StreamedModel(folder, self.dtype, options.trust_remote_code, source=options.output), weights

    def restructured(self, change: Callable[[int, nn.Module], None], fields, out: Path | None,
                     progress: bool = False) -> StreamedModel:
        """The model with every block changed in its structure (``change(index, block)``, in place,
        on a copy of the block) written into ``out`` with its config's ``fields`` set, then opened
        from there; this model is left as it was. The writer plans the changed shapes from meta
        copies of the blocks, then each block is read, copied, changed and written (the block and
        its copy resident), and the front, final norm and head pass through as they are: the files
        ``save_pretrained`` of the changed model writes. Under ``torchrun`` the rank given ``out``
        writes; the others (``out`` None) open its files once written."""
        from fairprune.distributed import broadcast_text
        from fairprune.hub.shards import ShardWriter

        config = copy.deepcopy(self.config)
        config.update(fields)
        if out is not None:
            planned, parameters = self.output_tensors(), self.num_parameters()
            for index, block in enumerate(self.blocks):  # the changed shapes, from meta copies (no weights read)
                changed = copy.deepcopy(block)
                change(index, changed)
                planned.update(self._state(block, changed))
                parameters += sum(p.numel() for p in changed.parameters()) - sum(p.numel() for p in block.parameters())
            writer = ShardWriter(out, planned, total_parameters=parameters)

            def rewrite(index: int, block: nn.Module) -> None:  # each block read, copied, changed and written
                changed = copy.deepcopy(block)
                change(index, changed)
                writer.write_many(self._state(block, changed).items())

            try:
                pipeline.run(self, [pipeline.Each(emit=rewrite)], device="cpu", progress=progress, desc="writing")
                for name in writer.missing():  # the front, the final norm, the head: as they are
                    writer.write(name, self.read_output(name))
                writer.close()
            finally:
                writer.abort()
            self.write_model_files(Path(out), config=config)
        folder = Path(broadcast_text(None if out is None else str(out)))
        changed = StreamedModel(folder, self.dtype, self.trust_remote_code, source=str(folder), device=self._device)
        changed._restructured = True
        return changed

    def _state(self, block: nn.Module, changed: nn.Module) -> dict[str, torch.Tensor]:
        """The state-dict entries of ``changed`` (a copy of ``block``) under ``block``'s full names."""
        from fairprune.hub.conversion import to_checkpoint

        state = dict(changed.state_dict(prefix=self.prefix(block)))
        return to_checkpoint(self.model, state) if self._sources else state

    def facts(self) -> dict[str, int]:
        """A report's ``memory`` sizes: the model's, its largest block's, the largest part resident."""
        block = max(self.nbytes(b) for b in self.blocks)
        parts = [self.nbytes(*self.front_modules()), self.nbytes(*self.tail_modules()[:-1]), self.nbytes(self.tail_modules()[-1])]
        return {"largest_block_bytes": block, "largest_part_bytes": max(block, *parts), "model_bytes": self.weight_bytes()}

    def write_model_files(self, out: Path, dtype: torch.dtype | None = None, config=None) -> None:
        """``config.json`` (``dtype``, default the run's; ``config``, default the model's) and
        ``generation_config.json`` beside the weights, as ``save_pretrained`` writes them."""
        config = config or self.model.config
        config.architectures = [type(self.model).__name__]
        config.dtype = dtype or self.dtype
        config.save_pretrained(out)
        generation = self._generation_config() or getattr(self.model, "generation_config", None)
        if generation is not None and self.model.can_generate():
            generation.save_pretrained(out)

    def _generation_config(self):
        """The folder's ``generation_config.json`` (None: none, or unreadable)."""
        from transformers import GenerationConfig

        if not (self.folder / "generation_config.json").is_file():
            return None
        try:
            return GenerationConfig.from_pretrained(self.folder)
        except (OSError, ValueError):
            return None

    # -- loading ----------------------------------------------------------------------------------
    def nbytes(self, *modules: nn.Module) -> int:
        """Bytes the parameters of ``modules`` take once loaded (a shared one once)."""
        seen, total = set(), 0
        for module in modules:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * p.element_size()
        return total

    @contextlib.contextmanager
    def loaded(self, *modules: nn.Module, device: str | torch.device = "cpu") -> Iterator[None]:
        """Load the parameters of ``modules`` from the checkpoint (in the model's dtype, on
        ``device``), checked finite; back on ``meta`` when the block ends, whatever happens."""
        restore: list[tuple[nn.Module, str, nn.Parameter]] = []
        names = getattr(self, "_prefix", None) or {id(m): n for n, m in self.model.named_modules()}
        try:
            for module in modules:
                prefix = f"{names[id(module)]}." if names[id(module)] else ""
                params = [(n, p) for n, p in module.named_parameters(remove_duplicate=False) if p.device.type == "meta"]
                converted = [prefix + n for n, _ in params if prefix + n in self._sources]
                made = self._read_converted(converted, device) if converted else {}
                for name, param in params:
                    owner, leaf = _split(module, name)
                    tensor = made.pop(prefix + name) if prefix + name in made else \
                        self.reader.read(self.key(prefix + name), param.dtype, device)
                    if tensor.shape != param.shape:
                        raise UserError(f"tensor {self.key(prefix + name)} of '{self.source}' has shape "
                                        f"{list(tensor.shape)}, the config says {list(param.shape)}")
                    restore.append((owner, leaf, param))
                    owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
                found = nonfinite(module)
                if found is not None:
                    raise UserError(f"the input model '{self.source}' is broken: parameter {prefix}{found[0]} holds "
                                    f"{found[1]}; nothing was written (give a model whose weights are finite)")
            yield
        finally:
            for owner, leaf, param in reversed(restore):
                owner._parameters[leaf] = param
            restore.clear()
            trim_heap()

    # -- running ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def runnable(self, device) -> Iterator[nn.Module]:
        """The whole model for a library that calls its forward (lm-eval): every part of it (the
        front, each block, the final norm, the head) read from the files by :meth:`loaded` as the
        forward reaches it and let go when it returns, so one part is resident at a time: the
        reader the pipeline prunes and measures with, not a second mechanism."""
        parts = [*self.front_modules(), *self.blocks, *self.tail_modules()]
        held = {id(p) for part in parts for p in part.parameters()}
        missing = [name for name, p in self.model.named_parameters() if id(p) not in held]
        if missing:
            raise UserError(f"'{self.source}' has parameters outside its embeddings, blocks and head ({missing[0]}, ...): "
                            "it cannot run streamed; use --stream false")
        open_parts: dict[int, contextlib.ExitStack] = {}

        def load(module, *_):
            stack = contextlib.ExitStack()
            stack.enter_context(self.loaded(module, device=device))
            open_parts[id(module)] = stack

        def let_go(module, *_):
            stack = open_parts.pop(id(module), None)
            if stack is not None:
                stack.close()

        hooks = [h for part in parts for h in (part.register_forward_pre_hook(load), part.register_forward_hook(let_go))]
        try:
            yield self.model
        finally:
            for hook in hooks:
                hook.remove()
            for stack in open_parts.values():
                stack.close()
