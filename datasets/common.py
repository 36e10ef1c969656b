"""What the dataset readers share.

* :class:`Layout`: each dataset's expected folder layout, class count, "how to get it" text and
  public downloads, declared once in its reader module (``LAYOUT``) and used by the reader at
  start-up, by ``tools/check_data.py`` and by ``tools/download_data.py``.
* :class:`CoOpDataset`: CoOp's reader flow (check the layout, read the split file or generate
  and save one, few-shot draw, base/new subsampling) and :class:`EvalOnlyDataset` for the
  ImageNet variants that only have a test set.
* Helpers for ImageNet class-name files and class-folder scans.
"""

from __future__ import annotations

import logging
import os
import os.path as osp
import random
from collections.abc import Callable
from dataclasses import dataclass

from engine.data import (
    DatasetBase,
    DatasetNotFoundError,
    Datum,
    fewshot_and_subsample,
    read_split,
    save_split,
    subsample_classes,
)
from engine.data.cache_files import load_or_generate
from engine.utils import listdir_nohidden

logger = logging.getLogger(__name__)

# The ImageNet variants look for CoOp's classnames.txt in their own folder (where CoOp's
# instructions copy it) and then in DATASET.ROOT/imagenet/.
IMAGENET_CLASSNAMES = ("classnames.txt", "../imagenet/classnames.txt")
CLASSNAMES_HOW = (
    "classnames.txt is CoOp's ImageNet class-name file (one '<wnid> <class name>' line per "
    "class, 1,000 lines, published by CoOp on Google Drive); `python tools/download_data.py "
    "--root DATA ImageNet` fetches it (with gdown) into DATA/imagenet/, where every ImageNet "
    "variant finds it."
)


def subfolders(path: str, ignored=()) -> list[str]:
    """The sorted sub-folder names of ``path`` (hidden and ``ignored`` ones left out)."""
    return sorted(
        e.name
        for e in os.scandir(path)
        if e.is_dir() and not e.name.startswith(".") and e.name not in ignored
    )


@dataclass(frozen=True)
class Download:
    """One publicly downloadable file of a dataset (fetched by ``tools/download_data.py``).

    Attributes:
        url: an http(s) address, or ``gdrive:<file id>`` for a public Google Drive file.
        filename: the downloaded file's name, saved in ``extract_to`` (or the dataset folder).
        extract: unpack the archive (.zip, .tar, .tar.gz, .tgz) and delete it afterwards.
        extract_to: where the file goes, relative to the dataset folder ("." or ".." = ROOT).
        strip: a leading folder of the archive's member names dropped while unpacking.
        inner: an archive found after unpacking (relative to ``extract_to``) that is unpacked
            into the same place in turn.
        provides: what the download creates, relative to the dataset folder (a trailing "/"
            marks a folder); the download is skipped when it is there. Default: ``filename``.
        by_hand: why the file cannot be fetched (``url`` then names where a person gets it):
            ``tools/download_data.py`` unpacks it once it is put in the dataset folder, and
            says exactly which file to put where until then.
    """

    url: str
    filename: str
    extract: bool = False
    extract_to: str = "."
    strip: str = ""
    inner: str = ""
    provides: str = ""
    by_hand: str = ""

    def target(self) -> str:
        """What the download provides, relative to the dataset folder."""
        return self.provides or osp.join(self.extract_to, self.filename)


# CoOp's ImageNet class-name file (Google Drive), saved in DATASET.ROOT/imagenet/.
CLASSNAMES_DOWNLOAD = Download(
    "gdrive:1-61f_ol79pViBFDG_IDlUQSwoLcn2XXF", "classnames.txt", extract_to="../imagenet"
)


GENERATED = "GENERATED.txt"  # in a dataset folder: a generated stand-in (tools/make_toy.py)


@dataclass(frozen=True)
class Layout:
    """A dataset's expected files under ``DATASET.ROOT/<folder>``.

    Paths are relative to the dataset folder; a trailing "/" marks a folder; a tuple lists
    alternatives (the first one present is used).

    Attributes:
        name: the registered reader name.
        folder: the dataset's folder under DATASET.ROOT.
        required: what must always be there.
        how: how to obtain the dataset (official source and expected unpacking).
        split_file: CoOp's split file, read when present and generated when absent.
        generated_from: what a missing split file is generated from (required only then).
        class_dirs: folders whose sub-folders are the classes (checked against num_classes).
        ignored: sub-folders of class_dirs that are not classes.
        num_classes: the dataset's class count.
        downloads: the public files ``tools/download_data.py`` fetches.
        manual: what cannot be downloaded automatically, and why.
    """

    name: str
    folder: str
    required: tuple[str | tuple[str, ...], ...]
    how: str
    split_file: str = ""
    generated_from: tuple[str, ...] = ()
    class_dirs: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    num_classes: int = 0
    downloads: tuple[Download, ...] = ()
    manual: str = ""

    def dir(self, root: str) -> str:
        """The dataset folder under ``root`` (absolute)."""
        return osp.join(osp.abspath(osp.expanduser(root)), self.folder)

    def find(self, root: str, entry: str | tuple[str, ...]) -> str | None:
        """The path of ``entry`` (its first present alternative) under ``root``, or None."""
        for rel in entry if isinstance(entry, tuple) else (entry,):
            path = osp.normpath(osp.join(self.dir(root), rel))
            if (osp.isdir if rel.endswith("/") else osp.isfile)(path):
                return path
        return None

    def describe(self, entry: str | tuple[str, ...]) -> str:
        """``entry`` as paths relative to DATASET.ROOT, e.g. ``dtd/images/``."""
        alts = entry if isinstance(entry, tuple) else (entry,)
        return " or ".join(
            osp.normpath(osp.join(self.folder, a)) + ("/" if a.endswith("/") else "") for a in alts
        )

    def has_split_file(self, root: str) -> bool:
        return bool(self.split_file) and osp.isfile(osp.join(self.dir(root), self.split_file))

    def missing(self, root: str) -> list[str]:
        """What the reader needs but ``root`` lacks (empty when it can start)."""
        out = [self.describe(e) for e in self.required if self.find(root, e) is None]
        if not self.has_split_file(root):
            out += [
                f"{self.describe(e)} (needed to generate {self.split_file} while it is absent)"
                for e in self.generated_from
                if self.find(root, e) is None
            ]
        return out

    def class_folders(self, root: str, class_dir: str) -> list[str]:
        """The sorted class sub-folders of ``class_dir`` (hidden and ``ignored`` ones left out)."""
        return subfolders(osp.join(self.dir(root), class_dir), self.ignored)

    def generated(self, root: str) -> bool:
        """Whether the dataset folder is a generated stand-in (it holds :data:`GENERATED`, e.g.
        ``tools/make_toy.py``'s): its class count is its own, not the real dataset's."""
        return osp.isfile(osp.join(self.dir(root), GENERATED))

    def class_count_problems(self, root: str) -> list[str]:
        """One line per class folder whose number of classes differs from ``num_classes`` (none
        for a generated stand-in)."""
        out = []
        if self.generated(root):
            return out
        for class_dir in self.class_dirs:
            if not osp.isdir(osp.join(self.dir(root), class_dir)):
                continue
            n = len(self.class_folders(root, class_dir))
            if self.num_classes and n != self.num_classes:
                out.append(
                    f"{self.describe(class_dir + '/')} has {n} class folders, "
                    f"the dataset has {self.num_classes}"
                )
        return out

    def not_found(self, root: str, missing: list[str]) -> DatasetNotFoundError:
        """The start-up error for missing pieces, with how to obtain them."""
        root = osp.abspath(osp.expanduser(root))
        return DatasetNotFoundError(
            f"{self.name}: not found or incomplete under DATASET.ROOT (--root) = {root}; "
            f"missing: {'; '.join(missing)}. How to get it: {self.how} "
            f"(`python tools/check_data.py --root {root} {self.name}` checks the layout.)"
        )

    def require(self, root: str) -> str:
        """Check the layout at start-up and return the dataset folder.

        Raises:
            DatasetNotFoundError: naming every missing piece and how to obtain it.
        """
        missing = self.missing(root)
        if missing:
            raise self.not_found(root, missing)
        for problem in self.class_count_problems(root):
            logger.warning("%s: %s (incomplete copy?)", self.name, problem)
        return self.dir(root)


# ----------------------------------------------------------------------------------------------
# Checks on the parsed splits
# ----------------------------------------------------------------------------------------------
def check_labels(name: str, reference: list[Datum], *others: list[Datum]) -> None:
    """Labels of ``reference`` must be 0..n-1 with one class name each; ``others`` use them only.

    Raises:
        ValueError: a gap in the labels, a label with two names, or an unknown label.
    """
    names: dict[int, str] = {}
    for item in reference:
        prev = names.setdefault(item.label, item.classname)
        if prev != item.classname:
            raise ValueError(
                f"{name}: label {item.label} has two class names ({prev!r}, {item.classname!r})"
            )
    if min(names, default=0) < 0:
        raise ValueError(f"{name}: negative label {min(names)}")
    top = max(names, default=-1) + 1
    gaps = sorted(set(range(top)) - set(names))
    if gaps:
        raise ValueError(
            f"{name}: the labels must run 0..{top - 1} without gaps, but no image has label(s) "
            f"{gaps[:5]} (an empty class folder or a damaged split file?)"
        )
    for items in others:
        unknown = {item.label for item in items} - set(names)
        if unknown:
            raise ValueError(f"{name}: labels {sorted(unknown)[:5]} have no training images")


def check_images_exist(layout: Layout, root: str, *splits: list[Datum]) -> None:
    """Spot check at start-up: the first image of every class of every split must exist.

    Raises:
        DatasetNotFoundError: naming a missing image and how to obtain the dataset.
    """
    missing = []
    for items in splits:
        seen = set()
        for item in items:
            if item.label not in seen:
                seen.add(item.label)
                if not osp.isfile(item.impath):
                    missing.append(item.impath)
    if missing:
        raise layout.not_found(
            root,
            [
                f"{len(missing)} image(s) that the split lists, e.g. {missing[0]} "
                "(incomplete image folder, or a split file from another copy of the dataset?)"
            ],
        )


# ----------------------------------------------------------------------------------------------
# Readers
# ----------------------------------------------------------------------------------------------
def _subdir(path: str, sub: str) -> str:
    return osp.join(path, sub) if sub else path


def split_seed(cfg) -> int:
    """The seed of generated splits: SEED, or 0 when SEED < 0 (a generated split is always
    reproducible). CoOp used the global ``random`` just after seeding it with the run seed,
    which draws the same numbers as ``random.Random(SEED)``."""
    return cfg.SEED if cfg.SEED >= 0 else 0


def read_or_generate_split(cfg, split_path: str, path_prefix: str, generate: Callable):
    """Read a CoOp split file, or call ``generate(rng)`` and save its result there.

    Generation is locked (:func:`engine.data.cache_files.generate_once`): runs started together
    on a dataset without a split file all use the one that is saved. A read-only dataset folder
    keeps the generated file in the per-user cache. A damaged split file raises DataError.

    Returns:
        ``(train, val, test)`` lists of Datum.
    """
    seed = split_seed(cfg)

    def load(path):
        return read_split(path, path_prefix)

    def generate_split():
        logger.info("%s not found: generating a split (seed %d) and saving it", split_path, seed)
        return generate(random.Random(seed))

    def save(value, path):
        save_split(*value, path, path_prefix)

    return load_or_generate(split_path, load, generate_split, save, "Split file", ours=False)


class CoOpDataset(DatasetBase):
    """CoOp's reader flow for a dataset with train/val/test splits.

    At start-up the declared ``layout`` is checked (a missing piece raises
    DatasetNotFoundError before any scan); then the split file is read, or generated with
    :meth:`generate_split` and saved; the labels and one image per class are checked; the
    few-shot sets are drawn (cached) and the classes subsampled (DATASET.SUBSAMPLE_CLASSES).

    Subclasses set ``layout`` and ``image_subdir`` (split paths are relative to it) and
    implement :meth:`generate_split`, or override :meth:`read_splits`.
    """

    layout: Layout
    image_subdir = ""  # folder (under the dataset folder) that split paths are relative to
    val_is_test = False  # ImageNet: no val split, evaluate "val" on the test set (as CoOp)

    def __init__(self, cfg):
        root = cfg.DATASET.ROOT
        self.dataset_dir = self.layout.require(root)
        self.image_dir = _subdir(self.dataset_dir, self.image_subdir)
        train, val, test = self.read_splits(cfg)
        check_labels(self.layout.name, train, val, test)
        check_images_exist(self.layout, root, train, val, test)
        self.check_splits(cfg, train, val, test)
        train, val, test = fewshot_and_subsample(self, cfg, train, val, test)
        super().__init__(train_x=train, val=test if self.val_is_test else val, test=test)

    @classmethod
    def layout_for(cls, cfg) -> Layout:
        """The layout this reader requires for ``cfg`` (``train.py`` checks it before the
        run folder is written, :mod:`engine.preflight`)."""
        return cls.layout

    def check_splits(self, cfg, train, val, test) -> None:
        """A reader's own checks of the parsed splits, before the few-shot draw (the built-in
        readers have none: a class with fewer images than DATASET.NUM_SHOTS keeps them all,
        as in CoOp)."""

    @property
    def split_path(self) -> str:
        return osp.join(self.dataset_dir, self.layout.split_file)

    def read_splits(self, cfg):
        """``(train, val, test)``: the split file, generated and saved when absent."""
        return read_or_generate_split(cfg, self.split_path, self.image_dir, self.generate_split)

    def generate_split(self, rng: random.Random):
        """Build ``(train, val, test)`` from the dataset's own files (CoOp's percentages)."""
        raise NotImplementedError


def read_imagenet_classnames(path: str) -> dict[str, str]:
    """CoOp's ``classnames.txt``: ``{wnid: class name}`` in file order.

    Raises:
        ValueError: a line that is not ``<wnid> <class name>``, or a repeated wnid.
    """
    names: dict[str, str] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            wnid, _, classname = line.partition(" ")
            if not classname:
                raise ValueError(f"{path}:{n}: expected '<wnid> <class name>', got {line!r}")
            if wnid in names:
                raise ValueError(f"{path}:{n}: {wnid} appears twice")
            names[wnid] = classname
    return names


def read_class_folders(image_dir: str, classes: list[tuple[str, str]], dataset: str) -> list:
    """Datum for every file in ``image_dir/<folder>/``, label = index in ``classes``.

    Args:
        image_dir: the folder holding the class folders.
        classes: ``(folder, classname)`` pairs in label order.
        dataset: the dataset's name (for errors).

    File names are sorted, so the lists (and the few-shot draws from them) are the same on
    every machine; CoOp kept the file system's order.
    """
    items = []
    for label, (folder, classname) in enumerate(classes):
        class_dir = osp.join(image_dir, folder)
        if not osp.isdir(class_dir):
            raise DatasetNotFoundError(f"{dataset}: class folder not found: {class_dir}")
        names = listdir_nohidden(class_dir, sort=True)
        if not names:
            raise DatasetNotFoundError(f"{dataset}: class folder {class_dir} is empty")
        items.extend(Datum(osp.join(class_dir, n), label, 0, classname) for n in names)
    return items


def names_for_folders(folders: list[str], classnames: dict[str, str], path: str, dataset: str):
    """``(folder, classname)`` pairs; a folder without a line in ``classnames`` raises."""
    unknown = [f for f in folders if f not in classnames]
    if unknown:
        raise ValueError(
            f"{dataset}: folders {unknown[:5]} have no line in {path} "
            "(is it CoOp's 1,000-class ImageNet classnames.txt?)"
        )
    return [(f, classnames[f]) for f in folders]


class EvalOnlyDataset(DatasetBase):
    """An ImageNet variant used only for evaluation (ImageNetV2, -Sketch, -A, -R).

    All its images form the test split. As in CoOp, ``train_x`` is the same list (so the
    DataManager builds and zero-shot or cross-dataset evaluation works) and there is no val
    split. DATASET.NUM_SHOTS is ignored (there is nothing to train on); DATASET.SUBSAMPLE_CLASSES
    applies (base = first half of the labels). Class names come from CoOp's ImageNet
    ``classnames.txt`` (see ``IMAGENET_CLASSNAMES`` for where it is looked for).

    Subclasses set ``layout`` and ``image_subdir`` and may override :meth:`classes`.
    """

    layout: Layout
    image_subdir = ""

    @classmethod
    def layout_for(cls, cfg) -> Layout:
        """The layout this reader requires (checked before the run folder is written)."""
        return cls.layout

    def __init__(self, cfg):
        root = cfg.DATASET.ROOT
        self.dataset_dir = self.layout.require(root)
        self.image_dir = _subdir(self.dataset_dir, self.image_subdir)
        self.classnames_path = self.layout.find(root, IMAGENET_CLASSNAMES)
        classnames = read_imagenet_classnames(self.classnames_path)
        data = read_class_folders(self.image_dir, self.classes(classnames), self.layout.name)
        check_labels(self.layout.name, data)
        if cfg.DATASET.NUM_SHOTS >= 1:
            logger.info("%s is evaluation-only: DATASET.NUM_SHOTS ignored", self.layout.name)
        data = subsample_classes(data, subsample=cfg.DATASET.SUBSAMPLE_CLASSES)
        super().__init__(train_x=data, test=data)

    def classes(self, classnames: dict[str, str]) -> list[tuple[str, str]]:
        """``(folder, classname)`` pairs in label order: by default the sorted wnid folders
        (CoOp's rule for ImageNet-Sketch, -A and -R), named from ``classnames``."""
        folders = subfolders(self.image_dir)
        return names_for_folders(folders, classnames, self.classnames_path, self.layout.name)
