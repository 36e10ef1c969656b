"""Dassl's ``dassl.utils.torchtools``: checkpoints and parameter helpers."""

from __future__ import annotations

import logging

from torch import nn

from engine.checkpoint import load_checkpoint, save_checkpoint

logger = logging.getLogger(__name__)

__all__ = ["count_num_param", "load_checkpoint", "load_pretrained_weights", "save_checkpoint"]


def count_num_param(model: nn.Module | None = None, params=None) -> int:
    """Dassl's ``count_num_param(model=None, params=None)``: the number of elements of every
    parameter of ``model`` (or of the iterable ``params``)."""
    if model is not None:
        return sum(p.numel() for p in model.parameters())
    if params is not None:
        return sum(p.numel() for p in params)
    raise ValueError("count_num_param: give a model or params")


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
