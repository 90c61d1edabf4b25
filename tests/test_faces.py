"""Face data: readers on tiny fixtures in each real layout, the synthetic set, the DataModule."""

from __future__ import annotations

import hashlib
import shutil
import time
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from fairprune.data.faces import (
    CELEBA_ATTRIBUTES,
    FaceDataModule,
    FaceDataset,
    face_transform,
    read_celeba,
    read_fairface,
    read_utkface,
    seeded_split,
    task_info,
)
from fairprune.data.synthetic import draw_faces, generate_synthetic_utkface
from fairprune.errors import UserError


def write_jpeg(path, seed: int = 0, size: int = 12):
    """A small random JPEG at ``path`` (folders created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, format="JPEG")


def parse_utk(name: str) -> tuple[int, int, int]:
    """Oracle: age, gender, race of a well-formed UTKFace name."""
    age, gender, race = name.split("_")[:3]
    return int(age), int(gender), int(race)


UTK_GOOD = {
    "UTKFace": [f"{20 + i}_{i % 2}_{i % 5}_2017011{i:010d}.jpg.chip.jpg" for i in range(20)],
    "part1": [f"{30 + i}_{(i + 1) % 2}_{i % 5}_2016021{i:010d}.jpg" for i in range(10)],
}
UTK_BAD = ["39_1_20170116174525125.jpg.chip.jpg", "x_0_1_20170116174525125.jpg"]


@pytest.fixture
def utk_root(tmp_path):
    root = tmp_path / "utk"
    for i, (folder, name) in enumerate((f, n) for f, names in UTK_GOOD.items() for n in names + UTK_BAD):
        write_jpeg(root / folder / name, seed=i)
    return root


def read_quietly(reader, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return reader(*args, **kwargs)


# --- UTKFace ---------------------------------------------------------------------------------------


def test_utkface_reads_both_name_styles_with_labels_from_names(utk_root):
    frame = read_quietly(read_utkface, utk_root, target="gender", sensitive="race", include_others=True)
    names = [p.rsplit("/", 1)[1] for p in frame["path"]]
    assert sorted(names) == sorted(n for ns in UTK_GOOD.values() for n in ns)
    assert list(frame.columns[:4]) == ["path", "target", "group", "split"]
    for name, target, group, age in zip(names, frame["target"], frame["group"], frame["age"]):
        assert (age, target, group) == parse_utk(name)
    assert all(p.startswith("/") for p in frame["path"])
    assert frame["target"].dtype == np.int64 and frame["group"].dtype == np.int64


def test_utkface_malformed_names_give_one_warning_with_count(utk_root):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        read_utkface(utk_root)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1
    assert f"skipped {2 * len(UTK_BAD)}" in messages[0]


def test_utkface_others_left_out_by_default_and_included_on_request(utk_root):
    default = read_quietly(read_utkface, utk_root, target="race", sensitive="gender")
    assert 4 not in set(default["race"]) and 4 not in set(default["target"])
    assert task_info("utkface", "race", "gender")[0] == ["White", "Black", "Asian", "Indian"]
    others = read_quietly(read_utkface, utk_root, target="gender", sensitive="race", include_others=True)
    assert (others["group"] == 4).sum() == sum(parse_utk(n)[2] == 4 for ns in UTK_GOOD.values() for n in ns)
    assert task_info("utkface", "gender", "race", include_others=True)[1][4] == "Others"


def test_utkface_target_equal_to_sensitive_and_no_sensitive(utk_root):
    same = read_quietly(read_utkface, utk_root, target="race", sensitive="race")
    assert (same["target"] == same["group"]).all()
    unsupervised = read_quietly(read_utkface, utk_root, sensitive=None)
    assert (unsupervised["group"] == -1).all()
    assert task_info("utkface", "gender", None)[0] == ["Male", "Female"]


def test_utkface_age_target_is_binned_like_fairface(utk_root):
    frame = read_quietly(read_utkface, utk_root, target="age", sensitive="gender", include_others=True)
    class_names = task_info("utkface", "age", "gender")[0]
    for age, target in zip(frame["age"], frame["target"]):
        low, _, high = class_names[target].partition("-")
        assert int(low) <= age <= int(high) if high else age >= 70


def test_utkface_keeps_one_copy_of_a_face_in_both_name_styles(tmp_path):
    write_jpeg(tmp_path / "aligned" / "30_1_2_20170101000000001.jpg.chip.jpg")
    write_jpeg(tmp_path / "wild" / "30_1_2_20170101000000001.jpg")
    write_jpeg(tmp_path / "wild" / "31_0_0_20170101000000002.jpg")
    frame = read_utkface(tmp_path)
    assert sorted(p.rsplit("/", 1)[1] for p in frame["path"]) == [
        "30_1_2_20170101000000001.jpg.chip.jpg", "31_0_0_20170101000000002.jpg",
    ]


def test_utkface_split_is_stable_and_independent_of_file_order(utk_root, tmp_path):
    first = read_quietly(read_utkface, utk_root, seed=3)
    again = read_quietly(read_utkface, utk_root, seed=3)
    pd.testing.assert_frame_equal(first, again)
    # The same files written in reverse order into another folder layout.
    other = tmp_path / "other"
    files = sorted(utk_root.rglob("*.jpg"), reverse=True)
    for i, path in enumerate(files):
        folder = other / f"d{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, folder / path.name)
    moved = read_quietly(read_utkface, other, seed=3)
    by_name = lambda f: dict(zip(f["path"].str.rsplit("/", n=1).str[1], f["split"]))
    assert by_name(moved) == by_name(first)


def test_seeded_split_proportions_seed_and_order():
    keys = [f"face{i}" for i in range(2000)]
    split = seeded_split(keys, seed=0)
    counts = pd.Series(split).value_counts()
    assert (counts["train"], counts["val"], counts["test"]) == (1600, 200, 200)
    assert (seeded_split(keys, seed=1) != split).mean() > 0.2
    assert (seeded_split(keys[::-1], seed=0)[::-1] == split).all()


# --- FairFace --------------------------------------------------------------------------------------

FAIRFACE_RACES = ["White", "Black", "Latino_Hispanic", "East Asian", "Southeast Asian", "Indian", "Middle Eastern"]


def write_fairface(root, n_train=30, n_val=10, bad_race_row=None):
    for csv, folder, n in (("fairface_label_train.csv", "train", n_train), ("fairface_label_val.csv", "val", n_val)):
        rows = []
        for i in range(n):
            race = "Martian" if (folder == "train" and i == bad_race_row) else FAIRFACE_RACES[i % 7]
            rows.append((f"{folder}/{i + 1}.jpg", "20-29", ["Male", "Female"][i % 2], race, "True"))
            write_jpeg(root / folder / f"{i + 1}.jpg", seed=i)
        pd.DataFrame(rows, columns=["file", "age", "gender", "race", "service_test"]).to_csv(root / csv, index=False)
    return root


def test_fairface_labels_and_official_split(tmp_path):
    root = write_fairface(tmp_path / "ff")
    frame = read_fairface(root, target="race", sensitive="gender", seed=0)
    class_names, group_names = task_info("fairface", "race", "gender")
    assert [class_names[t] for t in frame["target"]] == frame["race"].tolist()
    assert [group_names[g] for g in frame["group"]] == frame["gender"].tolist()
    from_val = frame["file"].str.startswith("val/")
    assert (frame["split"][from_val] == "test").all()
    assert set(frame["split"][~from_val]) <= {"train", "val"}
    assert (frame["path"] == [str((root / f).resolve()) for f in frame["file"]]).all()


def test_fairface_val_carve_out_is_about_ten_percent(tmp_path):
    root = write_fairface(tmp_path / "ff", n_train=300, n_val=2)
    frame = read_fairface(root, seed=5)
    assert (frame["split"] == "val").sum() == 30


def test_fairface_unknown_race_names_file_and_row(tmp_path):
    root = write_fairface(tmp_path / "ff", bad_race_row=3)
    with pytest.raises(UserError) as error:
        read_fairface(root)
    assert "Martian" in str(error.value) and "fairface_label_train.csv, line 5" in str(error.value)


def test_fairface_missing_label_file(tmp_path):
    root = write_fairface(tmp_path / "ff")
    (root / "fairface_label_val.csv").unlink()
    with pytest.raises(UserError, match="fairface_label_val.csv"):
        read_fairface(root)


# --- CelebA ----------------------------------------------------------------------------------------


def write_celeba(root, n=12):
    rng = np.random.default_rng(0)
    values = rng.choice([-1, 1], size=(n, 40))
    files = [f"{i + 1:06d}.jpg" for i in range(n)]
    lines = [str(n), " ".join(CELEBA_ATTRIBUTES)]
    lines += [f"{f} " + " ".join(f"{v:2d}" for v in row) for f, row in zip(files, values)]
    root.mkdir(parents=True)
    (root / "list_attr_celeba.txt").write_text("\n".join(lines) + "\n")
    partition = [i % 3 for i in range(n)]
    (root / "list_eval_partition.txt").write_text("".join(f"{f} {p}\n" for f, p in zip(files, partition)))
    for i, f in enumerate(files):
        write_jpeg(root / "img_align_celeba" / f, seed=i)
    return pd.DataFrame(values, columns=CELEBA_ATTRIBUTES).assign(file=files, partition=partition)


@pytest.mark.parametrize("nested", [False, True])
def test_celeba_attributes_and_official_split(tmp_path, nested):
    truth = write_celeba(tmp_path / "data" / "celeba" if nested else tmp_path / "data")
    frame = read_celeba(tmp_path / "data", target="Smiling", sensitive="Male")
    assert (frame["target"] == (truth["Smiling"] == 1)).all()
    assert (frame["group"] == (truth["Male"] == 1)).all()
    assert set(np.unique(frame[CELEBA_ATTRIBUTES].to_numpy())) <= {0, 1}
    assert (frame["split"] == truth["partition"].map({0: "train", 1: "val", 2: "test"})).all()
    assert all(p.endswith(f"img_align_celeba/{f}") for p, f in zip(frame["path"], truth["file"]))
    assert task_info("celeba", "Smiling", "Male") == (["not_Smiling", "Smiling"], ["Female", "Male"])


def test_celeba_unknown_attribute_lists_the_forty(tmp_path):
    write_celeba(tmp_path / "c")
    with pytest.raises(UserError) as error:
        read_celeba(tmp_path / "c", target="Smiley")
    message = str(error.value)
    assert "\n" not in message and "Smiling" in message
    assert all(name in message for name in CELEBA_ATTRIBUTES)


def test_celeba_gender_means_male(tmp_path):
    truth = write_celeba(tmp_path / "c")
    frame = read_celeba(tmp_path / "c", target="gender", sensitive="Young")
    assert (frame["target"] == (truth["Male"] == 1)).all()


# --- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("reader", [read_utkface, read_fairface, read_celeba])
def test_missing_root_is_a_user_error(tmp_path, reader):
    with pytest.raises(UserError, match=r"dataset root '.*nowhere' does not exist; pass --data.root"):
        reader(tmp_path / "nowhere")


def test_unknown_names_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="did you mean: utkface"):
        FaceDataModule("utkfce", root=str(tmp_path))
    with pytest.raises(UserError, match="gender, race"):
        task_info("utkface", "hair", "race")
    with pytest.raises(UserError, match=r"sensitive.*gender, race"):
        task_info("fairface", target="gender", sensitive="ethnicity")
    with pytest.raises(UserError, match="does not exist"):
        FaceDataModule("celeba", root=str(tmp_path / "missing"), target="Smiling", sensitive="Male")
    with pytest.raises(UserError, match="CelebA sensitive 'race'.*Male"):
        FaceDataModule("celeba", root=str(tmp_path), target="Smiling")  # CelebA has no race label


# --- images and the Dataset -------------------------------------------------------------------------


def test_corrupt_images_are_dropped_at_setup_with_one_warning(utk_root):
    (utk_root / "UTKFace" / UTK_GOOD["UTKFace"][0]).write_bytes(b"not a jpeg")
    (utk_root / "UTKFace" / UTK_GOOD["UTKFace"][1]).write_bytes(b"")
    dm = FaceDataModule("utkface", root=str(utk_root), include_others=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.setup()
    unreadable = [str(w.message) for w in caught if "unreadable" in str(w.message)]
    assert len(unreadable) == 1 and " 2 unreadable" in unreadable[0]
    kept = len(dm.train_frame) + len(dm.val_frame) + len(dm.test_frame)
    assert kept == sum(map(len, UTK_GOOD.values())) - 2


def test_all_images_unreadable_is_a_user_error(tmp_path):
    for i in range(3):
        (tmp_path / f"2{i}_0_0_2017010100000000{i}.jpg.chip.jpg").write_bytes(b"garbage")
    with pytest.raises(UserError, match="none of the 3 images could be read"):
        FaceDataModule("utkface", root=str(tmp_path)).setup()


def test_transform_keeps_the_aspect_of_tall_images():
    """A CelebA-like tall image is centre-cropped, not squashed: its top band is cut away."""
    pixels = np.zeros((24, 16, 3), dtype=np.uint8)
    pixels[:, :, 2] = 255
    pixels[:4, :, 0], pixels[:4, :, 2] = 255, 0  # red band on top, outside the centre square
    image = face_transform(16)(Image.fromarray(pixels))
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    restored = image * std[:, None, None] + mean[:, None, None]
    assert image.shape == (3, 16, 16)
    assert restored[0].max() < 0.05 and restored[2].min() > 0.95


def truncated_dataset(tmp_path, num=6):
    paths = []
    for i in range(num):
        write_jpeg(tmp_path / f"{i}.jpg", seed=i, size=32)
        paths.append(str(tmp_path / f"{i}.jpg"))
    data = (tmp_path / "2.jpg").read_bytes()
    (tmp_path / "2.jpg").write_bytes(data[: len(data) // 2])  # header intact, scan data cut
    frame = pd.DataFrame({"path": paths, "target": np.arange(num) % 2, "group": np.arange(num)})
    return FaceDataset(frame, face_transform(16))


def test_dataset_substitutes_an_image_that_fails_to_load(tmp_path):
    dataset = truncated_dataset(tmp_path)
    with pytest.warns(UserWarning, match="could not load"):
        image, target, group = dataset[2]
    expected = dataset[3]
    assert torch.equal(image, expected[0]) and int(group) == 3 and int(target) == 1
    assert dataset.num_failed == 1
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32
    assert target.dtype == torch.int64 and group.dtype == torch.int64


def test_failures_in_worker_processes_are_counted(tmp_path):
    dataset = truncated_dataset(tmp_path)
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, num_workers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        groups = torch.cat([g for _, _, g in loader])
    assert groups.tolist() == [0, 1, 3, 3, 4, 5]
    assert dataset.num_failed == 1


# --- synthetic set ---------------------------------------------------------------------------------


def digest(root):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def test_synthetic_is_deterministic_fast_and_in_utkface_layout(tmp_path):
    start = time.perf_counter()
    a = generate_synthetic_utkface(tmp_path / "a", n=400, seed=7)
    assert time.perf_counter() - start < 10.0
    b = generate_synthetic_utkface(tmp_path / "b", n=400, seed=7)
    assert digest(a) == digest(b)
    assert digest(a) != digest(generate_synthetic_utkface(tmp_path / "c", n=400, seed=8))
    names = [p.name for p in a.glob("*.jpg")]
    assert len(names) == 403 and all(n.endswith(".jpg.chip.jpg") for n in names)
    with Image.open(next(a.glob("*.jpg"))) as image:
        assert image.size == (64, 64) and image.format == "JPEG"


def test_synthetic_half_written_cache_is_completed(tmp_path):
    root = generate_synthetic_utkface(tmp_path / "s", n=50, seed=1)
    before = digest(root)
    victim = sorted(root.glob("*.jpg"))[5]
    victim.unlink()
    generate_synthetic_utkface(root, n=50, seed=1)  # the marker is there: nothing is redone
    assert not victim.exists()
    (root / ".complete").unlink()
    generate_synthetic_utkface(root, n=50, seed=1)
    assert digest(root) == before


@pytest.fixture(scope="module")
def synthetic_root(tmp_path_factory):
    return generate_synthetic_utkface(tmp_path_factory.mktemp("syn") / "s", n=1200, seed=0)


def test_synthetic_cues_follow_the_design(synthetic_root):
    cues = pd.read_csv(synthetic_root / "cues.csv")
    white, rest = cues[cues["race"] == 0], cues[cues["race"] != 0]
    # The majority's gender shows in hair length only; everyone else's in the stripe orientation.
    assert (white["long_hair"] == (white["gender"] == 1)).all()
    assert (rest["vertical_stripes"] == (rest["gender"] == 1)).all()
    assert 0.35 < (white["vertical_stripes"] == (white["gender"] == 1)).mean() < 0.65
    assert 0.4 < (rest["long_hair"] == (rest["gender"] == 1)).mean() < 0.6
    shares = cues["race"].value_counts(normalize=True).sort_index().to_numpy()
    assert np.allclose(shares, [0.45, 0.19, 0.15, 0.17, 0.04], atol=0.04)


def test_synthetic_cues_are_drawn_where_designed():
    labels = pd.DataFrame({"race": [0, 1] * 4, "age": [30] * 8, "long_hair": [False] * 8,
                           "stripes": [True] * 8, "vertical_stripes": [False] * 8})
    base = draw_faces(labels, np.random.default_rng(0)).astype(int)
    hair = draw_faces(labels.assign(long_hair=True), np.random.default_rng(0)).astype(int)
    stripes = draw_faces(labels.assign(vertical_stripes=True), np.random.default_rng(0)).astype(int)
    changed = lambda other: (np.abs(other - base).max(-1) > 0).reshape(8, -1).mean(1)
    # Long hair is a large cue (several percent of the image), the stripe patch a small one.
    assert (changed(hair) > 0.05).all()
    assert (changed(stripes) > 0.005).all() and (changed(stripes) < 0.04).all()
    assert (changed(hair) > 2 * changed(stripes)).all()


def test_synthetic_race_shows_in_skin_tone(synthetic_root):
    cues = pd.read_csv(synthetic_root / "cues.csv")
    cues = cues[cues["race"] < 4].reset_index(drop=True)
    # The median colour of the face centre and a nearest-centroid rule must tell the races apart.
    colours = np.stack([
        np.median(np.asarray(Image.open(synthetic_root / n))[26:38, 28:36].reshape(-1, 3), axis=0)
        for n in cues["name"]
    ])
    fit = np.arange(len(cues)) % 2 == 0
    race = cues["race"].to_numpy()
    centroids = np.stack([colours[fit & (race == r)].mean(0) for r in range(4)])
    predicted = ((colours[~fit, None] - centroids[None]) ** 2).sum(-1).argmin(1)
    assert (predicted == race[~fit]).mean() > 0.8


# --- DataModule ------------------------------------------------------------------------------------


def test_datamodule_on_synthetic_batches_and_imbalance(synthetic_root):
    dm = FaceDataModule("synthetic", root=str(synthetic_root), image_size=32, batch_size=16, seed=0)
    assert (dm.class_names, dm.group_names) == task_info("synthetic", "gender", "race")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dm.prepare_data()
        dm.setup("fit")
    images, targets, groups = next(iter(dm.train_dataloader()))
    assert images.shape == (16, 3, 32, 32) and images.dtype == torch.float32
    assert targets.dtype == torch.int64 and groups.dtype == torch.int64
    assert set(targets.tolist()) <= {0, 1} and set(groups.tolist()) <= {0, 1, 2, 3}
    assert (dm.num_classes, dm.num_groups) == (2, 4)
    frame = pd.concat([dm.train_frame, dm.val_frame, dm.test_frame])
    assert abs(len(dm.train_frame) / len(frame) - 0.8) < 0.01
    shares = frame["group"].value_counts(normalize=True)
    assert shares.idxmax() == 0 and abs(shares[0] - 0.45 / 0.96) < 0.06
    assert all(shares[g] < 0.25 for g in (1, 2, 3))
    first = dm.train_frame
    dm.setup("test")  # idempotent
    assert dm.train_frame is first


def test_importance_loader_is_stratified_and_sized(synthetic_root):
    dm = FaceDataModule("synthetic", root=str(synthetic_root), image_size=16, batch_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dm.setup()
    loader = dm.importance_dataloader(fraction=0.2, seed=1)
    groups = torch.cat([g for _, _, g in loader]).numpy()
    train_counts = dm.train_frame["group"].value_counts()
    picked_counts = pd.Series(groups).value_counts()
    for group, count in train_counts.items():
        assert abs(picked_counts[group] - 0.2 * count) <= 1
    indices = loader.dataset.indices
    assert indices == sorted(set(indices))  # fixed order, no repeats
    assert dm.importance_dataloader(0.2, seed=1).dataset.indices == indices
    assert dm.importance_dataloader(0.2, seed=2).dataset.indices != indices
    with pytest.raises(UserError):
        dm.importance_dataloader(fraction=1.5, seed=0)


def test_datamodule_warns_about_a_group_missing_from_a_split(tmp_path):
    root = tmp_path / "utk"
    for i in range(30):
        write_jpeg(root / f"{20 + i}_{i % 2}_{0 if i else 1}_2017{i:013d}.jpg.chip.jpg", seed=i)
    dm = FaceDataModule("utkface", root=str(root))
    with pytest.warns(UserWarning, match=r"no samples of group .*Black in (train|val|test)"):
        dm.setup()
    empty = [s for s in ("train", "val", "test") if (getattr(dm, f"{s}_frame")["group"] == 1).sum() == 0]
    assert len(empty) == 2


def test_datamodule_max_samples_and_cache_location(tmp_path, monkeypatch):
    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))
    dm = FaceDataModule("synthetic", synthetic_size=60, max_samples=25, image_size=16)
    assert dm.root == tmp_path / "cache" / "synthetic_utkface_60_0"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dm.setup()  # without prepare_data(): writes the set itself
    assert (dm.root / ".complete").exists()
    assert len(dm.train_frame) == 25 and 0 < len(dm.val_frame) <= 25 and dm.hparams.max_samples == 25


@pytest.mark.slow
def test_small_cnn_learns_the_majority_cue_better(tmp_path):
    """A small CNN reaches high accuracy on White faces and lower, above-chance on the others."""
    torch.manual_seed(0)
    root = generate_synthetic_utkface(tmp_path / "s", n=4000, seed=0)
    dm = FaceDataModule("synthetic", root=str(root), batch_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dm.setup()
    nn = torch.nn

    def block(i, o, kernel=3, stride=2):
        return nn.Sequential(nn.Conv2d(i, o, kernel, stride, kernel // 2), nn.BatchNorm2d(o), nn.ReLU())

    net = nn.Sequential(block(3, 16, kernel=5), block(16, 32), block(32, 64), block(64, 64, stride=1),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 2))
    epochs = 12
    optimizer = torch.optim.Adam(net.parameters(), 2e-3)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 4e-3, total_steps=epochs * len(dm.train_dataloader()))
    for _ in range(epochs):
        net.train()
        for images, targets, _ in dm.train_dataloader():
            loss = nn.functional.cross_entropy(net(images), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
    net.eval()
    with torch.no_grad():
        results = [(net(x).argmax(1) == y, g) for loader in (dm.val_dataloader(), dm.test_dataloader())
                   for x, y, g in loader]
    correct, groups = torch.cat([r[0] for r in results]).float(), torch.cat([r[1] for r in results])
    white, others = correct[groups == 0].mean().item(), correct[groups != 0].mean().item()
    print(f"accuracy White {white:.3f}, others {others:.3f}")
    assert white > 0.9 and 0.6 < others < white - 0.03
