"""Face-attribute readers: UTKFace, FairFace and CelebA files to one kind of frame.

Every reader returns one row per image:

* ``path``   absolute image path,
* ``target`` class index of the attribute to predict,
* ``group``  index of the sensitive attribute's value (-1 when ``sensitive=None``),
* ``split``  ``"train"``, ``"val"`` or ``"test"``,
* then the dataset's raw attribute columns (UTKFace ``age gender race``; FairFace
  ``file age gender race service_test``; CelebA its 40 attributes as 0/1).

Files a reader leaves out are counted, by reason, in ``frame.attrs["skipped"]`` (UTKFace:
``malformed_name``, ``others``), each reason with one warning; the DataModule adds the images
that do not decode and reports the counts.

The target and the sensitive attribute are picked independently by name and may be the same.
Names: ``gender``, ``race`` and ``age`` (nine FairFace age bins; UTKFace ages are binned the
same way) for UTKFace and FairFace; any of the 40 attributes for CelebA (``gender`` is accepted
as another name for ``Male``). The label vocabularies are fixed, so :func:`task_info` knows
the class and group names before any file is read: the model is built from them first.
"""

from __future__ import annotations

import hashlib
import re
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from fairprune.data.files import read_user_csv
from fairprune.errors import UserError, suggest

DATASETS = ("synthetic", "utkface", "fairface", "celeba")
SPLITS = ("train", "val", "test")
#: Gender codes shared by UTKFace (0 male, 1 female) and FairFace's strings.
GENDERS = ["Male", "Female"]
#: UTKFace race codes 0..4, in code order.
UTKFACE_RACES = ["White", "Black", "Asian", "Indian", "Others"]
FAIRFACE_RACES = [
    "White", "Black", "Latino_Hispanic", "East Asian", "Southeast Asian", "Indian", "Middle Eastern",
]
#: FairFace's age bins; UTKFace's integer ages are binned the same way.
AGE_BINS = ["0-2", "3-9", "10-19", "20-29", "30-39", "40-49", "50-59", "60-69", "more than 70"]
#: Lowest age of bins 1..8 (bin 0 starts at 0).
AGE_EDGES = [3, 10, 20, 30, 40, 50, 60, 70]
CELEBA_ATTRIBUTES = [
    "5_o_Clock_Shadow", "Arched_Eyebrows", "Attractive", "Bags_Under_Eyes", "Bald", "Bangs",
    "Big_Lips", "Big_Nose", "Black_Hair", "Blond_Hair", "Blurry", "Brown_Hair", "Bushy_Eyebrows",
    "Chubby", "Double_Chin", "Eyeglasses", "Goatee", "Gray_Hair", "Heavy_Makeup", "High_Cheekbones",
    "Male", "Mouth_Slightly_Open", "Mustache", "Narrow_Eyes", "No_Beard", "Oval_Face", "Pale_Skin",
    "Pointy_Nose", "Receding_Hairline", "Rosy_Cheeks", "Sideburns", "Smiling", "Straight_Hair",
    "Wavy_Hair", "Wearing_Earrings", "Wearing_Hat", "Wearing_Lipstick", "Wearing_Necklace",
    "Wearing_Necktie", "Young",
]
CELEBA_ALIASES = {"gender": "Male"}
#: The one group name when no sensitive attribute is used (every row then has group -1).
UNKNOWN_GROUP = "unknown"
#: What a dataset root must hold, for error messages.
ROOT_CONTENTS = {
    "utkface": "the UTKFace images ([age]_[gender]_[race]_[datetime].jpg or .jpg.chip.jpg)",
    "fairface": "fairface_label_train.csv, fairface_label_val.csv and the train/ and val/ image folders",
    "celeba": "list_attr_celeba.txt, list_eval_partition.txt and img_align_celeba/ (directly or under celeba/)",
}
ROOT_CONTENTS["synthetic"] = ROOT_CONTENTS["utkface"]
LABEL_FILES = {
    "fairface": ("fairface_label_train.csv", "fairface_label_val.csv"),
    "celeba": ("list_attr_celeba.txt", "list_eval_partition.txt"),
}
# age_gender_race_datetime, in-the-wild (.jpg) or aligned (.jpg.chip.jpg) style; an age of more than
# three digits (UTKFace's run 0..116) is no age: the name is malformed.
UTKFACE_NAME = re.compile(r"(\d{1,3})_([01])_([0-4])_(\d+)\.jpg(\.chip\.jpg)?")


# --------------------------------------------------------------------------------------------
# Label vocabularies: known without reading any file.


def task_info(
    dataset: str,
    target: str,
    sensitive: str | None,
    include_others: bool = False,
    root: str | None = None,
) -> tuple[list[str], list[str]]:
    """Return ``(class_names, group_names)`` for a dataset, target and sensitive attribute.

    ``root`` is accepted so callers can pass a DataModule's settings unchanged; the
    vocabularies are fixed per dataset, so no file is read. ``sensitive=None`` gives the one
    group ``["unknown"]`` (rows then carry group -1). Raises :class:`UserError` for an unknown
    dataset, target or sensitive name.
    """
    dataset = check_dataset(dataset)
    class_names = label_names(dataset, target, "target", include_others)
    if sensitive is None:
        return class_names, [UNKNOWN_GROUP]
    return class_names, label_names(dataset, sensitive, "sensitive", include_others)


def check_dataset(dataset: str) -> str:
    """Return ``dataset`` if it is supported, else raise a :class:`UserError` with a suggestion."""
    if dataset not in DATASETS:
        raise UserError(
            f"unknown dataset '{dataset}'{suggest(dataset, DATASETS)}; "
            f"pass --data.dataset as one of: {', '.join(DATASETS)}"
        )
    return dataset


def label_names(dataset: str, attribute: str, role: str, include_others: bool = False) -> list[str]:
    """Names of the values of ``attribute`` in ``dataset``; ``role`` is 'target' or 'sensitive'."""
    if dataset == "celeba":
        name = celeba_attribute(attribute, CELEBA_ATTRIBUTES, role)
        return ["Female", "Male"] if name == "Male" else [f"not_{name}", name]
    races = FAIRFACE_RACES if dataset == "fairface" else UTKFACE_RACES[: 5 if include_others else 4]
    vocabularies = {"gender": GENDERS, "race": races, "age": AGE_BINS}
    if attribute not in vocabularies:
        raise UserError(
            f"unknown {role} '{attribute}' for {dataset}{suggest(str(attribute), vocabularies)}; "
            f"pass --data.{role} as one of: {', '.join(vocabularies)}"
        )
    return list(vocabularies[attribute])


def celeba_attribute(attribute: str, names: Sequence[str], role: str) -> str:
    """Resolve a CelebA attribute name (or alias) against ``names``; UserError lists them all."""
    name = CELEBA_ALIASES.get(attribute, attribute)
    if name not in names:
        raise UserError(
            f"unknown CelebA {role} '{attribute}'{suggest(str(attribute), names)}; "
            f"pass --data.{role} as one of the {len(names)} attributes: {' '.join(names)}"
        )
    return name


# --------------------------------------------------------------------------------------------
# Readers: one plain function per real file layout.


def read_faces(
    dataset: str,
    root: str | Path,
    target: str = "gender",
    sensitive: str | None = "race",
    include_others: bool = False,
    seed: int = 0,
) -> pd.DataFrame:
    """Read any supported dataset's frame (``synthetic`` is read as UTKFace)."""
    dataset = check_dataset(dataset)
    if dataset == "fairface":
        return read_fairface(root, target, sensitive, seed)
    if dataset == "celeba":
        return read_celeba(root, target, sensitive)
    return read_utkface(root, target, sensitive, include_others, seed)


def read_utkface(
    root: str | Path,
    target: str = "gender",
    sensitive: str | None = "race",
    include_others: bool = False,
    seed: int = 0,
) -> pd.DataFrame:
    """Read UTKFace from file names, searching ``root`` recursively.

    Names are ``[age]_[gender]_[race]_[datetime].jpg`` or the aligned ``....jpg.chip.jpg``;
    when both styles of one image are present the aligned one is kept. Malformed names are
    skipped with one warning. UTKFace has no official split, so a seeded 80/10/10 split is
    drawn from the names (see :func:`seeded_split`). Race 4 ("Others") is dropped, with one
    warning, unless ``include_others``. ``frame.attrs["skipped"]`` counts both kinds of skipped
    file (``malformed_name``, ``others``).
    """
    label_names("utkface", target, "target", include_others)
    if sensitive is not None:
        label_names("utkface", sensitive, "sensitive", include_others)
    root = check_root("utkface", root).resolve()
    frame, malformed = _parse_utkface_names(sorted(root.rglob("*.jpg")))
    if malformed:
        warnings.warn(
            f"skipped {len(malformed)} UTKFace file(s) whose name is not "
            f"[age]_[gender]_[race]_[datetime].jpg, e.g. '{malformed[0]}'",
            stacklevel=2,
        )
    if frame.empty:
        raise UserError(f"no UTKFace images found under '{root}'; pass --data.root pointing to "
                        f"the folder that holds {ROOT_CONTENTS['utkface']}")
    # Split before dropping "Others", so an image's split does not depend on include_others.
    frame["split"] = seeded_split(frame["key"].tolist(), seed)
    others = 0
    if not include_others:
        others = int((frame["race"] == 4).sum())
        frame = frame[frame["race"] != 4]
        if others:
            warnings.warn(f"left out {others} UTKFace image(s) of race 4 (Others), which the class and group "
                          f"names do not include; pass --data.include_others true to keep them", stacklevel=2)
    codes = {
        "gender": frame["gender"].to_numpy(),
        "race": frame["race"].to_numpy(),
        "age": age_bin(frame["age"].to_numpy()),
    }
    out = _finish(frame, codes[target], None if sensitive is None else codes[sensitive], ["age", "gender", "race"])
    out.attrs["skipped"] = {"malformed_name": len(malformed), "others": others}
    return out


def _parse_utkface_names(files: list[Path]) -> tuple[pd.DataFrame, list[str]]:
    """Parse UTKFace file names into a frame (one row per image key) and a list of bad names.

    The key (the name without its extension) identifies an image across both name styles.
    """
    rows, malformed = [], []
    for path in files:
        match = UTKFACE_NAME.fullmatch(path.name)
        if match is None:
            malformed.append(path.name)
            continue
        age, gender, race, stamp, chip = match.groups()
        rows.append((str(path), f"{age}_{gender}_{race}_{stamp}", int(age), int(gender),
                     int(race), chip is not None))
    frame = pd.DataFrame(rows, columns=["path", "key", "age", "gender", "race", "aligned"])
    frame = frame.sort_values(["key", "aligned"], ascending=[True, False], kind="stable")
    return frame.drop_duplicates("key").reset_index(drop=True), malformed


def read_fairface(
    root: str | Path, target: str = "gender", sensitive: str | None = "race", seed: int = 0
) -> pd.DataFrame:
    """Read FairFace's two label csv files (``file,age,gender,race,service_test``).

    The train csv gives the train split, with a seeded 10 % carved out as val; the official
    val csv is the test split. A race or gender string outside the vocabulary raises a
    :class:`UserError` naming the csv file and line.
    """
    label_names("fairface", target, "target")
    if sensitive is not None:
        label_names("fairface", sensitive, "sensitive")
    root = check_root("fairface", root)
    train_csv, val_csv = (root / name for name in LABEL_FILES["fairface"])
    used = {"race", "gender"} | ({target, sensitive} & {"age"})
    train, test = (_read_fairface_csv(path, used) for path in (train_csv, val_csv))
    train["split"] = seeded_split(train["file"].tolist(), seed, (0.9, 0.1), ("train", "val"))
    test["split"] = "test"
    frame = pd.concat([train, test], ignore_index=True)
    frame.insert(0, "path", [str((root / f).resolve()) for f in frame["file"]])
    vocabularies = {"gender": GENDERS, "race": FAIRFACE_RACES, "age": AGE_BINS}

    def codes(attribute):
        return frame[attribute].map({v: i for i, v in enumerate(vocabularies[attribute])}).to_numpy()

    raw = [c for c in ("file", "age", "gender", "race", "service_test") if c in frame]
    out = _finish(frame, codes(target), None if sensitive is None else codes(sensitive), raw)
    out.attrs["skipped"] = {}
    return out


def _read_fairface_csv(path: Path, used: set[str]) -> pd.DataFrame:
    """Read one FairFace csv and check the vocabulary of the columns in ``used``."""
    table = read_user_csv(path, "FairFace label", "the header file,age,gender,race,service_test",
                          dtype={"file": str, "age": str, "gender": str, "race": str})
    missing = [c for c in ["file", *sorted(used)] if c not in table]
    if missing:
        raise UserError(f"{path} lacks column(s) {', '.join(missing)}; a FairFace label csv has "
                        f"the header file,age,gender,race,service_test")
    vocabularies = {"gender": GENDERS, "race": FAIRFACE_RACES, "age": AGE_BINS}
    for column in sorted(used):
        bad = ~table[column].isin(vocabularies[column])
        if bad.any():
            row = int(np.flatnonzero(bad.to_numpy())[0])
            # +2: one for the header line, one because lines count from 1.
            raise UserError(
                f"{path}, line {row + 2}: unknown {column} '{table[column].iloc[row]}'; "
                f"expected one of: {', '.join(vocabularies[column])}"
            )
    return table


def read_celeba(root: str | Path, target: str = "Smiling", sensitive: str | None = "Male") -> pd.DataFrame:
    """Read CelebA in torchvision's layout (under ``root`` or ``root/celeba``).

    Attributes go from -1/1 to 0/1; the official partition gives the splits (0 train,
    1 val, 2 test). Any attribute can be the target or the sensitive one.
    """
    celeba_attribute(target, CELEBA_ATTRIBUTES, "target")
    if sensitive is not None:
        celeba_attribute(sensitive, CELEBA_ATTRIBUTES, "sensitive")
    base = celeba_base(check_root("celeba", root))
    attr_file, partition_file = (base / name for name in LABEL_FILES["celeba"])
    expected = "a count line, the 40 attribute names, then one '<image> -1 1 ...' line per image"
    names = _celeba_names(attr_file, expected)
    target = celeba_attribute(target, names, "target")
    sensitive = None if sensitive is None else celeba_attribute(sensitive, names, "sensitive")
    attrs = read_user_csv(attr_file, "CelebA attribute", expected, sep=r"\s+", skiprows=2, header=None,
                          names=["image_id", *names])
    _check_celeba_attributes(attr_file, attrs, names, expected)
    attrs[names] = (attrs[names] > 0).astype(np.int64)
    partition = read_user_csv(partition_file, "CelebA partition", "'<image> <0|1|2>' lines", sep=r"\s+",
                              header=None, names=["image_id", "partition"])
    bad = ~partition["partition"].isin([0, 1, 2])
    if bad.any():
        row = int(np.argmax(bad.to_numpy()))
        raise UserError(f"{partition_file}, line {row + 1}: partition {partition['partition'].iloc[row]!r}; each line "
                        "is '<image> <0|1|2>' (0 train, 1 val, 2 test)")
    frame = attrs.merge(partition, on="image_id", how="inner", validate="one_to_one")
    if len(frame) != len(attrs):
        raise UserError(f"{len(attrs) - len(frame)} image(s) in {attr_file} have no line in "
                        f"{partition_file}; use the two files of one CelebA release")
    frame["split"] = frame["partition"].map(dict(enumerate(SPLITS)))
    frame.insert(0, "path", [str((base / "img_align_celeba" / i).resolve()) for i in frame["image_id"]])
    groups = None if sensitive is None else frame[sensitive].to_numpy()
    out = _finish(frame, frame[target].to_numpy(), groups, list(names))
    out.attrs["skipped"] = {}
    return out


def _check_celeba_attributes(attr_file: Path, attrs: pd.DataFrame, names: list[str], expected: str) -> None:
    """The attribute list as CelebA writes it, or one line naming what is wrong: as many image lines
    as its count line says (a cut or edited file lists fewer), every attribute -1 or 1 (a short
    line leaves cells empty)."""
    with attr_file.open(encoding="utf-8") as handle:
        count = handle.readline().strip()
    if not count.isdigit() or int(count) != len(attrs):
        raise UserError(f"{attr_file}: its count line says {count[:30]!r} images but it lists {len(attrs)}; the file "
                        f"is cut short or edited: expected {expected}")
    values = attrs[names]
    bad = ~values.isin([-1, 1]).all(axis=1).to_numpy()
    if bad.any():
        row = int(np.argmax(bad))
        column = next(n for n in names if values[n].iloc[row] not in (-1, 1))
        value = values[column].iloc[row]
        found = "missing (a short line)" if pd.isna(value) else f"{value}"
        raise UserError(f"{attr_file}, line {row + 3}: {column} is {found}; every attribute is -1 or 1: expected {expected}")


def _celeba_names(attr_file: Path, expected: str) -> list[str]:
    """The attribute names on line 2 of ``list_attr_celeba.txt``."""
    try:
        with attr_file.open(encoding="utf-8") as handle:
            handle.readline()  # the image count
            return handle.readline().split()
    except UnicodeDecodeError:
        raise UserError(f"{attr_file}: not UTF-8 text; expected {expected}") from None


def _finish(frame: pd.DataFrame, target, group, raw: list[str]) -> pd.DataFrame:
    """Put the common columns first (``path target group split``), then the raw ones."""
    out = pd.DataFrame({"path": frame["path"].to_numpy()})
    out["target"] = np.asarray(target, dtype=np.int64)
    out["group"] = np.full(len(out), -1, np.int64) if group is None else np.asarray(group, np.int64)
    out["split"] = frame["split"].to_numpy()
    for column in raw:
        out[column] = frame[column].to_numpy()
    return out


def age_bin(age: np.ndarray) -> np.ndarray:
    """Index into :data:`AGE_BINS` of each integer age."""
    return np.searchsorted(AGE_EDGES, np.asarray(age), side="right")


def seeded_split(
    keys: Sequence[str],
    seed: int,
    fractions: Sequence[float] = (0.8, 0.1, 0.1),
    names: Sequence[str] = SPLITS,
) -> np.ndarray:
    """Assign each key to a split by the rank of a seeded hash of the key.

    The result depends only on the set of keys and the seed, never on their order (so not on
    the order files come off the disk), and the split sizes are the fractions, rounded.
    """
    digests = [hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest() for key in keys]
    order = sorted(range(len(keys)), key=lambda i: (digests[i], keys[i]))
    rank = np.empty(len(keys), dtype=np.int64)
    rank[order] = np.arange(len(keys))
    bounds = np.rint(np.cumsum(fractions) * len(keys))
    return np.asarray(names)[np.minimum(np.searchsorted(bounds, rank, side="right"), len(names) - 1)]


def check_root(dataset: str, root: str | Path | None) -> Path:
    """Check that ``root`` and the dataset's label files exist (cheap: no file is read)."""
    root = _existing_root(root, dataset)
    base = celeba_base(root) if dataset == "celeba" else root
    for name in LABEL_FILES.get(dataset, ()):
        _label_file(base, name, dataset)
    return root


def celeba_base(root: Path) -> Path:
    """The folder holding CelebA's files: ``root`` itself or torchvision's ``root/celeba``."""
    nested = root / "celeba"
    return nested if not (root / LABEL_FILES["celeba"][0]).exists() and nested.is_dir() else root


def _existing_root(root: str | Path | None, dataset: str) -> Path:
    """Return ``root`` as a Path, or raise a UserError that says what the folder should hold."""
    if root is not None and Path(root).exists() and not Path(root).is_dir():
        raise UserError(f"dataset root '{root}' is a file, not a folder; pass --data.root pointing to the folder that "
                        f"holds {ROOT_CONTENTS[dataset]}")
    if root is None or not Path(root).is_dir():
        shown = "" if root is None else f" '{root}'"
        raise UserError(f"dataset root{shown} does not exist; pass --data.root pointing to the "
                        f"folder that holds {ROOT_CONTENTS[dataset]}")
    return Path(root)


def _label_file(base: Path, name: str, dataset: str) -> Path:
    """Return ``base / name`` or raise a UserError naming the missing label file."""
    path = base / name
    if not path.is_file():
        raise UserError(f"label file '{path}' does not exist; pass --data.root pointing to the "
                        f"folder that holds {ROOT_CONTENTS[dataset]}")
    return path
