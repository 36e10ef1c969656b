"""Generated image datasets in the layouts the real readers expect (tests, quick runs).

``make_dtd(root)`` writes ``root/dtd/images/<class>/*.jpg``: noisy images whose colour and stripe
frequency depend on the class, so a prompt learner can fit them; the DTD reader generates the
split file on first use. ``make_image_folder`` writes any ``<class>/<image>`` folder;
``make_folder_dataset`` a folder dataset (``DATASET.NAME Folder``) in mixed image formats.
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


FOLDER_CLASSES = ["great white shark", "red_panda", "tabby cat", "tree frog"]
FOLDER_FORMATS = (".jpg", ".JPEG", ".png", ".bmp", ".gif", ".webp", ".tif")


def make_folder_dataset(
    root: str,
    folder: str = "mydata",
    classes: list[str] | None = None,
    per_class: int = 14,
    formats: tuple[str, ...] = FOLDER_FORMATS,
    seed: int = 0,
) -> str:
    """A folder dataset (``DATASET.NAME Folder``) under ``root/folder/images/<class>/``.

    Each class folder gets ``per_class`` images cycling through ``formats`` (mixed file
    formats and extension cases); every other image sits in a sub-folder ``more/`` of its
    class folder (nested folders). Class folder names may hold spaces and underscores.
    Returns the dataset folder.
    """
    rng = np.random.default_rng(seed)
    image_dir = osp.join(root, folder, "images")
    for label, name in enumerate(classes or FOLDER_CLASSES):
        for i in range(per_class):
            sub = osp.join(image_dir, name, "more" if i % 2 else "")
            os.makedirs(sub, exist_ok=True)
            image = _class_image(rng, label, 40)
            image.save(osp.join(sub, f"img_{i:04d}{formats[i % len(formats)]}"))
    return osp.join(root, folder)
