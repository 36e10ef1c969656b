"""EuroSAT (RGB): ``eurosat/2750/<class>/*.jpg`` and ``split_zhou_EuroSAT.json`` (generated
50/20/30 per class when absent). The 10 folder names become CoOp's readable names."""

from __future__ import annotations

from engine.data import read_and_split_data
from engine.registry import DATASET_REGISTRY

from .common import CoOpDataset, Download, Layout

NEW_CNAMES = {
    "AnnualCrop": "Annual Crop Land",
    "Forest": "Forest",
    "HerbaceousVegetation": "Herbaceous Vegetation Land",
    "Highway": "Highway or Road",
    "Industrial": "Industrial Buildings",
    "Pasture": "Pasture Land",
    "PermanentCrop": "Permanent Crop Land",
    "Residential": "Residential Buildings",
    "River": "River",
    "SeaLake": "Sea or Lake",
}

LAYOUT = Layout(
    name="EuroSAT",
    folder="eurosat",
    required=("2750/",),
    split_file="split_zhou_EuroSAT.json",
    class_dirs=("2750",),
    num_classes=10,
    how=(
        "Download the RGB version of EuroSAT (EuroSAT.zip, 27,000 64x64 JPEGs; linked from "
        "github.com/phelber/eurosat) and unpack it in DATASET.ROOT/eurosat/ so that "
        "eurosat/2750/<class>/*.jpg exists (rename the unpacked image folder to 2750 if your "
        "copy calls it EuroSAT or EuroSAT_RGB). Put CoOp's split_zhou_EuroSAT.json in eurosat/ "
        "to use the paper's split (without it a first run generates and saves one)."
    ),
    downloads=(
        Download(
            "https://huggingface.co/datasets/torchgeo/eurosat/resolve/"
            "c877bcd43f099cd0196738f714544e355477f3fd/EuroSAT.zip",
            "EuroSAT.zip",
            extract=True,
            provides="2750/",
        ),
        Download("gdrive:1Ip7yaCWFi0eaOFUGga0lUdVi_DDQth1o", "split_zhou_EuroSAT.json"),
    ),
)


@DATASET_REGISTRY.register()
class EuroSAT(CoOpDataset):
    layout = LAYOUT
    image_subdir = "2750"

    def generate_split(self, rng):
        return read_and_split_data(self.image_dir, new_cnames=NEW_CNAMES, rng=rng)
