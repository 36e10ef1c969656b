"""OxfordPets: ``oxford_pets/images/*.jpg`` and ``split_zhou_OxfordPets.json``.

Without the split file, it is generated from ``annotations/trainval.txt`` and
``annotations/test.txt`` (lines ``<image> <class id> <species> <breed id>``): the class name is
the image name without its trailing ``_<n>``, lower-cased (``Abyssinian_12`` -> abyssinian);
labels are the 1-based class ids minus one; trainval is split 80/20 per class into train/val.
"""

from __future__ import annotations

import os.path as osp

from engine.data import Datum, split_trainval
from engine.registry import DATASET_REGISTRY

from .common import CoOpDataset, Download, Layout

LAYOUT = Layout(
    name="OxfordPets",
    folder="oxford_pets",
    required=("images/",),
    split_file="split_zhou_OxfordPets.json",
    generated_from=("annotations/trainval.txt", "annotations/test.txt"),
    num_classes=37,
    how=(
        "Download images.tar.gz and annotations.tar.gz of the Oxford-IIIT Pet dataset (VGG page, "
        "robots.ox.ac.uk/~vgg/data/pets/) and unpack both in DATASET.ROOT/oxford_pets/ so that "
        "oxford_pets/images/*.jpg and oxford_pets/annotations/trainval.txt exist. Put CoOp's "
        "split_zhou_OxfordPets.json in oxford_pets/ to use the paper's split (without it a first "
        "run generates one from the annotations and saves it)."
    ),
    downloads=(
        Download(
            "https://www.robots.ox.ac.uk/~vgg/data/pets/data/images.tar.gz",
            "images.tar.gz",
            extract=True,
            provides="images/",
        ),
        Download(
            "https://www.robots.ox.ac.uk/~vgg/data/pets/data/annotations.tar.gz",
            "annotations.tar.gz",
            extract=True,
            provides="annotations/",
        ),
        Download("gdrive:1501r8Ber4nNKvmlFVQZ8SeUHTcdTTEqs", "split_zhou_OxfordPets.json"),
    ),
)


@DATASET_REGISTRY.register()
class OxfordPets(CoOpDataset):
    layout = LAYOUT
    image_subdir = "images"

    def generate_split(self, rng):
        trainval = self.read_annotations("trainval.txt")
        test = self.read_annotations("test.txt")
        train, val = split_trainval(trainval, p_val=0.2, rng=rng)
        return train, val, test

    def read_annotations(self, filename: str) -> list[Datum]:
        path = osp.join(self.dataset_dir, "annotations", filename)
        items = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                fields = line.split()
                if len(fields) != 4 or not fields[1].isdigit():
                    raise ValueError(f"{path}:{n}: expected '<image> <class id> <species> <id>'")
                imname, label = fields[0], int(fields[1]) - 1
                breed = imname.rsplit("_", 1)[0].lower()
                impath = osp.join(self.image_dir, imname + ".jpg")
                items.append(Datum(impath=impath, label=label, classname=breed))
        return items
