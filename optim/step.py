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
- a sharpness-aware optimizer is asked, through its hooks (:mod:`optim.sharpness`), what this
  step takes: :meth:`begin_step` lets it act before the first forward (RWP perturbs the
  weights, MESA runs its EMA model), a term it returns is added to the loss before the backward
  (SAF/MESA's trajectory loss), and ``second_pass_due()`` says whether the second pass runs
  (LookSAM and SAMPLe with ``OPTIM.SAM.EVERY k``: every k steps; RWP, SAF, MESA: never);
  without it the optimizer's ``single_step`` updates from the one gradient. The engine hands
  the batch as a :class:`StepBatch` (the loss on all or part of the batch, the pass's logits
  and per-sample losses, the items' dataset indices), so no trainer knows any optimizer;
- a two-pass (sharpness-aware, ``needs_closure``) optimizer gets ``loss_fn`` (or its
  ``second_pass_loss``: ESAM's pass on the selected items) as its second pass.
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
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .build import get_optimizer_spec
from .errors import OptimConfigError, StepContractError
from .sharpness import BEGIN_STEP, INDEX, LOSS_FN, OUTPUTS, REPASS, STEP_NEEDS
from .staging import Staging


class PassOutputs(NamedTuple):
    """What a trainer's loss records of one pass (``TrainerX.classification_loss``).

    Attributes:
        logits: ``[batch, n_cls]`` (with the pass's graph when it ran with gradients).
        label: ``[batch]`` class indices.
        ce: the mean cross-entropy the trainer's loss contains (the tensor it added), or None.
        label_smoothing: the label smoothing of that cross-entropy (per-item losses use it too).
    """

    logits: Tensor
    label: Tensor
    ce: Tensor | None = None
    label_smoothing: float = 0.0

    def sample_loss(self, graph: bool = False) -> Tensor:
        """Per-item cross-entropy ``[batch]`` (fp32 at least; with the pass's graph if asked)."""
        logits = self.logits if graph else self.logits.detach()
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(
            logits, self.label, reduction="none", label_smoothing=self.label_smoothing
        )


NO_OUTPUTS = (
    "needs the trainer's logits, and this trainer's compute_loss does not record them: compute "
    "its cross-entropy with self.classification_loss(logits, label) (engine.trainer.TrainerX)"
)


class StepBatch:
    """The engine's side of a step: what an optimizer may ask of the current batch.

    Args:
        forward: ``forward(subset)`` computes the trainer's loss at the current parameters
            (autocast as in training; with gradients unless called under ``torch.no_grad()``)
            on the whole batch (``subset`` None) or on the items of the 1-D index tensor
            ``subset``; returns ``(loss, outputs)``, ``outputs`` a :class:`PassOutputs` or None
            when the trainer records none.
        index: the items' dataset indices ``[batch]`` (long), or None.

    Attributes:
        first: the outputs of the step's first pass (set by the engine), or None.
        count: the items of this process that the pass being synchronised ran on (data-parallel
            runs: the weight of its gradients, :mod:`optim.distributed`); None: the batch's.
        sync: the data-parallel gradient sync (:class:`optim.distributed.GradientSync`), None
            in a one-process run (set by :meth:`OptimizerStep.begin_step`).
    """

    def __init__(
        self,
        forward: Callable[[Tensor | None], tuple[Tensor, PassOutputs | None]],
        index: Tensor | None = None,
    ):
        self.forward = forward
        self.index = index
        self.first: PassOutputs | None = None
        self.count: int | None = None  # data-parallel (#29)
        self.sync = None  # data-parallel (#29)

    def loss(self, subset: Tensor | None = None) -> Tensor:
        """The loss on the batch (or on ``subset``), with gradients."""
        return self.forward(subset)[0]

    def outputs(self, subset: Tensor | None = None, who: str = "this optimizer") -> PassOutputs:
        """Logits and labels at the current parameters, without gradients."""
        with torch.no_grad():
            out = self.forward(subset)[1]
        if out is None:
            raise OptimConfigError(f"{who} {NO_OUTPUTS}")
        return out

    def first_outputs(self, who: str = "this optimizer") -> PassOutputs:
        """The first pass's outputs (an error naming the fix when the trainer records none)."""
        if self.first is None:
            raise OptimConfigError(f"{who} {NO_OUTPUTS}")
        return self.first

    def require_index(self, who: str) -> Tensor:
        """The items' dataset indices (an error naming the fix when the loader gives none)."""
        if self.index is None:
            raise OptimConfigError(
                f"{who} keys its records by the items' dataset indices: the training batches "
                "must hold an 'index' entry (the engine's data loader gives one)"
            )
        return self.index


def require_batch(batch: StepBatch | None, who: str) -> StepBatch:
    """``batch``, or an error: ``who`` needs the step's batch (the engine always passes it)."""
    if batch is None:
        raise OptimConfigError(
            f"{who} needs the step's batch (optim.step.StepBatch): call the step as "
            "step(loss, loss_fn, epoch, batch=...) as engine.trainer.TrainerX does"
        )
    return batch


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
        self.sharp = [o for o in self.optimizers if get_optimizer_spec(o).kind == "sharpness"]
        self._open: StepBatch | None = None  # the batch begin_step opened, until the step
        self._open_epoch: int | None = None
        self.grad_sync = None  # data-parallel (#29): optim.distributed.GradientSync, set by engine
        self.projection = None  # ProGrad's gradient rule (optim.prograd), set by its trainer
        self.two_pass = [o for o in self.sharp if get_optimizer_spec(o).needs_closure]
        if self.sharp and len(self.optimizers) != 1:
            raise OptimConfigError(
                "A sharpness-aware optimizer needs a single optimizer per trainer; this trainer "
                f"registers {len(self.optimizers)}"
            )

    # -- hooks --------------------------------------------------------------------------------
    def check(self, sam_name: str, max_epoch: int) -> None:
        """Refuse a configuration whose sharpness-aware stage never starts."""
        self.staging.check(sam_name if self.sharp else "", max_epoch)

    def sharpness_active(self, epoch: int) -> bool:
        """Whether a sharpness-aware optimizer steps in ``epoch``."""
        return bool(self.sharp) and self.staging.active(epoch)

    def _active(self, epoch: int):
        """The sharpness-aware optimizer stepping in ``epoch``, or None."""
        return self.sharp[0] if self.sharpness_active(epoch) else None

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
        """Backpropagate ``loss`` (scaled under AMP); with a projection set, every backward of
        the step (both passes of a two-pass optimizer) gives its projected gradient."""
        if self.projection is not None:
            params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
            self.projection.backward(loss, params, self.scaler)
            return
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def set_projection(self, projection) -> None:
        """Run every backward through ``projection`` (:class:`optim.prograd.ProGradProjection`),
        after checking that this step's optimizers combine with it (refused with the reason)."""
        if self.grad_sync is not None:
            raise OptimConfigError(
                f"{projection.who} does not run data-parallel yet: its projection needs the "
                "all-reduced gradients of both of its terms before it is applied, and the "
                "gradient sync all-reduces one. Train it in one process"
            )
        for opt in self.sharp:
            projection.check_optimizer(opt)
        self.projection = projection

    # -- data-parallel (#29): the one gradient-sync hook, after every backward an optimizer reads
    def sync_gradients(self, batch: StepBatch | None) -> None:
        """All-reduce the gradients of this pass over the processes (a no-op in one process):
        weighted by the pass's items (``batch.count``), see :mod:`optim.distributed`."""
        if self.grad_sync is None:
            return
        params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        count = 1 if batch is None else batch.count
        self.grad_sync(params, 1 if count is None else count)

    # -- the contract ------------------------------------------------------------------------
    def needs(self, epoch: int | None = None) -> frozenset[str]:
        """What the sharpness-aware optimizer needs from the caller (keys of
        :data:`optim.sharpness.STEP_NEEDS`): in ``epoch`` (nothing before its stage), or in
        any epoch (``epoch`` None). A base optimizer needs nothing."""
        opt = self.sharp[0] if self.sharp and epoch is None else self._active(epoch or 0)
        if opt is None:
            return frozenset()
        needs = set(getattr(opt, "step_needs", lambda: frozenset({BEGIN_STEP}))())
        if get_optimizer_spec(opt).needs_closure:
            needs.add(LOSS_FN)
        return frozenset(needs)

    def check_caller(self, gives, who: str, fix: str = "") -> None:
        """Refuse, before training, a caller that cannot give what the optimizer needs.

        Args:
            gives: the keys of :data:`optim.sharpness.STEP_NEEDS` the caller provides.
            who: the caller, for the message (e.g. "the trainer file's forward_backward").
            fix: what the user can do instead (appended to the message).
        """
        missing = sorted(self.needs() - set(gives))
        if missing:
            name = get_optimizer_spec(self.sharp[0]).name
            what = "; ".join(STEP_NEEDS[m] for m in missing)
            raise StepContractError(
                f"The optimizer {name!r} needs {what}, which {who} does not give. "
                + (fix or "Run it with a trainer of the engine's step protocol (engine.trainer)")
            )

    def _check_open(self, opt, batch: StepBatch | None, epoch: int) -> None:
        """The contract of a step of ``opt``: opened by begin_step with this batch, in this
        epoch; the batch and what it holds as the optimizer needs them."""
        name = get_optimizer_spec(opt).name
        if self._open is None or self._open is not batch or self._open_epoch != epoch:
            raise StepContractError(
                f"The step of the sharpness-aware optimizer {name!r} was not opened with "
                "OptimizerStep.begin_step(batch, epoch) before the step's first forward (with "
                "the StepBatch then passed as step(loss, loss_fn, epoch, batch=batch)): its "
                "caller breaks the step's contract (optim/step.py); engine.trainer.TrainerX "
                "and dassl.engine.TrainerX keep it"
            )
        needs = self.needs(epoch)
        if batch is None and needs & {OUTPUTS, INDEX, REPASS}:
            require_batch(batch, name)
        if OUTPUTS in needs and batch.first is None:
            raise StepContractError(f"{name} {NO_OUTPUTS}")
        if INDEX in needs:
            batch.require_index(name)

    # -- the step -----------------------------------------------------------------------------
    def begin_step(self, batch: StepBatch | None, epoch: int) -> None:
        """Open a step, before the first pass's forward: the sharpness-aware optimizer's
        ``before_forward`` (RWP perturbs the weights, MESA runs its EMA model). Every step of a
        sharpness-aware optimizer must be opened so (``__call__`` refuses one that was not)."""
        self._open, self._open_epoch = batch, epoch
        if batch is not None and self.grad_sync is not None:  # data-parallel (#29)
            batch.sync = self.grad_sync
        opt = self._active(epoch)
        if opt is not None:
            opt.before_forward(batch, epoch)

    def abort_step(self, epoch: int) -> None:
        """Close a step that failed between begin_step and the update: undo ``before_forward``
        (RWP's perturbed weights)."""
        self._open = self._open_epoch = None
        opt = self._active(epoch)
        if opt is not None:
            opt.restore_single()

    def __call__(
        self,
        loss: Tensor,
        loss_fn: Callable[[], Tensor] | None,
        epoch: int,
        batch: StepBatch | None = None,
    ) -> dict[str, Tensor]:
        """Backpropagate ``loss`` and update; ``loss_fn`` recomputes the loss (second pass).

        Args:
            loss: the first-pass loss.
            loss_fn: recomputes the loss at the current parameters (None: one-pass only).
            epoch: the current epoch (0-based; staging).
            batch: the step's :class:`StepBatch` (the engine passes it; optimizers that select
                items or read logits need it).

        Returns the optimizer's diagnostics of this step (empty for a base optimizer's).

        Raises:
            StepContractError: with a sharpness-aware optimizer, a step not opened by
                :meth:`begin_step` with ``batch``, or a batch without what it needs.
        """
        opt = self._active(epoch)
        if opt is not None:
            try:
                self._check_open(opt, batch, epoch)
            except StepContractError:
                self.abort_step(epoch)
                raise
            self._open = self._open_epoch = None
            extra = opt.extra_loss(batch, epoch)
            if extra is not None:
                loss = loss + extra
        self.zero_grad()
        self.backward(loss)
        two_pass = opt is not None and get_optimizer_spec(opt).needs_closure
        two_pass = two_pass and opt.second_pass_due()
        if not (two_pass and self.grad_sync is not None and self.grad_sync.local_ascent):
            self.sync_gradients(batch)  # data-parallel (#29); m-sharpness: the ascent stays local
        if opt is None:
            self._one_pass()
            return {}
        if two_pass:
            if loss_fn is None:
                raise RuntimeError(
                    "A sharpness-aware optimizer evaluates the loss twice per step: the trainer "
                    "must state prepare_step(batch) and compute_loss(inputs) instead of calling "
                    "model_backward_and_update(loss)"
                )
            return self._two_pass(opt, loss, lambda: opt.second_pass_loss(batch, loss_fn), batch)
        return self._single(opt)

    def _single(self, opt) -> dict[str, Tensor]:
        """A sharpness-aware optimizer's step without a second pass (``single_step``)."""
        scaler = self.scaler
        if scaler is not None:
            scaler.unscale_(opt)
            if not grads_finite(opt):  # overflow: undo before_forward, skip, back off
                opt.restore_single()
                opt.zero_grad(set_to_none=True)
                scaler.update()
                return {}
        opt.single_step()
        if scaler is not None:
            scaler.update()
        return dict(getattr(opt, "last_stats", None) or {})

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

    def _two_pass(
        self, opt, loss: Tensor, loss_fn: Callable[[], Tensor], batch: StepBatch | None = None
    ) -> dict[str, Tensor]:
        scaler = self.scaler
        if scaler is None:

            def closure():
                loss_p = loss_fn()
                self.backward(loss_p)
                self.sync_gradients(batch)  # data-parallel (#29)
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
        self.backward(loss_fn())  # scaled
        self.sync_gradients(batch)  # data-parallel (#29)
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
