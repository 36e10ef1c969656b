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

PRECISIONS = ("fp32", "fp16", "amp", "bf16")
# aliases (e.g. the SAMPLe authors' trainer names) train exactly what ALIAS_OF trains
TRAINABLE = sorted(
    n
    for n, cls in ((n, TRAINER_REGISTRY.get(n)) for n in TRAINER_REGISTRY)
    if not cls.EVAL_ONLY and not getattr(cls, "ALIAS_OF", "")
)
SHARPNESS = [s.name for s in list_optimizers("sharpness")]
CASES = [(t, p, o) for t in TRAINABLE for p in PRECISIONS for o in ("", "sample")] + [
    (t, "fp32", o) for t in TRAINABLE for o in SHARPNESS if o != "sample"
]


@pytest.mark.parametrize(
    "trainer,prec,sam", CASES, ids=[f"{t}-{p}-{o or 'base'}" for t, p, o in CASES]
)
def test_trainer_optimizer_precision(trainer, prec, sam, tmp_path, dtd_root, deep_opts):
    node = TRAINER_REGISTRY.get(trainer).config_node()
    opts = ["--root", dtd_root, "--seed", "1", "--output-dir", str(tmp_path / "out"), *deep_opts]
    opts += tiny_options(trainer, tmp_path, DEPTH)
    opts += [f"TRAINER.{node}.PREC", prec, "OPTIM.SAM.NAME", sam, "OPTIM.SAM.RHO", "0.5"]
    opts += ["OPTIM.SAM.START_EPOCH", "0", "OPTIM.MAX_EPOCH", "1", "DATASET.NUM_SHOTS", "2"]
    tr = build_trainer(make_cfg(opts, trainer=trainer))
    if prec == "amp":  # the default 2**16 may overflow the tiny fp16 model's first steps
        tr.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    tr.set_model_mode("train")
    out = assert_one_step_updates(tr)
    if sam:
        assert "grad_norm" in out  # the two-pass step ran
