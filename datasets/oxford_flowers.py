"""OxfordFlowers (Flowers102): ``oxford_flowers/jpg/image_<00001>.jpg`` and
``split_zhou_OxfordFlowers.json``.

Without the split file, it is generated from ``imagelabels.mat`` (``labels``: the 1-based class
of image i+1) and ``cat_to_name.json`` (``{"1": "pink primrose", ...}``): per class, in order of
first appearance, the images are shuffled and split 50/20/30 into train/val/test.
"""

from __future__ import annotations

import os.path as osp
from collections import defaultdict

from engine.data import Datum
from engine.registry import DATASET_REGISTRY
from engine.utils import read_json

from .common import CoOpDataset, Download, Layout

LAYOUT = Layout(
    name="OxfordFlowers",
    folder="oxford_flowers",
    required=("jpg/",),
    split_file="split_zhou_OxfordFlowers.json",
    generated_from=("imagelabels.mat", "cat_to_name.json"),
    num_classes=102,
    how=(
        "Download 102flowers.tgz and imagelabels.mat from the VGG Flowers-102 page "
        "(robots.ox.ac.uk/~vgg/data/flowers/102/) into DATASET.ROOT/oxford_flowers/ and unpack "
        "the archive there (it creates jpg/). Add CoOp's cat_to_name.json (class names) and "
        "split_zhou_OxfordFlowers.json to oxford_flowers/ (without the split file a first run "
        "generates one from imagelabels.mat and cat_to_name.json and saves it)."
    ),
    downloads=(
        Download(
            "https://www.robots.ox.ac.uk/~vgg/data/flowers/102/102flowers.tgz",
            "102flowers.tgz",
            extract=True,
            provides="jpg/",
        ),
        Download(
            "https://www.robots.ox.ac.uk/~vgg/data/flowers/102/imagelabels.mat", "imagelabels.mat"
        ),
        Download("gdrive:1AkcxCXeK_RCGCEC_GvmWxjcjaNhu-at0", "cat_to_name.json"),
        Download("gdrive:1Pp0sRXzZFZq15zVOzKjKBu4A9i01nozT", "split_zhou_OxfordFlowers.json"),
    ),
)


@DATASET_REGISTRY.register()
class OxfordFlowers(CoOpDataset):
    layout = LAYOUT
    image_subdir = "jpg"

    def generate_split(self, rng):
        from scipy.io import loadmat  # scipy only for this dataset (0.6 s of every start-up)

        labels = loadmat(osp.join(self.dataset_dir, "imagelabels.mat"))["labels"][0]
        lab2cname = read_json(osp.join(self.dataset_dir, "cat_to_name.json"))
        tracker = defaultdict(list)  # 1-based label -> image paths, first-appearance order
        for i, label in enumerate(labels):
            tracker[int(label)].append(osp.join(self.image_dir, f"image_{i + 1:05d}.jpg"))

        train, val, test = [], [], []
        for label, impaths in tracker.items():
            if str(label) not in lab2cname:
                raise ValueError(f"cat_to_name.json has no name for class {label}")
            rng.shuffle(impaths)
            n_train = round(len(impaths) * 0.5)
            n_val = round(len(impaths) * 0.2)
            if not (n_train > 0 and n_val > 0 and len(impaths) - n_train - n_val > 0):
                raise ValueError(f"Class {label} has {len(impaths)} images: too few to split")

            def collate(paths, y=label - 1, c=lab2cname[str(label)]):
                return [Datum(impath=p, label=y, classname=c) for p in paths]

            train += collate(impaths[:n_train])
            val += collate(impaths[n_train : n_train + n_val])
            test += collate(impaths[n_train + n_val :])
        return train, val, test
