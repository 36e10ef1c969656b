"""SAM (Foret et al., ICLR 2021) and ASAM (Kwon et al., ICML 2021).

Sharpness-Aware Minimization solves ``min_theta max_{||e|| <= rho} L(theta + e)`` with the
first-order solution of the inner problem (Foret et al., Eq. 2; SAMPLe paper,
Eq. ``sam_perturbation``)::

    e = rho * g / (||g|| + 1e-12)                         (SAM)
    e = rho * p^2 * g / (|| |p| * g || + 1e-12)           (ASAM, ``adaptive=True``)
    theta <- base_step(theta, g_p),  g_p = grad L(theta + e)

with ``g = grad L(theta)`` and the norm global over all parameters with a gradient (ASAM:
Kwon et al., Eq. 12 with the element-wise operator ``T_w = |w|``). ``rho`` and ``adaptive``
may be set per param group (the norm stays global), as in davda54/sam.

Paper vs reference: identical. Both variants implement the equations above, which are also
the de-facto reference code's (davda54/sam) and the SAM of the SAMPLe authors' CoOp, CoCoOp
and MaPLe trainers, with the reference's order of operations (``e = g * (rho / (||g|| + eps))``;
ASAM ``e = (p^2 * g) * (rho / (||(|p| * g)|| + eps))``) and two improvements that do not change
the trajectory: the state dict includes the base optimizer's state (momentum survives a
resume), and parameters are restored from saved copies (bit-exact in fp16) instead of by
subtraction (the only rounding difference from the reference). (The SAM copy of the SAMPLe
authors' PromptSRC trainer updates with ``0.5 * g + 0.5 * g_p``; that trainer is not in the
paper's tables and is not emulated.)
"""

from __future__ import annotations

import torch

from .build import HParam, declare_hparam, register_optimizer
from .sharpness import (
    EPS,
    RHO,
    SCHEDULE,
    VARIANT,
    SharpnessAwareOptimizer,
    acc_dtype,
    global_norm,
    per_group,
    scaled,
)

ADAPTIVE = declare_hparam(
    HParam("ADAPTIVE", "adaptive", False, "SAM only: ASAM's scale-invariant perturbation")
)


class SAM(SharpnessAwareOptimizer):
    """SAM, or ASAM with ``adaptive=True``; see the module docstring for the equations.

    Args:
        params: parameters or param-group dicts.
        base_optimizer: base optimizer class (default SGD).
        rho: perturbation radius (>= 0; 0 gives the base optimizer exactly).
        adaptive: ASAM's scale-invariant perturbation.
        variant: "paper" or "reference" (identical for SAM).
        schedule: "constant" or "inv_sqrt" (rho / sqrt(t)).
        **base_kwargs: base optimizer arguments (lr, momentum, weight_decay, ...).
    """

    def __init__(
        self,
        params,
        base_optimizer=torch.optim.SGD,
        rho: float = RHO.default,
        adaptive: bool = ADAPTIVE.default,
        variant: str = VARIANT.default,
        schedule: str = SCHEDULE.default,
        **base_kwargs,
    ):
        defaults = dict(rho=rho, adaptive=adaptive)
        super().__init__(params, base_optimizer, defaults, variant, schedule, **base_kwargs)

    def _perturbation(self, fp, g, g_norm, scale):
        weights = [
            p.detach().to(acc_dtype(p)).abs() if gr["adaptive"] else None
            for gr, p in zip(fp.groups, fp.params)
        ]
        if any(w is not None for w in weights):
            g_norm = global_norm(gi if w is None else w * gi for gi, w in zip(g, weights))
        denom = g_norm + EPS
        vectors = [gi if w is None else w * w * gi for gi, w in zip(g, weights)]
        return scaled(vectors, per_group(fp.groups, lambda gr: gr["rho"] * scale / denom))


register_optimizer(
    "sam",
    SAM,
    "SAM (Foret et al. 2021); ASAM with OPTIM.SAM.ADAPTIVE (Kwon et al. 2021)",
    kind="sharpness",
    needs_closure=True,
    hparams=("RHO", "ADAPTIVE", "VARIANT", "SCHEDULE"),
    test_kwargs=dict(rho=0.05),
)
