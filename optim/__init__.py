"""Optimizers: the registry, base optimizers, sharpness-aware wrappers and LR schedulers."""

from .build import (
    OPTIMIZER_REGISTRY,
    HParam,
    OptimizerSpec,
    add_optimizer_keys,
    build_optimizer,
    get_optimizer_spec,
    list_optimizers,
    register_optimizer,
)
from .fsam import FSAM
from .lr_scheduler import build_lr_scheduler
from .sagm import SAGM
from .sam import SAM
from .sample import SAMPLe
from .sharpness import SharpnessAwareOptimizer

__all__ = [
    "FSAM",
    "SAGM",
    "SAM",
    "SAMPLe",
    "SharpnessAwareOptimizer",
    "OPTIMIZER_REGISTRY",
    "HParam",
    "add_optimizer_keys",
    "OptimizerSpec",
    "build_lr_scheduler",
    "build_optimizer",
    "get_optimizer_spec",
    "list_optimizers",
    "register_optimizer",
]
