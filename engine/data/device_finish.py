"""INPUT.PIPELINE tensor's last stage: uint8 batches made float and normalised on the device.

With ``INPUT.PIPELINE tensor`` the loader workers stop at uint8 images (``[B, 3, H, W]``: a
quarter of float32's bytes through the workers' shared memory and the host-to-device copy), and
the main process finishes every batch where the model runs: it copies it to the device
(asynchronously from pinned memory on a GPU), converts it to float in ``[0, 1]`` and normalises
it with ``INPUT.PIXEL_MEAN`` / ``INPUT.PIXEL_STD``. The arithmetic is the CPU pipeline's, element
for element (``x.float() / 255``, then ``(x - mean) / std``), so the normalised batch is the same
to the last bit as normalising each image in a worker (``tests/test_loader_pipeline.py``).

:class:`FinishingLoader` is a ``DataLoader`` that does this while it is iterated, so every
consumer of the loaders (the trainers' ``parse_batch_*``, the evaluation, the feature cache, tools)
receives float batches already on the device; ``.to(device)`` of them is free.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader


def to_float(img: torch.Tensor) -> torch.Tensor:
    """uint8 -> float32 in [0, 1], with Dassl's ``ToTensor`` arithmetic (a division by 255)."""
    return img.to(torch.float32).div(255)


class ToFloat(torch.nn.Module):
    """A transform: a uint8 image tensor to float32 in [0, 1] (:func:`to_float`)."""

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return to_float(img)


def loader_device(cfg) -> torch.device:
    """Where a run's model runs (the trainer's rule): the current GPU when one is available and
    ``USE_CUDA``, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() and cfg.USE_CUDA else "cpu")


class DeviceFinish:
    """uint8 image batches -> float32, normalised, on a device.

    Args:
        mean, std: per-channel values (``INPUT.PIXEL_MEAN`` / ``PIXEL_STD``).
        normalize: subtract ``mean`` and divide by ``std`` ("normalize" in ``INPUT.TRANSFORMS``);
            False only converts to [0, 1].
    """

    def __init__(self, mean, std, normalize: bool = True):
        self.mean = [float(v) for v in mean]
        self.std = [float(v) for v in std]
        self.normalize = normalize
        self._stats: dict = {}  # device -> (mean, std) tensors of shape [1, C, 1, 1]

    def _stats_on(self, device: torch.device):
        key = str(device)
        if key not in self._stats:
            mean = torch.tensor(self.mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
            std = torch.tensor(self.std, dtype=torch.float32, device=device).view(1, -1, 1, 1)
            self._stats[key] = (mean, std)
        return self._stats[key]

    def images(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        """One uint8 batch ``[B, C, H, W]`` (or image ``[C, H, W]``) -> float32 on ``device``."""
        x = x.to(device, non_blocking=True).to(torch.float32).div_(255)  # to_float, in place
        if not self.normalize:
            return x
        mean, std = self._stats_on(x.device)
        if x.ndim == 3:
            mean, std = mean[0], std[0]
        return x.sub_(mean).div_(std)

    def __call__(self, batch, device: torch.device):
        """Finish every uint8 image tensor of a collated batch (a dict of the dataset wrapper's
        keys; lists of views included); everything else passes through unchanged."""
        if isinstance(batch, dict):
            return {k: self._value(v, device) for k, v in batch.items()}
        return self._value(batch, device)

    def _value(self, value, device):
        if isinstance(value, torch.Tensor):
            if value.dtype == torch.uint8 and value.ndim in (3, 4):
                return self.images(value, device)
            return value
        if isinstance(value, list):
            return [self._value(v, device) for v in value]
        return value


def device_finish_of(tfm) -> DeviceFinish | None:
    """The :class:`DeviceFinish` that the batches of transform ``tfm`` (or a list of them: one per
    view key) need, or None when the transform already gives float images."""
    tfms = tfm if isinstance(tfm, (list, tuple)) else [tfm]
    finishes = [getattr(t, "device_finish", None) for t in tfms]
    if not finishes or finishes[0] is None:
        if any(f is not None for f in finishes):
            raise ValueError("The transforms of one loader mix uint8 and float outputs")
        return None
    first = finishes[0]
    for f in finishes[1:]:
        same = (f.mean, f.std, f.normalize) == (first.mean, first.std, first.normalize)
        if type(f) is not type(first) or not same:  # None included
            raise ValueError("The transforms of one loader need different device finishes")
    return first


class FinishingLoader(DataLoader):
    """A ``DataLoader`` whose batches are finished on ``device`` as they are iterated
    (:class:`DeviceFinish`); its workers, sampler, length and shutdown are DataLoader's."""

    def __init__(self, *args, finish: DeviceFinish, device: torch.device, **kwargs):
        super().__init__(*args, **kwargs)
        self.finish = finish
        self.device = device

    def __iter__(self):
        for batch in super().__iter__():
            yield self.finish(batch, self.device)
