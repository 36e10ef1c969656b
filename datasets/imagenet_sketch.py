"""ImageNet-Sketch, evaluation only: ``imagenet-sketch/images/<wnid>/*``; label = index of the
sorted wnid folders (1,000), names from CoOp's ImageNet ``classnames.txt``."""

from __future__ import annotations

from engine.registry import DATASET_REGISTRY

from .common import (
    CLASSNAMES_DOWNLOAD,
    CLASSNAMES_HOW,
    IMAGENET_CLASSNAMES,
    EvalOnlyDataset,
    Layout,
)

LAYOUT = Layout(
    name="ImageNetSketch",
    folder="imagenet-sketch",
    required=("images/", IMAGENET_CLASSNAMES),
    class_dirs=("images",),
    num_classes=1000,
    how=(
        "Get ImageNet-Sketch (ImageNet-Sketch.zip, linked from "
        "github.com/HaohanWang/ImageNet-Sketch; also mirrored on Kaggle and Hugging Face), "
        "unpack it in DATASET.ROOT/imagenet-sketch/ and rename the unpacked folder (sketch/) to "
        "images/ so that imagenet-sketch/images/<wnid>/*.JPEG exists. classnames.txt is read "
        "from imagenet-sketch/ or else from imagenet/. " + CLASSNAMES_HOW
    ),
    downloads=(CLASSNAMES_DOWNLOAD,),
    manual="the images (Google Drive / Kaggle / Hugging Face copies; rename sketch/ to images/)",
)


@DATASET_REGISTRY.register()
class ImageNetSketch(EvalOnlyDataset):
    layout = LAYOUT
    image_subdir = "images"
