"""ImageNet (ILSVRC-2012): ``imagenet/images/train/<wnid>/*`` and ``images/val/<wnid>/*`` with
CoOp's ``classnames.txt`` (``n01440764 tench`` lines).

Label = index of the wnid among the sorted training folders; the class name comes from
classnames.txt. As in CoOp, the val images are the test set and also serve as "val" (there is
no separate val split), and few-shot draws take train images only.

Listing 1.3 M files takes minutes, so the parsed lists are cached in this project's own file,
``preprocessed_sample_pl.pkl`` (plain lists of ``(path relative to images/, label)`` plus the
class names), together with a fingerprint of the class folders (names and modification times of
every train and val class folder, which change when a file is added, removed or renamed) and of
classnames.txt: a later run re-uses the lists while the fingerprint matches and re-scans
otherwise. The cache is written once under a file lock, with normal file modes, and goes to the
per-user cache when the dataset folder is read-only (see :mod:`engine.data.cache_files`).

``preprocessed.pkl`` belongs to the CoOp code base (a dict ``{"train": [Datum], "test":
[Datum]}`` of pickled Dassl Datum objects): it is read and used as it is when its paths lie in
this image folder, and never written. A ``preprocessed.pkl`` written by earlier versions of this
project (which broke CoOp's code) is moved to the new name.
"""

from __future__ import annotations

import hashlib
import logging
import os
import os.path as osp
import pickle
from itertools import chain

from engine.data import DatasetNotFoundError, Datum
from engine.data.cache_files import READ_ERRORS, generate_once, load_existing
from engine.data.fewshot import load_datum_pickle
from engine.registry import DATASET_REGISTRY
from engine.utils import atomic_write_bytes

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
        "ImageNet (ILSVRC-2012) is distributed by image-net.org to registered users: put "
        "ILSVRC2012_img_train.tar, ILSVRC2012_img_val.tar and ILSVRC2012_devkit_t12.tar.gz in "
        "DATASET.ROOT/imagenet/ and run `python tools/download_data.py --root DATA ImageNet`: "
        "it checks them and unpacks the images into DATASET.ROOT/imagenet/images/train/<wnid>/ "
        "and images/val/<wnid>/ (the val archive is flat: it is sorted with the devkit's ground "
        "truth, as valprep.sh does). Or unpack them there yourself (symbolic links to an "
        "existing copy work). " + CLASSNAMES_HOW
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
        """This project's list cache."""
        return osp.join(self.dataset_dir, "preprocessed_sample_pl.pkl")

    @property
    def coop_cache_path(self) -> str:
        """CoOp's list cache: read, never written."""
        return osp.join(self.dataset_dir, "preprocessed.pkl")

    @property
    def classnames_path(self) -> str:
        return osp.join(self.dataset_dir, "classnames.txt")

    def read_splits(self, cfg):
        fingerprint = self.fingerprint()

        def load(path):
            return self.load_cache(path, fingerprint)

        lists = load_existing(self.cache_path, load, "ImageNet list cache")
        if lists is None:
            lists = self.coop_cache(load)
        if lists is None:

            def save(value, path):
                self.save_cache(path, fingerprint, *value)

            lists = generate_once(
                self.cache_path, load, self.scan, save, "ImageNet list cache", required=False
            )
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

    def _move_old_cache(self, load_own):
        old, new = self.coop_cache_path, self.cache_path
        try:
            if osp.exists(new):
                raise FileExistsError(f"{new} exists")
            os.replace(old, new)
        except OSError as e:
            logger.warning(
                "%s was written by an earlier version of this project and breaks CoOp's code; "
                "it could not be renamed to %s (%s): delete it",
                old,
                osp.basename(new),
                e,
            )
            return None
        logger.info("Moved this project's old list cache %s to %s", old, new)
        return load_existing(new, load_own, "ImageNet list cache")

    def load_cache(self, path: str, fingerprint: dict):
        """The cached ``(train, test)`` lists of ``path``, or None when out of date.

        Raises:
            One of ``READ_ERRORS`` for a damaged file (it is then written again).
        """
        data = load_datum_pickle(path)
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
            raise ValueError(f"not a {CACHE_FORMAT} file")
        if data.get("fingerprint") != fingerprint:
            logger.info("ImageNet folders or classnames.txt changed; re-listing the images")
            return None
        names = data["classnames"]

        def convert(rows):
            return [Datum(osp.join(self.image_dir, p), y, 0, names[y]) for p, y in rows]

        return convert(data["train"]), convert(data["test"])

    def coop_cache(self, load_own):
        """The lists of CoOp's ``preprocessed.pkl`` if all its paths are in this image folder.

        A ``preprocessed.pkl`` in this project's old format (which breaks CoOp's code) is moved
        to :attr:`cache_path` and read with ``load_own``.
        """
        path = self.coop_cache_path
        if not osp.isfile(path):
            return None
        try:
            data = load_datum_pickle(path)
        except (*READ_ERRORS, OSError) as e:
            logger.warning("Ignoring unreadable CoOp cache %s (%s)", path, e)
            return None
        if isinstance(data, dict) and data.get("format") == CACHE_FORMAT:
            return self._move_old_cache(load_own)
        if not isinstance(data, dict):
            return None
        train, test = data.get("train"), data.get("test")
        if not (isinstance(train, list) and isinstance(test, list)):
            return None
        prefix = self.image_dir + os.sep
        if all(isinstance(d, Datum) and d.impath.startswith(prefix) for d in chain(train, test)):
            logger.info(
                "Using CoOp's %s (it is not checked against later changes of the image "
                "folders; delete it to re-list them)",
                path,
            )
            return train, test
        logger.warning("%s lists images outside %s; re-listing", path, self.image_dir)
        return None

    def save_cache(self, path: str, fingerprint: dict, train: list[Datum], test: list[Datum]):
        """Write this project's list cache to ``path`` (atomically, plain Python types)."""
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
        atomic_write_bytes(path, pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL))
