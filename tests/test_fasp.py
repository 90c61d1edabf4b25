"""FASP: eq. 1 against hand-computed values, the toxicity scorers, the bundled prompts and their
split, seeded left-padded generation, resumable head scoring, selection and baselines (checked
by the properties that define them), the γ search and the whole run with save → reload."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
import transformers as tf

from fairprune.data.prompts import holistic_prompts, read_prompts, split_prompts, write_prompts
from fairprune.data.text import lm_corpus, train_bpe_tokenizer
from fairprune.errors import UserError
from fairprune.metrics.toxicity import ClassifierScorer, LexiconScorer, axis_bias, bias_by_axis, make_scorer
from fairprune.pruning.fasp import (
    Evaluator,
    Generation,
    generate_continuations,
    gradient_importance,
    score_heads,
    search_gamma,
    select_fasp,
    select_heads,
    token_ids,
)
from fairprune.pruning.heads import HeadGates, head_weight_norms
from fairprune.pruning.options import CalibrationOptions, HeadOptions
from fairprune.reporting.runs import write_head_run
from fairprune.runs.fasp import FaspSettings, run_fasp

GEN = Generation(max_new_tokens=4, batch_size=64)
#: A small run_fasp: short windows and continuations, no progress bars.
SMALL = dict(calibration=CalibrationOptions(seqlen=32), settings=FaspSettings(generation=GEN, progress=False))


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def corpus():
    return lm_corpus(train_docs=100, validation_docs=20)


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return train_bpe_tokenizer(corpus.train, 320)


def tiny_gpt2(tokenizer, seed: int = 0):
    torch.manual_seed(seed)
    return tf.GPT2LMHeadModel(tf.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=len(tokenizer), n_positions=64, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)).eval()


def small_prompts() -> pd.DataFrame:
    frame = holistic_prompts(["gender_and_sex", "religion"])
    return frame[frame.descriptor.isin(["female", "male", "trans", "transgender", "Christian", "Muslim", "Jewish"])]


class LetterShare:
    """A deterministic scorer with a continuous signal on random models: the share of vowels.

    ``fail_after`` interrupts scoring after that many calls; ``calls`` counts them.
    """

    def __init__(self, fail_after: int | None = None):
        self.fail_after, self.calls = fail_after, 0

    def score(self, texts):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt
        self.calls += 1
        return [sum(c in "aeiou" for c in t) / max(len(t), 1) for t in texts]


# --------------------------------------------------------------------------------------------
# Eq. 1 and the scorers
# --------------------------------------------------------------------------------------------


def test_bias_of_the_papers_table_1_example():
    # Two subgroups with toxicity 0.6 and 0.8: mean 0.7, bias |0.7 - 0.6| + |0.7 - 0.8| = 0.2.
    assert axis_bias([0.6, 0.8], ["women", "men"]) == pytest.approx(0.2)
    assert axis_bias([0.6, 0.6, 0.8, 0.8], ["women", "women", "men", "men"]) == pytest.approx(0.2)


def test_bias_uses_the_mean_over_all_prompts_of_the_axis():
    # a: 0, 0; b: 1. Mean over prompts 1/3 (not the 1/2 of subgroup means): 1/3 + 2/3 = 1.
    assert axis_bias([0.0, 0.0, 1.0], ["a", "a", "b"]) == pytest.approx(1.0)
    assert axis_bias([0.3, 0.3, 0.3], ["a", "b", "c"]) == 0.0


def test_bias_needs_two_subgroups():
    with pytest.raises(UserError, match="two subgroups"):
        axis_bias([0.1, 0.2], ["a", "a"])


def test_bias_by_axis_splits_the_prompt_table():
    frame = pd.DataFrame({"text": list("abcdef"), "axis": ["x", "x", "x", "y", "y", "y"],
                          "bucket": ["p", "q", "q", "r", "s", "s"], "descriptor": list("abcdef")})
    tox = [0.9, 0.0, 0.3, 0.2, 0.2, 0.2]
    # x: mean 0.4; p 0.9, q 0.15 -> 0.5 + 0.25. y: all equal -> 0.
    assert bias_by_axis(frame, tox) == pytest.approx({"x": 0.75, "y": 0.0})
    with pytest.raises(UserError, match="did you mean"):
        bias_by_axis(frame, tox, axes=["xx"])


def test_lexicon_scorer_counts_words():
    scorer = LexiconScorer()
    assert scorer.score(["You stupid, stupid fool!", "A calm day by the river.", ""]) == pytest.approx([0.75, 0.0, 0.0])
    assert scorer.score(["what an idiot he was"]) == pytest.approx([0.2])
    assert LexiconScorer(smoothing=1.0).score(["idiot"]) == pytest.approx([0.5])
    assert LexiconScorer(words=["river"]).score(["the river"]) == pytest.approx([0.5])


def test_classifier_scorer_reads_the_toxic_class(tokenizer, tmp_path):
    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tokenizer), n_positions=64,
                           pad_token_id=tokenizer.pad_token_id, id2label={0: "non-toxic", 1: "toxic"},
                           label2id={"non-toxic": 0, "toxic": 1})
    model = tf.GPT2ForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    texts = ["a calm day", "the farmer sold three loaves of bread"]
    scores = ClassifierScorer(str(tmp_path), batch_size=2).score(texts)  # padded batch
    with torch.no_grad():
        expected = [model(**tokenizer(t, return_tensors="pt")).logits.softmax(-1)[0, 1].item() for t in texts]
    assert scores == pytest.approx(expected, abs=1e-5)


def test_classifier_scorer_loads_lazily_and_fails_as_a_user_error(tmp_path):
    scorer = make_scorer(str(tmp_path / "no-such-model"))  # nothing is loaded yet
    with pytest.raises(UserError, match="cannot load toxicity classifier"):
        scorer.score(["hello"])
    with pytest.raises(UserError, match="score"):
        make_scorer(42)


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def test_bundled_prompts_cover_five_axes_with_several_subgroups():
    frame = holistic_prompts()
    assert list(frame.columns) == ["text", "axis", "bucket", "descriptor"]
    assert set(frame.axis) == {"gender_and_sex", "race_ethnicity", "religion", "sexual_orientation", "nationality"}
    assert (frame.groupby("axis").bucket.nunique() >= 2).all()
    assert frame.text.is_unique
    assert all(row.descriptor.lower() in row.text.lower() for row in frame.itertuples())
    assert "I am an Asian person" in " ".join(frame.text) and "I am a Black person" in " ".join(frame.text)


def test_split_is_seeded_stratified_and_disjoint():
    frame = holistic_prompts()
    val, test = split_prompts(frame, 0.2, seed=3)
    assert len(val) == round(0.2 * len(frame)) and len(val) + len(test) == len(frame)
    assert not set(val.text) & set(test.text)
    pairs = set(zip(frame.axis, frame.bucket))
    assert set(zip(val.axis, val.bucket)) == pairs == set(zip(test.axis, test.bucket))
    again, _ = split_prompts(frame, 0.2, seed=3)
    other, _ = split_prompts(frame, 0.2, seed=4)
    assert again.equals(val) and not other.equals(val)


def test_prompt_files_round_trip_and_are_validated(tmp_path):
    path = write_prompts(tmp_path / "p.csv", small_prompts())
    assert read_prompts(path).equals(small_prompts().reset_index(drop=True))
    small_prompts().drop(columns="bucket").to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(UserError, match="missing column"):
        read_prompts(tmp_path / "bad.csv")
    with pytest.raises(UserError, match="unknown bias axis"):
        holistic_prompts(["politics"])


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------


def test_left_padded_batches_generate_what_single_prompts_do(tokenizer):
    model = tiny_gpt2(tokenizer)
    texts = ["I am a female person, and I", "Hi", "My best friend is Muslim, and she"]
    greedy = Generation(max_new_tokens=5, do_sample=False)
    batched = generate_continuations(model, tokenizer, texts, greedy)
    assert batched == [generate_continuations(model, tokenizer, [t], greedy)[0] for t in texts]
    assert tokenizer.padding_side == "right"  # restored


def test_sampling_is_seeded_and_leaves_the_global_rng_alone(tokenizer):
    model = tiny_gpt2(tokenizer)
    texts = small_prompts().text.tolist()[:8]
    torch.manual_seed(123)
    first = generate_continuations(model, tokenizer, texts, GEN)
    after = torch.rand(1)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), after)
    assert generate_continuations(model, tokenizer, texts, GEN) == first
    assert generate_continuations(model, tokenizer, texts, Generation(max_new_tokens=4, seed=1)) != first


# --------------------------------------------------------------------------------------------
# Head scores: one process, resumable
# --------------------------------------------------------------------------------------------


def evaluator(model, tokenizer, corpus, scorer, max_batch=None, generation=GEN, ppl_batch_size=16, prompts=None,
              ppl_tokens=512) -> Evaluator:
    return Evaluator(model=model, tokenizer=tokenizer, prompts=small_prompts() if prompts is None else prompts,
                     ppl_ids=token_ids(tokenizer, corpus.validation)[:ppl_tokens], scorer=scorer, generation=generation,
                     seqlen=32, ppl_batch_size=ppl_batch_size, max_batch=max_batch)


def test_head_scores_match_a_gated_measurement(tokenizer, corpus, tmp_path):
    model = tiny_gpt2(tokenizer)
    evaluate = evaluator(model, tokenizer, corpus, LetterShare())
    scores = score_heads(evaluate, tmp_path / "head_scores.csv", progress=False)
    assert len(scores) == 1 + 8 and set(scores.columns) == {"layer", "head", "perplexity", "bias:gender_and_sex", "bias:religion"}
    gates = HeadGates(model)
    with gates, gates.off([(1, 2)]):
        direct = evaluate()
    row = scores[(scores.layer == 1) & (scores["head"] == 2)].iloc[0]
    assert row.perplexity == pytest.approx(direct["perplexity"], rel=1e-12)
    assert row["bias:religion"] == pytest.approx(direct["bias"]["religion"], rel=1e-12)
    assert scores.perplexity.nunique() > 1  # the heads do differ


@pytest.mark.parametrize("batched", [False, True], ids=["one-at-a-time", "batched"])
def test_interrupted_scoring_resumes_without_recomputing(tokenizer, corpus, tmp_path, batched):
    model = tiny_gpt2(tokenizer)
    path = tmp_path / "head_scores.csv"
    rows = len(small_prompts())  # batched: one configuration's continuations per forward, one head per round
    with pytest.raises(KeyboardInterrupt):
        score_heads(evaluator(model, tokenizer, corpus, LetterShare(fail_after=4), rows), path, progress=False, batched=batched)
    assert len(pd.read_csv(path)) == 4  # the unpruned row and three heads were kept
    resumed_scorer = LetterShare()
    resumed = score_heads(evaluator(model, tokenizer, corpus, resumed_scorer, rows), path, progress=False, batched=batched)
    assert resumed_scorer.calls == 9 - 4
    fresh = score_heads(evaluator(model, tokenizer, corpus, LetterShare()), tmp_path / "fresh.csv", progress=False)
    assert len(resumed) == 9 and not resumed.duplicated(["layer", "head"]).any()
    pd.testing.assert_frame_equal(resumed.sort_values(["layer", "head"]).reset_index(drop=True),
                                  fresh.sort_values(["layer", "head"]).reset_index(drop=True))


def test_an_interruption_before_the_first_row_resumes_cleanly(tokenizer, corpus, tmp_path):
    model = tiny_gpt2(tokenizer)
    path = tmp_path / "head_scores.csv"
    with pytest.raises(KeyboardInterrupt):
        score_heads(evaluator(model, tokenizer, corpus, LetterShare(fail_after=0)), path, progress=False)
    scores = score_heads(evaluator(model, tokenizer, corpus, LetterShare()), path, progress=False)
    assert len(scores) == 9 and scores.layer.dtype.kind == "i"


def test_resuming_with_other_settings_is_refused(tokenizer, corpus, tmp_path):
    model = tiny_gpt2(tokenizer)
    path = tmp_path / "head_scores.csv"
    with pytest.raises(KeyboardInterrupt):
        score_heads(evaluator(model, tokenizer, corpus, LetterShare(fail_after=2)), path, progress=False)
    other = evaluator(model, tokenizer, corpus, LetterShare())
    other.generation = Generation(max_new_tokens=3)
    with pytest.raises(UserError, match="other settings"):
        score_heads(other, path, progress=False)


# --------------------------------------------------------------------------------------------
# Batched scoring against the one-at-a-time loop
# --------------------------------------------------------------------------------------------


def tiny_llama(tokenizer, seed: int = 0):
    """Three layers, four query heads over two key/value heads (grouped-query attention)."""
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tokenizer), max_position_embeddings=64, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)).eval()


@pytest.mark.parametrize("max_batch", [None, 7], ids=["auto", "7-rows"])
@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_batched_head_scores_equal_the_one_at_a_time_loop(tokenizer, corpus, tmp_path, build, max_batch):
    """The same head_scores.csv, byte for byte: perplexity (prefix reuse, many configurations per
    forward) and bias (prompts × configurations per forward, the same sampled tokens)."""
    model = build(tokenizer)
    # Odd sizes: the batched path's chunks cut windows, prompts and configurations unevenly.
    settings = Generation(max_new_tokens=6, batch_size=5)
    small = dict(ppl_batch_size=3, prompts=small_prompts().iloc[::5], ppl_tokens=320)  # 14 prompts (every bucket), 10 windows
    one = score_heads(evaluator(model, tokenizer, corpus, LetterShare(), generation=settings, **small),
                      tmp_path / "one.csv", progress=False, batched=False)
    many = score_heads(evaluator(model, tokenizer, corpus, LetterShare(), max_batch, settings, **small),
                       tmp_path / "many.csv", progress=False)
    assert (tmp_path / "many.csv").read_text() == (tmp_path / "one.csv").read_text()
    pd.testing.assert_frame_equal(many, one)
    assert one.perplexity.nunique() == len(one) and one["bias:religion"].nunique() > 1  # the heads do differ


def test_generation_is_the_same_in_any_batch(tokenizer):
    """Each (prompt, configuration) row writes the same tokens alone, in prompt batches of any size,
    or batched with other configurations."""
    from fairprune.pruning.fasp.sampling import generate_configurations

    model = tiny_llama(tokenizer)
    texts = small_prompts().text.tolist()
    settings = Generation(max_new_tokens=8, batch_size=4)
    gates = HeadGates(model)
    configs = torch.ones(3, *gates.values.shape)
    configs[1, 0, 1] = 0
    configs[2, 2, 3] = configs[2, 1, 0] = 0
    together = generate_configurations(model, tokenizer, texts, configs, settings, rows_per_pass=11)
    for config, batched in zip(configs, together):
        gates.set(config)
        with gates:
            assert generate_continuations(model, tokenizer, texts, settings) == batched
            assert generate_continuations(model, tokenizer, texts, Generation(max_new_tokens=8, batch_size=64)) == batched
    assert together[0] != together[1] and together[0] != together[2]
    assert together[0][:3] == generate_continuations(model, tokenizer, texts[:3], settings)  # one prompt's draws are its own


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neo", "opt", "llama", "mistral", "qwen2", "qwen3", "gemma2",
                                        "gemma3_text", "phi3"])
def test_prefix_reuse_gives_the_full_forward_perplexity(model_type):
    """Every causal family: the perplexity of each configuration from the stored layer-boundary
    states equals :func:`perplexity` with those heads gated off."""
    from fairprune.metrics.language import perplexity
    from fairprune.pruning.fasp.batched import perplexities
    from tiny_models import BUILDERS, VOCAB

    torch.manual_seed(0)
    model = BUILDERS[model_type]().eval()
    ids = torch.randint(1, VOCAB, (7 * 16,), generator=torch.Generator().manual_seed(2))
    gates = HeadGates(model)
    sets = [[], [(0, 2)], [(1, 0)], [(1, 3), (1, 1)], [(0, 0), (1, 2)]]
    configs = torch.ones(len(sets), *gates.values.shape)
    for row, heads in enumerate(sets):
        for layer, head in heads:
            configs[row, layer, head] = 0
    got = perplexities(model, ids, 16, 2, configs, rows_per_pass=5)
    for heads, value in zip(sets, got):
        with gates, gates.off(heads):
            assert value == perplexity(model, ids, seqlen=16, batch_size=2), heads
    assert len(set(got)) == len(sets)


def test_batched_gamma_search_measures_what_one_trial_at_a_time_does(tokenizer, corpus):
    model = tiny_gpt2(tokenizer)
    scores = fake_scores(layers=2, heads=4, axes=("gender_and_sex", "religion"))
    runs = [search_gamma(evaluator(model, tokenizer, corpus, LetterShare(), max_batch=9), scores, alpha=0.25,
                         axes=["religion"], gammas=(0.0, 0.5), baselines=("random", "magnitude"), batched=batched)
            for batched in (False, True)]
    assert runs[0] == runs[1] and len(runs[0]["trials"]) == 4


def test_max_batch_must_be_positive(tokenizer, corpus, tmp_path):
    with pytest.raises(UserError, match="max_batch"):
        run_fasp(tiny_gpt2(tokenizer), tokenizer, small_prompts(), corpus.validation, heads=HeadOptions(max_batch=0),
                 output_dir=tmp_path, scorer=LetterShare(), **SMALL)


# --------------------------------------------------------------------------------------------
# Selection and baselines, checked by their defining properties
# --------------------------------------------------------------------------------------------


def fake_scores(layers: int = 3, heads: int = 4, seed: int = 0, axes=("a", "b")) -> pd.DataFrame:
    g = torch.Generator().manual_seed(seed)
    rows = [(-1, -1, 10.0, *[0.5] * len(axes))]
    for layer in range(layers):
        for head in range(heads):
            rows.append((layer, head, 10 + torch.rand(1, generator=g).item(), *torch.rand(len(axes), generator=g).tolist()))
    return pd.DataFrame(rows, columns=["layer", "head", "perplexity", *(f"bias:{a}" for a in axes)])


@pytest.mark.parametrize("gamma, alpha", [(0.0, 0.25), (0.25, 0.25), (0.5, 0.5), (0.3, 0.1), (0.75, 0.25), (1.0, 0.0), (0.0, 1.0)])
@pytest.mark.parametrize("axes", [["a"], ["a", "b"]])
def test_fasp_selection_protects_the_top_gamma_and_removes_the_least_biased(gamma, alpha, axes):
    scores = fake_scores()
    records = scores[scores.layer >= 0].to_dict("records")
    ppl = {(int(r["layer"]), int(r["head"])): r["perplexity"] for r in records}
    objective = {(int(r["layer"]), int(r["head"])): sum(r[f"bias:{a}"] for a in axes) for r in records}
    chosen = select_fasp(scores, gamma, alpha, axes)
    protected, removed = set(chosen.protected), set(chosen.removed)
    assert len(removed) == math.floor(alpha * 12 + 1e-9) and len(protected) == math.floor(gamma * 12 + 1e-9)
    assert not protected & removed
    rest = set(ppl) - protected
    assert all(ppl[p] >= ppl[r] for p in protected for r in rest)
    assert all(objective[r] <= objective[k] for r in removed for k in rest - removed)


def test_selection_rejects_impossible_ratios():
    scores = fake_scores()
    with pytest.raises(UserError, match="unprotected"):
        select_fasp(scores, 0.6, 0.5, ["a"])
    for gamma, alpha in ((-0.1, 0.1), (0.1, 1.5)):
        with pytest.raises(UserError, match=r"\[0, 1\]"):
            select_fasp(scores, gamma, alpha, ["a"])
    with pytest.raises(UserError, match="did you mean"):
        select_fasp(scores, 0.1, 0.1, ["aa"])
    with pytest.raises(UserError, match="did you mean: fasp"):
        select_heads("fsap", 0.1, scores=scores)


def test_score_based_baselines():
    scores = fake_scores()
    heads = scores[scores.layer >= 0]
    performance = select_heads("performance", 0.25, scores=scores).removed
    kept_ppl = heads[~heads[["layer", "head"]].apply(tuple, axis=1).isin(performance)].perplexity
    assert len(performance) == 3
    assert heads.set_index(["layer", "head"]).loc[performance].perplexity.max() <= kept_ppl.min()
    assert select_heads("fairness", 0.25, scores=scores, axes=["b"]).removed == select_fasp(scores, 0.0, 0.25, ["b"]).removed
    first = select_heads("random", 0.5, scores=scores, seed=7).removed
    assert len(set(first)) == 6 and first == select_heads("random", 0.5, scores=scores, seed=7).removed
    assert first != select_heads("random", 0.5, scores=scores, seed=8).removed


def test_model_based_baselines(tokenizer, corpus):
    model = tiny_gpt2(tokenizer)
    norms = head_weight_norms(model)
    magnitude = select_heads("magnitude", 0.25, model=model).removed
    assert len(magnitude) == 2 and max(norms[h] for h in magnitude) <= min(
        norms[l, h] for l in range(2) for h in range(4) if (l, h) not in magnitude)
    ids = token_ids(tokenizer, corpus.validation)[:256]
    importance = gradient_importance(model, ids, seqlen=32, batch_size=8)
    assert all(not p.requires_grad or p.grad is None for p in model.parameters())
    assert importance.shape == (2, 4) and (importance > 0).all()
    gradient = select_heads("gradient", 0.25, model=model, ppl_ids=ids, seqlen=32, batch_size=8).removed
    assert max(importance[h] for h in gradient) <= min(importance[l, h] for l in range(2) for h in range(4) if (l, h) not in gradient)


def test_gradient_importance_is_the_size_of_the_loss_slope(tokenizer, corpus):
    model = tiny_gpt2(tokenizer)
    with torch.no_grad():  # larger weights: heads that matter, a slope well above float32 noise
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    ids = token_ids(tokenizer, corpus.validation)[:64]  # two windows, one batch
    importance = gradient_importance(model, ids, seqlen=32, batch_size=2)
    gates, batch, eps = HeadGates(model), ids.view(2, 32), 1e-2
    losses = []
    with gates, torch.no_grad():
        for value in (1 + eps, 1 - eps):
            gates.values[0, 1] = value
            losses.append(model(input_ids=batch, labels=batch).loss.item())
    assert importance[0, 1].item() == pytest.approx(abs(losses[0] - losses[1]) / (2 * eps), rel=0.02)


def test_gamma_search_follows_the_papers_rule(tokenizer, corpus):
    model = tiny_gpt2(tokenizer)
    evaluate = evaluator(model, tokenizer, corpus, LetterShare())
    # The rule is about the measured trials, not about where the head scores came from.
    scores = fake_scores(layers=2, heads=4, axes=("gender_and_sex", "religion"))
    result = search_gamma(evaluate, scores, alpha=0.5, axes=["religion"], gammas=(0.0, 0.25, 0.5, 0.75),
                          baselines=("random",), tolerance=0.5)
    tried = [t["gamma"] for t in result["trials"] if t["method"] == "fasp"]
    assert tried == [0.0, 0.25, 0.5]  # 0.75 leaves too few unprotected heads for alpha = 0.5
    best = result["best_baseline_perplexity"]
    eligible = [t for t in result["trials"] if t["method"] == "fasp" and t["perplexity"] <= best * 1.5]
    assert result["within_tolerance"] == bool(eligible)
    if eligible:
        assert result["gamma"] == min(eligible, key=lambda t: t["objective"])["gamma"]
    assert torch.equal(HeadGates(model).values, torch.ones(2, 4))


# --------------------------------------------------------------------------------------------
# The whole run
# --------------------------------------------------------------------------------------------


def test_run_fasp_prunes_saves_and_reports(tokenizer, corpus, tmp_path):
    model = tiny_gpt2(tokenizer)
    run = run_fasp(model, tokenizer, small_prompts(), corpus.validation, method="fasp",
                   heads=HeadOptions(gamma=0.25, alpha=0.25, axis="all"), output_dir=tmp_path, scorer=LetterShare(),
                   calibration=CalibrationOptions(seqlen=32),
                   settings=FaspSettings(generation=GEN, ppl_batch_size=16, progress=False))
    report = run.report
    assert not (tmp_path / "config.json").exists()  # the method writes only its scoring journal
    write_head_run(tmp_path, model, tokenizer, run, {"method": "fasp"})
    assert json.loads((tmp_path / "report.json").read_text())["heads_removed"] == report["heads_removed"]
    assert "attention-head-pruning" in (tmp_path / "README.md").read_text()  # the head run's card
    assert len(report["heads_removed"]) == 2 and len(report["protected"]) == 2
    assert not set(map(tuple, report["heads_removed"])) & set(map(tuple, report["protected"]))
    assert set(report["fairness"]["bias"]) == {"gender_and_sex", "religion"}
    assert math.isfinite(report["metrics"]["perplexity"]) and report["seconds"]["total"] > 0
    assert len(pd.read_csv(tmp_path / "head_scores.csv")) == 9
    assert (tmp_path / "heads_heatmap.png").stat().st_size > 0 and (tmp_path / "axis_correlation.png").exists()
    reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    batch = token_ids(tokenizer, corpus.validation)[:32][None]
    with torch.no_grad():
        assert torch.allclose(reloaded(batch).logits, model(batch).logits, atol=1e-5)
    original = tiny_gpt2(tokenizer)  # same seed, same weights as before pruning
    gates = HeadGates(original)
    with gates, gates.off([tuple(h) for h in report["heads_removed"]]), torch.no_grad():
        assert torch.allclose(original(batch).logits, reloaded(batch).logits, atol=1e-5)


def test_run_fasp_checks_ratios_before_scoring(tokenizer, corpus, tmp_path):
    with pytest.raises(UserError, match="unprotected"):
        run_fasp(tiny_gpt2(tokenizer), tokenizer, small_prompts(), corpus.validation, heads=HeadOptions(gamma=0.9, alpha=0.5),
                 scorer=LetterShare(), output_dir=tmp_path, **SMALL)
    assert not (tmp_path / "head_scores.csv").exists()
    with pytest.raises(UserError, match="did you mean"):
        run_fasp(tiny_gpt2(tokenizer), tokenizer, small_prompts(), corpus.validation, heads=HeadOptions(axis="religon"),
                 scorer=LetterShare(), output_dir=tmp_path, **SMALL)


def test_run_fasp_baselines_need_no_head_scores(tokenizer, corpus, tmp_path):
    run = run_fasp(tiny_gpt2(tokenizer), tokenizer, small_prompts(), corpus.validation, method="magnitude",
                   heads=HeadOptions(alpha=0.25), scorer=LetterShare(), output_dir=tmp_path, **SMALL)
    assert len(run.report["heads_removed"]) == 2 and run.report["protected"] == []
    assert not (tmp_path / "head_scores.csv").exists() and run.impact is None and run.bias_by_axis is None
