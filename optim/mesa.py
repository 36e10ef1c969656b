"""MESA: Memory-Efficient Sharpness-Aware training (Du et al., "Sharpness-Aware Training for
Free", NeurIPS 2022, Sec. 4.3; code AngusDujw/SAF ``MESA_train.py``).

MESA is SAF (:mod:`optim.saf`) with the recorded outputs replaced by those of an exponential
moving average of the weights::

    w_ema <- d * w_ema + (1 - d) * w                 (after every base step)
    p_i = softmax(f_{w_ema}(x_i) / tau),   q_i = softmax(f_w(x_i) / tau)
    L = L_trainer + lam * tau^2 * mean_i KL(p_i || q_i)        (from epoch TRAJ_START on)

The EMA covers the optimizer's trainable parameters (for a prompt learner: the prompts), is kept
in at least fp32 (state "ema_w", in the state dict) and starts as a copy of the weights at the
first step of the sharpness-aware stage (the authors' timm ``ModelEmaV2`` copies the model when
training starts). The EMA model's logits come from one extra forward without gradients on the
same batch (the weights are swapped for the EMA before the first pass and back), so a step is
one forward/backward plus one forward; the engine runs that forward, which needs no gradients,
with each group's common prompt prefix encoded once (``engine.clip.text.shared_prefix_text(model)``:
the same logits up to fp32 rounding, for a fraction of the text encoder's cost).
Hyper-parameters of the authors' README and recipe:
``lam = 0.8`` (``--reinforce``), ``tau = 5``, ``d = 0.9998`` (``--model-ema-decay``); the start
epoch as SAF's (``TRAJ_START``). With few-shot schedules of a few thousand steps, ``d = 0.9998``
keeps the EMA close to the initial prompts: the term then pulls toward the start, like
KgCoOp's regulariser (``OPTIM.SAM.EMA_DECAY`` sets another decay).
"""

from __future__ import annotations

import torch

from .build import HParam, declare_hparam, register_optimizer
from .saf import TEMPERATURE, TRAJ_START, TRAJ_WEIGHT, TrajectoryOptimizer
from .sharpness import BEGIN_STEP, OUTPUTS, REPASS, acc_dtype, copies
from .step import require_batch

EMA_DECAY = declare_hparam(
    HParam(
        "EMA_DECAY",
        "ema_decay",
        0.9998,
        "mesa: decay of the EMA of the learnable weights, per step",
        lambda v: 0 <= v < 1,
        "a number in [0, 1)",
    )
)


class MESA(TrajectoryOptimizer):
    """MESA; see the module docstring for the equations.

    Args:
        params: parameters or param-group dicts.
        base_optimizer: base optimizer class (default SGD).
        weight: lam, the weight of the trajectory loss (< 0: the default 0.8).
        temperature: tau.
        start_epoch: the trajectory loss in the 0-based epochs > start_epoch (-1: all).
        ema_decay: d, the per-step decay of the EMA weights, in [0, 1).
        **base_kwargs: base optimizer arguments (lr, momentum, weight_decay, ...).
    """

    DEFAULT_WEIGHT = 0.8
    STEP_NEEDS = frozenset({BEGIN_STEP, OUTPUTS, REPASS})  # the EMA model's pass: a forward

    def __init__(
        self,
        params,
        base_optimizer=torch.optim.SGD,
        weight: float = TRAJ_WEIGHT.default,
        temperature: float = TEMPERATURE.default,
        start_epoch: int = TRAJ_START.default,
        ema_decay: float = EMA_DECAY.default,
        **base_kwargs,
    ):
        EMA_DECAY.check(ema_decay)
        self.ema_decay = float(ema_decay)
        super().__init__(params, base_optimizer, weight, temperature, start_epoch, **base_kwargs)
        self._teacher: torch.Tensor | None = None

    def _trainable(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    @torch.no_grad()
    def _ema_weights(self) -> list[torch.Tensor]:
        """The EMA of each trainable parameter (a copy of it when it has none yet)."""
        out = []
        for p in self._trainable():
            st = self.state[p]
            if "ema_w" not in st:
                st["ema_w"] = p.detach().to(acc_dtype(p)).clone()
            out.append(st["ema_w"])
        return out

    @torch.no_grad()
    def before_forward(self, batch, epoch: int) -> None:
        """After ``start_epoch``: the EMA model's logits on this batch (one forward)."""
        self._teacher = None
        ema = self._ema_weights()
        if epoch <= self.start_epoch:
            return
        batch = require_batch(batch, "MESA")
        params = self._trainable()
        backup = copies([p.detach() for p in params])
        for p, w in zip(params, ema):
            p.copy_(w)
        try:
            logits = batch.outputs(who="MESA").logits
            self._teacher = logits.detach().to(acc_dtype(logits))
        finally:
            torch._foreach_copy_(params, backup)

    def extra_loss(self, batch, epoch: int):
        if self._teacher is None:
            return None
        teacher, self._teacher = self._teacher, None
        logits = require_batch(batch, "MESA").first_outputs("MESA").logits
        return self._term(logits, teacher)

    def restore_single(self) -> None:
        self._teacher = None

    @torch.no_grad()
    def after_step(self) -> None:
        """``w_ema <- d * w_ema + (1 - d) * w`` for every trainable parameter."""
        d = self.ema_decay
        for p, w in zip(self._trainable(), self._ema_weights()):
            w.mul_(d).add_(p.detach().to(w.dtype), alpha=1 - d)


register_optimizer(
    "mesa",
    MESA,
    "MESA (Du et al. 2022): one pass plus a KL to the outputs of an EMA of the weights",
    kind="sharpness",
    needs_closure=False,
    hparams=("TRAJ_WEIGHT", "TEMPERATURE", "TRAJ_START", "EMA_DECAY"),
    test_kwargs=dict(weight=0.8, temperature=2.0, start_epoch=0, ema_decay=0.5),
    efficient=True,
)
