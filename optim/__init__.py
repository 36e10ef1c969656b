"""Optimizers: the registry, base optimizers, sharpness-aware wrappers and LR schedulers."""

from .build import (
    OPTIMIZER_REGISTRY,
    OptimizerSpec,
    build_optimizer,
    get_optimizer_spec,
    list_optimizers,
    register_optimizer,
)
from .lr_scheduler import build_lr_scheduler

__all__ = [
    "OPTIMIZER_REGISTRY",
    "OptimizerSpec",
    "build_lr_scheduler",
    "build_optimizer",
    "get_optimizer_spec",
    "list_optimizers",
    "register_optimizer",
]
