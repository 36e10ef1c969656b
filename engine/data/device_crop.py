"""INPUT.PIPELINE tensor_device: the random resized crop's resize and the flip on the device.

The ``tensor`` pipeline's worker spends most of its time resizing each random resized crop to
``INPUT.SIZE`` (bicubic, antialiased). With ``tensor_device`` the worker only draws the crop box
and the flip, with the same random numbers in the same order as ``tensor`` (so a seed gives the
same crops and flips), and sends the uint8 crop region with its flip flag
(:class:`DeviceCrop`). The loader collates a batch of these variable-size crops into a
:class:`CropBatch` (packed end to end in one flat tensor with their shapes, no padding) and
finishes it on the device (:class:`DeviceCropFinish`): one copy of the batch, each crop resized
to ``INPUT.SIZE`` with torchvision's resize (the interpolation of ``INPUT.INTERPOLATION``,
antialiased, uint8 in and out: the ``tensor`` pipeline's call on the same crop), the batch
stacked, the flagged images flipped, then the float conversion and normalisation of
:class:`~engine.data.device_finish.DeviceFinish`.

On a CPU device the batches are the ``tensor`` pipeline's bit for bit (the same kernel on the
same uint8 crop); on a GPU torchvision's uint8 resize computes in float and rounds, which can
differ from the CPU kernel by a grey level (not measured here: no GPU). Only the training
transforms ``random_resized_crop`` (required), ``random_flip`` and ``normalize`` qualify
(:func:`check_device_crop_choices`); the test transforms are the ``tensor`` pipeline's.

A crop of an image in the decoded-image cache (``DATALOADER.CACHE_DECODED``, the default) is
not copied by the worker at all: it sends a reference (the cache's token, the image's index and
the box; :func:`refer_cached`), and the main process, which built the cache and holds the same
images, cuts the crop from it (:meth:`CropBatch.images`). On a CPU device the resize reads the
crop in place; for a GPU the crops are gathered into one buffer, which ``DataLoader``'s
pin-memory step does in pinned memory (:meth:`CropBatch.pin_memory`), then copied once. A
worker's batch is then a few hundred bytes instead of every crop's pixels in fresh shared
memory, whose pages the worker would fault in and fill, batch after batch. Images beyond the
cache's budget are decoded by the worker and their crops sent as pixels, as before.
"""

from __future__ import annotations

import math

import torch
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as TF
from torch.utils.data import default_collate, get_worker_info

from .device_finish import DeviceFinish
from .image_cache import cache_of, laid_out, memory_order

# the training transforms that INPUT.PIPELINE tensor_device takes (random_resized_crop required)
DEVICE_CROP_TRANSFORMS = ("random_resized_crop", "random_flip", "normalize")


def device_crop_problem(choices) -> str | None:
    """Why ``INPUT.TRANSFORMS`` ``choices`` cannot run with ``INPUT.PIPELINE tensor_device``
    (None: they can)."""
    choices = list(choices)
    other = [c for c in choices if c not in DEVICE_CROP_TRANSFORMS]
    if "random_resized_crop" not in choices or other:
        what = f"has {other}" if other else "has no random_resized_crop"
        return (
            f"INPUT.PIPELINE tensor_device resizes the random resized crop on the device and "
            f"takes only the training transforms {list(DEVICE_CROP_TRANSFORMS)} "
            f"(random_resized_crop required); INPUT.TRANSFORMS {choices} {what}: use "
            "INPUT.PIPELINE tensor for these transforms"
        )
    return None


def check_device_crop_choices(choices) -> None:
    """Raise ValueError when ``choices`` cannot run with ``INPUT.PIPELINE tensor_device``."""
    problem = device_crop_problem(choices)
    if problem:
        raise ValueError(problem)


class DeviceCrop:
    """A worker's output: the uint8 crop region ``[C, h, w]`` and whether to flip it; or, for a
    crop of a cached image, no pixels but ``source`` ``(token, index, top, left)`` of the crop
    in the decoded-image cache of ``token`` and its ``shape`` (:func:`refer_cached`)."""

    __slots__ = ("img", "flip", "source", "shape")

    def __init__(self, img: torch.Tensor | None, flip: bool, source=None, shape=None):
        self.img, self.flip, self.source = img, flip, source
        self.shape = tuple(img.shape) if shape is None else tuple(shape)


def _referred(crop: DeviceCrop, img0: torch.Tensor, token: str, idx: int) -> DeviceCrop:
    """``crop`` as a reference into the cached image ``img0`` when its region is a view of it
    (the random resized crop's slice), else ``crop`` itself."""
    img = crop.img
    if (
        img is None
        or img.untyped_storage().data_ptr() != img0.untyped_storage().data_ptr()
        or img.ndim != 3
        or img0.ndim != 3
        or img.stride() != img0.stride()
        or img.shape[0] != img0.shape[0]
    ):
        return crop
    top, rest = divmod(img.storage_offset() - img0.storage_offset(), img0.stride(1))
    left = rest // img0.stride(2)
    h, w = img.shape[1:]
    inside = 0 <= top <= img0.shape[1] - h and 0 <= left <= img0.shape[2] - w
    region = img0[:, top : top + h, left : left + w] if inside else None
    if region is None or region.storage_offset() != img.storage_offset():
        return crop
    return DeviceCrop(None, crop.flip, (token, idx, top, left), img.shape)


def refer_cached(output: dict, img0: torch.Tensor, images, idx: int) -> None:
    """Replace the :class:`DeviceCrop` values of a dataset item (``output``; lists of views
    included) that are regions of ``img0``, the cached image ``idx`` of ``images`` (a
    :class:`~engine.data.image_cache.DecodedImageCache` or a worker's copy of it), by
    references that the main process resolves in its own cache (no pixels sent)."""
    token = getattr(images, "token", None)
    if token is None:
        return
    for key, value in output.items():
        if isinstance(value, DeviceCrop):
            output[key] = _referred(value, img0, token, idx)
        elif isinstance(value, list) and value and isinstance(value[0], DeviceCrop):
            output[key] = [_referred(v, img0, token, idx) for v in value]


def _resolve(source) -> torch.Tensor:
    """The crop that a reference ``(token, index, top, left)`` + shape names: a view of the
    cached image (no copy)."""
    (token, idx, top, left), (_, h, w) = source
    cache = cache_of(token)
    img = cache.get(idx) if cache is not None else None
    if img is None:
        raise RuntimeError(
            f"A loader worker sent a crop of image {idx} of a decoded-image cache that this "
            "process does not hold (INPUT.PIPELINE tensor_device): the batches of a loader "
            "must be finished in the process that built its cache"
        )
    return img[:, top : top + h, left : left + w]


class CropBatch:
    """A collated batch of :class:`DeviceCrop`: the crops sent as pixels packed into one flat
    uint8 tensor (in shared memory when collated in a loader worker, as ``default_collate``
    does: one transfer per batch), the references to cached images (``sources``: None for a
    crop in ``flat``), every crop's shape, and a bool tensor ``[B]`` of the flips.

    A crop in ``flat`` keeps its source's memory order (``orders``; a decoded image is
    ``[H, W, 3]`` in memory): copying it is a copy of whole rows, not a transposition, and the
    resize reads it in the layout that the ``tensor`` pipeline's resize reads."""

    def __init__(
        self,
        flat: torch.Tensor,
        shapes: list[tuple[int, ...]],
        flip: torch.Tensor,
        sources: list | None = None,
        orders: list | None = None,
    ):
        self.flat, self.shapes, self.flip = flat, shapes, flip
        self.sources = sources if sources is not None else [None] * len(shapes)
        self.orders = orders if orders is not None else [None] * len(shapes)  # None: as shaped

    @classmethod
    def of(cls, crops: list[DeviceCrop]) -> CropBatch:
        imgs = [c.img for c in crops if c.source is None]
        numel = sum(x.numel() for x in imgs)
        if numel and get_worker_info() is not None:  # a worker: straight into shared memory
            storage = imgs[0]._typed_storage()._new_shared(numel, device=imgs[0].device)
            flat = imgs[0].new(storage).resize_(numel)
        else:
            flat = torch.empty(numel, dtype=torch.uint8)
        batch = cls(
            flat,
            [c.shape for c in crops],
            torch.tensor([c.flip for c in crops]),
            [c.source for c in crops],
            [memory_order(c.img) if c.source is None else None for c in crops],
        )
        for view, x in zip(batch._flat_views(flat), imgs):
            view.copy_(x)  # the crop region, copied once (the cached image is not touched)
        return batch

    def __len__(self) -> int:
        return len(self.shapes)

    def _flat_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        kept = [(s, o) for s, o, src in zip(self.shapes, self.orders, self.sources) if src is None]
        parts = flat.split([math.prod(shape) for shape, _ in kept])
        views = []
        for part, (shape, order) in zip(parts, kept):
            views.append(part.view(shape) if order is None else laid_out(part, shape, order))
        return views

    def images(self, flat: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The crops: views of ``flat`` (default: this batch's) and of the cached images."""
        views = iter(self._flat_views(self.flat if flat is None else flat))
        return [
            next(views) if src is None else _resolve((src, shape))
            for src, shape in zip(self.sources, self.shapes)
        ]

    def gathered(self, pin: bool = False) -> CropBatch:
        """This batch with every crop's pixels in one flat tensor (pinned memory if ``pin``):
        the referenced crops cut from the cache, the others copied from ``flat``."""
        if not pin and all(src is None for src in self.sources):
            return self
        images = self.images()
        flat = torch.empty(sum(x.numel() for x in images), dtype=torch.uint8, pin_memory=pin)
        flip = self.flip.pin_memory() if pin else self.flip
        batch = CropBatch(flat, self.shapes, flip, orders=[memory_order(x) for x in images])
        for view, x in zip(batch.images(), images):
            view.copy_(x)
        return batch

    def pin_memory(self) -> CropBatch:  # DataLoader's pin_memory step calls this
        return self.gathered(pin=True)


def _collate(values: list):
    first = values[0]
    if isinstance(first, DeviceCrop):
        return CropBatch.of(values)
    if isinstance(first, dict):
        return {k: _collate([v[k] for v in values]) for k in first}
    if isinstance(first, list) and first and isinstance(first[0], (DeviceCrop, dict, list)):
        return [_collate([v[i] for v in values]) for i in range(len(first))]  # views
    return default_collate(values)


def collate_crops(batch: list):
    """``default_collate``, with the :class:`DeviceCrop` values made :class:`CropBatch`."""
    return _collate(batch)


class RandomCropBox(T.RandomResizedCrop):
    """``RandomResizedCrop``'s draw of the box (the same random numbers), cropped, not resized."""

    def transform(self, inpt, params):
        return TF.crop(inpt, **params)


class FlipFlag(torch.nn.Module):
    """``RandomHorizontalFlip``'s draw (``torch.rand(1) < p``) as a flag: the image and the flag
    as a :class:`DeviceCrop`; ``p=None`` (no random_flip): never flipped, nothing drawn."""

    def __init__(self, p: float | None = 0.5):
        super().__init__()
        self.p = p

    def forward(self, img: torch.Tensor) -> DeviceCrop:
        flip = self.p is not None and bool(torch.rand(1) < self.p)
        return DeviceCrop(img.as_subclass(torch.Tensor), flip)


class DeviceCropFinish(DeviceFinish):
    """:class:`DeviceFinish` that also resizes and flips :class:`CropBatch` values on the device.

    Args:
        mean, std, normalize: :class:`DeviceFinish`'s.
        size: ``(height, width)`` (``INPUT.SIZE``).
        interpolation: a torchvision ``InterpolationMode`` (antialiased, as ``tensor``'s crop).
    """

    collate = staticmethod(collate_crops)  # the loader's collate_fn

    def __init__(self, mean, std, normalize: bool, size, interpolation):
        super().__init__(mean, std, normalize)
        self.size = [int(v) for v in size]
        self.interpolation = interpolation

    def resize(self, crops: CropBatch, device: torch.device) -> torch.Tensor:
        """The crops resized to ``size`` and flipped where flagged: uint8 ``[B, C, H, W]``."""
        if device.type == "cpu":
            images = crops.images()  # in place: cached crops are read where they are
        else:
            crops = crops.gathered()  # already, when the loader pinned the batch
            images = crops.images(crops.flat.to(device, non_blocking=True))  # one copy
        resize = TF.resize
        size, interp = self.size, self.interpolation
        out = torch.stack([resize(x, size, interpolation=interp, antialias=True) for x in images])
        flip = crops.flip.to(out.device, non_blocking=True).view(-1, 1, 1, 1)
        return torch.where(flip, out.flip(-1), out)

    def _value(self, value, device):
        if isinstance(value, CropBatch):
            return self.images(self.resize(value, device), device)
        return super()._value(value, device)
