"""ImageNet-Sketch, evaluation only: ``imagenet-sketch/images/<wnid>/*``; label = index of the
sorted wnid folders (1,000), names from CoOp's ImageNet ``classnames.txt``."""

from __future__ import annotations

from engine.registry import DATASET_REGISTRY

from .common import (
    CLASSNAMES_DOWNLOAD,
    CLASSNAMES_HOW,
    IMAGENET_CLASSNAMES,
    Download,
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
    downloads=(
        Download(  # the authors' Google Drive file (ImageNet-Sketch.zip, members sketch/<wnid>/)
            "gdrive:1Mj0i5HBthqH1p_yeXzsg22gZduvgoNeA",
            "ImageNet-Sketch.zip",
            extract=True,
            extract_to="images",
            strip="sketch/",
            provides="images/",
        ),
        CLASSNAMES_DOWNLOAD,
    ),
)


@DATASET_REGISTRY.register()
class ImageNetSketch(EvalOnlyDataset):
    layout = LAYOUT
    image_subdir = "images"
