"""F-SAM: Friendly Sharpness-Aware Minimization (Li et al., CVPR 2024).

F-SAM removes the full-gradient component from SAM's perturbation direction, keeping the
batch-specific stochastic part. The full gradient is approximated by an exponential moving
average ``m`` of the mini-batch gradients (Li et al., Eq. 8; SAMPLe paper, Eq. ``EMA``)::

    m_t = lam * m_{t-1} + (1 - lam) * g_t,  m_0 = 0
    d   = g_t - sigma * m_t
    e   = rho * d / (||d|| + 1e-12)
    theta <- base_step(theta, g_p),  g_p = grad L(theta + e)

Paper vs reference (the released code, nblt/F-SAM), documented differences:

- First step of each tensor: the paper's ``m_1 = (1 - lam) * g_1`` (from ``m_0 = 0``) gives
  ``d = (1 - sigma * (1 - lam)) * g``; the reference initialises ``m = g`` and perturbs along
  ``d = g`` (plain SAM).
- Later steps: the paper subtracts the *new* average, ``d = g_t - sigma * m_t``; the reference
  subtracts the *old* one, ``d = g_t - sigma * m_{t-1}``, and only then updates
  ``m_t = lam * m_{t-1} + (1 - lam) * g_t``.
- Otherwise identical: SAM's perturbation on ``d`` with eps 1e-12, restore, base step with
  ``g_p``. The reference's order of operations is followed (``d = g - m * sigma``,
  ``m * lam + g * (1 - lam)``, ``e = d * (rho / (||d|| + 1e-12))``); it restores by subtracting
  ``e``, both variants here from saved copies (bit-exact; the difference is rounding only).

``lam`` and ``sigma`` are global in the reference; here they may also be set per param group
(the moving average is per tensor anyway; the norm of ``d`` stays global), like ``rho``.
The constructor's defaults are the config's (the ``HParam`` declarations: rho 0.05, lam 0.15,
sigma 1), the values the SAMPLe paper ran F-SAM with (its Table of hyper-parameters); the
released class defaults to lam 0.9.

Diagnostics (``last_stats``) besides the common ones: ``ema_norm`` (``||m_t||``), ``xi``
(``cos(g, m)`` of the average subtracted in ``d``), ``gb_norm`` (``||d||``), ``cos_gp_m``
(``cos(g_p, m_t)``).
"""

from __future__ import annotations

import torch

from .build import NONNEG, HParam, declare_hparam, nonneg, register_optimizer
from .sharpness import (
    EPS,
    RHO,
    SCHEDULE,
    VARIANT,
    SharpnessAwareOptimizer,
    cosine,
    ema_update,
    global_dot,
    global_norm,
    per_group,
    scaled,
)

LAMBDA = declare_hparam(
    HParam(
        "LAMBDA",
        "lam",
        0.15,
        "F-SAM/SAMPLe moving-average factor lambda of the full-gradient EMA",
        lambda v: 0 <= v <= 1,
        "a number in [0, 1]",
    )
)
SIGMA = declare_hparam(
    HParam(
        "SIGMA",
        "sigma",
        1.0,
        "F-SAM scale of the removed full-gradient component",
        nonneg,
        NONNEG,
    )
)


class FSAM(SharpnessAwareOptimizer):
    """Friendly SAM; see the module docstring for the equations and the two variants.

    Args:
        params: parameters or param-group dicts.
        base_optimizer: base optimizer class (default SGD).
        rho: perturbation radius (>= 0; 0 gives the base optimizer exactly).
        lam: moving-average factor lambda in [0, 1).
        sigma: scale (>= 0) of the full-gradient component removed from ``g``.
        variant: "paper" or "reference".
        schedule: "constant" or "inv_sqrt" (rho / sqrt(t)).
        **base_kwargs: base optimizer arguments (lr, momentum, weight_decay, ...).
    """

    KEEPS_GRADIENT_AVERAGE = True  # m-sharpness would average different g per process (#29)

    def __init__(
        self,
        params,
        base_optimizer=torch.optim.SGD,
        rho: float = RHO.default,
        lam: float = LAMBDA.default,
        sigma: float = SIGMA.default,
        variant: str = VARIANT.default,
        schedule: str = SCHEDULE.default,
        **base_kwargs,
    ):
        defaults = dict(rho=rho, lam=lam, sigma=sigma)
        super().__init__(params, base_optimizer, defaults, variant, schedule, **base_kwargs)

    def _perturbation(self, fp, g, g_norm, scale):
        used, new = [], []  # the average subtracted in d, and m_t
        for group, p, gi in zip(fp.groups, fp.params, g):
            m, lam = self._ema(p), group["lam"]
            if m is None:
                m_t = gi.clone() if self.variant == "reference" else gi * (1 - lam)
                used.append(torch.zeros_like(gi) if self.variant == "reference" else m_t)
            else:
                m_t = ema_update(m, gi, lam)
                used.append(m if self.variant == "reference" else m_t)
            new.append(m_t)
        d = [gi - group["sigma"] * m for group, gi, m in zip(fp.groups, g, used)]
        d_norm = global_norm(d)
        denom = d_norm + EPS
        fp.ema = new
        fp.stats["ema_norm"] = global_norm(new)
        fp.stats["xi"] = cosine(global_dot(g, used), g_norm, global_norm(used))
        fp.stats["gb_norm"] = d_norm
        return scaled(d, per_group(fp.groups, lambda gr: gr["rho"] * scale / denom))


register_optimizer(
    "fsam",
    FSAM,
    "Friendly SAM (Li et al. 2024): SAM along g minus its moving average",
    kind="sharpness",
    needs_closure=True,
    hparams=("RHO", "LAMBDA", "SIGMA", "VARIANT", "SCHEDULE"),
    test_kwargs=dict(rho=0.05, lam=0.5, sigma=1.0),
)
