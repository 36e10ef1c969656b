"""Checkpoints in Dassl's layout, holding plain state dicts only.

``OUTPUT_DIR/<model name>/model.pth.tar-<epoch>`` (and ``model-best.pth.tar``) plus a text file
``OUTPUT_DIR/<model name>/checkpoint`` naming the newest file. Each file is
``{"state_dict", "epoch", "optimizer", "scheduler", "val_result", ...}`` where every value is a
tensor, number, string or container of those, so it loads with ``torch.load(weights_only=True)``.
Writes go to a temporary file that is renamed into place.
"""

from __future__ import annotations

import logging
import os.path as osp

import torch

from .utils import atomic_torch_save, atomic_write_text

logger = logging.getLogger(__name__)


def save_checkpoint(state: dict, save_dir: str, is_best: bool = False, fname: str = "") -> str:
    """Save ``state`` as ``model.pth.tar-<epoch>`` (or ``model-best.pth.tar``, or ``fname``).

    Returns the path written in ``save_dir``. The ``checkpoint`` pointer file is updated after
    the checkpoint itself is complete, so a crash never leaves a pointer to a partial file.
    """
    state = dict(state)
    state["state_dict"] = {
        (k[7:] if k.startswith("module.") else k): v for k, v in state["state_dict"].items()
    }
    if not fname:
        fname = "model-best.pth.tar" if is_best else f"model.pth.tar-{state['epoch']}"
    fpath = osp.join(save_dir, fname)
    atomic_torch_save(state, fpath)
    if not is_best:
        atomic_write_text(osp.join(osp.dirname(fpath), "checkpoint"), fname + "\n")
    logger.info("Checkpoint saved to %s", fpath)
    return fpath


def load_checkpoint(fpath: str, map_location="cpu") -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` (``weights_only=True``)."""
    if not osp.exists(fpath):
        raise FileNotFoundError(f"Checkpoint not found: {fpath}")
    try:
        return torch.load(fpath, map_location=map_location, weights_only=True)
    except Exception as e:
        raise RuntimeError(
            f"Cannot load checkpoint {fpath} with weights_only=True ({e}). Checkpoints of this "
            "project hold plain state dicts only; files from other code bases may pickle objects."
        ) from e


def latest_checkpoint(model_dir: str) -> str | None:
    """The file named in ``model_dir/checkpoint``, or None."""
    pointer = osp.join(model_dir, "checkpoint")
    if not osp.isfile(pointer):
        return None
    with open(pointer) as f:
        name = f.readline().strip()
    path = osp.join(model_dir, name)
    return path if osp.isfile(path) else None
