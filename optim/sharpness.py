"""Shared machinery of the sharpness-aware optimizers (SAM/ASAM, F-SAM, SAGM, SAMPLe).

Every optimizer of this family takes two gradients on the same mini-batch per update: ``g`` at
the current parameters ``theta`` and ``g_p`` at a perturbed point ``theta + e``, then lets a base
optimizer (SGD, Adam, ...) step with a gradient formed from ``g`` and ``g_p``. The subclasses
differ only in how ``e`` is computed (:meth:`SharpnessAwareOptimizer._perturbation`), in which
update gradient is formed (``update``: ``g_p``, ``g + g_p`` or ``0.5 * g + 0.5 * g_p``) and in
whether they keep a moving average of ``g``.

Step protocol (identical for every subclass):

1. The caller computes ``g`` (forward + backward) so that the parameters' ``.grad`` hold it.
2. :meth:`~SharpnessAwareOptimizer.first_step` saves a copy of every parameter that has a
   gradient (in the parameter's dtype), computes ``e`` from ``g`` and moves to ``theta + e``.
3. The caller computes ``g_p`` at the perturbed point (``closure()``).
4. :meth:`~SharpnessAwareOptimizer.second_step` restores ``theta`` exactly from the copies (not by
   subtracting ``e``), forms the update gradient in ``.grad`` and calls
   ``self.base_optimizer.step()``. Weight decay and momentum belong to that step only.

:meth:`~SharpnessAwareOptimizer.step` runs 2-4 with a closure. When no parameter has a
``.grad`` it first calls the closure at ``theta`` to compute ``g`` (the usual torch convention;
the closure then runs twice). :meth:`~SharpnessAwareOptimizer.restore` puts ``theta`` back after
step 2 without any update (a pass produced inf/NaN under a GradScaler and the step is skipped).
Under a GradScaler the caller unscales ``.grad`` before ``first_step`` and before
``second_step``: the alpha terms, norms and cosines must see true gradients.

State and restore: everything a step changes is *computed* in ``first_step`` but *committed*
only in ``second_step``: the new moving average is held next to the saved copies and replaces
the old one in ``second_step`` (a tensor without a committed average takes the reference
variants' first-step rule), and the step counter ``num_steps`` (which drives the ``inv_sqrt``
schedule) is incremented there. So ``restore()`` leaves the wrapper's state exactly as before
``first_step`` (moving averages, counter) and does not touch the base optimizer; it leaves
``.grad`` as it is and keeps the ``last_stats`` of the last completed step.

Numerics: norms, dot products, cosines, the moving averages and ``e`` are computed in the
parameter's dtype promoted to at least fp32 (:func:`acc_dtype`: fp16/bf16 -> fp32, fp32 -> fp32,
fp64 -> fp64); the saved copies are in the parameter dtype, so restoring is bit-exact. Where the
reference code's order of operations is known it is followed (``rho / (||g|| + eps)`` before
the product with ``g``, ``lam * m + (1 - lam) * g`` as two products, the mean as
``g_p + (0.5 * g - 0.5 * g_p)``), so a reference variant with fp32 parameters rounds as the
released code does (tests/test_optim_fidelity.py); the one difference left is the restore from
copies. Element-wise work over the parameters is fused with ``torch._foreach_*`` where it
computes the same values (the copies, ``theta + e``, the restore, the sum/mean update, and one
group's scaling by ``rho / ||g||`` and the like), so a step is a few kernel launches on a GPU;
reductions (norms, dot products) stay per tensor in their reference order and the reference
variants' per-tensor loops (mixed norms, first-step rule) are kept: the results are those of
per-tensor loops, bit for bit. With fp16/bf16 parameters the released code computes in the
parameter dtype, this code in fp32 (the difference is rounding only). A zero gradient gives a
zero perturbation, never NaN (eps guards, no Python branch on tensor values: the step makes no
host-device synchronisation). ``||.||`` is the global L2 norm over every parameter of every
param group that has a gradient this step; parameters without one are neither perturbed, nor
restored, nor updated. All parameters are assumed to live on one device.

Hyper-parameters live in ``defaults`` and may be overridden per param group (``rho``, ``alpha``,
``lam``, ``sigma``, ``adaptive``); norms and cosines stay global. ``variant`` ("paper",
"reference"; SAMPLe also "reference-cocoop"), ``update`` ("" for the variant's own rule, "sum"
or "mean"; SAGM and SAMPLe only) and ``schedule`` ("constant" or "inv_sqrt":
``rho_t = rho / sqrt(t)`` and ``alpha_t = alpha / sqrt(t)``, t = 1, 2, ... this optimizer's
steps, as in the SAMPLe paper's convergence theorem) are global.

Cheaper members of the family (docs/efficient-sharpness.md) use these hooks, which the step
object (:mod:`optim.step`) calls on every sharpness-aware optimizer (no-ops here):

- :meth:`~SharpnessAwareOptimizer.second_pass_due`: whether this step takes the second pass.
  With ``every = k > 1`` (LookSAM; SAMPLe with ``OPTIM.SAM.EVERY``) the ascent runs on the steps
  ``t`` with ``t mod k == 0`` (``t = num_steps`` completed steps, so the first step is an
  ascent) and :meth:`~SharpnessAwareOptimizer.single_step` updates from ``g`` alone in between
  (the lookahead rule below);
- :meth:`~SharpnessAwareOptimizer.before_forward` (called before the first pass; RWP perturbs,
  MESA runs its EMA model) and :meth:`~SharpnessAwareOptimizer.extra_loss` (a term added to the
  first-pass loss before the backward; SAF/MESA's trajectory loss);
- :meth:`~SharpnessAwareOptimizer.second_pass_loss`: the loss of the second pass (ESAM selects a
  part of the batch); they receive the step's :class:`optim.step.StepBatch`.

Lookahead (LookSAM, Liu et al. CVPR 2022, Alg. 1, applied to every optimizer of this class that
sets ``every > 1``): at an ascent step the perturbed gradient ``g_p`` is split into its
component along ``g`` and the orthogonal rest, which is stored per parameter::

    g_v = g_p - (<g_p, g> / ||g||^2) * g                 (state "look_gv", at least fp32)

and on the ``k - 1`` steps in between the perturbed gradient is approximated from the new ``g``::

    g_p_hat = g + look_alpha * (||g|| / ||g_v||) * g_v

which then enters the optimizer's own update rule in place of ``g_p`` (``g_p_hat`` for SAM, i.e.
LookSAM; ``g + g_p_hat`` or the mean for SAMPLe). Only ``g_v`` is reused; everything else (the
moving average, ``e``) is computed at the ascent steps from the state as it is then, so
``every = 1`` is the optimizer exactly.

Random perturbations (ESAM, RWP) draw from a generator of the optimizer, seeded from
``torch.initial_seed()`` when it is first used (no draw from the global stream) and saved in
the state dict, so a resumed run draws what an uninterrupted one draws.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from .build import NONNEG, HParam, declare_hparam, nonneg

logger = logging.getLogger(__name__)

EPS = 1e-12  # the epsilon of SAM-style normalisations (davda54/sam, F-SAM, SAGM)
TINY = torch.finfo(torch.float32).tiny  # a guard that only acts on an exact zero
# Every variant name some optimizer accepts (the config check); each class lists its own.
VARIANTS = ("paper", "reference", "reference-cocoop")
UPDATES = ("", "sum", "mean")  # OPTIM.SAM.UPDATE: "" is the variant's own rule
SCHEDULES = ("constant", "inv_sqrt")

# The OPTIM.SAM hyper-parameters shared by the family (optim.build.HParam: config key, default,
# help, range; engine/config.py and engine/validate.py read them from here)
RHO = declare_hparam(HParam("RHO", "rho", 0.05, "perturbation radius rho", nonneg, NONNEG))
VARIANT = declare_hparam(
    HParam(
        "VARIANT",
        "variant",
        "paper",
        "paper (the equations as written) | reference (the released code) | reference-cocoop "
        "(sample only: the SAMPLe authors' CoCoOp copy, SAGM-like without the moving average)",
        choices=VARIANTS,
    )
)
# (not named UPDATE: the optimizer classes' UPDATE maps each variant to its update rule)
UPDATE_KEY = declare_hparam(
    HParam(
        "UPDATE",
        "update",
        "",
        "update gradient of sagm/sample: '' (the variant's own: paper g + g_p, reference mean) "
        "| sum (g + g_p) | mean (0.5 g + 0.5 g_p; with SGD half the step of sum)",
        choices=UPDATES,
    )
)
SCHEDULE = declare_hparam(
    HParam(
        "SCHEDULE",
        "schedule",
        "constant",
        "rho/alpha schedule: constant | inv_sqrt (the paper's theorem: divided by sqrt(t))",
        choices=SCHEDULES,
    )
)

# What an optimizer may need from the caller of its step (optim.step.OptimizerStep), declared by
# each class in STEP_NEEDS (or step_needs()) and checked by the step object, which refuses a
# caller that does not give it:
BEGIN_STEP = "begin_step"  # OptimizerStep.begin_step(batch, epoch) before the first forward
OUTPUTS = "outputs"  # the first pass's recorded logits and labels (StepBatch.first)
INDEX = "index"  # the items' dataset indices (StepBatch.index)
REPASS = "repass"  # more forwards on the batch or a part of it (StepBatch.forward)
LOSS_FN = "loss_fn"  # the loss recomputed at the current parameters (a second pass)
STEP_NEEDS = {
    BEGIN_STEP: "OptimizerStep.begin_step(batch, epoch) before the step's first forward",
    OUTPUTS: "the first pass's logits (the trainer's self.classification_loss(logits, label))",
    INDEX: "the items' dataset indices (an 'index' entry in every training batch)",
    REPASS: "forwards on the batch or a part of it at the current weights (StepBatch.forward)",
    LOSS_FN: "a function recomputing the loss at the current weights (its second pass)",
}


def acc_dtype(t: Tensor) -> torch.dtype:
    """The dtype of the optimizer arithmetic on ``t``: its dtype promoted to at least fp32."""
    return torch.promote_types(t.dtype, torch.float32)


def tensor_norm(t: Tensor) -> Tensor:
    """The L2 norm of ``t`` in :func:`acc_dtype` (a 0-d tensor)."""
    return torch.linalg.vector_norm(t, dtype=acc_dtype(t))


def stack_norm(norms: Sequence[Tensor]) -> Tensor:
    """The L2 norm of a vector whose pieces have the 0-d L2 norms ``norms``."""
    return torch.linalg.vector_norm(torch.stack(list(norms)))


def global_norm(tensors: Iterable[Tensor]) -> Tensor:
    """The L2 norm (at least fp32) of the concatenation of ``tensors`` (a 0-d tensor)."""
    return stack_norm([tensor_norm(t) for t in tensors])


def global_dot(a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
    """The inner product (at least fp32) of two lists of tensors seen as one vector each."""
    dots = []
    for x, y in zip(a, b):
        dtype = torch.promote_types(acc_dtype(x), y.dtype)
        dots.append(torch.dot(x.to(dtype).flatten(), y.to(dtype).flatten()))
    return torch.stack(dots).sum()


def copies(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Copies of ``tensors`` (same dtype and strides), made by one fused copy on a GPU."""
    out = [torch.empty_like(t) for t in tensors]
    if out:
        torch._foreach_copy_(out, list(tensors))
    return out


def per_group(groups: Sequence[dict], fn: Callable[[dict], Any]) -> list[Any]:
    """``[fn(group) for group in groups]`` with ``fn`` evaluated once per distinct group (the
    same object for every parameter of a group, so :func:`scaled` can fuse)."""
    seen: dict[int, Any] = {}
    return [seen[id(gr)] if id(gr) in seen else seen.setdefault(id(gr), fn(gr)) for gr in groups]


def scaled(tensors: Sequence[Tensor], factors: Sequence[Any]) -> list[Tensor]:
    """``[t * f for t, f in zip(tensors, factors)]`` as one fused multiply when every factor
    is the same object (one param group, the usual case): the same products, fewer launches."""
    tensors = list(tensors)
    if tensors and all(f is factors[0] for f in factors):
        return list(torch._foreach_mul(tensors, factors[0]))
    return [t * f for t, f in zip(tensors, factors)]


def ema_update(m: Tensor, g: Tensor, lam: float) -> Tensor:
    """``lam * m + (1 - lam) * g`` as a new tensor (two products, as the reference codes)."""
    return m.mul(lam).add_(g * (1 - lam))


def cosine(dot: Tensor, norm_a: Tensor, norm_b: Tensor) -> Tensor:
    """``dot / (norm_a * norm_b)``, 0 (not NaN) when either norm is 0."""
    return dot / (norm_a * norm_b).clamp_min(TINY)


def sagm_perturbation(
    groups: Sequence[dict], g: Sequence[Tensor], g_norm: Tensor, scale: float
) -> list[Tensor]:
    """SAGM's ``e_w = g * (rho / (||g|| + 1e-12) - alpha)`` per tensor (rho, alpha per group).

    Shared by SAGM and SAMPLe (whose ascent-and-descent part it is) so that SAMPLe without its
    exploration term is SAGM to the bit.
    """
    denom = g_norm + EPS
    return scaled(g, per_group(groups, lambda gr: gr["rho"] * scale / denom - gr["alpha"] * scale))


def check_hparams(group: dict) -> None:
    """Raise ValueError for an invalid hyper-parameter of a param group (or the defaults)."""
    for name in ("rho", "alpha", "sigma"):
        if name in group and not group[name] >= 0:
            raise ValueError(f"Invalid {name}: {group[name]} (must be >= 0)")
    if "lam" in group and not 0 <= group["lam"] < 1:
        raise ValueError(f"Invalid lam: {group['lam']} (must be in [0, 1))")
    if "adaptive" in group and not isinstance(group["adaptive"], bool):
        raise ValueError(f"Invalid adaptive: {group['adaptive']!r} (must be a bool)")


@dataclass
class FirstPass:
    """What ``first_step`` leaves for ``second_step`` (transient, never in the state dict).

    Attributes:
        t: the number this step will have once committed (1, 2, ...).
        groups: the param group of each parameter below.
        params: the parameters that had a gradient at ``first_step``.
        backup: copies of ``params`` before the perturbation (parameter dtype).
        grads: copies of the first-pass gradients ``g`` (gradient dtype).
        ema: the new moving average (at least fp32) to commit, or None for optimizers without.
        stats: first-pass diagnostics (0-d tensors, at least fp32).
    """

    t: int
    groups: list[dict]
    params: list[Tensor]
    backup: list[Tensor]
    grads: list[Tensor]
    ema: list[Tensor] | None = None
    stats: dict[str, Tensor] = field(default_factory=dict)


class SharpnessAwareOptimizer(torch.optim.Optimizer):
    """Base class: a wrapper around a base optimizer that steps with a perturbed gradient.

    Subclasses pass their hyper-parameters as ``defaults`` and implement :meth:`_perturbation`;
    ``VARIANTS`` lists the variants a class accepts and ``UPDATE`` maps each to its own update
    gradient: "perturbed" (``g_p``), "sum" (``g + g_p``) or "mean" (``0.5 * g + 0.5 * g_p``).
    A class whose rule is not "perturbed" also accepts ``update`` ("sum" or "mean") to override
    it (SAGM, SAMPLe: ``OPTIM.SAM.UPDATE``).

    Args:
        params: parameters or param-group dicts.
        base_optimizer: the base optimizer class, built as
            ``base_optimizer(self.param_groups, **base_kwargs)``; its ``param_groups`` list is
            this wrapper's ``param_groups`` (an LR scheduler may act on either).
        defaults: the subclass's hyper-parameters (validated, overridable per group).
        variant: "paper" (the equations as written) or "reference" (the released code); a
            subclass may accept more (``VARIANTS``).
        schedule: "constant" or "inv_sqrt" (rho and alpha divided by sqrt(t)).
        update: "" (the variant's own rule, ``UPDATE[variant]``), "sum" or "mean"; only for
            classes whose own rule combines ``g`` and ``g_p``.
        **base_kwargs: passed to the base optimizer (lr, momentum, weight_decay, ...).

    Attributes:
        base_optimizer: the wrapped optimizer.
        update_rule: the update gradient in use: "perturbed", "sum" or "mean".
        num_steps: completed steps (``second_step`` and ``single_step`` calls), saved in the
            state dict.
        every: the lookahead period k (1: a second pass every step).
        last_stats: diagnostics of the last completed step, 0-d tensors (at least fp32) on
            the parameters' device: grad_norm, grad_p_norm, cos_g_gp, plus the subclass's.
    """

    VARIANTS: tuple[str, ...] = ("paper", "reference")
    UPDATE: dict[str, str] = {"paper": "perturbed", "reference": "perturbed"}
    # what the step's caller must give (keys of STEP_NEEDS): every step is opened with
    # begin_step; a two-pass optimizer adds LOSS_FN (register_optimizer's needs_closure)
    STEP_NEEDS: frozenset[str] = frozenset({BEGIN_STEP})

    def __init__(
        self,
        params,
        base_optimizer: Callable[..., torch.optim.Optimizer],
        defaults: dict[str, Any],
        variant: str = VARIANT.default,
        schedule: str = SCHEDULE.default,
        update: str = UPDATE_KEY.default,
        **base_kwargs,
    ):
        name = type(self).__name__
        if variant not in self.VARIANTS:
            raise ValueError(
                f"Invalid variant for {name}: {variant!r} (expected one of {self.VARIANTS})"
            )
        if schedule not in SCHEDULES:
            raise ValueError(f"Invalid schedule: {schedule!r} (expected one of {SCHEDULES})")
        if update not in UPDATES:
            raise ValueError(
                f"Invalid update: {update!r} (expected '' for the variant's rule, sum or mean)"
            )
        if update and self.UPDATE[variant] == "perturbed":
            raise ValueError(f"Invalid update for {name}: {update!r} ({name} updates with g_p)")
        check_hparams(defaults)
        self.variant = variant
        self.schedule = schedule
        self.update_rule = update or self.UPDATE[variant]
        self._own_defaults = dict(defaults)
        super().__init__(params, defaults)
        self.base_optimizer = base_optimizer(self.param_groups, **base_kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)
        self.num_steps = 0
        self.last_stats: dict[str, Tensor] = {}
        self._pending: FirstPass | None = None
        self.every = 1  # lookahead: the second pass every `every` steps (set_lookahead)
        self.look_alpha = 0.0
        self._generator: torch.Generator | None = None
        self._generator_state: Tensor | None = None  # loaded before the generator exists

    def set_lookahead(self, every: int, look_alpha: float) -> None:
        """Take the second pass every ``every`` steps and reuse ``g_v`` in between (see the
        module docstring); ``every = 1`` is the optimizer unchanged."""
        if int(every) != every or every < 1:
            raise ValueError(f"Invalid every: {every!r} (an integer >= 1: ascent every k steps)")
        if not look_alpha >= 0:
            raise ValueError(f"Invalid look_alpha: {look_alpha} (must be >= 0)")
        self.every = int(every)
        self.look_alpha = float(look_alpha)

    def generator(self, device: torch.device) -> torch.Generator:
        """The optimizer's random generator on ``device`` (created on first use)."""
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            if self._generator_state is not None:
                self._generator.set_state(self._generator_state)
            else:
                self._generator.manual_seed(torch.initial_seed())
        return self._generator

    # ----------------------------------------------------------------------------- groups
    def add_param_group(self, param_group: dict) -> None:
        """Add a group with this wrapper's defaults and the base optimizer's (shared list)."""
        for key, value in self._own_defaults.items():
            param_group.setdefault(key, value)
        check_hparams(param_group)
        if hasattr(self, "base_optimizer"):
            self.base_optimizer.add_param_group(param_group)
        else:  # during torch.optim.Optimizer.__init__, before the base optimizer exists
            super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the gradients of every parameter, through the base optimizer."""
        self.base_optimizer.zero_grad(set_to_none=set_to_none)

    def _scale(self, t: int) -> float:
        """The schedule's factor on rho and alpha at step ``t``."""
        return 1.0 if self.schedule == "constant" else 1.0 / math.sqrt(t)

    # ------------------------------------------------------------------------- the step
    def _perturbation(self, fp: FirstPass, g: list[Tensor], g_norm: Tensor, scale: float):
        """Return the perturbation ``e`` of each of ``fp.params`` (at least fp32).

        Subclasses may set ``fp.ema`` (the new moving average, committed in ``second_step``)
        and add diagnostics to ``fp.stats``.

        Args:
            fp: the pending step (groups, params, saved copies).
            g: the first-pass gradients in :func:`acc_dtype`.
            g_norm: ``||g||`` (global).
            scale: the schedule's factor on rho and alpha.
        """
        raise NotImplementedError

    # ------------------------------------------------------------- hooks of the step object
    def step_needs(self) -> frozenset[str]:
        """What this optimizer needs from the step's caller (keys of :data:`STEP_NEEDS`); the
        step object (:class:`optim.step.OptimizerStep`) checks them, adding ``LOSS_FN`` for a
        class registered with ``needs_closure``. Default: the class's ``STEP_NEEDS``."""
        return frozenset(self.STEP_NEEDS)

    def second_pass_due(self) -> bool:
        """Whether this step takes the second pass (always, unless ``every > 1``: then on
        steps ``t`` with ``t mod every == 0``, and whenever no ``g_v`` is stored yet)."""
        if self.every <= 1 or self.num_steps % self.every == 0:
            return True
        return not any("look_gv" in s for s in self.state.values())

    def before_forward(self, batch, epoch: int) -> None:
        """Called before the first pass's forward (the step's :class:`optim.step.StepBatch`)."""

    def extra_loss(self, batch, epoch: int) -> Tensor | None:
        """A term added to the first-pass loss before the backward (None: nothing)."""
        return None

    def second_pass_loss(self, batch, loss_fn: Callable[[], Tensor]) -> Tensor:
        """The loss of the second pass at the perturbed point (default: ``loss_fn()``)."""
        return loss_fn()

    def restore_single(self) -> None:
        """Undo :meth:`before_forward` when a one-pass step is skipped (AMP overflow)."""

    @torch.no_grad()
    def single_step(self) -> None:
        """A step without a second pass, from ``.grad = g``: the lookahead rule (module
        docstring) through the optimizer's update rule, then the base optimizer's step."""
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        stats: dict[str, Tensor] = {}
        if params:
            g = [p.grad.to(acc_dtype(p.grad)) for p in params]
            g_norm = global_norm(g)
            g_v = [self.state[p].get("look_gv") for p in params]
            g_v = [torch.zeros_like(gi) if v is None else v for gi, v in zip(g, g_v)]
            gv_norm = global_norm(g_v)
            coef = self.look_alpha * g_norm / gv_norm.clamp_min(TINY)
            g_hat = torch._foreach_add(g, torch._foreach_mul(g_v, coef))
            update = self._combine(g, g_hat)
            for p, u in zip(params, update):
                p.grad.copy_(u)
            stats = {"grad_norm": g_norm, "gv_norm": gv_norm}
        self.num_steps += 1
        self.base_optimizer.step()
        self._opt_called = True
        self.last_stats = stats

    def _combine(self, g: list[Tensor], g_p: list[Tensor]) -> list[Tensor]:
        """The update gradient from ``g`` and ``g_p`` by ``update_rule`` (``g_p`` may be
        changed in place and returned)."""
        if self.update_rule == "sum":
            torch._foreach_add_(g_p, g)
        elif self.update_rule == "mean":  # g_p + (0.5 g - 0.5 g_p), as the references
            half = torch._foreach_mul(g, 0.5)
            torch._foreach_sub_(half, g_p, alpha=0.5)
            torch._foreach_add_(g_p, half)
        return g_p

    def _store_direction(self, fp: FirstPass, g_p: list[Tensor]) -> Tensor:
        """Lookahead: store ``g_v``, the part of ``g_p`` orthogonal to ``g``; returns its norm."""
        g = [gi.to(acc_dtype(gi)) for gi in fp.grads]
        gp = [gi.to(acc_dtype(gi)) for gi in g_p]
        g_norm = global_norm(g)
        coef = global_dot(gp, g) / (g_norm * g_norm).clamp_min(TINY)
        g_v = torch._foreach_sub(gp, torch._foreach_mul(g, coef))
        for p, v in zip(fp.params, g_v):
            self.state[p]["look_gv"] = v
        return global_norm(g_v)

    def _ema(self, p: Tensor) -> Tensor | None:
        """The committed moving average of ``p`` (at least fp32), None before its first update."""
        return self.state[p].get("ema")

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        """Save the parameters, compute ``e`` from the current ``.grad`` and move to theta + e.

        Args:
            zero_grad: zero the gradients afterwards (the second pass then starts clean).
        """
        if self._pending is not None:
            raise RuntimeError("first_step() called twice: call second_step() or restore()")
        groups, params = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    groups.append(group)
                    params.append(p)
        fp = FirstPass(
            t=self.num_steps + 1,
            groups=groups,
            params=params,
            backup=copies([p.detach() for p in params]),
            grads=copies([p.grad.detach() for p in params]),
        )
        if params:
            g = [gi.to(acc_dtype(gi)) for gi in fp.grads]
            g_norm = global_norm(g)
            fp.stats["grad_norm"] = g_norm
            e = self._perturbation(fp, g, g_norm, self._scale(fp.t))
            torch._foreach_add_(params, list(e))  # p.add_(e) per tensor, fused
        self._pending = fp
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        """Restore theta, form the update gradient from ``g`` and ``.grad = g_p``, step the base.

        A parameter without a first-pass gradient gets ``.grad = None`` (not updated, even if
        the second pass gave it one); one without a second-pass gradient uses ``g_p = 0``.

        Args:
            zero_grad: zero the gradients after the base optimizer's step.
        """
        fp = self._pending
        if fp is None:
            raise RuntimeError("second_step() without first_step()")
        self._pending = None
        stepped = {id(p) for p in fp.params}
        for group in self.param_groups:  # no first-pass gradient: not updated (pitfall 6)
            for p in group["params"]:
                if id(p) not in stepped:
                    p.grad = None
        if fp.params:
            torch._foreach_copy_(fp.params, fp.backup)
        for p in fp.params:
            if p.grad is None:  # no gradient in the second pass: g_p = 0
                p.grad = torch.zeros_like(p)
        stats = dict(fp.stats)
        if fp.params:
            g_p = [p.grad for p in fp.params]
            gp_norm = global_norm(g_p)
            stats["grad_p_norm"] = gp_norm
            stats["cos_g_gp"] = cosine(global_dot(fp.grads, g_p), stats["grad_norm"], gp_norm)
            if fp.ema is not None:
                m_norm = stats["ema_norm"]
                stats["cos_gp_m"] = cosine(global_dot(g_p, fp.ema), gp_norm, m_norm)
            if self.every > 1:
                stats["gv_norm"] = self._store_direction(fp, g_p)
            self._combine(fp.grads, g_p)
        if fp.ema is not None:
            for p, m in zip(fp.params, fp.ema):
                self.state[p]["ema"] = m
        self.num_steps = fp.t
        self.base_optimizer.step()
        self._opt_called = True  # torch LR schedulers check it when step() is not used
        self.last_stats = stats
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def restore(self) -> None:
        """Undo ``first_step``: parameters back bit-exactly, no update, state unchanged.

        The pending moving average and step number are discarded (they are committed only in
        ``second_step``); ``.grad`` is left as it is. A no-op without a pending ``first_step``.
        """
        fp = self._pending
        if fp is None:
            return
        self._pending = None
        if fp.params:
            torch._foreach_copy_(fp.params, fp.backup)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, loss: Any = None) -> Any:
        """One full sharpness-aware update.

        Args:
            closure: forward + backward at the current parameters, returning the loss (it need
                not zero the gradients). Called once at the perturbed point; called first at
                theta as well when no parameter has a ``.grad`` (then it runs twice).
            loss: the first-pass loss, returned as is.

        Returns:
            The first-pass loss: ``loss`` if given, else the closure's first-pass value when it
            was called at theta, else None.
        """
        if closure is None:
            raise RuntimeError(
                f"{type(self).__name__}.step() needs a closure (forward + backward); or call "
                "first_step() and second_step() around your own second pass"
            )
        closure = torch.enable_grad()(closure)
        if all(p.grad is None for group in self.param_groups for p in group["params"]):
            first_loss = closure()
            loss = first_loss if loss is None else loss
        if not self.second_pass_due():
            self.single_step()
            return loss
        self.first_step(zero_grad=True)
        closure()
        self.second_step()
        return loss

    # ---------------------------------------------------------------------- state dicts
    def _all_params(self) -> list[Tensor]:
        return list(chain.from_iterable(group["params"] for group in self.param_groups))

    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's state dict plus ``"sharpness"``: step counter and averages.

        Plain tensors, numbers, strings, lists and dicts (``torch.load(weights_only=True)``
        loads it); the transient copies of ``first_step`` are not included.
        """
        sd = self.base_optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(self._all_params())}
        own = {index[id(p)]: dict(s) for p, s in self.state.items() if s and id(p) in index}
        sd["sharpness"] = {
            "num_steps": self.num_steps,
            "variant": self.variant,
            "schedule": self.schedule,
            "update": self.update_rule,
            "state": own,
        }
        if self._generator is not None:
            sd["sharpness"]["generator"] = self._generator.get_state()
        extra = self._extra_state()
        if extra is not None:
            sd["sharpness"]["extra"] = extra
        return sd

    def _extra_state(self) -> dict | None:
        """State that is not per parameter (SAF's recorded outputs), for the state dict."""
        return None

    def _load_extra_state(self, extra: dict | None) -> None:
        """Load what :meth:`_extra_state` returned (None: a state dict without it)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict of :meth:`state_dict` (or a plain base optimizer's: averages restart)."""
        if self._pending is not None:
            raise RuntimeError("load_state_dict() between first_step() and second_step()")
        state_dict = dict(state_dict)
        own = state_dict.pop("sharpness", None)
        self.base_optimizer.load_state_dict(state_dict)
        self.param_groups = self.base_optimizer.param_groups  # load made a new list
        self.state = defaultdict(dict)
        if own is None:
            logger.warning("%s: no sharpness-aware state in the state dict", type(self).__name__)
            self.num_steps = 0
            return
        saved = (own.get("variant"), own.get("schedule"), own.get("update", self.update_rule))
        if saved != (self.variant, self.schedule, self.update_rule):
            logger.warning(
                "%s: state dict of variant %s / schedule %s / update %s loaded into %s / %s / %s",
                type(self).__name__,
                *saved,
                self.variant,
                self.schedule,
                self.update_rule,
            )
        params = self._all_params()
        for idx, s in own["state"].items():
            p = params[int(idx)]
            self.state[p] = {
                k: v.detach().clone().to(p.device) if isinstance(v, Tensor) else v
                for k, v in s.items()
            }
        self.num_steps = int(own["num_steps"])
        self._load_extra_state(own.get("extra"))
        gen = own.get("generator")
        self._generator_state = gen.clone() if gen is not None else None
        if self._generator is not None and gen is not None:
            self._generator.set_state(gen)
