"""A tiny random-weight CLIP for tests and quick runs (no downloads).

``write_tiny_clip(folder)`` writes an open_clip model config (``tiny_clip.json``) and a checkpoint
with random weights (``tiny_clip.pt``), loadable like any open_clip checkpoint through
``MODEL.BACKBONE.CONFIG`` / ``MODEL.BACKBONE.PATH``; ``TINY_OPTS`` are the KEY VALUE options that
fit a run to it. ``python tools/make_toy.py OUT`` writes one together with a generated dataset.

:func:`shrunk_config` makes a tiny model of any open_clip architecture's shape (its width
ratios, head counts, patch size, activation, MLP ratio, ResNet stages): the backbone tests run
every trainer on one per backbone family (tests/test_backbones.py).
"""

from __future__ import annotations

import copy
import json
import os
import os.path as osp

import torch

TINY_CLIP_CONFIG = {
    "embed_dim": 32,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}

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
    from .model import build_clip, save_clip_checkpoint

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


SHRINK = 16  # widths of shrunk_config: the architecture's / SHRINK
TEXT_HEAD_WIDTH = 8  # text heads of shrunk_config: its width / TEXT_HEAD_WIDTH
VISION_HEAD_WIDTH = 16  # ViT heads of shrunk_config: its width / this (or / 8)


def shrunk_config(arch: str, quick_gelu: bool | None = None) -> tuple[dict, int]:
    """A tiny open_clip model config shaped like ``arch`` (an open_clip architecture name) and the
    image size it takes.

    Widths (embedding, text, vision) are divided by :data:`SHRINK`, so their ratios stay those of
    the architecture (ViT-B: vision/text 768/512, ViT-L: 1024/768, RN50: embedding 2x text);
    layers are divided by 4 (at least 3: the tests prompt 3 blocks), ResNet stages by 3 (at
    least 1). ViT grids keep the architecture's patch size over a 2x2 grid (3x3 for the 336 px
    models, whose grid is 1.5x the 224 px one); a ResNet sees 32 px (64 px above 224 px). Every
    other key (``quick_gelu``, ``mlp_ratio``, pooling options) is kept; ``quick_gelu`` overrides
    it (OpenAI's weights use QuickGELU, which their open_clip configs do not say).
    """
    from .model import open_clip

    source = open_clip.get_model_config(arch)
    if source is None:
        raise ValueError(f"Unknown open_clip architecture {arch!r}")
    cfg = copy.deepcopy(source)
    if quick_gelu is not None:
        cfg["quick_gelu"] = quick_gelu
    cfg["embed_dim"] //= SHRINK
    text = cfg["text_cfg"]
    text["width"] //= SHRINK
    text["heads"] = text["width"] // TEXT_HEAD_WIDTH
    text["layers"] = max(3, text["layers"] // 4)
    vision = cfg["vision_cfg"]
    big = vision["image_size"] > 224
    if isinstance(vision["layers"], (list, tuple)):  # ModifiedResNet: stages of bottlenecks
        vision["layers"] = [max(1, n // 3) for n in vision["layers"]]
        vision["width"] //= SHRINK
        vision["image_size"] = 64 if big else 32
    else:
        vision["width"] //= SHRINK
        head = VISION_HEAD_WIDTH if vision["width"] % VISION_HEAD_WIDTH == 0 else 8
        vision["head_width"] = head  # ViT-bigG's 1664 / 16 = 104 wide: 13 heads of 8
        vision["layers"] = max(3, vision["layers"] // 4)
        vision["image_size"] = vision["patch_size"] * (3 if big else 2)
    return cfg, vision["image_size"]
