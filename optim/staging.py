"""Staged training (``OPTIM.SAM.STAGE2_EPOCHS`` / ``START_EPOCH`` / ``FREEZE``): a hook of the step.

The paper trains MaPLe and CoPrompt with SAMPLe in two stages (appendix, "MaPLe" and
"Co-Prompt"): first the prompts and the projection layers (and CoPrompt's adapters) with the
standard optimizer until that phase converges, then the projections/adapters are frozen and only
the prompts continue with SAMPLe. Here:

- **stage 1** is the trainer's whole published schedule: ``OPTIM.MAX_EPOCH`` epochs, warmup and
  LR schedule included, with the base optimizer on every learnable parameter (a sharpness-aware
  wrapper steps its ``base_optimizer``, which shares its param groups and momentum);
- **stage 2** adds ``OPTIM.SAM.STAGE2_EPOCHS`` epochs after ``MAX_EPOCH``: the sharpness-aware
  optimizer steps, the parameters whose names match a ``FREEZE`` pattern (fnmatch, e.g.
  ``"*proj*"``) stop training, and the LR follows its own cosine from ``OPTIM.SAM.STAGE2_LR``
  (0: ``OPTIM.LR``) to 0 over the stage-2 epochs (:func:`optim.lr_scheduler.make_lr_fn`). A run
  trains ``MAX_EPOCH + STAGE2_EPOCHS`` epochs (:func:`total_epochs`).

Without stage 2, ``START_EPOCH > 0`` switches inside the published schedule (no added epochs).
Either way a configuration that would freeze parameters before they have trained one epoch at
the full LR (the switch at or before the end of the warmup) is refused. The rule is stated once
here and applied by :class:`optim.step.OptimizerStep`; trainers never see it.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Mapping

from torch import nn

from .errors import OptimConfigError

logger = logging.getLogger(__name__)


def total_epochs(optim_cfg) -> int:
    """Epochs a run trains: ``OPTIM.MAX_EPOCH`` plus ``OPTIM.SAM.STAGE2_EPOCHS`` (stage 2)."""
    return int(optim_cfg.MAX_EPOCH) + max(int(optim_cfg.SAM.STAGE2_EPOCHS), 0)


class Staging:
    """Which optimizer steps in an epoch, and which parameters freeze when the stage starts.

    Args:
        start_epoch: first epoch (0-based) of the sharpness-aware stage (``START_EPOCH``).
        freeze: parameter-name patterns frozen from the start of that stage on.
        stage2_epochs: epochs of stage 2, added after ``max_epoch`` (0: no stage 2).
        max_epoch: the published schedule's epochs (``OPTIM.MAX_EPOCH``).
        warmup_epoch: its warmup epochs (``OPTIM.WARMUP_EPOCH``; <= 0: none).
    """

    def __init__(
        self,
        start_epoch: int = 0,
        freeze=(),
        stage2_epochs: int = 0,
        max_epoch: int = 0,
        warmup_epoch: int = 0,
    ):
        if start_epoch < 0:
            raise OptimConfigError(f"OPTIM.SAM.START_EPOCH must be >= 0, got {start_epoch}")
        if stage2_epochs < 0:
            raise OptimConfigError(f"OPTIM.SAM.STAGE2_EPOCHS must be >= 0, got {stage2_epochs}")
        if stage2_epochs and start_epoch:
            raise OptimConfigError(
                f"OPTIM.SAM.START_EPOCH {start_epoch} and OPTIM.SAM.STAGE2_EPOCHS {stage2_epochs} "
                "are two ways to stage: STAGE2_EPOCHS starts the sharpness-aware stage after "
                "OPTIM.MAX_EPOCH; set OPTIM.SAM.START_EPOCH 0 with it"
            )
        self.stage2_epochs = int(stage2_epochs)
        self.start_epoch = int(max_epoch) if stage2_epochs else int(start_epoch)
        self.freeze = [freeze] if isinstance(freeze, str) else list(freeze)
        self.warmup_epoch = max(int(warmup_epoch), 0)
        self._applied = False
        self._check_freeze()

    @classmethod
    def from_cfg(cls, optim_cfg) -> Staging:
        sam = optim_cfg.SAM
        return cls(
            sam.START_EPOCH,
            sam.FREEZE,
            sam.STAGE2_EPOCHS,
            optim_cfg.MAX_EPOCH,
            optim_cfg.WARMUP_EPOCH,
        )

    def _check_freeze(self) -> None:
        """Refuse freezing parameters that have not trained one epoch at the full LR."""
        if not self.freeze or self.start_epoch > self.warmup_epoch:
            return
        where = (
            f"the sharpness-aware stage starts at epoch {self.start_epoch} (0-based, "
            f"OPTIM.SAM.START_EPOCH {self.start_epoch})"
        )
        raise OptimConfigError(
            f"OPTIM.SAM.FREEZE {self.freeze} would freeze parameters that have not trained one "
            f"epoch at the full LR: {where} and OPTIM.WARMUP_EPOCH is {self.warmup_epoch}. Train "
            "them first: OPTIM.SAM.STAGE2_EPOCHS N (stage 2 after the published schedule, with "
            "OPTIM.SAM.START_EPOCH 0), or OPTIM.SAM.START_EPOCH above OPTIM.WARMUP_EPOCH; or "
            "freeze nothing (OPTIM.SAM.FREEZE [])"
        )

    def active(self, epoch: int) -> bool:
        """Whether the sharpness-aware optimizer steps in ``epoch`` (0-based)."""
        return epoch >= self.start_epoch

    def check(self, sam_name: str, max_epoch: int) -> None:
        """Refuse a sharpness-aware stage that never starts (``max_epoch``: epochs trained)."""
        if sam_name and self.start_epoch >= max_epoch:
            raise OptimConfigError(
                f"OPTIM.SAM.NAME is {sam_name!r} but its stage never starts: "
                f"OPTIM.SAM.START_EPOCH {self.start_epoch} >= OPTIM.MAX_EPOCH {max_epoch}. "
                "Set OPTIM.SAM.START_EPOCH below MAX_EPOCH, use OPTIM.SAM.STAGE2_EPOCHS N "
                "(a stage 2 after the published schedule), or OPTIM.SAM.NAME '' for the base "
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
        stage = " (stage 2)" if self.stage2_epochs else ""
        logger.info(
            "Epoch %d: the sharpness-aware stage starts%s; frozen: %s",
            epoch + 1,
            stage,
            ", ".join(frozen),
        )
        return frozen
