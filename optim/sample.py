"""SAMPLe: sharpness-aware prompt learning with batch-specific exploration (the SAMPLe paper).

SAMPLe minimises ``L(theta) + L(theta + e - alpha * g_B)`` (paper, Eq. ``obj_fn_1``) where
``g_B`` is the component of the mini-batch gradient orthogonal to the full-batch gradient,
which is approximated by a moving average ``m`` (Eq. ``fg_proj``, ``B_proj``, ``EMA`` and
Algorithm 1). Per step, both passes on the same mini-batch, variant "paper"::

    m_t   = lam * m_{t-1} + (1 - lam) * g,   m_0 = 0                    (Eq. EMA)
    e     = rho * g / (||g|| + 1e-12)                                    (Eq. sam_perturbation)
    xi    = cos(m_t, g),   sigma = ||g|| / ||m_t||                        (global, Alg. 1)
    g_B   = g - xi * sigma * m_t                                         (Eq. B_proj)
    theta_hat = theta + e - alpha * g_B                                  (Eq. obj_fn_1)
    theta <- base_step(theta, g + g_p),   g_p = grad L(theta_hat)

So ``g_B`` is orthogonal to ``m_t``; at the first step ``m_1 = (1 - lam) * g_1`` is parallel
to ``g_1``, ``g_B = 0`` and the perturbation is SAM's; replacing ``g_B`` by ``g`` gives SAGM.
``exploration=False`` does exactly that (an ablation: in the paper variant SAMPLe is then SAGM
to the bit; in the reference variant ``g_B`` is replaced by ``g`` in its own formula). The
cosine and ratio carry a zero-only guard, so a zero gradient or average gives ``xi = 0``.
With ``schedule="inv_sqrt"`` rho and alpha are divided by sqrt(t) (the convergence theorem).

Variant "reference" reproduces the authors' released code (HRajoliN/Sharpness-Aware-
Minimization-in-VLMs); documented differences from the paper:

- Update gradient ``0.5 * g + 0.5 * g_p`` instead of ``g + g_p``.
- First step (this optimizer's step 1): ``m = g`` (not ``(1 - lam) * g``) and
  ``e = rho * g / ||g||`` with no alpha term and no epsilon (a guard acts only on an exact
  zero norm, where the released code gives NaN).
- Later steps: ``m = lam * m + (1 - lam) * g`` before use (as in the paper);
  ``n = ||g|| + 1e-10``, ``n_m = ||m|| + 1e-10``; ``xi`` is a cosine per row of each tensor
  (``torch.nn.functional.cosine_similarity`` along dim 1 of a 2-D tensor: one cosine per
  context token of an ``(n_ctx, dim)`` prompt) instead of one global cosine; and
  ``e = rho * g / n - alpha * (g - xi * (n / n_m) * m)``. Rows are generalised as: a 2-D
  tensor as in the released code; a 1-D or 0-d tensor is one row (the released code crashes
  on 1-D tensors); a tensor with more dimensions is flattened to ``(shape[0], -1)``, one
  cosine per leading index.
- A tensor that first gets a gradient after step 1 starts its average at ``m = g`` (then
  follows the later-step rule).
- Restores from saved copies instead of subtracting ``e`` (rounding only).

The one intentional deviation from the released code: it computes the global ``||m||`` while
updating the tensors one by one, so with several tensors the norm mixes old and new averages;
here ``n_m`` is the norm of the new average of every tensor. The released trainers' extra
per-batch LR-scheduler step is a trainer bug and not an optimizer matter.

``rho``, ``alpha`` and ``lam`` may be set per param group; ``xi``, ``sigma`` and the norms are
global. Defaults follow the paper's hyper-parameter table for CoOp (rho 0.05, alpha 0.0015,
lam 0.15). Diagnostics besides the common ones: ``ema_norm`` (``||m_t||``), ``xi`` (the
global ``cos(g, m_t)``; the reference variant uses the per-row cosines), ``gb_norm``
(``||g_B||`` of the vector actually used: ``g`` with ``exploration=False``, 0 at a reference
first step) and ``cos_gp_m`` (``cos(g_p, m_t)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .build import register_optimizer
from .sharpness import (
    TINY,
    SharpnessAwareOptimizer,
    cosine,
    global_dot,
    global_norm,
    sagm_perturbation,
)

REF_EPS = 1e-10  # the released code's epsilon on ||g|| and ||m||


def row_cosine(a: Tensor, b: Tensor) -> Tensor:
    """Cosine of ``a`` and ``b`` per row, shaped to broadcast against ``a``.

    Rows: a 2-D tensor's rows (dim-1 cosine, as the released SAMPLe code); a 0-d or 1-D tensor
    is one row; an N-D tensor is flattened to ``(shape[0], -1)``.
    """
    if a.dim() < 2:
        return F.cosine_similarity(a.reshape(1, -1), b.reshape(1, -1), dim=1).reshape(())
    cos = F.cosine_similarity(a.flatten(1), b.flatten(1), dim=1)  # [rows]
    return cos.reshape((-1,) + (1,) * (a.dim() - 1))


class SAMPLe(SharpnessAwareOptimizer):
    """SAMPLe; see the module docstring for the equations and the two variants.

    Args:
        params: parameters or param-group dicts.
        base_optimizer: base optimizer class (default SGD).
        rho: perturbation radius (>= 0).
        alpha: step (>= 0) back along the batch-specific gradient ``g_B``.
        lam: moving-average factor lambda in [0, 1).
        variant: "paper" (update with g + g_p) or "reference" (the released code).
        schedule: "constant" or "inv_sqrt" (rho / sqrt(t) and alpha / sqrt(t)).
        exploration: False replaces ``g_B`` by ``g`` (ablation; then SAMPLe is SAGM).
        **base_kwargs: base optimizer arguments (lr, momentum, weight_decay, ...).
    """

    UPDATE = {"paper": "sum", "reference": "mean"}

    def __init__(
        self,
        params,
        base_optimizer=torch.optim.SGD,
        rho: float = 0.05,
        alpha: float = 0.0015,
        lam: float = 0.15,
        variant: str = "paper",
        schedule: str = "constant",
        exploration: bool = True,
        **base_kwargs,
    ):
        self.exploration = exploration
        defaults = dict(rho=rho, alpha=alpha, lam=lam)
        super().__init__(params, base_optimizer, defaults, variant, schedule, **base_kwargs)

    def _perturbation(self, fp, g, g_norm, scale):
        ref = self.variant == "reference"
        if ref and fp.t == 1:  # released code, first step: m = g, plain SAM without epsilon
            fp.ema = [gi.clone() for gi in g]
            fp.stats.update(ema_norm=g_norm, xi=cosine(global_dot(g, g), g_norm, g_norm))
            fp.stats["gb_norm"] = torch.zeros_like(g_norm)
            inv = 1.0 / g_norm.clamp_min(TINY)
            return [gi * (inv * (gr["rho"] * scale)) for gr, gi in zip(fp.groups, g)]
        fp.ema = []
        for group, p, gi in zip(fp.groups, fp.params, g):
            m, lam = self._ema(p), group["lam"]
            if m is None:
                fp.ema.append(gi.clone() if ref else gi * (1 - lam))
            else:
                fp.ema.append(m.mul(lam).add_(gi, alpha=1 - lam))
        m_norm = global_norm(fp.ema)
        xi = cosine(global_dot(fp.ema, g), g_norm, m_norm)
        fp.stats.update(ema_norm=m_norm, xi=xi)
        if ref:
            return self._reference_perturbation(fp, g, g_norm, m_norm, scale)
        e = sagm_perturbation(fp.groups, g, g_norm, scale)
        if not self.exploration:
            fp.stats["gb_norm"] = g_norm
            return e
        coef = xi * (g_norm / m_norm.clamp_min(TINY))  # xi * sigma: g_B = g - coef * m
        fp.stats["gb_norm"] = global_norm(gi - coef * m for gi, m in zip(g, fp.ema))
        for group, ei, m in zip(fp.groups, e, fp.ema):  # e = rho g/||g|| - alpha (g - coef m)
            ei.add_(m * (coef * (group["alpha"] * scale)))
        return e

    def _reference_perturbation(self, fp, g, g_norm, m_norm, scale):
        n, ratio = g_norm + REF_EPS, (g_norm + REF_EPS) / (m_norm + REF_EPS)
        if self.exploration:
            g_b = [gi - row_cosine(gi, m) * ratio * m for gi, m in zip(g, fp.ema)]
        else:
            g_b = g
        fp.stats["gb_norm"] = global_norm(g_b)
        return [
            gi * (gr["rho"] * scale / n) - (gr["alpha"] * scale) * gbi
            for gr, gi, gbi in zip(fp.groups, g, g_b)
        ]


register_optimizer(
    "sample",
    SAMPLe,
    "SAMPLe: SAM plus a step back along the batch-specific gradient (orthogonal to its EMA)",
    kind="sharpness",
    needs_closure=True,
    hparams=("RHO", "ALPHA", "LAMBDA", "VARIANT", "SCHEDULE"),
    test_kwargs=dict(rho=0.05, alpha=0.01, lam=0.5),
)
