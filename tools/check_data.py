"""Check dataset folders against the layouts the readers expect.

Usage::

    python tools/check_data.py --root DATA                     # the paper's 15 datasets
    python tools/check_data.py --root DATA Caltech101 eurosat  # reader, config or folder names
    python tools/check_data.py --root DATA folder:mydata        # your own images (Folder)
    python tools/check_data.py --plugin my_reader.py --root DATA MyReader   # a plugin's reader
    python tools/check_data.py --root DATA --verify            # every image read and counted

Prints one row per dataset: ``ready``, ``partial`` (some pieces or class folders missing),
``missing`` (nothing there) or, for a folder dataset, ``too small`` (a class has fewer training
images than ``--shots``, default 16: the run would stop), what is missing, and below the table
how to obtain each dataset that is not ready. Exits with status 1 if any requested dataset is
partial, missing or too small. A registered reader that declares no layout is reported as
``unchecked`` (its reader checks its data at start-up).

The expected layouts are the ``LAYOUT`` declarations of the readers in ``datasets/``; the readers
check the same thing at start-up. ``check_dataset(root, name)`` is the importable form.

A folder dataset (``DATASET.NAME Folder``, ``datasets/folder.py``) is named ``folder:<its folder
under DATA>``; besides its layout, its classes are read as the reader reads them (class folders
or lists, ``classnames.txt``) and what the reader would refuse is reported. Readers in a user's
own files are loaded with ``--plugin FILE.py|MODULE`` (repeatable) or ``$SAMPLE_PL_PLUGINS``.
"""

from __future__ import annotations

import argparse
import os.path as osp
import sys

if __package__ in (None, ""):  # run as a script
    import _repo  # noqa: F401


from tabulate import tabulate  # noqa: E402

from datasets import PAPER_DATASETS  # noqa: E402
from datasets.common import Layout  # noqa: E402
from datasets.folder import PREFIX as FOLDER_PREFIX  # noqa: E402
from datasets.folder import inspect_folder, shots_problem  # noqa: E402
from engine.errors import ConfigError, DataError  # noqa: E402
from engine.plugins import env_plugins, load_plugins  # noqa: E402
from experiments.layouts import find_layout  # noqa: E402
from experiments.verify_data import verify_dataset  # noqa: E402

READY, PARTIAL, MISSING = "ready", "partial", "missing"
SMALL = "too small"  # a folder dataset with a class of fewer training images than --shots
UNCHECKED = "unchecked"  # a registered reader without a declared layout (it checks at start-up)
HOW = "how to get it: "  # prefix of the details line that says how to obtain the dataset


def found_folder(layout: Layout) -> bool:
    """Whether ``layout`` is a folder dataset's (``folder:<folder>``)."""
    return layout.name.startswith(FOLDER_PREFIX)


def check_dataset(root: str, name: str, shots: int = 16) -> tuple[str, list[str]]:
    """Check one dataset's folder under ``root``.

    Args:
        root: the dataset root (DATASET.ROOT).
        name: reader, config or folder name of the dataset.
        shots: the training shots per class a run will draw; a folder dataset with a class of
            fewer training images is "too small" (the reader would stop the run).

    Returns:
        ``(status, details)``: status is "ready", "partial" or "missing" ("unchecked" for a
        reader that declares no layout); details are lines saying what is missing or worth
        knowing, and for a dataset that is partial or missing a last line starting with
        "how to get it: ".

    Raises:
        KeyError: ``name`` is not a registered dataset.
    """
    layout = find_layout(name)
    if layout is None:
        return UNCHECKED, ["declares no layout: not checked here (its reader checks at start-up)"]
    how = HOW + layout.how
    if not osp.isdir(layout.dir(root)):
        return MISSING, [f"{layout.folder}/ not found", how]
    missing = layout.missing(root)
    if not any(layout.find(root, e) for e in layout.required):
        return MISSING, [f"missing: {m}" for m in missing] + [how]
    problems = [f"missing: {m}" for m in missing] + layout.class_count_problems(root)
    notes = []
    if found_folder(layout):
        found, notes = inspect_folder(root, layout.folder)
        problems += found
    if problems:
        return PARTIAL, problems + notes + [how]
    try:
        small = shots_problem(root, layout.folder, shots) if found_folder(layout) else None
    except DataError as e:
        return PARTIAL, [str(e), *notes, how]
    if small:
        return SMALL, [small, *notes]
    if layout.split_file and not layout.has_split_file(root) and not found_folder(layout):
        notes.append(
            f"{layout.split_file} absent: a first run generates and saves a split (not the "
            "paper's; get CoOp's file for comparable numbers)"
        )
    for entry in layout.required:
        if isinstance(entry, tuple):
            found = layout.find(root, entry)
            notes.append(f"using {osp.relpath(found, osp.abspath(osp.expanduser(root)))}")
    return READY, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check dataset folders (CoOp layouts).")
    parser.add_argument("--root", required=True, help="the dataset root (DATASET.ROOT)")
    parser.add_argument(
        "names", nargs="*", help=f"datasets to check (default: all {len(PAPER_DATASETS)})"
    )
    parser.add_argument(
        "--shots",
        type=int,
        default=16,
        help="training shots per class the runs will use (default 16): a folder dataset with a "
        "class of fewer training images is reported 'too small'",
    )
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="FILE_OR_MODULE",
        help="import a module registering your own dataset reader first (a .py path or a module "
        "name; repeatable; also $SAMPLE_PL_PLUGINS)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="prove the datasets ready: read by their readers, every image of every split "
        "present and readable, class and image counts (experiments/verify_data.py)",
    )
    args = parser.parse_args(argv)
    try:
        load_plugins([*env_plugins(), *args.plugin])
    except ConfigError as e:
        parser.error(str(e))
    names = args.names or list(PAPER_DATASETS)
    try:
        layouts = {n: find_layout(n) for n in names}
    except KeyError as e:
        parser.error(str(e.args[0]))

    rows, hows = [], []
    for name, layout in layouts.items():
        if args.verify:
            status, details = verify_dataset(args.root, name)
        else:
            status, details = check_dataset(args.root, name, args.shots)
        name, folder = (layout.name, layout.folder + "/") if layout else (name, "")
        lines = [d for d in details if not d.startswith(HOW)]
        hows += [f"{name}: {d[len(HOW) :]}" for d in details if d.startswith(HOW)]
        rows.append([name, folder, status, "\n".join(lines)])
    print(f"Datasets under {osp.abspath(osp.expanduser(args.root))}:")
    print(
        tabulate(
            rows,
            headers=["dataset", "folder", "status", "details"],
            tablefmt="simple_grid",
            maxcolwidths=[None, None, None, 70],
        )
    )
    if hows:
        print("\nHow to get what is missing:")
        for line in hows:
            print(f"- {line}")
    not_ready = sum(row[2] in (MISSING, PARTIAL, SMALL) for row in rows)
    print(f"\n{sum(row[2] == READY for row in rows)} of {len(rows)} ready")
    return 1 if not_ready else 0


if __name__ == "__main__":
    sys.exit(main())
