"""Mixture-of-experts blocks: fused expert parameters as per-expert layers, routers, and each
expert's calibration inputs.

transformers 5 stores a block's experts fused: one 3-D parameter per projection,
``[experts, out, in]`` (Mixtral, Qwen2/3-MoE, OLMoE: ``gate_up_proj``, ``down_proj``) or
``[experts, in, out]`` where the experts module says ``is_transposed`` (gpt-oss). The experts
module's eager forward runs each expert as ``F.linear(x, W[e])`` (or ``x @ W[e]``) on the tokens the
router sent it. This module finds them from the model, with no per-family code:

- :func:`fused_experts`: every 3-D parameter of a block (whose leading axis counts the experts);
- :class:`ExpertSlice`: expert ``e`` of one such parameter, presented as a layer whose ``weight``
  is the ``[out, in]`` matrix (a view into the fused parameter: a solver writing it writes the
  parameter), so every LM method prunes an expert exactly as it prunes a linear layer;
- :func:`is_router`: the layer that scores experts (``gate`` / ``router``, Qwen2-MoE's
  ``shared_expert_gate``), left dense by design: pruning it changes which experts run;
- :class:`ExpertInputs`: the inputs each expert reads, recorded from the experts module's own
  eager forward under a ``TorchFunctionMode`` that sees every ``F.linear`` / ``matmul`` whose weight
  is a slice of a fused parameter: for ``gate_up_proj`` the tokens routed to the expert, for
  ``down_proj`` that expert's own activations. ``routed`` records the forward as the router sends
  it; ``all`` runs it once more with every token sent to every expert (the output of that pass is
  dropped), so every expert gets statistics from every token — what Debias-SparseGPT's paired term
  needs (both sides of a pair through the same expert) and what an expert the router rarely picks
  needs to get a Hessian at all.

Written by hand because it is the pipeline's view of the model: llm-compressor reaches the same
with one hand-written calibration module per MoE class (``MoECalibrationModule``); recording the
experts module's own forward needs none.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from fairprune.errors import UserError

MOE_CALIBRATE = ("all", "routed")
ROUTER_NAMES = ("gate", "router", "gating")


@dataclass(frozen=True)
class Fused:
    """One fused expert parameter of a block: the experts module's path (relative to the block),
    the parameter's name on it, and whether it is stored ``[experts, in, out]``."""

    module: str
    leaf: str
    transposed: bool

    @property
    def path(self) -> str:
        return f"{self.module}.{self.leaf}" if self.module else self.leaf


def fused_experts(block: nn.Module) -> list[Fused]:
    """The fused 3-D expert parameters of ``block``, in module order (a convolution's 3-D kernel,
    Mamba's or a short-convolution layer's ``Conv1d``, is no stack of experts)."""
    found = []
    for path, module in block.named_modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            continue
        for leaf, param in module.named_parameters(recurse=False):
            if param.dim() == 3:
                found.append(Fused(path, leaf, bool(getattr(module, "is_transposed", False))))
    return found


def num_experts(block: nn.Module, fused: Fused) -> int:
    """How many experts the fused parameter holds (its leading axis)."""
    return int(block.get_submodule(fused.module).get_parameter(fused.leaf).shape[0]) if fused.module else \
        int(block.get_parameter(fused.leaf).shape[0])


def has_experts(block: nn.Module) -> bool:
    """Whether ``block`` is a mixture-of-experts block (fused experts, or an ``experts`` module list)."""
    return bool(fused_experts(block)) or any(n.rsplit(".", 1)[-1] == "experts" for n, _ in block.named_modules())


def is_router(path: str, moe: bool) -> bool:
    """Whether the layer at ``path`` (relative to a block) scores experts: in a mixture-of-experts
    block, a layer named ``gate`` / ``router`` / ``gating`` or ending in ``_gate`` (Qwen2-MoE's
    one-output ``shared_expert_gate``). A dense MLP's ``gate_proj`` is not one."""
    leaf = path.rsplit(".", 1)[-1]
    return moe and (leaf in ROUTER_NAMES or leaf.endswith("_gate") or "router" in leaf)


class ExpertSlice(nn.Module):
    """Expert ``expert`` of a fused parameter as a layer: ``weight`` is its ``[out, in]`` matrix, a
    view of the parameter as it is now (a streamed block's parameter is replaced when it loads, so
    the view is taken each time it is read)."""

    def __init__(self, owner: nn.Module, fused: Fused, expert: int):
        super().__init__()
        object.__setattr__(self, "_owner", owner)  # not a submodule: the slice holds no state of its own
        self.fused, self.expert = fused, expert

    @property
    def weight(self) -> torch.Tensor:
        W = getattr(self._owner, self.fused.leaf).data[self.expert]
        return W.t() if self.fused.transposed else W

    def extra_repr(self) -> str:
        return f"{self.fused.path}[{self.expert}]"


def expert_slices(block: nn.Module) -> dict[str, ExpertSlice]:
    """Every expert of every fused parameter of ``block`` as a layer, named ``"<param path>.<expert>"``."""
    out = {}
    for fused in fused_experts(block):
        owner = block.get_submodule(fused.module) if fused.module else block
        for e in range(num_experts(block, fused)):
            out[f"{fused.path}.{e}"] = ExpertSlice(owner, fused, e)
    return out


#: The products an experts forward applies a weight slice with (``x @ W`` reaches the mode as ``Tensor.matmul``).
_PRODUCTS = (F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


class _Recorder(TorchFunctionMode):
    """Sends ``(fused, expert, x)`` to ``sink`` for every ``F.linear(x, W)`` / ``x @ W`` whose
    weight is one expert's slice of a watched fused parameter."""

    def __init__(self, params: dict[tuple[int, int], tuple[Fused, torch.Tensor]], sink: Callable):
        super().__init__()
        self.params, self.sink = params, sink

    def _slice(self, w):
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            return None
        found = self.params.get((w.untyped_storage().data_ptr(), w.element_size()))
        if found is None:
            return None
        fused, param = found
        return fused, (w.storage_offset() - param.storage_offset()) // param.stride(0)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PRODUCTS and len(args) >= 2:
            hit = self._slice(args[1])
            if hit is not None:
                self.sink(hit[0], int(hit[1]), args[0])
        return func(*args, **kwargs)


def _eager(module: nn.Module):
    """The experts module's own eager forward (transformers dispatches to grouped kernels by
    ``config._experts_implementation``; the recording needs the per-expert loop)."""
    forward = type(module).forward
    return getattr(forward, "__wrapped__", forward)


def check_routed(block: nn.Module, model_type: str = "this model") -> None:
    """Refuse, in one line, a block whose experts module takes its tokens already routed (Llama 4's
    ``forward(hidden_states)``: every token to every expert, scaled by its router score) rather than
    the router's choice (``forward(hidden_states, top_k_index, top_k_weights)``), which the
    expert-by-expert calibration reads."""
    for fused in fused_experts(block):
        module = block.get_submodule(fused.module) if fused.module else block
        if len(inspect.signature(_eager(module)).parameters) < 4:
            raise UserError(f"{model_type}: its experts module ({type(module).__name__}) takes tokens already routed "
                            "(forward(hidden_states)), not the router's choice (hidden states, expert indices, weights) "
                            "that calibrating each expert reads, so the calibrated methods cannot prune its experts; "
                            "prune it with magnitude (prune.py magnitude), which reads no inputs")


class ExpertInputs:
    """Records each expert's inputs while a block runs (see the module docstring).

    ``sink(name, expert_index, x)`` gets ``x`` [tokens, in] for the parameter ``name`` (relative to
    the block) each time an expert reads it; ``rows(hidden)`` picks which token rows of the experts
    module's input take part (None: all; a calibration batch's counted tokens). ``routed[name]``
    counts the tokens the router sent each expert (for the report)."""

    def __init__(self, block: nn.Module, mode: str):
        if mode not in MOE_CALIBRATE:
            raise ValueError(f"moe_calibrate must be one of {MOE_CALIBRATE}, got {mode!r}")
        check_routed(block)
        self.block, self.mode = block, mode
        self.fused = fused_experts(block)
        self.modules = {f.module for f in self.fused}
        self.routed: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def recording(self, sink: Callable[[str, int, torch.Tensor], None],
                  rows: Callable[[], torch.Tensor | None]) -> Iterator[None]:
        def hook(module, args, kwargs, output):
            path = owners[id(module)]
            bound = inspect.signature(_eager(module)).bind(module, *args, **kwargs)
            hidden, index, weights = list(bound.arguments.values())[1:4]
            n = num_experts(self.block, next(f for f in self.fused if f.module == path))
            counted = index[(index >= 0) & (index < n)]
            self.routed[path] = self.routed.get(path, 0) + torch.bincount(counted.flatten().cpu(), minlength=n)
            keep = rows()
            flat = hidden.reshape(-1, hidden.shape[-1])
            if keep is not None:
                keep = keep.reshape(-1).to(flat.device)
                flat, index, weights = flat[keep], index.reshape(len(keep), -1)[keep], weights.reshape(len(keep), -1)[keep]
            if self.mode == "all":
                index = torch.arange(n, device=flat.device).expand(len(flat), n)
                weights = torch.ones(len(flat), n, dtype=flat.dtype, device=flat.device)
            params = {}
            for f in self.fused:
                if f.module == path:
                    p = module.get_parameter(f.leaf)
                    params[(p.untyped_storage().data_ptr(), p.element_size())] = (f, p)

            def feed(fused, expert, x):
                sink(fused.path, expert, x)

            with torch.no_grad(), _Recorder(params, feed):
                _eager(module)(module, flat, index, weights)

        owners = {id(self.block.get_submodule(m) if m else self.block): m for m in self.modules}
        handles = [self.block.get_submodule(m).register_forward_hook(hook, with_kwargs=True) if m else
                   self.block.register_forward_hook(hook, with_kwargs=True) for m in self.modules]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def refuse_quantize(blocks, quantize: str) -> None:
    """``--quantize`` on a model with fused expert parameters, refused before any work:
    compressed-tensors' pack-quantized format quantizes linear layers, and a folder whose experts
    stay fused float parameters beside them does not load back in transformers."""
    if quantize == "none":
        return
    found = next((f"{blocks.prefix(b)}{f.path}" for b in blocks.blocks[:1] for f in fused_experts(b)), None)
    if found is not None:
        raise UserError(f"--quantize {quantize} writes linear layers as compressed-tensors pack-quantized, and "
                        f"{blocks.source}'s experts are fused 3-D parameters ({found}) that format does not hold: a "
                        "mixture-of-experts model is pruned and written in float here; drop --quantize (or the recipe's quantize entry)")
