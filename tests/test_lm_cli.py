"""Language-model workflows end to end: train the bundled LM, prune it every way, compare, evaluate."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from fairprune.cli.prune import main as prune_main
from fairprune.cli.train import main as train_main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--data.corpus_docs", "150", "--data.seqlen", "32", "--data.batch_size", "8", "--data.bpe_vocab_size", "400",
        "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2",
        "--trainer.accelerator", "cpu"]
GPT2 = '{"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 64}'
LM_FAST = ["--nsamples", "4", "--seqlen", "32", "--device", "cpu"]


def assert_dense_with_heads_off(saved: Path, dense: Path, heads: list[list[int]]) -> None:
    """The saved head-pruned model reloads with plain ``from_pretrained`` and computes exactly what
    the dense model computes with those heads gated off (and not what the dense model computes)."""
    from fairprune.pruning.heads import HeadGates

    pruned = AutoModelForCausalLM.from_pretrained(saved).eval()
    reference = AutoModelForCausalLM.from_pretrained(dense).eval()
    ids = torch.randint(0, reference.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    gates = HeadGates(reference)
    with torch.no_grad():
        got, dense_logits = pruned(ids).logits, reference(ids).logits
        with gates, gates.off([tuple(h) for h in heads]):
            gated = reference(ids).logits
    torch.testing.assert_close(got, gated, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, dense_logits, atol=1e-4)


@pytest.fixture(scope="module")
def small_eval(tmp_path_factory) -> list[str]:
    """A short evaluation text and a CrowS-Pairs-format file, so each measurement takes a moment."""
    from fairprune.data.text import lm_corpus, stereo_pairs

    folder = tmp_path_factory.mktemp("eval")
    (folder / "eval.txt").write_text(lm_corpus(train_docs=1, validation_docs=12, seed=5).validation)
    rows = ["sent_more,sent_less,stereo_antistereo"] + [f'"{a}","{b}",stereo' for a, b in stereo_pairs()[::15]]
    (folder / "pairs.csv").write_text("\n".join(rows) + "\n")
    return ["--eval_text", str(folder / "eval.txt"), "--pairs", str(folder / "pairs.csv")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Train-then-prune in one run: the bundled GPT-2 config with SparseGPT when fit ends."""
    out = tmp_path_factory.mktemp("lm")
    status = train_main(["fit", "--config", str(ROOT / "configs/lm/tiny_gpt2_sparsegpt.yaml"), *TINY,
                         "--model.init_args.config", GPT2, "--trainer.logger.init_args.save_dir", str(out),
                         "--trainer.callbacks.init_args.calibration.nsamples", "4",
                         "--trainer.callbacks.init_args.calibration.seqlen", "32",
                         "--trainer.callbacks.init_args.calibration.device", "cpu", "--threads", "1"])
    assert status == 0
    return out / "lm" / "tiny_gpt2_sparsegpt"


def test_fit_trains_then_prunes(trained):
    dense = AutoModelForCausalLM.from_pretrained(trained / "model")
    pruned = AutoModelForCausalLM.from_pretrained(trained / "pruned-sparsegpt")
    report = json.loads((trained / "pruned-sparsegpt" / "report.json").read_text())
    assert report["method"] == "sparsegpt" and report["achieved_sparsity"] == pytest.approx(0.5)
    # The pruned model and its dense reference are measured the same way.
    assert set(report["metrics"]) == set(report["reference"]["metrics"]) == {
        "perplexity", "stereotype_score", "stereotype_score_stereo", "stereotype_score_antistereo", "stereotype_pairs_neutral"}
    w_dense = dense.transformer.h[0].mlp.c_fc.weight
    w_pruned = pruned.transformer.h[0].mlp.c_fc.weight
    assert (w_pruned == 0).float().mean() == pytest.approx(0.5, abs=0.01)
    assert (w_dense == 0).float().mean() < 0.01  # the dense export is untouched
    dense_report = json.loads((trained / "report.json").read_text())
    assert dense_report["metrics"]["perplexity"] > 1
    # train.py --threads: parsed into the run's config, and every report says what torch ran with.
    assert yaml.safe_load((trained / "config.yaml").read_text())["threads"] == 1
    assert dense_report["threads"] == report["threads"] == 1


def test_the_callback_run_is_the_commands_run(tmp_path, monkeypatch):
    """The post-training callback runs the LM commands' run (prune_run): the dense reference with its
    intervals and the paired differences, the split timings, the memory facts, the per-item
    outcomes; a second fit of the same seeded model takes the dense figures from the project cache,
    and ``lm_eval`` adds lm-eval's figures for the dense and the pruned model."""
    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))

    def fit(version: str, *extra: str) -> dict:
        assert train_main(["fit", "--config", str(ROOT / "configs/lm/tiny_gpt2_sparsegpt.yaml"), *TINY,
                           "--model.init_args.config", GPT2, "--trainer.logger.init_args.save_dir", str(tmp_path),
                           "--trainer.logger.init_args.version", version, "--trainer.enable_progress_bar", "false",
                           "--trainer.callbacks.init_args.calibration.nsamples", "4",
                           "--trainer.callbacks.init_args.calibration.seqlen", "32",
                           "--trainer.callbacks.init_args.calibration.eval_tokens", "256",
                           "--trainer.callbacks.init_args.calibration.device", "cpu", "--threads", "1", *extra]) == 0
        return json.loads((tmp_path / "lm" / version / "pruned-sparsegpt" / "report.json").read_text())

    first = fit("first")
    run = tmp_path / "lm" / "first" / "pruned-sparsegpt"
    reference = first["reference"]
    assert reference["method"] == "dense" and reference["from_cache"] is False and reference["seconds"] > 0
    assert set(reference["ci"]) >= {"perplexity", "stereotype_score"} and set(first["paired"]) > {"baseline"}
    assert first["model"] == str(tmp_path / "lm" / "first" / "model") and first["stream"] is False
    assert set(first["seconds"]) == {"load", "prune", "solve", "evaluate", "total"}
    assert first["seconds"]["evaluate"] >= reference["seconds"] and first["seconds"]["total"] >= first["seconds"]["prune"]
    memory = first["memory"]
    assert memory["peak_rss_bytes"] >= memory["peak_rss_at_start_bytes"] > 0 and memory["model_bytes"] > 0
    assert first["weights"]["save_format"] == "dense" and first["evaluation"]["tokens"] == 256
    assert (run / "eval_items.npz").is_file() and (run / "sparsity.csv").is_file() and (run / "README.md").is_file()
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["dense_cache"] is True and config["lm_eval"]["tasks"] is None

    second = fit("second", "--trainer.callbacks.init_args.lm_eval.tasks", "[mmlu]",
                 "--trainer.callbacks.init_args.lm_eval.limit", "10")
    assert second["reference"]["from_cache"] is True  # the same seeded fit: the same weights
    assert {k: second["reference"]["metrics"][k] for k in reference["metrics"]} == reference["metrics"]
    assert "mmlu" in second["tasks"]["figures"] and "mmlu" in second["reference"]["tasks"]
    assert second["seconds"]["tasks"] >= 0 and (tmp_path / "lm" / "second" / "pruned-sparsegpt" / "task_items.json").is_file()


def test_the_callback_refuses_lm_eval_mistakes_before_training():
    from fairprune.callbacks.post_training import PostTrainingPruning
    from fairprune.errors import UserError
    from fairprune.pruning.options import TaskOptions

    with pytest.raises(UserError, match="lm_eval.tasks applies to weight pruning"):
        PostTrainingPruning(method="fasp", lm_eval=TaskOptions(tasks=["mmlu"]))
    with pytest.raises(UserError, match="names a task twice"):
        PostTrainingPruning(lm_eval=TaskOptions(tasks=["mmlu", "mmlu"]))
    with pytest.raises(UserError, match="no --tasks are given"):
        TaskOptions(limit=10)


@pytest.mark.parametrize("method, sparsity", [("magnitude", "0.5"), ("wanda", "2:4"), ("sparsegpt", "2:4"),
                                              ("debias-sparsegpt", "0.5")])
def test_prune_commands_write_loadable_models(method, sparsity, trained, tmp_path, small_eval):
    out = tmp_path / method
    assert prune_main([method, "--model", str(trained / "model"), "--sparsity", sparsity, "--output", str(out), *LM_FAST,
                       *small_eval]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["achieved_sparsity"] == pytest.approx(0.5, abs=1e-6)
    assert report["nm"] == ("2:4" if ":" in sparsity else None)
    model = AutoModelForCausalLM.from_pretrained(out)
    weight = model.transformer.h[1].attn.c_attn.weight  # Conv1D: [in, out]
    if ":" in sparsity:  # every group of 4 consecutive inputs of an output keeps exactly 2
        groups = (weight.T.reshape(weight.shape[1], -1, 4) != 0).sum(-1)
        assert torch.all(groups == 2)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    assert torch.isfinite(model(ids).logits).all()
    assert pd.read_csv(out / "sparsity.csv")["sparsity"].between(0.49, 0.51).all()


def test_compare_and_evaluate(trained, tmp_path, small_eval):
    assert prune_main(["compare", "--model", str(trained / "model"), "--methods", "[magnitude, sparsegpt]",
                       "--sparsities", '["0.5", "2:4"]', "--output", str(tmp_path), *LM_FAST, *small_eval]) == 0
    table = pd.read_csv(tmp_path / "comparison.csv")
    assert list(table["method"]) == ["dense", "magnitude", "magnitude", "sparsegpt", "sparsegpt"]
    assert {"perplexity", "stereotype_score", "achieved_sparsity", "seconds"} <= set(table.columns)
    # Every row has its intervals; each sparsegpt run is compared with magnitude (the first method)
    # at its sparsity, on the same windows and pairs.
    assert (table["perplexity_ci_low"] < table["perplexity"]).all() and (table["perplexity"] < table["perplexity_ci_high"]).all()
    assert table["stereotype_score_ci_low"].notna().all()
    ratio = table["perplexity_ratio_diff"]
    assert ratio[table["method"] == "sparsegpt"].notna().all() and ratio[table["method"] != "sparsegpt"].isna().all()
    expected = table["perplexity"].iloc[3:].to_numpy() / table["perplexity"].iloc[1:3].to_numpy()
    assert ratio.iloc[3:].to_numpy() == pytest.approx(expected, rel=1e-9)
    shown = (tmp_path / "comparison.md").read_text()
    assert "perplexity 95% CI" in shown and "perplexity vs magnitude" in shown and "Δ stereotype_score vs magnitude" in shown
    run = json.loads((tmp_path / "sparsegpt_0.5" / "report.json").read_text())
    assert run["ci"]["perplexity"][0] < run["metrics"]["perplexity"] < run["ci"]["perplexity"][1]
    assert run["reference"]["ci"]["windows"] == run["ci"]["windows"] > 0
    assert run["paired"]["baseline"] == "dense" and run["paired"]["perplexity_ratio"]["ratio"] == pytest.approx(
        run["metrics"]["perplexity"] / run["reference"]["metrics"]["perplexity"], rel=1e-9)
    assert (tmp_path / "sparsegpt_0.5" / "eval_items.npz").is_file()
    assert "95 % CI" in (tmp_path / "sparsegpt_0.5" / "README.md").read_text()
    assert prune_main(["evaluate", "--model", str(tmp_path / "sparsegpt_2of4"), "--output", str(tmp_path / "eval"),
                       "--seqlen", "32", "--device", "cpu", *small_eval]) == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["achieved_sparsity"] == pytest.approx(0.5)
    assert report["metrics"]["perplexity"] == pytest.approx(table["perplexity"].iloc[4], rel=1e-4)


def test_llama_config_trains(tmp_path):
    llama = ('{"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
             '"hidden_size": 32, "intermediate_size": 64, "max_position_embeddings": 64}')
    assert train_main(["fit", "--config", str(ROOT / "configs/lm/tiny_llama.yaml"), *TINY, "--model.init_args.config", llama,
                       "--trainer.logger.init_args.save_dir", str(tmp_path)]) == 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "lm" / "tiny_llama" / "model").config.num_key_value_heads == 2


@pytest.mark.parametrize("args, needle", [
    (["sparsegpt", "--sparsity", "1.2"], "[0, 1)"),
    (["sparsegpt", "--sparsity", "4:2"], "N < M"),
    (["wanda", "--sparsity", "3:5"], "divid"),
])
def test_bad_input_is_one_line(args, needle, trained, tmp_path, capsys, small_eval):
    cmd = [*args, "--model", str(trained / "model"), "--output", str(tmp_path / "x"), *LM_FAST, *small_eval]
    assert prune_main(cmd) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and needle in last


def test_missing_model_path_is_one_line(tmp_path, capsys):
    """A --model folder that is not there: the error line alone (no word of streaming before it)."""
    for stream in ("auto", "true", "false"):
        assert prune_main(["magnitude", "--model", str(tmp_path / "nothing"), "--output", str(tmp_path / "o"),
                           "--stream", stream]) == 2
        out = capsys.readouterr()
        assert out.err.strip().splitlines() == [f"error: model path '{tmp_path / 'nothing'}' does not exist; give a "
                                                "folder written by save_pretrained or a hub name"]
        assert out.out.strip() == "" and not (tmp_path / "o").exists()


def test_fasp_command_and_head_compare(trained, tmp_path, small_eval):
    from fairprune.data.prompts import holistic_prompts
    from fairprune.reporting.records import HeadRow

    prompts = holistic_prompts(["gender_and_sex"]).groupby("bucket").head(6)
    prompts.to_csv(tmp_path / "prompts.csv", index=False)
    common = ["--prompts", str(tmp_path / "prompts.csv"), "--max_new_tokens", "2", "--seqlen", "32"]
    out = tmp_path / "fasp"
    assert prune_main(["fasp", "--model", str(trained / "model"), "--gamma", "0.25", "--alpha", "0.25",
                       "--output", str(out), "--calib_text", small_eval[1], *common]) == 0
    report = json.loads((out / "report.json").read_text())
    assert len(report["heads_removed"]) == 1 and len(report["protected"]) == 1  # 4 heads: ⌊0.25·4⌋ each
    assert tuple(report["heads_removed"][0]) != tuple(report["protected"][0])
    assert_dense_with_heads_off(out, trained / "model", report["heads_removed"])  # every LM command saves to --output
    assert len(pd.read_csv(out / "head_scores.csv")) == 5  # the unpruned model + 4 heads

    table_out = tmp_path / "heads"
    assert prune_main(["compare", "--model", str(trained / "model"), "--methods", "[fasp, performance, random]",
                       "--alphas", "[0.25, 0.5]", "--gamma", "0.25", "--eval_text", small_eval[1],
                       "--output", str(table_out), *common]) == 0
    table = pd.read_csv(table_out / "comparison.csv")
    assert list(table["method"]) == ["dense", "fasp", "fasp", "performance", "performance", "random", "random"]
    assert list(table["heads_removed"]) == [0, 1, 2, 1, 2, 1, 2]
    assert "bias/gender_and_sex" in table.columns
    # Each row is the record of a run's report (the first: of its dense reference).
    fasp_run = json.loads((table_out / "fasp_a0.25" / "report.json").read_text())
    for row, record in ((table.iloc[0], HeadRow.dense(fasp_run)), (table.iloc[1], HeadRow.from_report(fasp_run, "fasp", 0.25, protects=True))):
        expected = record.as_dict()
        assert list(table.columns[: len(expected)]) == list(expected)
        assert row["method"] == expected["method"]
        figures = [float("nan") if v is None else v for v in list(expected.values())[1:]]
        assert row[1 : len(expected)].tolist() == pytest.approx(figures, nan_ok=True)
    # Then the intervals of perplexity (over windows) and of the bias (over prompts) on every row,
    # and each run's ratio / difference to the dense model on the same windows and prompts.
    bias = "bias/gender_and_sex"
    assert list(table.columns[len(expected):]) == [
        "perplexity_ci_low", "perplexity_ci_high", f"{bias}_ci_low", f"{bias}_ci_high", "perplexity_ratio_diff",
        "perplexity_ratio_diff_ci_low", "perplexity_ratio_diff_ci_high", f"{bias}_diff", f"{bias}_diff_ci_low",
        f"{bias}_diff_ci_high"]
    assert (table["perplexity_ci_low"] <= table["perplexity"]).all() and (table["perplexity"] <= table["perplexity_ci_high"]).all()
    assert (table[f"{bias}_ci_low"] <= table[bias]).all() and (table[bias] <= table[f"{bias}_ci_high"]).all()
    assert fasp_run["paired"][bias]["difference"] == pytest.approx(
        fasp_run["fairness"]["bias"]["gender_and_sex"] - fasp_run["reference"]["fairness"]["bias"]["gender_and_sex"])
    assert fasp_run["ci"]["prompts"] == fasp_run["reference"]["ci"]["prompts"] > 0
    card = (table_out / "fasp_a0.25" / "README.md").read_text()
    row = next(line for line in card.splitlines() if line.startswith("| bias (gender_and_sex)"))
    low, high = fasp_run["ci"][bias]
    assert f"{low:.4f}–{high:.4f}" in row, row
    assert fasp_run["paired"]["perplexity_ratio"]["ratio"] == pytest.approx(table["perplexity"][1] / table["perplexity"][0])
    speed = fasp_run["size"]["tokens_per_second"]  # measured before and after the heads left
    assert speed["before"] > 0 and speed["after"] > 0 and speed["threads"] >= 1
    assert {"parameters_removed", "bytes_removed"} <= set(fasp_run["size"]["layers"][0])
    assert table["perplexity_ratio_diff"][0] != table["perplexity_ratio_diff"][0]  # the dense row: no ratio (NaN)


def test_fasp_bad_ratio_is_one_line(trained, tmp_path, capsys):
    assert prune_main(["fasp", "--model", str(trained / "model"), "--alpha", "1.5", "--output", str(tmp_path)]) == 2
    assert "--alpha" in capsys.readouterr().err.strip().splitlines()[-1]


def test_fit_trains_then_prunes_heads(tmp_path):
    status = train_main(["fit", "--config", str(ROOT / "configs/lm/tiny_gpt2_fasp.yaml"), *TINY,
                         "--model.init_args.config", GPT2, "--trainer.logger.init_args.save_dir", str(tmp_path),
                         "--trainer.callbacks.init_args.heads.alpha", "0.25", "--trainer.callbacks.init_args.heads.gamma", "0.25",
                         "--trainer.callbacks.init_args.heads.max_new_tokens", "2",
                         "--trainer.callbacks.init_args.calibration.seqlen", "32"])
    assert status == 0
    run = tmp_path / "lm" / "tiny_gpt2_fasp" / "pruned-fasp"
    report = json.loads((run / "report.json").read_text())
    assert len(report["heads_removed"]) == 1 and (run / "head_scores.csv").exists()
    assert_dense_with_heads_off(run, run.parent / "model", report["heads_removed"])
