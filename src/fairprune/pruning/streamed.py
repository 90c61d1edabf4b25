"""Post-training pruning of a causal LM that never holds the whole model: one block in memory.

:class:`StreamedModel` is a transformers model built from its config with every parameter on the
``meta`` device (``accelerate.init_empty_weights``; buffers such as rotary tables are real) whose
weights stay in the folder's safetensors files (:class:`fairprune.hub.shards.ShardReader`). A part
of it — the embedding front, one transformer block, the final norm and head — is loaded just
before it runs, in the run's dtype, and put back on ``meta`` right after (:meth:`StreamedModel.loaded`),
so at most one block's weights (or the embeddings) are resident. Every part is checked finite
as it loads. Tied weights (the head sharing the token embedding) are read from whichever name
the checkpoint stores.

:func:`prune_streamed` is :func:`fairprune.pruning.llm.prune_causal_lm` block by block over such a
model: the same checks, the same calibration (the inputs of block 0 captured through the
embedding front by :func:`fairprune.pruning.calibration.capture_block_inputs`; block i
calibrated on the outputs of the already-pruned block i−1, the calibration windows' hidden
states held between blocks), the same statistics and layer solve (the registry entry's
``make_statistic`` and ``select``; the solvers work in float32 inside a layer whatever the
model's dtype), and the same per-layer sparsity. Each pruned block is written to a
:class:`~fairprune.hub.shards.ShardWriter` as soon as it is solved, the untouched tensors (front,
final norm, head) pass straight from the input files to the output ones, so the output folder
is what ``save_pretrained`` of the pruned model would write.

:meth:`StreamedModel.forward` runs batches through the whole model the same way (used by the
streamed measurements, :mod:`fairprune.metrics.streamed`): block 0's inputs captured, every block
loaded once and run on all batches, the hidden states held between blocks, then the final norm;
:meth:`StreamedModel.logits` applies the head.

Under ``torchrun`` every rank streams the model the same way (no rank holds it whole): each
calibrates on its share of whole batches, the statistics are summed exactly across ranks
(:class:`~fairprune.distributed.ExactSum`), every rank solves the same layers and takes rank 0's
solution, so the pruned weights are one process's bit for bit; only the rank given a writer writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from fairprune import distributed
from fairprune.errors import UserError
from fairprune.families import _get, family_of, linear_weight
from fairprune.hub.checks import nonfinite
from fairprune.hub.shards import ShardReader, ShardWriter, refuse_nonfloat
from fairprune.pruning import registry
from fairprune.pruning.calibration import PAIR_BATCH, BlockInput, _collect, _hidden, capture_block_inputs, rank_inputs
from fairprune.pruning.llm import _validate, solve_layer
from fairprune.pruning.masks import Target, sparsity_table
from fairprune.pruning.sparsity import Sparsity

#: What runs after the last block, per family (paths relative to ``model.base_model``, in order; an
#: absent optional one, e.g. OPT's ``project_out``, is skipped); the head follows.
TAILS: dict[str, tuple[str, ...]] = {
    "gpt2": ("ln_f",),
    "gpt-neo": ("ln_f",),
    "opt": ("decoder.final_layer_norm", "decoder.project_out"),
    "llama": ("norm",),
}


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing): the weights and activations of a block just put back on ``meta`` leave free holes
    in the heap that would otherwise stay resident while the next block loads."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()


def _split(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module owning parameter ``name`` (relative to ``module``) and its attribute name."""
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


class StreamedModel:
    """A causal LM whose weights stay in its folder's safetensors files (see the module docstring).

    ``dtype``: what parameters are loaded as (None: float32); ``device``: where blocks run."""

    def __init__(self, folder: str | Path, dtype: torch.dtype | None = None, trust_remote_code: bool = False,
                 source: str | None = None):
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        self.folder = Path(folder)
        self.source = source or str(folder)  # the name the user gave, for messages
        self.reader = ShardReader(self.folder)
        self.dtype = dtype or torch.float32
        try:
            config = AutoConfig.from_pretrained(self.folder, trust_remote_code=trust_remote_code)
            with init_empty_weights(include_buffers=False):
                model = AutoModelForCausalLM.from_config(config, dtype=self.dtype, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError) as err:
            hint = " (set --trust_remote_code true only if you trust it)" if "trust_remote_code" in str(err) else ""
            raise UserError(f"cannot build the model of '{self.source}'{hint}: {' '.join(str(err).split())[:200]}") from None
        model.tie_weights()  # empty-weight construction leaves tied weights as two parameters
        model.eval().requires_grad_(False)
        self.model = model
        self.config = model.config
        self.family = family_of(model)
        if self.family.name not in TAILS:
            raise UserError(f"--stream true supports the causal families {', '.join(TAILS)}, not {self.family.name}")
        self.blocks = list(self.family.block_list(model))
        self._prefix = {id(m): name for name, m in model.named_modules()}
        groups: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(name)
        self._aliases = {name: names for names in groups.values() for name in names}
        self._keys: dict[str, str] = {}
        self._check_stored()

    def _check_stored(self) -> None:
        """Before any work: every parameter is in the checkpoint with the shape the config implies,
        and the prunable layers' weights are stored as floating point."""
        for name, param in self.model.named_parameters():
            shape = self.reader.info(self.key(name))[1]
            if shape != tuple(param.shape):
                raise UserError(f"tensor {self.key(name)} of '{self.source}' has shape {list(shape)}, its config.json "
                                f"says {list(param.shape)}; the weights do not match the config (copy the folder again)")
        weights = [self.key(self.prefix(layer) + "weight") for block in self.blocks
                   for layer in self.family.block_linears(block).values()]
        refuse_nonfloat({key: self.reader.stored_dtype(key) for key in weights}, self.source)

    # -- names ------------------------------------------------------------------------------------
    def prefix(self, module: nn.Module) -> str:
        """The state-dict prefix of a submodule (``"model.layers.3."``)."""
        name = self._prefix[id(module)]
        return f"{name}." if name else ""

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
        try:
            from transformers.core_model_loading import dot_natural_key
        except ImportError:  # an older transformers saves in state-dict order
            return out
        return dict(sorted(out.items(), key=lambda item: dot_natural_key(item[0])))

    def num_parameters(self) -> int:
        """Parameters, a tied one once (as ``save_pretrained`` records it in the index)."""
        return self.model.num_parameters()

    def read_output(self, name: str) -> torch.Tensor:
        """A state-dict entry read from the checkpoint in the model's dtype (a buffer the
        checkpoint does not hold: the model's own value)."""
        tensor = self.model.state_dict(keep_vars=True)[name]
        if tensor.device.type != "meta" and not self._stored(name):
            return tensor.detach()
        return self.reader.read(self.key(name), tensor.dtype if tensor.is_floating_point() else None)

    def _stored(self, name: str) -> bool:
        try:
            self.key(name)
        except UserError:
            return False
        return True

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

    def front_modules(self) -> list[nn.Module]:
        """The modules that run before block 0."""
        return self.family.front_modules(self.model)

    def tail_modules(self) -> list[nn.Module]:
        """The modules that run after the last block, the head last."""
        base = getattr(self.model, "base_model", self.model)
        found = [_get(base, path, missing_ok=True) for path in TAILS[self.family.name]]
        return [m for m in found if m is not None] + [self.model.get_output_embeddings()]

    @contextlib.contextmanager
    def loaded(self, *modules: nn.Module, device: str | torch.device = "cpu") -> Iterator[None]:
        """Load the parameters of ``modules`` from the checkpoint (in the model's dtype, on
        ``device``), checked finite; back on ``meta`` when the block ends, whatever happens."""
        restore: list[tuple[nn.Module, str, nn.Parameter]] = []
        try:
            for module in modules:
                prefix = self.prefix(module)
                for name, param in list(module.named_parameters(remove_duplicate=False)):
                    if param.device.type != "meta":
                        continue
                    owner, leaf = _split(module, name)
                    tensor = self.reader.read(self.key(prefix + name), param.dtype, device)
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

    def state_of(self, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The loaded state-dict entries of ``module`` under their full names."""
        yield from module.state_dict(prefix=self.prefix(module)).items()

    # -- running ----------------------------------------------------------------------------------
    @torch.no_grad()
    def capture(self, calls: list[dict[str, torch.Tensor]], device) -> list[BlockInput]:
        """What block 0 is called with for each call of the model (``input_ids`` and optionally
        ``attention_mask``), the embedding front loaded for the time it runs."""
        first = self.blocks[0]
        captured: list[BlockInput] = []

        def grab(module, args, kwargs):
            kwargs = dict(kwargs)
            hidden = args[0] if args else kwargs.pop("hidden_states")
            captured.append(BlockInput(hidden, tuple(args[1:]), kwargs, None))
            raise _Captured

        fronts = self.front_modules()
        with self.loaded(*fronts, device=device):
            handle = first.register_forward_pre_hook(grab, with_kwargs=True)
            try:
                for call in calls:
                    try:
                        self.model(**{k: v.to(device) for k, v in call.items()}, use_cache=False)
                    except _Captured:
                        pass
            finally:
                handle.remove()
        return captured

    @torch.no_grad()
    def forward(self, calls: list[dict[str, torch.Tensor]], device, progress: bool = False,
                desc: str = "blocks") -> list[torch.Tensor]:
        """The hidden states after the last block and the final norm (the head's input) of each
        call, every block loaded once for all of them."""
        batches = self.capture(calls, device)
        for block in tqdm(self.blocks, desc=desc, unit="block", leave=False, disable=not progress):
            with self.loaded(block, device=device):
                batches = [replace(b, hidden=_hidden(block(b.hidden, *b.args, **b.kwargs))) for b in batches]
        tails = self.tail_modules()[:-1]
        out = []
        with self.loaded(*tails, device=device):
            for b in batches:
                hidden = b.hidden
                for module in tails:
                    hidden = module(hidden)
                out.append(hidden)
        return out

    @contextlib.contextmanager
    def head(self, device) -> Iterator[nn.Module]:
        """The output head, loaded for the time of the block."""
        head = self.model.get_output_embeddings()
        with self.loaded(head, device=device):
            yield head


class _Captured(Exception):
    """Raised from block 0's pre-hook: the rest of the model need not run."""


@dataclass
class StreamFacts:
    """What a streamed pass held: the largest block's parameter bytes and the largest part
    (front, block or tail) resident at once."""

    largest_block_bytes: int
    largest_part_bytes: int


def stream_facts(sm: StreamedModel) -> StreamFacts:
    """Bytes of the largest block and of the largest part loaded at once."""
    blocks = max(sm.nbytes(b) for b in sm.blocks)
    parts = [sm.nbytes(*sm.front_modules()), sm.nbytes(*sm.tail_modules()[:-1]), sm.nbytes(sm.tail_modules()[-1])]
    return StreamFacts(blocks, max(blocks, *parts))


@torch.no_grad()
def prune_streamed(
    sm: StreamedModel,
    method: str,
    sparsity: Sparsity,
    calib_ids: torch.Tensor | None = None,
    pairs: tuple[torch.Tensor, ...] | None = None,
    device: str | torch.device = "cpu",
    percdamp: float = 0.01,
    blocksize: int = 128,
    writer: ShardWriter | None = None,
    progress: bool = True,
    batch_size: int = 1,
    pair_batch_size: int = PAIR_BATCH,
) -> dict[str, Any]:
    """:func:`~fairprune.pruning.llm.prune_causal_lm` of a :class:`StreamedModel`, one block
    resident at a time; each pruned block goes to ``writer`` (then every tensor the blocks do
    not hold, read from the input), which is left for the caller to close. Collective under
    ``torchrun``: every rank calls it, rank 0 alone with a writer. Returns what
    ``prune_causal_lm`` returns, plus ``dense_zero_fraction`` (zeros the prunable layers had
    before) and ``largest_block_bytes``."""
    start = time.perf_counter()
    entry = registry.get(method, "lm")
    model, family = sm.model, sm.family
    _validate(model, family, entry, sparsity, calib_ids, pairs)
    settings = {"blocksize": blocksize, "percdamp": percdamp}
    solve_seconds = 0.0
    batches: list[BlockInput] = []
    if entry.statistic is not None:
        inputs = rank_inputs(calib_ids, pairs, batch_size, pair_batch_size)  # as prune_causal_lm deals them
        with sm.loaded(*sm.front_modules(), device="cpu"):  # capture_block_inputs moves them to the device
            batches = capture_block_inputs(model, family, inputs, device)
    dense_rows, rows = [], []
    for index, block in enumerate(tqdm(sm.blocks, desc=method, disable=not progress or not distributed.is_main(),
                                       unit="block")):
        with sm.loaded(block, device=device):
            layers = {f"{index}.{name}": layer for name, layer in family.block_linears(block).items()}
            dense_rows += sparsity_table([Target(name, layer) for name, layer in layers.items()])
            stats = {}
            if entry.statistic is not None:
                stats = {name: entry.make_statistic(linear_weight(layer).shape[1], device=device) for name, layer in layers.items()}
                _collect(block, layers, stats, batches)
            for name, layer in layers.items():
                tick = time.perf_counter()
                solve_layer(entry, layer, stats.pop(name, None), sparsity, settings)
                solve_seconds += time.perf_counter() - tick
            if entry.statistic is not None:
                batches = [replace(b, hidden=_hidden(block(b.hidden, *b.args, **b.kwargs))) for b in batches]
            found = nonfinite(block)
            if found is not None:
                raise UserError(f"pruning with {method} produced a broken model: parameter {sm.prefix(block)}{found[0]} "
                                f"holds {found[1]} (the input model was finite); nothing was written (try another method, "
                                "sparsity or calibration set)")
            rows += sparsity_table([Target(name, layer) for name, layer in layers.items()])
            if writer is not None:
                planned = set(writer.missing())
                writer.write_many((name, t) for name, t in sm.state_of(block) if name in planned)
    if writer is not None:
        for name in writer.missing():  # the front, the final norm, the head: as they are
            writer.write(name, sm.read_output(name))
    total = sum(r["numel"] for r in rows)
    return {
        "method": method,
        "family": family.name,
        "target_sparsity": float(sparsity.fraction),
        "nm": str(sparsity) if sparsity.nm else None,
        "achieved_sparsity": sum(r["zeros"] for r in rows) / total if total else 0.0,
        "dense_zero_fraction": sum(r["zeros"] for r in dense_rows) / total if total else 0.0,
        "layers": {r["layer"]: r["sparsity"] for r in rows},
        "largest_block_bytes": max(sm.nbytes(b) for b in sm.blocks),
        "seconds": {"solve": solve_seconds, "total": time.perf_counter() - start},
    }
