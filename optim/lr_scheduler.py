"""Epoch-based LR schedules with Dassl's warmup semantics, as plain state dicts.

``build_lr_scheduler(optimizer, optim_cfg)`` reproduces Dassl's LR sequence: e.g. LR 0.002,
cosine over 10 epochs, constant warmup of 1 epoch at 1e-5 (recount) gives
1e-5, 0.002, 0.001951, 0.001809, ..., 0.000191. Staged training appends its stage-2 cosine
(:func:`make_lr_fn`). ``step()`` advances the schedule's counter by one: the engine calls it at
the end of every epoch, and with ``OPTIM.LR_STEP_PER_BATCH`` also after every batch of the
sharpness-aware stage, as the released SAMPLe trainers do (the counter then runs batches + 1
per epoch and the cosine, periodic past ``MAX_EPOCH``, oscillates: Dassl's warmup wrapper and
``CosineAnnealingLR`` give the same closed form).

Dassl's warmup classes broke on current torch (a positional ``verbose``) and pickled their
successor scheduler into checkpoints. Here the LR of epoch ``e`` is a closed-form function of
``e``; the state dict is ``{"last_epoch", "base_lrs"}`` and a resumed run follows the schedule.
"""

from __future__ import annotations

import math

AVAI_SCHEDS = ("single_step", "multi_step", "cosine")


class EpochLRScheduler:
    """Sets ``param_group["lr"]`` for the current epoch; :meth:`step` moves to the next epoch.

    Args:
        optimizer: any optimizer (a sharpness-aware wrapper shares its base's param groups).
        lr_fn: ``lr_fn(base_lr, epoch) -> lr``.
    """

    def __init__(self, optimizer, lr_fn):
        self.optimizer = optimizer
        self.lr_fn = lr_fn
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = 0
        self._apply()

    def _apply(self) -> None:
        self._last_lr = [self.lr_fn(b, self.last_epoch) for b in self.base_lrs]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.last_epoch = int(state_dict["last_epoch"])
        self.base_lrs = [float(b) for b in state_dict["base_lrs"]]
        self._apply()


def _main_schedule(optim_cfg):
    max_epoch = optim_cfg.MAX_EPOCH
    name = optim_cfg.LR_SCHEDULER
    gamma = optim_cfg.GAMMA
    if name == "cosine":

        def fn(base, t):
            return base * (1 + math.cos(math.pi * t / float(max_epoch))) / 2

    elif name == "single_step":
        stepsize = optim_cfg.STEPSIZE
        stepsize = stepsize[-1] if isinstance(stepsize, (list, tuple)) else stepsize
        if not isinstance(stepsize, int):
            raise ValueError(f"OPTIM.STEPSIZE for single_step must be an int, got {stepsize!r}")
        if stepsize <= 0:
            stepsize = max_epoch

        def fn(base, t):
            return base * gamma ** (t // stepsize)

    elif name == "multi_step":
        milestones = optim_cfg.STEPSIZE
        if not isinstance(milestones, (list, tuple)) or not all(
            isinstance(m, int) for m in milestones
        ):
            raise ValueError(
                f"OPTIM.STEPSIZE for multi_step must be a list of ints, got {milestones!r}"
            )

        def fn(base, t):
            return base * gamma ** sum(1 for m in milestones if m <= t)

    else:
        raise ValueError(
            f"Unknown OPTIM.LR_SCHEDULER '{name}'; available: {', '.join(AVAI_SCHEDS)}"
        )
    return fn


def make_lr_fn(optim_cfg):
    """``lr(base_lr, epoch)``: the published schedule, then stage 2 if there is one.

    Stage 2 (``OPTIM.SAM.STAGE2_EPOCHS`` > 0, :mod:`optim.staging`): epochs ``MAX_EPOCH ..
    MAX_EPOCH + STAGE2_EPOCHS - 1`` follow a cosine from ``OPTIM.SAM.STAGE2_LR`` (0: ``OPTIM.LR``)
    to 0 over the stage-2 epochs, no warmup; a param group's LR keeps its ratio to ``OPTIM.LR``.
    """
    published = _published_schedule(optim_cfg)
    sam = optim_cfg.get("SAM")
    stage2 = int(sam.STAGE2_EPOCHS) if sam is not None and "STAGE2_EPOCHS" in sam else 0
    if stage2 <= 0:
        return published
    max_epoch = optim_cfg.MAX_EPOCH
    if sam.STAGE2_LR < 0:
        raise ValueError(f"OPTIM.SAM.STAGE2_LR must be >= 0 (0: OPTIM.LR), got {sam.STAGE2_LR}")
    ratio = (sam.STAGE2_LR or optim_cfg.LR) / optim_cfg.LR

    def fn(base, e):
        if e < max_epoch:
            return published(base, e)
        t = e - max_epoch
        return base * ratio * (1 + math.cos(math.pi * t / float(stage2))) / 2

    return fn


def _published_schedule(optim_cfg):
    """``lr(base_lr, epoch)`` for the main schedule wrapped in the configured warmup."""
    main = _main_schedule(optim_cfg)
    warmup = optim_cfg.WARMUP_EPOCH
    if warmup is None or warmup <= 0:
        return main
    wtype = optim_cfg.WARMUP_TYPE
    if wtype not in ("constant", "linear"):
        raise ValueError(f"Unknown OPTIM.WARMUP_TYPE '{wtype}'; available: constant, linear")
    cons_lr = optim_cfg.WARMUP_CONS_LR
    min_lr = optim_cfg.WARMUP_MIN_LR
    recount = optim_cfg.WARMUP_RECOUNT

    def fn(base, e):
        if e >= warmup:
            return main(base, e - warmup if recount else e)
        if wtype == "constant":
            return cons_lr
        return min_lr if e == 0 else base * e / warmup

    return fn


def build_lr_scheduler(optimizer, optim_cfg) -> EpochLRScheduler:
    """Dassl's ``build_lr_scheduler(optimizer, optim_cfg)``, stepped once per epoch."""
    if hasattr(optim_cfg, "OPTIM"):
        optim_cfg = optim_cfg.OPTIM
    return EpochLRScheduler(optimizer, make_lr_fn(optim_cfg))
