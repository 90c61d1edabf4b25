"""The offline Jigsaw scorer: the PyTorch port against a plain NumPy forward pass over the h5
arrays, the Keras tokenizer rules on tricky strings, the restricted unpickler, clearly toxic and
benign texts, and how ``make_scorer`` picks it."""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pytest

from fairprune.errors import UserError
from fairprune.metrics import jigsaw
from fairprune.metrics.toxicity import LexiconScorer, make_scorer

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not jigsaw.available(), reason=f"{jigsaw.PACKAGE} is not installed")]

TEXTS = ["You are a stupid idiot and I hate you.", "Thank you for the help, have a nice day!",
         "the weather is sunny today", "", "Shut up, you worthless piece of garbage", "women are " * 60]


@pytest.fixture(scope="module")
def scorer():
    return jigsaw.JigsawScorer(batch_size=4)  # several batches for TEXTS


@pytest.fixture(scope="module")
def state() -> dict:
    """The full pickled tokenizer state (all words, also those past num_words)."""
    data = (jigsaw.package_dir() / jigsaw.TOKENIZER).read_bytes()
    return jigsaw.RestrictedUnpickler(io.BytesIO(data)).load().__dict__


def test_clearly_toxic_texts_score_high_and_benign_ones_low(scorer):
    toxic = scorer.score(["You are a stupid idiot and I hate you.", "fuck off you moron",
                          "Shut up, you worthless piece of garbage"])
    benign = scorer.score(["Thank you for the help, have a nice day!", "the weather is sunny today",
                           "He was a good doctor and a kind neighbour."])
    assert min(toxic) > 0.5 and max(benign) < 0.2, (toxic, benign)


# --------------------------------------------------------------------------------------------
# The port equals a plain forward pass
# --------------------------------------------------------------------------------------------


def numpy_forward(ids: np.ndarray) -> np.ndarray:
    """The Keras model, step by step, straight from the h5 arrays: [batch, time] → [batch, 6]."""
    import h5py

    with h5py.File(jigsaw.package_dir() / jigsaw.WEIGHTS, "r") as f:
        arr = lambda name: np.asarray(f["layers/" + name], dtype=np.float64)  # noqa: E731
        emb = arr("embedding/vars/0")
        cells = {d: [arr(f"bidirectional/{d}_layer/cell/vars/{i}") for i in range(3)] for d in ("forward", "backward")}
        w1, b1, w2, b2 = arr("dense/vars/0"), arr("dense/vars/1"), arr("dense_1/vars/0"), arr("dense_1/vars/1")
    sigmoid = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    x = emb[ids]  # [B, T, 50]

    def run(kernel, recurrent, bias, steps):
        units = recurrent.shape[0]
        h = c = np.zeros((x.shape[0], units))
        out = np.zeros((x.shape[0], x.shape[1], units))
        for t in steps:
            z = x[:, t] @ kernel + h @ recurrent + bias
            i, f, g, o = (z[:, k * units : (k + 1) * units] for k in range(4))  # Keras order i, f, c, o
            c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
            h = sigmoid(o) * np.tanh(c)
            out[:, t] = h
        return out

    T = x.shape[1]
    seq = np.concatenate([run(*cells["forward"], range(T)), run(*cells["backward"], reversed(range(T)))], axis=-1)
    hidden = np.maximum(seq.max(axis=1) @ w1 + b1, 0)
    return sigmoid(hidden @ w2 + b2)


def test_port_equals_a_plain_numpy_forward_pass(scorer):
    ids = jigsaw.load()[1].pad(TEXTS)
    expected = numpy_forward(ids)
    got = scorer.probabilities(TEXTS).numpy()
    assert got.shape == (len(TEXTS), 6)
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-4)
    assert expected[:, 0].max() - expected[:, 0].min() > 0.5  # the texts differ, so the check has teeth
    assert scorer.score(TEXTS) == pytest.approx(got[:, 0].tolist())
    assert jigsaw.JigsawScorer(label="insult").score(TEXTS) == pytest.approx(got[:, 4].tolist())
    assert jigsaw.JigsawScorer(label="mean").score(TEXTS) == pytest.approx(got.mean(1).tolist(), abs=1e-6)
    assert ids.shape == (len(TEXTS), jigsaw.MAXLEN)


# --------------------------------------------------------------------------------------------
# The tokenizer rules
# --------------------------------------------------------------------------------------------


def test_words_follow_the_keras_rules(state):
    tok = jigsaw.load()[1]
    assert state["filters"] == tok.filters and state["num_words"] == tok.num_words == 20000 and state["oov_token"] is None
    # Filters become spaces; only the space splits; the apostrophe and other characters stay.
    assert tok.words("Hello,World!!  It's\tME\nyou're-great") == ["hello", "world", "it's", "me", "you're", "great"]
    assert tok.words("ÉCOLE\rnow   ") == ["école\rnow"]
    assert tok.words("...!!!") == [] and tok.words("") == []
    assert tok.words("a_b c@d [x] {y} ~z~") == ["a", "b", "c", "d", "x", "y", "z"]


def test_ids_keep_the_first_num_words_and_pad_and_truncate_at_the_front(state):
    tok = jigsaw.load()[1]
    index = state["word_index"]
    rare = next(w for w, i in index.items() if i >= 20000 and w.isalpha())
    assert index["the"] == 1 and index[rare] >= 20000
    assert tok.ids(f"The {rare} the") == [1, 1]  # a word past num_words is dropped, not mapped
    assert tok.ids("zzqqxx-not-a-word") == [index[w] for w in ("not", "a", "word")]
    assert tok.ids("The, THE; the!") == [1, 1, 1]
    batch = tok.pad(["the of", "", " ".join(["of"] * 150 + ["the"] * 3)])
    assert batch.shape == (3, 100) and batch.dtype == np.int64
    assert batch[0].tolist() == [0] * 98 + [1, index["of"]]  # padded in front
    assert not batch[1].any()
    assert batch[2].tolist() == [index["of"]] * 97 + [1, 1, 1]  # truncated in front: the last 100 ids stay


# --------------------------------------------------------------------------------------------
# The restricted unpickler
# --------------------------------------------------------------------------------------------


class _Evil:
    def __reduce__(self):
        return os.system, ("echo should-not-run",)


@pytest.mark.parametrize("payload", [_Evil(), {"word_index": {"a": 1}, "hook": pickle.loads}, [print]])
def test_unpickler_refuses_any_other_global(payload):
    data = pickle.dumps(payload)
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        jigsaw.RestrictedUnpickler(io.BytesIO(data)).load()
    with pytest.raises(UserError, match="refusing the tokenizer pickle"):
        jigsaw.read_tokenizer(data)


def test_a_pickle_without_a_tokenizer_is_a_user_error():
    with pytest.raises(UserError, match="no Keras Tokenizer"):
        jigsaw.read_tokenizer(pickle.dumps({"word_index": {"a": 1}}))


# --------------------------------------------------------------------------------------------
# make_scorer
# --------------------------------------------------------------------------------------------


def test_make_scorer_names(capsys):
    assert isinstance(make_scorer("jigsaw"), jigsaw.JigsawScorer)
    assert make_scorer("jigsaw:threat").label == "threat"
    assert isinstance(make_scorer("auto"), jigsaw.JigsawScorer)
    assert isinstance(make_scorer("lexicon"), LexiconScorer)
    with pytest.raises(UserError, match="unknown Jigsaw label 'toxicity'.*did you mean: toxic"):
        make_scorer("jigsaw:toxicity")
    assert capsys.readouterr().out == ""


def test_without_the_package_jigsaw_is_a_user_error_and_auto_falls_back(monkeypatch, capsys):
    monkeypatch.setattr(jigsaw, "PACKAGE", "toxic-comment-classifier-not-installed")
    assert not jigsaw.available()
    with pytest.raises(UserError, match="pip install --no-deps toxic-comment-classifier==0.3.0"):
        make_scorer("jigsaw")
    assert isinstance(make_scorer("auto"), LexiconScorer)
    note = capsys.readouterr().out.strip().splitlines()
    assert len(note) == 1 and "lexicon" in note[0]
