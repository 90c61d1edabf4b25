"""Language metrics and text data: perplexity against a plain per-token loop, the stereotype
score on pairs with a known answer, the StereoSet / CrowS-Pairs readers, the bundled corpus and
pair set, the BPE tokenizer and the calibration batches."""

from __future__ import annotations

import copy
import json
import math
import pickle

import numpy as np
import pytest
import torch
import transformers as tf
from torch import nn

from fairprune.data.pairs import Pair, read_crows_pairs, read_pairs, read_stereoset
from fairprune.data.text import (
    calibration_ids,
    encode_sentence,
    lm_corpus,
    paired_ids,
    stereo_pairs,
    train_bpe_tokenizer,
    write_lm_corpus,
    write_stereo_set,
)
from fairprune.errors import UserError
from fairprune.metrics.language import (
    measure_lm,
    perplexity,
    sentence_log_likelihoods,
    stereotype_score,
    stereotype_scores,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def corpus():
    return lm_corpus(train_docs=300, validation_docs=40)


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory):
    return train_bpe_tokenizer(corpus.train, 400, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=len(tokenizer), n_positions=64,
                           bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    return tf.GPT2LMHeadModel(config).eval()


# --------------------------------------------------------------------------------------------
# Perplexity
# --------------------------------------------------------------------------------------------


def plain_perplexity(model, ids: torch.Tensor, seqlen: int) -> float:
    """One window at a time, one token at a time: -log softmax of the next token."""
    nll, count = 0.0, 0
    for w in range(len(ids) // seqlen):
        window = ids[w * seqlen : (w + 1) * seqlen]
        with torch.no_grad():
            logits = model(window[None]).logits[0].double()
        for t in range(seqlen - 1):
            nll -= float(torch.log_softmax(logits[t], -1)[window[t + 1]])
            count += 1
    return math.exp(nll / count)


def test_perplexity_matches_plain_loop(model, tokenizer, corpus):
    docs = corpus.validation.split("\n\n")[:6]
    ids = tokenizer("\n\n".join(docs), return_tensors="pt").input_ids[0]
    want = plain_perplexity(model, ids, 32)
    assert perplexity(model, docs, tokenizer, seqlen=32) == pytest.approx(want, rel=1e-6)
    assert perplexity(model, ids, seqlen=32, batch_size=3) == pytest.approx(want, rel=1e-6)
    # An untrained model is close to uniform over the vocabulary.
    assert 0.5 * len(tokenizer) < want < 2 * len(tokenizer)


def test_perplexity_rejects_bad_inputs(model, tokenizer):
    with pytest.raises(UserError, match="fewer than one window"):
        perplexity(model, "too short", tokenizer, seqlen=32)
    with pytest.raises(UserError, match="context length"):
        perplexity(model, torch.arange(500) % 100, seqlen=128)
    with pytest.raises(UserError, match="tokenizer"):
        perplexity(model, "some text", None, seqlen=8)


@pytest.mark.parametrize("seqlen", [1, -3])
def test_perplexity_window_needs_two_tokens(model, seqlen):
    """A one-token window predicts nothing: refused, not a division by zero."""
    with pytest.raises(UserError, match="at least 2 tokens"):
        perplexity(model, torch.arange(40) % 50, seqlen=seqlen)


@pytest.mark.parametrize("command", [["evaluate", "--eval_seqlen", "1"], ["sparsegpt", "--nsamples", "1", "--seqlen", "1"]])
def test_lm_commands_refuse_windows_below_two_tokens(model, tokenizer, corpus, tmp_path, capsys, command):
    """Refused where the options enter, before anything is loaded or written: one line, exit 2."""
    from fairprune.cli.prune import main as prune_main

    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "eval.txt").write_text(corpus.validation)
    args = [*command, "--model", str(tmp_path / "model"), "--device", "cpu", "--eval_text", str(tmp_path / "eval.txt"),
            "--output", str(tmp_path / "out")]
    capsys.readouterr()
    assert prune_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and command[-2] in err[0], err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# Stereotype score
# --------------------------------------------------------------------------------------------


def unigram_lm(vocab: int, logits: torch.Tensor) -> nn.Module:
    """A real causal LM (Llama) whose next-token distribution is fixed, so log-likelihoods are known
    in closed form: every token embeds to ones, the blocks add nothing (their output projections
    are zero), the final norm keeps ones, and the head's rows are ``logits / hidden``."""
    hidden = 8
    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=16, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if "norm" in name or "embed" in name else 0.0)
        model.lm_head.weight.copy_((logits / hidden)[:, None].expand(vocab, hidden))
    return model


def test_stereotype_score_known_answer(tokenizer):
    she, he = tokenizer.convert_tokens_to_ids(["Ġshe", "Ġhe"])
    assert tokenizer.unk_token_id not in (she, he) and she != he
    logits = torch.zeros(len(tokenizer))
    logits[she] = 4.0  # " she" is far more likely than " he"; everything else is equal
    lm = unigram_lm(len(tokenizer), logits)
    pairs = [
        ("The nurse said that she left.", "The nurse said that he left."),  # stereotype wins
        ("The cashier knew she was late.", "The cashier knew he was late."),  # stereotype wins
        ("The pilot said that he left.", "The pilot said that she left."),  # anti wins
        ("The clerk left.", "The clerk left."),  # tie: neutral, counts 0 (as in the CrowS-Pairs metric)
    ]
    assert stereotype_score(lm, tokenizer, pairs) == pytest.approx((1 + 1 + 0 + 0) / 4)


def test_stereotype_score_is_the_crows_pairs_metric(model, tokenizer, tmp_path):
    """A CrowS-Pairs file of both kinds, scored by a real tiny model whose sentence log-likelihoods
    decide each row: a row counts when sent_more is the likelier sentence, whatever its direction;
    an equal pair is neutral and counts 0 in the headline (wins / all rows); each direction's part
    is its wins over its decided (non-neutral) rows."""
    sentences = [s for pair in stereo_pairs()[:12] for s in pair]
    ll = dict(zip(sentences, sentence_log_likelihoods(model, tokenizer, sentences).tolist()))
    ordered = [(a, b) if ll[a] > ll[b] else (b, a) for a, b in stereo_pairs()[:12] if abs(ll[a] - ll[b]) > 0.01]
    (w1, w2, w3, w4, w5, w6), (same, _) = ordered[:6], ordered[6]  # (likelier, less likely) each
    rows = [(*w1, "stereo"), (*w2, "stereo"), (w3[1], w3[0], "stereo"),  # stereo: 2 of 3 sent_more wins
            (*w4, "antistereo"), (w5[1], w5[0], "antistereo"), (w6[1], w6[0], "antistereo"),  # anti: 1 of 3
            (same, same, "stereo"), (same, same, "antistereo")]  # neutral
    path = tmp_path / "crows.csv"
    path.write_text("sent_more,sent_less,stereo_antistereo\n" + "".join(f'"{m}","{s}",{d}\n' for m, s, d in rows))
    pairs = read_pairs(path)
    assert [(m, s, p.direction) for p, (m, s) in zip(pairs, pairs)] == rows  # antistereo rows are not swapped
    assert stereotype_score(model, tokenizer, pairs) == pytest.approx(3 / 8)
    assert stereotype_scores(model, tokenizer, pairs) == {
        "stereotype_score": pytest.approx(3 / 8), "stereotype_score_stereo": pytest.approx(2 / 3),
        "stereotype_score_antistereo": pytest.approx(1 / 3), "stereotype_pairs_neutral": 2}
    # Without antistereo rows (StereoSet, the bundled set) that part is undefined: NaN (null in a report), not 0.
    only_stereo = stereotype_scores(model, tokenizer, [pair for pair in pairs if pair.direction == "stereo"])
    assert math.isnan(only_stereo["stereotype_score_antistereo"]) and only_stereo["stereotype_score"] == pytest.approx(2 / 4)
    measured = measure_lm(model, tokenizer, torch.arange(64) % len(tokenizer), pairs, seqlen=16, device="cpu")
    assert {k: v for k, v in measured.items() if k != "perplexity"} == stereotype_scores(model, tokenizer, pairs)


def test_sentence_log_likelihood_padding_and_direct(model, tokenizer):
    sentences = [a for a, _ in stereo_pairs()[:5]] + ["A much longer sentence about the old mill near the river bank."]
    batched = sentence_log_likelihoods(model, tokenizer, sentences, batch_size=6)
    single = sentence_log_likelihoods(model, tokenizer, sentences, batch_size=1)
    torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-5)
    assert encode_sentence(tokenizer, sentences[-1])[0] == tokenizer.eos_token_id
    # Each sentence's own forward, in the given order (the batches run them longest first).
    for sentence, got_single, got_batched in zip(sentences, single.tolist(), batched.tolist()):
        ids = encode_sentence(tokenizer, sentence)
        with torch.no_grad():
            logp = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        direct = sum(float(logp[t, ids[t + 1]]) for t in range(len(ids) - 1))
        assert got_single == pytest.approx(direct, rel=1e-6)
        assert got_batched == pytest.approx(direct, rel=1e-5)
    assert 0.0 <= stereotype_score(model, tokenizer, stereo_pairs()[:20]) <= 1.0


# --------------------------------------------------------------------------------------------
# Readers and the bundled pair set
# --------------------------------------------------------------------------------------------


def test_bundled_stereo_set_round_trips_through_reader(tmp_path):
    path = write_stereo_set(tmp_path)
    pairs = read_stereoset(path)
    assert pairs == stereo_pairs() == read_pairs(path)
    assert len(pairs) >= 200 and len(set(pairs)) == len(pairs)
    items = json.loads(path.read_text())["data"]["intrasentence"]
    labels = {s["gold_label"] for item in items for s in item["sentences"]}
    assert labels == {"stereotype", "anti-stereotype", "unrelated"}
    assert all("BLANK" in item["context"] for item in items)


def test_crows_pairs_reader_keeps_rows_and_direction(tmp_path):
    """Every row is (sent_more, sent_less) as written, antistereo rows too (the CrowS-Pairs metric
    asks in every row whether sent_more wins); the direction travels with the pair, which still
    unpacks as a 2-tuple. No direction column, or StereoSet: stereo."""
    path = tmp_path / "crows.csv"
    path.write_text(
        "sent_more,sent_less,stereo_antistereo,bias_type\n"
        '"Poor people steal.","Rich people steal.",stereo,socioeconomic\n'
        '"Women are strong.","Men are strong.",antistereo,gender\n'
    )
    pairs = read_crows_pairs(path)
    assert pairs == [("Poor people steal.", "Rich people steal."), ("Women are strong.", "Men are strong.")]
    assert [pair.direction for pair in pairs] == ["stereo", "antistereo"]
    more, less = pairs[1]
    assert (more, less) == ("Women are strong.", "Men are strong.")
    assert copy.deepcopy(pairs[1]).direction == pickle.loads(pickle.dumps(pairs[1])).direction == "antistereo"
    plain = tmp_path / "plain.csv"
    plain.write_text("sent_more,sent_less\nA b.,C d.\n")
    assert read_pairs(plain) == [("A b.", "C d.")] and read_pairs(plain)[0].direction == "stereo"
    assert {pair.direction for pair in read_stereoset(write_stereo_set(tmp_path))} == {"stereo"}


@pytest.mark.parametrize(
    "name,content,match",
    [
        ("bad.json", "{not json", "not valid JSON"),
        ("empty.json", json.dumps({"data": {"intersentence": []}}), "intrasentence"),
        ("noanti.json", json.dumps({"data": {"intrasentence": [
            {"sentences": [{"sentence": "x", "gold_label": "stereotype"}]}]}}), "anti-stereotype"),
        ("cols.csv", "sentence,label\na,b\n", "sent_less"),
        ("blank.csv", "sent_more,sent_less\nonly one,\n", "empty"),
        ("direction.csv", "sent_more,sent_less,stereo_antistereo\na,b,stereo\nc,d,anti\n", "row 2.*'anti'.*antistereo"),
        ("nodirection.csv", "sent_more,sent_less,stereo_antistereo\na,b,\n", "row 1.*stereo_antistereo"),
        ("pairs.txt", "x", "unknown pair-set format"),
    ],
)
def test_malformed_pair_files_raise_user_error(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(UserError, match=match) as err:
        read_pairs(path)
    assert "\n" not in str(err.value)


def test_missing_pair_file_raises_user_error(tmp_path):
    with pytest.raises(UserError, match="not found"):
        read_stereoset(tmp_path / "nope.json")
    with pytest.raises(UserError, match="not found"):
        read_crows_pairs(tmp_path / "nope.csv")


# --------------------------------------------------------------------------------------------
# Corpus, tokenizer, calibration batches
# --------------------------------------------------------------------------------------------


def test_corpus_is_deterministic_and_split(corpus, tmp_path):
    again = lm_corpus(train_docs=300, validation_docs=40)
    assert again == corpus
    assert lm_corpus(train_docs=300, validation_docs=40, seed=1) != corpus
    train_docs, val_docs = corpus.train.split("\n\n"), corpus.validation.split("\n\n")
    assert (len(train_docs), len(val_docs)) == (300, 40)
    assert not set(train_docs) & set(val_docs)
    assert len(set(corpus.train.split())) > 300  # varied vocabulary
    paths = write_lm_corpus(tmp_path, train_docs=5, validation_docs=2)
    assert paths["validation"].read_text() == lm_corpus(train_docs=5, validation_docs=2).validation


def test_tokenizer_saves_and_reloads(tokenizer, tmp_path, corpus):
    tokenizer.save_pretrained(tmp_path)
    loaded = tf.AutoTokenizer.from_pretrained(tmp_path)
    text = corpus.validation[:300]
    assert loaded(text).input_ids == tokenizer(text).input_ids
    assert loaded.decode(loaded(text).input_ids) == text  # byte-level BPE is lossless
    assert loaded.eos_token_id is not None and loaded.pad_token_id not in (None, loaded.eos_token_id)
    with pytest.raises(UserError, match="vocab_size"):
        train_bpe_tokenizer(["abc"], 100)


def test_calibration_ids_are_windows_of_the_stream(tokenizer, corpus):
    ids = calibration_ids(tokenizer, corpus.validation, nsamples=5, seqlen=24, seed=3)
    stream = tokenizer(corpus.validation).input_ids
    assert ids.shape == (5, 24) and ids.dtype == torch.long
    text = " " + " ".join(map(str, stream)) + " "
    assert all(" " + " ".join(map(str, row.tolist())) + " " in text for row in ids)
    assert torch.equal(ids, calibration_ids(tokenizer, corpus.validation, 5, 24, seed=3))
    assert not torch.equal(ids, calibration_ids(tokenizer, corpus.validation, 5, 24, seed=4))
    with pytest.raises(UserError, match="fewer than one window"):
        calibration_ids(tokenizer, "tiny", 2, 24)


def test_paired_ids_align_and_mask(tokenizer):
    pairs = stereo_pairs()[:3] + [("Short one.", "A clearly much longer second sentence here.")]
    ids0, ids1, mask = paired_ids(tokenizer, pairs, seqlen=64)
    assert ids0.shape == ids1.shape == mask.shape
    for i, (a, b) in enumerate(pairs):
        ea, eb = encode_sentence(tokenizer, a), encode_sentence(tokenizer, b)
        assert ids0[i, : len(ea)].tolist() == ea and ids1[i, : len(eb)].tolist() == eb
        assert (ids0[i, len(ea) :] == tokenizer.pad_token_id).all()
        assert int(mask[i].sum()) == max(len(ea), len(eb))
    short0, short1, short_mask = paired_ids(tokenizer, pairs, seqlen=6)
    assert short0.shape == (4, 6) and short_mask.all()
    with pytest.raises(UserError):
        paired_ids(tokenizer, [], seqlen=8)


def test_items_reproduce_the_figures_and_round_trip(model, tokenizer, tmp_path):
    """The per-window and per-pair outcomes give back the figures exactly, and save / load as
    plain arrays (a file that would need pickle is refused)."""
    from fairprune.metrics.language import LMItems, measure_lm_items

    pairs = [Pair(a, b, "antistereo" if i % 3 == 0 else "stereo") for i, (a, b) in enumerate(stereo_pairs()[:12])]
    ids = torch.arange(5 * 16) % len(tokenizer)
    metrics, items = measure_lm_items(model, tokenizer, ids, pairs, seqlen=16, device="cpu")
    assert metrics == measure_lm(model, tokenizer, ids, pairs, seqlen=16, device="cpu")
    figures = items.figures()
    assert figures["perplexity"] == pytest.approx(metrics["perplexity"], rel=1e-12)
    assert {k: v for k, v in figures.items() if k != "perplexity"} == {k: v for k, v in metrics.items() if k != "perplexity"}
    assert len(items.window_nll) == 5 and list(items.window_tokens) == [15.0] * 5
    assert len(items.pair_win) == 12 and items.pair_anti.sum() == 4
    items.save(tmp_path)
    back = LMItems.load(tmp_path)
    assert back is not None and all(np.array_equal(getattr(back, k), getattr(items, k)) for k in items.as_json())
    np.savez(tmp_path / LMItems.FILE, window_nll=np.array([object()], dtype=object))  # would need pickle
    assert LMItems.load(tmp_path) is None
    assert LMItems.from_json({"window_nll": [1.0]}) is None
