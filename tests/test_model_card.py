"""Every run folder that holds a model carries a Hugging Face model card (``README.md``): its front
matter is what the Hub reads (``model-index`` with the run's headline figures, exactly as
``report.json`` has them), its body the fairness audit (per-group table, before / after table, the
reference, how to load it), and names from the data never break its tables."""

from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub import ModelCard

from fairprune.cli.prune import main as prune_main
from fairprune.reporting.card_classifier import ClassifierCard
from fairprune.reporting.card_lm import HeadCard, LMCard
from fairprune.reporting.model_card import CARD, model_card, write_model_card
from tiny_models import tiny_gpt2_folder

FAST = '{limit_train_batches: 2, limit_val_batches: 2, limit_test_batches: 2, accelerator: cpu, enable_progress_bar: false}'
ODD = "a|b<c>"


def _group(count, accuracy, fpr, fnr, degradation=None, **extra):
    figures = {"count": count, "present": count > 0, "accuracy": accuracy, "fpr": fpr, "fnr": fnr, **extra}
    if degradation is not None:
        figures["degradation"] = degradation
    return figures


VISION = {
    "method": "fairgrape", "model": "mobilenet_v2", "split": "test", "dataset": "synthetic", "task": "gender",
    "sensitive": "race", "target_sparsity": 0.8, "achieved_sparsity": 0.7999, "keep_per_iter": 0.5,
    "metrics": {"accuracy": 0.8125},
    "groups": {"White": _group(40, 0.875, 0.1, 0.15, 0.05), "Black": _group(12, 0.75, 0.2, 0.3, 0.0625),
               ODD: _group(7, 0.5714, 0.5, 0.25, 0.1429), "Indian": _group(0, None, None, None)},
    "fairness": {"acc_gap": 0.3036, "acc_std": 0.1253, "degradation_std": 0.0412, "degradation_var": 0.0017},
    "reference": {"method": "dense", "metrics": {"accuracy": 0.875},
                  "groups": {"White": _group(40, 0.925, 0.05, 0.1), "Black": _group(12, 0.8125, 0.1, 0.2),
                             ODD: _group(7, 0.7143, 0.25, 0.25)},
                  "fairness": {"acc_gap": 0.2107, "acc_std": 0.09}},
}
VISION_CONFIG = {"ckpt": "runs/demo/dense/checkpoints/last.ckpt", "pruning": {"method": "fairgrape", "target_sparsity": 0.8},
                 "seed": 0}

LM = {
    "method": "wanda", "model": "HuggingFaceTB/SmolLM2-135M", "family": "llama", "target_sparsity": 0.5, "nm": None,
    "achieved_sparsity": 0.5, "sparsity": {"target": 0.5, "nm": None, "achieved": 0.5, "dense_zero_fraction": 0.0},
    "metrics": {"perplexity": 23.4567, "stereotype_score": 0.6125},
    "reference": {"method": "dense", "metrics": {"perplexity": 19.8765, "stereotype_score": 0.6375}, "from_cache": True},
    "calibration": {"nsamples": 128, "seqlen": 2048}, "evaluation": {"tokens": 4096, "window": 1024, "pairs": 150},
}
LM_CONFIG = {"method": "wanda", "sparsity": "0.5", "model": "HuggingFaceTB/SmolLM2-135M", "eval_text": None, "pairs": None,
             "nsamples": 128}

HEADS = {
    "method": "fasp", "model": "gpt2", "gamma": 0.3, "alpha": 0.2, "axes": ["gender_and_sex", "race_ethnicity"],
    "heads_total": 144, "heads_removed": [[0, 1], [3, 5], [7, 2]], "scorer": "lexicon",
    "metrics": {"perplexity": 31.25}, "fairness": {"bias": {"gender_and_sex": 0.0123, "race_ethnicity": 0.0456}},
    "reference": {"method": "dense", "metrics": {"perplexity": 29.5},
                  "fairness": {"bias": {"gender_and_sex": 0.0345, "race_ethnicity": 0.0567}}},
}


def _metrics(card: ModelCard) -> dict[str, float]:
    """``{metric type: value}`` over every result of the card's model-index, as the Hub reads it."""
    index = card.data.to_dict()["model-index"]
    return {m["type"]: m["value"] for result in index[0]["results"] for m in result["metrics"]}


def _table(text: str, first_header: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def test_a_vision_card_has_the_hub_front_matter_and_every_group():
    card = ModelCard(model_card(VISION, VISION_CONFIG, card=ClassifierCard, checkpoint="checkpoints/last.ckpt",
                                model_class="fairprune.models.vision.VisionClassifier"))
    data = card.data.to_dict()
    assert data["library_name"] and {"fairprune", "pruned", "fairgrape"} <= set(data["tags"])
    assert data["base_model"] == "runs/demo/dense/checkpoints/last.ckpt"
    result = data["model-index"][0]["results"][0]
    assert result["task"]["type"] == "image-classification" and result["task"]["name"]
    assert result["dataset"]["name"] and result["dataset"]["type"]
    assert all(m["name"] for m in result["metrics"])
    metrics = _metrics(card)
    assert metrics["accuracy"] == 0.8125 and metrics["accuracy_gap"] == 0.3036 and metrics["degradation_std"] == 0.0412
    assert metrics["accuracy/White"] == 0.875 and metrics[f"accuracy/{ODD}"] == 0.5714
    assert "accuracy/Indian" not in metrics  # no sample of the group: no figure, not a made-up one

    rows = _table(card.text, "group")
    assert len(rows) == 2 + len(VISION["groups"])
    for name in ("White", "Black", "Indian"):
        assert any(row.startswith(f"| {name} |") for row in rows), name
    white = next(row for row in rows if row.startswith("| White |"))
    assert [c.strip() for c in white.strip("|").split("|")][:6] == ["White", "40", "0.8750", "0.1000", "0.1500", "0.0500"]
    assert "0.8750" in card.text and "0.8125" in card.text  # the reference (dense) and this model's accuracy
    assert "VisionClassifier.load_from_checkpoint" in card.text and "checkpoints/last.ckpt" in card.text


def test_a_group_name_with_table_characters_keeps_the_table_whole():
    text = ModelCard(model_card(VISION, VISION_CONFIG, card=ClassifierCard)).text
    rows = _table(text, "group")
    assert len({row.count("|") for row in rows}) == 1, "\n".join(rows)  # no bar inside a cell: one column count
    assert ODD not in text and "<c>" not in text  # never raw HTML, never an extra column
    assert any(row.startswith("| a&#124;b&lt;c&gt; |") for row in rows)
    assert len(rows) == 2 + len(VISION["groups"])  # a newline in a name would have added a row
    text = ModelCard(model_card({**VISION, "method": "mag\nnitude|x"}, VISION_CONFIG, card=ClassifierCard)).text
    assert all(len({row.count("|") for row in _table(text, h)}) == 1 for h in ("group", "figure", "setting"))


def test_an_lm_card_has_perplexity_stereotype_score_and_the_before_after_table():
    card = ModelCard(model_card(LM, LM_CONFIG, card=LMCard))
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and data["base_model"] == "HuggingFaceTB/SmolLM2-135M"
    assert {"fairprune", "pruned", "wanda"} <= set(data["tags"])
    metrics = _metrics(card)
    assert metrics["perplexity"] == 23.4567 and metrics["stereotype_score"] == 0.6125
    for result in data["model-index"][0]["results"]:
        assert result["task"]["type"] == "text-generation" and result["dataset"]["name"] and result["dataset"]["type"]
    rows = _table(card.text, "figure")
    perplexity = next(row for row in rows if row.startswith("| perplexity |"))
    assert "19.8765" in perplexity and "23.4567" in perplexity  # dense, then pruned
    assert any("0.6375" in row and "0.6125" in row for row in rows)
    assert "from_pretrained" in card.text


def test_a_heads_card_has_perplexity_and_bias_per_axis():
    card = ModelCard(model_card(HEADS, {"method": "fasp", "model": "gpt2", "prompts": None, "alpha": 0.2}, card=HeadCard))
    metrics = _metrics(card)
    assert metrics["perplexity"] == 31.25
    assert metrics["bias/gender_and_sex"] == 0.0123 and metrics["bias/race_ethnicity"] == 0.0456
    assert {"fairprune", "fasp"} <= set(card.data.tags) and card.data.base_model == "gpt2"
    assert "3 of 144" in card.text  # heads removed
    rows = _table(card.text, "figure")
    assert any("0.0345" in row and "0.0123" in row for row in rows)


def test_intervals_are_shown_where_the_report_has_them():
    report = json.loads(json.dumps(VISION))
    report["metrics"]["accuracy_ci95"] = [0.75, 0.86]
    report["groups"]["White"]["accuracy_ci"] = {"low": 0.8, "high": 0.93}
    report["fairness"]["acc_gap"] = {"value": 0.3036, "ci95": [0.2, 0.4]}
    card = ModelCard(model_card(report, VISION_CONFIG, card=ClassifierCard))
    assert "0.8125 (95 % CI 0.7500–0.8600)" in card.text
    assert "0.8750 (CI 0.8000–0.9300)" in card.text
    assert "0.3036 (95 % CI 0.2000–0.4000)" in card.text
    assert _metrics(card)["accuracy_gap"] == 0.3036  # the value, not the interval


def test_the_reports_interval_section_warnings_and_a_compute_matched_reference_are_shown():
    report = json.loads(json.dumps(VISION))
    report["ci"] = {"level": 0.9, "resamples": 2000, "accuracy": [0.7, 0.85], "acc_gap": [0.1, 0.5],
                    "groups": {"White": [0.8, 0.95]}}
    report["warnings"] = [f"group {ODD} has 7 test items"]
    report["reference"].update(method="continued", epochs=3)
    report["dense"] = {"method": "dense", "metrics": {"accuracy": 0.9}, "fairness": {"acc_gap": 0.15}}
    text = ModelCard(model_card(report, VISION_CONFIG, card=ClassifierCard)).text
    accuracy = next(row for row in _table(text, "figure") if row.startswith("| accuracy |"))
    assert accuracy == "| accuracy | 0.8750 | 0.9000 | 0.8125 (90 % CI 0.7000–0.8500) |"  # reference, dense, this model
    assert _table(text, "figure")[0] == "| figure | reference (continued) | dense | this model |"
    assert "| White | 40 | 0.8750 (90 % CI 0.8000–0.9500) |" in text
    assert "**continued**" in text and "epochs: 3" in text
    assert "group a&#124;b&lt;c&gt; has 7 test items" in text


@pytest.mark.parametrize("report, card", [({}, ClassifierCard), ({}, HeadCard),
                                          ({"method": "x", "metrics": {"accuracy": None}, "groups": {"g": {}}}, ClassifierCard),
                                          ({"metrics": {"perplexity": float("nan")}, "reference": None, "groups": []}, LMCard)])
def test_a_report_missing_fields_still_gives_a_card(report, card, tmp_path):
    path = write_model_card(tmp_path, report, card=card)
    assert path == tmp_path / CARD
    ModelCard(path.read_text())  # parses


def test_figures_still_in_memory_form_are_written_as_plain_numbers():
    import numpy as np

    report = {"method": "magnitude", "metrics": {"accuracy": np.float64(0.625)}, "fairness": {"acc_gap": torch.tensor(0.25)},
              "groups": {"g": {"count": np.int64(8), "accuracy": torch.tensor(0.5)}, "h": None}}
    metrics = _metrics(ModelCard(model_card(report, card=ClassifierCard)))
    assert metrics == {"accuracy": 0.625, "accuracy_gap": 0.25, "accuracy/g": 0.5}


def test_prune_magnitude_leaves_a_card_with_the_report_figures(tmp_path):

    tiny_gpt2_folder(tmp_path)
    out = tmp_path / "out"
    assert prune_main(["magnitude", "--model", str(tmp_path / "dense"), "--sparsity", "0.25", "--nsamples", "2",
                       "--seqlen", "32", "--eval_text", str(tmp_path / "eval.txt"), "--eval_tokens", "256", "--device", "cpu",
                       "--quiet", "--dense_cache", "false", "--output", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    card = ModelCard((out / CARD).read_text())
    metrics = _metrics(card)
    assert metrics["perplexity"] == report["metrics"]["perplexity"]
    assert metrics["stereotype_score"] == report["metrics"]["stereotype_score"]
    assert card.data.base_model == str(tmp_path / "dense") and "magnitude" in card.data.tags
    assert f"{report['reference']['metrics']['perplexity']:.4f}" in card.text
    assert f"torch {torch.__version__}" in card.text.split("## Environment")[1]  # the report's environment


def test_prune_vision_leaves_a_card_with_the_report_figures(dense_ckpt, tmp_path):
    assert prune_main(["vision", "--ckpt", str(dense_ckpt), "--pruning.method", "magnitude",
                       "--pruning.target_sparsity", "0.5", "--pruning.keep_per_iter", "0.5",
                       "--pruning.bn_recalibration", "0", "--trainer", FAST, "--output", str(tmp_path)]) == 0
    run = tmp_path / "magnitude"
    report = json.loads((run / "report.json").read_text())
    assert report["split"] == "test"
    card = ModelCard((run / CARD).read_text())
    metrics = _metrics(card)
    assert metrics["accuracy"] == report["metrics"]["accuracy"]
    assert metrics["accuracy_gap"] == report["fairness"]["acc_gap"]
    for group, figures in report["groups"].items():
        if figures.get("accuracy") is not None:
            assert metrics[f"accuracy/{group}"] == figures["accuracy"]
    assert card.data.base_model == str(dense_ckpt)
    rows = _table(card.text, "group")
    assert len(rows) == 2 + len(report["groups"])
    assert "checkpoints/last.ckpt" in card.text and "load_from_checkpoint" in card.text
    assert f"torch {report['environment']['versions']['torch']}" in card.text.split("## Environment")[1]
