"""The trainer side of the optimizer step, moved out of :mod:`engine.trainer`.

- :class:`StepProtocol` (mixed into ``engine.trainer.TrainerX``): the step protocol's parts a
  trainer states or uses: ``prepare_step`` (work without gradients), ``compute_loss`` (the
  loss), ``classification_loss`` (records the pass's logits for the optimizer step),
  ``select_inputs`` (a part of the batch) and the pass the optimizer's
  :class:`optim.step.StepBatch` runs;
- :class:`DasslStepNames` (mixed into ``engine.trainer.TrainerBase``): Dassl's step names
  (``model_backward_and_update`` ...), routed through the engine's optimizer step or refused
  with a pointer.

The step's contract (what the optimizer needs from the caller, ``begin_step`` before the first
forward) is the optimizer step's own (:class:`optim.step.OptimizerStep`); the engine's
``TrainerX.forward_backward`` and ``dassl.engine.TrainerX`` keep it.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from optim.step import PassOutputs

from .clip.text import shared_prefix_text
from .compile import eager

DASSL_STEP_HINT = (
    "This engine takes the optimizer step itself: state prepare_step(batch) (work without "
    "gradients) and compute_loss(inputs) (the loss) in the trainer, and the engine's "
    "forward_backward runs backward, the optimizer (sharpness-aware or not), AMP and staging"
)


STEP_FIX = (
    "State prepare_step(batch) and compute_loss(inputs) instead of a forward_backward of its own "
    "(engine.trainer.TrainerX), or subclass dassl.engine.TrainerX (docs/porting-trainers.md)"
)


def batch_len(batch) -> int:
    """Items in a training batch (its labels); a huge number when it has none, i.e. the batch
    counts as full."""
    label = batch.get("label") if isinstance(batch, dict) else None
    return len(label) if label is not None else 1 << 62


def select_items(obj, subset: torch.Tensor, size: int):
    """``obj`` with every tensor whose first dimension is ``size`` indexed by ``subset``, inside
    tuples, lists and dicts; anything else unchanged."""
    if isinstance(obj, torch.Tensor):
        return obj[subset] if obj.dim() > 0 and obj.shape[0] == size else obj
    if isinstance(obj, tuple):
        items = [select_items(o, subset, size) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [select_items(o, subset, size) for o in obj]
    if isinstance(obj, dict):
        return {k: select_items(v, subset, size) for k, v in obj.items()}
    return obj


class DasslStepNames:
    """Dassl's step names on the engine's trainers (``TrainerBase``)."""

    def step_gives(self) -> frozenset[str]:
        """What this trainer's step gives the optimizer (none: one-pass optimizers only)."""
        return frozenset()

    # -- Dassl names: routed through the engine's step, or refused with a pointer ----------
    def detect_anomaly(self, loss: torch.Tensor) -> None:
        if not torch.isfinite(loss).all():
            raise FloatingPointError("Loss is infinite or NaN!")

    def model_zero_grad(self, names=None) -> None:
        for name in self.get_model_names(names):
            if self._optims[name] is not None:
                self._optims[name].zero_grad(set_to_none=True)

    def model_backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError(f"model_backward(): {DASSL_STEP_HINT}")

    def model_update(self, names=None) -> None:
        raise NotImplementedError(f"model_update(): {DASSL_STEP_HINT}")

    def model_backward_and_update(self, loss: torch.Tensor, names=None) -> None:
        """Dassl's one-call update, routed through the optimizer step (one-pass optimizers
        only: a sharpness-aware optimizer needs compute_loss to re-evaluate the loss)."""
        if names is not None and list(self.get_model_names(names)) != self.get_model_names():
            raise NotImplementedError(f"model_backward_and_update(names=...): {DASSL_STEP_HINT}")
        if self.optim_step.sharpness_active(self.epoch):
            raise NotImplementedError(
                f"model_backward_and_update(loss) with the sharpness-aware optimizer "
                f"{self.cfg.OPTIM.SAM.NAME!r}: {DASSL_STEP_HINT}; or subclass "
                "dassl.engine.TrainerX, which replays forward_backward for its passes"
            )
        self.detect_anomaly(loss)
        self.optim_step(loss, None, self.epoch)


class StepProtocol:
    """The step protocol's trainer methods (``TrainerX``; see :mod:`engine.trainer`)."""

    _pass_outputs: PassOutputs | None = None  # what classification_loss recorded this pass

    def prepare_step(self, batch_inputs):
        """(a) The work of a step that does not depend on learnable parameters.

        Runs once per step under ``torch.no_grad()`` and the precision's autocast. Default:
        return the parsed batch unchanged.
        """
        return batch_inputs

    def compute_loss(self, inputs):
        """(b) The loss from the prepared inputs: ``loss`` or ``(loss, {name: scalar})``.

        Called once per pass (twice per step with a sharpness-aware optimizer), under autocast.
        """
        raise NotImplementedError

    def classification_loss(
        self, logits: torch.Tensor, label: torch.Tensor, label_smoothing: float = 0.0
    ) -> torch.Tensor:
        """The cross-entropy of a training pass, ``F.cross_entropy(logits.float(), label)``
        (with ``label_smoothing`` if given).

        Records the pass's logits and labels for the optimizer step
        (:class:`optim.step.PassOutputs`: per-item losses, the outputs of SAF/MESA); every
        trainer computes its classification loss through it.
        """
        ce = F.cross_entropy(  # fp16/bf16 logits in fp32, fp64 ones in fp64
            logits.to(torch.promote_types(logits.dtype, torch.float32)),
            label,
            label_smoothing=label_smoothing,
        )
        self._pass_outputs = PassOutputs(logits, label, ce, label_smoothing)
        return ce

    def select_inputs(self, inputs, subset: torch.Tensor, size: int):
        """The prepared inputs of the items ``subset`` (1-D indices) of a batch of ``size``.

        Default: every tensor whose first dimension is ``size`` (in tuples, lists and dicts) is
        indexed; override when the inputs hold a tensor of that leading size that is not per
        item (e.g. per-class features when the classes may number ``size``).
        """
        return select_items(inputs, subset, size)

    def _loss(self, inputs):
        with self.autocast():
            out = self.compute_loss(inputs)
        loss, summary = out if isinstance(out, tuple) else (out, {})
        return loss, summary

    def _pass(self, inputs, subset: torch.Tensor | None, size: int):
        """One pass for the step: ``(loss, recorded outputs or None)`` on the batch or on the
        items ``subset``. A smaller batch, and a pass without gradients (an optimizer's look at
        the outputs), run the compiled encoders eagerly: the compiled graphs are the training
        pass's. A pass without gradients also encodes the class prompts' common prefix once
        (:func:`engine.clip.text.shared_prefix_text` on this model's encoders: the same outputs
        up to fp32 rounding)."""
        self._pass_outputs = None
        if subset is not None:
            inputs = self.select_inputs(inputs, subset, size)
        no_grad = not torch.is_grad_enabled()
        other = subset is not None or no_grad
        with (
            eager() if other and self.compiled_modules else nullcontext(),
            shared_prefix_text(self.model) if no_grad else nullcontext(),
        ):
            loss, _ = self._loss(inputs)
        return loss, self._pass_outputs
