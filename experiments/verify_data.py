"""``tools/check_data.py --verify``: prove a dataset root ready, image by image.

Beyond the layout check of ``check_data``, each dataset is read by its own reader (the split
file, or the dataset's own lists and class folders) and every image of every split is opened:

* every file the reader needs is present, and CoOp's split file is there (a generated split is
  not the paper's);
* the number of images per split that are present and readable equals the number the split
  file (or the dataset's lists) names: missing and unreadable images are listed;
* the dataset has its number of classes and no class is empty in any split;
* where the dataset's size is published and has no split file (ImageNet's 50,000 validation
  images, the evaluation sets), the count equals it; ImageNet's validation images must sit in
  wnid folders (a flat ``images/val/`` is reported with the command that sorts it).

:func:`verify_dataset` is the importable form; the expected class and image counts are a
:class:`Reference` (the dataset's own by default; the tests pass their tiny trees').
"""

from __future__ import annotations

import os
import os.path as osp
from dataclasses import dataclass, field

from datasets.common import (
    IMAGENET_CLASSNAMES,
    CoOpDataset,
    EvalOnlyDataset,
    Layout,
    read_class_folders,
    read_imagenet_classnames,
)
from engine.data.image_check import find_unreadable
from engine.registry import DATASET_REGISTRY

READY, PARTIAL, MISSING, UNCHECKED = "ready", "partial", "missing", "unchecked"
SHOWN = 10  # paths listed per kind of problem

# published image counts of the datasets without a split file (their papers and pages)
PUBLISHED_IMAGES = {
    "ImageNet": {"test": 50_000},  # ILSVRC-2012 validation images (the test set here)
    "ImageNetV2": {"test": 10_000},
    "ImageNetSketch": {"test": 50_889},
    "ImageNetA": {"test": 7_500},
    "ImageNetR": {"test": 30_000},
}


@dataclass(frozen=True)
class Reference:
    """What a complete copy has: ``classes`` classes and, where published, ``images[split]``."""

    classes: int
    images: dict = field(default_factory=dict)

    @classmethod
    def of(cls, layout: Layout) -> Reference:
        return cls(layout.num_classes, PUBLISHED_IMAGES.get(layout.name, {}))

    @classmethod
    def of_tree(cls, expected) -> Reference:
        """The reference of a miniature tree (``tests/dataset_trees.Expected``)."""
        return cls(len(expected.names), {"test": expected.sizes[2]})


def _reader(layout: Layout, root: str):
    """The dataset's reader object with its folders set, without running its start-up."""
    reader_cls = DATASET_REGISTRY.get(layout.name)
    reader = reader_cls.__new__(reader_cls)
    reader.dataset_dir = layout.dir(root)
    sub = getattr(reader_cls, "image_subdir", "")
    reader.image_dir = osp.join(reader.dataset_dir, sub) if sub else reader.dataset_dir
    return reader


def read_splits(layout: Layout, root: str) -> dict:
    """``{split: [Datum]}`` as the dataset's reader lists them (no few-shot draw, all classes).

    Raises:
        whatever the reader raises for a damaged file (DatasetNotFoundError, ValueError, ...).
    """
    reader = _reader(layout, root)
    if isinstance(reader, EvalOnlyDataset):
        reader.classnames_path = layout.find(root, IMAGENET_CLASSNAMES)
        names = read_imagenet_classnames(reader.classnames_path)
        return {"test": read_class_folders(reader.image_dir, reader.classes(names), layout.name)}
    if not isinstance(reader, CoOpDataset):
        raise TypeError(f"{layout.name}: --verify knows CoOp-style readers only")
    from engine.config import get_cfg_default

    cfg = get_cfg_default()
    cfg.SEED = 1
    train, val, test = reader.read_splits(cfg)
    splits = {"train": train, "val": val, "test": test}
    return {k: v for k, v in splits.items() if v}


def _shown(paths: list[str]) -> str:
    more = f" (and {len(paths) - SHOWN} more)" if len(paths) > SHOWN else ""
    return "; ".join(paths[:SHOWN]) + more


def imagenet_problems(root: str, layout: Layout) -> list[str]:
    """A flat ``images/val/`` (the validation archive unpacked as it is), or the validation
    archive waiting to be unpacked, with the command that sorts it."""
    val = osp.join(layout.dir(root), "images", "val")
    sort = f"`python tools/download_data.py --root {root} --sort-imagenet-val`"
    if not osp.isdir(val):
        if osp.isfile(osp.join(layout.dir(root), "ILSVRC2012_img_val.tar")):
            return [
                f"imagenet/ILSVRC2012_img_val.tar found: {sort} unpacks it into wnid folders "
                "(with imagenet/ILSVRC2012_devkit_t12.tar.gz, as valprep.sh does)"
            ]
        return []
    flat = sum(1 for e in os.scandir(val) if e.is_file() and not e.name.startswith("."))
    if not flat:
        return []
    return [
        f"imagenet/images/val/ holds {flat:,} images outside wnid folders (the flat validation "
        f"archive): sort them into wnid folders with {sort} (it reads the ground truth of "
        "imagenet/ILSVRC2012_devkit_t12.tar.gz, as valprep.sh does)"
    ]


def verify_dataset(root: str, name: str, reference: Reference | None = None):
    """``(status, lines)``: "ready" when every check of the module doc passes, else "partial"
    or "missing" with one line per problem (and what was counted).

    Raises:
        KeyError: ``name`` is not a registered dataset.
    """
    from experiments.layouts import find_layout

    layout = find_layout(name)
    if layout is None:
        return UNCHECKED, ["declares no layout: not checked here (its reader checks at start-up)"]
    reference = reference or Reference.of(layout)
    how = "how to get it: " + layout.how
    if not osp.isdir(layout.dir(root)):
        return MISSING, [f"{layout.folder}/ not found", how]
    extra = imagenet_problems(root, layout) if layout.name == "ImageNet" else []
    missing = layout.missing(root)
    if missing:
        return PARTIAL, [f"missing: {m}" for m in missing] + extra + [how]
    problems = list(extra)
    if layout.split_file and not layout.has_split_file(root):
        problems.append(
            f"{layout.folder}/{layout.split_file} absent: a generated split is not the paper's "
            f"(`python tools/download_data.py --root {root} {layout.name}` fetches CoOp's)"
        )
    if problems:
        return PARTIAL, problems + [how]
    try:
        splits = read_splits(layout, root)
    except Exception as e:  # the reader's own error names the damaged file
        return PARTIAL, [f"the reader fails: {e}", how]

    notes = []
    labels = {d.label for items in splits.values() for d in items}
    if len(labels) != reference.classes:
        problems.append(f"{len(labels)} classes, the dataset has {reference.classes}")
    for split, items in splits.items():
        empty = sorted(labels - {d.label for d in items})
        if empty:
            problems.append(f"{split}: no image of class(es) {empty[:SHOWN]}")
        bad = find_unreadable(items)
        absent = [p for p, reason in bad if reason == "file not found"]
        broken = [f"{p} ({reason})" for p, reason in bad if reason != "file not found"]
        paths = len({d.impath for d in items})
        if absent:
            problems.append(f"{split}: {len(absent)} of {paths:,} images missing: {_shown(absent)}")
        if broken:
            problems.append(f"{split}: {len(broken)} unreadable images: {_shown(broken)}")
        published = reference.images.get(split)
        if published is not None and paths != published:
            problems.append(f"{split}: {paths:,} images, the dataset has {published:,}")
        notes.append(f"{split}: {paths - len(bad):,} of {paths:,} images readable")
    if problems:
        return PARTIAL, problems + notes + [how]
    return READY, notes + [f"{len(labels)} classes, every split's images present and readable"]
