"""Shared-context scoring (:class:`fairprune.metrics.shared_context.SharedContextLM`) against its
oracle, lm-eval's own ``HFLM`` on the same model and requests: every request's log-likelihood
within 1e-4 (float32) and the same greedy flag, in the same order; tiny models of several families
(Llama, Qwen3, GPT-2, Gemma 2 with a sliding window of 4, Phi-3, Qwen3-MoE), batch sizes 1 and
more, requests that HFLM cuts from the left, one-token answers; the project's ``run_tasks`` on every
local task giving HFLM's figures; a streamed model; HFLM's partial-cache entries and progress bar."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import transformers as tf
from lm_eval.models.huggingface import HFLM

from fairprune.metrics import shared_context
from fairprune.metrics.harness import LOCAL_TASKS, TaskSpec, _manager, _quiet, bundled_data, run_tasks, task_config
from fairprune.metrics.shared_context import SharedContextLM
from tiny_models import MOE_SPECS, SPECS

ATOL = 1e-4  # float32: other matrix shapes and masked padding round differently, nothing more
FAMILIES = ("llama", "qwen3", "gpt2", "gemma2", "phi3", "qwen3_moe")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, one_thread):
    from fairprune.data.text import lm_corpus, train_bpe_tokenizer

    corpus = lm_corpus(train_docs=40, validation_docs=6, seed=3)
    return train_bpe_tokenizer(corpus.train, 300, tmp_path_factory.mktemp("tok"))


def tiny(model_type: str, tokenizer, positions: int = 512) -> tf.PreTrainedModel:
    """The tiny ``model_type`` (tests/tiny_models.py's shapes) for ``tokenizer``, ``positions`` long,
    its weights drawn wider than the default so that the answers' log-likelihoods differ."""
    torch.manual_seed(0)
    if model_type in MOE_SPECS:
        fields = dict(MOE_SPECS[model_type])
    else:
        fields = dict(SPECS[model_type][2])
    ids = dict(bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    length = {"n_positions": positions} if model_type == "gpt2" else {"max_position_embeddings": positions}
    config = tf.AutoConfig.for_model(model_type, **{**fields, "vocab_size": len(tokenizer), **ids, **length,
                                                    "initializer_range": 0.2})
    return tf.AutoModelForCausalLM.from_config(config).eval()


def scorers(model, tokenizer, batch_size: int, **shared) -> tuple[HFLM, SharedContextLM]:
    common = dict(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device="cpu", add_bos_token=True)
    return HFLM(**common), SharedContextLM(**common, **shared)


def assert_same(reference: list[tuple[float, bool]], got: list[tuple[float, bool]]) -> None:
    assert len(got) == len(reference)
    np.testing.assert_allclose([g[0] for g in got], [r[0] for r in reference], rtol=0, atol=ATOL)
    assert [g[1] for g in got] == [r[1] for r in reference]


@torch.no_grad()
def greedy(model, context: list[int], n: int) -> list[int]:
    """The model's ``n`` most likely next tokens after ``context``, one at a time (a plain loop)."""
    ids = list(context)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(context):]


def requests(model, vocab: int, longest: int, seed: int = 0) -> list:
    """Items of 1-12 answers after a shared context (one-token answers, long ones, a repeated
    request, the model's own greedy answer), some longer than ``longest + 1`` tokens together
    (HFLM cuts them from the left), one exactly that long; contexts that begin alike (a stem of 5,
    12 or 30 tokens and 0-12 of their own: one context the start of others), shuffled."""
    rng = random.Random(seed)
    stems = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 12, 30)]
    made = []
    for item in range(24):
        context = [rng.randrange(vocab) for _ in range(rng.choice([1, 3, 9, 20, 31, longest - 8, longest + 20]))]
        if item >= 12:
            context = stems[item % 3] + context[:(item // 3 - 4) * 4]
        answers = [[rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 4, 7, 15]))] for _ in range(rng.choice([1, 3, 4, 12]))]
        answers.append(greedy(model, context[-(longest - 4):], rng.choice([1, 3])))
        if item == 0:
            answers.append(answers[0])  # the same request twice
        if item == 1:
            answers.append([rng.randrange(vocab) for _ in range(longest + 1 - len(context))] or [1])
        made += [((f"context {item}", f"answer {k}"), context, answer) for k, answer in enumerate(answers)]
    rng.shuffle(made)
    return made


@pytest.mark.parametrize("family", FAMILIES)
def test_each_request_equals_hflms(family, tokenizer):
    """Hand-made requests, HFLM truncating some: the same answers at batch sizes 1, 5 and 16, the
    answers' rows split by length (a CPU's setting) or not (an accelerator's)."""
    model = tiny(family, tokenizer, positions=64)
    made = requests(model, len(tokenizer), 64)
    assert any(len(c) + len(a) > 65 for _, c, a in made) and any(len(a) == 1 for _, _, a in made)
    for batch_size, forward_tokens in ((1, None), (5, None), (16, None), (16, 4096)):
        hflm, shared = scorers(model, tokenizer, batch_size, forward_tokens=forward_tokens)
        reference = hflm._loglikelihood_tokens(made, disable_tqdm=True)
        assert_same(reference, shared._loglikelihood_tokens(made, disable_tqdm=True))
    assert any(r[1] for r in reference) and not all(r[1] for r in reference)  # both greedy flags occur
    assert len({round(r[0], 3) for r in reference}) > len(made) // 2  # the answers' likelihoods differ


def bundled_instances(limit: int) -> list:
    """The instances of every local task on the bundled sets, the first ``limit`` documents each."""
    data = bundled_data()
    with _quiet(False):
        tasks = _manager(False).load([task_config(name, data[fmt]) for name, (fmt, _) in LOCAL_TASKS.items()])["tasks"]
    instances = []
    for task in tasks.values():
        task.build_all_requests(limit=limit, rank=0, world_size=1)
        instances += task.instances
    return instances


@pytest.mark.parametrize("family", FAMILIES)
def test_bundled_tasks_requests_equal_hflms(family, tokenizer):
    """Every local task's requests on the bundled sets (a 160-token model: some are cut from the
    left); this tokenizer splits the letter answers into a space and the letter."""
    instances = bundled_instances(limit=6)
    model = tiny(family, tokenizer, positions=160)
    for batch_size in (1, 16) if family == "llama" else (16,):
        hflm, shared = scorers(model, tokenizer, batch_size)
        encoded = [hflm._encode_pair(*i.args) for i in instances if i.args[0]]  # crows_pairs: no context
        assert any(len(c) + len(a) > 161 for c, a in encoded) and any(len(c) + len(a) <= 161 for c, a in encoded)
        assert_same(hflm.loglikelihood(instances, disable_tqdm=True), shared.loglikelihood(instances, disable_tqdm=True))


def test_run_tasks_gives_hflms_figures_on_every_local_task(tokenizer, monkeypatch):
    """The project's lm-eval run (``run_tasks``) on every local task: HFLM's figures, sample for sample."""
    model = tiny("llama", tokenizer)
    data = bundled_data()
    specs = [TaskSpec(name, data[fmt], scoring) for name, (fmt, scoring) in LOCAL_TASKS.items()]
    got = run_tasks(model, tokenizer, specs, limit=10, progress=False)
    monkeypatch.setattr(shared_context, "SharedContextLM", HFLM)
    reference = run_tasks(model, tokenizer, specs, limit=10, progress=False)
    assert len(got.figures) >= len(LOCAL_TASKS)
    assert_close(got.figures, reference.figures)  # a choice changed would move an accuracy by 1/10
    assert_close(got.items.tasks, reference.items.tasks)


def leaves(tree, path=()) -> dict:
    """A nested structure's leaves by their path."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in leaves(sub, (*path, key)).items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in leaves(sub, (*path, i)).items()}
    return {path: tree}


def assert_close(got, reference) -> None:
    """Equal structures; numbers within :data:`ATOL` (NaN where the reference has NaN), the rest equal."""
    got, reference = leaves(got), leaves(reference)
    assert got.keys() == reference.keys()
    numbers = [k for k, v in reference.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    np.testing.assert_allclose([got[k] for k in numbers], [reference[k] for k in numbers], rtol=0, atol=ATOL)
    assert {k: v for k, v in got.items() if k not in numbers} == {k: v for k, v in reference.items() if k not in numbers}


class _Recorder:
    """lm-eval's cache hook's place: what the scorer hands it."""

    def __init__(self):
        self.partial = []

    def add_partial(self, kind, request, answer):
        self.partial.append((kind, request, answer))


def test_partial_cache_entries_and_progress_bar_are_hflms(tokenizer, capsys):
    model = tiny("qwen3", tokenizer, positions=64)
    made = requests(model, len(tokenizer), 64, seed=1)
    hflm, shared = scorers(model, tokenizer, 4)
    hflm.cache_hook, shared.cache_hook = _Recorder(), _Recorder()
    hflm._loglikelihood_tokens(made)
    shared._loglikelihood_tokens(made)
    reference = sorted(hflm.cache_hook.partial, key=lambda e: (e[1], e[2][0]))
    got = sorted(shared.cache_hook.partial, key=lambda e: (e[1], e[2][0]))
    assert [(k, r) for k, r, _ in got] == [(k, r) for k, r, _ in reference] and len(got) == len(made)
    assert_same([a for _, _, a in reference], [a for _, _, a in got])
    bars = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "Running loglikelihood" in line]
    assert any(f"{len(made)}/{len(made)}" in line for line in bars)
    shared._loglikelihood_tokens(made, disable_tqdm=True)
    assert "Running loglikelihood" not in capsys.readouterr().err


def test_a_model_whose_forward_takes_no_cache_is_scored_by_hflms_path(tokenizer):
    class NoCache(tf.LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, **kwargs):  # noqa: D102 - no cache, no positions
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)

    torch.manual_seed(0)
    model = NoCache(tiny("llama", tokenizer, positions=64).config).eval()
    made = requests(model, len(tokenizer), 64, seed=2)
    hflm, shared = scorers(model, tokenizer, 4)
    assert shared._forward_names() is None
    assert shared._loglikelihood_tokens(made, disable_tqdm=True) == hflm._loglikelihood_tokens(made, disable_tqdm=True)


def test_a_streamed_model_gives_hflms_answers_in_fewer_forwards(tokenizer, tmp_path):
    """A streamed model (parameters on ``meta``, each part read from its files as the forward
    reaches it): the in-memory model's HFLM answers, each block read fewer times."""
    from fairprune.causal.streamed import StreamedModel

    model = tiny("llama", tokenizer, positions=160)
    model.save_pretrained(tmp_path / "lm")
    instances = [i for i in bundled_instances(limit=6) if i.task_name in ("bbq_ambig_cloze3", "hellaswag")]
    hflm, _ = scorers(model, tokenizer, 8)
    reference = hflm.loglikelihood(instances, disable_tqdm=True)
    streamed = StreamedModel(tmp_path / "lm")
    reads = []
    streamed.blocks[0].register_forward_pre_hook(lambda *_: reads.append(1))
    answers = {}
    for kind in (HFLM, SharedContextLM):
        reads.clear()
        with streamed.runnable("cpu") as runnable:
            lm = kind(pretrained=runnable, tokenizer=tokenizer, batch_size=8, device="cpu", add_bos_token=True)
            lm._device = torch.device("cpu")
            answers[kind] = (lm.loglikelihood(instances, disable_tqdm=True), len(reads))
    assert_same(reference, answers[SharedContextLM][0])
    assert_same(reference, answers[HFLM][0])
    assert answers[SharedContextLM][1] < answers[HFLM][1]
    assert all(p.device.type == "meta" for p in streamed.model.parameters())
