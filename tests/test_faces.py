"""Face data: readers on tiny fixtures in each real layout, the synthetic set, the DataModule."""

from __future__ import annotations

import hashlib
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import cross_val_score

from fairprune.data.faces import (
    AGE_BINS,
    CELEBA_ATTRIBUTES,
    FAIRFACE_RACES,
    GENDERS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    FaceDataModule,
    FaceDataset,
    age_bin,
    drop_unreadable,
    face_transform,
    read_celeba,
    read_fairface,
    read_utkface,
    seeded_split,
    stratified_subset,
    task_info,
)
from fairprune.data.synthetic import MARKER, RACE_SHARES, VERSION, generate_synthetic_utkface
from fairprune.errors import UserError


def write_jpeg(path: Path, colour=(120, 90, 60), size: int = 8) -> None:
    """A tiny solid-colour JPEG (colour picked per file so substitutions are detectable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), colour).save(path, format="JPEG")


def caught(fn, *args, **kwargs):
    """Call ``fn``; return its result and the messages of the warnings it emitted."""
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    return result, [str(r.message) for r in records]


# --------------------------------------------------------------------------------------------
# UTKFace

UTK_GOOD = [
    "25_0_0_20170101000000001.jpg.chip.jpg",
    "30_1_1_20170101000000002.jpg",  # in-the-wild style
    "sub/dir/40_1_2_20170101000000003.jpg.chip.jpg",  # found recursively
    "5_0_3_20170101000000004.jpg.chip.jpg",
    "70_1_4_20170101000000005.jpg.chip.jpg",  # race 4: Others
    "2_1_0_20170101000000006.jpg",
]
UTK_BAD = ["39_1_20170116174525125.jpg.chip.jpg", "x_0_1_20170101000000007.jpg", "20_2_0_2017.jpg"]


def utk_fields(name: str) -> tuple[int, int, int]:
    """(age, gender, race) straight from a well-formed name: the oracle for the reader."""
    age, gender, race = Path(name).name.split("_")[:3]
    return int(age), int(gender), int(race)


@pytest.fixture
def utk_root(tmp_path):
    root = tmp_path / "UTKFace"
    for i, name in enumerate(UTK_GOOD + UTK_BAD):
        write_jpeg(root / name, colour=(10 * i, 100, 50))
    return root


def test_utkface_reads_both_name_styles_and_warns_once_for_malformed(utk_root):
    frame, messages = caught(read_utkface, utk_root)
    malformed = [m for m in messages if "whose name is not" in m]
    assert len(malformed) == 1 and "skipped 3" in malformed[0]
    assert frame.attrs["skipped"]["malformed_name"] == 3
    expected = {Path(n).name: utk_fields(n) for n in UTK_GOOD if utk_fields(n)[2] != 4}
    got = {Path(p).name: (t, g) for p, t, g in zip(frame["path"], frame["target"], frame["group"])}
    assert got == {name: (gender, race) for name, (_, gender, race) in expected.items()}
    assert list(frame.columns[:4]) == ["path", "target", "group", "split"]
    assert all(Path(p).is_absolute() and Path(p).exists() for p in frame["path"])
    assert {"age", "gender", "race"} <= set(frame.columns)


def test_utkface_others_left_out_by_default_and_kept_on_request(utk_root):
    default, messages = caught(read_utkface, utk_root)
    kept, kept_messages = caught(read_utkface, utk_root, include_others=True)
    # Left out with one warning line that says how to keep them, and counted.
    others = [m for m in messages if "Others" in m]
    assert len(others) == 1 and "left out 1 " in others[0] and "--data.include_others true" in others[0]
    assert default.attrs["skipped"] == {"malformed_name": 3, "others": 1}
    assert not any("Others" in m for m in kept_messages) and kept.attrs["skipped"]["others"] == 0
    assert 4 not in set(default["race"]) and 4 not in set(default["group"])
    assert len(kept) == len(default) + 1 and set(kept[kept["race"] == 4]["group"]) == {4}
    assert task_info("utkface", "race", "gender", include_others=True)[0][-1] == "Others"
    assert "Others" not in task_info("utkface", "race", "gender")[0]
    # Left out of the target too, not only of the groups.
    by_race, _ = caught(read_utkface, utk_root, target="race", sensitive="gender")
    assert 4 not in set(by_race["target"])


def test_utkface_keeps_the_aligned_copy_when_both_styles_exist(utk_root):
    write_jpeg(utk_root / "wild" / "25_0_0_20170101000000001.jpg")
    frame, _ = caught(read_utkface, utk_root)
    matches = [p for p in frame["path"] if "20170101000000001" in p]
    assert len(matches) == 1 and matches[0].endswith(".jpg.chip.jpg")


def test_target_and_sensitive_are_independent_and_may_coincide(utk_root):
    same, _ = caught(read_utkface, utk_root, target="race", sensitive="race")
    assert (same["target"] == same["group"]).all() and (same["target"] == same["race"]).all()
    unsupervised, _ = caught(read_utkface, utk_root, sensitive=None)
    assert (unsupervised["group"] == -1).all()
    assert task_info("utkface", "gender", None) == (GENDERS, ["unknown"])


def test_age_bins_match_a_plain_rule(utk_root):
    def oracle(age):
        lows = [0, 3, 10, 20, 30, 40, 50, 60, 70]
        return max(i for i, low in enumerate(lows) if age >= low)

    ages = np.arange(0, 117)
    assert age_bin(ages).tolist() == [oracle(a) for a in ages]
    frame, _ = caught(read_utkface, utk_root, target="age")
    assert frame["target"].tolist() == [oracle(a) for a in frame["age"]]
    assert task_info("fairface", "age", None)[0] == AGE_BINS


def test_unknown_target_or_sensitive_lists_the_valid_names():
    with pytest.raises(UserError, match="gendr.*did you mean: gender.*gender, race, age"):
        task_info("utkface", "gendr", "race")
    with pytest.raises(UserError, match="sensitive 'skin'.*gender, race, age"):
        task_info("fairface", "gender", "skin")
    with pytest.raises(UserError, match="did you mean: utkface"):
        task_info("utkfce", "gender", "race")


# --------------------------------------------------------------------------------------------
# Splits


def test_seeded_split_is_exact_stable_and_order_free():
    keys = [f"{i}_0_0_2017{i:09d}" for i in range(200)]
    split = dict(zip(keys, seeded_split(keys, seed=7)))
    assert pd.Series(split).value_counts().to_dict() == {"train": 160, "val": 20, "test": 20}
    shuffled = list(np.random.default_rng(0).permutation(keys))
    assert dict(zip(shuffled, seeded_split(shuffled, seed=7))) == split
    assert dict(zip(keys, seeded_split(keys, seed=7))) == split
    assert dict(zip(keys, seeded_split(keys, seed=8))) != split


def test_utkface_split_does_not_depend_on_file_order_or_folders(tmp_path):
    names = [f"{20 + i % 50}_{i % 2}_{i % 4}_2017{i:09d}.jpg.chip.jpg" for i in range(60)]
    for name in names:
        write_jpeg(tmp_path / "a" / name)
    for i, name in enumerate(reversed(names)):  # other creation order, other sub-folders
        write_jpeg(tmp_path / "b" / f"part{i % 3}" / name)
    a, _ = caught(read_utkface, tmp_path / "a", seed=3)
    b, _ = caught(read_utkface, tmp_path / "b", seed=3)

    def by_name(frame):
        return dict(zip(frame["path"].map(lambda p: Path(p).name), frame["split"]))

    assert by_name(a) == by_name(b)
    assert a["split"].value_counts().to_dict() == {"train": 48, "val": 6, "test": 6}


# --------------------------------------------------------------------------------------------
# FairFace

FAIRFACE_TRAIN = [(f"train/{i}.jpg", "20-29", GENDERS[i % 2], FAIRFACE_RACES[i % 7]) for i in range(1, 21)]
FAIRFACE_VAL = [(f"val/{i}.jpg", "3-9", GENDERS[i % 2], FAIRFACE_RACES[(i + 3) % 7]) for i in range(1, 6)]


def write_fairface(root: Path, train=FAIRFACE_TRAIN, val=FAIRFACE_VAL) -> Path:
    for csv, rows in (("fairface_label_train.csv", train), ("fairface_label_val.csv", val)):
        table = pd.DataFrame(rows, columns=["file", "age", "gender", "race"]).assign(service_test=True)
        root.mkdir(parents=True, exist_ok=True)
        table.to_csv(root / csv, index=False)
        for file in table["file"]:
            write_jpeg(root / file)
    return root


def test_fairface_labels_and_official_splits(tmp_path):
    root = write_fairface(tmp_path / "fairface")
    frame = read_fairface(root, target="gender", sensitive="race", seed=1)
    rows = {file: (gender, race) for file, _, gender, race in FAIRFACE_TRAIN + FAIRFACE_VAL}
    for path, target, group in zip(frame["path"], frame["target"], frame["group"]):
        gender, race = rows[str(Path(path).relative_to(root.resolve()))]
        assert (target, group) == (GENDERS.index(gender), FAIRFACE_RACES.index(race))
    test_files = set(frame[frame["split"] == "test"]["file"])
    assert test_files == {row[0] for row in FAIRFACE_VAL}
    assert frame[frame["file"].str.startswith("train/")]["split"].value_counts().to_dict() == {
        "train": 18, "val": 2}


def test_fairface_unknown_race_names_the_file_and_line(tmp_path):
    bad = list(FAIRFACE_TRAIN)
    bad[2] = ("train/3.jpg", "20-29", "Male", "Martian")
    root = write_fairface(tmp_path / "fairface", train=bad)
    with pytest.raises(UserError, match=r"fairface_label_train\.csv, line 4: unknown race 'Martian'"):
        read_fairface(root)


# --------------------------------------------------------------------------------------------
# CelebA


def write_celeba(base: Path, values: np.ndarray, partition: list[int]) -> None:
    """torchvision's layout: attr file (count, names, rows of -1/1), partition file, images."""
    names = [f"{i:06d}.jpg" for i in range(1, len(values) + 1)]
    lines = [str(len(values)), " ".join(CELEBA_ATTRIBUTES)]
    # The real file pads with two spaces between some columns.
    lines += [name + "  " + " ".join(f"{v:2d}" for v in row) for name, row in zip(names, values)]
    base.mkdir(parents=True, exist_ok=True)
    (base / "list_attr_celeba.txt").write_text("\n".join(lines) + "\n")
    (base / "list_eval_partition.txt").write_text(
        "".join(f"{n} {p}\n" for n, p in zip(names, partition)))
    for name in names:
        write_jpeg(base / "img_align_celeba" / name)


@pytest.fixture
def celeba(tmp_path):
    values = np.where(np.random.default_rng(0).random((9, 40)) < 0.5, -1, 1)
    partition = [0, 0, 0, 0, 1, 1, 2, 2, 2]
    write_celeba(tmp_path / "data" / "celeba", values, partition)  # the nested layout
    return tmp_path / "data", values, partition


def test_celeba_maps_attributes_and_keeps_official_splits(celeba):
    root, values, partition = celeba
    frame = read_celeba(root, target="Smiling", sensitive="Male")
    smiling, male = CELEBA_ATTRIBUTES.index("Smiling"), CELEBA_ATTRIBUTES.index("Male")
    assert frame["target"].tolist() == [int(v == 1) for v in values[:, smiling]]
    assert frame["group"].tolist() == [int(v == 1) for v in values[:, male]]
    assert frame["split"].tolist() == [("train", "val", "test")[p] for p in partition]
    assert set(frame[CELEBA_ATTRIBUTES].to_numpy().ravel()) <= {0, 1}
    assert all(Path(p).exists() for p in frame["path"])
    assert task_info("celeba", "Smiling", "Male") == (["not_Smiling", "Smiling"], ["Female", "Male"])
    assert read_celeba(root / "celeba", target="gender", sensitive=None)["target"].tolist() == (
        frame["group"].tolist())


def test_celeba_unknown_attribute_lists_all_forty(celeba):
    root, _, _ = celeba
    with pytest.raises(UserError, match="Smiles") as info:
        read_celeba(root, target="Smiles")
    assert all(name in str(info.value) for name in CELEBA_ATTRIBUTES)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------------------------
# Missing files and damaged images


def test_missing_root_or_label_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="dataset root '.*nope' does not exist; pass --data.root"):
        read_utkface(tmp_path / "nope")
    with pytest.raises(UserError, match="fairface_label_train.csv"):
        FaceDataModule("fairface", root=str(tmp_path))  # fails at __init__, before any training
    with pytest.raises(UserError, match="list_attr_celeba.txt"):
        read_celeba(tmp_path)
    with pytest.raises(UserError, match="--data.root"):
        FaceDataModule("utkface", root=None)


def test_corrupt_image_dropped_once_with_count(utk_root):
    (utk_root / UTK_GOOD[0]).write_bytes(b"not a jpeg at all")
    frame, _ = caught(read_utkface, utk_root)
    kept, messages = caught(drop_unreadable, frame)
    assert len(messages) == 1 and "dropped 1 unreadable" in messages[0] and UTK_GOOD[0] in messages[0]
    assert len(kept) == len(frame) - 1 and not kept["path"].str.endswith(UTK_GOOD[0]).any()
    assert kept.attrs["skipped"] == {"malformed_name": 3, "others": 1, "missing": 0, "unreadable": 1}


def truncate(path: Path) -> None:
    """Make ``path`` a JPEG cut off half-way through its pixel data (as an interrupted copy
    leaves it): PIL still opens and ``verify``s it, only decoding the pixels fails."""
    pixels = np.random.default_rng(len(path.name)).integers(0, 255, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, format="JPEG")
    data = path.read_bytes()
    scan = data.index(b"\xff\xda")  # start of scan: the entropy-coded pixels follow
    path.write_bytes(data[: scan + (len(data) - scan) // 2])
    with Image.open(path) as image:
        image.verify()  # the damage a header check cannot see


def test_truncated_jpeg_is_found_by_decoding_and_left_out(utk_root):
    truncate(utk_root / UTK_GOOD[1])
    frame, _ = caught(read_utkface, utk_root)
    kept, messages = caught(drop_unreadable, frame)
    assert len(messages) == 1 and "dropped 1 unreadable" in messages[0] and "truncated" in messages[0]
    assert not kept["path"].str.endswith(UTK_GOOD[1]).any() and len(kept) == len(frame) - 1


def test_missing_image_is_counted_apart_from_unreadable(tmp_path):
    root = write_fairface(tmp_path / "fairface")
    (root / FAIRFACE_TRAIN[0][0]).unlink()
    dm = FaceDataModule("fairface", root=str(root))
    _, messages = caught(dm.setup, "fit")
    assert dm.report_fields()["data"]["skipped"] == {"missing": 1, "unreadable": 0}
    missing = [m for m in messages if "missing from the disk" in m]
    assert len(missing) == 1 and "dropped 1 " in missing[0] and FAIRFACE_TRAIN[0][0] in missing[0]


def test_image_damaged_after_setup_is_an_error_not_a_substitute(utk_root):
    frame, _ = caught(read_utkface, utk_root)
    dataset = FaceDataset(frame)
    image, target, group = dataset[1]
    assert target.dtype == group.dtype == torch.int64
    Path(frame["path"][0]).write_bytes(b"\xff\xd8 broken after validation")
    with pytest.raises(UserError, match=f"cannot load image '.*{Path(frame['path'][0]).name}'.*changed during the run"):
        dataset[0]
    assert torch.equal(dataset[1][0], image)  # the others still load, each as itself


def test_the_only_sample_of_a_group_is_left_out_and_counted_never_replaced(tmp_path):
    """A damaged image is not served as a copy of its neighbour: the group is absent from the
    split, the warnings say so, and ``data.skipped`` counts it by reason."""
    root = tmp_path / "utk"
    names = [f"{20 + i}_{i % 2}_{race}_2017{i:09d}.jpg.chip.jpg" for i, race in enumerate([0, 1, 3] * 12 + [2] * 12)]
    for i, name in enumerate(names):
        write_jpeg(root / name, colour=(5 * i, 100, 50), size=16)
    write_jpeg(root / "70_1_4_20170101000000005.jpg.chip.jpg")  # Others
    write_jpeg(root / "39_1_20170116174525125.jpg.chip.jpg")  # malformed
    frame, _ = caught(read_utkface, root)
    asian_test = frame[(frame["split"] == "test") & (frame["group"] == 2)]["path"].tolist()
    for extra in asian_test[1:]:  # keep the test split's only Asian face
        Path(extra).unlink()
    assert asian_test, "the fixture needs an Asian face in the test split"
    truncate(Path(asian_test[0]))

    dm = FaceDataModule("utkface", root=str(root), image_size=16, batch_size=4)
    _, messages = caught(dm.setup, "test")
    assert not (dm.test_frame["group"] == 2).any() and asian_test[0] not in set(dm.test_frame["path"])
    fields = dm.report_fields()["data"]
    assert fields["skipped"] == {"malformed_name": 1, "others": 1, "missing": 0, "unreadable": 1}
    assert fields["samples"] == {s: len(f) for s, f in zip(("train", "val", "test"),
                                                             (dm.train_frame, dm.val_frame, dm.test_frame))}
    assert sum("dropped 1 unreadable" in m for m in messages) == 1
    assert sum("Asian in test" in m for m in messages) == 1
    # Every item is its own row: the group served is the one in the file's name.
    served = torch.cat([g for _, _, g in dm.test_dataloader()]).tolist()
    assert served == [int(Path(p).name.split("_")[2]) for p in dm.test_frame["path"]]


def test_image_checks_are_cached_per_file_and_redone_when_a_file_changes(tmp_path, monkeypatch):
    import fairprune.data.faces.images as images

    root = tmp_path / "utk"
    paths = [str(root / f"2{i}_0_{i % 4}_2017{i:09d}.jpg.chip.jpg") for i in range(6)]
    for i, path in enumerate(paths):
        write_jpeg(Path(path), colour=(30 * i, 0, 0))
    decoded = []
    real = images.load_rgb
    monkeypatch.setattr(images, "load_rgb", lambda path: decoded.append(path) or real(path))
    assert images.check_images(paths) == [None] * 6 and sorted(decoded) == sorted(paths)
    decoded.clear()
    assert images.check_images(paths) == [None] * 6 and decoded == []  # from the cache: no decoding
    truncate(Path(paths[2]))  # size and modification time change: checked again, alone
    problems = images.check_images(paths)
    assert decoded == [paths[2]] and problems[2][0] == "unreadable" and problems[:2] == [None, None]
    decoded.clear()
    assert images.check_images(paths)[2][0] == "unreadable" and decoded == []  # failures are cached too


def test_report_json_counts_what_the_data_left_out(tmp_path, repo_root):
    """``data.skipped`` reaches report.json through the ReportWriter."""
    import json

    from fairprune.cli.train import main

    root = tmp_path / "utk"
    for i in range(40):
        write_jpeg(root / f"{20 + i}_{i % 2}_{i % 5}_2017{i:09d}.jpg.chip.jpg", colour=(6 * i, 90, 40), size=16)
    truncate(root / "21_1_1_2017000000001.jpg.chip.jpg")
    status = main(["fit", "--config", str(repo_root / "configs" / "vision" / "demo.yaml"), "--data.dataset", "utkface",
                   "--data.root", str(root), "--data.image_size", "32", "--data.batch_size", "4",
                   "--trainer.fast_dev_run", "1", "--trainer.accelerator", "cpu",
                   "--trainer.default_root_dir", str(tmp_path / "run")])
    assert status == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["data"]["skipped"] == {"malformed_name": 0, "others": 8, "missing": 0, "unreadable": 1}


# --------------------------------------------------------------------------------------------
# The synthetic set


def digests(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def test_synthetic_generator_is_deterministic_fast_and_resumable(tmp_path):
    start = time.perf_counter()
    a = generate_synthetic_utkface(tmp_path / "a", n=150, seed=4)
    b = generate_synthetic_utkface(tmp_path / "b", n=150, seed=4)
    assert time.perf_counter() - start < 20  # ~0.1 s each on a laptop; generous for busy CI
    assert digests(a) == digests(b) and len(list(a.glob("*.jpg"))) == 153
    assert digests(generate_synthetic_utkface(tmp_path / "c", n=150, seed=5)) != digests(a)
    # A half-written cache (no marker) is written again; a complete one is left alone.
    victim = sorted(a.glob("*.chip.jpg"))[10]
    victim.unlink()
    generate_synthetic_utkface(a, n=150, seed=4)
    assert not victim.exists()
    (a / MARKER).unlink()
    generate_synthetic_utkface(a, n=150, seed=4)
    assert digests(a) == digests(b)


@pytest.fixture(scope="module")
def synthetic_root(tmp_path_factory):
    return generate_synthetic_utkface(tmp_path_factory.mktemp("synthetic"), n=1000, seed=0)


def test_synthetic_cues_follow_the_design(synthetic_root):
    """Race shows in skin tone; hair carries gender for White only, stripes for every other group,
    readable in each, least on Asian faces (the faintest stripes)."""
    root = synthetic_root
    cues = pd.read_csv(root / "cues.csv")
    rgb = np.stack([np.asarray(Image.open(root / n), dtype=np.float32) / 255 for n in cues["name"]])
    gray = rgb.mean(-1)
    gender, race = cues["gender"].to_numpy(), cues["race"].to_numpy()
    white = race == 0

    def accuracy(features, labels, c=1.0):
        return cross_val_score(LogisticRegression(C=c, max_iter=2000), features, labels, cv=3).mean()

    skin = rgb[:, 28:36, 26:38].mean((1, 2))  # the face centre
    assert accuracy(skin, cues["race"]) > 0.7
    # Large cue: a linear model on a 16x16 thumbnail sees the hair outline.
    thumbs = gray.reshape(-1, 16, 4, 16, 4).mean((2, 4)).reshape(len(cues), -1)
    assert accuracy(thumbs[white], gender[white], c=0.1) > 0.7
    assert accuracy(thumbs[~white], gender[~white], c=0.1) < 0.62
    # Small cue: spectral energy of vertical vs horizontal stripes (period 8 px).
    power = np.abs(np.fft.fft2(gray - gray.mean((1, 2), keepdims=True))) ** 2
    k = np.abs(np.fft.fftfreq(64) * 64)
    band, low = (k >= 7) & (k <= 10), k <= 2
    ratio = np.log(power[:, low][:, :, band].sum((1, 2)) / power[:, band][:, :, low].sum((1, 2)))
    by_group = {r: accuracy(ratio[race == r, None], gender[race == r]) for r in range(4)}
    assert by_group[0] < 0.62, by_group
    assert min(by_group[r] for r in (1, 2, 3)) > 0.8, by_group
    assert by_group[2] < min(by_group[1], by_group[3]), by_group
    amplitude = cues.groupby("race")["stripe_amplitude"].mean()
    assert amplitude[2] < amplitude[3] < amplitude[1]


# --------------------------------------------------------------------------------------------
# The DataModule on the synthetic set


@pytest.fixture(scope="module")
def synthetic_dm(synthetic_root):
    dm = FaceDataModule("synthetic", root=str(synthetic_root), image_size=64, batch_size=32,
                        synthetic_size=1000, seed=0)
    names_before_setup = (dm.class_names, dm.group_names, dm.num_classes, dm.num_groups)
    dm.prepare_data()
    caught(dm.setup, "fit")
    return dm, names_before_setup


def test_datamodule_names_are_known_before_setup(synthetic_dm):
    dm, before = synthetic_dm
    assert before == (GENDERS, ["White", "Black", "Asian", "Indian"], 2, 4)
    for frame in (dm.train_frame, dm.val_frame, dm.test_frame):
        assert frame["target"].between(0, dm.num_classes - 1).all()
        assert frame["group"].between(0, dm.num_groups - 1).all()
    frames = (dm.train_frame, dm.val_frame, dm.test_frame)
    dm.setup("test")  # reads once
    assert all(a is b for a, b in zip(frames, (dm.train_frame, dm.val_frame, dm.test_frame)))


def test_datamodule_batches_have_the_right_shapes_and_normalisation(synthetic_dm):
    dm, _ = synthetic_dm
    images, targets, groups = next(iter(dm.val_dataloader()))
    assert images.shape == (32, 3, 64, 64) and images.dtype == torch.float32
    assert targets.dtype == groups.dtype == torch.int64
    assert targets.tolist() == dm.val_frame["target"][:32].tolist()
    # Undoing the ImageNet normalisation gives back the file's pixels.
    raw = np.asarray(Image.open(dm.val_frame["path"][0]).convert("RGB"), dtype=np.float32) / 255
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None], torch.tensor(IMAGENET_STD)[:, None, None]
    restored = (images[0] * std + mean).permute(1, 2, 0).numpy()
    assert np.abs(restored - raw).max() < 1e-5


def test_datamodule_group_counts_reflect_the_imbalance(synthetic_dm):
    dm, _ = synthetic_dm
    cues = pd.read_csv(dm.root / "cues.csv")
    frame = pd.concat([dm.train_frame, dm.val_frame, dm.test_frame])
    assert len(frame) == int((cues["race"] != 4).sum())  # Others left out, nothing else lost
    shares = frame["group"].value_counts(normalize=True).sort_index().to_numpy()
    expected = np.array(RACE_SHARES[:4]) / sum(RACE_SHARES[:4])
    assert np.abs(shares - expected).max() < 0.05
    assert abs(len(dm.train_frame) / len(frame) - 0.8) < 0.03


@pytest.mark.parametrize("fraction", [0.2, 0.5])
def test_importance_loader_is_stratified_ordered_and_sized(synthetic_dm, fraction):
    dm, _ = synthetic_dm
    loader = dm.importance_dataloader(fraction, seed=3)
    groups = torch.cat([g for _, _, g in loader]).numpy()
    per_group = dm.train_frame["group"].value_counts()
    expected = {g: max(1, round(fraction * n)) for g, n in per_group.items()}
    assert pd.Series(groups).value_counts().to_dict() == expected
    again = torch.cat([t for _, t, _ in dm.importance_dataloader(fraction, seed=3)])
    assert torch.equal(again, torch.cat([t for _, t, _ in loader]))
    other = dm.importance_dataloader(fraction, seed=4).dataset.indices
    assert other != loader.dataset.indices
    with pytest.raises(UserError, match="fraction"):
        dm.importance_dataloader(0.0, seed=0)


def test_stratified_subset_matches_a_per_group_count():
    groups = np.repeat([0, 1, 2, -1], [50, 7, 1, 12])
    picked = stratified_subset(groups, 0.2, seed=0)
    assert np.all(np.diff(picked) > 0)
    assert {g: int((groups[picked] == g).sum()) for g in (0, 1, 2, -1)} == {0: 10, 1: 1, 2: 1, -1: 2}


def test_datamodule_warns_for_an_absent_group_and_caps_splits(tmp_path, monkeypatch):
    for i in range(30):  # only White and Black faces
        write_jpeg(tmp_path / "utk" / f"{20 + i}_{i % 2}_{i % 2}_2017{i:09d}.jpg.chip.jpg")
    dm = FaceDataModule("utkface", root=str(tmp_path / "utk"), max_samples=5)
    _, messages = caught(dm.setup, "fit")
    absent = [m for m in messages if m.startswith("no samples of group")]
    assert len(absent) == 1 and "Asian in train" in absent[0] and "Indian in test" in absent[0]
    assert len(dm.train_frame) == 5 and len(dm.val_frame) == 3
    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))
    assert FaceDataModule(synthetic_size=123, seed=9).root == tmp_path / "cache" / f"synthetic_utkface_v{VERSION}_123_9"


def test_datamodule_rejects_bad_settings_at_init(tmp_path):
    with pytest.raises(UserError, match="did you mean: celeba"):
        FaceDataModule("celeb")
    with pytest.raises(UserError, match="target 'Smile'"):
        FaceDataModule("synthetic", target="Smile")
    with pytest.raises(UserError, match="batch_size must be a positive integer"):
        FaceDataModule("synthetic", batch_size=0)


# --------------------------------------------------------------------------------------------
# Edge cases: nothing readable, worker processes, non-square images


def test_no_readable_image_is_a_user_error(tmp_path):
    for i in range(3):
        (tmp_path / f"2{i}_0_0_2017010100000000{i}.jpg.chip.jpg").write_bytes(b"garbage")
    with pytest.raises(UserError, match="none of the 3 images could be read"):
        FaceDataModule("utkface", root=str(tmp_path)).setup()


def test_failures_inside_worker_processes_name_the_file(utk_root):
    frame, _ = caught(read_utkface, utk_root)
    dataset = FaceDataset(frame)
    Path(frame["path"][1]).write_bytes(b"\xff\xd8 broken after validation")
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, num_workers=1)
    with pytest.raises(UserError, match=f"cannot load image '.*{Path(frame['path'][1]).name}'"):
        [g for _, _, g in loader]


def test_tall_images_are_centre_cropped_not_squashed():
    pixels = np.zeros((24, 16, 3), dtype=np.uint8)  # CelebA-like: taller than wide
    pixels[:, :, 2] = 255
    pixels[:4, :, 0], pixels[:4, :, 2] = 255, 0  # a red band on top, outside the centre square
    image = face_transform(16)(Image.fromarray(pixels))
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None], torch.tensor(IMAGENET_STD)[:, None, None]
    restored = image * std + mean
    assert image.shape == (3, 16, 16)
    assert restored[0].max() < 0.05 and restored[2].min() > 0.95
