"""The trainable causal LM: its evaluation loss and perplexity (a metric reduced across processes,
the same numbers as a plain token-weighted mean), and its export, which the report writer does."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.utilities.data import dim_zero_sum
from transformers import AutoModelForCausalLM

from fairprune.callbacks.report import ReportWriter
from fairprune.models.language import CausalLM, TokenNLL

VOCAB = 50
GPT2 = {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 32}

pytestmark = pytest.mark.usefixtures("one_thread")


def windows(n: int = 10, length: int = 12, seed: int = 0) -> DataLoader:
    ids = torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(ids), batch_size=4)  # a short last batch: weights differ per batch


def fit(module: CausalLM, root, callbacks: list[L.Callback]) -> L.Trainer:
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, default_root_dir=root, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=callbacks)
    trainer.fit(module, windows(seed=1), windows())
    return trainer


def test_token_nll_matches_the_python_sum_and_reduces_by_sum():
    metric = TokenNLL()
    losses, tokens = torch.rand(5, generator=torch.Generator().manual_seed(0)) * 6, [44, 44, 44, 44, 22]
    nll = 0.0
    for loss, n in zip(losses, tokens):
        metric.update(loss, n)
        nll += float(loss) * n
    assert float(metric.compute()) == nll / sum(tokens)  # bit for bit
    assert metric._reductions == {"nll": dim_zero_sum, "tokens": dim_zero_sum}
    metric.reset()
    metric.update(torch.tensor(2.0), 3)
    assert float(metric.compute()) == 2.0


def test_validation_loss_and_perplexity_are_the_token_weighted_mean(tmp_path):
    torch.manual_seed(0)
    module = CausalLM(config=GPT2, vocab_size=VOCAB, export=False)
    fit(module, tmp_path, [])
    module.eval()
    nll = count = 0.0
    with torch.no_grad():
        for (ids,) in windows():
            n = ids.numel() - len(ids)
            nll += float(module.model(input_ids=ids, labels=ids).loss) * n
            count += n
    assert module.last_results["val"] == {"metrics": {"loss": nll / count, "perplexity": math.exp(nll / count)}}
    assert not any(key.startswith("token_nll") for key in module.state_dict())  # checkpoints unchanged


def test_report_writer_exports_the_trained_model_and_the_model_writes_nothing(tmp_path):
    torch.manual_seed(0)
    module = CausalLM(config=GPT2, vocab_size=VOCAB)
    fit(module, tmp_path / "plain", [])
    assert not (tmp_path / "plain" / "model").exists()  # a model alone never writes its run folder

    fit(module, tmp_path / "run", [ReportWriter(print_table=False)])
    assert json.loads((tmp_path / "run" / "report.json").read_text())["metrics"] == module.last_results["val"]["metrics"]
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
    for (name, mine), theirs in zip(module.model.state_dict().items(), saved.state_dict().values()):
        assert torch.equal(mine, theirs), name

    quiet = CausalLM(config=GPT2, vocab_size=VOCAB, export=False)
    fit(quiet, tmp_path / "quiet", [ReportWriter(print_table=False)])
    assert not (tmp_path / "quiet" / "model").exists()
