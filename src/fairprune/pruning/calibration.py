"""The modifiers' part in the block pass: layer-sequential calibration and change of a causal LM.

:func:`modify` applies a run's modifiers (:mod:`fairprune.pruning.modifiers`: a pruning method,
GPTQ, one's own) in one pass over the blocks (:func:`fairprune.causal.pipeline.run`):

1. capture: the model's own forward with every block a stub keeps what block 0 receives (the
   hidden states) and the positional and keyword arguments *each* block is called with
   (attention mask, rotary position embeddings, ...): layers may differ (Gemma alternates
   sliding-window and global attention, each with its own mask and rotary tables);
2. for each block, loaded for its turn: **calibrate** (:class:`Modifying`: each modifier's
   statistics for each unit, fed by hooks while every calibration batch runs through the block),
   **change** (each modifier changes each unit in order), **emit** (the batches run through the
   *changed* block to give the next block's inputs; a streamed run writes the block).

The model is a block model (:mod:`fairprune.causal.blocks`): in memory, loading moves a block to
the compute device and back, so only the embedding front and one block are on the device at a
time; streamed from disk, loading reads the block's weights, so only one block is in memory. Statistics objects add one term per
batch and reduce themselves across processes (see ``sparsegpt.Hessian.value``): under
``torchrun`` each rank runs this pass on its share of the batches (``llm.prune_with`` deals
them out whole) and the layers are pruned from the statistics of all ranks, which sum every
batch's term exactly, so the result does not depend on the number of ranks.

Aligned pairs (Debias-SparseGPT) are batched like windows: ``pair_batch_size`` pairs travel as one
batch ``cat([side0, side1])``, one forward for both sides, cut to the batch's longest pair and
right-padded with an attention mask (:func:`make_inputs`), so the tokens of each pair get exactly
the activations they get alone (a causal model: right padding comes after them). The layer hook
splits the batch back in halves and calls ``stat.add_pair(x0, x1, mask)`` once per batch: one
product and one exact-sum term for the whole batch (``sparsegpt.PairedHessian``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from fairprune import distributed
from fairprune.causal import pipeline
from fairprune.causal.blocks import as_blocks
from fairprune.causal.experts import ExpertInputs, ExpertSlice, num_experts
from fairprune.causal.pipeline import Batch, CalibInput, capture
from fairprune.pruning.modifiers import Modifier, fed, statistics_for

#: Aligned pairs per calibration batch: one forward of 2·32 sentences, one statistics term.
PAIR_BATCH = 32


def make_inputs(
    calib_ids: torch.Tensor | None,
    pairs: tuple[torch.Tensor, ...] | None = None,
    batch_size: int = 1,
    pair_batch_size: int = PAIR_BATCH,
) -> list[CalibInput]:
    """Split plain ids [n, seq] into batches of ``batch_size`` windows and aligned pairs
    (ids0, ids1[, mask]) into batches of ``pair_batch_size`` pairs (with a mask, in order of
    length, so that a batch's pairs are padded little).

    A pair batch is ``cat([ids0[part], ids1[part]])``. With a mask, what follows a pair's last
    counted token is padding: the batch is cut after its longest pair's last counted token, and
    the rest of each shorter pair is masked out of attention (``attention``, the same for both
    sides). Being right padding it changes nothing before it in a causal model, so every counted
    token has the activations it has in the pair's own forward; positions inside a pair's span
    that the mask leaves out (e.g. the shorter side's padding up to the longer side) run as they
    would alone and are left out of the statistics by ``mask``."""
    inputs = []
    if calib_ids is not None:
        inputs += [CalibInput(chunk) for chunk in calib_ids.split(batch_size) if len(chunk)]  # a rank's share may be empty
    if pairs is not None:
        ids0, ids1 = pairs[0], pairs[1]
        mask = pairs[2] if len(pairs) > 2 else None
        order = torch.arange(len(ids0))
        if mask is not None:  # pairs of like length batched together: each batch is cut to less padding
            last = torch.where(mask.bool(), torch.arange(1, mask.shape[1] + 1), 0).amax(1)
            order = torch.sort(last, stable=True).indices
        for start in range(0, len(ids0), pair_batch_size):
            part = order[start:start + pair_batch_size]
            side0, side1, counted, attention = ids0[part], ids1[part], None, None
            if mask is not None:
                counted = mask[part].bool()
                positions = torch.arange(1, counted.shape[1] + 1)
                ends = torch.where(counted, positions, 0).amax(1).clamp(min=1)  # one past each pair's last counted token
                length = int(ends.max())
                side0, side1, counted = side0[:, :length], side1[:, :length], counted[:, :length]
                real = positions[:length] <= ends[:, None]
                if not bool(real.all()):
                    attention = torch.cat([real, real]).long()
            inputs.append(CalibInput(torch.cat([side0, side1]), True, counted, attention))
    return inputs


def rank_inputs(
    calib_ids: torch.Tensor | None,
    pairs: tuple[torch.Tensor, ...] | None = None,
    batch_size: int = 1,
    pair_batch_size: int = PAIR_BATCH,
) -> list[CalibInput]:
    """This rank's share of the calibration batches (all of them in one process): windows and
    pairs are cut into batches (:func:`make_inputs`) before they are dealt out, so each batch holds
    the same windows or pairs on any number of ranks and the statistics add the same per-batch
    terms (see sparsegpt's module docstring): the result is exact."""
    return [*distributed.shard(make_inputs(calib_ids, None, batch_size)),
            *distributed.shard(make_inputs(None, pairs, batch_size, pair_batch_size))]


class Statistics:
    """The statistics the modifiers collect for one unit (:func:`fairprune.pruning.modifiers.statistics_for`,
    one entry per modifier), fed together: each distinct statistic once per batch."""

    def __init__(self, stats: list[Any]):
        self.stats, self._fed = stats, fed(stats)

    def add_batch(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        for stat in self._fed:
            stat.add_batch(x, mask)

    def add_pair(self, x0: torch.Tensor, x1: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        for stat in self._fed:
            stat.add_pair(x0, x1, mask)


class Modifying(pipeline.Step):
    """The modifiers' part in the block pass (:func:`modify`): at each block, the statistics every
    modifier asks for each unit (calibrate: the block's batches run once for all of them, experts
    recorded from their own inputs), then each modifier's change of each unit in order (change),
    then ``after(index, block, units)`` once the block's batches have run through it (emit)."""

    def __init__(self, blocks, modifiers: list[Modifier], device, calibrated: bool, moe_calibrate: str = "all",
                 after: Callable[[int, nn.Module, dict[str, nn.Module]], None] | None = None):
        self.blocks, self.modifiers, self.device = blocks, modifiers, device
        self.collects, self.moe_calibrate, self.after = calibrated, moe_calibrate, after
        self.tokens: dict[str, dict[str, list[int]]] = {"routed": {}, "calibrated": {}}
        self.stats: dict[str, Statistics | None] = {}
        self._units: tuple[int, dict[str, nn.Module]] = (-1, {})

    def units(self, index: int, block: nn.Module) -> dict[str, nn.Module]:
        """The block's units by ``"<block>.<path>"``, found once per block (calibrate, change and
        emit ask for them)."""
        if self._units[0] != index:
            self._units = (index, {f"{index}.{name}": unit for name, unit in self.blocks.family.block_units(block).items()})
        return self._units[1]

    @contextlib.contextmanager
    def calibrate(self, index: int, block: nn.Module) -> Iterator[Callable[[Batch], None]]:
        units = self.units(index, block)
        self.stats = {name: Statistics(statistics_for(self.modifiers, name, unit, self.device))
                      for name, unit in units.items()}
        experts = _Experts(index, block, self.stats, self.moe_calibrate)
        with _collecting(units, self.stats, experts if experts.recorder.fused else None) as before:
            yield before
        experts.finish(self.tokens)

    def change(self, index: int, block: nn.Module) -> None:
        # Units that read one input share one Statistics (_collecting): each modifier changes them
        # together (Modifier.apply_shared), in the block's order otherwise.
        runs: list[tuple[Statistics | None, list[tuple[str, nn.Module]]]] = []
        for name, unit in self.units(index, block).items():
            group = self.stats.pop(name, None)
            if group is not None and runs and runs[-1][0] is group:
                runs[-1][1].append((name, unit))
            else:
                runs.append((group, [(name, unit)]))
        self.stats = {}
        for group, units in runs:
            for position, modifier in enumerate(self.modifiers):
                modifier.apply_shared(units, None if group is None else group.stats[position])

    def emit(self, index: int, block: nn.Module) -> None:
        if self.after is not None:
            self.after(index, block, self.units(index, block))


@torch.no_grad()
def modify(model, inputs: list[CalibInput] | None, device, modifiers: list[Modifier], progress: bool = True,
           desc: str = "pruning", after: Callable[[int, nn.Module, dict[str, nn.Module]], None] | None = None,
           moe_calibrate: str = "all") -> dict[str, Any]:
    """Apply ``modifiers`` block after block (one :func:`fairprune.causal.pipeline.run`), each
    block loaded for its turn; unit names are ``"<block>.<path>"``. ``model``: an ``nn.Module`` or a
    block model (resident or streamed, see :mod:`fairprune.causal.blocks`). ``inputs`` None: no
    calibration pass (every modifier works from the weights alone). ``after(index, block, units)``
    runs once a block is changed, while it is still loaded (a streamed run writes it then).

    A block's units are :meth:`~fairprune.causal.families.Family.block_units`: its linear layers
    (routers left out) and each expert of its fused expert parameters, calibrated from that
    expert's own inputs (:class:`~fairprune.causal.experts.ExpertInputs`, ``moe_calibrate`` all or
    routed). An expert that no calibration token reached gets ``None`` for its statistics (a
    pruning modifier prunes it from its weights alone). Returns the tokens each expert was routed
    and calibrated on: ``{"routed": {"<block>.<experts>": [...]}, "calibrated": {"<block>.<param>":
    [...]}}`` (empty for a dense model)."""
    blocks = as_blocks(model)
    for modifier in modifiers:
        modifier.begin(blocks)
    was_training = blocks.model.training
    blocks.model.eval()
    step = Modifying(blocks, modifiers, device, inputs is not None, moe_calibrate, after)
    batches = capture(blocks, inputs, device) if inputs is not None else None
    pipeline.run(blocks, [step], batches, device=device, flow_last=False, progress=progress, desc=desc)
    blocks.changed()
    blocks.model.train(was_training)
    return step.tokens


class _Functions(Modifier):
    """A modifier from two functions: ``make_stat(name, unit)`` and ``prune(name, unit, stat)``."""

    def __init__(self, make_stat, prune):
        self.make_stat, self.prune = make_stat, prune

    def statistic(self, name, unit, held, device):
        return None if self.make_stat is None else self.make_stat(name, unit)

    def apply(self, name, unit, stat):
        self.prune(name, unit, stat)


def run_layerwise(model, inputs: list[CalibInput] | None, device, make_stat: Callable[[str, nn.Module], Any] | None,
                  prune: Callable[[str, nn.Module, Any], None], progress: bool = True, desc: str = "pruning",
                  after: Callable[[int, nn.Module, dict[str, nn.Module]], None] | None = None,
                  moe_calibrate: str = "all") -> dict[str, Any]:
    """:func:`modify` with one modifier made of two functions: ``make_stat(name, unit)`` (the
    statistic a unit collects; None with ``inputs`` None) and ``prune(name, unit, stat)``."""
    return modify(model, inputs, device, [_Functions(make_stat, prune)], progress, desc, after, moe_calibrate)


class _Experts:
    """Each expert's statistic fed with the inputs that expert reads (``mode`` all: every token;
    routed: the tokens the router sends it), recorded in the same pass over the batches that feeds
    the linear layers (:func:`_collect`); :meth:`finish` gives an expert no counted token reached
    (over every rank) ``None`` and records the token counts."""

    def __init__(self, index: int, block: nn.Module, stats: dict, mode: str):
        self.index, self.block, self.stats, self.mode = index, block, stats, mode
        self.recorder = ExpertInputs(block, mode)
        self.calibrated: dict[str, int] = {}

    def recording(self, current: list[CalibInput]):
        """Record while the batches run; ``current[0]``: the batch being run."""
        def rows():
            source = current[0]
            return source.mask if self.mode == "routed" and source.mask is not None else None

        def sink(path: str, expert: int, x: torch.Tensor) -> None:
            name, source = f"{self.index}.{path}.{expert}", current[0]
            x = x.detach()
            if self.mode == "all":  # every token in order: the batch's own layout, its mask applies
                x = x.reshape(*source.ids.shape, x.shape[-1])
                counted = int(source.mask.sum()) if source.mask is not None else source.ids.numel()
                if source.paired:
                    x0, x1 = x.chunk(2)
                    self.stats[name].add_pair(x0, x1, source.mask)
                else:
                    self.stats[name].add_batch(x, source.mask)
            else:
                counted = len(x)
                if counted:
                    self.stats[name].add_batch(x.unsqueeze(0))
            self.calibrated[name] = self.calibrated.get(name, 0) + counted

        return self.recorder.recording(sink, rows)

    def finish(self, tokens: dict[str, dict[str, list[int]]]) -> None:
        fused, index, block = self.recorder.fused, self.index, self.block
        if not fused:
            return
        names = [f"{index}.{f.path}.{e}" for f in fused for e in range(num_experts(block, f))]
        counts = torch.tensor([float(self.calibrated.get(n, 0)) for n in names], dtype=torch.float64)
        sizes = {f.module: num_experts(block, f) for f in fused}  # every rank reduces the same tensors
        routed = {path: torch.as_tensor(self.recorder.routed.get(path, torch.zeros(n)), dtype=torch.float64)
                  for path, n in sorted(sizes.items())}
        if distributed.world()[1] > 1:
            distributed.all_reduce_sum(counts)
            for path in routed:
                distributed.all_reduce_sum(routed[path])
        for name, count in zip(names, counts.tolist()):
            if count == 0:
                self.stats[name] = None
        for path, value in routed.items():
            tokens["routed"][f"{index}.{path}"] = [int(v) for v in value.tolist()]
        for f in fused:
            tokens["calibrated"][f"{index}.{f.path}"] = [int(c) for n, c in zip(names, counts.tolist())
                                                         if n.startswith(f"{index}.{f.path}.")]


@contextlib.contextmanager
def _collecting(layers: dict, stats: dict, experts: _Experts | None = None, share: bool = True
                ) -> Iterator[Callable[[Batch], None]]:
    """Hooks feeding each layer's input to its statistics while the pass runs the block's batches;
    yields the function the pass calls with each batch before it runs.

    Layers that read the very same input tensor (a Llama block's q, k and v projections; its gate
    and up projections) share their statistics: theirs would be the same sum of the same terms, so
    each gets exactly what its own would hold, accumulated and held once (for a 7B Llama block,
    four float64 Hessians of 134 MB fewer). ``stats`` is updated in place so that such layers map
    to one object. Which layers share is seen on the first batch, checked on every later one, and
    agreed across ranks (a rank whose share of batches is empty takes the others' answer), so every
    rank reduces the same statistics. ``share`` False keeps one statistic per layer."""
    current: list[CalibInput] = []
    names = list(layers)
    partner: dict[str, int] = {}  # layer -> 1 + the index of the layer whose statistic it shares (0: its own)
    fed: dict[int, tuple[torch.Tensor, int]] = {}  # this batch: id(input) -> (input, index of its first reader)

    def hook_for(index: int, name: str):
        def hook(layer, args, output):
            x = args[0]
            seen = fed.get(id(x))
            first = seen[1] + 1 if share and seen is not None and seen[0] is x else 0
            if partner.setdefault(name, first) != first:
                raise RuntimeError(f"calibration: layer {name} read another layer's input on one batch and not on another")
            if first:
                return
            fed[id(x)] = (x, index)
            stat, source = stats[name], current[0]
            x = x.detach()
            if x.dim() == 2 and x.shape[0] == source.ids.numel():  # flattened to [batch·seq, cols] (OPT's MLP)
                x = x.view(*source.ids.shape, x.shape[-1])
            if source.paired:
                x0, x1 = x.chunk(2)
                stat.add_pair(x0, x1, source.mask)
            else:
                stat.add_batch(x, source.mask)

        return hook

    def before(b: Batch) -> None:
        current[:] = [b.source]
        fed.clear()

    handles = [layer.register_forward_hook(hook_for(i, name)) for i, (name, layer) in enumerate(layers.items())
               if not isinstance(layer, ExpertSlice)]  # experts: recorded by ``experts``
    try:
        with experts.recording(current) if experts is not None else contextlib.nullcontext():
            yield before
    finally:
        fed.clear()
        for handle in handles:
            handle.remove()
    for name, first in zip(names, _agree_partners([partner.get(name, 0) for name in names], bool(partner))):
        if first:
            stats[name] = stats[names[first - 1]]


def _agree_partners(partners: list[int], seen: bool) -> list[int]:
    """Every rank's sharing of statistics, from the ranks that saw a batch (``seen``): they all saw
    the same block, so they agree; alone, ``partners`` as they are."""
    if distributed.world()[1] == 1:
        return partners
    shared = torch.tensor([int(seen), *partners], dtype=torch.float64) if seen else torch.zeros(1 + len(partners),
                                                                                               dtype=torch.float64)
    distributed.all_reduce_sum(shared)
    ranks = int(shared[0])
    return [int(v) // ranks for v in shared[1:].tolist()] if ranks else partners
