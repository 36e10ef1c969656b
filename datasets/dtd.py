"""DescribableTextures (DTD): ``dtd/images/<class>/*.jpg``, 47 classes named by their folders;
``split_zhou_DescribableTextures.json`` (generated 50/20/30 per class when absent)."""

from __future__ import annotations

from engine.data import read_and_split_data
from engine.registry import DATASET_REGISTRY

from .common import CoOpDataset, Download, Layout

LAYOUT = Layout(
    name="DescribableTextures",
    folder="dtd",
    required=("images/",),
    split_file="split_zhou_DescribableTextures.json",
    class_dirs=("images",),
    num_classes=47,
    how=(
        "Download DTD (dtd-r1.0.1.tar.gz from the VGG page, robots.ox.ac.uk/~vgg/data/dtd/) and "
        "unpack it in DATASET.ROOT: it creates dtd/images/<texture>/*.jpg. Put CoOp's "
        "split_zhou_DescribableTextures.json in dtd/ to use the paper's split (without it a "
        "first run generates and saves one)."
    ),
    downloads=(
        Download(
            "https://www.robots.ox.ac.uk/~vgg/data/dtd/download/dtd-r1.0.1.tar.gz",
            "dtd-r1.0.1.tar.gz",
            extract=True,
            strip="dtd/",
            provides="images/",
        ),
        Download("gdrive:1u3_QfB467jqHgNXC00UIzbLZRQCg2S7x", "split_zhou_DescribableTextures.json"),
    ),
)


@DATASET_REGISTRY.register()
class DescribableTextures(CoOpDataset):
    layout = LAYOUT
    image_subdir = "images"

    def generate_split(self, rng):
        return read_and_split_data(self.image_dir, rng=rng)
