"""Files the project writes under DATASET.ROOT: generated once, locked, never in a read-only folder.

Generated split files, few-shot caches and the ImageNet list cache live next to the dataset (as
in CoOp), so that every run of a grid uses the same file. Three rules:

* **Once**: generation holds ``fcntl.flock`` on ``<file>.lock`` and reads the file again after
  acquiring it, so when a grid starts many runs at once on a dataset without the file, one run
  generates and saves it and every other run uses the saved file.
* **Read-only dataset folders** (shared cluster storage): when the dataset folder cannot be
  written (``os.access``, or the write itself fails), the file goes to the same relative place
  in the per-user cache, ``$SAMPLE_PL_CACHE/datasets/<absolute dataset path>/...``, logged once
  per folder. Readers look in the dataset folder first, then in that cache.
* **Damaged files**: a cache of this project that cannot be read is regenerated with a warning; a
  file that may come from elsewhere (a CoOp split file) raises :class:`DataError` naming the
  file and the fix.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import os.path as osp
import pickle
from collections.abc import Callable
from typing import Any

from engine.errors import DataError
from engine.utils import file_lock, user_cache_dir

logger = logging.getLogger(__name__)

# what a damaged JSON or pickle file raises when it is read
READ_ERRORS = (
    ValueError,  # json.JSONDecodeError, UnicodeDecodeError, wrong values
    KeyError,
    TypeError,
    IndexError,
    AttributeError,
    EOFError,
    pickle.UnpicklingError,
)

_announced: set[str] = set()  # folders whose fallback was logged (once per process)


def fallback_path(path: str) -> str:
    """Where ``path`` goes when its folder cannot be written: the same absolute path under
    ``$SAMPLE_PL_CACHE/datasets/``."""
    return user_cache_dir("datasets", osp.abspath(path).lstrip(os.sep))


def candidates(path: str) -> list[str]:
    """The places ``path`` may have been saved, in reading order."""
    return [path, fallback_path(path)]


def _nearest_existing(folder: str) -> str:
    while folder and not osp.exists(folder):
        parent = osp.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return folder


def _folder_writable(path: str) -> bool:
    """``os.access`` on the nearest existing folder of ``path`` (False on a read-only mount,
    even for root; the write itself is still guarded)."""
    return os.access(_nearest_existing(osp.dirname(osp.abspath(path))), os.W_OK)


def _announce(path: str, target: str, reason: str) -> None:
    folder = _nearest_existing(osp.dirname(osp.abspath(path)))
    if folder in _announced:
        return
    _announced.add(folder)
    logger.warning(
        "Dataset folder %s cannot be written (%s): this project's split and cache files go to "
        "%s instead (set SAMPLE_PL_CACHE to move it)",
        folder,
        reason,
        osp.dirname(target),
    )


def _failed(path: str, target: str, targets: list[str], e: OSError) -> str:
    reason = e.strerror or str(e)
    if target == path:
        _announce(path, targets[-1], reason)
    return f"{target}: {reason}"


def _try_load(path: str, load: Callable[[str], Any], what: str, ours: bool):
    """``load(path)``; a damaged file of ours gives None (regenerated), of others DataError."""
    try:
        return load(path)
    except READ_ERRORS as e:
        if isinstance(e, DataError) and not ours:
            raise
        if not ours:
            raise DataError(
                f"{what} {path} cannot be read ({type(e).__name__}: {e}). Delete it to have "
                "it generated again, or download the original again (e.g. `python "
                "tools/download_data.py --root DATASET.ROOT <dataset>` for CoOp's split files)."
            ) from e
        logger.warning(
            "%s %s is damaged (%s: %s); generating it again", what, path, type(e).__name__, e
        )
        return None


def load_existing(path: str, load: Callable[[str], Any], what: str, ours: bool = True):
    """The first readable copy of ``path`` (dataset folder, then per-user cache), or None.

    ``load`` returns the value, None for an outdated file, or raises one of READ_ERRORS for a
    damaged one (see :func:`_try_load`).
    """
    for p in candidates(path):
        if osp.isfile(p):
            value = _try_load(p, load, what, ours)
            if value is not None:
                return value
    return None


def generate_once(
    path: str,
    load: Callable[[str], Any],
    generate: Callable[[], Any],
    save: Callable[[Any, str], None],
    what: str,
    ours: bool = True,
    required: bool = True,
):
    """Generate and save ``path`` under a file lock, unless another process saved it first.

    Args:
        path: where the file belongs (inside the dataset folder).
        load: reads a saved file (see :func:`load_existing`).
        generate: builds the value (e.g. scans the folders, draws the split).
        save: writes the value to a given path (atomically).
        what: the file's description for messages.
        ours: the file is this project's (a damaged one is replaced) or may come from elsewhere.
        required: without a saved file later runs would differ (a split): failing to save
            anywhere raises DataError; otherwise it is a warning.

    Returns:
        The value that is saved on disk (this process's or the one another process saved).
    """
    targets = [path, fallback_path(path)]
    if not _folder_writable(path):
        _announce(path, targets[1], "no write permission or a read-only file system")
        targets = targets[1:]
    value = None
    errors = []
    for target in targets:
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(file_lock(target + ".lock"))
            except OSError as e:
                errors.append(_failed(path, target, targets, e))
                continue
            if osp.isfile(target):  # saved by another run while this one waited
                saved = _try_load(target, load, what, ours)
                if saved is not None:
                    return saved
            if value is None:
                value = generate()
            try:
                save(value, target)
            except OSError as e:
                errors.append(_failed(path, target, targets, e))
                continue
        if target != path:
            logger.info("Saved %s to %s", what, target)
        return value
    message = (
        f"Could not save {what} anywhere ({'; '.join(errors)}). Make the dataset folder "
        "writable or set SAMPLE_PL_CACHE to a writable folder."
    )
    if required:
        raise DataError(message)
    logger.warning("%s The next run generates it again.", message)
    return value if value is not None else generate()


def load_or_generate(path, load, generate, save, what, ours=True, required=True):
    """:func:`load_existing`, else :func:`generate_once` (same arguments)."""
    value = load_existing(path, load, what, ours)
    if value is not None:
        return value
    return generate_once(path, load, generate, save, what, ours, required)


def read_json_file(path: str):
    """``json.load`` of ``path``."""
    with open(path) as f:
        return json.load(f)
