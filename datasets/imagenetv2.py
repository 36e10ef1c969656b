"""ImageNetV2 (matched frequency), evaluation only:
``imagenetv2/imagenetv2-matched-frequency-format-val/<0..999>/*``; folder ``i`` is the i-th
class of CoOp's ImageNet ``classnames.txt`` (label ``i``)."""

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
    name="ImageNetV2",
    folder="imagenetv2",
    required=("imagenetv2-matched-frequency-format-val/", IMAGENET_CLASSNAMES),
    class_dirs=("imagenetv2-matched-frequency-format-val",),
    num_classes=1000,
    how=(
        "Download imagenetv2-matched-frequency.tar.gz (linked from "
        "github.com/modestyachts/ImageNetV2) and unpack it in DATASET.ROOT/imagenetv2/ so "
        "that imagenetv2/imagenetv2-matched-frequency-format-val/<0..999>/ exists. "
        "classnames.txt is read from imagenetv2/ or else from imagenet/. " + CLASSNAMES_HOW
    ),
    downloads=(
        Download(
            "https://s3-us-west-2.amazonaws.com/imagenetv2public/imagenetv2-matched-frequency.tar.gz",
            "imagenetv2-matched-frequency.tar.gz",
            extract=True,
            provides="imagenetv2-matched-frequency-format-val/",
        ),
        CLASSNAMES_DOWNLOAD,
    ),
)


@DATASET_REGISTRY.register()
class ImageNetV2(EvalOnlyDataset):
    layout = LAYOUT
    image_subdir = "imagenetv2-matched-frequency-format-val"

    def classes(self, classnames: dict[str, str]) -> list[tuple[str, str]]:
        return [(str(i), name) for i, name in enumerate(classnames.values())]
