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
"""

from __future__ import annotations

import math

import torch
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as TF
from torch.utils.data import default_collate, get_worker_info

from .device_finish import DeviceFinish

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
    """A worker's output: the uint8 crop region ``[C, h, w]`` and whether to flip it."""

    __slots__ = ("img", "flip")

    def __init__(self, img: torch.Tensor, flip: bool):
        self.img, self.flip = img, flip


class CropBatch:
    """A collated batch of :class:`DeviceCrop`: the crops packed into one flat uint8 tensor (in
    shared memory when collated in a loader worker, as ``default_collate`` does: one transfer
    per batch) with their shapes, and a bool tensor ``[B]`` of the flips."""

    def __init__(self, flat: torch.Tensor, shapes: list[tuple[int, ...]], flip: torch.Tensor):
        self.flat, self.shapes, self.flip = flat, shapes, flip

    @classmethod
    def of(cls, crops: list[DeviceCrop]) -> CropBatch:
        imgs = [c.img for c in crops]
        numel = sum(x.numel() for x in imgs)
        if get_worker_info() is not None:  # a worker: straight into shared memory
            storage = imgs[0]._typed_storage()._new_shared(numel, device=imgs[0].device)
            flat = imgs[0].new(storage).resize_(numel)
        else:
            flat = imgs[0].new_empty(numel)
        batch = cls(flat, [tuple(x.shape) for x in imgs], torch.tensor([c.flip for c in crops]))
        for view, x in zip(batch.images(), imgs):
            view.copy_(x)  # the crop region, copied once (the cached image is not touched)
        return batch

    def __len__(self) -> int:
        return len(self.shapes)

    def images(self, flat: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The crops, as views of ``flat`` (default: this batch's)."""
        flat = self.flat if flat is None else flat
        sizes = [math.prod(shape) for shape in self.shapes]
        return [x.view(shape) for x, shape in zip(flat.split(sizes), self.shapes)]

    def pin_memory(self) -> CropBatch:  # DataLoader's pin_memory thread calls this
        return CropBatch(self.flat.pin_memory(), self.shapes, self.flip.pin_memory())


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
        flat = crops.flat.to(device, non_blocking=True)  # one copy per batch
        resize = TF.resize
        size, interp = self.size, self.interpolation
        out = torch.stack(
            [resize(x, size, interpolation=interp, antialias=True) for x in crops.images(flat)]
        )
        flip = crops.flip.to(out.device, non_blocking=True).view(-1, 1, 1, 1)
        return torch.where(flip, out.flip(-1), out)

    def _value(self, value, device):
        if isinstance(value, CropBatch):
            return self.images(self.resize(value, device), device)
        return super()._value(value, device)
