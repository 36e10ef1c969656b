"""Few-shot training images decoded once and kept in memory as uint8 tensors.

CoOp runs 200 epochs over a few hundred images and decodes every JPEG again each epoch. With
``DATALOADER.CACHE_DECODED`` (default on) the training images are decoded once into uint8
``[3, H, W]`` tensors (within ``DATALOADER.CACHE_DECODED_MB``); the augmentation still runs per
epoch. Training pipelines start with ``ToImage``, so a cached tensor and a freshly decoded PIL
image go through exactly the same operations: the batches are identical, only faster.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch
from PIL import Image
from torchvision.transforms.v2.functional import pil_to_tensor

logger = logging.getLogger(__name__)


class DecodedImageCache:
    """``index -> uint8 tensor`` for the first images of a data source that fit the budget."""

    def __init__(self, images: dict[int, torch.Tensor]):
        self._images = images

    def get(self, idx: int) -> torch.Tensor | None:
        return self._images.get(idx)

    def __len__(self) -> int:
        return len(self._images)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self._images.values())

    @classmethod
    def build(cls, cfg, data_source, num_threads: int = 8) -> DecodedImageCache | None:
        """Decode ``data_source`` (threads; PIL releases the GIL while decoding)."""
        from .manager import read_image

        budget = int(cfg.DATALOADER.CACHE_DECODED_MB) * 2**20
        if budget <= 0 or not data_source:
            return None

        def size(item) -> int:  # the header only: no decoding
            with Image.open(item.impath) as img:
                return 3 * img.size[0] * img.size[1]

        def decode(item):
            return pil_to_tensor(read_image(item.impath))  # [3, H, W] uint8

        with ThreadPoolExecutor(max_workers=num_threads) as pool:
            selected, used = [], 0
            for idx, nbytes in enumerate(pool.map(size, data_source)):
                if used + nbytes > budget:
                    break
                selected.append(idx)
                used += nbytes
            tensors = pool.map(decode, [data_source[i] for i in selected])
            images = dict(zip(selected, tensors))
        if len(images) < len(data_source):
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
        return cls(images)
