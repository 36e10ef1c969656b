"""Caltech101: ``caltech-101/101_ObjectCategories/<class>/*.jpg`` and
``split_zhou_Caltech101.json`` (generated 50/20/30 per class when absent).

100 classes: the sorted folders minus BACKGROUND_Google and Faces_easy, with four renamed
(airplanes -> airplane, Faces -> face, Leopards -> leopard, Motorbikes -> motorbike), as CoOp.
"""

from __future__ import annotations

from engine.data import read_and_split_data
from engine.registry import DATASET_REGISTRY

from .common import CoOpDataset, Download, Layout

IGNORED = ("BACKGROUND_Google", "Faces_easy")
NEW_CNAMES = {
    "airplanes": "airplane",
    "Faces": "face",
    "Leopards": "leopard",
    "Motorbikes": "motorbike",
}

LAYOUT = Layout(
    name="Caltech101",
    folder="caltech-101",
    required=("101_ObjectCategories/",),
    split_file="split_zhou_Caltech101.json",
    class_dirs=("101_ObjectCategories",),
    ignored=IGNORED,
    num_classes=100,
    how=(
        "Caltech 101 is published on the Caltech data repository (data.caltech.edu, "
        "caltech-101.zip, which holds 101_ObjectCategories.tar.gz). Unpack "
        "101_ObjectCategories.tar.gz inside DATASET.ROOT/caltech-101/ so that "
        "caltech-101/101_ObjectCategories/<class>/*.jpg exists (102 folders; BACKGROUND_Google "
        "and Faces_easy are skipped). Put CoOp's split_zhou_Caltech101.json in caltech-101/ to "
        "use the paper's split (without it a first run generates and saves one)."
    ),
    downloads=(
        Download(
            "https://data.caltech.edu/records/mzrjq-6wc02/files/caltech-101.zip",
            "caltech-101.zip",
            extract=True,
            strip="caltech-101/",
            inner="101_ObjectCategories.tar.gz",
            provides="101_ObjectCategories/",
        ),
        Download("gdrive:1hyarUivQE36mY6jSomru6Fjd-JzwcCzN", "split_zhou_Caltech101.json"),
    ),
)


@DATASET_REGISTRY.register()
class Caltech101(CoOpDataset):
    layout = LAYOUT
    image_subdir = "101_ObjectCategories"

    def generate_split(self, rng):
        return read_and_split_data(self.image_dir, ignored=IGNORED, new_cnames=NEW_CNAMES, rng=rng)
