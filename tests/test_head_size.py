"""The size report of head removal: stored and effective parameters against the tensors (and
against the model with the heads cut out), attention FLOPs against the formula, per-layer head
counts, and the note for families whose heads are zeroed rather than cut out."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from fairprune.causal.families import family_of, linear_weight
from fairprune.pruning.head_size import measure, removal_size, summary
from fairprune.pruning.heads import remove_heads

pytestmark = pytest.mark.usefixtures("one_thread")

BUILDERS = {"gpt2": tiny_models.builder("gpt2"), "llama": tiny_models.builder("llama", attention_bias=True)}  # GQA: 4 q, 2 kv
CONTEXT = 32
# Llama groups are (0, 1) and (2, 3): layer 0 keeps one head per group, layer 1 one head of group 1.
HEADS = [(0, 1), (0, 3), (1, 0), (1, 1), (1, 3)]


def build(model_type: str):
    """A tiny model whose every parameter is non-zero, so exact zeros are the zeroed heads."""
    torch.manual_seed(0)
    model = BUILDERS[model_type]().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_().add_(torch.sign(p) * 1e-3)
    return model


def attention_zeros(model) -> int:
    """Exact zeros in the q/k/v and output projections (weights and biases)."""
    family = family_of(model)
    layers = [m for block in family.block_list(model) for m in (*family.qkv_layers(block), family.attention_out(block))]
    return sum(int((p == 0).sum()) for m in layers for p in m.parameters())


def flops_by_hand(model, context: int) -> int:
    """The docstring's formula, from the config and the tensor widths."""
    family = family_of(model)
    d_h, total = family.head_dim(model.config), 0
    for block in family.block_list(model):
        out = linear_weight(family.attention_out(block))
        n_q = out.shape[1] // d_h
        qkv = sum(linear_weight(p).shape[0] for p in family.qkv_layers(block)) // d_h
        n_kv = (qkv - n_q) // 2
        hidden = model.config.hidden_size
        total += 2 * (hidden * n_q * d_h + 2 * hidden * n_kv * d_h + n_q * d_h * hidden) + 4 * n_q * d_h * context
    return total


@pytest.mark.parametrize("model_type", list(BUILDERS))
def test_dense_figures_are_the_plain_counts(model_type):
    model = build(model_type)
    size = measure(model, CONTEXT)
    assert size.parameters == size.effective_parameters == sum(p.numel() for p in model.parameters())
    assert size.attention_flops == size.effective_attention_flops == flops_by_hand(model, CONTEXT)
    assert [(layer.heads, layer.kv_heads) for layer in size.layers] == [(4, 4 if model_type == "gpt2" else 2)] * 2


@pytest.mark.parametrize("model_type", list(BUILDERS))
def test_sliced_model_is_counted_from_its_tensors(model_type):
    model = build(model_type)
    before = measure(model, CONTEXT)
    removal = remove_heads(model, HEADS, loadable=False)
    size = removal_size(before, model, removal, loadable=False)
    assert size["parameters"]["stored"] == sum(p.numel() for p in model.parameters()) < before.parameters
    assert size["parameters"]["stored"] - size["parameters"]["effective"] == attention_zeros(model)
    assert size["attention_flops_per_token"]["stored"] == flops_by_hand(model, CONTEXT)
    removed = [sum(layer == i for layer, _ in removal.removed) for i in range(2)]
    assert [row["heads_removed"] for row in size["layers"]] == removed
    assert [row["heads_kept"] for row in size["layers"]] == [2, 1]  # 4 − pruned heads
    assert [row["heads_removed"] for row in size["layers"]] == [2, 3]
    assert size["note"] is None and not removal.zeroed and params_equal(size)
    # Per layer, what left the tensors adds up to the parameter count's drop, 4 bytes each in float32.
    assert sum(row["parameters_removed"] for row in size["layers"]) == before.parameters - size["parameters"]["stored"]
    assert all(row["bytes_removed"] == 4 * row["parameters_removed"] > 0 for row in size["layers"])
    if model_type == "gpt2":
        # Multi-head attention: every FLOP belongs to one head, so FLOPs scale with the heads left.
        assert size["attention_flops_per_token"]["stored"] * 8 == before.attention_flops * (8 - len(HEADS))
    else:  # layer 1's emptied key/value group leaves the tensors
        assert [row["kv_heads_removed"] for row in size["layers"]] == [0, 1]
        assert [row["kv_heads_kept"] for row in size["layers"]] == [2, 1]


def test_tokens_per_second_times_one_window_and_restores_the_mode():
    """A throughput figure for the report (its size is a benchmark's business, not a test's): finite,
    positive, one window of the given length, the model's train / eval mode left as it was."""
    from fairprune.pruning.head_size import tokens_per_second

    model = build("gpt2").train()
    seen = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape),
                                           with_kwargs=True)
    speed = tokens_per_second(model, torch.arange(64) % model.config.vocab_size, 16, repeats=2)
    hook.remove()
    assert 0 < speed < float("inf") and model.training
    assert seen == [(1, 16)] * 3  # one untimed forward, then the timed ones


@pytest.mark.parametrize("model_type", list(BUILDERS))
def test_loadable_removal_reports_zeroed_heads_and_the_note(model_type):
    model, sliced = build(model_type), build(model_type)
    before = measure(model, CONTEXT)
    size = removal_size(before, model, remove_heads(model, HEADS, loadable=True), loadable=True)
    cut = removal_size(before, sliced, remove_heads(sliced, HEADS, loadable=False), loadable=False)
    params, flops = size["parameters"], size["attention_flops_per_token"]
    assert params["stored"] == sum(p.numel() for p in model.parameters())
    assert params["stored"] - params["effective"] == attention_zeros(model) > 0
    # What still computes does not depend on how the heads were taken out.
    assert params["effective"] == cut["parameters"]["effective"]
    assert flops["effective"] == cut["attention_flops_per_token"]["effective"] < flops["stored"]
    assert flops["stored"] == flops_by_hand(model, CONTEXT)
    assert [row["heads_kept"] for row in size["layers"]] == [2, 1]
    assert size["note"] and "\n" not in size["note"] and "zeroed in place" in size["note"]
    if model_type == "gpt2":  # nothing can leave the tensors: the stored size does not move
        assert params["stored"] == before.parameters and flops["stored"] == before.attention_flops
        assert f"{len(HEADS)} of {len(HEADS)} pruned heads" in size["note"]
        assert flops["effective"] * 8 == before.attention_flops * (8 - len(HEADS))
    else:  # both layers shrink to 2 groups × 1 head; layer 1 pads its emptied group with a zeroed head
        assert params["stored"] < before.parameters
        assert [row["heads_removed"] for row in size["layers"]] == [2, 2]
        assert [row["heads_zeroed"] for row in size["layers"]] == [0, 1]
        assert [row["kv_heads_zeroed"] for row in size["layers"]] == [0, 1]
        assert f"1 of {len(HEADS)} pruned heads" in size["note"] and "llama config" in size["note"]
    assert "effective" in summary(size)


def test_grouped_query_attention_zeroes_uneven_groups_even_when_sliced():
    model = build("llama")
    before = measure(model, CONTEXT)
    size = removal_size(before, model, remove_heads(model, [(0, 0), (1, 3)], loadable=False), loadable=False)
    # One head of one group per layer: the other group keeps two, so the pruned head stays, zeroed.
    assert [row["heads_zeroed"] for row in size["layers"]] == [1, 1]
    assert size["parameters"]["stored"] == before.parameters > size["parameters"]["effective"]
    assert "grouped-query" in size["note"] and "config" not in size["note"]


def params_equal(size: dict) -> bool:
    return size["parameters"]["stored"] == size["parameters"]["effective"]


def test_the_report_does_not_change_the_model():
    model = build("gpt2")
    state = copy.deepcopy(model.state_dict())
    measure(model, CONTEXT)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_fasp_report_carries_the_size_and_the_scorer(tmp_path, capsys):
    import json

    import transformers as tf

    from fairprune.data.prompts import holistic_prompts
    from fairprune.data.text import lm_corpus, train_bpe_tokenizer
    from fairprune.metrics import jigsaw
    from fairprune.pruning.fasp import Generation
    from fairprune.pruning.options import CalibrationOptions, HeadOptions
    from fairprune.runs.fasp import FaspSettings, run_fasp

    corpus = lm_corpus(train_docs=40, validation_docs=8)
    tokenizer = train_bpe_tokenizer(corpus.train, 300)
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=len(tokenizer), n_positions=64,
                                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                             pad_token_id=tokenizer.pad_token_id)).eval()
    dense = sum(p.numel() for p in model.parameters())
    prompts = holistic_prompts(["gender_and_sex"]).groupby("bucket").head(5)
    scorer = "jigsaw" if jigsaw.available() else "lexicon"
    run = run_fasp(model, tokenizer, prompts, corpus.validation, method="random",
                   heads=HeadOptions(alpha=0.25, scorer=scorer), output_dir=tmp_path,
                   calibration=CalibrationOptions(seqlen=32),
                   settings=FaspSettings(generation=Generation(max_new_tokens=2), progress=False))
    report = json.loads(json.dumps(run.report))  # what report.json holds
    assert report["scorer"] == ("jigsaw:toxic" if scorer == "jigsaw" else "lexicon")
    size = report["size"]
    assert size["context"] == 32 and size["parameters"]["before"] == dense == size["parameters"]["stored"]
    assert dense - size["parameters"]["effective"] == 2 * (32 // 4) * (3 * 32 + 3 + 32)  # 2 heads: q/k/v rows + biases, o columns
    assert sum(row["heads_zeroed"] for row in size["layers"]) == 2 and "zeroed in place" in size["note"]
