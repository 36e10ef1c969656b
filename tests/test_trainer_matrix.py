"""Every registered trainer x optimizer x precision: one parametrised test over the registries.

A new trainer (registered in trainers/) or a new sharpness-aware optimizer (registered in
optim/) is picked up here without editing this file: each trainer trains in every precision
with the base optimizer and with SAMPLe, and once in fp32 with every other sharpness-aware
optimizer. Trainer options for the tiny 4-block CLIP are derived from the trainer's config keys.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_cfg
from helpers import DEPTH, assert_one_step_updates, tiny_options

from engine import build_trainer
from engine.registry import TRAINER_REGISTRY
from optim import list_optimizers
from optim.errors import OptimConfigError

PRECISIONS = ("fp32", "fp16", "amp", "bf16")
# aliases (e.g. the SAMPLe authors' trainer names) train exactly what ALIAS_OF trains
TRAINABLE = sorted(
    n
    for n, cls in ((n, TRAINER_REGISTRY.get(n)) for n in TRAINER_REGISTRY)
    if not cls.EVAL_ONLY and not getattr(cls, "ALIAS_OF", "")
)
SHARPNESS = [s.name for s in list_optimizers("sharpness")]
# The cheaper optimizers (docs/efficient-sharpness.md) and SAMPLe-k ("sample-k2": SAMPLe with
# OPTIM.SAM.EVERY 2) take two steps (with a lookahead k = 2: an ascent, then a step without
# the second pass). To keep the matrix's added time small: those that use the trainer's side of
# the step (ESAM's item subset, SAF/MESA's logits, RWP's forward at perturbed weights) on every
# trainer, the purely optimizer-side ones (lookahead, m-RWP) on CoOp and MaPLe, all in fp32;
# the other precisions on CoOp.
EFFICIENT = [s.name for s in list_optimizers("sharpness") if s.efficient] + ["sample-k2"]
OPTIMIZER_SIDE = ("looksam", "mrwp", "sample-k2")
CASES = (
    [(t, p, o) for t in TRAINABLE for p in PRECISIONS for o in ("", "sample")]
    + [(t, "fp32", o) for t in TRAINABLE for o in SHARPNESS if o != "sample" and o not in EFFICIENT]
    + [
        (t, "fp32", o)
        for o in EFFICIENT
        for t in TRAINABLE
        if o not in OPTIMIZER_SIDE or t in ("CoOp", "MaPLe")
    ]
    + [("CoOp", p, o) for o in EFFICIENT for p in PRECISIONS if p != "fp32"]
)


def refuses_extra_loss(trainer: str, name: str) -> bool:
    """ProGrad's projection with an optimizer that adds a loss term of its own (its class
    overrides SharpnessAwareOptimizer.extra_loss): refused, as ProGradProjection decides."""
    from optim.build import list_optimizers
    from optim.sharpness import SharpnessAwareOptimizer

    own = {
        s.name
        for s in list_optimizers("sharpness")
        if s.cls.extra_loss is not SharpnessAwareOptimizer.extra_loss
    }
    return trainer == "ProGrad" and name in own


@pytest.mark.parametrize(
    "trainer,prec,sam", CASES, ids=[f"{t}-{p}-{o or 'base'}" for t, p, o in CASES]
)
def test_trainer_optimizer_precision(trainer, prec, sam, tmp_path, dtd_root, deep_opts):
    node = TRAINER_REGISTRY.get(trainer).config_node()
    opts = ["--root", dtd_root, "--seed", "1", "--output-dir", str(tmp_path / "out"), *deep_opts]
    opts += tiny_options(trainer, tmp_path, DEPTH)
    name = "sample" if sam == "sample-k2" else sam
    opts += [f"TRAINER.{node}.PREC", prec, "OPTIM.SAM.NAME", name, "OPTIM.SAM.RHO", "0.5"]
    if sam in EFFICIENT:
        opts += ["OPTIM.SAM.EVERY", "2", "OPTIM.SAM.GAMMA", "0.5", "OPTIM.SAM.NOISE", "0.1"]
    opts += ["OPTIM.SAM.START_EPOCH", "0", "OPTIM.MAX_EPOCH", "1", "DATASET.NUM_SHOTS", "2"]
    if (trainer, sam) == ("SkipTuning", "saf"):  # SAF needs every class in every step
        opts += ["TRAINER.SKIP.TOP_RATIO", "1.0"]  # (refused otherwise: test_skiptuning.py)
    if refuses_extra_loss(trainer, name):  # ProGrad with SAF/MESA (optim/prograd.py): the reason
        with pytest.raises(OptimConfigError, match="adds a loss term of its own"):
            build_trainer(make_cfg(opts, trainer=trainer))
        return
    tr = build_trainer(make_cfg(opts, trainer=trainer))
    if prec == "amp":  # the default 2**16 may overflow the tiny fp16 model's first steps
        tr.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    tr.set_model_mode("train")
    out = assert_one_step_updates(tr)
    if sam:
        assert "grad_norm" in out  # the sharpness-aware step ran
    if sam in EFFICIENT:  # a second step: between two ascents, or the one-pass rule again
        before = [p.detach().clone() for p in tr.model.parameters() if p.requires_grad]
        for _ in range(4 if prec == "amp" else 1):
            tr.batch_idx = 1
            out = tr.forward_backward(next(iter(tr.train_loader_x)))
            after = [p for p in tr.model.parameters() if p.requires_grad]
            if not torch.equal(before[0], after[0]):
                break
        assert torch.isfinite(out["loss"]) and "grad_norm" in out
        for b, p in zip(before, after, strict=True):
            assert torch.isfinite(p).all() and not torch.equal(b, p)
        n = tr.optim_step.sharp[0].num_steps
        assert n >= 2 and ("gv_norm" in out) == (sam in ("looksam", "sample-k2") and n % 2 == 0)
