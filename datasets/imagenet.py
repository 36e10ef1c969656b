"""ImageNet (ILSVRC-2012): ``imagenet/images/train/<wnid>/*`` and ``images/val/<wnid>/*`` with
CoOp's ``classnames.txt`` (``n01440764 tench`` lines).

Label = index of the wnid among the sorted training folders; the class name comes from
classnames.txt. As in CoOp, the val images are the test set and also serve as "val" (there is
no separate val split), and few-shot draws take train images only.

Listing 1.3 M files takes minutes, so the parsed lists are cached in ``preprocessed.pkl``
(plain lists of ``(path relative to images/, label)`` plus the class names) together with a
fingerprint of the class folders (names and modification times of every train and val class
folder, which change when a file is added, removed or renamed) and of classnames.txt: a later
run re-uses the lists while the fingerprint matches and re-scans otherwise. A
``preprocessed.pkl`` written by the CoOp code base (pickled Dassl Datum objects) is used as it
is when its paths lie in this image folder; it is never overwritten then.
"""

from __future__ import annotations

import hashlib
import logging
import os
import os.path as osp
import pickle
import tempfile
from itertools import chain

from engine.data import DatasetNotFoundError, Datum
from engine.data.fewshot import load_datum_pickle
from engine.registry import DATASET_REGISTRY

from .common import (
    CLASSNAMES_DOWNLOAD,
    CLASSNAMES_HOW,
    CoOpDataset,
    Layout,
    names_for_folders,
    read_class_folders,
    read_imagenet_classnames,
    subfolders,
)

logger = logging.getLogger(__name__)

CACHE_FORMAT = "sample-prompt-learning/imagenet-lists/1"

LAYOUT = Layout(
    name="ImageNet",
    folder="imagenet",
    required=("images/train/", "images/val/", "classnames.txt"),
    class_dirs=("images/train", "images/val"),
    num_classes=1000,
    how=(
        "ImageNet (ILSVRC-2012) is distributed by image-net.org to registered users: unpack "
        "the training archive into DATASET.ROOT/imagenet/images/train/<wnid>/ and the "
        "validation images into DATASET.ROOT/imagenet/images/val/<wnid>/ (the val archive is "
        "flat: sort its images into wnid folders, e.g. with the commonly used valprep.sh; "
        "symbolic links to an existing copy work). " + CLASSNAMES_HOW
    ),
    downloads=(CLASSNAMES_DOWNLOAD,),
    manual="the images (image-net.org requires an account and accepting its terms)",
)


@DATASET_REGISTRY.register()
class ImageNet(CoOpDataset):
    layout = LAYOUT
    image_subdir = "images"
    val_is_test = True

    @property
    def cache_path(self) -> str:
        return osp.join(self.dataset_dir, "preprocessed.pkl")

    @property
    def classnames_path(self) -> str:
        return osp.join(self.dataset_dir, "classnames.txt")

    def read_splits(self, cfg):
        fingerprint = self.fingerprint()
        lists = self.load_cache(fingerprint)
        if lists is None:
            lists = self.scan()
            self.save_cache(fingerprint, *lists)
        train, test = lists
        return train, [], test

    def fingerprint(self) -> dict:
        """Names and modification times of the class folders, hash of classnames.txt."""
        with open(self.classnames_path, "rb") as f:
            out = {"classnames.txt": hashlib.sha1(f.read()).hexdigest()}
        for split in ("train", "val"):
            with os.scandir(osp.join(self.image_dir, split)) as entries:
                out[split] = sorted((e.name, e.stat().st_mtime_ns) for e in entries if e.is_dir())
        return out

    def scan(self) -> tuple[list[Datum], list[Datum]]:
        """List every train and val image (minutes on the full dataset)."""
        logger.info("Listing the ImageNet images in %s (cached afterwards)", self.image_dir)
        classnames = read_imagenet_classnames(self.classnames_path)
        train_dir, val_dir = (osp.join(self.image_dir, s) for s in ("train", "val"))
        folders, val_folders = subfolders(train_dir), subfolders(val_dir)
        if folders != val_folders:
            odd = sorted(set(folders) ^ set(val_folders))
            raise DatasetNotFoundError(
                f"ImageNet: images/train and images/val must hold the same wnid folders; these "
                f"are in only one of them: {odd[:5]}{' ...' if len(odd) > 5 else ''}. "
                f"How to get it: {self.layout.how}"
            )
        classes = names_for_folders(folders, classnames, self.classnames_path, "ImageNet")
        train = read_class_folders(train_dir, classes, "ImageNet")
        test = read_class_folders(val_dir, classes, "ImageNet")
        return train, test

    def load_cache(self, fingerprint: dict):
        """The cached ``(train, test)`` lists, or None when absent or out of date."""
        if not osp.isfile(self.cache_path):
            return None
        try:
            data = load_datum_pickle(self.cache_path)
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
            logger.warning("Ignoring unreadable %s (%s); re-listing the images", self.cache_path, e)
            return None
        if not isinstance(data, dict):
            return None
        if data.get("format") == CACHE_FORMAT:
            if data.get("fingerprint") != fingerprint:
                logger.info("ImageNet folders or classnames.txt changed; re-listing the images")
                return None
            names = data["classnames"]

            def convert(rows):
                return [Datum(osp.join(self.image_dir, p), y, 0, names[y]) for p, y in rows]

            return convert(data["train"]), convert(data["test"])
        return self.coop_cache(data)

    def coop_cache(self, data: dict):
        """The lists of a CoOp ``preprocessed.pkl`` if all its paths are in this image folder."""
        train, test = data.get("train"), data.get("test")
        if not (isinstance(train, list) and isinstance(test, list)):
            return None
        prefix = self.image_dir + os.sep
        if all(isinstance(d, Datum) and d.impath.startswith(prefix) for d in chain(train, test)):
            logger.info(
                "Using CoOp's %s (it is not checked against later changes of the image "
                "folders; delete it to re-list them)",
                self.cache_path,
            )
            return train, test
        logger.warning("%s lists images outside %s; re-listing", self.cache_path, self.image_dir)
        return None

    def save_cache(self, fingerprint: dict, train: list[Datum], test: list[Datum]) -> None:
        names = [c for _, c in sorted({(d.label, d.classname) for d in train})]
        start = len(self.image_dir) + 1

        def rows(items):
            return [(d.impath[start:], d.label) for d in items]

        data = {
            "format": CACHE_FORMAT,
            "fingerprint": fingerprint,
            "classnames": names,
            "train": rows(train),
            "test": rows(test),
        }
        try:
            fd, tmp = tempfile.mkstemp(prefix=".preprocessed.", dir=self.dataset_dir)
            with os.fdopen(fd, "wb") as f:
                pickle.dump(data, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, self.cache_path)
        except OSError as e:  # e.g. a read-only dataset folder: work without the cache
            logger.warning("Could not write %s (%s); the next run lists again", self.cache_path, e)
