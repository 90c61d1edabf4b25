"""A causal LM's structure, found from the model rather than from a table of names.

The LM pipeline sees a causal LM as *front → blocks → tail → head*. For any transformers
``*ForCausalLM`` whose decoder layers form one ``nn.ModuleList`` this module finds, from the model:

- **the blocks**: the ``ModuleList`` whose items are the classes the model names in its own
  ``_no_split_modules`` (what ``accelerate`` keeps whole on one device), else the ``ModuleList``
  holding most parameters;
- **the front and the tail**: by a *skeleton forward* (:func:`skeleton`): the model's own forward
  runs on a few probe tokens with every block's ``forward`` replaced by a stub that records the
  call and passes the hidden states on, and a pre-hook on every other module records the order
  in which they run. What runs before the first block (embeddings, rotary tables) is the front;
  what runs after the last block and before the output head (the final norm, OPT's
  ``project_out``) is the tail, in order. A module that runs *between* blocks means the model is
  not a plain chain of blocks, and it is refused;
- **the prunable layers**: every ``nn.Linear`` / ``Conv1D`` of a block, in the order the block's
  forward calls them (the first block of each kind runs for real inside the skeleton forward, with
  hooks on its layers). Blocks may differ in their layers: DeepSeek-V3 and GLM-4.5 keep their first
  layers' MLP dense and route the others through experts, Qwen2-MoE's ``mlp_only_layers`` names
  its dense ones. The layers of every kind are merged into one list that keeps each
  kind's own order, and each block's layers are those of the list it has;
- **how a block returns**: a tensor (most families in transformers 5) or a tuple whose first item
  is the hidden states (GPT-Neo); stubs must hand the model's loop what it expects.

The same skeleton forward gives every block the arguments the model itself passes to *that*
block (:func:`block_calls`): Gemma 2 / 3 alternate sliding-window and global attention, each layer
with its own mask and rotary embeddings, so block 0's arguments are not every block's.

Written by hand because it is the pipeline's view of a model: ``accelerate`` and transformers give
the no-split classes and the modules, not the call order or per-block arguments.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions
from transformers.pytorch_utils import Conv1D

from fairprune.errors import UserError

LINEAR_TYPES = (nn.Linear, Conv1D)
PROBE_TOKENS = 8


@dataclass(frozen=True)
class Structure:
    """What discovery found; every path is relative to ``model.base_model``."""

    blocks: str
    front: tuple[str, ...]
    tail: tuple[str, ...]
    linears: tuple[str, ...]  # relative to a block, in forward order (every kind's, merged)
    returns_tuple: bool
    mixed: bool = False  # blocks of more than one kind: a block holds some of ``linears``


@dataclass
class BlockCall:
    """The arguments one block was called with, its hidden-states input left out."""

    args: tuple
    kwargs: dict


class _Stop(Exception):
    """Raised to end a skeleton forward once what it records is known."""


def _base(model: nn.Module) -> nn.Module:
    return getattr(model, "base_model", model)


def _name(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__)


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder layers: their path under ``model.base_model`` and the ``ModuleList``."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise UserError(f"{_name(model)} is an encoder-decoder model; the LM methods read a decoder-only causal LM "
                        "block by block (give a *ForCausalLM model)")
    base = _base(model)
    lists = [(n, m) for n, m in base.named_modules() if isinstance(m, nn.ModuleList) and len(m) and n]
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    named = [(n, m) for n, m in lists if all(type(b).__name__ in no_split for b in m)]
    if len(named) == 1:
        return named[0]
    if not lists:
        raise UserError(f"{_name(model)} has no nn.ModuleList of decoder layers, so it cannot be read block by block "
                        "(add a row with `blocks` to fairprune.causal.families.FAMILIES if its layers live elsewhere)")
    pool = named or lists
    return max(pool, key=lambda item: sum(p.numel() for p in item[1].parameters()))


@contextlib.contextmanager
def stubbed(blocks, stub: Callable[[int, tuple, dict], Any]) -> Iterator[None]:
    """Every block's ``forward`` replaced by ``stub(index, args, kwargs)`` for the time of the block
    (hooks registered on the blocks still run around it)."""
    try:
        for index, block in enumerate(blocks):
            block.forward = lambda *a, _i=index, **k: stub(_i, a, k)
        yield
    finally:
        for block in blocks:
            block.__dict__.pop("forward", None)


def _split_hidden(args: tuple, kwargs: dict) -> tuple[torch.Tensor, BlockCall]:
    kwargs = dict(kwargs)
    hidden = args[0] if args else kwargs.pop("hidden_states")
    return hidden, BlockCall(tuple(args[1:]), kwargs)


def _outermost(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    names = [n for n, _ in found]
    return [(n, m) for n, m in found if not any(n != o and n.startswith(o + ".") for o in names)]


def probe_ids(model: nn.Module, device) -> torch.Tensor:
    """A few token ids every model accepts (below its vocabulary size)."""
    vocab = int(getattr(model.config, "vocab_size", 0) or PROBE_TOKENS + 1)
    return (torch.arange(1, PROBE_TOKENS + 1) % vocab).unsqueeze(0).to(device)


@torch.no_grad()
def discover(model: nn.Module, load: Callable[..., Any] | None = None, device="cpu") -> Structure:
    """The structure of causal LM ``model`` (see the module docstring). ``load(*modules, device=)``:
    a context that makes the given modules' weights resident (a streamed model's); None: they are."""
    if model.get_output_embeddings() is None:
        raise UserError(f"{_name(model)} has no output head: the LM methods take a causal LM (*ForCausalLM)")
    base = _base(model)
    path, layer_list = find_blocks(model)
    blocks = list(layer_list)
    head = model.get_output_embeddings()
    inside = {id(m) for b in blocks for m in b.modules()}
    others = [(n, m) for n, m in base.named_modules()
              if n and id(m) not in inside and m is not layer_list and m is not head and not path.startswith(n + ".")]
    phase = ["front"]
    seen: dict[str, list[tuple[str, nn.Module]]] = {"front": [], "between": [], "tail": []}
    returned: list[bool] = []
    kinds = block_kinds(blocks)  # the first block of each kind: its index -> its linear layers' names
    orders: dict[int, list[str]] = {index: [] for index in kinds}

    def note(name):
        def hook(module, args):
            if all(n != name for n, _ in seen[phase[0]]):
                seen[phase[0]].append((name, module))
        return hook

    def stop(module, args):
        raise _Stop

    def stub(index, args, kwargs):
        phase[0] = "between"
        if index in kinds:  # block 0 and the first of every other kind run for real (their layers' order)
            out = type(blocks[index]).forward(blocks[index], *args, **kwargs)
        if index == 0:
            returned.append(isinstance(out, (tuple, list)))
        else:  # the chain goes on with the hidden states as they came
            out = args[0] if args else kwargs["hidden_states"]
            out = (out,) if returned[0] else out
        if index == len(blocks) - 1:
            phase[0] = "tail"
        return out

    def called(index, name):
        def hook(module, args):
            if name not in orders[index]:
                orders[index].append(name)
        return hook

    handles = [m.register_forward_pre_hook(note(n)) for n, m in others]
    handles += [m.register_forward_pre_hook(called(index, n)) for index, names in kinds.items()
                for n, m in blocks[index].named_modules() if n in names]
    handles.append(head.register_forward_pre_hook(stop))
    firsts = [blocks[index] for index in kinds]
    loader = load(*[m for _, m in _outermost(others)], *firsts, device=device) if load else contextlib.nullcontext()
    try:
        with loader, stubbed(blocks, stub):
            try:
                first = next((p for p in model.parameters() if p.device.type != "meta"), None)
                model(input_ids=probe_ids(model, device if load else (first.device if first is not None else "cpu")),
                      use_cache=False)
            except _Stop:
                pass
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    if not returned:
        raise UserError(f"{_name(model)}: its forward never called its decoder layers ({path}); it cannot be read "
                        "block by block")
    between = [n for n, m in seen["between"] if any(True for _ in m.parameters())]
    if between:
        raise UserError(f"{_name(model)} runs {', '.join(between)} between its decoder layers; the LM methods read a "
                        "model whose layers follow one another (add a row to fairprune.causal.families.FAMILIES to override)")
    front = tuple(n for n, m in _outermost(seen["front"]) if _has_state(m))
    tail = tuple(n for n, _ in _outermost(seen["tail"]))
    return Structure(blocks=path, front=front, tail=tail, linears=merge_orders(list(orders.values())),
                     returns_tuple=returned[0], mixed=len(kinds) > 1)


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def linear_names(block: nn.Module) -> list[str]:
    """A block's ``nn.Linear`` / ``Conv1D`` layers, by relative name, in module order."""
    return [n for n, m in block.named_modules() if isinstance(m, LINEAR_TYPES)]


def block_kinds(blocks: list[nn.Module]) -> dict[int, set[str]]:
    """The first block of each kind (the set of its linear layers' names): its index -> that set."""
    found: dict[int, set[str]] = {}
    for index, block in enumerate(blocks):
        names = set(linear_names(block))
        if names not in found.values():
            found[index] = names
    return found


def merge_orders(orders: list[list[str]]) -> tuple[str, ...]:
    """One list holding every name of ``orders``, each order a subsequence of it: a name new to the
    list goes right after the name before it in its own order (first kind's order first)."""
    merged: list[str] = []
    for order in orders:
        at = -1
        for name in order:
            if name in merged:
                at = merged.index(name)
            else:
                at += 1
                merged.insert(at, name)
    return tuple(merged)


@torch.no_grad()
def block_calls(model: nn.Module, blocks, returns_tuple: bool, **inputs) -> tuple[torch.Tensor, list[BlockCall]]:
    """Block 0's hidden-states input and every block's other arguments, for one call of the
    model on ``inputs`` (``input_ids``, ``attention_mask``; ``use_cache`` and the cache for a
    generation step, else no cache): the skeleton forward with every block a stub, stopped after
    the last block. The front must be resident; no block runs."""
    calls: list[BlockCall] = []
    first: list[torch.Tensor] = []

    def stub(index, args, kwargs):
        hidden, call = _split_hidden(args, kwargs)
        if index == 0:
            first.append(hidden)
        calls.append(call)
        if index == len(blocks) - 1:
            raise _Stop
        return (hidden,) if returns_tuple else hidden

    with stubbed(blocks, stub):
        try:
            model(**{"use_cache": False, **inputs})
        except _Stop:
            pass
    if len(calls) != len(blocks):
        raise RuntimeError(f"the model called {len(calls)} of its {len(blocks)} decoder layers")
    return first[0], calls


class _Output(BaseModelOutputWithPastAndCrossAttentions):
    """The blocks' owner's output as the causal-LM forward reads it: the last hidden states; any
    other field a family reads (caches, attentions) is None."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def head_logits(model: nn.Module, owner: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The model's logits for final hidden states ``hidden`` (``[..., positions, hidden]``, after
    the tail), made by the model's own forward: the output head and whatever the model does
    after it (Gemma's final logit soft-capping). ``owner``: the module whose forward runs the
    blocks (its output is replaced by ``hidden``)."""
    squeeze = hidden.dim() == 2
    batch = hidden.unsqueeze(0) if squeeze else hidden
    out = _Output(last_hidden_state=batch)
    owner.forward = lambda *a, **k: out
    try:
        ids = torch.zeros(batch.shape[:2], dtype=torch.long, device=batch.device)
        logits = model(input_ids=ids, use_cache=False).logits
    finally:
        owner.__dict__.pop("forward", None)
    return logits[0] if squeeze else logits
