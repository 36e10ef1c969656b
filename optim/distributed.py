"""Data-parallel gradients: the one mechanism through which every optimizer step sees the
gradient of the *global* batch (docs/distributed.md).

In a data-parallel run each process holds a contiguous shard of every global batch (the
shards of one batch, in rank order, are the batch: :mod:`engine.data.distributed`). A process's
loss is its trainer's loss on its shard; the one-process loss is the global batch's, and for
the losses of this project (means over the items plus terms that do not depend on the items)

    L_global = sum_r (n_r / N) * L_r          (n_r items on rank r, N = sum_r n_r)

so the global gradient is ``sum_r (n_r / N) * grad L_r``: every pass's gradients are weighted
by the process's share and summed over the processes (one SUM all-reduce of one flat buffer).
:class:`GradientSync` does that; :class:`optim.step.OptimizerStep` calls it after *every*
backward whose gradients an optimizer reads (the first pass, a sharpness-aware optimizer's
second pass, under AMP too), so no optimizer has a distributed special case for its gradients.
The weight is carried with the step's batch (:attr:`optim.step.StepBatch.count`, the items the
pass ran on): an optimizer whose second pass runs on a part of the batch (ESAM) sets it.

Per-item records that need the whole batch (ESAM's selection by the global loss ranking,
SAF's recorded logits) gather the items with :meth:`GradientSync.gather_items`.

``local_ascent`` (``DISTRIBUTED.LOCAL_ASCENT``, m-sharpness): the first pass of a two-pass step
is *not* all-reduced, so each process climbs along its own shard's gradient, and only the
perturbed gradients are averaged. That is another method (Foret et al.'s m-sharpness with
m = the shard size), cheaper by one all-reduce per step; it is refused for optimizers whose
update or state reads the first-pass gradient (their processes would drift apart).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .errors import OptimConfigError


def _flag_dtype(dtypes: set[torch.dtype]) -> torch.dtype:
    """The dtype of the all-reduced buffer: float64 if any gradient is, else float32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


class GradientSync:
    """Weighted SUM all-reduce of gradients over a process group (see the module docstring).

    Args:
        group: the process group (None: the default group).
        local_ascent: m-sharpness: the first pass of a two-pass step stays per process.
    """

    def __init__(self, group=None, local_ascent: bool = False):
        self.group = group
        self.local_ascent = bool(local_ascent)
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.calls = 0  # all-reduces of gradients so far (tests, the cost model)
        self.bytes = 0  # bytes of the last gradient buffer

    # -- gradients ----------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, params: Sequence[Tensor], count: float) -> None:
        """Replace each ``p.grad`` by ``sum_r count_r * grad_r / sum_r count_r``.

        A parameter without a gradient on this process counts as a zero gradient when another
        process has one (an empty shard of a selected subset); one without a gradient on every
        process keeps ``grad = None`` (not updated, as in one process).
        """
        params = list(params)
        grads = [p.grad for p in params]
        dtype = _flag_dtype({p.dtype for p in params})  # the same on every process
        sizes = [p.numel() for p in params]
        parts = []
        for p, g in zip(params, grads):
            if g is None:
                parts.append(torch.zeros(p.numel(), dtype=dtype, device=p.device))
            else:
                parts.append(g.detach().reshape(-1).to(dtype) * count)
        device = params[0].device if params else torch.device("cpu")
        present = torch.tensor([g is not None for g in grads], dtype=dtype, device=device)
        total = torch.tensor([float(count)], dtype=dtype, device=device)
        buf = torch.cat([*parts, present, total])
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
        self.calls += 1
        self.bytes = buf.numel() * buf.element_size()
        *flags, n_total = buf[-1 - len(params) :].tolist()  # one host transfer
        if n_total <= 0:
            raise RuntimeError("GradientSync: no process contributed an item to this pass")
        offset = 0
        for i, (p, n) in enumerate(zip(params, sizes)):
            chunk = buf[offset : offset + n]
            offset += n
            if flags[i] == 0:
                continue
            value = (chunk / buf[-1]).view_as(p)
            if p.grad is None:
                p.grad = value.to(p.dtype)
            else:
                p.grad.copy_(value)

    # -- items of the global batch -------------------------------------------------------------
    def _device(self) -> torch.device:
        """Where this group's collectives take their tensors (NCCL: the GPU; gloo: the CPU)."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def total(self, value: float) -> float:
        """``sum_r value_r`` over the processes (a number)."""
        t = torch.tensor([float(value)], dtype=torch.float64, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return float(t)

    def gather_items(self, t: Tensor) -> tuple[Tensor, int]:
        """The rows of ``t`` (``[n_r, ...]`` per process) of every process, in rank order (the
        global batch's order), and the offset of this process's rows in it."""
        device = self._device()
        n = torch.tensor([t.shape[0]], dtype=torch.long, device=device)
        counts = [torch.zeros_like(n) for _ in range(self.world_size)]
        dist.all_gather(counts, n, group=self.group)
        counts = [int(c) for c in counts]
        pad = t.new_zeros((max(counts) - t.shape[0], *t.shape[1:]))
        src = torch.cat([t.detach(), pad]).contiguous().to(device)
        out = [torch.empty_like(src) for _ in range(self.world_size)]
        dist.all_gather(out, src, group=self.group)
        rows = torch.cat([o[:c] for o, c in zip(out, counts)]).to(t.device)
        return rows, sum(counts[: self.rank])


def check_local_ascent(opt) -> None:
    """Refuse m-sharpness for an optimizer that reads the first-pass gradient beyond the ascent
    (its processes would hold different parameters or state)."""
    name = type(opt).__name__
    reasons = []
    if getattr(opt, "update_rule", "perturbed") != "perturbed":
        reasons.append(f"its update uses the first-pass gradient ({opt.update_rule})")
    if getattr(opt, "every", 1) > 1:
        reasons.append("its lookahead stores a direction computed from the first-pass gradient")
    if getattr(opt, "KEEPS_GRADIENT_AVERAGE", False):
        reasons.append("it keeps a moving average of the first-pass gradient")
    if reasons:
        raise OptimConfigError(
            f"DISTRIBUTED.LOCAL_ASCENT True (m-sharpness) does not apply to {name}: "
            f"{'; '.join(reasons)}, so the processes would drift apart. Set "
            "DISTRIBUTED.LOCAL_ASCENT False (the default: the one-process ascent)"
        )
