"""Post-training LLM pruning: SparseGPT against a plain OBS oracle, N:M and unstructured
exactness, Wanda and magnitude masks, the paired Hessian, the layer-sequential calibration loop,
every family in the table end to end, save/load round trips and input validation."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import warnings

import pytest
import torch
import transformers as tf

from fairprune.causal.families import FAMILIES, family_of, linear_weight
from fairprune.errors import UserError
from fairprune.pruning.calibration import make_inputs, run_layerwise
from fairprune.pruning.llm import prune_causal_lm, sparsity_by_layer
from fairprune.pruning.sparsegpt import Hessian, PairedHessian, inverse_hessian_cholesky, sparsegpt_solve
from fairprune.pruning.sparsity import Sparsity
from fairprune.pruning.wanda import InputNorms, wanda_mask
from tiny_models import BUILDERS, VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")

HALF = Sparsity.parse(0.5)


def build(model_type: str, seed: int = 0):
    torch.manual_seed(seed)
    return BUILDERS[model_type]().eval()


def calib(n: int = 4, seqlen: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, VOCAB, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def structured_inputs(tokens: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Correlated inputs with uneven column scales, like real activations."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=g) / math.sqrt(cols) + torch.eye(cols)
    scale = torch.rand(cols, generator=g) * 3 + 0.1
    return (torch.randn(tokens, cols, generator=g) @ mix) * scale


# --------------------------------------------------------------------------------------------
# SparseGPT solver against a plain float64 column-by-column OBS oracle
# --------------------------------------------------------------------------------------------


def obs_oracle(W, H, sparsity=None, nm=None, blocksize=128, percdamp=0.01):
    """Optimal brain surgeon one column at a time with explicit inverses of the remaining Hessian."""
    W, H = W.double().clone(), H.double().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += percdamp * H.diagonal().mean() * torch.eye(len(H), dtype=H.dtype)
    rows, cols = W.shape
    saliency_den = torch.tensor([torch.linalg.inv(H[j:, j:])[0, 0] for j in range(cols)], dtype=H.dtype)
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    for i in range(cols):
        if nm is None and i % blocksize == 0:
            i2 = min(i + blocksize, cols)
            score = (W[:, i:i2] ** 2 / saliency_den[i:i2]).flatten()
            k = math.floor(sparsity * rows * i2) - math.floor(sparsity * rows * i)
            block = torch.zeros(score.numel(), dtype=torch.bool)
            block[score.argsort()[:k]] = True
            mask[:, i:i2] = block.view(rows, i2 - i)
        if nm is not None and i % nm[1] == 0:
            score = W[:, i : i + nm[1]] ** 2 / saliency_den[i : i + nm[1]]
            for r in range(rows):
                mask[r, i + score[r].argsort()[: nm[0]]] = True
        Finv = torch.linalg.inv(H[i:, i:])  # inverse Hessian of the columns not yet visited
        w = W[:, i].clone()
        q = torch.where(mask[:, i], torch.zeros_like(w), w)
        W[:, i:] -= ((w - q) / Finv[0, 0]).unsqueeze(1) * Finv[0].unsqueeze(0)
        W[:, i] = q
    return W


@pytest.mark.parametrize("sparsity,nm", [(0.5, None), (0.3, None), (None, (2, 4)), (None, (3, 8))])
def test_sparsegpt_matches_obs_oracle(sparsity, nm):
    # A small block size keeps the oracle fast while still covering full and partial blocks.
    rows, cols, blocksize = 12, 88, 32
    X = structured_inputs(300, cols).double()
    X[:, 7] = 0  # a dead input column
    H = 2 / len(X) * X.T @ X
    W = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = sparsegpt_solve(W, H, Sparsity.parse(f"{nm[0]}:{nm[1]}" if nm else sparsity), blocksize=blocksize)
    want = obs_oracle(W, H, sparsity, nm, blocksize=blocksize)
    assert torch.equal(got == 0, want == 0)
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-9)
    assert (got[:, 7] == 0).all()


def test_sparsegpt_float32_close_to_oracle_and_better_than_magnitude():
    rows, cols = 32, 96
    X = structured_inputs(600, cols)
    acc = Hessian(cols)
    for chunk in X.view(6, 100, cols):  # six "sequences" of 100 tokens
        acc.add_batch(chunk.unsqueeze(0))
    W = torch.randn(rows, cols, generator=torch.Generator().manual_seed(2))
    got = sparsegpt_solve(W, acc.value(), Sparsity.parse(0.5), blocksize=32)
    want = obs_oracle(W, acc.value(), 0.5, blocksize=32)
    err = lambda Q: float((X @ (W - Q.float()).T).norm() / (X @ W.T).norm())  # noqa: E731
    magnitude = W * (W.abs() > W.abs().flatten().kthvalue(rows * cols // 2).values)
    assert abs(err(got) - err(want)) < 1e-3
    assert err(got) < 0.8 * err(magnitude)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (3, 8)])
def test_sparsegpt_exact_nm_pattern(n, m):
    W = torch.randn(16, 256, generator=torch.Generator().manual_seed(3))
    X = structured_inputs(300, 256)
    out = sparsegpt_solve(W, 2 / 300 * X.T @ X, Sparsity.parse(f"{n}:{m}"))
    zeros_per_group = (out == 0).view(16, 256 // m, m).sum(-1)
    assert (zeros_per_group == n).all()


@pytest.mark.parametrize("cols,sparsity", [(200, 0.3), (256, 0.5), (130, 0.77)])
def test_sparsegpt_exact_unstructured_count(cols, sparsity):
    W = torch.randn(10, cols, generator=torch.Generator().manual_seed(4))
    X = structured_inputs(300, cols)
    out = sparsegpt_solve(W, 2 / 300 * X.T @ X, Sparsity.parse(sparsity))
    assert int((out == 0).sum()) == math.floor(sparsity * W.numel())


def test_hessian_is_running_average_of_2xxt():
    X = structured_inputs(5 * 7, 6).view(5, 7, 6)
    acc = Hessian(6)
    acc.add_batch(X[:2])
    acc.add_batch(X[2:])
    want = 2 / 5 * sum(x.T @ x for x in X)
    torch.testing.assert_close(acc.value(), want, rtol=1e-5, atol=1e-5)


def test_statistics_do_not_depend_on_the_order_of_the_batches():
    """The same batches in another order give the same statistics bit for bit, and an exact sum of
    terms of very different magnitude does too (two ranks against one process: tests/test_torchrun.py)."""
    from fairprune.distributed import ExactSum

    g = torch.Generator().manual_seed(8)
    batches = [torch.randn(1, 16, 64, generator=g) for _ in range(64)]
    order = torch.randperm(64, generator=g).tolist()

    def fed(stat, items):
        for x in items:
            (stat.add_pair(x, x.flip(1)) if isinstance(stat, PairedHessian) else stat.add_batch(x))
        return stat

    for make in (lambda: Hessian(64), lambda: PairedHessian(64), lambda: InputNorms(64)):
        assert torch.equal(fed(make(), [batches[i] for i in order]).value(), fed(make(), batches).value())
    terms = [torch.randn(5, 7, generator=g) * 10.0 ** (6 * (k % 3 - 1)) for k in range(30)]
    sums = [ExactSum((5, 7)), ExactSum((5, 7))]
    for k, other in enumerate(torch.randperm(30, generator=g).tolist()):
        sums[0].add(terms[k])
        sums[1].add(terms[other])  # the same terms in another order
    assert len(sums[0].parts) == 3 and torch.equal(sums[0].total(), sums[1].total())


def test_exact_sum_classes_a_term_by_its_largest_magnitude():
    """A term is rounded on the grid of the class of its largest |entry|, whichever sign holds it
    (a Gram matrix's largest entry is positive, a difference's may be negative)."""
    import math

    from fairprune.distributed import ExactSum

    for term in (torch.tensor([[1000.0, -3.0]]), torch.tensor([[3.0, -1000.0]])):
        acc = ExactSum((1, 2))
        acc.add(term)
        assert list(acc.parts) == [-(-math.frexp(1000.0)[1] // ExactSum.CLASS)]
        assert torch.equal(acc.total(), term.double())  # float32 entries lie on the grid
    # A term larger than the slice it is rounded in: as if rounded whole.
    g = torch.Generator().manual_seed(3)
    terms = [torch.randn(700, 500, generator=g, dtype=torch.float64) * 1e3 for _ in range(2)]
    acc = ExactSum((700, 500))
    for term in terms:
        acc.add(term)
    assert 700 * 500 > ExactSum.CHUNK
    scale = 2.0 ** (ExactSum.BITS - ExactSum.CLASS * 2)  # |entries| < 2^16: class 2
    want = sum((t * scale).round() / scale for t in terms)
    assert torch.equal(acc.total(), want)
    # Scaled and narrowed a slice at a time: each entry as (total * times / over).to(dtype).
    acc.add(terms[0] * 1e-9)  # a second class
    assert len(acc.parts) == 2
    whole = acc.total()
    assert torch.equal(acc.total(torch.float32, times=2, over=7), (whole * 2 / 7).to(torch.float32))


def test_paired_hessian_matches_formula():
    g = torch.Generator().manual_seed(5)
    x0, x1 = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    plain = torch.randn(2, 6, 5, generator=g)
    acc = PairedHessian(5)
    acc.add_pair(x0[:1], x1[:1])
    acc.add_pair(x0[1:], x1[1:])
    acc.add_batch(plain)
    pair_term = sum(a.T @ a + b.T @ b + 2 * (a - b).T @ (a - b) for a, b in zip(x0, x1)) / 3
    plain_term = 2 / 2 * sum(p.T @ p for p in plain)
    torch.testing.assert_close(acc.value(), pair_term + plain_term, rtol=1e-5, atol=1e-5)
    # Every pair has the same weight: the order of the pairs does not matter.
    rev = PairedHessian(5)
    for k in (2, 1, 0):
        rev.add_pair(x0[k : k + 1], x1[k : k + 1])
    torch.testing.assert_close(rev.value(), pair_term, rtol=1e-5, atol=1e-5)


def test_paired_hessian_mask_and_identical_sides():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 5, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    paired, plain = PairedHessian(4), Hessian(4)
    paired.add_pair(x, x, mask)
    plain.add_batch(x, mask)
    # Identical sides: X0X0ᵀ + X1X1ᵀ = 2XXᵀ, ΔX = 0, i.e. exactly the SparseGPT Hessian.
    torch.testing.assert_close(paired.value(), plain.value())
    want = 2 / 2 * (x[0, :3].T @ x[0, :3] + x[1, :4].T @ x[1, :4])
    torch.testing.assert_close(plain.value(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(UserError, match="align"):
        paired.add_pair(x, x[:, :4])


def test_cholesky_retries_with_more_damping_then_fails_loudly():
    H = torch.diag(torch.tensor([1.0, 1.0, -0.05]))
    with pytest.warns(UserWarning, match="percdamp"):
        U = inverse_hessian_cholesky(H)
    assert torch.isfinite(U).all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UserError, match="not positive definite"):
            inverse_hessian_cholesky(-torch.eye(3))
        with pytest.raises(UserError):
            sparsegpt_solve(torch.randn(2, 3), torch.full((3, 3), float("nan")), Sparsity.parse(0.5))


# --------------------------------------------------------------------------------------------
# Wanda and magnitude
# --------------------------------------------------------------------------------------------


def test_wanda_norms_and_per_row_mask():
    X = structured_inputs(60, 40).view(3, 20, 40)
    norms = InputNorms(40)
    norms.add_batch(X[:1])
    norms.add_batch(X[1:])
    torch.testing.assert_close(norms.value(), X.reshape(-1, 40).norm(dim=0), rtol=1e-5, atol=1e-5)
    W = torch.randn(7, 40, generator=torch.Generator().manual_seed(7))
    mask = wanda_mask(W, norms.value(), Sparsity.parse(0.35))
    k = int(40 * 0.35)
    assert (mask.sum(1) == k).all()
    score = W.abs() * norms.value()
    for r in range(7):  # the pruned entries are the row's k lowest scores
        assert set(mask[r].nonzero().flatten().tolist()) == set(score[r].argsort()[:k].tolist())
    nm = wanda_mask(W, norms.value(), Sparsity.parse("2:4"))
    assert (nm.view(7, 10, 4).sum(-1) == 2).all()


def test_magnitude_layerwise_threshold_and_nm():
    model = build("gpt2")
    layers = [l for b in model.transformer.h for l in family_of(model).block_linears(b).values()]
    dense = [linear_weight(l).clone() for l in layers]
    prune_causal_lm(model, "magnitude", Sparsity.parse(0.4), progress=False)
    for layer, before in zip(layers, dense):
        W = linear_weight(layer)
        pruned = W == 0
        assert int(pruned.sum()) == int(0.4 * W.numel())
        # Layer-wide: every pruned weight is smaller than every kept one; kept ones unchanged.
        assert before[pruned].abs().max() <= before[~pruned].abs().min()
        torch.testing.assert_close(W[~pruned], before[~pruned])
    model = build("llama")
    prune_causal_lm(model, "magnitude", Sparsity.parse("1:4"), progress=False)
    layer = model.model.layers[1].mlp.down_proj.weight
    assert ((layer == 0).view(layer.shape[0], -1, 4).sum(-1) == 1).all()


# --------------------------------------------------------------------------------------------
# Layer-sequential calibration
# --------------------------------------------------------------------------------------------


class Recorder:
    """A statistic that keeps every input it is given."""

    def __init__(self):
        self.xs = []

    def add_batch(self, x, mask=None):
        self.xs.append(x.clone())


def test_calibration_feeds_next_block_the_pruned_outputs():
    model = build("gpt2")
    dense = copy.deepcopy(model)
    ids = calib(3, 12)
    seen = {}

    def make_stat(name, layer):
        seen[name] = Recorder()
        return seen[name]

    def prune(name, layer, stat):  # zero the first half of every input column
        linear_weight(layer)[:, : linear_weight(layer).shape[1] // 2] = 0

    run_layerwise(model, make_inputs(ids, batch_size=2), "cpu", make_stat, prune, progress=False)
    assert [x.shape[0] for x in seen["0.attn.c_attn"].xs] == [2, 1]

    def block_io(m):
        """Run the full model; return block 0's input and output and block 1's c_attn input."""
        got = {}
        blocks = m.transformer.h
        # Hooks must return None (a returned value would replace the input / output).
        hooks = [
            blocks[0].register_forward_pre_hook(lambda mod, a: got.update(in0=a[0])),
            blocks[0].register_forward_hook(lambda mod, a, out: got.update(out0=out)),
            blocks[1].attn.c_attn.register_forward_hook(lambda mod, a, out: got.update(x1=a[0])),
        ]
        with torch.no_grad():
            m(ids)
        for h in hooks:
            h.remove()
        return got

    after, before = block_io(model), block_io(dense)
    recorded0 = torch.cat(seen["0.attn.c_attn"].xs)
    recorded1 = torch.cat(seen["1.attn.c_attn"].xs)
    by_hand0 = model.transformer.h[0].ln_1(model.transformer.wte(ids) + model.transformer.wpe(torch.arange(12)))
    torch.testing.assert_close(recorded0, by_hand0)
    torch.testing.assert_close(after["in0"], model.transformer.wte(ids) + model.transformer.wpe(torch.arange(12)))
    # Block 1 was calibrated on block 0's outputs *after* block 0 was pruned.
    torch.testing.assert_close(recorded1, model.transformer.h[1].ln_1(after["out0"]))
    torch.testing.assert_close(recorded1, after["x1"])
    assert not torch.allclose(recorded1, before["x1"], atol=1e-3)


SHARED = {"llama": [["mlp.gate_proj", "mlp.up_proj"], ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]],
          "opt": [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]],
          "gpt_neo": [["attn.attention.q_proj", "attn.attention.k_proj", "attn.attention.v_proj"]], "gpt2": []}


@pytest.mark.parametrize("model_type", sorted(SHARED))
def test_layers_reading_one_input_share_one_statistic(model_type):
    """Layers fed the very same tensor (q, k, v; gate and up) share one statistic object, and its
    value is what each layer's own statistic holds when nothing is shared, for the Hessian, the
    paired Hessian (plain and paired batches) and Wanda's norms."""
    from fairprune.causal.blocks import Resident
    from fairprune.causal.pipeline import call_block
    from fairprune.causal.pipeline import capture as capture_block_inputs
    from fairprune.pruning.calibration import _collecting

    def _collect(index, block, layers, stats, batches, share=True):  # the batches through the block, hooks on
        with _collecting(layers, stats, share=share) as before:
            for b in batches:
                before(b)
                call_block(index, block, b)

    model = build(model_type)
    family = family_of(model)
    g = torch.Generator().manual_seed(2)
    pairs = (torch.randint(0, VOCAB, (3, 10), generator=g), torch.randint(0, VOCAB, (3, 10), generator=g))
    batches = capture_block_inputs(Resident(model), make_inputs(calib(5, 12), pairs, batch_size=2), "cpu")
    block = family.block_list(model)[0]
    layers = family.block_linears(block)
    for make in (Hessian, PairedHessian, InputNorms):
        together = {name: make(linear_weight(layer).shape[1]) for name, layer in layers.items()}
        apart = {name: make(linear_weight(layer).shape[1]) for name, layer in layers.items()}
        plain = [b for b in batches if not b.source.paired] if make is not PairedHessian else batches
        with torch.no_grad():
            _collect(0, block, layers, together, plain)
            _collect(0, block, layers, apart, plain, share=False)
        groups: dict[int, list[str]] = {}
        for name in layers:
            groups.setdefault(id(together[name]), []).append(name)
        assert sorted(sorted(g) for g in groups.values() if len(g) > 1) == sorted(sorted(g) for g in SHARED[model_type])
        assert len({id(stat) for stat in apart.values()}) == len(layers)
        for name in layers:
            assert torch.equal(together[name].value(), apart[name].value()), (make.__name__, name)


@pytest.mark.parametrize("spec", ["0.3", "0.5", "2:4"])
def test_layers_stacked_by_rows_solve_as_each_alone(spec):
    """``segments``: layers sharing a Hessian, solved stacked, are each layer's own solve bit for
    bit, each with its own unstructured quota (uneven row counts, partial last block)."""
    cols = 72
    X = structured_inputs(200, cols)
    H = 2 / len(X) * X.T @ X
    g = torch.Generator().manual_seed(4)
    parts = [torch.randn(rows, cols, generator=g) * scale for rows, scale in ((12, 1.0), (5, 30.0), (7, 0.01))]
    alone = [sparsegpt_solve(W, H, Sparsity.parse(spec), blocksize=32) for W in parts]
    stacked = sparsegpt_solve(torch.cat(parts), H, Sparsity.parse(spec), blocksize=32, segments=[12, 5, 7])
    assert torch.equal(stacked, torch.cat(alone))
    if spec != "2:4":  # the scales differ by 3000x: one quota over all rows would prune the small layer whole
        for part in alone:
            assert int((part == 0).sum()) == math.floor(float(spec) * part.numel())
    with pytest.raises(ValueError, match="do not add up"):
        sparsegpt_solve(torch.cat(parts), H, Sparsity.parse(spec), segments=[12, 5])


@pytest.mark.parametrize("method", ["sparsegpt", "debias-sparsegpt"])
@pytest.mark.parametrize("model_type", sorted(SHARED))
def test_pruning_solves_shared_layers_together_as_each_alone(model_type, method, monkeypatch):
    """A block's layers that share a Hessian (q, k, v; gate, up) are solved together: the pruned
    model is the one each layer's own solve gives, bit for bit."""
    from fairprune.pruning.registry import Method

    ids = calib(4, 16)
    kwargs = {"pairs": (ids, calib(4, 16, seed=3))} if method == "debias-sparsegpt" else {"calib_ids": ids}
    together = build(model_type)
    prune_causal_lm(together, method, HALF, progress=False, **kwargs)
    monkeypatch.setattr(Method, "select_takes", lambda self, name: False)
    apart = build(model_type)
    prune_causal_lm(apart, method, HALF, progress=False, **kwargs)
    for (name, a), b in zip(together.state_dict().items(), apart.state_dict().values()):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------------------------
# Every family end to end
# --------------------------------------------------------------------------------------------


def test_every_family_has_a_test_model():
    assert {t for f in FAMILIES for t in f.model_types} <= set(BUILDERS)


@pytest.mark.parametrize("model_type", sorted(BUILDERS))
def test_family_table_geometry(model_type):
    model = build(model_type)
    family = family_of(model)
    config = model.config
    heads, kv, dim = family.num_heads(config), family.num_kv_heads(config), family.head_dim(config)
    block = family.block_list(model)[0]
    assert len(family.block_list(model)) == 2
    assert linear_weight(family.attention_out(block)).shape[1] == heads * dim
    if model_type in ("llama", "mistral"):
        assert kv == 2 < heads
        assert linear_weight(block.self_attn.k_proj).shape[0] == kv * dim
    for layer in family.block_linears(block).values():
        assert linear_weight(layer).dim() == 2


@pytest.mark.parametrize("model_type", sorted(BUILDERS))
@pytest.mark.parametrize("method", ["wanda", "sparsegpt", "debias-sparsegpt"])
def test_prune_every_family_end_to_end(model_type, method):
    model = build(model_type)
    ids = calib(4, 16)
    kwargs = {"pairs": (ids[:2], calib(2, 16, seed=1))} if method == "debias-sparsegpt" else {"calib_ids": ids}
    sparsity = Sparsity.parse("2:4" if method == "wanda" else 0.5)
    report = prune_causal_lm(model, method, sparsity, progress=False, **kwargs)
    family = family_of(model)
    n_layers = 2 * len(family.linears)
    assert len(report["layers"]) == n_layers
    for name, value in report["layers"].items():
        assert value == pytest.approx(0.5, abs=1e-9), name
    assert report["achieved_sparsity"] == pytest.approx(0.5)
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_debias_with_identical_sides_equals_sparsegpt():
    ids = calib(3, 16)
    plain, paired = build("llama"), build("llama")
    prune_causal_lm(plain, "sparsegpt", HALF, calib_ids=ids, progress=False)
    prune_causal_lm(paired, "debias-sparsegpt", HALF, pairs=(ids, ids), progress=False)
    for a, b in zip(plain.model.layers.parameters(), paired.model.layers.parameters()):
        agree = ((a == 0) == (b == 0)).float().mean()
        assert agree > 0.99
    different = build("llama")
    prune_causal_lm(different, "debias-sparsegpt", HALF, pairs=(ids, calib(3, 16, seed=9)), progress=False)
    w, v = plain.model.layers[0].mlp.up_proj.weight, different.model.layers[0].mlp.up_proj.weight
    assert ((w == 0) != (v == 0)).float().mean() > 0.05


def test_save_and_reload_keeps_logits_and_zeros(tmp_path):
    model = build("gpt2")
    ids = calib(2, 16)
    prune_causal_lm(model, "sparsegpt", Sparsity.parse("2:4"), calib_ids=ids, progress=False)
    model.save_pretrained(tmp_path)
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    family = family_of(loaded)
    assert sparsity_by_layer(loaded, family) == sparsity_by_layer(model, family)
    assert sparsity_by_layer(loaded, family)["__total__"] == 0.5


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(method="sparsegpt", sparsity=1.0), "sparsity"),
        (dict(method="sparsegpt", sparsity=-0.1), "sparsity"),
        (dict(method="sparsegpt", sparsity="4:4"), "N < M"),
        (dict(method="sparsegpt", sparsity="3:7"), "divide"),
        (dict(method="sparsegpt", sparsity=124), "sexagesimal.*quote"),
        (dict(method="sparsegpt", sparsity="half"), "fraction in \\[0, 1\\) or an N:M"),
        (dict(method="sparsgpt", sparsity=0.5), "did you mean"),
        (dict(method="wanda", sparsity=0.5, calib_ids=None), "calibration"),
        (dict(method="debias-sparsegpt", sparsity=0.5, calib_ids=None), "paired"),
        (dict(method="sparsegpt", sparsity=0.5, pairs=(calib(), calib())), "used only by the paired methods"),
        (dict(method="debias-sparsegpt", sparsity=0.5, pairs=(calib(2, 8), calib(2, 9))), "align"),
        (dict(method="sparsegpt", sparsity=0.5, calib_ids=calib() + VOCAB), "vocabulary"),
        (dict(method="sparsegpt", sparsity=0.5, calib_ids=torch.randn(2, 4)), "integer"),
    ],
)
def test_bad_inputs_raise_user_error(kwargs, match):
    kwargs.setdefault("calib_ids", calib())
    with pytest.raises(UserError, match=match) as err:
        sparsity = Sparsity.parse(kwargs.pop("sparsity"))  # where a sparsity enters: parsed once
        prune_causal_lm(build("gpt2"), sparsity=sparsity, progress=False, **kwargs)
    assert "\n" not in str(err.value)


def test_a_family_no_row_names_is_read_from_the_model():
    """GPT-J has no row in the table: its structure is found from the model and it prunes."""
    torch.manual_seed(0)
    model = tf.GPTJForCausalLM(tf.GPTJConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, rotary_dim=4,
                                             n_positions=64, bos_token_id=0, eos_token_id=0)).eval()
    family = family_of(model)
    assert (family.blocks, family.front, family.tail) == ("h", ("wte", "rotary_emb"), ("ln_f",))
    assert family.linears == ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "mlp.fc_in", "mlp.fc_out")
    assert not family.has_heads  # its attention is not named the common way: head pruning says so
    with pytest.raises(UserError, match="gptj family's attention was not recognised"):
        family.require_heads("FASP")
    report = prune_causal_lm(model, "sparsegpt", HALF, calib_ids=calib(2, 16), progress=False)
    assert report["achieved_sparsity"] == pytest.approx(0.5)


def test_a_model_that_cannot_be_read_block_by_block_is_refused_in_one_line():
    t5 = tf.T5ForConditionalGeneration(tf.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16,
                                                   vocab_size=VOCAB, decoder_start_token_id=0))
    with pytest.raises(UserError, match="encoder-decoder") as err:
        family_of(t5)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------
# Distributed: statistics from two processes combine into the single-process result
# --------------------------------------------------------------------------------------------


# Run as two fresh interpreters importing only torch and the statistics (spawning the test
# module itself would import transformers in every child).
_WORKER = """
import sys, torch, torch.distributed as dist
from fairprune.pruning.sparsegpt import Hessian, PairedHessian
from fairprune.pruning.wanda import InputNorms
rank, init_file, out_file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
g = torch.Generator().manual_seed(11)
x0, x1, plain = torch.randn(5, 3, 4, generator=g), torch.randn(5, 3, 4, generator=g), torch.randn(5, 6, 4, generator=g)
share = slice(0, 2) if rank == 0 else slice(2, 5)  # uneven shards: weighting by count matters
hessian, paired, norms = Hessian(4), PairedHessian(4), InputNorms(4)
hessian.add_batch(plain[share])
paired.add_pair(x0[share], x1[share])
paired.add_batch(plain[share])
norms.add_batch(plain[share])
values = [hessian.value(), paired.value(), norms.value()]
if rank == 0:
    torch.save(values, out_file)
dist.destroy_process_group()
"""


def test_statistics_all_reduce_across_processes(tmp_path):
    out = tmp_path / "values.pt"
    cmd = [sys.executable, "-c", _WORKER]
    procs = [subprocess.Popen([*cmd, str(r), str(tmp_path / "init"), str(out)]) for r in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    got = torch.load(out)
    g = torch.Generator().manual_seed(11)
    x0, x1, plain = torch.randn(5, 3, 4, generator=g), torch.randn(5, 3, 4, generator=g), torch.randn(5, 6, 4, generator=g)
    hessian, paired, norms = Hessian(4), PairedHessian(4), InputNorms(4)
    hessian.add_batch(plain)
    paired.add_pair(x0, x1)
    paired.add_batch(plain)
    norms.add_batch(plain)
    for a, b in zip(got, [hessian.value(), paired.value(), norms.value()]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
