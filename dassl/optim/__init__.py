"""Dassl's ``dassl.optim``: ``build_optimizer(model, optim_cfg, param_groups=None)`` and
``build_lr_scheduler(optimizer, optim_cfg)`` over the project's optimizer registry, so a Dassl
trainer file gets every registered optimizer (``OPTIM.NAME``) and sharpness-aware wrapper
(``OPTIM.SAM.NAME``)."""

from __future__ import annotations

from optim import build_lr_scheduler
from optim import build_optimizer as _build_optimizer

__all__ = ["build_lr_scheduler", "build_optimizer"]


def build_optimizer(model, optim_cfg, param_groups=None):
    """The optimizer of ``optim_cfg`` (the ``OPTIM`` node) over ``model``'s trainable
    parameters, or over ``param_groups`` when given (Dassl's signature)."""
    return _build_optimizer(optim_cfg, param_groups if param_groups is not None else model)
