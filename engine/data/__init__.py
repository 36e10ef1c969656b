"""Data model and pipeline: Datum, DatasetBase, split helpers, transforms, DataManager."""

from .base import (
    DatasetBase,
    DatasetNotFoundError,
    Datum,
    SplitError,
    SplitFileError,
    read_and_split_data,
    read_split,
    require_dir,
    require_file,
    save_split,
    split_per_class,
    split_trainval,
    subsample_classes,
)
from .fewshot import fewshot_and_subsample, load_or_create_fewshot
from .image_check import ImageReadError, UnreadableImagesError
from .manager import DataManager, DatasetWrapper, build_data_loader, build_dataset, read_image
from .transforms import build_transform
from .validate import validate_data_cfg

__all__ = [
    "DataManager",
    "DatasetBase",
    "DatasetNotFoundError",
    "DatasetWrapper",
    "Datum",
    "ImageReadError",
    "SplitError",
    "SplitFileError",
    "UnreadableImagesError",
    "build_data_loader",
    "build_dataset",
    "build_transform",
    "fewshot_and_subsample",
    "load_or_create_fewshot",
    "read_and_split_data",
    "read_image",
    "read_split",
    "require_dir",
    "require_file",
    "save_split",
    "split_per_class",
    "split_trainval",
    "subsample_classes",
    "validate_data_cfg",
]
