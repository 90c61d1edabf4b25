"""What every LM command shares about how it runs: ``--eval_tokens``, the dense-figures cache,
``compare`` measuring the dense model once, ``--threads``, split timings, the dense model's own
zeros, and ``--quiet``. A tiny GPT-2 with its own BPE tokenizer, saved as a transformers folder."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from fairprune.cli.prune import _bare_flags
from fairprune.cli.prune import main as prune_main
from fairprune.data.pairs import Pair
from fairprune.data.text import lm_corpus, stereo_pairs, train_bpe_tokenizer
from fairprune.metrics.language import eval_ids, perplexity
from fairprune.runs.dense import cache_key, weights_digest
from fairprune.workflows.options import MachineOptions

FAST = ["--seqlen", "32", "--nsamples", "4", "--device", "cpu"]


@pytest.fixture(scope="module")
def lm(tmp_path_factory, one_thread) -> dict[str, str]:
    """A saved tiny GPT-2 (seeded), a short evaluation text, a second one, and a pairs file."""
    folder = tmp_path_factory.mktemp("tiny-lm")
    corpus = lm_corpus(train_docs=60, validation_docs=10, seed=3)
    tokenizer = train_bpe_tokenizer(corpus.train, 300, folder / "model")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=128, vocab_size=len(tokenizer),
                                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(folder / "model")
    (folder / "eval.txt").write_text(corpus.validation)
    (folder / "other.txt").write_text(lm_corpus(train_docs=1, validation_docs=10, seed=4).validation)
    rows = ["sent_more,sent_less,stereo_antistereo"] + [f'"{a}","{b}",stereo' for a, b in stereo_pairs()[::20]]
    (folder / "pairs.csv").write_text("\n".join(rows) + "\n")
    return {"model": str(folder / "model"), "eval": str(folder / "eval.txt"), "other": str(folder / "other.txt"),
            "pairs": str(folder / "pairs.csv")}


def texts(lm: dict[str, str], eval_text: str | None = None) -> list[str]:
    return ["--eval_text", eval_text or lm["eval"], "--pairs", lm["pairs"]]


def report_of(folder: Path) -> dict:
    return json.loads((Path(folder) / "report.json").read_text())


def test_sparsegpt_with_eval_tokens_end_to_end(lm, tmp_path):
    """The command as a user types it: every other option at its default (bundled texts, 128 windows of 128)."""
    assert prune_main(["sparsegpt", "--model", lm["model"], "--sparsity", "0.5", "--eval_tokens", "4096",
                       "--output", "runs/s"]) == 0
    report = report_of(tmp_path / "runs" / "s")
    assert report["evaluation"]["tokens"] == 4096 and report["achieved_sparsity"] == pytest.approx(0.5)
    assert set(report["seconds"]) >= {"load", "prune", "evaluate", "total"} and "threads" in report
    pruned = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "s")
    assert (pruned.transformer.h[0].mlp.c_fc.weight == 0).float().mean() == pytest.approx(0.5, abs=0.01)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "runs" / "s")
    assert torch.isfinite(pruned(**tokenizer("the cat sat", return_tensors="pt")).logits).all()


def test_eval_tokens_caps_the_perplexity_tokens(lm, tmp_path):
    args = ["evaluate", "--model", lm["model"], *FAST, *texts(lm), "--dense_cache", "false"]
    assert prune_main([*args, "--eval_tokens", "250", "--output", str(tmp_path / "capped")]) == 0
    assert prune_main([*args, "--output", str(tmp_path / "all")]) == 0
    capped, full = report_of(tmp_path / "capped"), report_of(tmp_path / "all")

    model = AutoModelForCausalLM.from_pretrained(lm["model"])
    tokenizer = AutoTokenizer.from_pretrained(lm["model"])
    ids = eval_ids(Path(lm["eval"]).read_text(), tokenizer)
    assert ids.numel() > 1000  # the cap really cuts the text
    direct = perplexity(model, ids[:250], seqlen=32, batch_size=8)
    assert capped["metrics"]["perplexity"] == pytest.approx(direct, rel=1e-9)
    assert capped["metrics"]["perplexity"] != pytest.approx(full["metrics"]["perplexity"], rel=1e-6)
    assert capped["evaluation"] == {"tokens": 224, "eval_tokens": 250, "window": 32, "pairs": full["evaluation"]["pairs"],
                                    "bos": None,
                                    "document_start": full["evaluation"]["document_start"]}
    assert full["evaluation"]["tokens"] == ids.numel() // 32 * 32
    # The stereotype pairs are not capped.
    assert capped["metrics"]["stereotype_score"] == full["metrics"]["stereotype_score"]


def test_eval_tokens_below_one_window_is_one_line(lm, tmp_path, capsys):
    assert prune_main(["magnitude", "--model", lm["model"], "--eval_tokens", "16", "--output", str(tmp_path / "x"),
                       *FAST, *texts(lm)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "--eval_tokens 16" in last and "32" in last


def test_dense_cache_hits_and_is_invalidated(lm, tmp_path, monkeypatch):
    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))

    def prune(name: str, *extra: str, eval_text: str | None = None) -> dict:
        assert prune_main(["magnitude", "--model", lm["model"], "--output", str(tmp_path / name), "--eval_tokens", "512",
                           *FAST, *texts(lm, eval_text), *extra]) == 0
        return report_of(tmp_path / name)

    first = prune("first")
    assert first["reference"]["from_cache"] is False
    assert len(list((tmp_path / "cache" / "dense").glob("*.json"))) == 1
    again = prune("again")
    assert again["reference"]["from_cache"] is True
    assert again["reference"]["metrics"] == first["reference"]["metrics"]  # identical figures
    assert again["metrics"] == first["metrics"]

    # Anything the dense figures depend on measures again, and agrees with the cache where it should.
    assert prune("other_text", eval_text=lm["other"])["reference"]["from_cache"] is False
    assert prune("other_cap", "--eval_tokens", "256")["reference"]["from_cache"] is False
    assert prune("other_window", "--eval_seqlen", "16")["reference"]["from_cache"] is False
    assert prune("other_seed", "--seed", "1")["reference"]["from_cache"] is False  # another pair split
    from fairprune.reporting import environment

    real = environment.versions()
    monkeypatch.setattr(environment, "versions", lambda: {**real, "transformers": "0.0.0-other"})
    assert prune("other_library", "--eval_tokens", "512")["reference"]["from_cache"] is False  # another transformers
    monkeypatch.setattr(environment, "versions", lambda: real)
    assert prune("same_library", "--eval_tokens", "512")["reference"]["from_cache"] is True
    fresh = prune("no_cache", "--dense_cache", "false")
    assert fresh["reference"]["from_cache"] is False
    assert fresh["reference"]["metrics"] == first["reference"]["metrics"]
    assert len(list((tmp_path / "cache" / "dense").glob("*.json"))) == 6  # --dense_cache false writes nothing


def test_dense_cache_key_follows_pair_directions(lm):
    """The cached figures include each direction's part, so the key holds the pairs' directions:
    the same sentences with one row marked antistereo are another key; plain 2-tuples are stereo."""
    model = AutoModelForCausalLM.from_pretrained(lm["model"])
    tokenizer = AutoTokenizer.from_pretrained(lm["model"])
    ids, sentences = torch.arange(64), stereo_pairs()[:3]
    key = cache_key(model, tokenizer, ids, [Pair(a, b) for a, b in sentences], 32, None, "cpu")
    assert cache_key(model, tokenizer, ids, sentences, 32, None, "cpu") == key
    flipped = [Pair(*sentences[0]), Pair(*sentences[1], "antistereo"), Pair(*sentences[2])]
    assert cache_key(model, tokenizer, ids, flipped, 32, None, "cpu")["pairs"] != key["pairs"]


def test_weights_digest_follows_every_weight(lm):
    model = AutoModelForCausalLM.from_pretrained(lm["model"])
    before = weights_digest(model)
    assert weights_digest(AutoModelForCausalLM.from_pretrained(lm["model"])) == before
    with torch.no_grad():
        model.transformer.h[1].mlp.c_proj.weight[3, 5] += 1e-3
    assert weights_digest(model) != before


def test_compare_measures_the_dense_model_once(lm, tmp_path, monkeypatch):
    import fairprune.metrics.language as language
    import fairprune.runs.dense as dense

    calls = {"dense": 0, "measured": 0}

    def counting(kind, measure):
        def measure_and_count(*args, **kwargs):
            calls[kind] += 1
            return measure(*args, **kwargs)
        return measure_and_count

    cached_figures = dense.cached_figures  # the dense model's measurement goes through it; every measurement through _scores
    monkeypatch.setattr(dense, "cached_figures", lambda key, measure, *a, **k: cached_figures(key, counting("dense", measure), *a, **k))
    monkeypatch.setattr(language, "_scores", counting("measured", language._scores))
    assert prune_main(["compare", "--model", lm["model"], "--methods", "[magnitude, wanda]", "--sparsities", '["0.5", "2:4"]',
                       "--output", str(tmp_path / "cmp"), "--eval_tokens", "512", "--dense_cache", "false",
                       *FAST, *texts(lm)]) == 0
    assert {"dense": calls["dense"], "pruned": calls["measured"] - calls["dense"]} == {"dense": 1, "pruned": 4}
    table = pd.read_csv(tmp_path / "cmp" / "comparison.csv")
    assert list(table["method"]) == ["dense", "magnitude", "magnitude", "wanda", "wanda"]
    for name in ("magnitude_0.5", "magnitude_2of4", "wanda_0.5", "wanda_2of4"):
        reference = report_of(tmp_path / "cmp" / name)["reference"]
        assert reference["metrics"]["perplexity"] == pytest.approx(table["perplexity"].iloc[0], rel=1e-12)
        assert reference["from_cache"] is False
    summary = report_of(tmp_path / "cmp")
    assert summary["evaluation"]["tokens"] == 512 and summary["reference"]["from_cache"] is False
    assert summary["threads"] == torch.get_num_threads()


def test_threads_timings_and_dense_zeros_are_reported(lm, tmp_path):
    # A dense model with some exact zeros of its own: the report states them beside the achieved sparsity.
    model = AutoModelForCausalLM.from_pretrained(lm["model"])
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[:4].zero_()  # Conv1D [in, out]: 4 input rows of 32
    model.save_pretrained(tmp_path / "zeros")
    AutoTokenizer.from_pretrained(lm["model"]).save_pretrained(tmp_path / "zeros")
    prunable = sum(m.weight.numel() for block in model.transformer.h
                   for m in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj))

    before = torch.get_num_threads()
    try:
        assert prune_main(["magnitude", "--model", str(tmp_path / "zeros"), "--sparsity", "2:4", "--threads", "2",
                           "--output", str(tmp_path / "out"), *FAST, *texts(lm), "--eval_tokens", "256"]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    report = report_of(tmp_path / "out")
    assert report["threads"] == 2
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["threads"] == 2
    assert set(report["seconds"]) == {"load", "prune", "solve", "evaluate", "total"}
    assert all(v >= 0 for v in report["seconds"].values())
    assert report["sparsity"]["dense_zero_fraction"] == pytest.approx(4 * 128 / prunable)
    # 2:4 keeps 2 of every 4 weights, but where the dense model had zeros some kept weights are zeros too.
    zeros = report["sparsity"]["dense_zero_fraction"]
    assert report["sparsity"]["achieved"] == report["achieved_sparsity"]
    assert 0.5 < report["achieved_sparsity"] <= 0.5 + zeros
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").transformer.h[0].mlp.c_fc.weight[:4].abs().sum() == 0


def test_machine_options_set_the_thread_count():
    before = torch.get_num_threads()
    try:
        MachineOptions(threads=2).apply()
        assert torch.get_num_threads() == 2
        MachineOptions(threads=None).apply()  # torch's own choice: left as it is
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    with pytest.raises(Exception, match="--threads"):
        MachineOptions(threads=0).apply()


def test_quiet_silences_every_progress_bar(lm, tmp_path, capsys, monkeypatch):
    from transformers.utils import logging as hf_logging

    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")
    was_enabled = hf_logging.is_progress_bar_enabled()
    args = ["sparsegpt", "--model", lm["model"], *FAST, *texts(lm), "--eval_tokens", "256", "--dense_cache", "false"]
    try:
        assert prune_main([*args, "--output", str(tmp_path / "loud")]) == 0
        loud = capsys.readouterr().err
        assert "measuring" in loud and "sparsegpt" in loud and "%|" in loud
        assert prune_main([*args, "--output", str(tmp_path / "quiet"), "--quiet"]) == 0
        quiet = capsys.readouterr()
        assert "%|" not in quiet.err and "it/s" not in quiet.err
        assert "[sparsegpt] perplexity" in quiet.out  # the result line stays
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def test_importance_bars_follow_the_progress_flag(capsys):
    import torch.nn.functional as F
    from torch import nn

    from fairprune.pruning import importance
    from fairprune.pruning.masks import Target

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    targets = [Target("0", model[0])]
    loader = [(torch.randn(6, 4), torch.randint(0, 3, (6,)), torch.tensor([0, 1, 0, 1, 0, 1]))]
    shown = importance.group_scores(model, targets, loader, F.cross_entropy, torch.device("cpu"), 2, progress=True)
    assert "fairgrape" in capsys.readouterr().err
    hidden = importance.group_scores(model, targets, loader, F.cross_entropy, torch.device("cpu"), 2, progress=False)
    importance.snip_scores(model, targets, loader, F.cross_entropy, torch.device("cpu"), progress=False)
    assert capsys.readouterr().err == ""
    torch.testing.assert_close(shown["0"], hidden["0"])


def test_bare_quiet_means_true():
    assert _bare_flags(["--quiet"]) == ["--quiet", "true"]
    assert _bare_flags(["--quiet", "--seed", "1"]) == ["--quiet", "true", "--seed", "1"]
    assert _bare_flags(["--quiet", "false"]) == ["--quiet", "false"]


def test_vision_quiet_and_threads(dense_ckpt, tmp_path, capsys):
    """``prune.py vision --quiet``: neither Lightning's bars nor FairGRAPE's importance bar; the
    report says how many threads torch ran with (read when the report is written)."""
    before = torch.get_num_threads()
    try:
        assert prune_main(["vision", "--ckpt", str(dense_ckpt), "--pruning.method", "fairgrape",
                           "--pruning.target_sparsity", "0.5", "--pruning.keep_per_iter", "0.5",
                           "--trainer", json.dumps({"accelerator": "cpu", "limit_train_batches": 2}),
                           "--output", str(tmp_path), "--quiet", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert "%|" not in err and "group importance" not in err
    assert report_of(tmp_path / "fairgrape")["threads"] == 1  # FairGRAPE's numba kernels ran in between


@pytest.mark.skipif(torch.cuda.is_available(), reason="triton is left alone on a machine with a GPU")
def test_a_run_without_a_gpu_does_not_import_triton():
    """``MachineOptions.apply`` (the start of every command) makes triton read as absent where torch
    sees no GPU, so transformers' model code (which imports ``torch._dynamo``) does not load it; the
    model still builds and runs."""
    import subprocess
    import sys

    code = ("import importlib.util, sys, torch\n"
            "from fairprune.workflows.options import MachineOptions\n"
            "MachineOptions().apply()\n"
            "from transformers import LlamaConfig, LlamaForCausalLM\n"
            "import torch._dynamo\n"
            "from torch.utils._triton import has_triton_package\n"
            "config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,\n"
            "                     num_key_value_heads=1, vocab_size=50)\n"
            "out = LlamaForCausalLM(config).eval()(torch.tensor([[1, 2, 3]])).logits\n"
            "print(sys.modules.get('triton', 'absent'), importlib.util.find_spec('triton'), has_triton_package(),\n"
            "      tuple(out.shape))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["None", "None", "False", "(1,", "3,", "50)"]


def test_lm_commands_do_not_import_lightning():
    """The LM workflows (prune, recipe, evaluate, compare's LM cells) and head pruning run no
    Trainer: importing them leaves Lightning, torchmetrics and what they pull in (torchvision,
    matplotlib) unloaded, which keeps a streamed run's memory at its import floor."""
    import subprocess
    import sys

    heavy = ("lightning", "torchmetrics", "torchvision", "matplotlib")
    code = ("import sys\nimport fairprune.workflows.lm, fairprune.workflows.heads, fairprune.runs.lm\n"
            f"print(sorted(name for name in {heavy!r} if name in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
