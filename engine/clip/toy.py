"""A tiny random-weight CLIP for tests and quick runs (no downloads).

``write_tiny_clip(folder)`` writes an open_clip model config (``tiny_clip.json``) and a checkpoint
with random weights (``tiny_clip.pt``), loadable like any open_clip checkpoint through
``MODEL.BACKBONE.CONFIG`` / ``MODEL.BACKBONE.PATH``; ``TINY_OPTS`` are the KEY VALUE options that
fit a run to it. ``python tools/make_toy.py OUT`` writes one together with a generated dataset.
"""

from __future__ import annotations

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
