"""Compressed LM checkpoints (``--save_format compressed``) and ``--dtype``.

- A pruned model written in compressed-tensors' sparse layouts (sparse-bitmask at 50 %, sparse-24-bitmask
  at 2:4, sparse-bitmask with a note where 2:4 runs down a stored column or the pattern is another N:M)
  reloads bit for bit, in its dtype, and its weight files are smaller than the dense ones.
- The stored tensors are compressed-tensors' layout: the names, shapes and dtypes its sparse
  compressors wrote, and a sparsity config its registry accepts.
- A bfloat16 model is solved in float32 inside each layer and stays bfloat16.
- The real command line: magnitude at 50 % with ``--save_format compressed --dtype bfloat16`` writes the
  same weights as the dense save, a report with the bytes, and a folder ``evaluate`` measures the same;
  compare gets a ``weights_mb`` column; a bad value is one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
import transformers as tf

from fairprune.causal.blocks import Resident
from fairprune.cli.prune import main as prune_main
from fairprune.errors import UserError
from fairprune.hub import load_model
from fairprune.hub.compressed import (
    SPARSE_24,
    SPARSE_BITMASK,
    choose_format,
    compress_tensor,
    decompress_tensor,
    dense_weight_bytes,
    save_weights,
    weight_file_bytes,
)
from fairprune.pruning.llm import prune_causal_lm
from fairprune.pruning.sparsity import Sparsity
from tiny_models import BUILDERS, tiny_gpt2_folder

FAST = ["--nsamples", "2", "--seqlen", "32", "--device", "cpu", "--quiet", "--dense_cache", "false",
        "--eval_tokens", "256", "--threads", "1"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits (so -0.0 and 0.0 differ)."""
    return tensor.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def _assert_bit_identical(loaded: torch.nn.Module, reference: torch.nn.Module) -> None:
    got, want = loaded.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype, key
        assert torch.equal(_bits(got[key]), _bits(tensor)), key


def _pruned(model_type: str, sparsity: str, dtype=torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(0)
    model = BUILDERS[model_type]().to(dtype).eval()
    prune_causal_lm(model, "magnitude", Sparsity.parse(sparsity), progress=False)
    return model


@pytest.mark.parametrize("model_type, sparsity, fmt, noted", [
    ("llama", "0.5", SPARSE_BITMASK, False),
    ("llama", "2:4", SPARSE_24, False),
    ("gpt2", "2:4", SPARSE_BITMASK, True),  # Conv1D stores [in, out]: the 2:4 groups run down its columns
    ("llama", "4:8", SPARSE_BITMASK, True),  # compressed-tensors has a dedicated layout for 2:4 only
    ("llama", "1:4", SPARSE_BITMASK, True),  # one zero in four: three stored entries per group
])
def test_compressed_save_reloads_bit_identical_and_is_smaller(model_type, sparsity, fmt, noted, tmp_path):
    model = _pruned(model_type, sparsity)
    facts = save_weights(model, tmp_path / "c", "compressed", Sparsity.parse(sparsity).nm, Resident(model).layers())
    assert facts["format"] == fmt and facts["save_format"] == "compressed" and facts["dtype"] == "bfloat16"
    assert (facts["note"] is not None) == noted
    assert facts["compressed_layers"] == len(Resident(model).layers())
    loaded = load_model(str(tmp_path / "c"))
    assert type(loaded) is type(model)
    _assert_bit_identical(loaded, model)
    dense = save_weights(model, tmp_path / "d", "dense")
    # It computes what the dense folder computes, loaded the plain way (the same buffers built at load).
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, tf.AutoModelForCausalLM.from_pretrained(tmp_path / "d").eval()(ids).logits)
    assert facts["dense_bytes"] == dense["dense_bytes"] == dense_weight_bytes(model)
    assert facts["file_bytes"] == weight_file_bytes(tmp_path / "c") < dense["file_bytes"] == weight_file_bytes(tmp_path / "d")
    assert facts["ratio"] == pytest.approx(facts["file_bytes"] / facts["dense_bytes"])
    assert 1.0 <= dense["ratio"] < 1.05  # the dense files: the tensors plus the safetensors header
    # A float32 load of the bf16 folder holds the same values.
    widened = load_model(str(tmp_path / "c"), dtype="float32")
    assert next(widened.parameters()).dtype == torch.float32
    assert all(torch.equal(a.float(), b) for a, b in zip(model.state_dict().values(), widened.state_dict().values()))


def test_a_pattern_of_fewer_zeros_than_half_is_recognised_as_its_pattern():
    """1:4 (one zero in every four inputs) keeps three entries per group: the folder names the
    pattern, and says why it is stored as a bitmask, not that the groups run another way."""
    model = _pruned("llama", "1:4")
    weights = {name: module.weight.detach() for name, module in Resident(model).layers().items()}
    fmt, structure, note = choose_format(weights, (1, 4))
    assert (fmt, structure) == (SPARSE_BITMASK, "1:4") and "2:4 only" in note
    assert choose_format(weights, (2, 4))[1] == "unstructured"  # three stored in four is not 2:4


def test_the_folder_holds_compressed_tensors_layout(tmp_path):
    from compressed_tensors.config import SparsityCompressionConfig
    from safetensors import safe_open

    model = _pruned("llama", "2:4")
    save_weights(model, tmp_path / "24", "compressed", (2, 4), Resident(model).layers())
    config = json.loads((tmp_path / "24" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    sparsity = config["sparsity_config"]
    assert SparsityCompressionConfig.load_from_registry(sparsity["format"], **sparsity).format == SPARSE_24
    assert sparsity["targets"] == ["Linear"] and sparsity["ignore"] == ["lm_head"] and sparsity["sparsity_structure"] == "2:4"
    weight = model.model.layers[0].mlp.down_proj.weight.detach()
    rows, cols = weight.shape
    with safe_open(str(tmp_path / "24" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        prefix = "model.layers.0.mlp.down_proj"
        assert f"{prefix}.weight" not in keys and "model.embed_tokens.weight" in keys and "lm_head.weight" in keys
        assert f.get_tensor(f"{prefix}.compressed").shape == (rows, cols // 2)
        assert f.get_tensor(f"{prefix}.compressed").dtype == torch.bfloat16
        assert f.get_tensor(f"{prefix}.bitmask").dtype == torch.uint8 and f.get_tensor(f"{prefix}.bitmask").shape == (rows, cols // 8)
        assert f.get_tensor(f"{prefix}.shape").flatten().tolist() == [rows, cols]

    unstructured = _pruned("llama", "0.5")
    save_weights(unstructured, tmp_path / "u", "compressed", None, Resident(unstructured).layers())
    weight = unstructured.model.layers[1].self_attn.o_proj.weight.detach()
    with safe_open(str(tmp_path / "u" / "model.safetensors"), "pt") as f:
        prefix = "model.layers.1.self_attn.o_proj"
        values, offsets = f.get_tensor(f"{prefix}.compressed"), f.get_tensor(f"{prefix}.row_offsets")
        assert torch.equal(values, weight[weight != 0])
        counts = (weight != 0).sum(-1)
        assert torch.equal(offsets, torch.cumsum(counts, 0) - counts)


def test_negative_zero_and_kept_zeros_come_back_as_they_were():
    weight = torch.tensor([[1.0, 0.0, -0.0, 0.0, 0.0, 0.0, 3.0, -0.0], [0.0, 0.0, 0.0, 0.0, -4.0, 0.0, 0.0, 5.0]],
                          dtype=torch.bfloat16)
    for fmt in (SPARSE_24, SPARSE_BITMASK):
        assert torch.equal(_bits(decompress_tensor(compress_tensor(weight, fmt))), _bits(weight)), fmt
    with pytest.raises(ValueError, match="not 2:4"):  # three entries in a group of 4
        compress_tensor(torch.tensor([[1.0, 2.0, 3.0, 0.0]]), SPARSE_24)


def test_bfloat16_is_solved_in_float32_per_layer_and_stays_bfloat16():
    from fairprune.pruning.sparsegpt import Hessian, sparsegpt_solve

    x = torch.randn(2, 8, 16).to(torch.bfloat16)
    hessian = Hessian(16)
    hessian.add_batch(x)
    assert hessian.value().dtype == torch.float32
    W = torch.randn(4, 16).to(torch.bfloat16)
    assert sparsegpt_solve(W, hessian.value(), Sparsity.parse("0.5")).dtype == torch.float32
    torch.manual_seed(0)
    model = BUILDERS["llama"]().to(torch.bfloat16)
    calib = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    result = prune_causal_lm(model, "sparsegpt", Sparsity.parse("0.5"), calib, progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert result["achieved_sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.fixture(scope="module")
def lm_folders(tmp_path_factory) -> dict:
    """A tiny GPT-2 and a tiny Llama (GQA) folder with one locally trained BPE tokenizer, and short texts."""
    from fairprune.data.text import stereo_pairs

    root = tmp_path_factory.mktemp("lm")
    tiny_gpt2_folder(root)
    tokenizer = tf.AutoTokenizer.from_pretrained(root / "dense")
    torch.manual_seed(0)
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                               num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=64,
                                               bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id))
    llama.save_pretrained(root / "llama")
    tokenizer.save_pretrained(root / "llama")
    rows = ["sent_more,sent_less,stereo_antistereo"] + [f'"{a}","{b}",stereo' for a, b in stereo_pairs()[::30]]
    (root / "pairs.csv").write_text("\n".join(rows) + "\n")
    return {"gpt2": root / "dense", "llama": root / "llama",
            "texts": ["--eval_text", str(root / "eval.txt"), "--calib_text", str(root / "eval.txt"),
                      "--pairs", str(root / "pairs.csv")]}


def test_cli_magnitude_compressed_bfloat16(lm_folders, tmp_path):
    base = ["magnitude", "--model", str(lm_folders["gpt2"]), "--sparsity", "0.5", "--dtype", "bfloat16",
            *lm_folders["texts"], *FAST]
    assert prune_main([*base, "--save_format", "compressed", "--output", str(tmp_path / "c")]) == 0
    assert prune_main([*base, "--output", str(tmp_path / "d")]) == 0
    report = json.loads((tmp_path / "c" / "report.json").read_text())
    dense_report = json.loads((tmp_path / "d" / "report.json").read_text())
    weights = report["weights"]
    assert weights["save_format"] == "compressed" and weights["dtype"] == "bfloat16" and weights["format"] == SPARSE_BITMASK
    assert weights["file_bytes"] == weight_file_bytes(tmp_path / "c") < dense_report["weights"]["file_bytes"]
    assert weights["dense_bytes"] == dense_report["weights"]["dense_bytes"]
    assert weights["ratio"] < 0.9
    assert dense_report["weights"]["save_format"] == "dense" and dense_report["weights"]["dtype"] == "bfloat16"
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    # The compressed folder holds the dense run's weights, bit for bit, and measures the same.
    compressed, dense = load_model(str(tmp_path / "c")), tf.AutoModelForCausalLM.from_pretrained(tmp_path / "d")
    _assert_bit_identical(compressed, dense)
    assert report["metrics"]["perplexity"] == dense_report["metrics"]["perplexity"]
    assert prune_main(["evaluate", "--model", str(tmp_path / "c"), "--dtype", "bfloat16", "--output", str(tmp_path / "e"),
                       *lm_folders["texts"], *FAST]) == 0
    evaluated = json.loads((tmp_path / "e" / "report.json").read_text())
    assert evaluated["metrics"]["perplexity"] == pytest.approx(report["metrics"]["perplexity"], rel=1e-6)
    assert evaluated["achieved_sparsity"] == pytest.approx(report["achieved_sparsity"])
    assert "load_model" in (tmp_path / "c" / "README.md").read_text()


def test_cli_compare_has_a_weights_column(lm_folders, tmp_path):
    assert prune_main(["compare", "--model", str(lm_folders["llama"]), "--methods", "[magnitude]",
                       "--sparsities", '["0.5", "2:4"]', "--save_format", "compressed", "--dtype", "bfloat16",
                       "--output", str(tmp_path), *lm_folders["texts"], *FAST]) == 0
    table = pd.read_csv(tmp_path / "comparison.csv").set_index("sparsity")
    dense_mb = table.loc["0", "weights_mb"]
    assert table.loc["0.5", "weights_mb"] < dense_mb and table.loc["2:4", "weights_mb"] < dense_mb
    report = json.loads((tmp_path / "magnitude_2of4" / "report.json").read_text())
    assert report["weights"]["format"] == SPARSE_24
    assert report["weights"]["dense_bytes"] == pytest.approx(dense_mb * 1e6)
    assert "weights_mb" in (tmp_path / "comparison.md").read_text()


@pytest.mark.parametrize("args, needle", [
    (["magnitude", "--save_format", "zip"], "--save_format 'zip' is not one of dense, compressed"),
    (["magnitude", "--dtype", "float64"], "--dtype 'float64' is not one of float32, bfloat16, float16"),
    (["compare", "--methods", "[fasp]", "--alphas", "[0.1]", "--save_format", "compressed"], "applies to weight pruning"),
])
def test_bad_values_are_one_line(args, needle, lm_folders, tmp_path, capsys):
    assert prune_main([*args, "--model", str(lm_folders["gpt2"]), "--output", str(tmp_path / "x"), *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and needle in err[-1], err[-3:]
    assert not any("Traceback" in line for line in err)
    assert not (tmp_path / "x" / "report.json").exists()


def test_library_errors_are_user_errors(tmp_path):
    from fairprune.hub.compressed import check_save_format, decompress_state_dict, torch_dtype
    from fairprune.pruning.options import LMOptions

    with pytest.raises(UserError, match="--save_format"):
        LMOptions(model="m", save_format="sparse")
    with pytest.raises(UserError, match="--save_format"):
        check_save_format("bitmask")
    with pytest.raises(UserError, match="--dtype"):
        torch_dtype("int8")
    weight = torch.tensor([[1.0, 0.0, 0.0, 2.0]])
    parts = {f"m.{k}": v for k, v in compress_tensor(weight, SPARSE_BITMASK).items()}
    del parts["m.row_offsets"]
    with pytest.raises(UserError, match="lacks row_offsets"):
        decompress_state_dict(parts, SPARSE_BITMASK)


def test_a_folder_that_does_not_match_its_model_is_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    model = _pruned("llama", "0.5")
    save_weights(model, tmp_path / "c", "compressed", None, Resident(model).layers())
    state = load_file(tmp_path / "c" / "model.safetensors")
    del state["model.norm.weight"]
    save_file(state, tmp_path / "c" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="does not match its model class"):
        load_model(str(tmp_path / "c"))


def test_dense_save_format_writes_what_save_pretrained_writes(tmp_path):
    model = _pruned("gpt2", "0.5", dtype=torch.float32)
    facts = save_weights(model, tmp_path / "d", "dense")
    model.save_pretrained(tmp_path / "plain")
    assert facts["format"] == "dense" and facts["dtype"] == "float32"
    assert facts["file_bytes"] == weight_file_bytes(tmp_path / "plain")
    assert Path(tmp_path / "d" / "model.safetensors").read_bytes() == Path(tmp_path / "plain" / "model.safetensors").read_bytes()


def test_post_training_callback_writes_a_compressed_folder(tmp_path):
    from fairprune.callbacks.post_training import PostTrainingPruning
    from fairprune.cli.train import main as train_main

    with pytest.raises(UserError, match="--save_format"):
        PostTrainingPruning(save_format="zip")
    with pytest.raises(UserError, match="applies to weight pruning"):
        PostTrainingPruning(method="fasp", save_format="compressed")
    root = Path(__file__).resolve().parents[1]
    tiny = ["--data.corpus_docs", "150", "--data.seqlen", "32", "--data.batch_size", "8", "--data.bpe_vocab_size", "400",
            "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
            "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false"]
    gpt2 = '{"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 64}'
    assert train_main(["fit", "--config", str(root / "configs/lm/tiny_gpt2_sparsegpt.yaml"), *tiny,
                       "--model.init_args.config", gpt2, "--trainer.logger.init_args.save_dir", str(tmp_path),
                       "--trainer.callbacks.init_args.calibration.nsamples", "2",
                       "--trainer.callbacks.init_args.calibration.seqlen", "32",
                       "--trainer.callbacks.init_args.calibration.device", "cpu",
                       "--trainer.callbacks.init_args.calibration.eval_tokens", "64",
                       "--trainer.callbacks.init_args.save_format", "compressed", "--threads", "1"]) == 0
    out = tmp_path / "lm" / "tiny_gpt2_sparsegpt" / "pruned-sparsegpt"
    report = json.loads((out / "report.json").read_text())
    assert report["weights"]["save_format"] == "compressed" and report["weights"]["format"] == SPARSE_BITMASK
    model = load_model(str(out))
    assert report["achieved_sparsity"] == pytest.approx(0.5, abs=1e-6)
    zeros = torch.cat([(layer.weight == 0).flatten() for layer in Resident(model).layers().values()])
    assert zeros.float().mean().item() == pytest.approx(0.5, abs=1e-6)
