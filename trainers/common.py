"""Helpers shared by the trainers."""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def load_init_weights(module: nn.Module, path: str) -> None:
    """Load ``MODEL.INIT_WEIGHTS`` into ``module``: tensors whose names and shapes match
    (Dassl's ``load_pretrained_weights``); the rest is reported."""
    if not path:
        return
    from engine.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(path)
    state = checkpoint.get("state_dict", checkpoint)
    state = {(k[7:] if k.startswith("module.") else k): v for k, v in state.items()}
    own = module.state_dict()
    matched = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    if not matched:
        raise ValueError(f"MODEL.INIT_WEIGHTS {path}: no tensor matches the model by name/shape")
    module.load_state_dict(matched, strict=False)
    skipped = sorted(set(own) - set(matched))
    logger.info("Initialised %d tensors from %s; not in the file: %s", len(matched), path, skipped)


def freeze_except(model: nn.Module, prefixes: tuple[str, ...]) -> list[str]:
    """Set requires_grad only on parameters whose names start with one of ``prefixes``.

    Returns the names of the trainable parameters.
    """
    trainable = []
    for name, param in model.named_parameters():
        on = name.startswith(prefixes)
        param.requires_grad_(on)
        if on:
            trainable.append(name)
    return trainable


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)
