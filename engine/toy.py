"""Tiny CLIP checkpoints and generated datasets for tests and quick demos (no downloads).

``python -m engine.toy OUT`` writes ``OUT/tiny_clip.json`` (an open_clip model config),
``OUT/tiny_clip.pt`` (random weights, saved like any open_clip checkpoint) and a DTD-layout
dataset under ``OUT/data/dtd``.
"""

from __future__ import annotations

import argparse
import json
import os
import os.path as osp

import numpy as np
import torch
from PIL import Image

TINY_CLIP_CONFIG = {
    "embed_dim": 32,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}

DTD_CLASSES = ["banded", "blotchy", "braided", "bubbly", "bumpy", "chequered", "cobwebbed"]

TINY_OPTS = [
    "INPUT.SIZE",
    "(32, 32)",
    "DATALOADER.NUM_WORKERS",
    "0",
    "DATALOADER.TRAIN_X.BATCH_SIZE",
    "4",
    "DATALOADER.TEST.BATCH_SIZE",
    "8",
    "TRAIN.PRINT_FREQ",
    "2",
]


def write_tiny_clip(out_dir: str, config: dict | None = None, seed: int = 0) -> tuple[str, str]:
    """Write a tiny open_clip config JSON and a random-weight checkpoint; return both paths."""
    from engine.clip.model import build_clip, save_clip_checkpoint

    config = config or TINY_CLIP_CONFIG
    os.makedirs(out_dir, exist_ok=True)
    cfg_path = osp.join(out_dir, "tiny_clip.json")
    with open(cfg_path, "w") as f:
        json.dump(config, f, indent=2)
    torch.manual_seed(seed)
    model = build_clip(config)
    ckpt = osp.join(out_dir, "tiny_clip.pt")
    save_clip_checkpoint(model, ckpt)
    return cfg_path, ckpt


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output folder")
    parser.add_argument("--per-class", type=int, default=20)
    args = parser.parse_args()
    cfg_path, ckpt = write_tiny_clip(args.out)
    make_dtd(osp.join(args.out, "data"), per_class=args.per_class)
    print(f"config: {cfg_path}\nweights: {ckpt}\ndata root: {osp.join(args.out, 'data')}")


if __name__ == "__main__":
    main()
