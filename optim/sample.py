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

Variant "reference" reproduces the authors' released optimizer (HRajoliN/Sharpness-Aware-
Minimization-in-VLMs: the copy used by its CoOp, MaPLe and PromptSRC trainers); differences
from the paper:

- Update gradient ``0.5 * g + 0.5 * g_p`` instead of ``g + g_p``.
- First step of each tensor (it has no average yet): ``m = g`` (not ``(1 - lam) * g``) and
  ``e = rho * g / ||g||`` with no alpha term and no epsilon (a guard acts only on an exact
  zero norm, where the released code gives NaN). A tensor that first gets a gradient after
  other tensors have averages takes this rule too (the released code: the same, or a
  KeyError when such a tensor comes after one with an average, see below).
- Later steps, tensor by tensor in parameter order (the released code loops over the model's
  parameters; here the order of the param groups, the same when the groups were built from
  ``model.parameters()`` as Dassl does): the tensor's average is updated in place,
  ``m_k = lam * m_k + (1 - lam) * g_k``, and then ``n = ||g|| + 1e-10`` and
  ``n_m = ||m|| + 1e-10`` are computed from the averages *as they are at that moment*. So the
  k-th tensor sees the mixed norm::

      n_m(k) = sqrt(sum_{j <= k} ||m_j(t)||^2 + sum_{j > k} ||m_j(t-1)||^2) + 1e-10

  (tensors before it and itself already updated, those after it not yet; a tensor after it
  without an average counts 0, where the released code raises a KeyError). Only the last
  tensor sees the norm of the new averages; with one tensor there is no mixing.
- ``xi`` is a cosine per row (``torch.nn.functional.cosine_similarity(m_k, g_k, dim=1)``,
  unsqueezed at dim 1 to broadcast: one cosine per context token of an ``(n_ctx, dim)``
  prompt; for a tensor of 3 or more dimensions the released expression's cosine along dim 1
  per index of the other dimensions) instead of one global cosine, and
  ``e = rho * g / n - alpha * (g - xi * (n / n_m(k)) * m_k)``. A 1-D or 0-d tensor is one
  row (the released code crashes on 1-D tensors).
- Restores from saved copies instead of subtracting ``e`` (rounding only). Its order of
  operations is otherwise followed (``(rho / n) * g``, ``(xi * (n / n_m)) * m``,
  ``lam * m + ((1 - lam) * g)``, the mean as ``g_p + (0.5 * g - 0.5 * g_p)``), so in fp32 the
  step rounds as the released one. Its ``NORMALIZATION`` and ``ADAPTIVE`` options (off in its
  scripts' defaults) are not emulated; its rho "scheduler" is a constant.

Variant "reference-cocoop" reproduces the copy of the optimizer used by the released CoCoOp
trainer, in which the moving average and the exploration term are commented out: every step
(the first too) perturbs by ``e = (rho / ||g||) * g - alpha * g`` (no epsilon, the same zero
guard) and updates with ``0.5 * g + 0.5 * g_p``. That is SAGM with eps 0 and the mean update;
no average is kept, and ``lam`` and ``exploration`` have no effect.

Update gradient: ``update`` (``OPTIM.SAM.UPDATE``: "sum" or "mean") overrides the variant's
rule ("paper": sum; "reference", "reference-cocoop": mean). Every
``configs/optim/**/sample.yaml`` sets ``mean``: the published numbers come from the released
code, which averages, and with SGD "sum" would train the SAMPLe rows at twice the effective
learning rate of the SGD/SAM/F-SAM rows at the same ``OPTIM.LR`` (the convergence proof's
``g + g_p`` differs from the mean by that factor on the learning rate only). The released
trainers' extra per-batch LR-scheduler step is a trainer matter, not an optimizer one.

Lookahead, SAMPLe-k (``every = k``, ``OPTIM.SAM.EVERY``; this project's, in none of the
anchors): SAMPLe's mixed perturbation ``e - alpha * g_B`` and its second pass run only on the
steps ``t`` (completed steps so far, from 0) with ``t mod k == 0``; the steps in between take
one forward/backward. What is reused is LookSAM's: at an ascent step the part of ``g_p`` (the
gradient at SAMPLe's perturbed point) orthogonal to ``g`` is stored,
``g_v = g_p - (<g_p, g> / ||g||^2) g``; in between ``g_p`` is replaced by
``g_p_hat = g + look_alpha * (||g|| / ||g_v||) * g_v`` (``look_alpha``: ``OPTIM.SAM.LOOK_ALPHA``,
0.7) and the update is SAMPLe's own rule on ``(g, g_p_hat)`` (``g + g_p_hat`` or the mean). The
moving average ``m`` belongs to the perturbation: it is updated at the ascent steps only, from
the ``g`` of that step, exactly as SAMPLe does; so ``every = 1`` (the default) is SAMPLe to the
bit, and with ``k = 5`` a step costs about ``1 + 1/5`` passes. The rule is
:meth:`optim.sharpness.SharpnessAwareOptimizer.single_step`, shared with LookSAM.

``rho``, ``alpha`` and ``lam`` may be set per param group; ``xi``, ``sigma`` and the norms are
global. Defaults follow the paper's hyper-parameter table for CoOp (rho 0.05, alpha 0.0015,
lam 0.15). Diagnostics besides the common ones: ``ema_norm`` (``||m_t||``), ``xi`` (the
global ``cos(g, m_t)``; the reference variant uses the per-row cosines), ``gb_norm``
(``||g_B||`` of the vector actually used: ``g`` with ``exploration=False`` or
"reference-cocoop", 0 for a tensor at its reference first step) and ``cos_gp_m``
(``cos(g_p, m_t)``; not for "reference-cocoop", which keeps no average).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .build import register_optimizer
from .fsam import LAMBDA
from .looksam import EVERY, LOOK_ALPHA
from .sagm import ALPHA
from .sharpness import (
    RHO,
    SCHEDULE,
    TINY,
    UPDATE_KEY,
    VARIANT,
    SharpnessAwareOptimizer,
    cosine,
    ema_update,
    global_dot,
    global_norm,
    per_group,
    sagm_perturbation,
    scaled,
    stack_norm,
    tensor_norm,
)

REF_EPS = 1e-10  # the released code's epsilon on ||g|| and ||m||


def row_cosine(m: Tensor, g: Tensor) -> Tensor:
    """The released code's per-row cosine of ``m`` and ``g``, shaped to broadcast against ``g``.

    ``cosine_similarity(m, g, dim=1)`` unsqueezed at dim 1 (for a 2-D tensor one cosine per
    row); a 0-d or 1-D tensor is one row (a 0-d result).
    """
    if g.dim() < 2:
        return F.cosine_similarity(m.reshape(1, -1), g.reshape(1, -1), dim=1).reshape(())
    return F.cosine_similarity(m, g, dim=1).unsqueeze(1)


class SAMPLe(SharpnessAwareOptimizer):
    """SAMPLe; see the module docstring for the equations and the variants.

    Args:
        params: parameters or param-group dicts.
        base_optimizer: base optimizer class (default SGD).
        rho: perturbation radius (>= 0).
        alpha: step (>= 0) back along the batch-specific gradient ``g_B``.
        lam: moving-average factor lambda in [0, 1).
        variant: "paper" (update with g + g_p), "reference" (the released code) or
            "reference-cocoop" (the released CoCoOp copy: SAGM-like, no average).
        schedule: "constant" or "inv_sqrt" (rho / sqrt(t) and alpha / sqrt(t)).
        update: "" (the variant's rule), "sum" (g + g_p) or "mean" (0.5 * g + 0.5 * g_p).
        exploration: False replaces ``g_B`` by ``g`` (ablation; then SAMPLe is SAGM).
        every: lookahead period k (SAMPLe-k; 0 or 1: SAMPLe, the second pass every step).
        look_alpha: scale of the reused direction between two ascents (LookSAM's alpha).
        **base_kwargs: base optimizer arguments (lr, momentum, weight_decay, ...).
    """

    VARIANTS = ("paper", "reference", "reference-cocoop")
    UPDATE = {"paper": "sum", "reference": "mean", "reference-cocoop": "mean"}
    KEEPS_GRADIENT_AVERAGE = True  # m-sharpness would average different g per process (#29)

    def __init__(
        self,
        params,
        base_optimizer=torch.optim.SGD,
        rho: float = RHO.default,
        alpha: float = ALPHA.default,
        lam: float = LAMBDA.default,
        variant: str = VARIANT.default,
        schedule: str = SCHEDULE.default,
        update: str = UPDATE_KEY.default,
        exploration: bool = True,
        every: int = EVERY.default,
        look_alpha: float = LOOK_ALPHA.default,
        **base_kwargs,
    ):
        self.exploration = exploration
        defaults = dict(rho=rho, alpha=alpha, lam=lam)
        super().__init__(params, base_optimizer, defaults, variant, schedule, update, **base_kwargs)
        self.set_lookahead(every or 1, look_alpha)

    def _perturbation(self, fp, g, g_norm, scale):
        if self.variant == "reference-cocoop":
            return self._cocoop_perturbation(fp, g, g_norm, scale)
        if self.variant == "reference":
            return self._reference_perturbation(fp, g, g_norm, scale)
        fp.ema = self._paper_ema(fp, g)
        m_norm = global_norm(fp.ema)
        xi = cosine(global_dot(fp.ema, g), g_norm, m_norm)
        fp.stats.update(ema_norm=m_norm, xi=xi)
        e = sagm_perturbation(fp.groups, g, g_norm, scale)
        if not self.exploration:
            fp.stats["gb_norm"] = g_norm
            return e
        coef = xi * (g_norm / m_norm.clamp_min(TINY))  # xi * sigma: g_B = g - coef * m
        fp.stats["gb_norm"] = global_norm(torch._foreach_sub(g, torch._foreach_mul(fp.ema, coef)))
        # e = rho g/||g|| - alpha (g - coef m): add m * (coef * alpha) to SAGM's e
        torch._foreach_add_(
            e, scaled(fp.ema, per_group(fp.groups, lambda gr: coef * (gr["alpha"] * scale)))
        )
        return e

    def _paper_ema(self, fp, g) -> list[Tensor]:
        """``m_t = lam * m_{t-1} + (1 - lam) * g`` (``(1 - lam) * g`` at a tensor's first
        step); fused over the tensors when they all have an average and share one group."""
        old = [self._ema(p) for p in fp.params]
        groups = fp.groups
        if all(m is not None for m in old) and all(gr is groups[0] for gr in groups):
            lam = groups[0]["lam"]
            new = list(torch._foreach_mul(old, lam))
            torch._foreach_add_(new, torch._foreach_mul(g, 1 - lam))  # ema_update, fused
            return new
        return [
            gi * (1 - gr["lam"]) if m is None else ema_update(m, gi, gr["lam"])
            for gr, gi, m in zip(groups, g, old)
        ]

    def _reference_perturbation(self, fp, g, g_norm, scale):
        """The released code's loop: update m_k in place, then use the norm of the averages as
        they are (tensors 1..k new, k+1.. old); a tensor without an average: m = g, plain SAM."""
        old = [self._ema(p) for p in fp.params]
        fp.ema = [
            gi.clone() if m is None else ema_update(m, gi, group["lam"])
            for group, gi, m in zip(fp.groups, g, old)
        ]
        new_norms = [tensor_norm(m) for m in fp.ema]
        zero = torch.zeros_like(g_norm)
        old_norms = [zero if m is None else tensor_norm(m) for m in old]
        n = g_norm + REF_EPS
        e, g_b = [], []
        for k, (group, gi, m) in enumerate(zip(fp.groups, g, fp.ema)):
            rho, alpha = group["rho"] * scale, group["alpha"] * scale
            if old[k] is None:  # this tensor's first step: m = g, e = rho g / ||g||
                e.append(gi * (rho / g_norm.clamp_min(TINY)))
                g_b.append(torch.zeros_like(gi))
                continue
            n_m = stack_norm(new_norms[: k + 1] + old_norms[k + 1 :]) + REF_EPS  # mixed
            gbi = gi - row_cosine(m, gi) * (n / n_m) * m if self.exploration else gi
            e.append(gi * (rho / n) - alpha * gbi)
            g_b.append(gbi)
        m_norm = stack_norm(new_norms)
        fp.stats.update(ema_norm=m_norm, xi=cosine(global_dot(fp.ema, g), g_norm, m_norm))
        fp.stats["gb_norm"] = global_norm(g_b)
        return e

    def _cocoop_perturbation(self, fp, g, g_norm, scale):
        """The released CoCoOp copy: ``e = (rho / ||g||) g - alpha g`` every step, no average."""
        fp.stats["gb_norm"] = g_norm
        norm = g_norm.clamp_min(TINY)
        return [
            gi * (gr["rho"] * scale / norm) - (gr["alpha"] * scale) * gi
            for gr, gi in zip(fp.groups, g)
        ]


register_optimizer(
    "sample",
    SAMPLe,
    "SAMPLe: SAM plus a step back along the batch-specific gradient (orthogonal to its EMA)",
    kind="sharpness",
    needs_closure=True,
    hparams=("RHO", "ALPHA", "LAMBDA", "VARIANT", "UPDATE", "SCHEDULE", "EVERY", "LOOK_ALPHA"),
    test_kwargs=dict(rho=0.05, alpha=0.01, lam=0.5),
)
