"""How a training step is taken: one object for every optimizer and precision.

The engine computes the loss of a step and hands it, with a function that recomputes the loss at
the current parameters (forward only), to :class:`OptimizerStep`::

    step = build_step(cfg, [optimizer], precision="amp", device_type="cuda")
    ...
    step.begin_epoch(epoch, {"prompt_learner": module})   # staging (START_EPOCH / FREEZE)
    loss = loss_fn()
    stats = step(loss, loss_fn, epoch)                     # backward + update

It owns everything about the update, so trainers and the engine contain no optimizer-specific
code:

- gradients are zeroed before the backward and the loss is backpropagated (scaled under AMP);
- a one-pass optimizer (SGD, Adam, ...) steps; under AMP through the ``GradScaler`` (unscale,
  skip on inf/NaN, update the scale);
- a two-pass (sharpness-aware, ``needs_closure``) optimizer gets ``loss_fn`` as its second pass.
  Under AMP the passes share one scale: the first-pass gradients are unscaled (recording
  inf/NaN) before ``first_step``, the perturbed ones before ``second_step``; an overflow in
  either pass skips the step (parameters restored exactly) and backs the scale off;
- before its stage starts (``OPTIM.SAM.START_EPOCH``, or after ``MAX_EPOCH`` with
  ``OPTIM.SAM.STAGE2_EPOCHS``) a sharpness-aware wrapper steps its base optimizer
  (:mod:`optim.staging`), which also freezes ``OPTIM.SAM.FREEZE`` when the stage starts;
- :meth:`OptimizerStep.lr_step_per_batch` tells the engine whether the LR scheduler also steps
  after every batch (``OPTIM.LR_STEP_PER_BATCH``: the released SAMPLe trainers do so while the
  sharpness-aware optimizer steps);
- the returned dict holds the step's diagnostics (0-d tensors, no host sync).

Its ``state_dict`` (the GradScaler's) goes into checkpoints next to the optimizer's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from .build import get_optimizer_spec
from .errors import OptimConfigError
from .staging import Staging


def grads_finite(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every gradient of ``optimizer``'s parameters is finite (one host sync)."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return True
    return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())


class OptimizerStep:
    """Backward and update for a list of optimizers in a precision mode (see module docstring).

    Args:
        optimizers: the optimizers of the registered models (None entries are skipped).
        precision: "fp32", "fp16", "bf16" or "amp" (GradScaler).
        device_type: "cuda" or "cpu" (for the GradScaler).
        staging: the START_EPOCH/STAGE2_EPOCHS/FREEZE rule (default: the stage starts at
            epoch 0).
        lr_per_batch: step the LR scheduler after every batch of the sharpness-aware stage too.
    """

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer | None],
        precision: str = "fp32",
        device_type: str = "cpu",
        staging: Staging | None = None,
        lr_per_batch: bool = False,
    ):
        self.optimizers = [o for o in optimizers if o is not None]
        self.scaler = torch.amp.GradScaler(device_type) if precision == "amp" else None
        self.staging = staging or Staging()
        self.lr_per_batch = bool(lr_per_batch)
        self.two_pass = [o for o in self.optimizers if get_optimizer_spec(o).needs_closure]
        if self.two_pass and len(self.optimizers) != 1:
            raise OptimConfigError(
                "A sharpness-aware optimizer needs a single optimizer per trainer; this trainer "
                f"registers {len(self.optimizers)}"
            )

    # -- hooks --------------------------------------------------------------------------------
    def check(self, sam_name: str, max_epoch: int) -> None:
        """Refuse a configuration whose sharpness-aware stage never starts."""
        self.staging.check(sam_name if self.two_pass else "", max_epoch)

    def sharpness_active(self, epoch: int) -> bool:
        """Whether a sharpness-aware (two-pass) optimizer steps in ``epoch``."""
        return bool(self.two_pass) and self.staging.active(epoch)

    def lr_step_per_batch(self, epoch: int) -> bool:
        """Whether the LR scheduler steps after each batch of ``epoch`` (besides the epoch end):
        ``OPTIM.LR_STEP_PER_BATCH`` while the sharpness-aware optimizer steps."""
        return self.lr_per_batch and self.sharpness_active(epoch)

    def begin_epoch(self, epoch: int, modules: Mapping[str, nn.Module]) -> list[str]:
        """Apply the staging rule at the start of ``epoch``; returns newly frozen names."""
        return self.staging.begin_epoch(epoch, modules)

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def backward(self, loss: Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    # -- the step -----------------------------------------------------------------------------
    def __call__(
        self, loss: Tensor, loss_fn: Callable[[], Tensor] | None, epoch: int
    ) -> dict[str, Tensor]:
        """Backpropagate ``loss`` and update; ``loss_fn`` recomputes the loss (second pass).

        Returns the optimizer's diagnostics of this step (empty for one-pass steps).
        """
        self.zero_grad()
        self.backward(loss)
        if self.two_pass and self.staging.active(epoch):
            if loss_fn is None:
                raise RuntimeError(
                    "A sharpness-aware optimizer evaluates the loss twice per step: the trainer "
                    "must state prepare_step(batch) and compute_loss(inputs) instead of calling "
                    "model_backward_and_update(loss)"
                )
            return self._two_pass(self.two_pass[0], loss, loss_fn)
        self._one_pass()
        return {}

    def _one_pass(self) -> None:
        # before START_EPOCH a sharpness-aware wrapper steps its base optimizer
        targets = [getattr(o, "base_optimizer", o) for o in self.optimizers]
        if self.scaler is None:
            for opt in targets:
                opt.step()
            return
        for opt in targets:
            self.scaler.step(opt)  # unscales, skips the step on inf/NaN gradients
        self.scaler.update()

    def _two_pass(self, opt, loss: Tensor, loss_fn: Callable[[], Tensor]) -> dict[str, Tensor]:
        scaler = self.scaler
        if scaler is None:

            def closure():
                loss_p = loss_fn()
                loss_p.backward()
                return loss_p.detach()

            opt.step(closure, loss=loss.detach())
            return dict(getattr(opt, "last_stats", None) or {})
        # GradScaler cannot drive a closure: the passes run here with one scale for both
        scale = scaler.get_scale()
        scaler.unscale_(opt)  # first-pass gradients unscaled, inf/NaN recorded
        if not grads_finite(opt):
            opt.zero_grad(set_to_none=True)
            scaler.update()  # backs off: the first pass overflowed
            return {}
        opt.first_step(zero_grad=True)
        scaler.scale(loss_fn()).backward()
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        torch._foreach_mul_(grads, 1.0 / scale)
        if grads_finite(opt):
            opt.second_step()
            scaler.update()
        else:  # the perturbed pass overflowed: restore, skip, back off
            opt.restore()
            opt.zero_grad(set_to_none=True)
            scaler.update(scale * scaler.get_backoff_factor())
            return {}
        return dict(getattr(opt, "last_stats", None) or {})

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: Mapping) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def build_step(
    cfg, optimizers: Sequence, precision: str = "fp32", device_type: str = "cpu"
) -> OptimizerStep:
    """The step of ``cfg.OPTIM`` (full config or its OPTIM node) over ``optimizers``."""
    optim_cfg = cfg.OPTIM if hasattr(cfg, "OPTIM") else cfg
    staging = Staging.from_cfg(optim_cfg)
    per_batch = bool(optim_cfg.get("LR_STEP_PER_BATCH", False))
    if per_batch and staging.stage2_epochs:
        raise OptimConfigError(
            "OPTIM.LR_STEP_PER_BATCH (the released code's LR stepping) and OPTIM.SAM.STAGE2_EPOCHS "
            f"{staging.stage2_epochs} (a stage-2 LR schedule counted in epochs) do not combine: "
            "set one of them off (the released reproduction mode has no staging)"
        )
    return OptimizerStep(optimizers, precision, device_type, staging, per_batch)
