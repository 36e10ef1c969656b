"""ImageNet-R, evaluation only: ``imagenet-rendition/imagenet-r/<wnid>/*``; its 200 classes get
labels 0..199 in sorted wnid order and names from CoOp's ImageNet ``classnames.txt``."""

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
    name="ImageNetR",
    folder="imagenet-rendition",
    required=("imagenet-r/", IMAGENET_CLASSNAMES),
    class_dirs=("imagenet-r",),
    num_classes=200,
    how=(
        "Download imagenet-r.tar (linked from github.com/hendrycks/imagenet-r) and unpack it "
        "in DATASET.ROOT/imagenet-rendition/ so that imagenet-rendition/imagenet-r/<wnid>/*.jpg "
        "exists (200 folders). classnames.txt is read from imagenet-rendition/ or else from "
        "imagenet/. " + CLASSNAMES_HOW
    ),
    downloads=(
        Download(
            "https://people.eecs.berkeley.edu/~hendrycks/imagenet-r.tar",
            "imagenet-r.tar",
            extract=True,
            provides="imagenet-r/",
        ),
        CLASSNAMES_DOWNLOAD,
    ),
)


@DATASET_REGISTRY.register()
class ImageNetR(EvalOnlyDataset):
    layout = LAYOUT
    image_subdir = "imagenet-r"
