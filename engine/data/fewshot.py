"""Few-shot training sets: CoOp's draws, this project's keyed caches, CoOp's ``.pkl`` caches.

CoOp draws ``random.sample(items, k)`` per label (first-appearance order) with Python's
``random`` seeded by the run seed, train first and then val with ``min(k, 4)`` shots, and caches
the result in ``split_fewshot/shot_{k}-seed_{seed}.pkl``. That cache is keyed by shots and seed
only, so a changed split file silently reuses a stale draw.

This project draws the same samples (a ``random.Random(seed)``), and writes its own cache as JSON
keyed by a hash of the source lists (``shot_{k}-seed_{seed}-{hash}.json``): a different split
file, shot count or seed never reuses a wrong cache. Existing CoOp pickles are read too (their
``dassl.data.datasets.base_dataset.Datum`` objects are mapped to this project's Datum without
importing Dassl) after checking that every sample belongs to the current split; they are never
written (CoOp's code reads them). The project's cache is generated once under a file lock (runs
started together use the same file), goes to the per-user cache when the dataset folder is
read-only, and a damaged one is drawn again with a warning (see :mod:`.cache_files`).
"""

from __future__ import annotations

import hashlib
import logging
import os.path as osp
import pickle
import random

from engine.utils import read_json, write_json

from .base import DatasetBase, Datum
from .cache_files import READ_ERRORS, generate_once, load_existing

logger = logging.getLogger(__name__)


def _relpath(path: str, root: str) -> str:
    """``path`` relative to ``root`` when it lies under it (so caches survive a moved root)."""
    prefix = root.rstrip("/\\") + osp.sep
    return path[len(prefix) :] if path.startswith(prefix) else path


def _abspath(path: str, root: str) -> str:
    return path if osp.isabs(path) else osp.join(root, path)


def _source_key(train, val, num_shots: int, seed: int, root: str) -> str:
    h = hashlib.sha1(f"k={num_shots};s={seed};".encode())
    for name, items in (("train", train), ("val", val)):
        h.update(name.encode())
        for item in items:
            h.update(f"{_relpath(item.impath, root)}\t{item.label}\t{item.classname}\n".encode())
    return h.hexdigest()[:12]


class _DatumUnpickler(pickle.Unpickler):
    """Unpickles CoOp caches: Dassl's Datum -> this project's Datum; nothing else foreign."""

    _SAFE = {
        ("builtins", "dict"),
        ("builtins", "list"),
        ("builtins", "tuple"),
        ("builtins", "object"),
        ("builtins", "set"),
        ("collections", "OrderedDict"),
        ("collections", "defaultdict"),
        ("copyreg", "_reconstructor"),
    }

    def find_class(self, module: str, name: str):
        if name == "Datum" and (module.startswith("dassl.") or module == __name__):
            return Datum
        if (module, name) in self._SAFE:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a few-shot cache")


def load_datum_pickle(path: str):
    """Unpickle a file that may hold only plain containers, numbers, strings and Datum objects
    (Dassl's ``Datum`` is mapped to this project's); anything else raises UnpicklingError."""
    with open(path, "rb") as f:
        return _DatumUnpickler(f).load()


def load_coop_fewshot_pickle(path: str) -> dict:
    """Load a CoOp ``shot_{k}-seed_{s}.pkl`` (``{"train": [Datum], "val": [Datum]}``)."""
    data = load_datum_pickle(path)
    if not isinstance(data, dict) or "train" not in data:
        raise pickle.UnpicklingError(f"{path} does not hold a CoOp few-shot dict")
    return data


def _match_to_split(items, known: dict[str, Datum]) -> list[Datum] | None:
    """Map pickled items (absolute paths from another machine) onto the current split's items
    by the longest path suffix; None if any item is not in the split or its label differs."""
    out = []
    for item in items:
        parts = item.impath.replace("\\", "/").split("/")
        match = None
        for i in range(len(parts)):
            cand = "/".join(parts[i:])
            if cand in known:
                match = known[cand]
                break
        if match is None or match.label != item.label:
            return None
        out.append(match)
    return out


def load_or_create_fewshot(
    dataset: DatasetBase,
    train: list[Datum],
    val: list[Datum],
    num_shots: int,
    seed: int,
    root: str | None = None,
) -> tuple[list[Datum], list[Datum]]:
    """The few-shot train and val lists for ``num_shots`` and ``seed``, cached on disk.

    Args:
        dataset: the reader (for its sampling helper).
        train, val: the full splits (all classes; subsampling comes after).
        num_shots: shots per class; val gets ``min(num_shots, 4)``.
        seed: the run seed; a negative seed draws at random and does not cache.
        root: the dataset folder; caches go to ``root/split_fewshot`` (or, when it is
            read-only, to the same place under ``$SAMPLE_PL_CACHE/datasets/``).
    """
    if num_shots < 1:
        return train, val
    root = root or dataset.dataset_dir
    if seed < 0:
        logger.warning("SEED < 0: drawing a random %d-shot set that is not cached", num_shots)
        rng = random.Random()
        return _draw(dataset, train, val, num_shots, rng)

    cache_dir = osp.join(root, "split_fewshot")
    key = _source_key(train, val, num_shots, seed, root)
    own = osp.join(cache_dir, f"shot_{num_shots}-seed_{seed}-{key}.json")

    def load(path):
        data = read_json(path)

        def _convert(items):
            return [Datum(_abspath(p, root), int(y), 0, c) for p, y, c in items]

        logger.info("Loading few-shot cache %s", path)
        return _convert(data["train"]), _convert(data["val"])

    cached = load_existing(own, load, "Few-shot cache", ours=True)
    if cached is not None:
        return cached
    coop = _coop_cache(osp.join(cache_dir, f"shot_{num_shots}-seed_{seed}.pkl"), train, val, root)
    if coop is not None:
        return coop

    def generate():
        return _draw(dataset, train, val, num_shots, random.Random(seed))

    def save(value, path):
        def _extract(items):
            return [(_relpath(d.impath, root), d.label, d.classname) for d in items]

        write_json({"train": _extract(value[0]), "val": _extract(value[1])}, path)
        logger.info("Saved few-shot cache to %s", path)

    # a cache that cannot be saved costs nothing but time: the draw is seeded
    return generate_once(own, load, generate, save, "Few-shot cache", required=False)


def _coop_cache(path: str, train, val, root: str):
    """The draw of CoOp's ``shot_{k}-seed_{s}.pkl`` (read, never written) if it fits the split."""
    if not osp.isfile(path):
        return None
    try:
        data = load_coop_fewshot_pickle(path)
    except READ_ERRORS as e:
        logger.warning("Ignoring unreadable CoOp few-shot cache %s (%s)", path, e)
        return None
    known = {_relpath(d.impath, root).replace("\\", "/"): d for d in train + val}
    tr = _match_to_split(data["train"], known)
    va = _match_to_split(data.get("val", []), known)
    if tr is not None and va is not None:
        logger.info("Loading CoOp few-shot cache %s", path)
        return tr, va
    logger.warning(
        "CoOp few-shot cache %s holds images that are not in the current split; "
        "drawing a new few-shot set instead",
        path,
    )
    return None


def _draw(dataset, train, val, num_shots, rng):
    few_train = dataset.generate_fewshot_dataset(train, num_shots=num_shots, rng=rng)
    few_val = dataset.generate_fewshot_dataset(val, num_shots=min(num_shots, 4), rng=rng)
    return few_train, few_val


def fewshot_and_subsample(dataset: DatasetBase, cfg, train, val, test, root: str | None = None):
    """CoOp's common tail of a reader: few-shot train/val (cached), then base/new subsampling.

    Returns ``(train, val, test)``.
    """
    from .base import subsample_classes

    num_shots = cfg.DATASET.NUM_SHOTS
    if num_shots >= 1:
        train, val = load_or_create_fewshot(dataset, train, val, num_shots, cfg.SEED, root)
    subsample = cfg.DATASET.SUBSAMPLE_CLASSES
    return subsample_classes(train, val, test, subsample=subsample)
