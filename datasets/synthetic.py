"""Generated image datasets in the layouts the real readers expect (tests, quick runs).

``make_dtd(root)`` writes ``root/dtd/images/<class>/*.jpg``: noisy images whose colour and stripe
frequency depend on the class, so a prompt learner can fit them; the DTD reader generates the
split file on first use. ``make_image_folder`` writes any ``<class>/<image>`` folder.
"""

from __future__ import annotations

import os
import os.path as osp

import numpy as np
from PIL import Image

DTD_CLASSES = ["banded", "blotchy", "braided", "bubbly", "bumpy", "chequered", "cobwebbed"]


def _class_image(rng: np.random.Generator, label: int, size: int) -> Image.Image:
    """A noisy image whose colour and stripe frequency depend on the label (learnable)."""
    hue = np.array([(label * 37) % 255, (label * 91) % 255, (label * 53) % 255], dtype=np.float32)
    yy, xx = np.mgrid[0:size, 0:size]
    stripes = np.sin(xx * (label + 1) * np.pi / size)[..., None]
    img = hue[None, None, :] * (0.6 + 0.4 * stripes) + rng.normal(0, 25, (size, size, 3))
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def make_image_folder(
    image_dir: str,
    classes: list[str],
    per_class: int = 10,
    size: int = 40,
    seed: int = 0,
    ext: str = ".jpg",
) -> None:
    """``image_dir/<class>/<class>_<i>.jpg`` with ``per_class`` images each."""
    rng = np.random.default_rng(seed)
    for label, name in enumerate(classes):
        d = osp.join(image_dir, name)
        os.makedirs(d, exist_ok=True)
        for i in range(per_class):
            _class_image(rng, label, size).save(osp.join(d, f"{name}_{i:04d}{ext}"))


def make_dtd(root: str, classes: list[str] | None = None, per_class: int = 10, seed: int = 0):
    """A DTD-layout dataset under ``root/dtd/images`` (no split file: the reader generates it)."""
    make_image_folder(osp.join(root, "dtd", "images"), classes or DTD_CLASSES, per_class, seed=seed)
    return osp.join(root, "dtd")
