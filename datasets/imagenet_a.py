"""ImageNet-A, evaluation only: ``imagenet-adversarial/imagenet-a/<wnid>/*``; its 200 classes get
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
    name="ImageNetA",
    folder="imagenet-adversarial",
    required=("imagenet-a/", IMAGENET_CLASSNAMES),
    class_dirs=("imagenet-a",),
    num_classes=200,
    how=(
        "Download imagenet-a.tar (linked from github.com/hendrycks/natural-adv-examples) and "
        "unpack it in DATASET.ROOT/imagenet-adversarial/ so that "
        "imagenet-adversarial/imagenet-a/<wnid>/*.jpg exists (200 folders). classnames.txt is "
        "read from imagenet-adversarial/ or else from imagenet/. " + CLASSNAMES_HOW
    ),
    downloads=(
        Download(
            "https://people.eecs.berkeley.edu/~hendrycks/imagenet-a.tar",
            "imagenet-a.tar",
            extract=True,
            provides="imagenet-a/",
        ),
        CLASSNAMES_DOWNLOAD,
    ),
)


@DATASET_REGISTRY.register()
class ImageNetA(EvalOnlyDataset):
    layout = LAYOUT
    image_subdir = "imagenet-a"
