"""Food101: ``food-101/images/<class>/*.jpg``, 101 classes named by their folders;
``split_zhou_Food101.json`` (generated 50/20/30 per class when absent)."""

from __future__ import annotations

from engine.data import read_and_split_data
from engine.registry import DATASET_REGISTRY

from .common import CoOpDataset, Download, Layout

LAYOUT = Layout(
    name="Food101",
    folder="food-101",
    required=("images/",),
    split_file="split_zhou_Food101.json",
    class_dirs=("images",),
    num_classes=101,
    how=(
        "Download food-101.tar.gz from the ETH Zurich Food-101 page "
        "(data.vision.ee.ethz.ch/cvl/datasets_extra/food-101/) and unpack it in DATASET.ROOT: "
        "it creates food-101/images/<dish>/*.jpg. Put CoOp's split_zhou_Food101.json in "
        "food-101/ to use the paper's split (without it a first run generates and saves one)."
    ),
    downloads=(
        Download(
            "http://data.vision.ee.ethz.ch/cvl/food-101.tar.gz",
            "food-101.tar.gz",
            extract=True,
            strip="food-101/",
            provides="images/",
        ),
        Download("gdrive:1QK0tGi096I0Ba6kggatX1ee6dJFIcEJl", "split_zhou_Food101.json"),
    ),
)


@DATASET_REGISTRY.register()
class Food101(CoOpDataset):
    layout = LAYOUT
    image_subdir = "images"

    def generate_split(self, rng):
        return read_and_split_data(self.image_dir, rng=rng)
