"""Diff-Pruning: hard-concrete gates against their closed forms, exact-k pruning, frozen masks,
the diff-only checkpoint, the text data and the callback's stages through the real CLI."""

from __future__ import annotations

import json
import math
import operator

import pandas as pd
import pytest
import torch
from torch import nn

from fairprune.callbacks.diff_pruning import DiffPruning
from fairprune.cli.train import main
from fairprune.data.text_classification import TextClassificationDataModule, bios_records
from fairprune.errors import UserError
from fairprune.models.text_classifier import SequenceClassifier, tiny_bert_config
from fairprune.pruning import diff
from fairprune.workflows.diff import compare_diff_pruning

TINY = tiny_bert_config(max_position_embeddings=128)


@pytest.fixture(scope="module")
def bios(tmp_path_factory):
    """The bundled biographies, small, with a locally trained WordPiece tokenizer."""
    mp = pytest.MonkeyPatch()
    mp.setenv("FAIRPRUNE_CACHE", str(tmp_path_factory.mktemp("cache")))
    dm = TextClassificationDataModule(bios_size=300, batch_size=16, vocab_size_local=400)
    dm.setup()
    yield dm
    mp.undo()


def tiny_module(dm: TextClassificationDataModule, seed: int = 0) -> SequenceClassifier:
    torch.manual_seed(seed)
    return SequenceClassifier(config=TINY, class_names=dm.class_names, group_names=dm.group_names,
                              tokenizer_path=dm.tokenizer_path, vocab_size=dm.vocab_size)


def val_batch(dm: TextClassificationDataModule) -> dict[str, torch.Tensor]:
    return next(iter(dm.val_dataloader()))


def logits(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    module.eval()
    with torch.no_grad():
        return module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def randomize_gates(root: nn.Module, seed: int = 0) -> None:
    """Non-zero δ and spread-out log α, as after some gated training."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for gate in diff.gates(root).values():
            gate.delta.copy_(torch.randn(gate.delta.shape, generator=g) * 0.05)
            gate.log_alpha.copy_(torch.randn(gate.log_alpha.shape, generator=g) * 2)


# ----------------------------------------------------------------------------------------------
# Gates against the closed forms


def test_sampled_gate_matches_the_formula_for_given_noise():
    cfg = diff.GateConfig(beta=0.7, left=-0.2, right=1.3)
    log_alpha = torch.linspace(-4, 4, 101)
    u = torch.rand(101, generator=torch.Generator().manual_seed(1)).clamp(0.01, 0.99)
    expected = [min(max((1 / (1 + math.exp(-(math.log(ui / (1 - ui)) + a) / 0.7))) * 1.5 - 0.2, 0.0), 1.0)
                for ui, a in zip(u.tolist(), log_alpha.tolist())]
    assert torch.allclose(diff.sample_gate(log_alpha, cfg, u), torch.tensor(expected), atol=1e-6)


@pytest.mark.parametrize("a", [-1.0, 0.5, 2.0])
def test_gate_distribution_and_penalty_match_closed_forms(a):
    """P(z = 0), P(z = 1) and P(z > 0) of the hard concrete, and the expected-L0 penalty."""
    cfg = diff.GateConfig(beta=1.0, left=-0.1, right=1.1, lam=0.5)
    torch.manual_seed(0)
    z = diff.sample_gate(torch.full((200_000,), a), cfg)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    p_zero = sig(logit(0.1 / 1.2) - a)  # s < -l/(r-l)
    p_one = 1 - sig(logit(1.1 / 1.2) - a)  # s > (1-l)/(r-l)
    assert (z == 0).float().mean().item() == pytest.approx(p_zero, abs=5e-3)
    assert (z == 1).float().mean().item() == pytest.approx(p_one, abs=5e-3)
    p_nonzero = sig(a - math.log(0.1 / 1.1))
    assert (z > 0).float().mean().item() == pytest.approx(p_nonzero, abs=5e-3)
    assert diff.prob_nonzero(torch.tensor(a), cfg).item() == pytest.approx(p_nonzero, rel=1e-5)

    layer = nn.Linear(4, 3)
    diff.attach_gates(layer, ["weight"], cfg)
    with torch.no_grad():
        diff.gates(layer)["weight"].log_alpha.fill_(a)
    assert diff.l0_penalty(layer).item() == pytest.approx(0.5 * 12 * p_nonzero, rel=1e-5)


def test_structured_gate_multiplies_entry_and_tensor_probabilities():
    cfg = diff.GateConfig(structured=True, lam=1.0)
    layer = nn.Linear(3, 2)
    diff.attach_gates(layer, ["weight"], cfg)
    gate = diff.gates(layer)["weight"]
    with torch.no_grad():
        gate.log_alpha.copy_(torch.tensor([[0.0, 1.0, -1.0], [2.0, -2.0, 0.5]]))
        gate.tensor_log_alpha.fill_(-0.3)
    sig = torch.sigmoid
    expected = sig(gate.log_alpha.detach()).sum() * sig(torch.tensor(-0.3))
    assert diff.l0_penalty(layer).item() == pytest.approx(expected.item(), rel=1e-6)
    layer.eval()
    z = diff.deterministic_gate(gate.log_alpha.detach(), cfg) * diff.deterministic_gate(torch.tensor(-0.3), cfg)
    with torch.no_grad():
        gate.delta.fill_(1.0)
    assert torch.allclose(layer.weight - layer.parametrizations.weight.original, z)


@pytest.mark.parametrize("beta, left, right", [(1.0, -1.5, 1.5), (0.6, -0.1, 1.1)])
def test_fused_gated_weight_matches_autograd_of_the_formula(beta, left, right):
    """The hand-written backward of θ₀ + z ⊙ δ against autograd through the plain expression."""
    cfg = diff.GateConfig(beta=beta, left=left, right=right)
    g = torch.Generator().manual_seed(2)
    base, grad = torch.randn(40, 30, generator=g), torch.randn(40, 30, generator=g)
    leaves = [torch.randn(40, 30, generator=g).requires_grad_(True), (torch.randn(40, 30, generator=g) * 3).requires_grad_(True)]
    torch.manual_seed(5)
    fused = diff._GatedSum.apply(base, *leaves, beta, left, right)
    fused_grads = torch.autograd.grad(fused, leaves, grad)
    torch.manual_seed(5)
    plain = base + diff.sample_gate(leaves[1], cfg) * leaves[0]
    plain_grads = torch.autograd.grad(plain, leaves, grad)
    assert torch.allclose(fused, plain, atol=1e-6)
    for a, b in zip(fused_grads, plain_grads):
        assert torch.allclose(a, b, atol=1e-5)
    assert (fused_grads[1] != 0).any()


def test_eval_gates_are_deterministic_and_train_gates_are_not():
    layer = nn.Linear(16, 16)
    diff.attach_gates(layer, ["weight"])
    gate = diff.gates(layer)["weight"]
    with torch.no_grad():
        gate.log_alpha.copy_(torch.randn(16, 16))
        gate.delta.fill_(1.0)
    layer.eval()
    first, second = layer.weight.detach().clone(), layer.weight.detach().clone()
    assert torch.equal(first, second)
    closed = (torch.sigmoid(gate.log_alpha.detach()) * 3 - 1.5).clamp(0, 1)
    assert torch.allclose(first - layer.parametrizations.weight.original, closed)
    layer.train()
    assert not torch.equal(layer.weight.detach(), layer.weight.detach())


def test_gradient_reaches_delta_once():
    """dL/dδ = z ⊙ dL/dθ, as for a plain weight θ₀ + z ⊙ δ (no doubled gradient)."""
    torch.manual_seed(0)
    layer = nn.Linear(5, 4)
    base = layer.weight.detach().clone()
    diff.attach_gates(layer, ["weight"])
    gate = diff.gates(layer)["weight"]
    with torch.no_grad():
        gate.delta.copy_(torch.randn(4, 5))
        gate.log_alpha.copy_(torch.randn(4, 5))
    layer.eval()
    x = torch.randn(8, 5)
    layer(x).square().sum().backward()
    z = diff.deterministic_gate(gate.log_alpha.detach(), gate.cfg)
    w = (base + z * gate.delta.detach()).requires_grad_(True)
    (x @ w.T + layer.bias.detach()).square().sum().backward()
    assert torch.allclose(gate.delta.grad, z * w.grad, atol=1e-5)
    assert layer.parametrizations.weight.original.grad is None


# ----------------------------------------------------------------------------------------------
# Settings


@pytest.mark.parametrize("kwargs, needle", [
    ({"target_fraction": 0.0}, "target_fraction"),
    ({"target_fraction": 1.5}, "target_fraction"),
    ({"lam": -1e-7}, "lam"),
    ({"gated_epochs": 0}, "gated_epochs"),
    ({"score": "grad"}, "score"),
])
def test_bad_settings_are_user_errors(kwargs, needle):
    with pytest.raises(UserError, match=needle):
        DiffPruning(**kwargs)


def test_unknown_parameter_name_lists_close_names(bios):
    module = tiny_module(bios)
    with pytest.raises(UserError, match=r"did you mean: bert\.encoder\.layer\.0\.attention\.self\.query\.weight"):
        diff.attach_gates(module.model, ["bert.encoder.layer.0.attention.self.querry.weight"])
    names = diff.attach_gates(module.model, ["*.attention.self.query.weight"])
    assert names == [f"bert.encoder.layer.{i}.attention.self.query.weight" for i in range(2)]


# ----------------------------------------------------------------------------------------------
# Gated model, pruning, fixed mask


def test_gates_start_as_the_base_and_train_only_delta_alpha_and_head(bios):
    module = tiny_module(bios)
    batch = val_batch(bios)
    before = logits(module.model, batch)
    names = diff.attach_gates(module.model)
    assert torch.equal(logits(module.model, batch), before)
    module.train()  # sampled gates times δ = 0 change nothing either
    for name in names:
        assert torch.equal(operator.attrgetter(name)(module.model), diff.base_tensor(module.model, name))
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert {"classifier.weight", "classifier.bias"} <= trainable
    assert all(".delta" in n or ".log_alpha" in n or n.startswith("classifier.") for n in trainable)
    assert "classifier.weight" not in names and "bert.embeddings.word_embeddings.weight" in names
    assert len(module.configure_optimizers().param_groups) == 1  # the model alone knows no log α
    DiffPruning().register(module)
    groups = module.configure_optimizers().param_groups
    assert groups[1]["lr"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in diff.alpha_parameters(module.model)}
    assert {id(p) for p in groups[0]["params"]} == {id(p) for p in module.parameters() if p.requires_grad} - {id(p) for p in groups[1]["params"]}


def test_registered_penalty_joins_the_training_loss(bios):
    module = tiny_module(bios)
    diff.attach_gates(module.model)
    randomize_gates(module.model)
    module.train()
    batch = next(iter(bios.train_dataloader()))

    def task_loss():
        torch.manual_seed(3)  # the same gate samples for every forward
        return module.loss(module(batch["input_ids"], batch["attention_mask"]), batch["labels"])

    torch.manual_seed(3)
    assert torch.equal(module.training_step(batch, 0), task_loss())  # no callback: no penalty
    DiffPruning().register(module)
    torch.manual_seed(3)
    loss = module.training_step(batch, 0)
    penalty = diff.l0_penalty(module.model)
    assert penalty.requires_grad and penalty > 0
    assert torch.allclose(loss, task_loss() + penalty)
    diff.magnitude_prune(module.model, 0.05)  # fixed gates: the penalty is gone
    torch.manual_seed(3)
    assert torch.equal(module.training_step(batch, 0), task_loss())


@pytest.mark.parametrize("fraction", [0.003, 0.05, 0.5])
@pytest.mark.parametrize("score", ["gated", "delta"])
def test_magnitude_pruning_keeps_exactly_k_largest(bios, fraction, score):
    module = tiny_module(bios)
    diff.attach_gates(module.model)
    randomize_gates(module.model)
    found = diff.gates(module.model)
    if score == "gated":
        scores = {n: (diff.deterministic_gate(g.log_alpha.detach(), g.cfg) * g.delta.detach()).abs() for n, g in found.items()}
    else:
        scores = {n: g.delta.detach().abs() for n, g in found.items()}
    flat = torch.cat([s.flatten() for s in scores.values()])
    k = diff.magnitude_prune(module.model, fraction, score)
    assert k == round(fraction * flat.numel())
    kept = torch.cat([g.mask.flatten() for g in found.values()])
    assert int(kept.sum()) == k
    assert flat[kept].min() >= flat[~kept].max()  # the k largest, by a plain sort's threshold
    if score == "gated":
        nonzero = sum(int(g.effective_delta().count_nonzero()) for g in found.values())
        assert nonzero == k - int((flat[kept] == 0).sum())
        assert diff.nonzero_fraction(module.model) == pytest.approx(nonzero / flat.numel())


def test_fixed_mask_stays_frozen_through_optimizer_steps(bios):
    module = tiny_module(bios)
    diff.attach_gates(module.model)
    randomize_gates(module.model)
    diff.magnitude_prune(module.model, 0.02)
    found = diff.gates(module.model)
    masks = {n: g.mask.clone() for n, g in found.items()}
    alphas = {n: g.log_alpha.detach().clone() for n, g in found.items()}
    deltas = {n: g.delta.detach().clone() for n, g in found.items()}
    bases = {n: diff.base_tensor(module.model, n).detach().clone() for n in found}
    optimizer = torch.optim.AdamW(diff.param_groups(module), lr=0.05, weight_decay=0.1)
    module.train()
    for batch in list(bios.train_dataloader())[:3]:
        loss = module.loss(module(batch["input_ids"], batch["attention_mask"]), batch["labels"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    moved = 0
    for n, g in found.items():
        assert torch.equal(g.mask, masks[n]) and torch.equal(g.log_alpha.detach(), alphas[n])
        assert torch.equal(diff.base_tensor(module.model, n), bases[n])
        assert torch.all(g.effective_delta()[~masks[n]] == 0)
        moved += int((g.delta.detach()[masks[n]] != deltas[n][masks[n]]).sum())
    assert moved > 0


# ----------------------------------------------------------------------------------------------
# Diff-only checkpoint


@pytest.mark.parametrize("fixed", [True, False])
def test_saved_diff_reloads_to_identical_logits_and_refuses_another_base(bios, tmp_path, fixed):
    module = tiny_module(bios)
    base = tiny_module(bios).model  # same seed: the same starting weights
    diff.attach_gates(module.model)
    randomize_gates(module.model)
    with torch.no_grad():
        module.model.classifier.weight.add_(1.0)
    if fixed:
        diff.magnitude_prune(module.model, 0.05)
    batch = val_batch(bios)
    expected = logits(module.model, batch)
    meta = diff.save_diff(module.model, tmp_path / "diff", "my-base")
    assert meta["stored_bytes"] < meta["full_bytes"] or not fixed

    restored = diff.load_diff(tmp_path / "diff", base)
    assert not diff.gates(restored)
    assert torch.equal(logits(restored, batch), expected)
    assert not torch.equal(logits(base, batch), expected)  # the base itself was not modified

    other = tiny_module(bios, seed=1).model
    with pytest.raises(UserError, match="base weights do not match"):
        diff.load_diff(tmp_path / "diff", other)
    with pytest.raises(UserError, match="not a Diff-Pruning checkpoint"):
        diff.load_diff(tmp_path, base)


# ----------------------------------------------------------------------------------------------
# Data


def test_bios_are_deterministic_and_imbalanced_like_biasbios():
    assert bios_records(50, seed=3) == bios_records(50, seed=3)
    assert bios_records(50, seed=3) != bios_records(50, seed=4)
    frame = pd.DataFrame(bios_records(3000))
    women = frame.assign(f=frame.group == "female").groupby("label").f.mean()
    assert women["nurse"] > 0.8 and women["dietitian"] > 0.8 and women["surgeon"] < 0.3
    assert not frame.text.str.contains("surgeon|nurse|dietitian|attorney").any()


def test_csv_files_give_names_and_tuple_batches(tmp_path):
    rows = pd.DataFrame({"text": ["good film", "bad film", "great plot", "awful plot"] * 3,
                         "label": ["pos", "neg", "pos", "neg"] * 3, "group": ["a", "b", "b", "a"] * 3})
    rows.to_csv(tmp_path / "train.csv", index=False)
    dm = TextClassificationDataModule(train_file=str(tmp_path / "train.csv"), batch_format="tuple", batch_size=5, vocab_size_local=60)
    assert dm.class_names == ["neg", "pos"] and dm.group_names == ["a", "b"]
    ids, mask, labels, groups = next(iter(dm.val_dataloader()))
    assert ids.shape == mask.shape and ids.shape[0] == 5 and mask[:, 0].all()
    assert labels.tolist() == [1, 0, 1, 0, 1] and groups.tolist() == [0, 1, 1, 0, 0]
    with pytest.raises(UserError, match="no column 'sentence'"):
        TextClassificationDataModule(train_file=str(tmp_path / "train.csv"), text_column="sentence").class_names  # noqa: B018 (the property raises)
    with pytest.raises(UserError, match="does not exist"):
        TextClassificationDataModule(train_file=str(tmp_path / "missing.csv"))


def test_hub_dataset_without_datasets_package_is_a_user_error(monkeypatch):
    import builtins

    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "datasets" else real_import(name, *a, **k))
    with pytest.raises(UserError, match="pip install datasets"):
        TextClassificationDataModule(dataset="glue", subset="sst2").records()


# ----------------------------------------------------------------------------------------------
# The callback through the CLI, and the comparison table


def test_callback_runs_its_stages_through_the_cli(repo_root, tmp_path):
    status = main(["fit", "--config", str(repo_root / "configs/text/diffprune_bios.yaml"),
                   "--model.init_args.model", "null", "--model.init_args.config", json.dumps(TINY),
                   "--data.init_args.tokenizer", "null", "--data.init_args.bios_size", "300",
                   "--data.init_args.vocab_size_local", "400", "--data.init_args.batch_size", "16",
                   "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2",
                   "--trainer.accelerator", "cpu",
                   "--trainer.logger.init_args.save_dir", str(tmp_path),
                   "--trainer.callbacks.init_args.gated_epochs", "2", "--trainer.callbacks.init_args.finetune_epochs", "1",
                   "--trainer.callbacks.init_args.target_fraction", "0.02"])
    assert status == 0
    run = tmp_path / "bios" / "diff-pruning"
    report = json.loads((run / "report.json").read_text())
    assert report["method"] == "diff-pruning" and set(report["groups"]) == {"female", "male"}
    assert 0 < report["fraction_changed"] <= 0.02
    assert report["stored_bytes"] < report["full_bytes"] / 3
    metrics = pd.read_csv(run / "metrics.csv")
    per_epoch = metrics.dropna(subset=["diff/nonzero_fraction"])
    assert per_epoch["epoch"].tolist() == [0, 1, 2]  # max_epochs raised from 1 to 2 + 1
    assert per_epoch["diff/stage"].tolist() == [1.0, 1.0, 2.0]
    assert per_epoch["diff/expected_l0"].iloc[-1] == pytest.approx(0.02, rel=1e-3)
    assert metrics["val/acc/female"].notna().any()
    penalty = metrics.dropna(subset=["train/l0_penalty"])  # logged by the model for the callback's loss term
    assert penalty["epoch"].tolist() == [0, 1] and (penalty["train/l0_penalty"] > 0).all()  # gated epochs only

    # The Lightning checkpoint reloads with its gates; the diff rebuilds the same model from the base.
    ckpt = next((run / "checkpoints").glob("*.ckpt"))
    trained = SequenceClassifier.load_from_checkpoint(ckpt).model
    restored = diff.load_diff(run / "diff")
    batch = val_batch(TextClassificationDataModule(bios_size=300, vocab_size_local=400, batch_size=16))  # the run's tokenizer
    assert torch.equal(logits(restored, batch), logits(trained, batch))


def test_compare_table_has_every_method(bios, tmp_path):
    table = compare_diff_pruning(tiny_module(bios), bios, target_fraction=0.05, epochs=1, finetune_epochs=1,
                                 output=tmp_path, trainer_kwargs={"accelerator": "cpu", "limit_train_batches": 2,
                                                                  "limit_val_batches": 2})
    assert list(table.index) == ["full-finetune", "finetune+magnitude", "diff-pruning"]
    assert {"accuracy", "acc/female", "acc/male", "fraction_changed", "stored_bytes"} <= set(table.columns)
    assert table.loc["full-finetune", "fraction_changed"] > 0.5
    assert table.loc["finetune+magnitude", "fraction_changed"] <= 0.05
    assert table.loc["diff-pruning", "fraction_changed"] <= 0.05
    assert (table.loc[["finetune+magnitude", "diff-pruning"], "stored_bytes"] < table.loc["full-finetune", "stored_bytes"]).all()


def test_diff_compare_command_writes_one_table(repo_root, tmp_path):
    from fairprune.cli.prune import main as prune_main

    overrides = ["--data.init_args.bios_size", "300", "--data.init_args.vocab_size_local", "400",
                 "--data.init_args.batch_size", "16", "--model.init_args.config", json.dumps(TINY)]
    status = prune_main(["diff-compare", "--train_config", str(repo_root / "configs/text/diffprune_bios_tiny.yaml"),
                         "--overrides", json.dumps(overrides), "--target_fraction", "0.05", "--epochs", "1",
                         "--finetune_epochs", "1", "--output", str(tmp_path),
                         "--trainer", json.dumps({"accelerator": "cpu", "limit_train_batches": 2, "limit_val_batches": 2})])
    assert status == 0
    table = pd.read_csv(tmp_path / "comparison.csv", index_col="method")
    assert list(table.index) == ["full-finetune", "finetune+magnitude", "diff-pruning"]
    assert table.loc["diff-pruning", "fraction_changed"] <= 0.05
    assert json.loads((tmp_path / "report.json").read_text())["comparison"][0]["method"] == "full-finetune"
