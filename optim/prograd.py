"""ProGrad's gradient rule: the update gradient with its conflict against a guide removed.

Prompt-aligned Gradient (Zhu et al., "Prompt-aligned Gradient for Prompt Tuning", ICCV 2023;
code BeierZhu/Prompt-align, its Dassl fork's ``prograd_backward_and_update``). A step's loss has
two parts: the task loss ``L_ce`` whose gradient the optimizer follows, and a guide ``L_kl`` (the
KL divergence to the zero-shot CLIP's predictions) whose gradient is the "general direction".
For every parameter tensor, with ``g = grad L_ce``, ``g_kl = grad L_kl`` and
``u = g_kl / ||g_kl||``::

    g_prograd = g - lambda * (g . u) u    if cos(g, g_kl) < 0     (the two conflict)
    g_prograd = g                         otherwise

With ``lambda = 1`` the conflicting component is removed entirely (``g_prograd`` is orthogonal
to ``g_kl``); the guide's own gradient is never added. The rule is per tensor, as the authors'
loop over the parameters is, and computed in their order of operations (both gradients
normalised for the cosine, the component along the normalised guide).

Two backward passes per gradient: the guide's (``torch.autograd.grad`` with the graph kept) and
the task loss's (``.backward()``, which fills ``.grad``); then the projection in place. The step
object (:class:`optim.step.OptimizerStep`) runs every backward of a step through it once a
trainer has set it (:meth:`optim.step.OptimizerStep.set_projection`), so a sharpness-aware
optimizer reads projected gradients in both passes: the ascent follows ProGrad's gradient at
``w``, the update ProGrad's gradient at the perturbed point ``w + e`` (each projected against
the guide's gradient at the same point). Optimizers that add a loss term of their own (SAF's
and MESA's trajectory loss) are refused: whether that term is projected with the task loss,
added after, or guides is not defined by ProGrad. ESAM's "masked" second pass rewrites the loss
and is refused too ("subset" works: the pass on the selected items carries its own guide).

A trainer's loss carries its guide: ``guided(ce, kl)`` returns ``ce`` (the same tensor) with the
guide attached; :func:`guide_of` reads it back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .errors import OptimConfigError

_GUIDE = "_prograd_guide"  # the attribute of a loss tensor that holds its guide


def guided(loss: Tensor, guide: Tensor) -> Tensor:
    """``loss`` with ``guide`` attached (the tensor itself: its value and graph are unchanged)."""
    setattr(loss, _GUIDE, guide)
    return loss


def guide_of(loss: Tensor) -> Tensor | None:
    """The guide attached to ``loss`` by :func:`guided`, or None."""
    return getattr(loss, _GUIDE, None)


@torch.no_grad()
def project_conflicting(grad: Tensor, guide_grad: Tensor, lam: float) -> tuple[Tensor, bool]:
    """ProGrad's rule for one tensor (module docstring): ``(g_prograd, conflicting)``.

    Args:
        grad: the task loss's gradient ``g``.
        guide_grad: the guide's gradient ``g_kl`` (same shape).
        lam: ``lambda``, the share of the conflicting component removed.

    A zero gradient on either side gives a NaN cosine, which is not negative: ``g`` unchanged,
    as in the authors' code.
    """
    unit_guide = guide_grad / torch.linalg.norm(guide_grad)
    unit_grad = grad / torch.linalg.norm(grad)
    if torch.dot(unit_grad.flatten(), unit_guide.flatten()) < 0:
        along = torch.dot(grad.flatten(), unit_guide.flatten())
        return grad - lam * along * unit_guide, True
    return grad, False


class ProGradProjection:
    """The backward of a step whose loss carries a guide (:func:`guided`): gradients of the task
    loss with their conflict against the guide's gradient removed (module docstring).

    Args:
        lam: ``lambda`` (ProGrad's ``LOSS.LAMBDA``), >= 0.
        who: the trainer, for error messages.

    Attributes:
        conflicts: how many tensors conflicted in the latest backward (a diagnostic).
    """

    def __init__(self, lam: float, who: str = "ProGrad"):
        if lam < 0:
            raise OptimConfigError(f"{who}: LAMBDA must be >= 0, got {lam}")
        self.lam = float(lam)
        self.who = who
        self.conflicts = 0

    def check_optimizer(self, opt) -> None:
        """Refuse a sharpness-aware optimizer whose combination with ProGrad is not defined."""
        from .build import get_optimizer_spec
        from .sharpness import SharpnessAwareOptimizer

        name = get_optimizer_spec(opt).name
        if type(opt).extra_loss is not SharpnessAwareOptimizer.extra_loss:
            raise OptimConfigError(
                f"{self.who} does not combine with the optimizer {name!r}: it adds a loss term "
                "of its own (a trajectory loss) to the step, and ProGrad does not define "
                "whether that term's gradient is projected with the cross-entropy's, added "
                "after the projection or guides it. Use a sharpness-aware optimizer without an "
                "extra loss term (sam, fsam, sagm, sample, esam, looksam, rwp, mrwp) or sgd "
                "(docs/optimizers.md)"
            )
        if getattr(opt, "select_pass", None) == "masked" and getattr(opt, "gamma", 1.0) < 1:
            raise OptimConfigError(
                f"{self.who} does not combine with {name!r}'s masked selection "
                "(OPTIM.SAM.SELECT_PASS masked): that pass rewrites the loss with the selected "
                "items' cross-entropy, and the guide is not recomputed for them. Set "
                "OPTIM.SAM.SELECT_PASS subset (the pass on the selected items carries its guide)"
            )

    def backward(
        self, loss: Tensor, params: Sequence[Tensor], scaler: torch.amp.GradScaler | None = None
    ) -> None:
        """Fill ``.grad`` of ``params`` with ProGrad's gradient of ``loss`` (scaled by ``scaler``
        under AMP: the projection is linear in the scale and the cosine does not see it)."""
        guide = guide_of(loss)
        if guide is None:
            raise OptimConfigError(
                f"{self.who}'s step needs the guide term with the loss (optim.prograd.guided): "
                "the loss of this pass has none. Either the trainer's compute_loss did not "
                "return guided(ce, kl), or an optimizer rewrote the loss"
            )

        def scale(t):
            return scaler.scale(t) if scaler is not None else t

        params = [p for p in params if p.requires_grad]
        guide_grads = torch.autograd.grad(
            scale(guide), params, retain_graph=True, allow_unused=True
        )
        # own copies: a gradient may be a view of a buffer that the second backward reuses
        guide_grads = [g if g is None else g.clone() for g in guide_grads]
        scale(loss).backward()
        conflicts = 0
        for p, g_kl in zip(params, guide_grads, strict=True):
            if p.grad is None or g_kl is None:
                continue
            projected, conflicting = project_conflicting(p.grad, g_kl, self.lam)
            if conflicting:
                p.grad.copy_(projected)
                conflicts += 1
        self.conflicts = conflicts
