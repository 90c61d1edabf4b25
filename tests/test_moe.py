"""Mixture-of-experts models pruned for real, and reports measured from the written weights.

Tiny random models built from the transformers configs of Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE and
gpt-oss (fused 3-D expert parameters in transformers 5): every expert at the target sparsity in the
files, the report equal to what the files hold, one expert's SparseGPT solve equal to the OBS
oracle fed by exactly that expert's inputs, an expert no token reached pruned by magnitude, the
check that stops a run whose written weights miss the target, and the one-line refusals.
"""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from fairprune.causal.blocks import Resident
from fairprune.causal.written import check_written, measure_written
from fairprune.cli.prune import main as prune_main
from fairprune.errors import UserError
from fairprune.pruning.llm import magnitude_solve, prune_causal_lm
from fairprune.pruning.options import SolverOptions
from fairprune.pruning.sparsity import Sparsity
from test_llm_pruning import obs_oracle
from tiny_models import BUILDERS, LFM2, LLAMA4, MIXED_MOE_SPECS, MOE_SPECS, VOCAB, moe_folder, moe_model

FAST = ["--nsamples", "4", "--seqlen", "32", "--eval_tokens", "256", "--device", "cpu", "--quiet", "true",
        "--dense_cache", "false"]


def _texts(root) -> list[str]:
    return ["--calib_text", str(root / "eval.txt"), "--eval_text", str(root / "eval.txt")]


def _per_expert(folder) -> dict[tuple[str, int], list[int]]:
    """(decoder layer, expert) -> [zeros, numel] over the written tensors, read with safetensors
    alone: Mixtral's experts.<e>.w1 / w2 / w3, or an expert's slice of each 3-D parameter
    (``experts.gate_up_proj``, GraniteMoE's ``input_linear.weight`` / ``output_linear.weight``)."""
    out: dict[tuple[str, int], list[int]] = {}
    for key, t in load_file(str(folder / "model.safetensors")).items():
        if "shared" in key or key.endswith("bias"):
            continue
        within = re.match(r"^(.*?layers\.\d+)\.", key)
        if within is None:  # embeddings, final norm, head
            continue
        layer = within.group(1)
        listed = re.search(r"\.experts\.(\d+)\.", key)
        if listed:
            z = out.setdefault((layer, int(listed.group(1))), [0, 0])
            z[0], z[1] = z[0] + int((t == 0).sum()), z[1] + t.numel()
        elif t.dim() == 3:
            for e in range(t.shape[0]):
                z = out.setdefault((layer, e), [0, 0])
                z[0], z[1] = z[0] + int((t[e] == 0).sum()), z[1] + t[e].numel()
    return out


@pytest.mark.parametrize("family", sorted(MOE_SPECS))
def test_every_expert_is_pruned_and_the_report_states_the_files(tmp_path, family):
    folder = moe_folder(tmp_path, family)
    out = tmp_path / "out"
    assert prune_main(["sparsegpt", "--model", folder, "--sparsity", "0.5", "--output", str(out),
                       *FAST, *_texts(tmp_path)]) == 0
    experts = _per_expert(out)
    assert len(experts) == 2 * 4  # two blocks of four experts
    assert all(z / n >= 0.49 for z, n in experts.values()), experts
    report = json.loads((out / "report.json").read_text())
    sparsity = report["sparsity"]
    assert sparsity["measured_on"] == "the written weights"
    assert sparsity["by_kind"]["experts"]["sparsity"] == pytest.approx(
        sum(z for z, _ in experts.values()) / sum(n for _, n in experts.values()))
    assert [len(v) for v in sparsity["experts"].values()] == [4, 4]
    assert "router" in {d["kind"] for d in sparsity["left_dense"]}
    assert sparsity["by_kind"]["router"]["pruned_numel"] == 0
    assert report["achieved_sparsity"] == pytest.approx(0.5, abs=0.01)
    assert report["experts"]["calibrate"] == "all" and not report["experts"]["magnitude_fallback"]
    assert math.isfinite(report["metrics"]["perplexity"])
    if family == "qwen2_moe":  # the shared expert is an MLP like any; its one-output gate is a router
        assert sparsity["by_kind"]["shared_experts"]["sparsity"] == pytest.approx(0.5, abs=0.01)
        assert any(d["parameter"].endswith("shared_expert_gate.weight") for d in sparsity["left_dense"])
    card = (out / "README.md").read_text()
    assert "sparsity as written: experts" in card and "Left dense" in card


def _experts_inputs(model, ids):
    """Block 0's experts module input (hidden states, routing), from the dense model's own forward."""
    seen = {}
    experts = model.model.layers[0].mlp.experts

    def grab(module, args, kwargs):
        seen["args"] = [a.detach().clone() for a in args]

    handle = experts.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    return seen["args"][0], seen["args"][1]


@pytest.mark.parametrize("mode", ["routed", "all"])
def test_one_expert_solve_equals_the_obs_oracle_on_its_own_inputs(mode):
    torch.manual_seed(0)
    model = moe_model("mixtral").double().eval()
    model.config._experts_implementation = "eager"  # the grouped kernel takes no float64
    dense = copy.deepcopy(model)
    ids = torch.randint(1, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    hidden, index = _experts_inputs(dense, ids)
    prune_causal_lm(model, "sparsegpt", Sparsity.parse(0.5), ids, solver=SolverOptions(moe_calibrate=mode), progress=False)
    experts = dense.model.layers[0].mlp.experts
    for e in range(4):
        x = hidden[(index == e).any(-1)] if mode == "routed" else hidden
        assert len(x) and (mode == "all" or len(x) < len(hidden))
        gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
        act = experts.act_fn(gate) * up
        for name, inputs in (("gate_up_proj", x), ("down_proj", act)):
            W = getattr(experts, name)[e].detach()
            want = obs_oracle(W, 2 / len(inputs) * inputs.T @ inputs, 0.5)
            got = getattr(model.model.layers[0].mlp.experts, name)[e].detach()
            assert torch.equal(got == 0, want == 0), (name, e)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    # the router is left as it was
    assert torch.equal(model.model.layers[0].mlp.gate.weight, dense.model.layers[0].mlp.gate.weight)


def test_an_expert_no_token_reaches_is_pruned_by_magnitude():
    torch.manual_seed(0)
    model = moe_model("gpt_oss").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.bias[3] = -1e4  # never among the top two
    dense = copy.deepcopy(model)
    ids = torch.randint(1, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    result = prune_causal_lm(model, "wanda", Sparsity.parse(0.5), ids, solver=SolverOptions(moe_calibrate="routed"),
                             progress=False)
    facts = result["experts"]
    assert facts["calibrate"] == "routed"
    assert all(counts[3] == 0 for counts in facts["routed_tokens"].values())
    assert {"0.mlp.experts.gate_up_proj.3", "0.mlp.experts.down_proj.3"} <= set(facts["magnitude_fallback"])
    for name in ("gate_up_proj", "down_proj"):
        W = getattr(dense.model.layers[0].mlp.experts, name)[3].detach().t()  # gpt-oss stores [in, out]
        want = magnitude_solve(W, None, Sparsity.parse(0.5))
        assert torch.equal(getattr(model.model.layers[0].mlp.experts, name)[3].detach().t(), want)


def test_debias_needs_every_token_through_every_expert():
    torch.manual_seed(0)
    model = moe_model("mixtral").eval()
    ids = torch.randint(1, VOCAB, (2, 8))
    with pytest.raises(UserError, match="--moe_calibrate routed"):
        prune_causal_lm(model, "debias-sparsegpt", Sparsity.parse(0.5), None, (ids, ids.flip(0)),
                        solver=SolverOptions(moe_calibrate="routed"), progress=False)


def test_nm_patterns_hold_in_every_expert():
    torch.manual_seed(0)
    model = moe_model("qwen3_moe").eval()
    ids = torch.randint(1, VOCAB, (4, 16))
    prune_causal_lm(model, "sparsegpt", Sparsity.parse("2:4"), ids, progress=False)
    for layer in model.model.layers:
        for name in ("gate_up_proj", "down_proj"):
            W = getattr(layer.mlp.experts, name).detach()
            assert torch.equal((W.reshape(*W.shape[:2], -1, 4) == 0).sum(-1), torch.full(W.shape[:2] + (W.shape[2] // 4,), 2))


def test_the_written_weights_are_checked_against_the_target(tmp_path):
    torch.manual_seed(0)
    model = moe_model("mixtral").eval()
    ids = torch.randint(1, VOCAB, (4, 16))
    prune_causal_lm(model, "magnitude", Sparsity.parse(0.5), progress=False)
    model.save_pretrained(tmp_path)
    blocks = Resident(model)
    measured = measure_written(tmp_path, blocks)
    check_written(measured, 0.5, tmp_path)  # as pruned: passes
    assert measured["achieved"] == pytest.approx(0.5, abs=1e-3)
    files = load_file(str(tmp_path / "model.safetensors"))
    key = next(k for k in files if k.endswith("experts.2.w2.weight"))
    files[key] = torch.randn_like(files[key])  # one expert's down projection written dense
    save_file(files, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    measured = measure_written(tmp_path, blocks)
    assert min(measured["experts"]["model.layers.0.mlp.experts"] + measured["experts"]["model.layers.1.mlp.experts"]) < 0.4
    with pytest.raises(UserError, match=r"miss the target sparsity 0\.5000: model\.layers\.\d\.mlp\.experts\.down_proj\[2\]"):
        check_written(measured, 0.5, tmp_path)
    del ids


def test_a_parameter_no_method_reaches_is_listed_left_dense(tmp_path):
    torch.manual_seed(0)
    model = BUILDERS["llama"]().eval()
    for layer in model.model.layers:  # a weight a block holds outside any layer the methods prune
        layer.mlp.register_parameter("direct", torch.nn.Parameter(torch.randn(4, 8)))
    prune_causal_lm(model, "magnitude", Sparsity.parse(0.5), progress=False)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    measured = measure_written(tmp_path, Resident(model))
    direct = [d for d in measured["left_dense"] if d["parameter"].endswith("mlp.direct")]
    assert len(direct) == 2 and all("not reached" in d["reason"] and d["kind"] == "mlp" for d in direct)
    assert measured["achieved"] == pytest.approx(0.5, abs=1e-3)
    assert set(measured["by_kind"]) == {"attention", "mlp"}


def test_quantize_on_experts_is_refused_before_work(tmp_path, capsys):
    folder = moe_folder(tmp_path, "mixtral")
    out = tmp_path / "q"
    assert prune_main(["sparsegpt", "--model", folder, "--sparsity", "0.5", "--quantize", "w4a16", "--output", str(out),
                       *FAST, *_texts(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "fused 3-D parameters" in err and "drop --quantize" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("family, nm", [("mixtral", None), ("qwen2_moe", None), ("qwen3_moe", "2:4"), ("olmoe", None),
                                        ("gpt_oss", None)])
def test_streamed_experts_equal_in_memory_in_the_checkpoints_layout(tmp_path, family, nm):
    folder = moe_folder(tmp_path, family)
    stored = set(load_file(f"{folder}/model.safetensors"))  # Mixtral: experts.<e>.w1 / w2 / w3, converted on load
    runs = {}
    for stream in ("false", "true"):
        runs[stream] = tmp_path / f"s{stream}"
        assert prune_main(["sparsegpt", "--model", folder, "--sparsity", nm or "0.5", "--stream", stream, "--output",
                           str(runs[stream]), *FAST, *_texts(tmp_path)]) == 0
    a, b = (load_file(str(runs[s] / "model.safetensors")) for s in ("false", "true"))
    assert set(a) == set(b) == stored  # written in the checkpoint's own layout, both ways
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = (json.loads((runs[s] / "report.json").read_text()) for s in ("false", "true"))
    assert ra["sparsity"]["by_kind"] == rb["sparsity"]["by_kind"] and ra["metrics"] == rb["metrics"]
    assert ra["experts"] == rb["experts"] and rb["stream"] is True
    assert all(s >= 0.49 for v in rb["sparsity"]["experts"].values() for s in v)


def test_evaluate_tasks_on_a_pruned_moe_model(tmp_path):
    folder = moe_folder(tmp_path, "olmoe")
    out = tmp_path / "pruned"
    assert prune_main(["wanda", "--model", folder, "--sparsity", "0.5", "--output", str(out), *FAST,
                       *_texts(tmp_path)]) == 0
    assert prune_main(["evaluate", "--model", str(out), "--tasks", "[hellaswag]", "--limit", "4", "--output",
                       str(tmp_path / "ev"), *FAST, *_texts(tmp_path)]) == 0
    report = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert report["achieved_sparsity"] == pytest.approx(0.5, abs=0.01)  # the experts counted, not only attention
    assert "hellaswag/acc" in report["tasks"]["figures"] or any("hellaswag" in k for k in report["metrics"])


def test_fasp_on_moe_attention(tmp_path):
    from fairprune.data.prompts import holistic_prompts

    folder = moe_folder(tmp_path, "mixtral")
    holistic_prompts(["gender_and_sex"]).groupby("bucket").head(2).to_csv(tmp_path / "prompts.csv", index=False)
    out = tmp_path / "fasp"
    assert prune_main(["fasp", "--model", folder, "--prompts", str(tmp_path / "prompts.csv"), "--max_new_tokens", "2",
                       "--seqlen", "32", "--device", "cpu", "--gamma", "0.25", "--alpha", "0.25", "--scorer", "lexicon",
                       "--calib_text", str(tmp_path / "eval.txt"), "--quiet", "true", "--output", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert len(report["heads_removed"]) == 2 and math.isfinite(report["metrics"]["perplexity"])


def test_a_renamed_checkpoint_streams_and_writes_what_transformers_loads(tmp_path):
    import transformers as tf

    from tiny_models import lm_folder

    torch.manual_seed(0)
    folder = lm_folder(tmp_path, lambda vocab, eos: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=vocab,
        max_position_embeddings=64, bos_token_id=eos, eos_token_id=eos)))
    assert "embed_out.weight" in load_file(f"{folder}/model.safetensors")  # GPT-NeoX's head, lm_head in the model
    outs = {}
    for stream in ("false", "true"):
        outs[stream] = tmp_path / f"neox_{stream}"
        assert prune_main(["sparsegpt", "--model", folder, "--sparsity", "0.5", "--stream", stream, "--output",
                           str(outs[stream]), *FAST, *_texts(tmp_path)]) == 0
    ids = torch.arange(1, 20)[None]
    a, b = (tf.AutoModelForCausalLM.from_pretrained(outs[s]).eval() for s in ("false", "true"))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


@pytest.mark.parametrize("family", sorted(MIXED_MOE_SPECS))
def test_blocks_of_two_kinds_are_pruned_each_by_its_own_layers(tmp_path, family):
    """A model whose first block has a dense MLP and whose second routes through experts: every
    layer of each block pruned (the dense MLP and the attention at 0.5, every expert at least
    0.49, the router left dense), the report equal to the files, streamed equal to in-memory."""
    folder = moe_folder(tmp_path, family, **MIXED_MOE_SPECS[family])
    runs = {}
    for stream in ("false", "true"):
        runs[stream] = tmp_path / f"s{stream}"
        assert prune_main(["sparsegpt", "--model", folder, "--sparsity", "0.5", "--stream", stream, "--output",
                           str(runs[stream]), *FAST, *_texts(tmp_path)]) == 0
    a, b = (load_file(str(runs[s] / "model.safetensors")) for s in ("false", "true"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    dense_mlp = {k: t for k, t in a.items() if k.startswith("model.layers.0.mlp.") and t.dim() == 2}
    assert len(dense_mlp) >= 3 and not any(".experts" in k for k in dense_mlp)  # layer 0 holds no experts
    assert all(float((t == 0).float().mean()) == pytest.approx(0.5, abs=0.01) for t in dense_mlp.values()), \
        {k: float((t == 0).float().mean()) for k, t in dense_mlp.items()}
    experts = _per_expert(runs["false"])
    assert {layer for layer, _ in experts} == {"model.layers.1"} and len(experts) == 4
    assert all(z / n >= 0.49 for z, n in experts.values()), experts
    report = json.loads((runs["false"] / "report.json").read_text())
    by_kind = report["sparsity"]["by_kind"]
    assert by_kind["mlp"]["sparsity"] == pytest.approx(0.5, abs=0.01)
    assert by_kind["experts"]["sparsity"] == pytest.approx(sum(z for z, _ in experts.values()) /
                                                         sum(n for _, n in experts.values()))
    assert by_kind["router"]["pruned_numel"] == 0 and report["achieved_sparsity"] == pytest.approx(0.5, abs=0.01)
    streamed = json.loads((runs["true"] / "report.json").read_text())
    assert streamed["sparsity"]["by_kind"] == by_kind and streamed["metrics"] == report["metrics"]


def test_merged_layer_orders_keep_every_kinds_order():
    """The layers of blocks of several kinds, one list: every kind's forward order a subsequence,
    every name once (an oracle that checks the subsequence property directly)."""
    from fairprune.causal.structure import merge_orders

    kinds = [["q", "k", "v", "o", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"],
             ["q", "k", "v", "o", "mlp.gate", "shared.gate_proj", "shared.up_proj", "shared.down_proj"],
             ["q", "k", "v", "o", "mlp.gate", "mlp.gate_proj", "extra"]]
    merged = merge_orders(kinds)
    assert sorted(merged) == sorted({n for kind in kinds for n in kind})
    for kind in kinds:
        positions = [merged.index(n) for n in kind]
        assert positions == sorted(positions), (kind, merged)
    assert merge_orders([kinds[0]]) == tuple(kinds[0])


def test_experts_fed_routed_tokens_are_refused_by_calibrated_methods_and_pruned_by_magnitude(tmp_path, capsys):
    """Llama 4's experts module takes every token already scaled by its router score, so no
    expert's own inputs can be told apart: SparseGPT (as every calibrated method) is refused in
    one line before any work, nothing written; magnitude prunes the dense MLP, every expert and the
    attention to the target and leaves the router dense."""
    folder = moe_folder(tmp_path, "llama4_text", **LLAMA4)
    out = tmp_path / "sgpt"
    assert prune_main(["sparsegpt", "--model", folder, "--sparsity", "0.5", "--output", str(out),
                       *FAST, *_texts(tmp_path)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: llama4_text: its experts module") and "prune.py magnitude" in last
    assert not out.exists()
    out = tmp_path / "mag"
    assert prune_main(["magnitude", "--model", folder, "--sparsity", "0.5", "--output", str(out),
                       *FAST, *_texts(tmp_path)]) == 0
    experts = _per_expert(out)
    assert {layer for layer, _ in experts} == {"model.layers.1"} and len(experts) == 4
    assert all(z / n == pytest.approx(0.5, abs=0.01) for z, n in experts.values()), experts
    by_kind = json.loads((out / "report.json").read_text())["sparsity"]["by_kind"]
    assert by_kind["mlp"]["sparsity"] == pytest.approx(0.5, abs=0.01) and by_kind["router"]["pruned_numel"] == 0


def test_a_convolution_kernel_is_no_stack_of_experts(tmp_path):
    """LFM2's short-convolution block holds a 3-D ``Conv1d`` kernel: it is not taken for fused
    experts (no expert calibration, no ``experts`` in the report); the attention and MLP layers of
    both kinds of block are pruned, the kernel listed as left dense (``other``)."""
    folder = moe_folder(tmp_path, "lfm2", **LFM2)
    out = tmp_path / "out"
    assert prune_main(["sparsegpt", "--model", folder, "--sparsity", "0.5", "--output", str(out),
                       *FAST, *_texts(tmp_path)]) == 0
    sparsity = json.loads((out / "report.json").read_text())["sparsity"]
    assert "experts" not in sparsity["by_kind"] and "experts" not in sparsity
    assert sparsity["by_kind"]["attention"]["sparsity"] == pytest.approx(0.5, abs=0.01)
    assert sparsity["by_kind"]["mlp"]["sparsity"] == pytest.approx(0.5, abs=0.01)
    conv = [d for d in sparsity["left_dense"] if d["parameter"].endswith("conv.conv.weight")]
    assert len(conv) == 1 and conv[0]["kind"] == "other"
    written = load_file(str(out / "model.safetensors"))
    assert float((written["model.layers.0.conv.in_proj.weight"] == 0).float().mean()) == pytest.approx(0.5, abs=0.01)
