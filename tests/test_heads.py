"""Head gates and physical head removal: gates against zeroed output-projection columns, removed
heads against gated heads (GPT-2, GPT-Neo, Llama with grouped-query attention, OPT, BERT),
save → from_pretrained round trips, gradients of the gates, per-head weight norms."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from fairprune.causal.families import family_of, linear_weight
from fairprune.errors import UserError
from fairprune.pruning.heads import HeadGates, head_weight_norms, remove_heads
from tiny_models import VOCAB

# The shared tiny models, with every Llama projection biased (a bias slice missed shows) and OPT without project_in.
BUILDERS = {
    "gpt2": tiny_models.BUILDERS["gpt2"],
    "gpt_neo": tiny_models.BUILDERS["gpt_neo"],
    "llama": tiny_models.builder("llama", attention_bias=True),
    "opt": tiny_models.builder("opt", word_embed_proj_dim=None),
    "bert": tiny_models.BUILDERS["bert"],
}
# Head sets: mixed per layer; a whole GQA group (Llama heads 0, 1 share key/value head 0); one head per group.
HEAD_SETS = {
    "mixed": [(0, 1), (0, 0), (1, 3)],
    "one-per-group": [(0, 0), (0, 2), (1, 1), (1, 3)],
    "whole-layer": [(0, 0), (0, 1), (0, 2), (0, 3), (1, 2)],
}


pytestmark = pytest.mark.usefixtures("one_thread")


def build(model_type: str, seed: int = 0):
    """A tiny model whose every weight and bias is non-zero, so a missed slice shows in the logits."""
    torch.manual_seed(seed)
    model = BUILDERS[model_type]().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def ids(n: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(1, VOCAB, (n, length), generator=torch.Generator().manual_seed(1))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids()).logits


def zeroed_columns(model, heads):
    """Oracle for a gated head: a copy whose output-projection columns of that head are zero."""
    model = copy.deepcopy(model)
    family = family_of(model)
    width = family.head_dim(model.config)
    blocks = family.block_list(model)
    with torch.no_grad():
        for layer, head in heads:
            linear_weight(family.attention_out(blocks[layer]))[:, head * width : (head + 1) * width] = 0
    return model


@pytest.mark.parametrize("model_type", list(BUILDERS))
def test_open_gates_leave_the_model_untouched(model_type):
    model = build(model_type)
    reference = logits(model)
    gates = HeadGates(model)
    with gates:
        assert torch.equal(logits(model), reference)
        gates.set(torch.full_like(gates.values, 1.0))
        assert torch.equal(logits(model), reference)
    assert torch.equal(logits(model), reference)  # hooks gone


@pytest.mark.parametrize("model_type", list(BUILDERS))
def test_gated_head_equals_zeroed_output_columns(model_type):
    model = build(model_type)
    heads = HEAD_SETS["mixed"]
    expected = logits(zeroed_columns(model, heads))
    gates = HeadGates(model)
    with gates, gates.off(heads):
        gated = logits(model)
    assert torch.allclose(gated, expected, atol=1e-6)
    assert not torch.allclose(gated, logits(model), atol=1e-3)  # the heads did matter
    assert torch.equal(gates.values, torch.ones_like(gates.values))  # off() and exit restore the gates


def test_gates_reject_unknown_heads():
    gates = HeadGates(build("gpt2"))
    with pytest.raises(UserError, match="does not exist"):
        gates.set([(2, 0)])
    with pytest.raises(UserError, match="shape"):
        gates.set(torch.ones(3, 3))


@pytest.mark.parametrize("model_type", list(BUILDERS))
def test_per_row_gates_give_each_row_its_own_head_set(model_type):
    """One batch, one configuration per row: each row's logits are those of its head set gated off
    with ``off`` alone (bit for bit on a CPU), whatever the other rows carry."""
    model = build(model_type)
    gates = HeadGates(model)
    sets = [[], HEAD_SETS["mixed"], [(1, 2)], HEAD_SETS["whole-layer"]]
    configs = torch.ones(len(sets), *gates.values.shape)
    for row, heads in enumerate(sets):
        for layer, head in heads:
            configs[row, layer, head] = 0
    batch = ids(1).expand(len(sets), -1)
    with gates, gates.per_row(configs), torch.no_grad():
        together = model(input_ids=batch).logits
    for row, heads in enumerate(sets):
        with gates, gates.off(heads), torch.no_grad():
            alone = model(input_ids=ids(1)).logits[0]
        assert torch.equal(together[row], alone), (row, heads)
    assert not torch.allclose(together[0], together[1], atol=1e-3)  # the configurations differ
    assert gates.rows is None  # per_row() restores


def test_per_row_gates_are_checked():
    model = build("gpt2")
    gates = HeadGates(model)
    with pytest.raises(UserError, match="batch, layers, heads"):
        with gates.per_row(torch.ones(2, 3, 4)):
            pass
    with gates, gates.per_row(torch.ones(3, 2, 4)), pytest.raises(UserError, match="3 rows"):
        model(input_ids=ids(2))


def gated_setup(model_type: str, heads: str):
    """A fresh model, the head set, and the logits with those heads gated off."""
    model = build(model_type)
    chosen = HEAD_SETS[heads]
    gates = HeadGates(model)
    with gates, gates.off(chosen):
        gated = logits(model)
    return model, chosen, gated


@pytest.mark.parametrize("loadable", [False, True], ids=["sliced", "loadable"])
@pytest.mark.parametrize("heads", list(HEAD_SETS))
@pytest.mark.parametrize("model_type", list(BUILDERS))
def test_removed_heads_equal_gated_heads(model_type, heads, loadable):
    model, chosen, gated = gated_setup(model_type, heads)
    before = sum(p.numel() for p in model.parameters())
    report = remove_heads(model, chosen, loadable=loadable)
    assert torch.allclose(logits(model), gated, atol=1e-5)
    assert sorted(report.removed + report.zeroed) == sorted(chosen)
    after = sum(p.numel() for p in model.parameters())
    assert (after < before) == bool(report.removed)
    if not loadable:
        # Only padding stays: one head in an emptied layer, or query heads that even out GQA groups.
        assert report.heads_per_layer == expected_heads_left(model_type, chosen)


def expected_heads_left(model_type: str, chosen, layers: int = 2, heads: int = 4) -> list[int]:
    group = 2 if model_type == "llama" else 1
    left = []
    for layer in range(layers):
        live = [sum((layer, h) not in chosen for h in range(g, g + group)) for g in range(0, heads, group)]
        left.append(max(1, sum(n > 0 for n in live)) * max(1, max(live)))
    return left


@pytest.mark.parametrize("heads", list(HEAD_SETS))
@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neo", "llama", "opt"])
def test_saved_model_reloads_with_plain_from_pretrained(model_type, heads, tmp_path):
    model, chosen, gated = gated_setup(model_type, heads)
    remove_heads(model, chosen)
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path).eval()
    assert torch.allclose(logits(reloaded), gated, atol=1e-5)


def test_llama_shrinks_its_config_when_every_layer_can():
    """Both layers lose one whole kv group: 2 query heads and 1 kv head remain, physically."""
    model = build("llama")
    chosen = [(0, 0), (0, 1), (1, 2), (1, 3)]
    gates = HeadGates(model)
    with gates, gates.off(chosen):
        gated = logits(model)
    report = remove_heads(model, chosen)
    assert report.zeroed == [] and sorted(report.removed) == chosen
    assert report.kv_removed == [(0, 0), (1, 1)]
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (2, 1)
    assert model.model.layers[0].self_attn.k_proj.weight.shape[0] == model.config.head_dim
    assert torch.allclose(logits(model), gated, atol=1e-5)


def test_gqa_keeps_a_kv_head_while_its_group_has_query_heads():
    model = build("llama")
    report = remove_heads(model, [(0, 0), (0, 2), (1, 0), (1, 1)], loadable=False)
    # Layer 0: one query head left in each group, both kv heads stay. Layer 1: group 0 is empty.
    assert report.kv_removed == [(1, 0)]
    assert report.heads_per_layer == [2, 2]
    attention = model.model.layers[0].self_attn
    assert attention.k_proj.weight.shape[0] == 2 * model.config.head_dim
    assert attention.num_key_value_groups == 1


def test_gpt2_fused_qkv_is_sliced_per_part():
    model = build("gpt2")
    original = copy.deepcopy(model.transformer.h[0].attn.c_attn.weight.data)  # [in, 3 * 64]
    remove_heads(model, [(0, 1)], loadable=False)
    attention = model.transformer.h[0].attn
    keep = [c for part in range(3) for c in range(part * 64, (part + 1) * 64) if not 16 <= c - part * 64 < 32]
    assert torch.equal(attention.c_attn.weight.data, original[:, keep])
    assert (attention.num_heads, attention.split_size, attention.c_proj.weight.shape[0]) == (3, 48, 48)


def test_removing_an_unknown_head_is_a_user_error():
    with pytest.raises(UserError, match="does not exist"):
        remove_heads(build("gpt2"), [(0, 4)])


def test_gate_gradient_matches_finite_difference():
    model = build("gpt2").double()
    batch = ids()

    def loss():  # float64 throughout (the built-in loss upcasts to float32 only)
        out = model(input_ids=batch).logits
        return torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), batch[:, 1:].flatten())

    gates = HeadGates(model)
    gates.values = gates.values.double().requires_grad_(True)
    with gates:
        (grad,) = torch.autograd.grad(loss(), gates.values)
        eps = 1e-6
        with torch.no_grad():
            gates.values[1, 2] += eps
            up = loss()
            gates.values[1, 2] -= 2 * eps
            down = loss()
    assert grad.abs().min() > 0
    assert abs(float(grad[1, 2]) - float((up - down) / (2 * eps))) < 1e-7


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_head_weight_norms_against_a_plain_loop(model_type):
    model = build(model_type)
    family = family_of(model)
    hd, h, kv = family.head_dim(model.config), family.num_heads(model.config), family.num_kv_heads(model.config)
    norms = head_weight_norms(model)
    for layer, block in enumerate(family.block_list(model)):
        if model_type == "gpt2":
            w = block.attn.c_attn.weight.data.t()
            q, k, v = w[:64], w[64:128], w[128:]
            o = block.attn.c_proj.weight.data.t()
        else:
            a = block.self_attn
            q, k, v, o = a.q_proj.weight.data, a.k_proj.weight.data, a.v_proj.weight.data, a.o_proj.weight.data
        for head in range(h):
            g = head // (h // kv)
            rows, kv_rows = slice(head * hd, (head + 1) * hd), slice(g * hd, (g + 1) * hd)
            total = q[rows].pow(2).sum() + k[kv_rows].pow(2).sum() + v[kv_rows].pow(2).sum() + o[:, rows].pow(2).sum()
            assert torch.isclose(norms[layer, head], total.sqrt(), rtol=1e-5)


@pytest.mark.parametrize("model_type", list(BUILDERS))
def test_family_row_locates_every_head_piece(model_type):
    """The head fields of each family's row match its model: q/k/v widths and the attributes
    that head removal rewrites exist and hold the head counts (a misspelt one would be created)."""
    model = build(model_type)
    family = family_of(model)
    heads, kv, dim = family.num_heads(model.config), family.num_kv_heads(model.config), family.head_dim(model.config)
    for block in family.block_list(model):
        attention = family.attention_module(block)
        assert sum(linear_weight(layer).shape[0] for layer in family.qkv_layers(block)) == (heads + 2 * kv) * dim
        assert all(getattr(attention, name) == heads for name in family.head_counts)
        assert all(getattr(attention, name) == heads * dim for name in family.head_widths)
        assert family.head_groups is None or getattr(attention, family.head_groups) == heads // kv
    assert family.heads_shrinkable == (model_type == "llama")
