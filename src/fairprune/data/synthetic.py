"""A synthetic face-attribute set in the UTKFace layout, made in seconds and fully offline.

Every image is a cartoon face: an ellipse of skin on a coloured background, with hair, two
eyes, a mouth, pixel noise, and jitter in position, scale and lighting. The set is built so that
pruning has something to hurt unevenly:

* **Race** follows UTKFace's imbalance (White ~45 %, Black ~19 %, Asian ~15 %, Indian ~17 %,
  Others ~4 %) and is visible in the skin tone (a per-race mean colour plus per-face noise), so a
  race classifier can learn it.
* **Gender** is roughly balanced and learnable in every group, but *how it shows depends on the
  race*, and so does how hard it is to read:

  - White faces: a large, easy cue. Women have long hair falling down both sides of the face,
    men short hair on top. The small cue below is present but random.
  - Black, Asian, Indian and Others faces: hair length is random, so the large cue says nothing.
    Gender shows in a disc of stripes on one cheek: vertical stripes for women, horizontal for
    men. Every such face has the disc; its contrast depends on the race (strongest on Black
    faces, then Indian and Others, faintest on Asian faces, whose light skin also clips part of
    it), which makes the groups' task unequally hard.

  A small CNN learns every group's cue within a few epochs (a half-width MobileNet-V2 at 48 px,
  8 epochs: every group above 0.85 on the test split), but the minority groups' label rests on a
  fine texture the majority does not use, and a network pruned hard without regard to the groups
  loses the cues unevenly: what fair pruning is for.
* **Age** is drawn from 1-90 with UTKFace's bulge at 20-40; older faces tend to grey hair. Age is
  recorded in the file name only; it is not a designed cue.

Files are written as ``{age}_{gender}_{race}_{datetime}.jpg.chip.jpg`` (gender 0 male, 1 female;
race 0 White, 1 Black, 2 Asian, 3 Indian, 4 Others), JPEG quality 90, plus three files with
malformed names (a reader must skip them), plus ``cues.csv`` (the hidden cues of every image,
for analysis), and a ``.complete`` marker written last. The same arguments give the same bytes.
:data:`VERSION` numbers the design: the DataModule's cache folder names it, so a changed design
is generated afresh instead of read from an older cache.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image

#: Share of each UTKFace race code (0 White, 1 Black, 2 Asian, 3 Indian, 4 Others).
RACE_SHARES = (0.45, 0.19, 0.15, 0.17, 0.04)
#: Mean skin colour (RGB in [0, 1]) per race code; per-face noise is added on top.
SKIN_TONES = np.array(
    [
        [0.93, 0.78, 0.68],  # White
        [0.42, 0.28, 0.20],  # Black
        [0.86, 0.72, 0.48],  # Asian
        [0.66, 0.47, 0.33],  # Indian
        [0.77, 0.60, 0.45],  # Others
    ],
    dtype=np.float32,
)
#: Race code whose gender shows in hair length; every other race shows it in the stripes.
MAJORITY_RACE = 0
#: Range of the stripe amplitude (on a [0, 1] intensity scale) per race code: the minority groups'
#: difficulty. White faces' stripes are random in orientation (no cue), the others' carry gender.
STRIPE_AMPLITUDE = np.array(
    [
        [0.06, 0.14],  # White (random orientation)
        [0.26, 0.36],  # Black
        [0.20, 0.30],  # Asian
        [0.22, 0.32],  # Indian
        [0.22, 0.32],  # Others
    ],
    dtype=np.float32,
)
#: Radius of the stripe patch, as a fraction of the face's half-width.
STRIPE_RADIUS = 0.55
#: Stripe period in pixels at any image size (8 at the default 64 px, 6 after the demo's resize to
#: 48 px): survives JPEG at quality 90 and the resize.
STRIPE_PERIOD = 8.0
#: The design's version (2: every face carries a stripe disc, of a contrast set per race; 3: fainter
#: random stripes on White faces, stronger ones on the others).
VERSION = 3
MARKER = ".complete"
CHUNK = 512  # faces drawn at once: bounds memory to a few tens of MB


def generate_synthetic_utkface(
    root: str | Path, n: int = 4000, seed: int = 0, image_size: int = 64
) -> Path:
    """Write ``n`` synthetic faces (plus three malformed names) under ``root``; return ``root``.

    Skips the work when ``root/.complete`` exists. Files are overwritten in place, never
    deleted, so pointing ``root`` at a folder with other content is safe.
    """
    root = Path(root)
    if (root / MARKER).exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    labels = _draw_labels(rng, n)
    for start in range(0, n, CHUNK):
        part = labels.iloc[start : start + CHUNK]
        pixels = draw_faces(part, rng, image_size)
        for name, image in zip(part["name"], pixels):
            Image.fromarray(image).save(root / name, format="JPEG", quality=90)
    for name in _malformed_names(labels):
        Image.fromarray(pixels[0]).save(root / name, format="JPEG", quality=90)
    labels.to_csv(root / "cues.csv", index=False)
    (root / MARKER).write_text(f"version={VERSION} n={n} seed={seed} image_size={image_size}\n")
    return root


def _draw_labels(rng: np.random.Generator, n: int) -> pd.DataFrame:
    """Draw the labels and hidden cues of every face; one row per image."""
    race = rng.choice(len(RACE_SHARES), size=n, p=RACE_SHARES)
    gender = (rng.random(n) < 0.5).astype(int)
    age = _draw_ages(rng, n)
    majority = race == MAJORITY_RACE
    # The large cue follows gender for the majority only; the small cue for everyone else.
    long_hair = np.where(majority, gender == 1, rng.random(n) < 0.5)
    vertical = np.where(majority, rng.random(n) < 0.5, gender == 1)
    low, high = STRIPE_AMPLITUDE[race].T
    amplitude = np.round(low + (high - low) * rng.random(n), 4)
    start = dt.datetime(2017, 1, 10, 9, 0, 0)
    # One distinct timestamp per image keeps every file name unique.
    stamps = [start + dt.timedelta(seconds=41 * i, milliseconds=int(rng.integers(1000))) for i in range(n)]
    dates = [s.strftime("%Y%m%d%H%M%S") + f"{s.microsecond // 1000:03d}" for s in stamps]
    names = [f"{a}_{g}_{r}_{d}.jpg.chip.jpg" for a, g, r, d in zip(age, gender, race, dates)]
    return pd.DataFrame(
        {"name": names, "age": age, "gender": gender, "race": race,
         "long_hair": long_hair, "vertical_stripes": vertical, "stripe_amplitude": amplitude}
    )


def _draw_ages(rng: np.random.Generator, n: int) -> np.ndarray:
    """Ages 1-90 shaped like UTKFace: many young adults, some children and elderly."""
    kind = rng.choice(3, size=n, p=(0.12, 0.70, 0.18))
    young = rng.integers(1, 16, size=n)
    adult = np.clip(np.rint(rng.normal(32, 10, size=n)), 16, 60)
    old = rng.integers(61, 91, size=n)
    return np.choose(kind, [young, adult, old]).astype(int)


def _malformed_names(labels: pd.DataFrame) -> list[str]:
    """Three names a UTKFace reader must reject, modelled on the real set's broken files."""
    date = labels["name"].iloc[0].split("_")[3].split(".")[0]
    return [
        f"39_1_{date}.jpg.chip.jpg",  # race missing (as in the real set)
        f"x_0_1_{date}.jpg.chip.jpg",  # age not a number
        f"25__2_{date}.jpg.chip.jpg",  # gender empty
    ]


def draw_faces(labels: pd.DataFrame, rng: np.random.Generator, size: int = 64) -> np.ndarray:
    """Draw one face per row of ``labels``; returns uint8 images of shape (B, size, size, 3)."""
    b = len(labels)
    # Normalised coordinates in [-1, 1]; per-face parameters broadcast as (B, 1, 1).
    axis = np.linspace(-1.0, 1.0, size, dtype=np.float32)
    y, x = np.meshgrid(axis, axis, indexing="ij")

    def param(low, high):
        return rng.uniform(low, high, size=(b, 1, 1)).astype(np.float32)

    cx, cy, scale = param(-0.10, 0.10), param(-0.08, 0.08), param(0.85, 1.10)
    ax, ay = 0.42 * scale, 0.55 * scale
    image = _background(rng, b, y)
    _paint(image, _hair_mask(x, y, cx, cy, ax, ay, labels["long_hair"].to_numpy()),
           _hair_colours(rng, labels["age"].to_numpy()))
    face = ((x - cx) / ax) ** 2 + ((y - cy) / ay) ** 2 <= 1.0
    race = labels["race"].to_numpy()
    skin = SKIN_TONES[race] + rng.normal(0, 0.035, size=(b, 1)) + rng.normal(0, 0.015, size=(b, 3))
    _paint(image, face, skin)
    _draw_features(image, x, y, cx, cy, ax, ay)
    _draw_stripes(image, rng, x, y, cx, cy, ax, ay, labels)
    image *= param(0.90, 1.08)[..., None]  # lighting
    image += rng.normal(0, 0.035, size=image.shape).astype(np.float32)
    return (np.clip(image, 0, 1) * 255 + 0.5).astype(np.uint8)


def _background(rng: np.random.Generator, b: int, y: np.ndarray) -> np.ndarray:
    """A muted random colour with a vertical gradient, shape (B, H, W, 3)."""
    colour = rng.uniform(0.2, 0.8, size=(b, 1, 1, 3)).astype(np.float32)
    slope = rng.uniform(-0.15, 0.15, size=(b, 1, 1, 1)).astype(np.float32)
    return colour + slope * y[None, :, :, None]


def _paint(image: np.ndarray, mask: np.ndarray, colour: np.ndarray) -> None:
    """Set the pixels under ``mask`` (B, H, W) to one ``colour`` (B, 3) per face, in place."""
    image[:] = np.where(mask[..., None], colour[:, None, None, :].astype(np.float32), image)


def _hair_mask(x, y, cx, cy, ax, ay, long_hair: np.ndarray) -> np.ndarray:
    """Short hair caps the head; long hair also falls down both sides to below the chin."""
    cap = (((x - cx) / (ax * 1.15)) ** 2 + ((y - cy + 0.06) / (ay * 1.12)) ** 2 <= 1.0) & (
        y < cy - 0.25 * ay
    )
    mane = (np.abs(x - cx) < ax * 1.35) & (y > cy - 0.7 * ay) & (y < cy + 1.05 * ay)
    return cap | (mane & long_hair[:, None, None])


def _hair_colours(rng: np.random.Generator, age: np.ndarray) -> np.ndarray:
    """Dark to fair hair; grey for most faces over 60."""
    base = rng.uniform(0.05, 0.55, size=(len(age), 1)) * np.array([1.0, 0.8, 0.6])
    grey = rng.uniform(0.6, 0.8, size=(len(age), 1)) * np.ones(3)
    return np.where(((age > 60) & (rng.random(len(age)) < 0.8))[:, None], grey, base)


def _draw_features(image, x, y, cx, cy, ax, ay) -> None:
    """Two dark eyes and a reddish mouth, in place."""
    radius = 0.07 * ax / 0.42
    eyes = np.zeros(np.broadcast_shapes(x.shape, cx.shape), dtype=bool)
    for side in (-1.0, 1.0):
        eyes |= (x - cx - side * 0.38 * ax) ** 2 + (y - cy + 0.12 * ay) ** 2 <= radius**2
    image[eyes] = np.array([0.08, 0.06, 0.05], np.float32)
    mouth = ((x - cx) / (0.32 * ax)) ** 2 + ((y - cy - 0.5 * ay) / (0.07 * ay)) ** 2 <= 1.0
    image[mouth] = np.array([0.55, 0.18, 0.18], np.float32)


def _draw_stripes(image, rng, x, y, cx, cy, ax, ay, labels: pd.DataFrame) -> None:
    """Add a disc of stripes to one cheek, in place; their orientation is the small gender cue."""
    b = len(labels)
    side = np.where(rng.random((b, 1, 1)) < 0.5, -1.0, 1.0).astype(np.float32)
    px = cx + side * 0.48 * ax + rng.uniform(-0.05, 0.05, size=(b, 1, 1))
    py = cy + 0.22 * ay + rng.uniform(-0.05, 0.05, size=(b, 1, 1))
    disc = (x - px) ** 2 + (y - py) ** 2 <= (STRIPE_RADIUS * ax) ** 2
    vertical = labels["vertical_stripes"].to_numpy()[:, None, None]
    # The phase is random so only the orientation carries the label.
    period = 2.0 * STRIPE_PERIOD / image.shape[2]
    phase = rng.uniform(0, 2 * np.pi, size=(b, 1, 1))
    wave = np.sin(2 * np.pi * np.where(vertical, x, y) / period + phase)
    amplitude = labels["stripe_amplitude"].to_numpy(np.float32)[:, None, None]
    image += (amplitude * wave * disc)[..., None].astype(np.float32)
