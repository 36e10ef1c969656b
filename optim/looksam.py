"""LookSAM (Liu et al., "Towards Efficient and Scalable Sharpness-Aware Minimization", CVPR 2022).

SAM's second pass only every k steps (Liu et al., Alg. 1, the non-layer-wise LookSAM). On an
ascent step (``t mod k == 0``, ``t`` the completed steps so far, so the first step is one) it
is SAM (:mod:`optim.sam`)::

    e   = rho * g / (||g|| + 1e-12),   g_s = grad L(theta + e)
    g_v = g_s - (<g_s, g> / ||g||^2) * g                 (stored: g_s orthogonal to g)
    theta <- base_step(theta, g_s)

and on the ``k - 1`` steps in between it takes one forward/backward for ``g`` and reuses ``g_v``
with the adaptive scale of the paper (Eq. 6)::

    theta <- base_step(theta, g + look_alpha * (||g|| / ||g_v||) * g_v)

``||.||`` is global over every parameter with a gradient; a zero ``g_v`` adds nothing. Cost:
about ``1 + 1/k`` passes per step. Defaults: ``k = 5`` and ``look_alpha = 0.7`` (the values of
the paper's ViT experiments and the common unofficial implementation), ``rho = 0.05`` (this
project's SAM default, ``OPTIM.SAM.RHO``; the paper's ViT runs use larger rho). ``every = 1``
is SAM exactly; ASAM's ``adaptive`` perturbation applies on the ascent steps. The layer-wise
variant (Look-LayerSAM, for large-batch training) is not implemented. The paper gives no
released code; the reuse rule is shared with SAMPLe-k
(:meth:`optim.sharpness.SharpnessAwareOptimizer.single_step`).
"""

from __future__ import annotations

import torch

from .build import NONNEG, HParam, declare_hparam, nonneg, register_optimizer
from .sam import ADAPTIVE, SAM
from .sharpness import RHO, SCHEDULE, VARIANT

EVERY = declare_hparam(
    HParam(
        "EVERY",
        "every",
        0,
        "lookahead (looksam; sample): the second pass every EVERY steps (steps t with t mod k "
        "== 0, the first included), the stored part g_v of the perturbed gradient orthogonal to "
        "g reused in between. 0: the optimizer's own k (looksam 5, sample 1)",
        lambda v: v >= 0,
        "an integer >= 0 (0: the optimizer's own k)",
    )
)
LOOK_ALPHA = declare_hparam(
    HParam(
        "LOOK_ALPHA",
        "look_alpha",
        0.7,
        "scale of the reused orthogonal component (LookSAM's alpha)",
        nonneg,
        NONNEG,
    )
)


class LookSAM(SAM):
    """LookSAM; see the module docstring for the equations.

    Args:
        params: parameters or param-group dicts.
        base_optimizer: base optimizer class (default SGD).
        rho: perturbation radius of the ascent steps.
        every: the ascent period k (0: the default 5; 1: SAM).
        look_alpha: scale of the reused orthogonal component (alpha of the paper).
        adaptive: ASAM's perturbation on the ascent steps.
        variant: "paper" or "reference" (identical, as SAM's).
        schedule: "constant" or "inv_sqrt" (rho / sqrt(t)).
        **base_kwargs: base optimizer arguments (lr, momentum, weight_decay, ...).
    """

    DEFAULT_EVERY = 5

    def __init__(
        self,
        params,
        base_optimizer=torch.optim.SGD,
        rho: float = RHO.default,
        every: int = EVERY.default,
        look_alpha: float = LOOK_ALPHA.default,
        adaptive: bool = ADAPTIVE.default,
        variant: str = VARIANT.default,
        schedule: str = SCHEDULE.default,
        **base_kwargs,
    ):
        super().__init__(params, base_optimizer, rho, adaptive, variant, schedule, **base_kwargs)
        self.set_lookahead(every or self.DEFAULT_EVERY, look_alpha)


register_optimizer(
    "looksam",
    LookSAM,
    "LookSAM (Liu et al. 2022): SAM's ascent every k steps, its orthogonal part reused between",
    kind="sharpness",
    needs_closure=True,
    hparams=("RHO", "EVERY", "LOOK_ALPHA", "ADAPTIVE", "SCHEDULE"),
    test_kwargs=dict(rho=0.05, every=3, look_alpha=0.7),
    efficient=True,
)
