"""Every causal family read from the model itself (:mod:`fairprune.causal.structure`), checked on
tiny random models of ten families built from their transformers configs, offline:

- discovery finds what the hand-written table used to state (GPT-2, GPT-Neo, OPT, Llama);
- the blocks run one by one, as the pipeline runs them, give the model's own logits bit for bit,
  in memory and streamed from disk, with right padding; Gemma's sliding-window and global layers
  each get their own arguments, and block 0's would be wrong for the global one;
- SparseGPT on the first layer equals the plain OBS oracle fed the layer's inputs from the
  model's own forward;
- streamed pruning equals in-memory pruning for SparseGPT, Debias-SparseGPT, Wanda and magnitude;
- the command line prunes (``--stream true`` and ``false``) and evaluates ``--tasks`` on each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fairprune.causal.blocks import Resident
from fairprune.causal.families import family_of, linear_weight
from fairprune.causal.pipeline import CalibInput, capture, through
from fairprune.causal.streamed import StreamedModel
from fairprune.cli.prune import main as prune_main
from fairprune.hub.shards import ShardWriter
from fairprune.pruning.llm import prune_causal_lm
from fairprune.pruning.sparsity import Sparsity
from test_llm_pruning import obs_oracle
from tiny_models import BUILDERS, VOCAB, builder, write_gguf

pytestmark = pytest.mark.usefixtures("one_thread")

CAUSAL = ["gpt2", "gpt_neo", "opt", "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"]
NEW = ["qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"]
LLAMA = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# What the table stated by hand before discovery: (front, blocks, linears, tail).
TABLE = {
    "gpt2": (("wte", "wpe"), "h", ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"), ("ln_f",)),
    "gpt_neo": (("wte", "wpe"), "h", ("attn.attention.q_proj", "attn.attention.k_proj", "attn.attention.v_proj",
                                      "attn.attention.out_proj", "mlp.c_fc", "mlp.c_proj"), ("ln_f",)),
    "opt": (("decoder.embed_tokens", "decoder.embed_positions", "decoder.project_in"), "decoder.layers",
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "fc1", "fc2"),
            ("decoder.final_layer_norm", "decoder.project_out")),
    "llama": (("embed_tokens", "rotary_emb"), "layers", LLAMA, ("norm",)),
    "mistral": (("embed_tokens", "rotary_emb"), "layers", LLAMA, ("norm",)),
}


def build(model_type: str):
    torch.manual_seed(0)
    return BUILDERS[model_type]().eval()


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (2, 12), generator=g)
    attention = torch.ones(2, 12, dtype=torch.long)
    attention[1, 9:] = 0
    return ids, attention


@pytest.mark.parametrize("model_type", sorted(TABLE))
def test_discovery_finds_what_the_table_stated(model_type):
    family = family_of(build(model_type))
    assert (family.front, family.blocks, family.linears, family.tail) == TABLE[model_type]
    assert family.returns_tuple == (model_type == "gpt_neo")  # GPT-Neo's blocks still return tuples


def _blockwise_logits(blocks, ids, attention) -> torch.Tensor:
    batches = capture(blocks, [CalibInput(ids, attention=attention)], "cpu")
    for index, block in enumerate(blocks.blocks):
        with blocks.loaded(block):
            through(index, block, batches)
    hidden = batches[0].hidden
    tails = blocks.tail_modules()
    with blocks.loaded(*tails):
        for module in tails[:-1]:
            hidden = module(hidden)
        return blocks.logits(hidden)


@pytest.mark.parametrize("model_type", CAUSAL)
def test_blocks_one_by_one_give_the_models_own_logits(model_type, tmp_path):
    model = build(model_type)
    ids, attention = padded_batch()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=attention).logits
        got = _blockwise_logits(Resident(model), ids, attention)
        model.save_pretrained(tmp_path)
        streamed = _blockwise_logits(StreamedModel(tmp_path), ids, attention)
    real = attention.bool()
    assert torch.equal(got[real], want[real])
    assert torch.equal(streamed[real], want[real])


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_sliding_and_global_layers_each_get_their_own_arguments(model_type):
    """Layer 0 attends within a window of 4, layer 1 globally: their masks differ, and running
    layer 1 with layer 0's arguments (what a capture at block 0 alone would do) changes its output."""
    model = build(model_type)
    ids, _ = padded_batch()
    blocks = Resident(model)
    with torch.no_grad():
        batch = capture(blocks, [CalibInput(ids)], "cpu")[0]
        first, second = batch.calls
        masks = first.kwargs["attention_mask"], second.kwargs["attention_mask"]
        assert masks[0] is not None and (masks[1] is None or not torch.equal(*masks))  # windowed, then global
        through(0, blocks.blocks[0], [batch])
        after_first = batch.hidden
        through(1, blocks.blocks[1], [batch])
        right = batch.hidden
        batch.hidden, batch.calls = after_first, [first, first]
        through(1, blocks.blocks[1], [batch])
        wrong = batch.hidden
    assert not torch.allclose(right, wrong)


@pytest.mark.parametrize("model_type", CAUSAL)
def test_sparsegpt_first_layer_equals_the_oracle_on_the_models_own_inputs(model_type):
    """The pipeline's calibration of block 0's first layer is the model's own forward: the OBS
    oracle on ``H = 2/n Σ XXᵀ`` of the inputs a forward hook sees gives the pipeline's weights."""
    model = build(model_type)
    family = family_of(model)
    layer = family.block_linears(family.block_list(model)[0])[family.linears[0]]
    ids = torch.randint(1, VOCAB, (4, 16), generator=torch.Generator().manual_seed(5))
    seen = []
    handle = layer.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    x = torch.cat(seen).double()
    hessian = 2 * x.t() @ x / len(ids)
    want = obs_oracle(linear_weight(layer).double().clone(), hessian, 0.5, blocksize=128)
    prune_causal_lm(model, "sparsegpt", Sparsity.parse("0.5"), calib_ids=ids, progress=False)
    got = linear_weight(layer).double()
    assert torch.equal(got == 0, want == 0)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    for model_type in NEW:
        build(model_type).save_pretrained(root / model_type, max_shard_size="100KB")
    return {t: root / t for t in NEW}


@pytest.mark.parametrize("method", ["sparsegpt", "debias-sparsegpt", "wanda", "magnitude"])
@pytest.mark.parametrize("model_type", NEW)
def test_streamed_pruning_equals_in_memory(saved, model_type, method, tmp_path):
    g = torch.Generator().manual_seed(4)
    calib = torch.randint(1, VOCAB, (3, 16), generator=g)
    data = {"pairs": (calib, torch.randint(1, VOCAB, (3, 16), generator=g))} if method == "debias-sparsegpt" else \
        {"calib_ids": calib} if method != "magnitude" else {}
    sparsity = Sparsity.parse("2:4" if method == "wanda" else "0.5")
    reference = AutoModelForCausalLM.from_pretrained(saved[model_type]).eval()
    expected = prune_causal_lm(reference, method, sparsity, progress=False, **data)
    streamed = StreamedModel(saved[model_type])
    writer = ShardWriter(tmp_path, streamed.output_tensors(), total_parameters=streamed.num_parameters())
    result = prune_causal_lm(streamed, method, sparsity, writer=writer, progress=False, **data)
    writer.close()
    streamed.write_model_files(tmp_path)
    assert result["layers"] == expected["layers"]
    got = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    for name, want in reference.state_dict().items():
        assert torch.equal(got[name], want), name


@pytest.fixture(scope="module")
def lm_folders(tmp_path_factory) -> dict[str, Path]:
    """Each new family with a tokenizer trained on the bundled corpus, saved as a user's folder."""
    from fairprune.data.text import lm_corpus, train_bpe_tokenizer

    root = tmp_path_factory.mktemp("family-folders")
    corpus = lm_corpus(train_docs=40, validation_docs=6, seed=3)
    tokenizer = train_bpe_tokenizer(corpus.train, 300, root / "tok")
    (root / "eval.txt").write_text(corpus.validation)
    folders = {}
    for model_type in NEW:
        torch.manual_seed(0)
        eos = tokenizer.eos_token_id
        model = builder(model_type, vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)()
        model.save_pretrained(root / model_type)
        tokenizer.save_pretrained(root / model_type)
        folders[model_type] = root / model_type
    folders["eval"] = root / "eval.txt"
    return folders


@pytest.mark.parametrize("model_type", NEW)
def test_the_command_line_prunes_streams_and_scores_tasks(lm_folders, model_type, tmp_path, monkeypatch):
    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))
    common = ["--model", str(lm_folders[model_type]), "--eval_text", str(lm_folders["eval"]), "--nsamples", "4",
              "--seqlen", "32", "--eval_tokens", "512", "--device", "cpu", "--quiet"]
    tasks = ["--tasks", "[mmlu]", "--limit", "8"]
    assert prune_main(["sparsegpt", *common, "--stream", "true", *tasks, "--output", str(tmp_path / "streamed")]) == 0
    assert prune_main(["sparsegpt", *common, "--stream", "false", "--output", str(tmp_path / "memory")]) == 0
    assert prune_main(["debias-sparsegpt", *common, "--stream", "true", "--output", str(tmp_path / "debias")]) == 0
    assert prune_main(["evaluate", *common, *tasks, "--output", str(tmp_path / "dense")]) == 0
    streamed = json.loads((tmp_path / "streamed" / "report.json").read_text())
    memory = json.loads((tmp_path / "memory" / "report.json").read_text())
    assert streamed["achieved_sparsity"] == memory["achieved_sparsity"] == pytest.approx(0.5)
    assert streamed["metrics"]["perplexity"] == pytest.approx(memory["metrics"]["perplexity"], rel=1e-5)
    assert 0 <= streamed["metrics"]["mmlu/acc"] <= 1
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed")
    assert loaded.config.model_type == model_type
    dense = json.loads((tmp_path / "dense" / "report.json").read_text())
    assert dense["metrics"]["mmlu/acc"] == streamed["reference"]["metrics"]["mmlu/acc"]
    debiased = json.loads((tmp_path / "debias" / "report.json").read_text())
    assert debiased["achieved_sparsity"] == pytest.approx(0.5)


@pytest.mark.parametrize("model_type", ["gemma2", "phi3"])
def test_fasp_removes_heads_of_grouped_and_fused_attention(lm_folders, model_type, tmp_path):
    """Gemma 2 (grouped-query attention, soft-capped logits) and Phi-3 (one fused q/k/v layer):
    FASP scores the heads and the saved model reloads with the chosen heads removed."""
    from fairprune.data.prompts import holistic_prompts

    prompts = holistic_prompts(["gender_and_sex"]).groupby("bucket").head(4)
    prompts.to_csv(tmp_path / "prompts.csv", index=False)
    out = tmp_path / "fasp"
    assert prune_main(["fasp", "--model", str(lm_folders[model_type]), "--gamma", "0.25", "--alpha", "0.25",
                       "--prompts", str(tmp_path / "prompts.csv"), "--max_new_tokens", "2", "--seqlen", "32",
                       "--calib_text", str(lm_folders["eval"]), "--output", str(out), "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert len(report["heads_removed"]) == 2  # 2 layers × 4 heads: ⌊0.25·8⌋
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == model_type


def test_the_override_row_of_the_docs_works(monkeypatch):
    """docs/extending.md's example row, run as written: GPT-J's heads located, its MLP alone pruned."""
    import transformers as tf

    from fairprune.causal import families
    from fairprune.pruning.heads import HeadGates, remove_heads

    text = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    snippet = text.split("## Model families", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    monkeypatch.setattr(families, "FAMILIES", families.FAMILIES)
    exec(compile(snippet, "extending.md", "exec"), {})
    torch.manual_seed(0)
    model = tf.GPTJForCausalLM(tf.GPTJConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, rotary_dim=4,
                                             n_positions=64, bos_token_id=0, eos_token_id=0)).eval()
    family = families.family_of(model)
    assert family.linears == ("mlp.fc_in", "mlp.fc_out") and family.front == ("wte", "rotary_emb")
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))
    gates = HeadGates(model)
    with torch.no_grad(), gates, gates.off([(0, 1)]):
        gated = model(ids).logits
    remove_heads(model, [(0, 1)])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, gated)
    report = prune_causal_lm(model, "sparsegpt", Sparsity.parse("0.5"), calib_ids=ids, progress=False)
    assert sorted(report["layers"]) == ["0.mlp.fc_in", "0.mlp.fc_out", "1.mlp.fc_in", "1.mlp.fc_out"]


def test_a_gguf_file_of_another_architecture_prunes_and_scores_tasks(tmp_path, monkeypatch):
    """A Qwen2 GGUF file (not the packaged SmolLM2): converted once, then pruned by SparseGPT and
    Debias-SparseGPT and measured with --tasks, offline, as the README's commands run it."""
    from fairprune.data.text import lm_corpus, train_bpe_tokenizer

    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))
    corpus = lm_corpus(train_docs=40, validation_docs=6, seed=3)
    tokenizer = train_bpe_tokenizer(corpus.train, 300, tmp_path / "tok")
    (tmp_path / "eval.txt").write_text(corpus.validation)
    eos = tokenizer.eos_token_id
    torch.manual_seed(0)
    model = builder("qwen2", vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                    tie_word_embeddings=False)().eval()
    write_gguf(model, tokenizer, tmp_path / "qwen2-tiny.gguf")
    common = ["--model", str(tmp_path / "qwen2-tiny.gguf"), "--eval_text", str(tmp_path / "eval.txt"), "--nsamples", "4",
              "--seqlen", "32", "--eval_tokens", "512", "--device", "cpu", "--quiet"]
    for method in ("sparsegpt", "debias-sparsegpt"):
        out = tmp_path / method
        assert prune_main([method, *common, "--tasks", "[mmlu]", "--limit", "8", "--output", str(out)]) == 0
        report = json.loads((out / "report.json").read_text())
        assert report["achieved_sparsity"] == pytest.approx(0.5) and 0 <= report["metrics"]["mmlu/acc"] <= 1
    converted = next((tmp_path / "cache" / "models").glob("qwen2-tiny-*"))
    dense = AutoModelForCausalLM.from_pretrained(converted).eval()
    ids = torch.randint(0, len(tokenizer), (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(dense(ids).logits, model(ids).logits)  # the round trip through GGUF is exact in float32


def test_fasp_on_attention_it_cannot_cut_is_one_line_before_any_work(lm_folders, tmp_path, capsys):
    import transformers as tf

    from cli_output import last_error

    torch.manual_seed(0)
    folder = tmp_path / "gptj"
    tf.GPTJForCausalLM(tf.GPTJConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=300, rotary_dim=4, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((lm_folders["qwen2"] / name).read_bytes())
    code = prune_main(["fasp", "--model", str(folder), "--output", str(tmp_path / "out"), "--quiet"])
    assert code == 2
    assert "gptj family's attention was not recognised" in last_error(capsys)
    assert not (tmp_path / "out").exists()
