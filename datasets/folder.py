"""Folder: your own images as a dataset, without code (``DATASET.NAME Folder``).

``DATASET.FOLDER mydata`` names the dataset's folder under DATASET.ROOT (the grid, the scripts
and ``tools/check_data.py`` call it ``folder:mydata``). The folder holds either

- ``images/<class folder>/...``: one folder per class; its images may sit in sub-folders of
  any depth. Images are the files ending in .jpg .jpeg .png .bmp .gif .webp .tif .tiff (any
  case); other files are ignored. Or
- lists of images: ``train.csv`` and ``test.csv``, optionally ``val.csv`` (or the same names
  ending in ``.json``), one image per row ``path,label`` (a CSV may start with the header row
  ``path,label``; a JSON file is a list of ``[path, label]`` pairs or of ``{"path": ...,
  "label": ...}`` objects). Paths are relative to the dataset folder (or absolute); a label is
  a class key (any text or number).

Classes: the class folders (or the labels of the lists) in sorted order (numbers in numeric
order), named by their folder or label with underscores as spaces. ``classnames.txt`` in the
dataset folder, when present, fixes both: one class per line in label order, ``<key><TAB><class
name>`` or ``<key> <class name>`` (split at the first space, CoOp's ImageNet format), or just
``<key>`` (the name derived as above); a line that is a whole key (a folder name with spaces)
names that key.

The split (CoOp's rules): all three lists are the split as they are. Otherwise a split is made
once and saved in CoOp's format as ``split_zhou_<folder name>.json`` in the dataset folder (in
the per-user cache when the folder is read-only), and reused by every later run: from the class
folders 50% train, 20% val and 30% test of each class; from train and test lists, 20% of each
class of the train list as val. The split uses ``SEED`` (0 when unseeded) of the run that makes
it. Delete the file after adding or removing images or editing ``classnames.txt`` to have a new
split made (a run from class folders warns when they differ from the file).

Base-to-new halves, few-shot caches and the protocols work as for the built-in readers. A class
with fewer training images than ``DATASET.NUM_SHOTS`` stops the run with a DataError naming it
(CoOp's readers silently train on fewer images).
"""

from __future__ import annotations

import csv
import json
import logging
import os
import os.path as osp
import re

from engine.data import Datum, split_per_class, split_trainval
from engine.data.base import DatasetNotFoundError
from engine.data.cache_files import candidates
from engine.errors import ConfigError, DataError
from engine.registry import DATASET_REGISTRY

from .common import CoOpDataset, Layout, read_or_generate_split

logger = logging.getLogger(__name__)

PREFIX = "folder:"  # a folder dataset's name in the grid, the scripts and tools/check_data.py
IMAGES = "images"  # the class folders' folder
CLASSNAMES = "classnames.txt"
SPLITS = ("train", "val", "test")
LIST_EXTENSIONS = (".csv", ".json")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
P_TRAIN, P_VAL = 0.5, 0.2  # CoOp's split of class folders (the rest is test)
P_VAL_OF_TRAIN = 0.2  # CoOp's val share of a train list without a val list (OxfordPets)
HOW = (
    "put your images in DATASET.ROOT/{folder}/images/<class>/ (one folder per class) or list "
    "them in {folder}/train.csv and {folder}/test.csv (and val.csv; rows 'path,label'); "
    "see docs/own-dataset.md"
)


def folder_name(folder: str) -> str:
    """The last component of ``DATASET.FOLDER`` (names the split file)."""
    return osp.basename(osp.normpath(folder))


def split_file_name(folder: str) -> str:
    return f"split_zhou_{folder_name(folder)}.json"


def folder_layout(folder: str) -> Layout:
    """The layout of the folder dataset ``folder`` (a folder under DATASET.ROOT)."""
    folder = osp.normpath(folder)
    lists = tuple(f"train{ext}" for ext in LIST_EXTENSIONS)
    return Layout(
        name=PREFIX + folder,
        folder=folder,
        required=((f"{IMAGES}/", *lists, split_file_name(folder)),),
        how=HOW.format(folder=folder),
        split_file=split_file_name(folder),
    )


# ----------------------------------------------------------------------------------------------
# Reading the folder
# ----------------------------------------------------------------------------------------------
def is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")


def images_under(folder: str) -> list[str]:
    """The image files under ``folder`` (any depth, hidden entries left out), sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found += [osp.join(dirpath, f) for f in filenames if is_image(f)]
    return sorted(found)


def scan_class_folders(image_dir: str, dataset: str) -> dict[str, list[str]]:
    """``{class folder: its images}`` of ``image_dir``, folders sorted.

    Raises:
        DataError: no class folders, or a class folder without images.
    """
    folders = sorted(
        e.name for e in os.scandir(image_dir) if e.is_dir() and not e.name.startswith(".")
    )
    if not folders:
        raise DatasetNotFoundError(
            f"{dataset}: {image_dir} has no class folders; put each class's images in "
            f"{image_dir}/<class name>/"
        )
    classes = {f: images_under(osp.join(image_dir, f)) for f in folders}
    empty = [f for f, ims in classes.items() if not ims]
    if empty:
        raise DataError(
            f"{dataset}: class folder(s) {', '.join(repr(f) for f in empty[:5])} in {image_dir} "
            f"hold no images (files ending in {' '.join(IMAGE_EXTENSIONS)}, any case); add "
            "images or remove the folder(s)"
        )
    return classes


def list_files(dataset_dir: str) -> dict[str, str]:
    """``{split: list file}`` of the lists present in ``dataset_dir``.

    Raises:
        DataError: a split listed twice (``train.csv`` and ``train.json``).
    """
    found = {}
    for split in SPLITS:
        paths = [osp.join(dataset_dir, split + e) for e in LIST_EXTENSIONS]
        paths = [p for p in paths if osp.isfile(p)]
        if len(paths) > 1:
            raise DataError(f"Both {' and '.join(paths)} exist: keep one list per split")
        if paths:
            found[split] = paths[0]
    return found


def _label_text(value, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise DataError(f"{where}: a label must be a text or a whole number, got {value!r}")
    text = str(value).strip()
    if not text:
        raise DataError(f"{where}: empty label")
    return text


def read_list(path: str, dataset_dir: str) -> list[tuple[str, str]]:
    """``[(image path, class key)]`` of a ``.csv`` or ``.json`` list (module docstring).

    Raises:
        DataError: a row that is not ``path,label``, naming the file and the row.
    """
    rows = []
    if path.endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                items = json.load(f)
        except ValueError as e:
            raise DataError(f"{path} is not valid JSON ({e})") from e
        if not isinstance(items, list):
            raise DataError(f"{path}: expected a list of [path, label] pairs")
        for n, item in enumerate(items):
            where = f"{path}: item {n}"
            if isinstance(item, dict) and set(item) >= {"path", "label"}:
                item = (item["path"], item["label"])
            if not (isinstance(item, (list, tuple)) and len(item) == 2):
                raise DataError(f'{where}: expected [path, label] or {{"path", "label"}}: {item!r}')
            rows.append((item[0], _label_text(item[1], where), where))
    else:
        with open(path, newline="", encoding="utf-8") as f:
            for n, row in enumerate(csv.reader(f), 1):
                if not row or not "".join(row).strip():
                    continue
                if n == 1 and [c.strip().lower() for c in row] == ["path", "label"]:
                    continue  # the header row
                where = f"{path}:{n}"
                if len(row) != 2:
                    raise DataError(f"{where}: expected 'path,label', got {','.join(row)!r}")
                rows.append((row[0].strip(), _label_text(row[1], where), where))
    out = []
    for image, label, where in rows:
        if not isinstance(image, str) or not image:
            raise DataError(f"{where}: the image path must be a non-empty text")
        out.append((osp.normpath(osp.join(dataset_dir, image)), label))
    if not out:
        raise DataError(f"{path} lists no images")
    return out


def sorted_keys(keys) -> list[str]:
    """Class keys in label order: numeric order when all are whole numbers, else text order."""
    keys = set(keys)
    if all(re.fullmatch(r"-?\d+", k) for k in keys):
        return sorted(keys, key=int)
    return sorted(keys)


def default_name(key: str) -> str:
    return " ".join(key.replace("_", " ").split())


def read_classnames(path: str, keys: list[str]) -> list[tuple[str, str]]:
    """``[(key, class name)]`` in the order of ``classnames.txt`` (module docstring).

    Raises:
        DataError: an unknown key, a key named twice or a class left out, naming the line.
    """
    known = set(keys)
    out: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            line = raw.strip()
            if not line:
                continue
            if "\t" in line:
                key, _, name = (p.strip() for p in line.partition("\t"))
            elif line in known:
                key, name = line, ""
            else:
                key, _, name = line.partition(" ")
            if key not in known:
                some = ", ".join(sorted_keys(known)[:8]) + (", ..." if len(known) > 8 else "")
                raise DataError(
                    f"{path}:{n}: {key!r} is not a class folder or label of the dataset "
                    f"(known: {some}); a line is '<key><TAB><class name>', "
                    "'<key> <class name>' or '<key>'"
                )
            if key in out:
                raise DataError(f"{path}:{n}: class {key!r} is named twice")
            out[key] = name.strip() or default_name(key)
    left = [k for k in sorted_keys(known) if k not in out]
    if left:
        raise DataError(
            f"{path} names {len(out)} of the {len(known)} classes; add a line for each of "
            f"{', '.join(repr(k) for k in left[:5])}{' ...' if len(left) > 5 else ''}"
        )
    return list(out.items())


def class_table(dataset_dir: str, keys) -> list[tuple[str, str]]:
    """``[(key, class name)]`` in label order: ``classnames.txt`` if present, else the sorted
    keys named with underscores as spaces.

    Raises:
        DataError: two classes with the same name (CLIP would get the same prompt for both),
            naming both.
    """
    keys = sorted_keys(keys)
    path = osp.join(dataset_dir, CLASSNAMES)
    if osp.isfile(path):
        table = read_classnames(path, keys)
        where = f"in {path}"
    elif all(re.fullmatch(r"-?\d+", k) for k in keys):
        raise DataError(
            f"The labels of {dataset_dir} are numbers ({', '.join(keys[:5])}...): CLIP needs "
            f"class names. Add {path} with one '<label> <class name>' line per class"
        )
    else:
        table = [(k, default_name(k)) for k in keys]
        where = f"from the class folders or labels of {dataset_dir} (underscores read as spaces)"
    seen: dict[str, str] = {}
    for key, name in table:
        same = seen.setdefault(" ".join(name.lower().split()), key)
        if same != key:
            raise DataError(
                f"Classes {same!r} and {key!r} have the same name {name!r} {where}: CLIP would "
                "give both the same prompt. Rename one (its folder or label, or its line in "
                f"{CLASSNAMES}), or merge them"
            )
    return table


# ----------------------------------------------------------------------------------------------
# The reader
# ----------------------------------------------------------------------------------------------
@DATASET_REGISTRY.register()
class Folder(CoOpDataset):
    """A dataset from a folder of images or lists (module docstring); ``DATASET.FOLDER``."""

    def __init__(self, cfg):
        self.layout = self.layout_for(cfg)
        super().__init__(cfg)

    @classmethod
    def layout_for(cls, cfg) -> Layout:
        """The layout of the folder ``DATASET.FOLDER`` (ConfigError when it is empty)."""
        if not cfg.DATASET.FOLDER:
            raise ConfigError(
                "DATASET.NAME Folder reads the folder DATASET.FOLDER under DATASET.ROOT, but "
                "DATASET.FOLDER is empty: pass e.g. DATASET.FOLDER mydata (docs/own-dataset.md)"
            )
        return folder_layout(cfg.DATASET.FOLDER)

    def read_splits(self, cfg):
        """The lists, or the split file (made from the lists or the class folders if absent)."""
        lists = list_files(self.dataset_dir)
        if set(lists) == set(SPLITS):
            return self.splits_from_lists(lists, None)
        if lists:
            missing = [f"{s}.csv / {s}.json" for s in ("train", "test") if s not in lists]
            if missing:
                raise DataError(
                    f"{self.layout.name}: lists {', '.join(sorted(lists.values()))} found but no "
                    f"{' or '.join(missing)}: give train and test lists (val is optional), or "
                    "remove the lists to split the images/ folders"
                )

            def generate(rng):
                return self.splits_from_lists(lists, rng)

            splits = read_or_generate_split(cfg, self.split_path, self.dataset_dir, generate)
            if self.split_matches_lists(splits, lists):
                return splits
            for path in candidates(self.split_path):
                if osp.isfile(path):
                    logger.warning(
                        "%s: the lists %s changed since %s was made from them: it is replaced by "
                        "a new split of the current lists",
                        self.layout.name,
                        ", ".join(sorted(lists.values())),
                        path,
                    )
                    os.remove(path)
            return read_or_generate_split(cfg, self.split_path, self.dataset_dir, generate)
        image_dir = osp.join(self.dataset_dir, IMAGES)
        scanned = scan_class_folders(image_dir, self.layout.name) if osp.isdir(image_dir) else None

        def from_folders(rng):
            return self.splits_from_folders(scanned, rng)

        splits = read_or_generate_split(cfg, self.split_path, self.dataset_dir, from_folders)
        if scanned is not None:
            self.warn_if_changed(splits, scanned)
        return splits

    def split_matches_lists(self, splits, lists: dict[str, str]) -> bool:
        """Whether a split file made from the train/test lists holds what they list now (the
        train list = its train and val, the test list = its test, same class names)."""
        try:
            rows = {s: read_list(p, self.dataset_dir) for s, p in lists.items()}
            table = dict(class_table(self.dataset_dir, {k for r in rows.values() for _, k in r}))
        except DataError:
            return True  # the lists' own error is raised when a new split is made from them

        def items(*parts):
            return sorted((osp.normpath(d.impath), d.classname) for p in parts for d in p)

        train, val, test = splits
        want = {s: sorted((p, table[k]) for p, k in r) for s, r in rows.items()}
        return items(train, val) == want["train"] and items(test) == want["test"]

    def splits_from_folders(self, scanned: dict[str, list[str]] | None, rng):
        """CoOp's 50/20/30 split of each class folder."""
        if scanned is None:
            raise DatasetNotFoundError(f"{self.layout.name}: no {IMAGES}/ in {self.dataset_dir}")
        classes = [
            (name, list(scanned[key]), osp.join(self.dataset_dir, IMAGES, key))
            for key, name in class_table(self.dataset_dir, scanned)
        ]
        return split_per_class(classes, P_TRAIN, P_VAL, rng)

    def splits_from_lists(self, lists: dict[str, str], rng):
        """The lists as the split; without a val list, 20% of each class of the train list."""
        rows = {s: read_list(p, self.dataset_dir) for s, p in lists.items()}
        table = class_table(self.dataset_dir, {k for items in rows.values() for _, k in items})
        label = {key: (y, name) for y, (key, name) in enumerate(table)}
        trained = {k for _, k in rows["train"]}
        untrained = [name for key, (_, name) in label.items() if key not in trained]
        if untrained:
            raise DataError(
                f"{self.layout.name}: class(es) {', '.join(repr(n) for n in untrained[:5])} "
                f"have no image in {lists['train']}: add training images or remove the class"
            )
        splits = {
            s: [Datum(path, label[k][0], 0, label[k][1]) for path, k in items]
            for s, items in rows.items()
        }
        if "val" not in splits:
            counts = {}
            for d in splits["train"]:
                counts[d.classname] = counts.get(d.classname, 0) + 1
            few = [f"{c!r} ({n})" for c, n in counts.items() if round(n * P_VAL_OF_TRAIN) < 1]
            if few:
                raise DataError(
                    f"{self.layout.name}: without a val list, {P_VAL_OF_TRAIN:.0%} of each class "
                    f"of {lists['train']} becomes val, but class(es) {', '.join(few[:5])} have too "
                    "few training images (3 at least): add images, or give a val list"
                )
            splits["train"], splits["val"] = split_trainval(
                splits["train"], p_val=P_VAL_OF_TRAIN, rng=rng
            )
        return splits["train"], splits["val"], splits["test"]

    def warn_if_changed(self, splits, scanned: dict[str, list[str]]) -> None:
        """A warning when the class folders hold other images, or ``classnames.txt`` other
        class names, than the split file (made before they changed)."""
        listed = {d.impath for items in splits for d in items}
        present = {p for images in scanned.values() for p in images}
        added, gone = len(present - listed), len(listed - present)
        fix = "delete the split file to have a new split made"
        if added or gone:
            logger.warning(
                "%s: %d image(s) in %s/ are not in the split file %s and %d it lists are not "
                "there: %s from the current images",
                self.layout.name,
                added,
                IMAGES,
                self.layout.split_file,
                gone,
                fix,
            )
        if osp.isfile(osp.join(self.dataset_dir, CLASSNAMES)):
            try:
                wanted = [name for _, name in class_table(self.dataset_dir, scanned)]
            except DataError as e:
                logger.warning("%s: %s", self.layout.name, e)
                return
            names = dict(sorted({(d.label, d.classname) for items in splits for d in items}))
            if list(names.values()) != wanted:
                logger.warning(
                    "%s: the class names or their order in %s differ from the split file %s "
                    "(which the run uses): %s with the new names",
                    self.layout.name,
                    CLASSNAMES,
                    self.layout.split_file,
                    fix,
                )

    def check_splits(self, cfg, train, val, test) -> None:
        """Every class must have DATASET.NUM_SHOTS training images (DataError otherwise)."""
        shots = cfg.DATASET.NUM_SHOTS
        if shots < 1:
            return
        counts: dict[int, int] = {}
        names: dict[int, str] = {}
        totals: dict[int, int] = {}
        for items in (train, val, test):
            for d in items:
                totals[d.label] = totals.get(d.label, 0) + 1
        for d in train:
            counts[d.label] = counts.get(d.label, 0) + 1
            names[d.label] = d.classname
        short = sorted((n, y) for y, n in counts.items() if n < shots)
        if not short:
            return
        listed = ", ".join(
            f"{names[y]!r} has {n} training image(s) of {totals[y]}" for n, y in short[:5]
        )
        listed = ("class " if len(short) == 1 else "classes ") + listed
        listed += f" (and {len(short) - 5} more)" if len(short) > 5 else ""
        lists = list_files(self.dataset_dir)
        if "train" in lists:
            add = f"add training images of the class to {lists['train']}"
        else:
            add = (
                f"add images to the class folder (the split puts about {P_TRAIN:.0%} of them in "
                f"train: {2 * shots} images or more for {shots} shots)"
            )
        if set(lists) != set(SPLITS):
            saved = [p for p in candidates(self.split_path) if osp.isfile(p)]  # read-only: cache
            add += f" and delete {(saved or [self.split_path])[0]} so that a new split is made"
        fewest = short[0][0]
        raise DataError(
            f"{self.layout.name}: DATASET.NUM_SHOTS {shots} needs {shots} training images per "
            f"class, but {listed}. Fix: {add}; or lower DATASET.NUM_SHOTS to {fewest} "
            f"(SHOTS={fewest} for the scripts); or leave the class out"
        )


# ----------------------------------------------------------------------------------------------
# tools/check_data.py
# ----------------------------------------------------------------------------------------------
def training_counts(root: str, folder: str) -> tuple[dict[str, int], str]:
    """``({class name: training images}, where from)`` of the folder dataset ``folder``: from
    its split file when there is one, from its lists, or for class folders without a split file
    the share CoOp's split would put in train (``round(n * 50%)``).

    Raises:
        DataError: what the reader would refuse (unreadable lists, duplicate class names, ...).
    """
    layout = folder_layout(folder)
    dataset_dir = layout.dir(root)
    lists = list_files(dataset_dir)
    counts: dict[str, int] = {}
    if set(lists) != set(SPLITS) and layout.has_split_file(root):
        with open(osp.join(dataset_dir, layout.split_file), encoding="utf-8") as f:
            try:
                train = json.load(f)["train"]
            except (ValueError, KeyError, TypeError) as e:
                raise DataError(f"{layout.split_file} is not a split file ({e})") from e
        for item in train:
            counts[item[2]] = counts.get(item[2], 0) + 1
        return counts, layout.split_file
    if lists:
        rows = read_list(lists["train"], dataset_dir) if "train" in lists else []
        names = dict(class_table(dataset_dir, {k for _, k in rows}))
        for _, key in rows:
            counts[names[key]] = counts.get(names[key], 0) + 1
        if "val" not in lists:  # 20% of each class of the train list becomes val
            counts = {c: n - round(n * P_VAL_OF_TRAIN) for c, n in counts.items()}
        return counts, osp.basename(lists.get("train", ""))
    scanned = scan_class_folders(osp.join(dataset_dir, IMAGES), layout.name)
    for key, name in class_table(dataset_dir, scanned):
        counts[name] = round(len(scanned[key]) * P_TRAIN)
    return counts, f"{P_TRAIN:.0%} of each class folder (CoOp's split)"


def shots_problem(root: str, folder: str, shots: int) -> str | None:
    """What stops a run of ``shots`` shots on the folder dataset (a class with fewer training
    images), with the largest shots that would run; None when every class has enough."""
    if shots < 1:
        return None
    counts, source = training_counts(root, folder)
    short = sorted((n, c) for c, n in counts.items() if n < shots)
    if not short:
        return None
    fewest = short[0][0]
    which = "every class" if len(short) == len(counts) else f"{len(short)} of {len(counts)} classes"
    listed = ", ".join(f"{c!r} ({n})" for n, c in short[:5]) + (" ..." if len(short) > 5 else "")
    lower = f"run with {fewest} shots or fewer (SHOTS={fewest} for the scripts, " + (
        f"DATASET.NUM_SHOTS {fewest} for train.py)" if fewest >= 1 else "none: add images)"
    )
    return (
        f"too few training images for {shots} shots in {which}: {listed} (training images per "
        f"class, from {source}); add images, or {lower}"
    )


def inspect_folder(root: str, folder: str, shots: int = 16) -> tuple[list[str], list[str]]:
    """``(problems, notes)`` about the folder dataset ``folder`` under ``root`` for
    ``tools/check_data.py``: what the reader would refuse, and its classes and images."""
    layout = folder_layout(folder)
    dataset_dir = layout.dir(root)
    problems: list[str] = []
    notes: list[str] = []
    try:
        lists = list_files(dataset_dir)
        if lists:
            rows = {s: read_list(p, dataset_dir) for s, p in lists.items()}
            table = class_table(dataset_dir, {k for r in rows.values() for _, k in r})
            sizes = ", ".join(f"{s} {len(r)}" for s, r in rows.items())
            notes.append(f"lists: {sizes} images, {len(table)} classes")
            missing = [p for r in rows.values() for p, _ in r if not osp.isfile(p)]
            if missing:
                problems.append(f"{len(missing)} listed image(s) not found, e.g. {missing[0]}")
        elif osp.isdir(osp.join(dataset_dir, IMAGES)):
            scanned = scan_class_folders(osp.join(dataset_dir, IMAGES), layout.name)
            table = class_table(dataset_dir, scanned)
            counts = {name: len(scanned[key]) for key, name in table}
            fewest = min(counts, key=counts.get)
            notes.append(
                f"{len(table)} classes, {sum(counts.values())} images in {IMAGES}/ (fewest: "
                f"{fewest!r} with {counts[fewest]})"
            )
            if not layout.has_split_file(root):
                small = [f"{c!r} ({n})" for c, n in counts.items() if n < 4]
                if small:
                    problems.append(
                        f"class(es) {', '.join(small[:5])} have fewer than 4 images: too few "
                        "for the 50/20/30 split"
                    )
        if set(lists) == set(SPLITS):
            notes.append("the lists are the split")
        elif layout.has_split_file(root):
            notes.append(f"split: {layout.split_file} (made by an earlier run, or yours)")
        else:
            notes.append(f"no {layout.split_file} yet: the first run makes and saves the split")
    except DataError as e:
        problems.append(str(e))
    return problems, notes
