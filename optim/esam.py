"""ESAM (Du et al., "Efficient Sharpness-aware Minimization for Improved Training of Neural
Networks", ICLR 2022; code dydjw9/Efficient_SAM).

SAM with two savings (Du et al., Sec. 3 and Alg. 1):

- Stochastic weight perturbation (SWP): only a random subset of the weights is perturbed; each
  entry is kept with probability ``beta`` and the kept part is scaled by ``1 / beta`` (the
  authors' code: ``rho / (||g|| + eps) / beta``)::

      m ~ Bernoulli(beta) per entry,   e = rho / beta * (m * g) / (||g|| + 1e-12)     (paper)
                                       e = rho / beta * (m * g) / (||m * g|| + 1e-7)  (reference)

  ``variant`` (``OPTIM.SAM.VARIANT``): ``paper`` scales by the norm of the full gradient, as Du
  et al. write SWP (Eq. 5, the SAM perturbation of the full gradient, masked); ``reference``
  scales by the norm of the perturbed coordinates' gradient, as the authors' released
  ``utils/Esam.py`` does (there the tensors skipped by the previous step have no gradient, so
  its ``_grad_norm`` runs over the perturbed ones only; its guard is ``1e-7``). With
  ``beta = 1`` the two differ only in the guard.

  The authors draw one Bernoulli per *tensor* (a whole tensor is skipped, which saves its
  backward on a network of many tensors); a prompt learner has one to a few tensors, so this
  project draws per entry, the paper's definition of SWP (Eq. 5), which saves no backward here.
- Sharpness-sensitive data selection (SDS): after the move to ``theta + e`` a forward without
  gradients on the whole batch gives the per-item losses ``l_i(theta + e)``; the second pass
  (forward and backward) runs only on the ``floor(gamma * B)`` items (at least one) with the
  largest increase ``l_i(theta + e) - l_i(theta)`` (``l_i(theta)`` from the first pass). With
  ``gamma = 1`` the second pass is on the whole batch and the extra forward is skipped::

      theta <- base_step(theta, grad L_S+(theta + e)),   S+ = top-gamma items by the increase

Two schedules of the selected pass (``select_pass``, ``OPTIM.SAM.SELECT_PASS``), the same update
when the trainer's regularisers do not depend on the items (CoOp, KgCoOp, TCP; in "masked" an
item-dependent regulariser stays over the whole batch):

- "subset" (the authors'): a forward without gradients on the batch for ``l_i(theta + e)``, then
  a forward and backward on the selected items. Cheaper where a step's work grows with the
  items (large batches through a prompted image encoder).
- "masked": one forward with gradients on the batch gives ``l_i(theta + e)``; the backward is
  of the trainer's loss with its cross-entropy replaced by the mean over the selected items,
  ``L - CE + mean_{S+} l_i``. Cheaper where the class prompts' text-encoder work, which does
  not shrink with the items, dominates (CoOp, KgCoOp, TCP; the deep-prompt trainers at their
  published batch of 4): there "subset" costs a forward more than SAM. Their per-trainer
  configs use it (CoCoOp's, with per-image text features, keeps "subset").

Per-item losses are the cross-entropy terms the trainer records
(``TrainerX.classification_loss``); batch-level regularisers (KgCoOp's, PromptSRC's, CoPrompt's)
enter the second pass unchanged on the selected items. The selected items keep the batch order
(ties broken by ``torch.topk``). The random masks come from the optimizer's generator (saved in
the state dict). Defaults: ``beta = 0.6``, ``gamma = 0.5`` (the authors' CIFAR recipe) and
``rho = 0.05`` (this project's SAM default). Cost: "subset" one forward/backward, one forward
without gradients and a forward/backward on ``gamma`` of the batch; "masked" SAM's two. The
selection needs the step's batch (:class:`optim.step.StepBatch`, given by the engine's step
object); through ``step(closure)`` the closure's loss is the second pass (no selection).
"""

from __future__ import annotations

import torch

from .build import HParam, declare_hparam, register_optimizer
from .errors import OptimConfigError
from .sharpness import (
    EPS,
    OUTPUTS,
    REPASS,
    RHO,
    SCHEDULE,
    VARIANT,
    SharpnessAwareOptimizer,
    global_norm,
    per_group,
    scaled,
)
from .step import NO_OUTPUTS, require_batch

BETA = declare_hparam(
    HParam(
        "BETA",
        "beta",
        0.6,
        "esam: fraction of the weights perturbed (SWP), in (0, 1]",
        lambda v: 0 < v <= 1,
        "a number in (0, 1]",
    )
)
GAMMA = declare_hparam(
    HParam(
        "GAMMA",
        "gamma",
        0.5,
        "esam: fraction of the batch in the second pass (SDS), in (0, 1]",
        lambda v: 0 < v <= 1,
        "a number in (0, 1]",
    )
)
SELECT_PASS = declare_hparam(
    HParam(
        "SELECT_PASS",
        "select_pass",
        "subset",
        "esam: the selected pass: subset (a forward without gradients on the batch, then "
        "forward + backward on the selected items) | masked (one forward with gradients on the "
        "batch, backward of the selected items' loss)",
        choices=("subset", "masked"),
    )
)


REFERENCE_EPS = 1e-7  # the guard of the authors' Esam.py: rho / (||g_S|| + 1e-7) / beta


class ESAM(SharpnessAwareOptimizer):
    """ESAM; see the module docstring for the equations.

    Args:
        params: parameters or param-group dicts.
        base_optimizer: base optimizer class (default SGD).
        rho: perturbation radius (>= 0, may be set per param group).
        beta: probability that an entry is perturbed, in (0, 1].
        gamma: fraction of the batch in the second pass, in (0, 1].
        select_pass: "subset" or "masked" (the schedule of the selected pass, module docstring).
        schedule: "constant" or "inv_sqrt" (rho / sqrt(t)).
        **base_kwargs: base optimizer arguments (lr, momentum, weight_decay, ...).
    """

    VARIANTS = ("paper", "reference")
    UPDATE = {"paper": "perturbed", "reference": "perturbed"}
    SELECT_PASSES = SELECT_PASS.choices

    def __init__(
        self,
        params,
        base_optimizer=torch.optim.SGD,
        rho: float = RHO.default,
        beta: float = BETA.default,
        gamma: float = GAMMA.default,
        select_pass: str = SELECT_PASS.default,
        variant: str = VARIANT.default,
        schedule: str = SCHEDULE.default,
        **base_kwargs,
    ):
        for hparam, value in ((SELECT_PASS, select_pass), (BETA, beta), (GAMMA, gamma)):
            hparam.check(value)
        self.select_pass = select_pass
        self.beta, self.gamma = float(beta), float(gamma)
        super().__init__(
            params, base_optimizer, dict(rho=rho), variant, schedule=schedule, **base_kwargs
        )

    def _perturbation(self, fp, g, g_norm, scale):
        gen = self.generator(g[0].device)
        masks = [torch.rand(gi.shape, generator=gen, device=gi.device) < self.beta for gi in g]
        masked = [gi * m for gi, m in zip(g, masks)]
        if self.variant == "reference":  # the norm of the perturbed coordinates' gradient
            denom = (global_norm(masked) + REFERENCE_EPS) * self.beta
        else:
            denom = (g_norm + EPS) * self.beta
        fp.stats["perturbed"] = torch.stack([m.sum() for m in masks]).sum().to(g_norm.dtype) / sum(
            m.numel() for m in masks
        )
        return scaled(masked, per_group(fp.groups, lambda gr: gr["rho"] * scale / denom))

    def step_needs(self) -> frozenset[str]:
        """With ``gamma < 1`` the selection needs the first pass's per-item losses and a pass
        on the selected items (or the whole batch, ``masked``)."""
        needs = super().step_needs()
        return needs | {OUTPUTS, REPASS} if self.gamma < 1 else needs

    def select(self, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
        """The items of the second pass: the ``max(1, floor(gamma * B))`` largest increases
        ``after - before`` (1-D indices in batch order)."""
        n = before.numel()
        k = max(1, int(n * self.gamma))
        return torch.topk(after - before, k).indices.sort().values

    def second_pass_loss(self, batch, loss_fn):
        """The loss at ``theta + e`` on the selected items (all of them with ``gamma = 1``)."""
        if self.gamma >= 1:
            return loss_fn()
        batch = require_batch(batch, "ESAM's data selection (OPTIM.SAM.GAMMA < 1)")
        if getattr(batch, "sync", None) is not None:  # data-parallel (#29)
            return self._distributed_second_pass(batch)
        before = batch.first_outputs("ESAM's data selection").sample_loss()
        if max(1, int(before.numel() * self.gamma)) >= before.numel():
            return batch.loss()  # every item selected (e.g. a batch of 1): no extra forward
        stats = self._pending.stats
        stats["selected"] = torch.tensor(
            max(1, int(before.numel() * self.gamma)) / before.numel(),
            dtype=stats["grad_norm"].dtype,
        )
        if self.select_pass == "subset":
            after = batch.outputs(who="ESAM's data selection").sample_loss()
            return batch.loss(self.select(before, after))
        loss, out = batch.forward(None)  # with gradients, on the whole batch
        if out is None or out.ce is None:
            raise OptimConfigError(f"ESAM's masked selection {NO_OUTPUTS}")
        items = out.sample_loss(graph=True)
        subset = self.select(before, items.detach())
        return loss - out.ce + items[subset].mean()

    def _distributed_second_pass(self, batch):
        """The selection over the *global* batch (data-parallel, :mod:`optim.distributed`):
        the per-item losses of every process are gathered, the global top items chosen as one
        process would, and each process runs its pass on its own selected items; its gradient
        weight (``batch.count``) is its number of selected items, so the all-reduced gradient
        is that of the mean over the global selection ("subset"). In "masked" the process's
        loss is rescaled so that its batch-share weight gives the same sum."""
        sync = batch.sync
        before_local = batch.first_outputs("ESAM's data selection").sample_loss()
        before, offset = sync.gather_items(before_local)
        n_local, n = before_local.numel(), before.numel()
        k = max(1, int(n * self.gamma))
        if k >= n:
            return batch.loss()  # every item selected: the full pass, the batch-share weight
        stats = self._pending.stats
        stats["selected"] = torch.tensor(k / n, dtype=stats["grad_norm"].dtype)

        def local(subset):  # this process's part of the global selection, local indices
            mine = subset[(subset >= offset) & (subset < offset + n_local)]
            return (mine - offset).to(before_local.device)

        if self.select_pass == "subset":
            after_local = batch.outputs(who="ESAM's data selection").sample_loss()
            after, _ = sync.gather_items(after_local)
            mine = local(self.select(before, after))
            batch.count = int(mine.numel())
            if batch.count == 0:  # none of this process's items: a zero gradient, same collectives
                return torch.zeros((), requires_grad=True)
            return batch.loss(mine)
        loss, out = batch.forward(None)  # with gradients, on this process's items
        if out is None or out.ce is None:
            raise OptimConfigError(f"ESAM's masked selection {NO_OUTPUTS}")
        items = out.sample_loss(graph=True)
        all_items, _ = sync.gather_items(items.detach())
        mine = local(self.select(before, all_items))
        # weight n_local / N (batch.count): (L - CE) keeps its share, the selected items' sum
        # enters as sum_{S_r} l_i / k
        return loss - out.ce + items[mine].sum() * (n / (k * n_local))


register_optimizer(
    "esam",
    ESAM,
    "ESAM (Du et al. 2022): SAM with a random subset of weights perturbed and the second pass "
    "on the batch's sharpest items",
    kind="sharpness",
    needs_closure=True,
    hparams=("RHO", "BETA", "GAMMA", "SELECT_PASS", "VARIANT", "SCHEDULE"),
    test_kwargs=dict(rho=0.05, beta=0.6, gamma=0.5),
    efficient=True,
)
