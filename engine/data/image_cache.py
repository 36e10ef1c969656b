"""Few-shot training images decoded once and kept in memory as uint8 tensors.

CoOp runs 200 epochs over a few hundred images and decodes every JPEG again each epoch. With
``DATALOADER.CACHE_DECODED`` (default on) the training images are decoded once into uint8
``[3, H, W]`` tensors (within ``DATALOADER.CACHE_DECODED_MB``); the augmentation still runs per
epoch. Training pipelines start with ``ToImage``, so a cached tensor and a freshly decoded PIL
image go through exactly the same operations: the batches are identical, only faster.

Building the cache is also where the training images are checked: every image is either
decoded or given the fast check of :mod:`.image_check`, and the unreadable ones are returned
(all of them, with reasons) instead of failing one at a time in a loader worker.

Several runs in one process (a ``tools/grid.py --in-process`` worker: seeds and optimizers of
one trainer and dataset) decode each file once: decoded images stay in a process-wide store
keyed by (path, modification time, size), the most recently used ones first, within the run's
``CACHE_DECODED_MB`` (:func:`process_store_info`, :func:`clear_process_store`). A file changed
on disk is decoded again; the tensors are never modified (the pipelines copy them).

In a packed worker whose loader workers are kept across runs (:mod:`.worker_pool`), the images
are decoded into blocks of shared memory (:data:`SLAB_BYTES` each), so the kept workers, forked
before the run, map the run's images without a copy: a run sends one handle per block. A block
is freed when none of its images is cached any more (images dropped from the store leave their
space in a block unused until then).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import torch
from PIL import Image
from torchvision.transforms.v2.functional import pil_to_tensor

from .image_check import UnreadableImagesError, describe, find_unreadable

logger = logging.getLogger(__name__)

# (path, mtime_ns, size) -> uint8 [3, H, W]: decoded images kept between the runs of a process
_STORE: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_STORE_LOCK = threading.Lock()


SLAB_BYTES = 64 * 2**20  # a block of shared memory that decoded images are placed in
_SLAB: dict = {"flat": None, "used": 0}
_SLAB_LOCK = threading.Lock()


def is_dense(tensor: torch.Tensor) -> bool:
    """Its elements fill ``numel`` consecutive places in some order (a contiguous tensor, or a
    permutation of one: ``pil_to_tensor``'s ``[3, H, W]`` view of ``[H, W, 3]`` memory)."""
    span = sum((size - 1) * step for size, step in zip(tensor.shape, tensor.stride())) + 1
    return tensor.numel() == span and all(step > 0 for step in tensor.stride())


def memory_order(x: torch.Tensor) -> tuple[int, ...]:
    """The dimensions of ``x`` from the largest stride to the smallest: the order its elements
    lie in memory (``(1, 2, 0)`` for a decoded image's ``[3, H, W]`` view of ``[H, W, 3]``)."""
    return tuple(sorted(range(x.ndim), key=lambda d: -x.stride(d)))


def laid_out(part: torch.Tensor, shape, order) -> torch.Tensor:
    """The 1-d ``part`` seen as ``shape``, its elements in memory in the dimension ``order``
    (:func:`memory_order`)."""
    back = [order.index(d) for d in range(len(order))]
    return part.view([shape[d] for d in order]).permute(back)


def place(flat: torch.Tensor, start: int, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied into ``flat[start:]`` with its own strides (a plain memory copy, and
    the pipelines see the same memory layout as the original's); a non-dense one is made
    contiguous first."""
    if not is_dense(tensor):
        tensor = tensor.contiguous()
    part = flat[start : start + tensor.numel()]
    return laid_out(part, tensor.shape, memory_order(tensor)).copy_(tensor)


SHM_RESERVE = 512 * 2**20  # shared memory left free for the loaders' batches


def shm_free() -> int:
    """Bytes free in /dev/shm, where shared memory lives (a container's may be small); a
    system without it: unlimited."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 2**62
    return st.f_bavail * st.f_frsize


def to_shared(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` (uint8) placed in the current block of shared memory (a new block
    when it is full; an image larger than a block gets one of its own); ``tensor`` itself when
    /dev/shm has no room for a new block (the run's loaders then fork their own workers)."""
    n = tensor.numel()
    with _SLAB_LOCK:
        needs_block = n > SLAB_BYTES or _SLAB["flat"] is None or _SLAB["used"] + n > SLAB_BYTES
        if needs_block and shm_free() < max(n, SLAB_BYTES) + SHM_RESERVE:
            return tensor
        if n > SLAB_BYTES:
            flat = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(n))
            start = 0
        else:
            if _SLAB["flat"] is None or _SLAB["used"] + n > SLAB_BYTES:
                storage = torch.UntypedStorage._new_shared(SLAB_BYTES)
                _SLAB["flat"], _SLAB["used"] = torch.empty(0, dtype=torch.uint8).set_(storage), 0
            flat, start = _SLAB["flat"], _SLAB["used"]
            _SLAB["used"] += n
    return place(flat, start, tensor)


def _release_slab() -> None:
    """Stop placing images in the current block (it is freed with its last image)."""
    with _SLAB_LOCK:
        _SLAB["flat"], _SLAB["used"] = None, 0


def _file_key(path: str) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (path, st.st_mtime_ns, st.st_size)


def _store_get(key: tuple | None) -> torch.Tensor | None:
    if key is None:
        return None
    with _STORE_LOCK:
        tensor = _STORE.get(key)
        if tensor is not None:
            _STORE.move_to_end(key)
        return tensor


def _store_put(key: tuple | None, tensor: torch.Tensor) -> None:
    if key is not None:
        with _STORE_LOCK:
            _STORE[key] = tensor
            _STORE.move_to_end(key)


def _store_trim(budget: int) -> None:
    """Drop the least recently used images beyond ``budget`` bytes."""
    with _STORE_LOCK:
        total = sum(t.numel() for t in _STORE.values())
        while _STORE and total > budget:
            _, tensor = _STORE.popitem(last=False)
            total -= tensor.numel()


def process_store_info() -> tuple[int, int]:
    """(images, bytes) in the process-wide store of decoded images."""
    with _STORE_LOCK:
        return len(_STORE), sum(t.numel() for t in _STORE.values())


def clear_process_store() -> None:
    with _STORE_LOCK:
        _STORE.clear()
    _release_slab()


# token -> the cache in this process: INPUT.PIPELINE tensor_device's workers send crops of cached
# images as references (engine/data/device_crop.py), which the main process cuts from its cache
_CACHES: weakref.WeakValueDictionary[str, DecodedImageCache] = weakref.WeakValueDictionary()


def cache_of(token: str) -> DecodedImageCache | None:
    """The :class:`DecodedImageCache` of ``token`` built in this process (None: none alive)."""
    return _CACHES.get(token)


class DecodedImageCache:
    """``index -> uint8 tensor`` for the first images of a data source that fit the budget.

    ``token`` names the cache across processes: a loader worker's copy (forked, or handed over
    as :class:`~engine.data.worker_pool.SharedImages`) carries the token of the cache that the
    main process built and keeps (:func:`cache_of`).
    """

    def __init__(self, images: dict[int, torch.Tensor]):
        self._images = images
        self.token = uuid.uuid4().hex
        _CACHES[self.token] = self

    def get(self, idx: int) -> torch.Tensor | None:
        return self._images.get(idx)

    def __len__(self) -> int:
        return len(self._images)

    def tensors(self) -> dict[int, torch.Tensor]:
        """``index -> uint8 [3, H, W]``, every cached image (do not modify them)."""
        return self._images

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self._images.values())

    def subset(self, keep: list[int]) -> DecodedImageCache:
        """The cache of ``[data_source[i] for i in keep]`` (indices renumbered)."""
        return DecodedImageCache(
            {new: self._images[old] for new, old in enumerate(keep) if old in self._images}
        )

    @classmethod
    def build(cls, cfg, data_source, num_threads: int = 8) -> DecodedImageCache | None:
        """Decode ``data_source`` (see :meth:`build_checked`); unreadable images raise
        :class:`~engine.data.image_check.UnreadableImagesError` listing all of them."""
        cache, bad = cls.build_checked(cfg, data_source, num_threads)
        if bad:
            raise UnreadableImagesError(bad, "training", len(data_source))
        return cache

    @classmethod
    def build_checked(
        cls, cfg, data_source, num_threads: int = 8
    ) -> tuple[DecodedImageCache | None, list[tuple[str, str]]]:
        """Check every image and decode those that fit the budget (threads; PIL releases the
        GIL while decoding).

        Returns:
            The cache (None when the budget is 0) keyed by the index in ``data_source``, and
            ``(path, reason)`` for every unreadable image (none of them is cached).
        """
        bad = find_unreadable(data_source, num_threads)  # fast; covers images beyond the budget
        budget = int(cfg.DATALOADER.CACHE_DECODED_MB) * 2**20
        if budget <= 0 or not data_source:
            return None, bad
        unreadable = {p for p, _ in bad}
        from .worker_pool import is_active

        # kept loader workers (a packed worker) read the images from shared memory
        shared = is_active() and cfg.DATALOADER.NUM_WORKERS > 0

        def size(item) -> int:  # the header only: no decoding
            if item.impath in unreadable:
                return 0
            with Image.open(item.impath) as img:
                return 3 * img.size[0] * img.size[1]

        def decode(item):
            """(tensor, reason if unreadable, whether an earlier run decoded it)"""
            key = _file_key(item.impath)
            stored = _store_get(key)
            if stored is not None:
                return stored, None, True
            try:
                with Image.open(item.impath) as img:
                    tensor = pil_to_tensor(img.convert("RGB"))  # [3, H, W] uint8
                if shared:
                    tensor = to_shared(tensor)
            except Exception as e:  # reported with the others, not raised from a thread
                return None, describe(e), False
            _store_put(key, tensor)
            return tensor, None, False

        with ThreadPoolExecutor(max_workers=num_threads) as pool:
            selected, used = [], 0
            for idx, nbytes in enumerate(pool.map(size, data_source)):
                if used + nbytes > budget:
                    break
                if data_source[idx].impath not in unreadable:
                    selected.append(idx)
                    used += nbytes
            images, reused = {}, 0
            for idx, (tensor, reason, hit) in zip(
                selected, pool.map(decode, [data_source[i] for i in selected])
            ):
                if tensor is None:
                    if data_source[idx].impath not in unreadable:
                        bad.append((data_source[idx].impath, reason))
                        unreadable.add(data_source[idx].impath)
                else:
                    images[idx] = tensor
                    reused += hit
        _store_trim(budget)
        if reused:
            logger.info("Decoded-image cache: %d images decoded by an earlier run", reused)
        if len(images) + len(bad) < len(data_source):
            logger.info(
                "Decoded-image cache: %d of %d training images fit DATALOADER.CACHE_DECODED_MB="
                "%d; the others are decoded every epoch",
                len(images),
                len(data_source),
                cfg.DATALOADER.CACHE_DECODED_MB,
            )
        else:
            logger.info(
                "Decoded-image cache: %d training images, %.1f MB", len(images), used / 2**20
            )
        return cls(images), bad
