"""FGVCAircraft: ``fgvc_aircraft/images/<id>.jpg`` with the dataset's own split lists
``images_variant_{train,val,test}.txt`` (lines ``<id> <variant>``); no split file.

100 classes: the variants in the order of ``variants.txt`` (label = line index), as CoOp.
"""

from __future__ import annotations

import os.path as osp

from engine.data import Datum
from engine.registry import DATASET_REGISTRY

from .common import CoOpDataset, Download, Layout

SPLIT_FILES = ("images_variant_train.txt", "images_variant_val.txt", "images_variant_test.txt")

LAYOUT = Layout(
    name="FGVCAircraft",
    folder="fgvc_aircraft",
    required=("images/", "variants.txt", *SPLIT_FILES),
    num_classes=100,
    how=(
        "Download fgvc-aircraft-2013b.tar.gz from the VGG FGVC-Aircraft page "
        "(robots.ox.ac.uk/~vgg/data/fgvc-aircraft/), unpack it, and move its data/ folder to "
        "DATASET.ROOT/fgvc_aircraft/ so that fgvc_aircraft/images/*.jpg, variants.txt and "
        "images_variant_{train,val,test}.txt exist (the splits are the dataset's own)."
    ),
    downloads=(
        Download(
            "https://www.robots.ox.ac.uk/~vgg/data/fgvc-aircraft/archives/fgvc-aircraft-2013b.tar.gz",
            "fgvc-aircraft-2013b.tar.gz",
            extract=True,
            strip="fgvc-aircraft-2013b/data/",
            provides="images/",
        ),
    ),
)


@DATASET_REGISTRY.register()
class FGVCAircraft(CoOpDataset):
    layout = LAYOUT
    image_subdir = "images"

    def read_splits(self, cfg):
        with open(osp.join(self.dataset_dir, "variants.txt")) as f:
            classnames = [line.strip() for line in f if line.strip()]
        cname2lab = {c: i for i, c in enumerate(classnames)}
        return tuple(self.read_list(name, cname2lab) for name in SPLIT_FILES)

    def read_list(self, filename: str, cname2lab: dict[str, int]) -> list[Datum]:
        path = osp.join(self.dataset_dir, filename)
        items = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                imname, _, classname = line.partition(" ")
                if classname not in cname2lab:
                    raise ValueError(f"{path}:{n}: variant {classname!r} is not in variants.txt")
                impath = osp.join(self.image_dir, imname + ".jpg")
                items.append(Datum(impath=impath, label=cname2lab[classname], classname=classname))
        return items
