"""DescribableTextures (DTD), CoOp layout: ``dtd/images/<class>/*.jpg`` and
``dtd/split_zhou_DescribableTextures.json`` (generated 50/20/30 per class when missing)."""

from __future__ import annotations

import os.path as osp
import random

from engine.data import (
    DatasetBase,
    fewshot_and_subsample,
    read_and_split_data,
    read_split,
    require_dir,
    save_split,
)
from engine.registry import DATASET_REGISTRY

HOW_TO_GET = (
    "Download DTD (dtd-r1.0.1.tar.gz, https://www.robots.ox.ac.uk/~vgg/data/dtd/) and extract "
    "it under DATASET.ROOT so that dtd/images/<class>/*.jpg exists; put CoOp's "
    "split_zhou_DescribableTextures.json in dtd/ (or let a first run generate a split)."
)


@DATASET_REGISTRY.register()
class DescribableTextures(DatasetBase):
    dataset_dir = "dtd"

    def __init__(self, cfg):
        root = osp.abspath(osp.expanduser(cfg.DATASET.ROOT))
        self.dataset_dir = osp.join(root, self.dataset_dir)
        self.image_dir = osp.join(self.dataset_dir, "images")
        self.split_path = osp.join(self.dataset_dir, "split_zhou_DescribableTextures.json")
        require_dir(self.image_dir, "DescribableTextures", HOW_TO_GET)

        if osp.exists(self.split_path):
            train, val, test = read_split(self.split_path, self.image_dir)
        else:
            rng = random.Random(cfg.SEED if cfg.SEED >= 0 else 0)
            train, val, test = read_and_split_data(self.image_dir, rng=rng)
            save_split(train, val, test, self.split_path, self.image_dir)

        train, val, test = fewshot_and_subsample(self, cfg, train, val, test)
        super().__init__(train_x=train, val=val, test=test)
