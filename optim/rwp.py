"""RWP and m-RWP: random weight perturbation (Li et al., "Efficient Generalization Improvement
Guided by Random Weight Perturbation", arXiv 2211.11489; code nblt/RWP).

Both take the gradient at randomly perturbed weights ``w + eps`` with Gaussian noise scaled per
filter by the filter's norm (Li et al., Eq. 4; the authors' ``train_rwp_parallel.py``)::

    eps_f ~ N(0, (noise * ||w_f||)^2 I)   for every filter w_f of a tensor

where a *filter* is a slice along the first dimension of a tensor of two or more dimensions
(a convolution's output channel, a linear layer's output row; for a prompt of shape
``(n_ctx, dim)`` one context vector, for CoOp's class-specific ``(n_cls, n_ctx, dim)`` one class's
context) and a 1-D or 0-d tensor is one filter (``||w|| + 1e-16``, as the authors' code). The
noise is drawn in at least fp32 from the optimizer's generator (saved in the state dict).

- ``rwp`` (one pass): the engine's forward and backward run at ``w + eps`` (the optimizer
  perturbs in ``before_forward``); the weights are restored from a copy and the base optimizer
  steps with ``g(w + eps)``. The logged training loss is the loss at ``w + eps``.
- ``mrwp`` (m-RWP, two passes): ``g = grad L(w)`` (first pass), ``g_eps = grad L(w + eps)``
  (second pass, same batch), update with ``mix * g_eps + (1 - mix) * g`` (Li et al., Eq. 6;
  the authors run the two passes on two devices with different batches and average with the
  weights ``2 mix`` and ``2 (1 - mix)``; here both passes see the same batch).

Defaults of the authors' CIFAR recipe: ``noise = 0.01`` (their ``gamma``), ``mix = 0.5`` (their
``alpha``). Parameters without a gradient are restored and not updated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .build import NONNEG, HParam, declare_hparam, nonneg, register_optimizer
from .sharpness import SharpnessAwareOptimizer, acc_dtype, copies, global_norm


def filter_noise(p: Tensor, noise: float, gen: torch.Generator) -> Tensor:
    """Gaussian noise shaped as ``p`` (at least fp32), std ``noise * ||filter||`` per filter
    (a slice along dim 0 of a tensor of >= 2 dims; a 1-D or 0-d tensor is one filter)."""
    w = p.detach().to(acc_dtype(p))
    if p.dim() >= 2:
        std = torch.linalg.vector_norm(w.flatten(1), dim=1).view(-1, *([1] * (p.dim() - 1)))
    else:
        std = torch.linalg.vector_norm(w) + 1e-16
    z = torch.randn(p.shape, generator=gen, device=p.device, dtype=w.dtype)
    return z * (std * noise)


NOISE = declare_hparam(
    HParam(
        "NOISE",
        "noise",
        0.01,
        "rwp/mrwp: Gaussian noise std per filter, relative to its L2 norm",
        nonneg,
        NONNEG,
    )
)
MIX = declare_hparam(
    HParam(
        "MIX",
        "mix",
        0.5,
        "mrwp: update = MIX * g(w + noise) + (1 - MIX) * g(w)",
        lambda v: 0 <= v <= 1,
        "a number in [0, 1]",
    )
)


class RWP(SharpnessAwareOptimizer):
    """RWP, one pass at ``w + eps``; see the module docstring.

    Args:
        params: parameters or param-group dicts.
        base_optimizer: base optimizer class (default SGD).
        noise: noise std relative to each filter's norm (may be set per param group).
        schedule: accepted for the common interface; RWP has no radius to schedule.
        **base_kwargs: base optimizer arguments (lr, momentum, weight_decay, ...).
    """

    VARIANTS = ("paper",)
    UPDATE = {"paper": "perturbed"}

    def __init__(
        self, params, base_optimizer=torch.optim.SGD, noise: float = NOISE.default, **base_kwargs
    ):
        NOISE.check(noise)
        super().__init__(params, base_optimizer, dict(noise=noise), **base_kwargs)
        self._saved: tuple[list[Tensor], list[Tensor]] | None = None

    def second_pass_due(self) -> bool:
        return False

    @torch.no_grad()
    def perturb(self) -> None:
        """Save the trainable weights and move them to ``w + eps`` (one draw per filter)."""
        if self._saved is not None:
            raise RuntimeError("RWP.perturb() twice without a step or restore_single()")
        groups = [(g, p) for g in self.param_groups for p in g["params"] if p.requires_grad]
        params = [p for _, p in groups]
        self._saved = (params, copies([p.detach() for p in params]))
        if params:
            gen = self.generator(params[0].device)
            for group, p in groups:
                p.add_(filter_noise(p, group["noise"], gen))

    def before_forward(self, batch, epoch: int) -> None:
        self.perturb()

    @torch.no_grad()
    def restore_single(self) -> None:
        if self._saved is not None:
            params, backup = self._saved
            self._saved = None
            if params:
                torch._foreach_copy_(params, backup)

    @torch.no_grad()
    def single_step(self) -> None:
        """Restore ``w`` and let the base optimizer step with ``.grad = g(w + eps)``."""
        self.restore_single()
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.last_stats = {"grad_norm": global_norm(grads)} if grads else {}
        self.num_steps += 1
        self.base_optimizer.step()
        self._opt_called = True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, loss: Any = None) -> Any:
        """One RWP step: perturb, ``closure()`` (forward + backward at ``w + eps``), update."""
        if closure is None:
            raise RuntimeError("RWP.step() needs a closure (forward + backward at w + eps)")
        self.zero_grad()
        self.perturb()
        try:
            with torch.enable_grad():
                out = closure()
        except BaseException:
            self.restore_single()
            raise
        self.single_step()
        return out if loss is None else loss


class MRWP(SharpnessAwareOptimizer):
    """m-RWP: the clean gradient mixed with the one at ``w + eps``; see the module docstring.

    Args:
        params: parameters or param-group dicts.
        base_optimizer: base optimizer class (default SGD).
        noise: noise std relative to each filter's norm (may be set per param group).
        mix: weight of the perturbed gradient in the update, in [0, 1].
        schedule: accepted for the common interface (no radius to schedule).
        **base_kwargs: base optimizer arguments (lr, momentum, weight_decay, ...).
    """

    VARIANTS = ("paper",)
    UPDATE = {"paper": "mix"}

    def __init__(
        self,
        params,
        base_optimizer=torch.optim.SGD,
        noise: float = NOISE.default,
        mix: float = MIX.default,
        **base_kwargs,
    ):
        NOISE.check(noise)
        MIX.check(mix)
        self.mix = float(mix)
        super().__init__(params, base_optimizer, dict(noise=noise), **base_kwargs)

    def _perturbation(self, fp, g, g_norm, scale):
        gen = self.generator(fp.params[0].device)
        return [filter_noise(p, gr["noise"], gen) for gr, p in zip(fp.groups, fp.params)]

    def _combine(self, g, g_p):
        """``mix * g_p + (1 - mix) * g``."""
        torch._foreach_mul_(g_p, self.mix)
        torch._foreach_add_(g_p, g, alpha=1 - self.mix)
        return g_p


register_optimizer(
    "rwp",
    RWP,
    "RWP (Li et al.): one pass at filter-wise Gaussian-perturbed weights",
    kind="sharpness",
    needs_closure=False,
    hparams=("NOISE",),
    test_kwargs=dict(noise=0.05),
    efficient=True,
)
register_optimizer(
    "mrwp",
    MRWP,
    "m-RWP (Li et al.): the clean gradient mixed with the one at perturbed weights (2 passes)",
    kind="sharpness",
    needs_closure=True,
    hparams=("NOISE", "MIX"),
    test_kwargs=dict(noise=0.05, mix=0.5),
    efficient=True,
)
