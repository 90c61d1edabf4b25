"""Tiny datasets in the real on-disk layouts (UTKFace, FairFace, CelebA), written by tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from fairprune.data.faces import CELEBA_ATTRIBUTES, FAIRFACE_RACES


def _image(path: Path, seed: int, size: int = 16) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, quality=90)


def write_utkface(root: Path, per_cell: int = 3, chip: bool = True) -> Path:
    """Every (gender, race) cell gets ``per_cell`` images named ``age_gender_race_datetime.jpg[.chip.jpg]``."""
    suffix = ".jpg.chip.jpg" if chip else ".jpg"
    i = 0
    for gender in (0, 1):
        for race in range(5):
            for _ in range(per_cell):
                _image(root / f"{20 + i % 50}_{gender}_{race}_2017011{i:010d}{suffix}", i)
                i += 1
    return root


def write_fairface(root: Path, per_cell: int = 2) -> Path:
    """``fairface_label_{train,val}.csv`` and ``train/`` / ``val/`` images for every (race, gender)."""
    for split, n in (("train", per_cell * 3), ("val", per_cell)):
        rows = ["file,age,gender,race,service_test"]
        i = 0
        for race in FAIRFACE_RACES:
            for gender in ("Male", "Female"):
                for _ in range(n):
                    name = f"{split}/{i + 1}.jpg"
                    _image(root / name, hash((split, i)) % 10_000)
                    rows.append(f"{name},20-29,{gender},{race},True")
                    i += 1
        (root / f"fairface_label_{split}.csv").write_text("\n".join(rows) + "\n")
    return root


def write_celeba(root: Path, n: int = 24) -> Path:
    """torchvision's CelebA layout: attribute and partition lists plus ``img_align_celeba/``."""
    rng = np.random.default_rng(0)
    attrs = [f"{n:d}", " ".join(CELEBA_ATTRIBUTES)]
    parts = []
    for i in range(n):
        name = f"{i + 1:06d}.jpg"
        _image(root / "img_align_celeba" / name, i)
        values = rng.choice([-1, 1], size=len(CELEBA_ATTRIBUTES))
        attrs.append(name + " " + " ".join(f"{v:2d}" for v in values))
        parts.append(f"{name} {i % 3}")
    (root / "list_attr_celeba.txt").write_text("\n".join(attrs) + "\n")
    (root / "list_eval_partition.txt").write_text("\n".join(parts) + "\n")
    return root
