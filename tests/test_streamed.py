"""Streamed pruning (one block resident) against the in-memory path: the same weights and masks,
the same figures per window and per pair, the folder ``save_pretrained`` writes; the CLI's
``--stream true`` and its errors; and (slow) the memory of a streamed run on a 1.5 GB model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from cli_output import last_error
from fairprune.causal.streamed import StreamedModel
from fairprune.cli.prune import main as prune_main
from fairprune.hub.shards import INDEX, ShardReader, ShardWriter
from fairprune.metrics.language import measure_lm_items, perplexity_of, window_losses
from fairprune.pruning.llm import prune_causal_lm
from fairprune.pruning.sparsity import Sparsity
from tiny_models import BUILDERS, VOCAB, tiny_gpt2_folder

ROOT = Path(__file__).resolve().parents[1]
SEQ = 32


@pytest.fixture(scope="module")
def folders(tmp_path_factory, one_thread) -> dict[str, Path]:
    """A tiny Llama (untied head, several shards and an index), a tiny GPT-2 (head tied to the
    embedding, one file), OPT (an input and output projection around the blocks) and GPT-Neo
    (local-attention blocks), saved by ``save_pretrained``."""
    root = tmp_path_factory.mktemp("streamed")
    shards = {"llama": "100KB", "gpt2": "50GB", "opt": "100KB", "gpt_neo": "50GB"}
    for model_type, shard in shards.items():
        torch.manual_seed(0)
        BUILDERS[model_type]().save_pretrained(root / model_type, max_shard_size=shard)
    assert (root / "llama" / INDEX).is_file() and not (root / "gpt2" / INDEX).is_file()
    return {model_type: root / model_type for model_type in shards}


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory, one_thread) -> Path:
    """A tiny GPT-2 with its own BPE tokenizer (``dense``) and an evaluation text (``eval.txt``)."""
    root = tmp_path_factory.mktemp("tiny-lm")
    tiny_gpt2_folder(root)
    return root


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (4, SEQ), generator=g), torch.randint(0, VOCAB, (300,), generator=g)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    reader = ShardReader(folder)
    return {name: reader.read(name) for name in reader.keys()}


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_writer_writes_what_save_pretrained_writes(folders, model_type, tmp_path):
    """Tensor by tensor, in any order, the writer lays out the files, index and tensors exactly as
    ``save_pretrained`` does (a tied head written once)."""
    sm = StreamedModel(folders[model_type])
    writer = ShardWriter(tmp_path / "streamed", sm.output_tensors(), max_shard_size="100KB",
                         total_parameters=sm.num_parameters())
    for name in reversed(writer.missing()):
        writer.write(name, sm.read_output(name))
    files = writer.close()
    AutoModelForCausalLM.from_pretrained(folders[model_type]).save_pretrained(tmp_path / "reference", max_shard_size="100KB")
    expected = sorted(p.name for p in (tmp_path / "reference").iterdir() if p.name.startswith("model"))
    assert sorted(files) == expected and len(expected) > 2
    assert json.loads((tmp_path / "streamed" / INDEX).read_text()) == json.loads((tmp_path / "reference" / INDEX).read_text())
    for file in expected[:-1]:
        with safe_open(tmp_path / "streamed" / file, "pt") as got, safe_open(tmp_path / "reference" / file, "pt") as want:
            assert got.metadata() == want.metadata() == {"format": "pt"}
            assert sorted(got.keys()) == sorted(want.keys())
            for key in want.keys():
                assert torch.equal(got.get_tensor(key), want.get_tensor(key))
    if model_type == "gpt2":
        assert "lm_head.weight" not in ShardReader(tmp_path / "streamed").keys()


def test_writer_refuses_a_wrong_tensor_and_an_incomplete_checkpoint(tmp_path):
    writer = ShardWriter(tmp_path, {"a": torch.empty(2, 3), "b": torch.empty(4, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="planned"):
        writer.write("a", torch.zeros(3, 2))
    writer.write("a", torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="misses 1 tensor"):
        writer.close()


@pytest.mark.parametrize("model_type, method", [("llama", "sparsegpt"), ("llama", "wanda"), ("gpt2", "sparsegpt"),
                                                ("gpt2", "wanda"), ("opt", "sparsegpt"), ("gpt_neo", "wanda")])
def test_streamed_pruning_equals_in_memory(folders, model_type, method, tmp_path):
    """Same masks and values as ``prune_causal_lm`` on the whole model, the same per-layer
    sparsity, the same per-window NLL (dense and pruned) as ``window_losses``; the output folder
    loads with ``from_pretrained``."""
    calib, ids = _ids()
    sparsity = Sparsity.parse("0.5")
    reference = AutoModelForCausalLM.from_pretrained(folders[model_type]).eval()
    dense_nll, count = window_losses(reference, ids, seqlen=SEQ, batch_size=8)
    expected = prune_causal_lm(reference, method, sparsity, calib, progress=False)
    pruned_nll, _ = window_losses(reference, ids, seqlen=SEQ, batch_size=8)

    sm = StreamedModel(folders[model_type])
    streamed_dense, streamed_count = window_losses(sm, ids, seqlen=SEQ)
    writer = ShardWriter(tmp_path, sm.output_tensors(), max_shard_size="100KB", total_parameters=sm.num_parameters())
    result = prune_causal_lm(sm, method, sparsity, calib, writer=writer, progress=False)
    writer.close()
    sm.write_model_files(tmp_path)
    assert result["layers"] == pytest.approx(expected["layers"], abs=0) and result["achieved_sparsity"] == expected["achieved_sparsity"]
    assert sm.facts()["largest_block_bytes"] == sum(p.numel() * 4 for p in sm.family.block_list(reference)[0].parameters())

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    got = loaded.state_dict()
    for name, want in reference.state_dict().items():
        assert torch.equal(got[name] == 0, want == 0), name
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-7)
    streamed_pruned, _ = window_losses(StreamedModel(tmp_path), ids, seqlen=SEQ)
    assert torch.equal(streamed_count, count)
    np.testing.assert_allclose(streamed_dense.numpy(), dense_nll.numpy(), rtol=1e-6)
    np.testing.assert_allclose(streamed_pruned.numpy(), pruned_nll.numpy(), rtol=1e-6)
    for streamed, in_memory in ((streamed_dense, dense_nll), (streamed_pruned, pruned_nll)):
        assert perplexity_of(streamed, count) == pytest.approx(perplexity_of(in_memory, count), rel=1e-5)


@pytest.mark.parametrize("method", ["magnitude", "debias-sparsegpt"])
def test_streamed_magnitude_and_paired_method_equal_in_memory(folders, method, tmp_path):
    """No calibration at all (magnitude), and aligned pairs with plain text (Debias-SparseGPT's
    paired Hessian): the same weights as the in-memory run."""
    calib, _ = _ids()
    g = torch.Generator().manual_seed(2)
    pairs = (torch.randint(0, VOCAB, (3, 12), generator=g), torch.randint(0, VOCAB, (3, 12), generator=g),
             torch.ones(3, 12, dtype=torch.bool))
    data = {"magnitude": (None, None), "debias-sparsegpt": (calib, pairs)}[method]
    reference = AutoModelForCausalLM.from_pretrained(folders["llama"]).eval()
    prune_causal_lm(reference, method, Sparsity.parse("0.5"), *data, progress=False)
    sm = StreamedModel(folders["llama"])
    writer = ShardWriter(tmp_path, sm.output_tensors())
    prune_causal_lm(sm, method, Sparsity.parse("0.5"), *data, writer=writer, progress=False)
    writer.close()
    got = _tensors(tmp_path)
    for name, want in reference.state_dict().items():
        assert torch.equal(got[name] == 0, want == 0), name
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_streamed_half_precision_equals_in_memory(folders, dtype, tmp_path):
    """Held, run and written in bfloat16 / float16 (the solver in float32 inside each layer): bit
    for bit the model ``prune_causal_lm`` gives when ``from_pretrained`` loads it in that dtype."""
    calib, ids = _ids()
    reference = AutoModelForCausalLM.from_pretrained(folders["llama"], dtype=dtype).eval()
    prune_causal_lm(reference, "sparsegpt", Sparsity.parse("2:4"), calib, progress=False)
    sm = StreamedModel(folders["llama"], dtype)
    writer = ShardWriter(tmp_path, sm.output_tensors())
    prune_causal_lm(sm, "sparsegpt", Sparsity.parse("2:4"), calib, writer=writer, progress=False)
    writer.close()
    sm.write_model_files(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    got = _tensors(tmp_path)
    for name, want in reference.state_dict().items():
        assert got[name].dtype == dtype and torch.equal(got[name], want), name
    nll, count = window_losses(reference, ids, seqlen=SEQ, batch_size=8)
    streamed, _ = window_losses(StreamedModel(tmp_path, dtype), ids, seqlen=SEQ)
    assert perplexity_of(streamed, count) == pytest.approx(perplexity_of(nll, count), rel=1e-5)


def test_streamed_measurement_equals_measure_lm_items(tiny_lm):
    """Perplexity per window and the stereotype outcomes per pair (right-padded sentence batches)
    as the in-memory measurement gives them; small hidden-state budgets give the same items."""
    from fairprune.data.pairs import lm_texts
    from fairprune.hub import load_tokenizer
    from fairprune.metrics.language import LMItems, eval_ids, eval_windows, measure_items, scores_of

    texts = lm_texts(None, str(tiny_lm / "eval.txt"))
    tokenizer = load_tokenizer(str(tiny_lm / "dense"))
    ids = eval_ids(texts.eval_text, tokenizer, 1024)
    model = AutoModelForCausalLM.from_pretrained(tiny_lm / "dense").eval()
    figures, items = measure_lm_items(model, tokenizer, ids, texts.eval_pairs, SEQ, "cpu")
    sm = StreamedModel(tiny_lm / "dense")
    for budget in (512 * 1024 * 1024, 64 * 1024):  # all batches at once; several passes over the blocks
        nll, count, outcomes = measure_items(sm, tokenizer, eval_windows(sm.model, ids, SEQ), texts.eval_pairs,
                                             max_hidden_bytes=budget)
        got = {"perplexity": perplexity_of(nll, count), **scores_of(**outcomes)}
        got_items = LMItems(nll.numpy(), count.numpy(), *(outcomes[k].numpy() for k in ("win", "decided", "anti")))
        assert got["perplexity"] == pytest.approx(figures["perplexity"], rel=1e-6)
        assert {k: v for k, v in got.items() if k != "perplexity" and v == v} == {
            k: v for k, v in figures.items() if k != "perplexity" and v == v}
        np.testing.assert_allclose(got_items.window_nll, items.window_nll, rtol=1e-6)
        for part in ("window_tokens", "pair_win", "pair_decided", "pair_anti"):
            assert np.array_equal(getattr(got_items, part), getattr(items, part)), part


def test_cli_stream_equals_in_memory_run(tiny_lm, tmp_path):
    """``prune.py sparsegpt --stream true`` writes the folder and figures the in-memory run writes,
    takes the dense figures that run cached (the streamed digest is the in-memory one), and
    reports its memory; ``evaluate --stream true`` measures the folder alike."""
    common = ["--eval_text", str(tiny_lm / "eval.txt"), "--nsamples", "4", "--seqlen", str(SEQ), "--eval_tokens", "1024",
              "--device", "cpu", "--threads", "1", "--quiet"]
    dense = ["--model", str(tiny_lm / "dense")]
    assert prune_main(["sparsegpt", *dense, *common, "--output", str(tmp_path / "memory")]) == 0
    assert prune_main(["sparsegpt", *dense, *common, "--stream", "true", "--output", str(tmp_path / "streamed")]) == 0
    memory = json.loads((tmp_path / "memory" / "report.json").read_text())
    streamed = json.loads((tmp_path / "streamed" / "report.json").read_text())
    assert streamed["stream"] is True and streamed["reference"]["from_cache"] is True
    assert streamed["reference"]["metrics"] == memory["reference"]["metrics"]
    assert streamed["metrics"]["perplexity"] == pytest.approx(memory["metrics"]["perplexity"], rel=1e-5)
    assert streamed["metrics"]["stereotype_score"] == memory["metrics"]["stereotype_score"]
    assert streamed["achieved_sparsity"] == memory["achieved_sparsity"]
    assert streamed["weights"]["dense_bytes"] == memory["weights"]["dense_bytes"]
    facts = streamed["memory"]
    assert facts["peak_rss_bytes"] >= facts["peak_rss_at_start_bytes"] > 0
    assert 0 < facts["largest_block_bytes"] <= facts["largest_part_bytes"] < facts["model_bytes"]
    assert (tmp_path / "streamed" / "sparsity.csv").read_text() == (tmp_path / "memory" / "sparsity.csv").read_text()
    names = {p.name for p in (tmp_path / "memory").iterdir()}
    assert names == {p.name for p in (tmp_path / "streamed").iterdir()}
    got, want = _tensors(tmp_path / "streamed"), _tensors(tmp_path / "memory")
    assert got.keys() == want.keys() and all(torch.allclose(got[k], want[k], rtol=1e-6, atol=1e-7) for k in want)
    assert prune_main(["evaluate", *common, "--model", str(tmp_path / "streamed"), "--stream", "true",
                       "--dense_cache", "false", "--output", str(tmp_path / "eval")]) == 0
    evaluated = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert evaluated["metrics"]["perplexity"] == pytest.approx(streamed["metrics"]["perplexity"], rel=1e-9)
    assert evaluated["achieved_sparsity"] == pytest.approx(streamed["achieved_sparsity"], abs=1e-12)


def test_cli_stream_errors_are_one_line(tiny_lm, tmp_path, capsys):
    import shutil

    common = ["--eval_text", str(tiny_lm / "eval.txt"), "--nsamples", "4", "--seqlen", str(SEQ), "--device", "cpu",
              "--quiet", "--stream", "true", "--output", str(tmp_path / "out")]
    legacy = tmp_path / "legacy"  # weights as a pytorch_model.bin only
    shutil.copytree(tiny_lm / "dense", legacy)
    torch.save(AutoModelForCausalLM.from_pretrained(legacy).state_dict(), legacy / "pytorch_model.bin")
    (legacy / "model.safetensors").unlink()
    assert prune_main(["wanda", "--model", str(legacy), *common]) == 2
    assert "--stream true reads safetensors weights" in last_error(capsys)
    assert prune_main(["wanda", "--model", str(tiny_lm / "dense"), "--save_format", "compressed", *common]) == 2
    assert "--save_format dense with --stream true" in last_error(capsys)
    torn = tmp_path / "torn"  # an index naming a shard the folder lacks
    shutil.copytree(tiny_lm / "dense", torn)
    (torn / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {"transformer.wte.weight": "model-00002.safetensors"}}))
    assert prune_main(["sparsegpt", "--model", str(torn), *common]) == 2
    assert "does not hold it" in last_error(capsys)
    assert prune_main(["compare", "--model", str(tiny_lm / "dense"), "--methods", "[wanda]", "--save_format", "compressed",
                       *common]) == 2
    assert "--save_format dense with --stream true" in last_error(capsys)
    for heads in (["fasp"], ["compare", "--methods", "[fasp]", "--alphas", "[0.5]"]):  # head pruning streams too
        assert prune_main([*heads, "--model", str(legacy), *common]) == 2
        assert "--stream true reads safetensors weights" in last_error(capsys)
    assert not (tmp_path / "out" / "report.json").exists()


def test_cli_compare_streamed_equals_in_memory(tiny_lm, tmp_path):
    """``compare --stream true`` gives the in-memory compare's table: every run streamed from disk
    into its own folder, the dense model measured once (its cache then read by every run), the
    intervals and the paired differences on the same windows and pairs."""
    common = ["--model", str(tiny_lm / "dense"), "--eval_text", str(tiny_lm / "eval.txt"), "--nsamples", "4", "--seqlen",
              str(SEQ), "--eval_tokens", "1024", "--device", "cpu", "--threads", "1", "--quiet",
              "--methods", "[magnitude, sparsegpt]", "--sparsities", '[0.5, "2:4"]', "--dense_cache", "false"]
    assert prune_main(["compare", *common, "--output", str(tmp_path / "memory")]) == 0
    assert prune_main(["compare", *common, "--stream", "true", "--output", str(tmp_path / "streamed")]) == 0
    memory = pd.read_csv(tmp_path / "memory" / "comparison.csv")
    streamed = pd.read_csv(tmp_path / "streamed" / "comparison.csv")
    assert list(streamed.columns) == list(memory.columns)
    assert list(streamed["method"]) == list(memory["method"]) == ["dense", "magnitude", "magnitude", "sparsegpt", "sparsegpt"]
    for column in ("achieved_sparsity", "stereotype_score", "weights_mb"):
        assert streamed[column].tolist() == pytest.approx(memory[column].tolist(), rel=1e-9), column
    for column in ("perplexity", "perplexity_ci_low", "perplexity_ci_high", "perplexity_ratio_diff"):
        assert streamed[column].tolist() == pytest.approx(memory[column].tolist(), rel=1e-5, nan_ok=True), column
    for cell in ("magnitude_0.5", "sparsegpt_2of4"):
        report = json.loads((tmp_path / "streamed" / cell / "report.json").read_text())
        assert report["stream"] is True and report["reference"]["from_cache"] is False  # --dense_cache false: measured
    assert json.loads((tmp_path / "streamed" / "report.json").read_text())["stream"] is True


# -- slow: a model far bigger than what a streamed run may hold -----------------------------------
BIG = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=38, num_attention_heads=8, num_key_value_heads=2,
           vocab_size=32000, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
           pad_token_id=1)
# Runs ``-c code`` or a script in the child and prints the peak resident memory of its life (the
# runner bench/streamed_prune.py uses), so child and baseline are measured alike.
RUNNER = ROOT / "bench" / "peak_rss.py"


def _peak_rss(argv: list[str], env: dict[str, str]) -> int:
    """Run ``python argv`` to the end; the peak resident memory of its life in bytes (``ru_maxrss``)."""
    proc = subprocess.run([sys.executable, str(RUNNER), *argv], env=env, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1].startswith("PEAK_RSS_KIB"), (proc.stdout + proc.stderr)[-3000:]
    return int(lines[-1].split()[1]) * 1024


def _write_big_llama(folder: Path) -> int:
    """A random Llama of about 1.5 GB float32 written tensor by tensor (one tensor in memory at a
    time) with a small BPE tokenizer; returns the weight bytes on disk."""
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    from fairprune.data.text import lm_corpus, train_bpe_tokenizer

    config = LlamaConfig(**BIG)
    with init_empty_weights():
        skeleton = LlamaForCausalLM(config)
    skeleton.tie_weights()
    plan = {name: t for name, t in skeleton.state_dict().items() if name != "lm_head.weight"}
    writer = ShardWriter(folder, plan, max_shard_size="400MB")
    g = torch.Generator().manual_seed(0)
    for name, t in plan.items():
        value = torch.ones(t.shape) if name.endswith("norm.weight") else torch.randn(t.shape, generator=g) * 0.02
        writer.write(name, value)
        del value
    writer.close()
    config.save_pretrained(folder)
    train_bpe_tokenizer(lm_corpus(train_docs=40, validation_docs=2, seed=3).train, 300, folder)
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


@pytest.mark.slow
def test_streamed_run_holds_far_less_than_the_model(tmp_path, one_thread):
    """A 1.5 GB float32 Llama pruned by ``prune.py sparsegpt --stream true`` in a child process: its
    peak resident memory above that of a child that only imports torch and transformers stays
    below half the model's size on disk; the first blocks equal an in-memory prune of the model
    cut to those blocks (layer-sequential calibration: block i depends on blocks before it only).
    The in-memory prune runs on one thread, as the child does: float32 products summed by two
    threads may round differently, and a Hessian a few ulps away moves SparseGPT's masks."""
    from fairprune.data.pairs import lm_texts
    from fairprune.data.text import calibration_ids
    from fairprune.hub import load_tokenizer

    folder, out = tmp_path / "big", tmp_path / "out"
    size = _write_big_llama(folder)
    assert size > 1.4e9
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    baseline = _peak_rss(["-c", "import torch, transformers"], env)
    peak = _peak_rss([str(ROOT / "prune.py"), "sparsegpt", "--model", str(folder), "--stream", "true",
                      "--sparsity", "0.5", "--nsamples", "4", "--seqlen", "64", "--eval_tokens", "256", "--device", "cpu",
                      "--threads", "1", "--quiet", "--dense_cache", "false", "--output", str(out)], env)
    report = json.loads((out / "report.json").read_text())
    print(f"model {size / 1e9:.2f} GB; baseline {baseline / 1e9:.3f} GB, streamed peak {peak / 1e9:.3f} GB "
          f"(+{(peak - baseline) / 1e9:.3f} GB); report {report['memory']}")
    assert peak - baseline < size / 2
    assert report["achieved_sparsity"] == pytest.approx(0.5, abs=1e-4)

    keep = 2
    tokenizer = load_tokenizer(str(folder))
    calib = calibration_ids(tokenizer, lm_texts().calib_text, 4, 64, 0)
    cut = AutoModelForCausalLM.from_pretrained(folder, num_hidden_layers=keep, dtype=torch.float32).eval()
    prune_causal_lm(cut, "sparsegpt", Sparsity.parse("0.5"), calib, progress=False)
    reader = ShardReader(out)
    for name, want in cut.state_dict().items():
        if name.startswith("model.layers."):
            got = reader.read(name)
            assert torch.equal(got == 0, want == 0), name
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
