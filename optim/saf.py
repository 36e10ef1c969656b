"""SAF: Sharpness-Aware training for Free (Du et al., NeurIPS 2022; code AngusDujw/SAF).

SAF replaces SAM's second pass by a *trajectory loss*: the KL divergence between the softened
outputs the model gave the same item ``E`` epochs earlier and its current ones (Du et al.,
Eq. 6 and Alg. 1; the authors' ``SAF_train.py``)::

    p_i^(e-E) = softmax(y_i^(e-E) / tau),   q_i = softmax(f_theta(x_i) / tau)
    L = L_trainer + lam * tau^2 * mean_i KL(p_i^(e-E) || q_i)      (from epoch TRAJ_START on)

``y_i^(e)`` are the logits recorded for item ``i`` (its dataset index) in epoch ``e``, kept for
the last ``E + 1`` epochs (memory ``items x (E + 1) x classes`` floats: small for few-shot sets);
with augmentation the recorded outputs are of another view of the item, as in the paper. The
mean runs over the batch's items that have a record from epoch ``e - E`` (an item without one
adds nothing). One forward/backward per step: the term needs only the logits the trainer
already computes (``TrainerX.classification_loss``) and the items' indices (the engine's data
loader gives them). The base optimizer steps with the gradient of ``L``.

Hyper-parameters of the authors' README and ImageNet recipe: ``lam = 0.3`` (``--reinforce``),
``tau = 5``, ``E = 2`` (``--minus_epoch``); the term starts at the authors' epoch 5 on a 90- to
300-epoch schedule ("the beginning epoch or 30% of the epochs"). Prompt learners train 5 to 50
epochs, so ``TRAJ_START`` defaults to 0 (from the first epoch that has a record ``E`` epochs
back) and the per-trainer configs set it near 30% of the schedule. ``TRAJ_START`` counts as the
authors' ``--kl_start_epoch``: their code (a 0-based epoch loop) applies the term for ``epoch >
kl_start_epoch``, and so does this one for ``epoch > TRAJ_START`` (0-based ``self.epoch``): the
published ``--kl_start_epoch 5`` is ``TRAJ_START 5``, the term from the 7th epoch on; ``-1``
applies it from the first epoch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .build import POS, HParam, declare_hparam, positive, register_optimizer
from .sharpness import BEGIN_STEP, INDEX, OUTPUTS, SharpnessAwareOptimizer, acc_dtype, global_norm
from .step import require_batch


def trajectory_kl(logits: Tensor, target_logits: Tensor, tau: float) -> Tensor:
    """Per item ``tau^2 * KL(softmax(target / tau) || softmax(logits / tau))`` (fp32 at least)."""
    dtype = torch.promote_types(acc_dtype(logits), target_logits.dtype)
    log_q = F.log_softmax(logits.to(dtype) / tau, dim=-1)
    log_p = F.log_softmax(target_logits.to(dtype) / tau, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1) * (tau * tau)


TRAJ_WEIGHT = declare_hparam(
    HParam(
        "TRAJ_WEIGHT",
        "weight",
        -1.0,
        "saf/mesa: weight lambda of the KL term; < 0: saf 0.3, mesa 0.8",
    )
)
TEMPERATURE = declare_hparam(
    HParam(
        "TEMPERATURE",
        "temperature",
        5.0,
        "saf/mesa: softmax temperature tau of the KL term",
        positive,
        POS,
    )
)
TRAJ_START = declare_hparam(
    HParam(
        "TRAJ_START",
        "start_epoch",
        0,
        "saf/mesa: the KL term in the epochs after this one (0-based epochs > TRAJ_START), "
        "as the authors' --kl_start_epoch; -1: from the first epoch",
        lambda v: v >= -1,
        "an integer >= -1 (the term in the 0-based epochs > TRAJ_START)",
    )
)
EPOCHS_BACK = declare_hparam(
    HParam(
        "EPOCHS_BACK",
        "epochs_back",
        2,
        "saf: the KL target is the output recorded E epochs earlier",
        lambda v: v >= 1,
        "an integer >= 1",
    )
)


class TrajectoryOptimizer(SharpnessAwareOptimizer):
    """Shared by SAF and MESA: one pass, a trajectory loss on the logits, the base step."""

    VARIANTS = ("paper",)
    UPDATE = {"paper": "perturbed"}
    DEFAULT_WEIGHT = 0.0
    NAME = ""

    def __init__(
        self,
        params,
        base_optimizer=torch.optim.SGD,
        weight: float = TRAJ_WEIGHT.default,
        temperature: float = TEMPERATURE.default,
        start_epoch: int = TRAJ_START.default,
        **base_kwargs,
    ):
        weight = self.DEFAULT_WEIGHT if weight < 0 else weight
        TEMPERATURE.check(temperature)
        TRAJ_START.check(start_epoch)
        self.weight, self.temperature = float(weight), float(temperature)
        self.start_epoch = int(start_epoch)
        super().__init__(params, base_optimizer, {}, **base_kwargs)

    def second_pass_due(self) -> bool:
        return False

    def _term(self, logits: Tensor, target: Tensor, valid: Tensor | None = None) -> Tensor:
        """``weight *`` the mean trajectory KL over the (valid) items; logged as traj_loss."""
        kl = trajectory_kl(logits, target, self.temperature)
        if valid is None:
            term = kl.mean()
        else:
            term = (kl * valid).sum() / valid.sum().clamp_min(1)
        self._traj = term.detach()
        return self.weight * term

    @torch.no_grad()
    def single_step(self) -> None:
        """The base optimizer's step with ``.grad`` = the gradient of loss + trajectory term."""
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        stats = {"grad_norm": global_norm(grads)} if grads else {}
        traj = getattr(self, "_traj", None)
        if traj is not None:
            stats["traj_loss"] = traj
        self._traj = None
        self.num_steps += 1
        self.base_optimizer.step()
        self._opt_called = True
        self.after_step()
        self.last_stats = stats

    def after_step(self) -> None:
        """Called after the base optimizer's step (MESA updates its EMA)."""

    def step(self, closure=None, loss=None):
        raise RuntimeError(
            f"{type(self).__name__} reads the trainer's logits: it steps through the engine's "
            "step object (optim.step.OptimizerStep with a StepBatch), not step(closure)"
        )


class SAF(TrajectoryOptimizer):
    """SAF; see the module docstring for the equations.

    Args:
        params: parameters or param-group dicts.
        base_optimizer: base optimizer class (default SGD).
        weight: lam, the weight of the trajectory loss (< 0: the default 0.3).
        temperature: tau.
        start_epoch: the trajectory loss in the 0-based epochs > start_epoch (-1: all).
        epochs_back: E, the age in epochs of the recorded outputs (>= 1).
        **base_kwargs: base optimizer arguments (lr, momentum, weight_decay, ...).
    """

    DEFAULT_WEIGHT = 0.3
    STEP_NEEDS = frozenset({BEGIN_STEP, OUTPUTS, INDEX})

    def __init__(
        self,
        params,
        base_optimizer=torch.optim.SGD,
        weight: float = TRAJ_WEIGHT.default,
        temperature: float = TEMPERATURE.default,
        start_epoch: int = TRAJ_START.default,
        epochs_back: int = EPOCHS_BACK.default,
        **base_kwargs,
    ):
        if int(epochs_back) != epochs_back:
            raise ValueError(f"Invalid epochs_back: {epochs_back} (an integer >= 1)")
        EPOCHS_BACK.check(epochs_back)
        self.epochs_back = int(epochs_back)
        super().__init__(params, base_optimizer, weight, temperature, start_epoch, **base_kwargs)
        self.records: Tensor | None = None  # [items, E + 1, classes] logits (fp32)
        self.record_epoch: Tensor | None = None  # [items, E + 1] epoch of each record, -1: none

    def _slots(self, size: int, n_cls: int, device, dtype) -> None:
        """Grow the record store to ``size`` items (a new store for a new number of classes)."""
        e1 = self.epochs_back + 1
        if self.records is None or self.records.shape[2] != n_cls:
            self.records = torch.zeros(0, e1, n_cls, device=device, dtype=dtype)
            self.record_epoch = torch.zeros(0, e1, dtype=torch.long, device=device)
        have = self.records.shape[0]
        if size > have:
            self.records = torch.cat([self.records, self.records.new_zeros(size - have, e1, n_cls)])
            pad = self.record_epoch.new_full((size - have, e1), -1)
            self.record_epoch = torch.cat([self.record_epoch, pad])

    def extra_loss(self, batch, epoch: int):
        """Record this pass's logits; after ``start_epoch``, the KL to those of ``e - E``."""
        batch = require_batch(batch, "SAF")
        logits = batch.first_outputs("SAF").logits
        index = batch.require_index("SAF").to(logits.device)
        sync = getattr(batch, "sync", None)
        every_index, every_logits = index, logits.detach()
        if sync is not None:  # data-parallel (#29): every process records the global batch
            every_index, _ = sync.gather_items(index)
            every_logits, _ = sync.gather_items(every_logits)
        size = int(every_index.max()) + 1
        self._slots(size, logits.shape[-1], logits.device, acc_dtype(logits))
        e1 = self.epochs_back + 1
        slot = epoch % e1
        self.records[every_index, slot] = every_logits.to(self.records.dtype)
        self.record_epoch[every_index, slot] = epoch
        past = epoch - self.epochs_back
        if epoch <= self.start_epoch or past < 0:
            return None
        valid = (self.record_epoch[index, past % e1] == past).to(self.records.dtype)
        if sync is None:
            return self._term(logits, self.records[index, past % e1], valid)
        # the global mean over the valid items: sum_r (n_r / N) * term_r with
        # term_r = (N / n_r) * sum_{valid, r} kl / V  (V valid items in the global batch)
        n_local = float(index.numel())
        n_all, n_valid = float(every_index.numel()), sync.total(float(valid.sum()))
        kl = trajectory_kl(logits, self.records[index, past % e1], self.temperature)
        term = (kl * valid).sum() / max(n_valid, 1.0) * (n_all / n_local)
        self._traj = term.detach()
        return self.weight * term

    def _extra_state(self):
        """The recorded logits and the epoch of each record."""
        if self.records is None:
            return None
        return {"records": self.records, "record_epoch": self.record_epoch}

    def _load_extra_state(self, extra):
        self.records = self.record_epoch = None
        if extra is not None:
            device = self.param_groups[0]["params"][0].device
            self.records = extra["records"].detach().clone().to(device)
            self.record_epoch = extra["record_epoch"].detach().clone().to(device)


register_optimizer(
    "saf",
    SAF,
    "SAF (Du et al. 2022): one pass plus a KL to the outputs recorded E epochs earlier",
    kind="sharpness",
    needs_closure=False,
    hparams=("TRAJ_WEIGHT", "TEMPERATURE", "TRAJ_START", "EPOCHS_BACK"),
    test_kwargs=dict(weight=0.3, temperature=2.0, start_epoch=0, epochs_back=1),
    efficient=True,
)
