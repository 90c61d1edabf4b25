"""Face-attribute data: UTKFace, FairFace and CelebA readers, one Dataset, one DataModule.

- :mod:`~fairprune.data.faces.readers`: the label vocabularies (:func:`task_info`), one reader
  per real file layout, the seeded split and the dataset-root checks.
- :mod:`~fairprune.data.faces.images`: which images decode (checked once per file, cached), and
  leaving out those that do not, counted by reason.
- :mod:`~fairprune.data.faces.datamodule`: :class:`FaceDataset`, its transforms and
  :class:`FaceDataModule` (configs name it ``fairprune.data.faces.FaceDataModule``).

Every public name of these is importable from here.
"""

from fairprune.data.faces.datamodule import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    EpochShuffle,
    FaceDataModule,
    FaceDataset,
    face_transform,
    stratified_subset,
)
from fairprune.data.faces.images import IMAGE_PROBLEMS, check_images, drop_unreadable, load_rgb
from fairprune.data.faces.readers import (
    AGE_BINS,
    AGE_EDGES,
    CELEBA_ALIASES,
    CELEBA_ATTRIBUTES,
    DATASETS,
    FAIRFACE_RACES,
    GENDERS,
    LABEL_FILES,
    ROOT_CONTENTS,
    SPLITS,
    UNKNOWN_GROUP,
    UTKFACE_NAME,
    UTKFACE_RACES,
    age_bin,
    celeba_attribute,
    celeba_base,
    check_dataset,
    check_root,
    label_names,
    read_celeba,
    read_faces,
    read_fairface,
    read_utkface,
    seeded_split,
    task_info,
)

__all__ = [
    "AGE_BINS", "AGE_EDGES", "CELEBA_ALIASES", "CELEBA_ATTRIBUTES", "DATASETS", "FAIRFACE_RACES",
    "GENDERS", "IMAGE_PROBLEMS", "IMAGENET_MEAN", "IMAGENET_STD", "LABEL_FILES", "ROOT_CONTENTS", "SPLITS",
    "UNKNOWN_GROUP", "UTKFACE_NAME", "UTKFACE_RACES",
    "EpochShuffle", "FaceDataModule", "FaceDataset",
    "age_bin", "celeba_attribute", "celeba_base", "check_dataset", "check_images", "check_root",
    "drop_unreadable", "face_transform", "label_names", "load_rgb", "read_celeba", "read_faces", "read_fairface", "read_utkface",
    "seeded_split", "stratified_subset", "task_info",
]
