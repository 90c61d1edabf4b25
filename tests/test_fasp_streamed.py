"""FASP and the heads compare on a streamed model (``--stream true``): the heads scored, removed and
measured block by block give the in-memory run's heads, scores and figures, and a folder whose
model computes what the in-memory run's folder computes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
import transformers as tf

from fairprune.cli.prune import main as prune_main
from fairprune.data.prompts import holistic_prompts
from fairprune.data.text import lm_corpus, train_bpe_tokenizer
from fairprune.hub.shards import INDEX

pytestmark = pytest.mark.usefixtures("one_thread")

#: Figures of the two runs compared to this (relative); on a CPU they agree bit for bit.
TOLERANCE = 1e-9


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory, one_thread) -> Path:
    """A tiny grouped-query Llama saved in several safetensors shards with its BPE tokenizer, a
    text, a prompt file and a tiny toxicity classifier (a continuous score, so the bias differs
    from head to head)."""
    root = tmp_path_factory.mktemp("fasp-streamed")
    corpus = lm_corpus(train_docs=30, validation_docs=4, seed=3)
    tokenizer = train_bpe_tokenizer(corpus.train, 300)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=64,
                                       **ids)).save_pretrained(root / "dense", max_shard_size="100KB")
    tokenizer.save_pretrained(root / "dense")
    assert (root / "dense" / INDEX).is_file()
    classifier = tf.GPT2ForSequenceClassification(tf.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=len(tokenizer), n_positions=64, **ids, id2label={0: "non-toxic", 1: "toxic"}, label2id={"non-toxic": 0, "toxic": 1}))
    classifier.save_pretrained(root / "toxicity")
    tokenizer.save_pretrained(root / "toxicity")
    (root / "text.txt").write_text(corpus.validation)
    holistic_prompts(["gender_and_sex"]).groupby("bucket").head(3).to_csv(root / "prompts.csv", index=False)
    return root


def _options(root: Path, gamma: str = "0.25") -> list[str]:
    return ["--model", str(root / "dense"), "--prompts", str(root / "prompts.csv"), "--scorer", str(root / "toxicity"),
            "--calib_text", str(root / "text.txt"), "--eval_text", str(root / "text.txt"), "--max_new_tokens", "3",
            "--seqlen", "32", "--device", "cpu", "--gamma", gamma, "--dense_cache", "false", "--quiet", "true"]


def _largest_difference(a, b, path: str = "") -> float:
    """The largest absolute difference between two reports' numbers (keys and lists matched), and
    every other leaf equal."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        return max((_largest_difference(a[k], b[k], f"{path}/{k}") for k in a), default=0.0)
    if isinstance(a, list):
        assert len(a) == len(b), path
        return max((_largest_difference(x, y, f"{path}/{i}") for i, (x, y) in enumerate(zip(a, b))), default=0.0)
    if isinstance(a, float) and not isinstance(b, bool):
        assert math.isclose(a, b, rel_tol=TOLERANCE, abs_tol=TOLERANCE) or (math.isnan(a) and math.isnan(b)), (path, a, b)
        return 0.0 if math.isnan(a) else abs(a - b)
    assert a == b, (path, a, b)
    return 0.0


def _figures(report: dict) -> dict:
    """A report without what differs between runs by nature: times, the machine, and the way the
    model was held (``stream``; a streamed run does not time a forward of the model)."""
    size = {k: v for k, v in report["size"].items() if k != "tokens_per_second"}
    skip = {"seconds", "environment", "threads", "stream", "size", "gamma_search"}
    search = report.get("gamma_search") or {}
    return {**{k: v for k, v in report.items() if k not in skip}, "size": size,
            "gamma_search": {k: v for k, v in search.items() if k != "seconds"}}


def _assert_same_logits(streamed: Path, in_memory: Path) -> None:
    """Both folders load with plain ``from_pretrained`` (the same config) and compute the same logits."""
    one, other = (tf.AutoModelForCausalLM.from_pretrained(p).eval() for p in (streamed, in_memory))
    configs = [{k: v for k, v in m.config.to_dict().items() if k != "_name_or_path"} for m in (one, other)]
    assert configs[0] == configs[1]
    ids = torch.randint(1, one.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(one(ids).logits, other(ids).logits, rtol=0, atol=0)


def test_fasp_streamed_gives_the_in_memory_run(lm_folder, tmp_path):
    """γ searched: every baseline (gradient and magnitude read the weights block by block) and
    every γ measured on the streamed model as in memory."""
    outputs = {}
    for stream in ("false", "true"):
        outputs[stream] = tmp_path / f"stream-{stream}"
        assert prune_main(["fasp", *_options(lm_folder, "null"), "--alpha", "0.5", "--stream", stream,
                           "--output", str(outputs[stream])]) == 0
    memory, streamed = (json.loads((outputs[s] / "report.json").read_text()) for s in ("false", "true"))
    assert streamed["stream"] is True and memory["stream"] is False
    assert streamed["heads_removed"] == memory["heads_removed"] and len(memory["heads_removed"]) == 4
    assert streamed["protected"] == memory["protected"] and streamed["gamma"] == memory["gamma"]
    assert {t["method"] for t in memory["gamma_search"]["trials"]} == {"fasp", "performance", "magnitude", "gradient", "random"}
    assert _largest_difference(_figures(streamed), _figures(memory)) <= TOLERANCE
    assert memory["fairness"]["bias"]["gender_and_sex"] > 0 and streamed["size"]["tokens_per_second"] is None
    scores = [pd.read_csv(outputs[s] / "head_scores.csv") for s in ("false", "true")]
    pd.testing.assert_frame_equal(scores[1], scores[0], rtol=TOLERANCE)
    assert scores[0]["bias:gender_and_sex"].nunique() > 1  # the heads do differ
    _assert_same_logits(outputs["true"], outputs["false"])
    assert sorted(p.name for p in outputs["true"].iterdir()) == sorted(p.name for p in outputs["false"].iterdir())


def test_heads_compare_streamed_gives_the_in_memory_table(lm_folder, tmp_path):
    tables = {}
    for stream in ("false", "true"):
        out = tmp_path / f"stream-{stream}"
        assert prune_main(["compare", *_options(lm_folder), "--methods", "[fasp, magnitude]", "--alphas", "[0.25, 0.5]",
                           "--stream", stream, "--output", str(out)]) == 0
        tables[stream] = pd.read_csv(out / "comparison.csv")
    assert list(tables["true"]["method"]) == ["dense", "fasp", "fasp", "magnitude", "magnitude"]
    pd.testing.assert_frame_equal(tables["true"], tables["false"], rtol=TOLERANCE)
    for cell in ("fasp_a0.25", "fasp_a0.5", "magnitude_a0.25", "magnitude_a0.5"):
        reports = [json.loads((tmp_path / f"stream-{s}" / cell / "report.json").read_text()) for s in ("false", "true")]
        assert reports[1]["heads_removed"] == reports[0]["heads_removed"]
        assert _largest_difference(_figures(reports[1]), _figures(reports[0])) <= TOLERANCE
        _assert_same_logits(tmp_path / "stream-true" / cell, tmp_path / "stream-false" / cell)
