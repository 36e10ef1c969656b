"""StanfordCars: ``stanford_cars/cars_train/``, ``cars_test/`` and ``split_zhou_StanfordCars.json``
(image paths relative to the dataset folder).

Without the split file, it is generated from the devkit: ``devkit/cars_meta.mat``
(``class_names``), ``devkit/cars_train_annos.mat`` and ``cars_test_annos_withlabels.mat``
(``annotations`` with ``fname`` and 1-based ``class``). Class names put the model year first
("AM General Hummer SUV 2000" -> "2000 AM General Hummer SUV"); the training annotations are
split 80/20 per class into train/val.
"""

from __future__ import annotations

import os.path as osp

from scipy.io import loadmat

from engine.data import Datum, split_trainval
from engine.registry import DATASET_REGISTRY

from .common import CoOpDataset, Download, Layout

CARS_BY_HAND = (
    "the original Stanford host no longer serves Stanford Cars (HTTP 404 since 2023; torchvision "
    "dropped its download for that reason) and no public copy of the original archives with a "
    "published checksum is known: take the file from a copy of the original release (e.g. the "
    "Kaggle copies, which need an account; car_devkit.tgz and cars_test_annos_withlabels.mat "
    "are also attached to comments of torchvision's GitHub issue #7545)"
)

LAYOUT = Layout(
    name="StanfordCars",
    folder="stanford_cars",
    required=("cars_train/", "cars_test/"),
    split_file="split_zhou_StanfordCars.json",
    generated_from=(
        "devkit/cars_meta.mat",
        "devkit/cars_train_annos.mat",
        "cars_test_annos_withlabels.mat",
    ),
    num_classes=196,
    how=(
        "Stanford Cars (196 classes) is no longer served from its Stanford page; get a copy of "
        "cars_train.tgz, cars_test.tgz, car_devkit.tgz and cars_test_annos_withlabels.mat (e.g. "
        "from a mirror of the original release) and unpack them in DATASET.ROOT/stanford_cars/ "
        "so that stanford_cars/cars_train/*.jpg, cars_test/*.jpg, devkit/cars_meta.mat and "
        "cars_test_annos_withlabels.mat exist. Put CoOp's split_zhou_StanfordCars.json in "
        "stanford_cars/ to use the paper's split (without it a first run generates one from "
        "the devkit and saves it)."
    ),
    downloads=(
        *(
            Download(
                f"https://ai.stanford.edu/~jkrause/car196/{name}",
                name,
                extract=name.endswith(".tgz"),
                provides=provides,
                by_hand=CARS_BY_HAND,
            )
            for name, provides in (
                ("cars_train.tgz", "cars_train/"),
                ("cars_test.tgz", "cars_test/"),
                ("car_devkit.tgz", "devkit/"),
                ("cars_test_annos_withlabels.mat", ""),
            )
        ),
        Download("gdrive:1ObCFbaAgVu0I-k_Au-gIUcefirdAuizT", "split_zhou_StanfordCars.json"),
    ),
    manual="the images and devkit (the original Stanford links are gone)",
)


def year_first(classname: str) -> str:
    """CoOp's class name: the trailing model year moved to the front."""
    words = classname.split(" ")
    return " ".join([words[-1], *words[:-1]])


@DATASET_REGISTRY.register()
class StanfordCars(CoOpDataset):
    layout = LAYOUT

    def generate_split(self, rng):
        meta = osp.join(self.dataset_dir, "devkit", "cars_meta.mat")
        names = [year_first(str(c[0])) for c in loadmat(meta)["class_names"][0]]
        trainval = self.read_annotations(
            "cars_train", osp.join(self.dataset_dir, "devkit", "cars_train_annos.mat"), names
        )
        test = self.read_annotations(
            "cars_test", osp.join(self.dataset_dir, "cars_test_annos_withlabels.mat"), names
        )
        train, val = split_trainval(trainval, p_val=0.2, rng=rng)
        return train, val, test

    def read_annotations(self, image_dir: str, anno_file: str, names: list[str]) -> list[Datum]:
        items = []
        for anno in loadmat(anno_file)["annotations"][0]:
            label = int(anno["class"][0, 0]) - 1
            if not 0 <= label < len(names):
                raise ValueError(f"{anno_file}: class {label + 1} is not in cars_meta.mat")
            impath = osp.join(self.dataset_dir, image_dir, str(anno["fname"][0]))
            items.append(Datum(impath=impath, label=label, classname=names[label]))
        return items
