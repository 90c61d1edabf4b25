"""Language-model data: the bundled corpus (or any text files), a tokenizer, packed windows.

``LMDataModule`` tokenizes the training and validation text once, packs it into non-overlapping
``seqlen`` windows (the standard perplexity protocol: documents joined by blank lines), and serves
them in batches. Without a tokenizer it trains a byte-level BPE tokenizer on the training text
(``tokenizers``), cached next to the corpus, so nothing is downloaded.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from fairprune.data.files import read_text
from fairprune.data.shards import eval_sampler
from fairprune.data.text import train_bpe_tokenizer, write_lm_corpus
from fairprune.errors import UserError
from fairprune.hub import cache_dir, load_tokenizer


def pack(ids: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Non-overlapping windows ``[n, seqlen]`` of a token stream (the tail shorter than a window is dropped)."""
    n = len(ids) // seqlen
    if n == 0:
        raise UserError(f"the text has {len(ids)} tokens, fewer than one window of {seqlen}; give more text or a smaller seqlen")
    return ids[: n * seqlen].view(n, seqlen)


class LMDataModule(L.LightningDataModule):
    """Causal-LM data: bundled corpus or text files, packed into ``seqlen`` windows.

    Args:
        train_text / val_text: text files (or folders of .txt); unset = the bundled corpus.
        tokenizer: hub name or folder; unset = train a byte-level BPE tokenizer on the train text.
        bpe_vocab_size: vocabulary size of the locally trained tokenizer.
        seqlen: window length. batch_size, num_workers: loader settings.
        corpus_docs: documents in the bundled corpus' train split (validation: a tenth).
    """

    def __init__(self, train_text: str | None = None, val_text: str | None = None, tokenizer: str | None = None,
                 bpe_vocab_size: int = 2048, seqlen: int = 128, batch_size: int = 16, num_workers: int = 0,
                 corpus_docs: int = 2000, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        if seqlen < 2 or batch_size < 1:
            raise UserError(f"seqlen must be >= 2 and batch_size >= 1, got {seqlen} and {batch_size}")
        if (train_text is None) != (val_text is None):
            raise UserError("give both train_text and val_text, or neither (the bundled corpus)")
        for p in (train_text, val_text):
            if p is not None and not Path(p).exists():
                raise UserError(f"text file '{p}' does not exist; give a path to a .txt file or folder")
        self.tokenizer_path = tokenizer or str(self._local_tokenizer_dir())
        self._tokenizer = None
        self.train_ids = self.val_ids = None

    # -- text and tokenizer -------------------------------------------------------------------------
    def _corpus_dir(self) -> Path:
        return cache_dir() / f"lm_corpus_{self.hparams.corpus_docs}_{self.hparams.seed}"

    def _local_tokenizer_dir(self) -> Path:
        source = f"{self.hparams.train_text}|{self.hparams.corpus_docs}|{self.hparams.seed}|{self.hparams.bpe_vocab_size}"
        return cache_dir() / f"tokenizer_bpe_{hashlib.sha1(source.encode()).hexdigest()[:10]}"

    def texts(self) -> tuple[str, str]:
        """(train text, validation text)."""
        hp = self.hparams
        if hp.train_text is not None:
            return read_text(hp.train_text), read_text(hp.val_text)
        folder = self._corpus_dir()
        if not (folder / "validation.txt").exists():
            write_lm_corpus(folder, train_docs=hp.corpus_docs, validation_docs=max(hp.corpus_docs // 10, 1), seed=hp.seed)
        return (folder / "train.txt").read_text(encoding="utf-8"), (folder / "validation.txt").read_text(encoding="utf-8")

    def prepare_data(self) -> None:
        """Write the bundled corpus and train the local tokenizer, once."""
        train, _ = self.texts()
        if self.hparams.tokenizer is None and not (Path(self.tokenizer_path) / "tokenizer.json").exists():
            train_bpe_tokenizer(train, self.hparams.bpe_vocab_size, self.tokenizer_path)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if self.hparams.tokenizer is None and not (Path(self.tokenizer_path) / "tokenizer.json").exists():
                self.prepare_data()
            self._tokenizer = load_tokenizer(self.tokenizer_path)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer (trains the local tokenizer if needed)."""
        return len(self.tokenizer)

    # -- loaders -----------------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if self.train_ids is not None:
            return
        train, val = self.texts()
        encode = lambda text: self.tokenizer(text, return_tensors="pt", verbose=False).input_ids[0]  # noqa: E731
        self.train_ids = pack(encode(train), self.hparams.seqlen)
        self.val_ids = pack(encode(val), self.hparams.seqlen)

    def _loader(self, ids: torch.Tensor, shuffle: bool) -> DataLoader:
        # Evaluation under DDP: this process's unpadded shard, so every window counts once.
        sampler = None if shuffle else eval_sampler(len(ids))
        return DataLoader(TensorDataset(ids), batch_size=self.hparams.batch_size, shuffle=shuffle, sampler=sampler,
                          num_workers=self.hparams.num_workers, persistent_workers=self.hparams.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_ids, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_ids, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
