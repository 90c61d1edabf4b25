"""Face images for Lightning: the Dataset, its transforms, and :class:`FaceDataModule`.

The frames come from :mod:`fairprune.data.faces.readers`; this module leaves out the images
that do not decode (:mod:`fairprune.data.faces.images`), loads the rest as
``(image, target, group)`` and serves the three splits and a group-stratified importance subset,
in an order that a resumed run repeats. Every file left out is counted by reason
(:meth:`FaceDataModule.report_fields`: ``report.json``'s ``data.skipped``).

Example (the synthetic set is generated on first use)::

    dm = FaceDataModule("synthetic", target="gender", sensitive="race", synthetic_size=400)
    dm.class_names, dm.group_names      # (['Male', 'Female'], ['White', 'Black', 'Asian', 'Indian'])
    dm.prepare_data(); dm.setup("fit")
    images, targets, groups = next(iter(dm.train_dataloader()))
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset
from torchvision.transforms import v2

from fairprune.data.faces.images import drop_unreadable, load_rgb
from fairprune.data.faces.readers import SPLITS, check_root, read_faces, task_info
from fairprune.data.shards import eval_sampler
from fairprune.data.synthetic import MARKER, VERSION, generate_synthetic_utkface
from fairprune.errors import UserError
from fairprune.hub import cache_dir

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# --------------------------------------------------------------------------------------------
# Dataset and transforms.


def face_transform(image_size: int, augment: bool = False) -> v2.Compose:
    """Resize and centre-crop to a square, scale to float in [0, 1], normalise (ImageNet).

    Resizing the shorter side and cropping keeps CelebA's 178x218 faces undistorted; square
    images (UTKFace, FairFace, synthetic) are simply resized.
    """
    steps = [v2.ToImage(), v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)]
    if augment:
        steps.append(v2.RandomHorizontalFlip())
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    return v2.Compose(steps)


class FaceDataset(Dataset):
    """Images of a frame as ``(image, target, group)``; target and group are int64 tensors.

    Item ``i`` is always row ``i``: an image that fails to load raises a :class:`UserError`
    naming the file, never a stand-in from another row (which would carry another group's
    label). :class:`FaceDataModule` decodes every image when it builds the splits and leaves out
    those that fail, so this happens only to a file damaged during the run.
    """

    def __init__(self, frame: pd.DataFrame, transform=None):
        self.paths = frame["path"].astype(str).tolist()
        self.targets = torch.tensor(frame["target"].to_numpy(np.int64))
        self.groups = torch.tensor(frame["group"].to_numpy(np.int64))
        self.transform = transform or v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        path = self.paths[index]
        try:
            rgb = load_rgb(path)
        except Exception as err:  # noqa: BLE001 - whatever the cause, the file is unusable now
            raise UserError(
                f"cannot load image '{path}' ({type(err).__name__}: {' '.join(str(err).split())}); the splits "
                f"left out every image that did not decode when they were built, so this file changed during "
                f"the run: restore it, or start the run again to leave it out (and count it in data.skipped)"
            ) from None
        return self.transform(rgb), self.targets[index], self.groups[index]


def stratified_subset(groups: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Sorted indices of a seeded ``fraction`` of each group (at least one per non-empty group)."""
    rng = np.random.default_rng(seed)
    picks = []
    for value in np.unique(groups):
        members = np.flatnonzero(groups == value)
        take = max(1, int(round(fraction * len(members))))
        picks.append(rng.permutation(members)[:take])
    return np.sort(np.concatenate(picks)) if picks else np.zeros(0, dtype=np.int64)


# --------------------------------------------------------------------------------------------
# The DataModule.


class FaceDataModule(L.LightningDataModule):
    """UTKFace, FairFace, CelebA or the bundled synthetic set, with targets and groups.

    ``class_names``, ``group_names``, ``num_classes`` and ``num_groups`` are known right after
    ``__init__`` (from the label vocabularies), so a model can be built before any data is
    read. With ``sensitive=None`` every row has group -1 and ``group_names == ["unknown"]``.
    ``max_samples`` caps each split (a seeded sample), for quick runs.
    """

    def __init__(
        self,
        dataset: str = "synthetic",
        root: str | None = None,
        target: str = "gender",
        sensitive: str | None = "race",
        image_size: int = 64,
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
        include_others: bool = False,
        augment: bool = False,
        max_samples: int | None = None,
        synthetic_size: int = 4000,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.class_names, self.group_names = task_info(dataset, target, sensitive, include_others)
        _check_positive(image_size=image_size, batch_size=batch_size, synthetic_size=synthetic_size,
                        max_samples=max_samples)
        if num_workers < 0:
            raise UserError(f"--data.num_workers must be 0 or more, got {num_workers}")
        if dataset == "synthetic":
            if root is not None and Path(root).exists() and not Path(root).is_dir():
                raise UserError(f"--data.root '{root}' is a file, not a folder; pass a folder for the synthetic faces "
                                "(made when missing) or leave --data.root out to use the project cache")
            self.root = Path(root) if root is not None else cache_dir() / f"synthetic_utkface_v{VERSION}_{synthetic_size}_{seed}"
        else:
            self.root = check_root(dataset, root)  # fail before training, not at setup()
        self.num_classes = len(self.class_names)
        self.num_groups = len(self.group_names)
        self.train_frame = self.val_frame = self.test_frame = None
        self.skipped: dict[str, int] | None = None  # files left out by reason, known after setup()

    def prepare_data(self) -> None:
        """Generate the synthetic set into ``root`` unless it is complete already."""
        if self.hparams.dataset == "synthetic":
            generate_synthetic_utkface(self.root, n=self.hparams.synthetic_size, seed=self.hparams.seed)

    def setup(self, stage: str | None = None) -> None:
        """Read the frame once, leave out (and count) the images that do not decode, and build
        the three datasets."""
        if self.train_frame is not None:
            return
        hp = self.hparams
        if hp.dataset == "synthetic" and not (self.root / MARKER).exists():
            self.prepare_data()  # setup() called without prepare_data(), e.g. from a script
        frame = read_faces(hp.dataset, self.root, hp.target, hp.sensitive, hp.include_others, hp.seed)
        skipped = dict(frame.attrs.get("skipped", {}))  # what the reader left out (UTKFace names, Others)
        frames = {split: self._cap(frame[frame["split"] == split]) for split in SPLITS}
        frame = drop_unreadable(pd.concat(frames.values(), ignore_index=True))
        self.skipped = {**skipped, **frame.attrs["skipped"]}
        frames = {split: frame[frame["split"] == split].reset_index(drop=True) for split in SPLITS}
        self._warn_absent_groups(frames)
        self.train_frame, self.val_frame, self.test_frame = (frames[s] for s in SPLITS)
        train_tf = face_transform(hp.image_size, augment=hp.augment)
        eval_tf = face_transform(hp.image_size)
        self.train_set = FaceDataset(self.train_frame, train_tf)
        self.val_set = FaceDataset(self.val_frame, eval_tf)
        self.test_set = FaceDataset(self.test_frame, eval_tf)
        # Importance scores want the training images without random augmentation.
        self.importance_set = FaceDataset(self.train_frame, eval_tf)

    def report_fields(self) -> dict[str, Any]:
        """``{"data": {"skipped": {reason: count}, "samples": {split: count}}}`` for report.json
        (:class:`~fairprune.callbacks.report.ReportWriter` merges it); empty before ``setup``."""
        if self.skipped is None:
            return {}
        samples = {split: len(f) for split, f in zip(SPLITS, (self.train_frame, self.val_frame, self.test_frame))}
        return {"data": {"skipped": dict(self.skipped), "samples": samples}}

    def _cap(self, frame: pd.DataFrame) -> pd.DataFrame:
        """At most ``max_samples`` rows of one split, a seeded sample kept in frame order."""
        cap = self.hparams.max_samples
        if cap is None or len(frame) <= cap:
            return frame
        return frame.sample(n=cap, random_state=self.hparams.seed).sort_index()

    def _warn_absent_groups(self, frames: dict[str, pd.DataFrame]) -> None:
        """Warn once, naming every (group, split) pair without samples."""
        if self.hparams.sensitive is None:
            return
        absent = [
            f"{name} in {split}"
            for split, frame in frames.items()
            for code, name in enumerate(self.group_names)
            if not (frame["group"] == code).any()
        ]
        if absent:
            warnings.warn(f"no samples of group {', '.join(absent)}; metrics of those groups "
                          f"will be missing for that split", stacklevel=3)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, sampler=EpochShuffle(len(self.train_set), self.hparams.seed))

    def val_dataloader(self) -> DataLoader:
        # Under DDP: this process's unpadded shard, so per-group counts sum to the split's size.
        return self._loader(self.val_set, sampler=eval_sampler(len(self.val_set)))

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, sampler=eval_sampler(len(self.test_set)))

    def importance_dataloader(self, fraction: float = 0.2, seed: int = 0) -> DataLoader:
        """A loader over a seeded, group-stratified ``fraction`` of the training set, in order."""
        if not 0 < fraction <= 1:
            raise UserError(f"importance data fraction must be in (0, 1], got {fraction}; "
                            f"pass a fraction such as 0.2")
        if self.train_frame is None:
            self.setup("fit")
        indices = stratified_subset(self.importance_set.groups.numpy(), fraction, seed)
        return self._loader(Subset(self.importance_set, indices.tolist()))

    def _loader(self, dataset: Dataset, sampler: Sampler | None = None) -> DataLoader:
        workers = self.hparams.num_workers
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            sampler=sampler,
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=torch.cuda.is_available(),
        )


class EpochShuffle(Sampler[int]):
    """A shuffled order that depends only on ``(seed, epoch)``.

    Lightning calls ``set_epoch`` before every training epoch, so a run resumed from a checkpoint
    sees the same order in each epoch as an uninterrupted run (a plain shuffling sampler would
    draw from the global random state, which a resume does not restore).
    """

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        yield from torch.randperm(self.size, generator=generator).tolist()


def _check_positive(**values: int | None) -> None:
    """Raise a UserError for the first value that is given but not a positive integer."""
    for name, value in values.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise UserError(f"--data.{name} must be a positive integer, got {value}")
