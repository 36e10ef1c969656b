"""NaN/inf detection of a training run without a host sync per step.

The loop records each step's loss (a tensor still on the device) with :meth:`FiniteWatch.record`
and calls :meth:`FiniteWatch.check` at its print frequency and before any checkpoint: one host
transfer then tells whether a recorded loss or a learnable parameter became infinite or NaN,
and the error names the epoch, the batch and the loss terms (or the parameters).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_HINT = "Try a lower OPTIM.LR, PREC fp32/amp instead of fp16, or a larger ADAM_EPS."


class FiniteWatch:
    """The losses recorded since the last check: ``(epoch, batch, loss, terms)``."""

    def __init__(self):
        self.pending: list[tuple[int, int, torch.Tensor, dict]] = []

    def record(self, epoch: int, batch_idx: int, loss: torch.Tensor, terms: dict) -> None:
        self.pending.append((epoch, batch_idx, loss.detach(), terms))

    def check(
        self, params: Sequence[tuple[str, torch.Tensor]], max_epoch: int, num_batches: int
    ) -> None:
        """Raise FloatingPointError on the first non-finite recorded loss, or on a non-finite
        parameter of ``params`` (``(name, tensor)``) after the last step; clears the record."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        losses = torch.stack([c[2].float().reshape(()) for c in pending])
        bad = ~torch.isfinite(losses)
        finite = [torch.isfinite(p.detach()).all().to(bad.device) for _, p in params]
        params_ok = torch.stack(finite).all() if finite else torch.ones((), dtype=torch.bool)
        flags = torch.cat([bad.any().reshape(1), (~params_ok).reshape(1).to(bad.device)]).tolist()
        if flags[0]:
            epoch, batch_idx, value, summary = pending[int(bad.nonzero()[0])]
            terms = {k: float(v) for k, v in summary.items()}
            raise FloatingPointError(
                f"Loss became infinite or NaN at epoch {epoch + 1}/{max_epoch}, batch "
                f"{batch_idx + 1}/{num_batches}: loss = {float(value)}; terms = {terms}. {_HINT}"
            )
        if flags[1]:
            epoch, batch_idx, value, _ = pending[-1]
            names = [n for (n, _), ok in zip(params, torch.stack(finite).tolist()) if not ok]
            raise FloatingPointError(
                f"Parameters became infinite or NaN at epoch {epoch + 1}/{max_epoch}, "
                f"batch {batch_idx + 1}/{num_batches} (the loss was still finite: "
                f"{float(value)}): {names[:8]}. {_HINT}"
            )
