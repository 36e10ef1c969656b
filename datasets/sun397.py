"""SUN397: ``sun397/SUN397/<letter>/<category>[/<sub>]/*.jpg`` and ``split_zhou_SUN397.json``.

Without the split file, it is generated from ``ClassName.txt`` (``/a/abbey`` lines; label = line
index), ``Training_01.txt`` and ``Testing_01.txt`` (partition 1): the training list is split
80/20 per class into train/val. Class names drop the letter and put the last part first
(``/a/apartment_building/outdoor`` -> "outdoor apartment_building"), as CoOp.
"""

from __future__ import annotations

import os.path as osp

from engine.data import Datum, split_trainval
from engine.registry import DATASET_REGISTRY

from .common import CoOpDataset, Download, Layout

LAYOUT = Layout(
    name="SUN397",
    folder="sun397",
    required=("SUN397/",),
    split_file="split_zhou_SUN397.json",
    generated_from=("ClassName.txt", "Training_01.txt", "Testing_01.txt"),
    num_classes=397,
    how=(
        "Download SUN397.tar.gz and Partitions.zip from the SUN database page "
        "(vision.princeton.edu/projects/2010/SUN/) and unpack both in DATASET.ROOT/sun397/ so "
        "that sun397/SUN397/a/abbey/*.jpg and sun397/ClassName.txt, Training_01.txt, "
        "Testing_01.txt exist. Put CoOp's split_zhou_SUN397.json in sun397/ to use the paper's "
        "split (without it a first run generates one from partition 1 and saves it)."
    ),
    downloads=(
        Download(
            "http://vision.princeton.edu/projects/2010/SUN/SUN397.tar.gz",
            "SUN397.tar.gz",
            extract=True,
            provides="SUN397/",
        ),
        Download(
            "https://vision.princeton.edu/projects/2010/SUN/download/Partitions.zip",
            "Partitions.zip",
            extract=True,
            strip="Partitions/",
            provides="ClassName.txt",
        ),
        Download("gdrive:1y2RD81BYuiyvebdN-JymPfyWYcd8_MUq", "split_zhou_SUN397.json"),
    ),
)


def readable_name(category: str) -> str:
    """``a/apartment_building/outdoor`` -> ``outdoor apartment_building`` (CoOp's rule)."""
    return " ".join(category.split("/")[1:][::-1])


@DATASET_REGISTRY.register()
class SUN397(CoOpDataset):
    layout = LAYOUT
    image_subdir = "SUN397"

    def generate_split(self, rng):
        with open(osp.join(self.dataset_dir, "ClassName.txt")) as f:
            categories = [line.strip()[1:] for line in f if line.strip()]  # drop the leading /
        cname2lab = {c: i for i, c in enumerate(categories)}
        trainval = self.read_list("Training_01.txt", cname2lab)
        test = self.read_list("Testing_01.txt", cname2lab)
        train, val = split_trainval(trainval, p_val=0.2, rng=rng)
        return train, val, test

    def read_list(self, filename: str, cname2lab: dict[str, int]) -> list[Datum]:
        path = osp.join(self.dataset_dir, filename)
        items = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                imname = line.strip()[1:]  # drop the leading /
                if not imname:
                    continue
                category = osp.dirname(imname)
                if category not in cname2lab:
                    raise ValueError(f"{path}:{n}: {category!r} is not in ClassName.txt")
                items.append(
                    Datum(
                        impath=osp.join(self.image_dir, imname),
                        label=cname2lab[category],
                        classname=readable_name(category),
                    )
                )
        return items
