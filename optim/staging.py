"""Staged training (``OPTIM.SAM.START_EPOCH`` / ``OPTIM.SAM.FREEZE``): a hook of the step.

Epochs before ``START_EPOCH`` step the base optimizer (a sharpness-aware wrapper steps its
``base_optimizer``, sharing the same param groups, momentum and LR schedule); from
``START_EPOCH`` on the sharpness-aware optimizer takes over and the parameters whose names match
a ``FREEZE`` pattern (fnmatch, e.g. ``"*proj*"``) stop training. The rule is stated once here
and applied by :class:`optim.step.OptimizerStep`; trainers never see it.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Mapping

from torch import nn

from .errors import OptimConfigError

logger = logging.getLogger(__name__)


class Staging:
    """Which optimizer steps in an epoch, and which parameters freeze when the stage starts.

    Args:
        start_epoch: first epoch (0-based) of the sharpness-aware stage.
        freeze: parameter-name patterns frozen from ``start_epoch`` on.
    """

    def __init__(self, start_epoch: int = 0, freeze=()):
        if start_epoch < 0:
            raise OptimConfigError(f"OPTIM.SAM.START_EPOCH must be >= 0, got {start_epoch}")
        self.start_epoch = int(start_epoch)
        self.freeze = [freeze] if isinstance(freeze, str) else list(freeze)
        self._applied = False

    @classmethod
    def from_cfg(cls, optim_cfg) -> Staging:
        sam = optim_cfg.SAM
        return cls(sam.START_EPOCH, sam.FREEZE)

    def active(self, epoch: int) -> bool:
        """Whether the sharpness-aware optimizer steps in ``epoch`` (0-based)."""
        return epoch >= self.start_epoch

    def check(self, sam_name: str, max_epoch: int) -> None:
        """Refuse a sharpness-aware stage that never starts."""
        if sam_name and self.start_epoch >= max_epoch:
            raise OptimConfigError(
                f"OPTIM.SAM.NAME is {sam_name!r} but its stage never starts: "
                f"OPTIM.SAM.START_EPOCH {self.start_epoch} >= OPTIM.MAX_EPOCH {max_epoch}. "
                "Set OPTIM.SAM.START_EPOCH below MAX_EPOCH (e.g. OPTIM.SAM.START_EPOCH 1 for "
                "MaPLe's 2-epoch cross-dataset config), or OPTIM.SAM.NAME '' for the base "
                "optimizer only"
            )

    def begin_epoch(self, epoch: int, modules: Mapping[str, nn.Module]) -> list[str]:
        """At the first epoch of the stage, freeze the matching parameters of ``modules``.

        Idempotent; a resumed run re-applies the freeze at its first epoch. Returns the names
        of the parameters frozen now ("<module>.<parameter>").
        """
        if self._applied or not self.freeze or not self.active(epoch):
            return []
        frozen = []
        for mname, module in modules.items():
            for pname, p in module.named_parameters():
                if any(fnmatch.fnmatch(pname, pat) for pat in self.freeze) and p.requires_grad:
                    p.requires_grad_(False)
                    p.grad = None
                    frozen.append(f"{mname}.{pname}")
        if not frozen:
            names = [n for m in modules.values() for n, _ in m.named_parameters()]
            raise OptimConfigError(
                f"OPTIM.SAM.FREEZE {self.freeze} matches no parameter; parameter names: {names}"
            )
        self._applied = True
        logger.info(
            "Epoch %d: the sharpness-aware stage starts; frozen: %s", epoch + 1, ", ".join(frozen)
        )
        return frozen
