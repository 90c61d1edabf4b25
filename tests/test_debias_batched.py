"""Debias-SparseGPT calibration in batches of pairs against a plain per-pair oracle.

The oracle is the method written out: every pair on its own, each side run through the whole
model *unpadded* (cut to the pair's span, so no padding at all), the three products
``X0X0ᵀ + X1X1ᵀ + 2ΔXΔXᵀ`` of its counted tokens added in float64, the sum divided by the pair
count, plus ``2/N Σ XXᵀ`` of the plain windows. The batched path (pairs padded to their batch's
longest with an attention mask, one forward per batch, one stacked product per batch and layer)
must give the same Hessians to float tolerance, and the same pruned weights when the oracle's
Hessians, computed block after block on the already-pruned blocks, feed the same solver."""

from __future__ import annotations

import pytest
import torch

from fairprune.causal.families import family_of, linear_weight, set_linear_weight
from fairprune.pruning.calibration import make_inputs, run_layerwise
from fairprune.pruning.llm import Batching, prune_causal_lm
from fairprune.pruning.sparsegpt import PairedHessian, sparsegpt_solve
from fairprune.pruning.sparsity import Sparsity
from tiny_models import BUILDERS, VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")

CAUSAL = ["gpt2", "gpt_neo", "opt", "llama", "mistral"]
PAD = 0  # the tiny models' pad token


def ragged_pairs(n: int = 7, seed: int = 0, longest: int = 14) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` pairs of sentences of different lengths (sides of one pair differ too), laid out as
    ``fairprune.data.text.paired_ids`` does: right-padded to the longest, the mask counting each
    pair up to the end of its longer side."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((2, n, longest), PAD, dtype=torch.long)
    mask = torch.zeros(n, longest, dtype=torch.bool)
    for i in range(n):
        lengths = torch.randint(3, longest + 1, (2,), generator=g).tolist()
        for side, length in enumerate(lengths):
            ids[side, i, :length] = torch.randint(1, VOCAB, (length,), generator=g)
        mask[i, : max(lengths)] = True
    return ids[0], ids[1], mask


def windows(n: int = 3, seqlen: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def build(model_type: str):
    torch.manual_seed(0)
    return BUILDERS[model_type]().eval()


@torch.no_grad()
def oracle_hessians(model, layers: dict, pairs, calib) -> dict[str, torch.Tensor]:
    """The per-pair Hessian of each of ``layers`` (name -> Linear of ``model``), in float64: one
    unpadded forward per sentence, three products per pair, then the plain windows' term."""
    seen: dict[str, torch.Tensor] = {}
    handles = [layer.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, args[0].reshape(-1, args[0].shape[-1]).double()))
               for name, layer in layers.items()]

    def inputs(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        seen.clear()
        model(input_ids=ids[None], use_cache=False)
        return dict(seen)

    try:
        ids0, ids1, mask = pairs
        paired = {name: 0.0 for name in layers}
        for i in range(len(ids0)):
            span = int(mask[i].nonzero().max()) + 1
            counted = mask[i, :span]
            side0, side1 = inputs(ids0[i, :span]), inputs(ids1[i, :span])
            for name in layers:
                a, c = side0[name][counted], side1[name][counted]
                d = a - c
                paired[name] = paired[name] + a.T @ a + c.T @ c + 2 * d.T @ d
        out = {name: paired[name] / len(ids0) for name in layers}
        if calib is not None:
            for name in layers:
                plain = sum(x.T @ x for x in (inputs(w)[name] for w in calib))
                out[name] = out[name] + 2 * plain / len(calib)
    finally:
        for handle in handles:
            handle.remove()
    return out


def batched_hessians(model, pairs, calib, pair_batch_size: int) -> dict[str, torch.Tensor]:
    """The library's Hessians of the dense model (nothing pruned), per ``"<block>.<path>"``."""
    got = {}
    inputs = make_inputs(calib, pairs, batch_size=2, pair_batch_size=pair_batch_size)
    run_layerwise(model, inputs, "cpu", lambda name, layer: PairedHessian(linear_weight(layer).shape[1]),
                  lambda name, layer, stat: got.__setitem__(name, stat.value()), progress=False)
    return got


def all_layers(model) -> dict:
    family = family_of(model)
    return {f"{index}.{name}": layer for index, block in enumerate(family.block_list(model))
            for name, layer in family.block_linears(block).items()}


def relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("model_type", CAUSAL)
@pytest.mark.parametrize("with_text", [False, True])
def test_batched_hessian_equals_the_per_pair_one(model_type, with_text):
    """Pairs of different lengths in batches of three (the last batch shorter, each batch cut to
    its own longest pair and padded with an attention mask): the Hessian of every layer of the
    dense model is the per-pair, unpadded one to float tolerance."""
    model, pairs = build(model_type), ragged_pairs()
    calib = windows() if with_text else None
    want = oracle_hessians(model, all_layers(model), pairs, calib)
    got = batched_hessians(model, pairs, calib, pair_batch_size=3)
    assert got.keys() == want.keys()
    gaps = {name: relative_gap(got[name], want[name]) for name in want}
    assert max(gaps.values()) < 2e-6, gaps
    # One batch of all the pairs, and one pair per batch, give it as well.
    for size in (1, len(pairs[0])):
        other = batched_hessians(model, pairs, calib, pair_batch_size=size)
        assert max(relative_gap(other[name], want[name]) for name in want) < 2e-6


def test_a_pair_batch_is_cut_to_its_longest_pair_and_masked_after_each_pair():
    ids0, ids1, mask = ragged_pairs(5, seed=3)
    spans = [int(m.nonzero().max()) + 1 for m in mask]
    batches = make_inputs(None, (ids0, ids1, mask), pair_batch_size=2)
    assert len(batches) == 3 and all(b.paired for b in batches)
    order = sorted(range(5), key=lambda i: spans[i])  # pairs of like length share a batch (stable order)
    assert [b.ids.shape[1] for b in batches] == sorted(b.ids.shape[1] for b in batches)
    for k, b in enumerate(batches):
        part = torch.tensor(order[2 * k:2 * k + 2])
        length = max(spans[i] for i in part)
        assert torch.equal(b.ids, torch.cat([ids0[part, :length], ids1[part, :length]]))
        assert torch.equal(b.mask, mask[part, :length])
        real = torch.stack([torch.arange(length) < spans[i] for i in part])
        if real.all():
            assert b.attention is None
        else:
            assert torch.equal(b.attention, torch.cat([real, real]).long())
    # No mask: every position counts, nothing is padding.
    plain = make_inputs(None, (ids0, ids1), pair_batch_size=4)
    assert [len(b.ids) for b in plain] == [8, 2] and all(b.mask is None and b.attention is None for b in plain)


def test_one_product_and_one_exact_sum_term_per_batch():
    """A batch of pairs adds one term whatever its size; the value is the per-pair formula."""
    g = torch.Generator().manual_seed(4)
    x0, x1 = torch.randn(6, 5, 8, generator=g), torch.randn(6, 5, 8, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.3
    batched, single = PairedHessian(8), PairedHessian(8)
    batched.add_pair(x0, x1, mask)
    for i in range(6):
        single.add_pair(x0[i : i + 1], x1[i : i + 1], mask[i : i + 1])
    assert batched.sum.terms == 1 and single.sum.terms == 6
    want = sum(a.T @ a + c.T @ c + 2 * (a - c).T @ (a - c)
               for a, c in ((x0[i][mask[i]].double(), x1[i][mask[i]].double()) for i in range(6))) / 6
    for stat in (batched, single):
        torch.testing.assert_close(stat.value().double(), want, rtol=1e-6, atol=1e-6)


@torch.no_grad()
def oracle_prune(model, sparsity: Sparsity, pairs, calib) -> None:
    """Debias-SparseGPT written out: block after block, the per-pair oracle Hessians of the block's
    layers (inputs from the already-pruned blocks before it), each layer solved by the same solver."""
    family = family_of(model)
    for block in family.block_list(model):
        layers = family.block_linears(block)
        hessians = oracle_hessians(model, layers, pairs, calib)
        for name, layer in layers.items():
            set_linear_weight(layer, sparsegpt_solve(linear_weight(layer), hessians[name].float(), sparsity))


@pytest.mark.parametrize("model_type,sparsity", [("gpt2", "0.5"), ("opt", "2:4"), ("llama", "0.5"), ("llama", "2:4")])
def test_debias_prune_gives_the_per_pair_oracle_weights(model_type, sparsity):
    """``prune_causal_lm`` (batched pairs plus text windows) against the oracle Hessians fed to the
    same solver: the same weights to float tolerance, the same masks but for near-ties."""
    pairs, calib, target = ragged_pairs(9, seed=5), windows(4, 12, seed=6), Sparsity.parse(sparsity)
    batched, oracle = build(model_type), build(model_type)
    prune_causal_lm(batched, "debias-sparsegpt", target, calib_ids=calib, pairs=pairs, progress=False, batching=Batching(pairs=4))
    oracle_prune(oracle, target, pairs, calib)
    got, want = all_layers(batched), all_layers(oracle)
    for name in want:
        W, V = linear_weight(got[name]), linear_weight(want[name])
        assert float(((W == 0) != (V == 0)).float().mean()) <= 2e-3, name
        torch.testing.assert_close(W, V, rtol=1e-3, atol=2e-4 * float(V.abs().max()), msg=name)
