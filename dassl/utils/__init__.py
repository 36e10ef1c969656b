"""Dassl's ``dassl.utils`` names over the engine's utilities."""

from __future__ import annotations

import logging

from torch import nn

from engine.checkpoint import load_checkpoint, save_checkpoint
from engine.data import read_image
from engine.registry import Registry
from engine.utils import (
    AverageMeter,
    MetricMeter,
    check_isfile,
    collect_env_info,
    listdir_nohidden,
    mkdir_if_missing,
    read_json,
    set_random_seed,
    setup_logger,
    write_json,
)

logger = logging.getLogger(__name__)

__all__ = [
    "AverageMeter",
    "MetricMeter",
    "Registry",
    "check_isfile",
    "collect_env_info",
    "count_num_param",
    "listdir_nohidden",
    "load_checkpoint",
    "load_pretrained_weights",
    "mkdir_if_missing",
    "read_image",
    "read_json",
    "save_checkpoint",
    "set_random_seed",
    "setup_logger",
    "tolist_if_not",
    "write_json",
]


def count_num_param(model: nn.Module | None = None, params=None) -> int:
    """Dassl's ``count_num_param(model=None, params=None)``: the number of elements of every
    parameter of ``model`` (or of the iterable ``params``)."""
    if model is not None:
        return sum(p.numel() for p in model.parameters())
    if params is not None:
        return sum(p.numel() for p in params)
    raise ValueError("count_num_param: give a model or params")


def tolist_if_not(x):
    """``x`` as a list (Dassl's helper)."""
    return x if isinstance(x, list) else [x]


def load_pretrained_weights(model: nn.Module, weight_path: str) -> None:
    """Dassl's ``load_pretrained_weights``: load the tensors of the checkpoint at
    ``weight_path`` (its ``state_dict``, ``module.`` prefixes dropped) whose names and shapes
    match ``model``; the others are reported. Loaded with the engine's safe checkpoint reader."""
    checkpoint = load_checkpoint(weight_path)
    state = checkpoint.get("state_dict", checkpoint)
    state = {(k[7:] if k.startswith("module.") else k): v for k, v in state.items()}
    own = model.state_dict()
    matched = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    if not matched:
        logger.warning(
            "The pretrained weights %s cannot be loaded: no tensor matches the model's names "
            "and shapes",
            weight_path,
        )
        return
    model.load_state_dict(matched, strict=False)
    skipped = sorted(set(state) - set(matched))
    logger.info("Loaded %d tensors from %s; discarded: %s", len(matched), weight_path, skipped)
