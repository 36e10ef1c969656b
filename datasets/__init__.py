"""Dataset readers in the CoOp folder layouts, registered under the CoOp names.

Each reader module declares its dataset's expected layout (``LAYOUT``, see
:class:`datasets.common.Layout`), used by the reader at start-up, by ``tools/check_data.py`` and
by ``tools/download_data.py``.
"""

from . import (  # noqa: F401  (registers the readers)
    caltech101,
    dtd,
    eurosat,
    fgvc_aircraft,
    folder,
    food101,
    imagenet,
    imagenet_a,
    imagenet_r,
    imagenet_sketch,
    imagenetv2,
    oxford_flowers,
    oxford_pets,
    small_world,
    stanford_cars,
    sun397,
    ucf101,
)

# The paper's datasets in the order of its tables (the order tools/check_data.py reports).
PAPER_DATASETS = (
    "ImageNet",
    "Caltech101",
    "OxfordPets",
    "StanfordCars",
    "OxfordFlowers",
    "Food101",
    "FGVCAircraft",
    "SUN397",
    "DescribableTextures",
    "EuroSAT",
    "UCF101",
    "ImageNetV2",
    "ImageNetSketch",
    "ImageNetA",
    "ImageNetR",
)
