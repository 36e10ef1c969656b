"""SAGM: Sharpness-Aware Gradient Matching (Wang et al., CVPR 2023).

SAGM minimises ``L(theta) + L(theta + e - alpha * g)`` with SAM's ``e = rho * g / ||g||``
(Wang et al., Eq. 9-11), i.e. the second pass is taken at::

    theta_hat = theta + e_w,   e_w = g * (rho / (||g|| + 1e-12) - alpha)
    theta <- base_step(theta, G)

Paper vs reference (the released code, Wang-pengfei/SAGM), documented differences:

- Update gradient: the paper's objective (and the SAMPLe paper's SAGM/SAMPLe update, Eq.
  ``obj_fn_1``) sums the two gradients, ``G = g + g_p`` ("paper"); the reference averages
  them, ``G = 0.5 * g + 0.5 * g_p`` ("reference"; the same as halving the learning rate with
  SGD, not with Adam). ``update`` ("sum" or "mean"; ``OPTIM.SAM.UPDATE``) overrides the
  variant's rule.
- Restore: the reference subtracts the stored ``e_w`` (inexact in low precision); both
  variants here restore from saved copies (bit-exact; the difference is rounding only). The
  reference's order of operations is followed otherwise: ``e_w = g * (rho / (||g|| + 1e-12) -
  alpha)`` and the mean as ``g_p + (0.5 * g - 0.5 * g_p)``.

Which update the project's configs use: every ``configs/optim/**/sagm.yaml`` sets
``OPTIM.SAM.UPDATE mean`` explicitly. The numbers in the SAMPLe paper's tables come from code
that averages (SAGM's own code, and the SAMPLe authors' code, whose optimizer without the
exploration term is SAGM); with SGD (CoOp, CoCoOp, MaPLe, CoPrompt, TCP) "sum" would train
the SAGM rows at twice the effective learning rate of the SGD/SAM/F-SAM rows at the same
``OPTIM.LR``, which the paper does not report. The paper variant's own rule stays "sum"
(``OPTIM.SAM.UPDATE ""`` or ``sum`` selects it).
- The reference drives rho through a linear scheduler whose max equals its min (a constant);
  here rho is constant, or rho / sqrt(t) with ``schedule="inv_sqrt"`` (alpha likewise).

The perturbation is the same in both variants. ``rho`` and ``alpha`` may be set per param
group (the norm stays global). The constructor's default alpha is ``OPTIM.SAM.ALPHA``'s (0.0015,
the key SAMPLe shares); the reference's and the SAMPLe paper's SAGM value, 0.001, is set by every
``configs/optim/**/sagm.yaml``.
"""

from __future__ import annotations

import torch

from .build import NONNEG, HParam, declare_hparam, nonneg, register_optimizer
from .sharpness import (
    RHO,
    SCHEDULE,
    UPDATE_KEY,
    VARIANT,
    SharpnessAwareOptimizer,
    sagm_perturbation,
)

ALPHA = declare_hparam(
    HParam(
        "ALPHA",
        "alpha",
        0.0015,
        "SAGM/SAMPLe step alpha along the (batch-specific) gradient",
        nonneg,
        NONNEG,
    )
)


class SAGM(SharpnessAwareOptimizer):
    """Sharpness-aware gradient matching; see the module docstring for the equations.

    Args:
        params: parameters or param-group dicts.
        base_optimizer: base optimizer class (default SGD).
        rho: perturbation radius (>= 0).
        alpha: step (>= 0) back along ``g`` at the perturbed point.
        variant: "paper" (update with g + g_p) or "reference" (0.5 * g + 0.5 * g_p).
        schedule: "constant" or "inv_sqrt" (rho / sqrt(t) and alpha / sqrt(t)).
        update: "" (the variant's rule), "sum" (g + g_p) or "mean" (0.5 * g + 0.5 * g_p).
        **base_kwargs: base optimizer arguments (lr, momentum, weight_decay, ...).
    """

    UPDATE = {"paper": "sum", "reference": "mean"}

    def __init__(
        self,
        params,
        base_optimizer=torch.optim.SGD,
        rho: float = RHO.default,
        alpha: float = ALPHA.default,
        variant: str = VARIANT.default,
        schedule: str = SCHEDULE.default,
        update: str = UPDATE_KEY.default,
        **base_kwargs,
    ):
        defaults = dict(rho=rho, alpha=alpha)
        super().__init__(params, base_optimizer, defaults, variant, schedule, update, **base_kwargs)

    def _perturbation(self, fp, g, g_norm, scale):
        return sagm_perturbation(fp.groups, g, g_norm, scale)


register_optimizer(
    "sagm",
    SAGM,
    "SAGM (Wang et al. 2023): SAM plus a step back along the gradient, update g + g_p or mean",
    kind="sharpness",
    needs_closure=True,
    hparams=("RHO", "ALPHA", "VARIANT", "UPDATE", "SCHEDULE"),
    test_kwargs=dict(rho=0.05, alpha=0.01),
)
