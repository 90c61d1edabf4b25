"""Pruned and quantized LM folders (``--quantize w4a16 | w8a16``), measured after the round trip.

- The quantized layers are compressed-tensors ``pack-quantized`` (symmetric int4 / int8 per group,
  zero point 0): a pruned zero stays exactly zero, and they take at most 0.30x their bfloat16 bytes.
- Plain transformers in a fresh process (no fairprune import) loads the folder and gives the logits
  fairprune's loaded model gives.
- The real command line: the run's figures are those of the folder as loaded back (``evaluate`` on
  the folder measures the same), ``report.json`` has ``quantization`` and ``weights``, the model card
  and the printed lines name the format and bits; every bad option value is one line, nothing written.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers as tf

from fairprune.causal.blocks import Resident
from fairprune.cli.prune import main as prune_main
from fairprune.errors import UserError
from fairprune.hub.quantized import layer_group, load_quantized, save_quantized
from fairprune.pruning.llm import prune_causal_lm
from fairprune.pruning.sparsity import Sparsity
from tiny_models import BUILDERS, TOKENS, builder, tiny_gpt2_folder

FAST = ["--nsamples", "2", "--seqlen", "32", "--device", "cpu", "--quiet", "--dense_cache", "false",
        "--eval_tokens", "256", "--threads", "1"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _pruned(model_type: str, sparsity: str = "0.5") -> torch.nn.Module:
    torch.manual_seed(0)
    model = BUILDERS[model_type]().eval()
    prune_causal_lm(model, "magnitude", Sparsity.parse(sparsity), progress=False)
    return model


def test_layer_group_takes_the_largest_power_of_two_that_divides():
    assert layer_group(1536, 128) == 128
    assert layer_group(576, 128) == 64  # SmolLM2's hidden width
    assert layer_group(96, 128) == 32
    assert layer_group(48, 128) is None  # no power-of-two group of 32 or more divides it
    assert layer_group(48, 16) == 16


@pytest.mark.parametrize("model_type, scheme, bits, group", [
    ("llama", "w4a16", 4, 64), ("qwen2", "w4a16", 4, 64), ("llama", "w8a16", 8, 64),
    ("llama96", "w4a16", 4, 32),  # inputs 96 and 256 wide: one group size for all, 32 (SmolLM2's 576 and 1536: 64)
])
def test_pruned_zeros_stay_zero_and_the_layers_shrink(model_type, scheme, bits, group, tmp_path):
    if model_type == "llama96":
        torch.manual_seed(0)
        model = builder("llama", hidden_size=96, intermediate_size=256)().eval()
        prune_causal_lm(model, "magnitude", Sparsity.parse("0.5"), progress=False)
    else:
        model = _pruned(model_type)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    facts = save_quantized(model, tmp_path / "q", scheme, 128, layers=Resident(model).layers())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the float model is left as it was
    quant = facts["quantization"]
    assert facts["format"] == quant["format"] == "pack-quantized" and quant["bits"] == bits
    assert quant["group_sizes"] == {str(group): 14}
    assert quant["quantized_layers"] == 14 and facts["dtype"] == "bfloat16"
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    assert config["ignore"] == ["lm_head"]
    for group in config["config_groups"].values():
        assert group["weights"]["symmetric"] and group["weights"]["num_bits"] == bits
    limit = 0.30 if bits == 4 else 0.55
    assert quant["layer_ratio"] <= limit and facts["ratio"] < 1
    loaded = load_quantized(tmp_path / "q", torch.float32)
    for name, module in model.named_modules():
        if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
            got = loaded.get_submodule(name).weight
            zeros = module.weight == 0
            assert bool((got[zeros] == 0).all()), name  # every pruned zero still zero
            largest = float(module.weight.detach().abs().max())
            # within half a step of the grid, plus bfloat16's rounding of the weight, the scale and the result
            bound = largest / (2 ** bits - 1) + largest * 2 ** -7
            assert float((got - module.weight).detach().abs().max()) <= bound, name
    assert quant["zero_fraction"] >= 0.5


def test_plain_transformers_in_a_fresh_process_gives_fairprunes_logits(tmp_path):
    model = _pruned("llama")
    save_quantized(model, tmp_path / "q", "w4a16", 128, layers=Resident(model).layers())
    ids = [[5, 17, 3, 60, 42, 8, 11, 90, 2, 33]]
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, CompressedTensorsConfig\n"
        "torch.set_num_threads(1)  # as this process: the same summation order, so equal logits bit for bit\n"
        f"folder, ids = {str(tmp_path / 'q')!r}, torch.tensor({ids})\n"
        "plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()\n"
        "dequantized = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,\n"
        "    quantization_config=CompressedTensorsConfig(dequantize=True)).eval()\n"
        "with torch.no_grad():\n"
        f"    torch.save([plain(ids).logits, dequantized(ids).logits], {str(tmp_path / 'plain.pt')!r})\n"
        "assert not any(name.startswith('fairprune') for name in sys.modules), 'fairprune was imported'\n")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, timeout=300)
    plain, dequantized = torch.load(tmp_path / "plain.pt")
    with torch.no_grad():
        ours = load_quantized(tmp_path / "q", torch.float32)(torch.tensor(ids)).logits
        reference = model(torch.tensor(ids)).logits
    assert torch.equal(dequantized, ours)  # the model fairprune measures is the one transformers loads
    # the default load decompresses each layer as it runs, without the 16-bit rounding: within it
    assert torch.allclose(plain, ours, atol=1e-2)
    assert float((ours - reference).abs().max()) < 0.1 * float(reference.abs().max())  # still the pruned model


def test_a_conv1d_model_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match="Conv1D, not a Linear"):
        gpt2 = _pruned("gpt2")
        save_quantized(gpt2, tmp_path / "q", "w4a16", layers=Resident(gpt2).layers())


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A tiny Llama with a BPE tokenizer, saved as a model folder, and an evaluation text."""
    from fairprune.data.text import lm_corpus, train_bpe_tokenizer

    root = tmp_path_factory.mktemp("qlm")
    corpus = lm_corpus(train_docs=40, validation_docs=6, seed=3)
    tokenizer = train_bpe_tokenizer(corpus.train, 300, root / "tok")
    torch.manual_seed(0)
    fields = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, vocab_size=len(tokenizer), **TOKENS)
    tf.LlamaForCausalLM(tf.LlamaConfig(**fields)).save_pretrained(root / "dense")
    tokenizer.save_pretrained(root / "dense")
    (root / "eval.txt").write_text(corpus.validation)
    return root


def test_the_command_measures_the_folder_as_loaded_back(llama_folder, tmp_path, capsys):
    out = tmp_path / "sgpt_q4"
    texts = ["--eval_text", str(llama_folder / "eval.txt")]
    assert prune_main(["sparsegpt", "--model", str(llama_folder / "dense"), "--sparsity", "0.5", "--quantize", "w4a16",
                       "--output", str(out), *FAST, *texts]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "Compressing model" not in captured.err + printed  # --quiet: compressed-tensors' bars too
    assert "Applying quantization config" not in captured.err + printed
    assert "[sparsegpt + w4a16]" in printed and "pack-quantized w4a16: 4-bit, groups of 64" in printed
    report = json.loads((out / "report.json").read_text())
    quant = report["quantization"]
    assert quant["scheme"] == "w4a16" and quant["bits"] == 4 and quant["group_size"] == 128
    assert quant["format"] == "pack-quantized" and quant["quantized_layers"] == 14
    weights = report["weights"]
    assert weights["format"] == "pack-quantized" and weights["dtype"] == "bfloat16"
    params = sum(p.numel() for p in tf.AutoModelForCausalLM.from_pretrained(llama_folder / "dense").parameters())
    assert weights["dense_bytes"] == 2 * params  # the dense model in bfloat16
    assert weights["file_bytes"] == (out / "model.safetensors").stat().st_size
    assert "quantization" not in weights and quant["layer_ratio"] <= 0.30
    card = (out / "README.md").read_text()
    assert "Quantized weights: w4a16" in card and "pack-quantized" in card and "4-bit" in card
    # The figures are the folder's: evaluate on the folder (plain from_pretrained) measures the same.
    assert prune_main(["evaluate", "--model", str(out), "--output", str(tmp_path / "eval"), *FAST, *texts]) == 0
    evaluated = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert evaluated["metrics"]["perplexity"] == pytest.approx(report["metrics"]["perplexity"], rel=1e-6)
    assert evaluated["metrics"]["stereotype_score"] == report["metrics"]["stereotype_score"]
    assert "ci" in report and "paired" in report  # intervals and the pairing against the dense model, as ever
    from test_docs import _data_names, _documented, _report_keys

    missing = {where for where, key in _report_keys(report, _data_names(report)) if key not in _documented()}
    assert not missing, f"report.json keys not described in docs/outputs.md: {sorted(missing)}"


@pytest.mark.parametrize("extra, message", [
    (["--quantize", "w3a16"], "--quantize 'w3a16' is not one of none, w4a16, w8a16, w4a16-gptq, w8a16-gptq"),
    (["--quantize", "w4a16", "--quant_group_size", "100"], "--quant_group_size must be a power of two"),
    (["--quantize", "w4a16", "--save_format", "compressed"], "does not combine with --save_format compressed"),
    (["--quantize", "w4a16-gptq", "--quant_group_size", "12"], "--quant_group_size must be a power of two"),
])
def test_bad_option_values_are_one_line(llama_folder, tmp_path, capsys, extra, message):
    out = tmp_path / "x"
    code = prune_main(["magnitude", "--model", str(llama_folder / "dense"), "--output", str(out), *FAST, *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_compare_adds_a_pruned_and_quantized_row_paired_with_the_pruned_one(llama_folder, tmp_path):
    import pandas as pd

    out = tmp_path / "c"
    assert prune_main(["compare", "--model", str(llama_folder / "dense"), "--methods", "[magnitude, wanda]",
                       "--sparsities", '["0.5"]', "--quantize", "w4a16", "--quantize_methods", "[magnitude]",
                       "--output", str(out), *FAST, "--eval_text", str(llama_folder / "eval.txt")]) == 0
    table = pd.read_csv(out / "comparison.csv")
    assert list(table["method"]) == ["dense", "magnitude", "magnitude + w4a16", "wanda"]  # wanda: no quantized row
    pruned = json.loads((out / "magnitude_0.5" / "report.json").read_text())
    quantized = json.loads((out / "magnitude_0.5_w4a16" / "report.json").read_text())
    assert "quantization" not in pruned and quantized["quantization"]["bits"] == 4
    assert pruned["achieved_sparsity"] == quantized["achieved_sparsity"]  # the same pruning, then quantized
    row = table[table["method"] == "magnitude + w4a16"].iloc[0]
    assert row["perplexity"] == pytest.approx(quantized["metrics"]["perplexity"])
    assert pd.notna(row["perplexity_ratio_diff"])  # paired with the baseline, the pruned float row
    assert row["weights_mb"] < table[table["method"] == "magnitude"].iloc[0]["weights_mb"] * 0.5


def test_compare_quantizes_the_float_rows_model_without_pruning_again(llama_folder, tmp_path):
    """The round-to-nearest row reuses its float row's prune: the folder it writes holds, bit for
    bit, what the single command (prune, then quantize) writes, and its report says where the
    prune came from."""
    from safetensors.torch import load_file

    texts = ["--eval_text", str(llama_folder / "eval.txt")]
    out = tmp_path / "c"
    assert prune_main(["compare", "--model", str(llama_folder / "dense"), "--methods", "[sparsegpt]",
                       "--sparsities", '["0.5"]', "--quantize", "w4a16", "--output", str(out), *FAST, *texts]) == 0
    assert prune_main(["sparsegpt", "--model", str(llama_folder / "dense"), "--sparsity", "0.5", "--quantize", "w4a16",
                       "--output", str(tmp_path / "single"), *FAST, *texts]) == 0
    reused, single = load_file(out / "sparsegpt_0.5_w4a16" / "model.safetensors"), load_file(tmp_path / "single" / "model.safetensors")
    assert reused.keys() == single.keys() and all(torch.equal(reused[k], single[k]) for k in reused)
    report = json.loads((out / "sparsegpt_0.5_w4a16" / "report.json").read_text())
    pruned = json.loads((out / "sparsegpt_0.5" / "report.json").read_text())
    assert report["pruned_from"] == str(out / "sparsegpt_0.5") and "pruned_from" not in pruned
    assert report["seconds"]["prune"] == 0.0 and report["seconds"]["solve"] == 0.0 and report["seconds"]["quantize"] > 0
    assert report["calibration"] == pruned["calibration"] and report["sparsity"]["solver_achieved"] == pruned["achieved_sparsity"]
    # as written: the pruned zeros and the small weights the 4-bit grid rounds to zero
    assert report["achieved_sparsity"] >= pruned["achieved_sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert report["metrics"] == pytest.approx(json.loads((tmp_path / "single" / "report.json").read_text())["metrics"])
    assert (out / "sparsegpt_0.5_w4a16" / "sparsity.csv").read_text() == (out / "sparsegpt_0.5" / "sparsity.csv").read_text()
    from test_docs import _data_names, _documented, _report_keys

    missing = {where for where, key in _report_keys(report, _data_names(report)) if key not in _documented()}
    assert not missing, f"report.json keys not described in docs/outputs.md: {sorted(missing)}"


def test_a_gpt2_model_is_refused_before_any_work(tmp_path, capsys):
    tiny_gpt2_folder(tmp_path)
    out = tmp_path / "x"
    code = prune_main(["magnitude", "--model", str(tmp_path / "dense"), "--quantize", "w4a16", "--output", str(out),
                       *FAST, "--eval_text", str(tmp_path / "eval.txt")])
    err = capsys.readouterr()
    assert code == 2 and "Conv1D, not a Linear" in err.err and len(err.err.strip().splitlines()) == 1
    assert "measuring" not in err.out and not out.exists()


@pytest.mark.parametrize("method, scheme", [("sparsegpt", "w4a16"), ("wanda", "w4a16-gptq")])
def test_streamed_writes_the_files_memory_writes_and_measures_them_as_loaded_back(llama_folder, tmp_path, method,
                                                                                  scheme):
    from safetensors.torch import load_file

    texts = ["--eval_text", str(llama_folder / "eval.txt")]
    reports = {}
    for stream in ("false", "true"):
        out = tmp_path / stream
        assert prune_main([method, "--model", str(llama_folder / "dense"), "--sparsity", "0.5", "--quantize", scheme,
                           "--stream", stream, "--output", str(out), *FAST, *texts]) == 0
        reports[stream] = json.loads((out / "report.json").read_text())
    memory, streamed = load_file(tmp_path / "false" / "model.safetensors"), load_file(tmp_path / "true" / "model.safetensors")
    assert memory.keys() == streamed.keys() and all(torch.equal(memory[k], streamed[k]) for k in memory)
    config = [json.loads((tmp_path / s / "config.json").read_text()) for s in ("false", "true")]
    assert config[0]["quantization_config"] == config[1]["quantization_config"]
    assert config[1]["dtype"] == "bfloat16"
    report = reports["true"]
    assert report["stream"] is True and report["quantization"]["rounding"] == ("gptq" if "gptq" in scheme else "nearest")
    assert report["quantization"]["layer_ratio"] <= 0.30
    for key in ("layer_bytes", "layer_dense_bytes", "zero_fraction"):
        assert report["quantization"][key] == reports["false"]["quantization"][key]
    assert report["weights"]["dense_bytes"] == reports["false"]["weights"]["dense_bytes"]
    # read streamed, the folder measures what the model in memory loaded back measures
    assert report["metrics"]["perplexity"] == pytest.approx(reports["false"]["metrics"]["perplexity"], rel=1e-5)
    assert report["metrics"]["stereotype_score"] == reports["false"]["metrics"]["stereotype_score"]
    # evaluate, reading the folder streamed, measures the same
    assert prune_main(["evaluate", "--model", str(tmp_path / "true"), "--output", str(tmp_path / "eval"), "--stream",
                       "true", *FAST, *texts]) == 0
    evaluated = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert evaluated["metrics"]["perplexity"] == pytest.approx(report["metrics"]["perplexity"], rel=1e-5)


def test_a_quantized_run_under_torchrun_measures_the_loaded_folder_on_every_rank(llama_folder, tmp_path, one_thread):
    """``--quantize w4a16`` in memory on two ranks: rank 0 writes the folder, and every rank
    measures its share of the windows and pairs on the model loaded back from those files, so the
    figures are one process's (a rank measuring its float model would move them)."""
    from test_torchrun import finish, torchrun

    run = ["sparsegpt", "--model", str(llama_folder / "dense"), "--sparsity", "0.5", "--quantize", "w4a16", *FAST,
           "--eval_text", str(llama_folder / "eval.txt")]
    finish(torchrun([*run, "--output", "A"], tmp_path / "a"))
    assert prune_main([*run, "--output", str(tmp_path / "b" / "B")]) == 0
    two, one = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("a/A", "b/B"))
    assert two["quantization"] == one["quantization"]
    assert two["metrics"] == one["metrics"] and two["ci"] == one["ci"] and two["paired"] == one["paired"]
    float_run = ["sparsegpt", "--model", str(llama_folder / "dense"), "--sparsity", "0.5", *FAST,
                 "--eval_text", str(llama_folder / "eval.txt"), "--output", str(tmp_path / "f")]
    assert prune_main(float_run) == 0  # the figures the quantized model is measured apart from
    assert json.loads((tmp_path / "f" / "report.json").read_text())["metrics"]["perplexity"] != one["metrics"]["perplexity"]
