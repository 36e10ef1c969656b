"""Datum and DatasetBase (Dassl's data model) and CoOp's split helpers.

A dataset reader builds lists of :class:`Datum` for train/val/test and passes them to
:class:`DatasetBase`. The helpers below reproduce CoOp's split files (``split_zhou_*.json``),
generated splits and base/new class subsampling, and give one clear error type for missing data.
"""

from __future__ import annotations

import json
import math
import os.path as osp
import random
from collections import defaultdict

from engine.errors import DataError
from engine.utils import listdir_nohidden, write_json


class DatasetNotFoundError(DataError, FileNotFoundError):
    """A dataset folder or file is missing; the message says what and how to get it."""


class SplitFileError(DataError, ValueError):
    """A split file that is not valid JSON or not in CoOp's format; the message names the fix."""


class Datum:
    """One image with its label.

    Args:
        impath: image path.
        label: class label (0-based).
        domain: domain label (0 when there is a single domain).
        classname: class name.

    The image file is not stat-ed here (ImageNet has 1.3 M of them); a missing or unreadable
    file fails when it is read, with its path. Attribute names match Dassl's so that few-shot
    caches pickled by the CoOp code base load into this class.
    """

    __slots__ = ("_impath", "_label", "_domain", "_classname")

    def __init__(self, impath: str = "", label: int = 0, domain: int = 0, classname: str = ""):
        if not isinstance(impath, str):
            raise TypeError(f"Datum impath must be a str, got {type(impath).__name__}")
        self._impath = impath
        self._label = int(label)
        self._domain = int(domain)
        self._classname = classname

    # pickles written by Dassl store the instance __dict__; accept both forms
    def __setstate__(self, state):
        if isinstance(state, tuple):  # (dict_state, slots_state)
            state = {**(state[0] or {}), **(state[1] or {})}
        for k in self.__slots__:
            object.__setattr__(self, k, state.get(k, "" if k in ("_impath", "_classname") else 0))

    def __getstate__(self):
        return {k: getattr(self, k) for k in self.__slots__}

    @property
    def impath(self) -> str:
        return self._impath

    @property
    def label(self) -> int:
        return self._label

    @property
    def domain(self) -> int:
        return self._domain

    @property
    def classname(self) -> str:
        return self._classname

    def __eq__(self, other) -> bool:
        return isinstance(other, Datum) and self.__getstate__() == other.__getstate__()

    def __hash__(self) -> int:
        return hash((self._impath, self._label, self._domain, self._classname))

    def __repr__(self) -> str:
        return f"Datum({self._impath!r}, {self._label}, {self._domain}, {self._classname!r})"


class DatasetBase:
    """A dataset as lists of Datum: ``train_x``, ``train_u``, ``val``, ``test``.

    Readers set ``dataset_dir`` (the dataset's folder) before calling ``super().__init__``.
    """

    dataset_dir = ""  # the dataset's folder under DATASET.ROOT
    domains: list[str] = []  # domain names, for multi-domain datasets

    def __init__(self, train_x=None, train_u=None, val=None, test=None):
        self._train_x = train_x
        self._train_u = train_u
        self._val = val
        self._test = test
        source = train_x if train_x else test
        self._num_classes = self.get_num_classes(source or [])
        self._lab2cname, self._classnames = self.get_lab2cname(source or [])

    @property
    def train_x(self):
        return self._train_x

    @property
    def train_u(self):
        return self._train_u

    @property
    def val(self):
        return self._val

    @property
    def test(self):
        return self._test

    @property
    def lab2cname(self) -> dict[int, str]:
        return self._lab2cname

    @property
    def classnames(self) -> list[str]:
        return self._classnames

    @property
    def num_classes(self) -> int:
        return self._num_classes

    def drop_images(self, paths, splits=("train_x", "val", "test")) -> None:
        """Remove the items whose ``impath`` is in ``paths`` from ``splits`` (unreadable images
        skipped with DATASET.SKIP_UNREADABLE). Labels and class names stay as they are."""
        paths = set(paths)
        for name in splits:
            items = getattr(self, f"_{name}")
            if items:
                setattr(self, f"_{name}", [d for d in items if d.impath not in paths])

    @staticmethod
    def get_num_classes(data_source) -> int:
        """Number of classes = max label + 1."""
        return max((item.label for item in data_source), default=-1) + 1

    @staticmethod
    def get_lab2cname(data_source):
        """``{label: classname}`` and the class names ordered by label."""
        container = {item.label: item.classname for item in data_source}
        labels = sorted(container)
        mapping = {label: container[label] for label in labels}
        return mapping, [mapping[label] for label in labels]

    @staticmethod
    def split_dataset_by_label(data_source) -> dict[int, list[Datum]]:
        """Group items by label, labels in order of first appearance."""
        output = defaultdict(list)
        for item in data_source:
            output[item.label].append(item)
        return output

    @staticmethod
    def split_dataset_by_domain(data_source) -> dict[int, list[Datum]]:
        output = defaultdict(list)
        for item in data_source:
            output[item.domain].append(item)
        return output

    def generate_fewshot_dataset(
        self, *data_sources, num_shots: int = -1, repeat: bool = False, rng=None
    ):
        """Sample ``num_shots`` items per label from each source (CoOp's algorithm).

        For each source, for each label in first-appearance order: ``rng.sample(items, k)`` when
        there are enough items, ``rng.choices`` with ``repeat``, else all items. ``rng`` is a
        ``random.Random``; CoOp used the global ``random`` seeded with the run seed, and
        ``random.Random(seed)`` draws the same numbers.
        """
        if num_shots < 1:
            return data_sources[0] if len(data_sources) == 1 else data_sources
        rng = rng if rng is not None else random.Random()
        output = []
        for data_source in data_sources:
            tracker = self.split_dataset_by_label(data_source)
            dataset = []
            for items in tracker.values():
                if len(items) >= num_shots:
                    sampled = rng.sample(items, num_shots)
                elif repeat:
                    sampled = rng.choices(items, k=num_shots)
                else:
                    sampled = items
                dataset.extend(sampled)
            output.append(dataset)
        return output[0] if len(output) == 1 else output


# ----------------------------------------------------------------------------------------------
# CoOp split helpers
# ----------------------------------------------------------------------------------------------
def require_dir(path: str, dataset: str, how: str = "") -> None:
    """Raise DatasetNotFoundError if ``path`` is not a folder."""
    if not osp.isdir(path):
        raise DatasetNotFoundError(
            f"{dataset}: folder not found: {path}. " + (how or "Check DATASET.ROOT / --root.")
        )


def require_file(path: str, dataset: str, how: str = "") -> None:
    """Raise DatasetNotFoundError if ``path`` is not a file."""
    if not osp.isfile(path):
        raise DatasetNotFoundError(
            f"{dataset}: file not found: {path}. " + (how or "Check DATASET.ROOT / --root.")
        )


def read_split(filepath: str, path_prefix: str) -> tuple[list, list, list]:
    """Read a CoOp ``split_zhou_*.json`` (``[relpath, label, classname]`` triplets).

    Raises:
        SplitFileError: the file is not valid JSON or not in CoOp's format (names the fix).
    """
    fix = (
        "Delete it to have a split generated (a new split, not the paper's), or download "
        "CoOp's split file again (`python tools/download_data.py --root DATASET.ROOT <dataset>`)."
    )
    try:
        with open(filepath, "rb") as f:
            split = json.loads(f.read().decode("utf-8"))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SplitFileError(f"Split file {filepath} is not valid JSON ({e}). {fix}") from e

    def _convert(items):
        return [
            Datum(impath=osp.join(path_prefix, impath), label=int(label), classname=classname)
            for impath, label, classname in items
        ]

    try:
        return _convert(split["train"]), _convert(split["val"]), _convert(split["test"])
    except (KeyError, ValueError, TypeError) as e:
        raise SplitFileError(
            f"Split file {filepath} is not in CoOp's format "
            '({"train": [[relpath, label, classname], ...], "val": ..., "test": ...}): '
            f"{e!r}. {fix}"
        ) from e


def save_split(train, val, test, filepath: str, path_prefix: str) -> None:
    """Write a CoOp split file with paths relative to ``path_prefix``."""

    def _extract(items):
        out = []
        for item in items:
            impath = item.impath
            if impath.startswith(path_prefix):
                impath = impath[len(path_prefix) :].lstrip("/\\")
            out.append((impath, item.label, item.classname))
        return out

    write_json({"train": _extract(train), "val": _extract(val), "test": _extract(test)}, filepath)


def split_trainval(trainval, p_val: float = 0.2, rng=None):
    """Split train+val per class: ``round(p_val * n)`` items of each label go to val."""
    rng = rng if rng is not None else random
    tracker = defaultdict(list)
    for idx, item in enumerate(trainval):
        tracker[item.label].append(idx)
    train, val = [], []
    for label, idxs in tracker.items():
        n_val = round(len(idxs) * p_val)
        if n_val <= 0:
            raise ValueError(f"Class {label} has too few images to split off a val set")
        rng.shuffle(idxs)
        for n, idx in enumerate(idxs):
            (val if n < n_val else train).append(trainval[idx])
    return train, val


class SplitError(DataError, ValueError):
    """A class has too few images for the split rule; the message names it and the fix."""


def read_and_split_data(
    image_dir: str,
    p_trn: float = 0.5,
    p_val: float = 0.2,
    ignored=(),
    new_cnames: dict | None = None,
    rng=None,
):
    """Build a split from ``image_dir/<class>/*`` folders (CoOp's DTD/Caltech/Food rule).

    Classes are the sorted folder names (minus ``ignored``, renamed by ``new_cnames``); per
    class the images are shuffled and ``round(n*p_trn)`` go to train, ``round(n*p_val)`` to val
    and the rest to test (:func:`split_per_class`).
    """
    categories = [c for c in listdir_nohidden(image_dir, sort=True) if c not in ignored]
    categories = [c for c in categories if osp.isdir(osp.join(image_dir, c))]
    classes = []
    for category in categories:
        category_dir = osp.join(image_dir, category)
        images = [osp.join(category_dir, im) for im in listdir_nohidden(category_dir, sort=True)]
        name = new_cnames[category] if new_cnames and category in new_cnames else category
        classes.append((name, images, category_dir))
    return split_per_class(classes, p_trn, p_val, rng)


def split_per_class(classes, p_trn: float = 0.5, p_val: float = 0.2, rng=None):
    """CoOp's per-class split of image lists into train, val and test.

    Args:
        classes: ``(classname, image paths, where)`` per class in label order (``where``: the
            class's folder or list, named in errors).
        p_trn, p_val: the train and val fractions; the test set gets the rest.
        rng: a ``random.Random`` (default: the global ``random``, as CoOp).

    Per class the paths are shuffled (in place) and ``round(n*p_trn)`` go to train,
    ``round(n*p_val)`` to val and the rest to test.

    Raises:
        SplitError: a class whose share of train, val or test would be empty.
    """
    rng = rng if rng is not None else random
    p_tst = 1 - p_trn - p_val
    train, val, test = [], [], []
    for label, (classname, images, where) in enumerate(classes):
        rng.shuffle(images)
        n_total = len(images)
        n_train = round(n_total * p_trn)
        n_val = round(n_total * p_val)
        n_test = n_total - n_train - n_val
        if not (n_train > 0 and n_val > 0 and n_test > 0):
            raise SplitError(
                f"Class '{classname}' in {where} has {n_total} images: too few for a "
                f"{p_trn:.0%}/{p_val:.0%}/{p_tst:.0%} split (add images to the class, or "
                "leave the class out)"
            )

        def _collate(ims, y=label, c=classname):
            return [Datum(impath=im, label=y, classname=c) for im in ims]

        train.extend(_collate(images[:n_train]))
        val.extend(_collate(images[n_train : n_train + n_val]))
        test.extend(_collate(images[n_train + n_val :]))
    return train, val, test


def subsample_classes(*args, subsample: str = "all"):
    """Keep the base (first ceil(n/2) sorted labels) or new (the rest) classes and relabel.

    Args:
        args: lists of Datum (train, val, test...); the labels come from the first one.
        subsample: "all" | "base" | "new".
    """
    if subsample not in ("all", "base", "new"):
        raise ValueError(f"DATASET.SUBSAMPLE_CLASSES must be all, base or new; got {subsample!r}")
    if subsample == "all":
        return args if len(args) > 1 else args[0]
    labels = sorted({item.label for item in args[0]})
    m = math.ceil(len(labels) / 2)
    selected = labels[:m] if subsample == "base" else labels[m:]
    relabeler = {y: y_new for y_new, y in enumerate(selected)}
    output = []
    for dataset in args:
        output.append(
            [
                Datum(
                    impath=item.impath,
                    label=relabeler[item.label],
                    domain=item.domain,
                    classname=item.classname,
                )
                for item in dataset
                if item.label in relabeler
            ]
        )
    return output if len(output) > 1 else output[0]
