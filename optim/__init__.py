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
from .esam import ESAM
from .fsam import FSAM
from .looksam import LookSAM
from .lr_scheduler import build_lr_scheduler
from .mesa import MESA
from .rwp import MRWP, RWP
from .saf import SAF
from .sagm import SAGM
from .sam import SAM
from .sample import SAMPLe
from .sharpness import SharpnessAwareOptimizer

__all__ = [
    "ESAM",
    "FSAM",
    "LookSAM",
    "MESA",
    "MRWP",
    "RWP",
    "SAF",
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
