"""The optimizer family inside the engine: step protocol, precision, staging, diagnostics."""

from __future__ import annotations

import json
import logging
import os.path as osp
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, make_cfg
from helpers import train_in_process
from torch import nn

from engine import build_trainer
from engine.trainer import TrainerX
from optim import OPTIMIZER_REGISTRY, build_lr_scheduler, build_optimizer

SHARPNESS = [n for n in OPTIMIZER_REGISTRY if OPTIMIZER_REGISTRY.get(n).kind == "sharpness"]


def test_registry_metadata():
    assert {"sam", "fsam", "sagm", "sample"} <= set(SHARPNESS)
    for name in SHARPNESS:
        spec = OPTIMIZER_REGISTRY.get(name)
        assert (spec.needs_closure or spec.efficient) and spec.description
        assert spec.test_kwargs, f"{name}: the shared math suite needs its test_kwargs"
        cfg = make_cfg([])
        for h in spec.hparams:  # every hyper-parameter is a config key with its type
            assert h.key in cfg.OPTIM.SAM and type(cfg.OPTIM.SAM[h.key]) is type(h.default)
    for name in ("sgd", "adam", "adamw"):
        assert not OPTIMIZER_REGISTRY.get(name).needs_closure


def test_constructor_defaults_are_the_hparams_defaults():
    """One fact per default: every registered sharpness-aware constructor's keyword default is
    its HParam's (the config's), so building the class directly trains what the config does."""
    import inspect

    differ = []
    for name in SHARPNESS:
        spec = OPTIMIZER_REGISTRY.get(name)
        params = inspect.signature(spec.cls.__init__).parameters
        for h in spec.hparams:
            assert h.kwarg in params, f"{name}: {spec.cls.__name__} takes no {h.kwarg!r}"
            default = params[h.kwarg].default
            if default != h.default or type(default) is not type(h.default):
                differ.append(f"{name}.{h.kwarg}: {default!r} != OPTIM.SAM.{h.key} {h.default!r}")
    assert not differ, differ


def test_wrong_optimizer_slot_is_explained():
    cfg = make_cfg(["OPTIM.NAME", "sample"])
    with pytest.raises(ValueError, match="set OPTIM.SAM.NAME sample"):
        build_optimizer(cfg, [nn.Parameter(torch.zeros(2))])
    cfg = make_cfg(["OPTIM.NAME", "sgd", "OPTIM.SAM.NAME", "adam"])
    with pytest.raises(ValueError, match="OPTIM.SAM.NAME takes one of"):
        build_optimizer(cfg, [nn.Parameter(torch.zeros(2))])


# the SAMPLe paper's deployment table (appendix "Hyperparameter selection")
PAPER = {
    "CoOp": {
        "sam": (0.05,),
        "sagm": (0.05, 0.001),
        "fsam": (0.05, 0.15),
        "sample": (0.05, 0.0015, 0.15),
    },
    "CoCoOp": {
        "sam": (0.10,),
        "sagm": (0.10, 0.001),
        "fsam": (0.05, 0.15),
        "sample": (0.10, 0.0015, 0.15),
    },
    "TCP": {
        "sam": (0.05,),
        "sagm": (0.10, 0.001),
        "fsam": (0.05, 0.15),
        "sample": (0.10, 0.0015, 0.15),
    },
}


@pytest.mark.parametrize("trainer", sorted(PAPER))
def test_per_trainer_config_files_hold_the_paper_values(trainer):
    for name, values in PAPER[trainer].items():
        cfg = make_cfg(
            ["--optim-config-file", osp.join(ROOT, f"configs/optim/{trainer}/{name}.yaml")]
        )
        sam = cfg.OPTIM.SAM
        assert sam.NAME == name and sam.RHO == values[0]
        if name == "sagm":
            assert sam.ALPHA == values[1]
        if name == "fsam":
            assert sam.LAMBDA == values[1] and sam.SIGMA == 1.0
        if name == "sample":
            assert (sam.ALPHA, sam.LAMBDA) == values[1:]


# ----------------------------------------------------------------------------------------------
# A tiny trainer with a "prompt" and a "proj" parameter, registered for these tests
# ----------------------------------------------------------------------------------------------
class Learner(nn.Module):
    def __init__(self, n_cls):
        super().__init__()
        self.prompt = nn.Parameter(torch.zeros(n_cls))
        self.proj = nn.Linear(3, n_cls)


class ToyStaged(TrainerX):  # built directly, not registered: the registry drives other tests
    """logits = proj(mean colour) + prompt; counts prepare/loss calls per step."""

    def build_model(self):
        self.model = Learner(self.num_classes).to(self.device)
        self.optim = build_optimizer(self.cfg, self.model)
        self.sched = build_lr_scheduler(self.optim, self.cfg.OPTIM)
        self.register_model("learner", self.model, self.optim, self.sched)
        self.calls = []  # (epoch, batch, kind, random draw)

    def prepare_step(self, batch_inputs):
        image, label = batch_inputs
        draw = torch.randint(0, 1000, ()).item()  # a per-step random choice
        self.calls.append((self.epoch, self.batch_idx, "prepare", draw))
        return image.mean(dim=(2, 3)), label, draw

    def compute_loss(self, inputs):
        feats, label, draw = inputs
        self.calls.append((self.epoch, self.batch_idx, "loss", draw))
        logits = self.model.proj(feats) + self.model.prompt
        return F.cross_entropy(logits, label), {"acc": (logits.argmax(1) == label).float().mean()}

    def model_inference(self, image):
        return self.model.proj(image.mean(dim=(2, 3))) + self.model.prompt


def _toy(tmp_path, dtd_root, *opts):
    cfg = make_cfg(
        [
            "--root",
            dtd_root,
            "--seed",
            "1",
            "--output-dir",
            str(tmp_path / "out"),
            "INPUT.SIZE",
            "(16, 16)",
            "DATALOADER.NUM_WORKERS",
            "0",
            "DATALOADER.TRAIN_X.BATCH_SIZE",
            "7",
            "OPTIM.NAME",
            "sgd",
            "OPTIM.LR",
            "0.5",
            "TEST.NO_TEST",
            "True",
            "TRAIN.PRINT_FREQ",
            "1",
            *opts,
        ],
        trainer="ToyStaged",
    )
    return ToyStaged(cfg)


def test_staged_training_switch_and_freeze(tmp_path, dtd_root, caplog):
    caplog.set_level(logging.INFO)
    tr = _toy(
        tmp_path,
        dtd_root,
        "OPTIM.MAX_EPOCH",
        "2",
        "OPTIM.SAM.NAME",
        "sample",
        "OPTIM.SAM.START_EPOCH",
        "1",
        "OPTIM.SAM.FREEZE",
        "['proj.*']",
    )
    snapshots = {}
    orig_before = tr.before_epoch

    def before_epoch():
        orig_before()
        snapshots[tr.epoch] = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}

    tr.before_epoch = before_epoch
    tr.train()
    end = tr.model.state_dict()
    assert not torch.equal(snapshots[0]["proj.weight"], snapshots[1]["proj.weight"])  # stage 1
    assert torch.equal(snapshots[1]["proj.weight"], end["proj.weight"])  # frozen in stage 2
    assert not torch.equal(snapshots[1]["prompt"], end["prompt"])
    assert not tr.model.proj.weight.requires_grad and tr.model.prompt.requires_grad
    per_step = {}
    for epoch, batch, kind, draw in tr.calls:
        per_step.setdefault((epoch, batch), []).append((kind, draw))
    for (epoch, _), calls in per_step.items():
        kinds = [k for k, _ in calls]
        # the frozen part once per step; the loss once (base optimizer) or twice (two passes)
        assert kinds == (["prepare", "loss"] if epoch == 0 else ["prepare", "loss", "loss"])
        assert len({d for _, d in calls}) == 1  # the step's random draw is shared by both passes
    assert "sharpness-aware stage starts; frozen: learner.proj.weight, learner.proj.bias" in (
        caplog.text
    )


def test_freeze_pattern_matching_nothing_is_an_error(tmp_path, dtd_root):
    tr = _toy(
        tmp_path,
        dtd_root,
        "OPTIM.MAX_EPOCH",
        "2",
        "OPTIM.SAM.NAME",
        "sam",
        "OPTIM.SAM.START_EPOCH",
        "1",
        "OPTIM.SAM.FREEZE",
        "['adapter*']",
    )
    with pytest.raises(ValueError, match=r"FREEZE \['adapter\*'\] matches no parameter"):
        tr.train()


def test_nan_loss_is_reported_with_the_step(tmp_path, dtd_root):
    tr = _toy(tmp_path, dtd_root, "OPTIM.MAX_EPOCH", "1", "TRAIN.PRINT_FREQ", "100")
    compute = tr.compute_loss

    def bad(inputs):
        loss, summary = compute(inputs)
        return (loss * float("nan") if tr.batch_idx == 2 else loss), summary

    tr.compute_loss = bad
    with pytest.raises(FloatingPointError, match=r"epoch 1/1, batch 3/\d+: loss = nan"):
        tr.train()


def test_diagnostics_are_logged(tmp_path, dtd_root, caplog):
    caplog.set_level(logging.INFO)
    tr = _toy(tmp_path, dtd_root, "OPTIM.MAX_EPOCH", "1", "OPTIM.SAM.NAME", "sample")
    tr.train()
    rows = [json.loads(line) for line in open(osp.join(tmp_path, "out", "scalars.jsonl"))]
    keys = set().union(*rows)
    for k in ("grad_norm", "grad_p_norm", "cos_g_gp", "ema_norm", "xi", "gb_norm", "cos_gp_m"):
        assert f"train/{k}" in keys
    assert re.search(r"cos_g_gp -?\d\.\d{4} \(", caplog.text)


# ----------------------------------------------------------------------------------------------
# Mixed precision with two passes (GradScaler)
# ----------------------------------------------------------------------------------------------
def _coop(tmp_path, dtd_root, tiny_clip_opts, prec, *opts):
    cfg = make_cfg(
        [
            "--root",
            dtd_root,
            "--seed",
            "1",
            "--output-dir",
            str(tmp_path / prec),
            *tiny_clip_opts,
            "TRAINER.COOP.PREC",
            prec,
            "TRAINER.COOP.N_CTX",
            "4",
            "OPTIM.NAME",
            "sgd",
            "OPTIM.LR",
            "0.002",
            "OPTIM.MAX_EPOCH",
            "1",
            "DATASET.NUM_SHOTS",
            "2",
            "TEST.NO_TEST",
            "True",
            *opts,
        ]
    )
    return build_trainer(cfg)


def test_amp_perturbation_uses_unscaled_gradients(tmp_path, dtd_root, tiny_clip_opts):
    norms = {}
    for prec in ("fp32", "amp"):
        tr = _coop(tmp_path, dtd_root, tiny_clip_opts, prec, "OPTIM.SAM.NAME", "sample")
        if prec == "amp":  # a scale the tiny fp16 model does not overflow at
            tr.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        batch = next(iter(tr.train_loader_x))
        tr.batch_idx = 0
        out = tr.forward_backward(batch)
        norms[prec] = float(out["grad_norm"])
        if prec == "amp":
            assert tr.scaler.get_scale() == 1024.0  # one scale for both passes, no overflow
    assert norms["amp"] == pytest.approx(norms["fp32"], rel=0.05)


def test_amp_skips_a_step_whose_second_pass_overflows(tmp_path, dtd_root, tiny_clip_opts):
    tr = _coop(tmp_path, dtd_root, tiny_clip_opts, "amp", "OPTIM.SAM.NAME", "sample")
    tr.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    batch = next(iter(tr.train_loader_x))
    tr.batch_idx = 0
    before = tr.model.prompt_learner.ctx.detach().clone()
    n = {"calls": 0}
    compute = tr.compute_loss

    def overflow_second_pass(inputs):
        n["calls"] += 1
        loss, summary = compute(inputs)
        return (loss * 1e38 if n["calls"] == 2 else loss), summary

    tr.compute_loss = overflow_second_pass
    tr.forward_backward(batch)
    assert torch.equal(tr.model.prompt_learner.ctx, before)  # restored, not updated
    assert tr.optim.num_steps == 0 and tr.scaler.get_scale() == 512.0


# ----------------------------------------------------------------------------------------------
# CoOp through train.py with each sharpness-aware optimizer (the paper's CoOp values)
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", SHARPNESS)
def test_coop_train_py_with_each_optimizer(tmp_path, dtd_root, tiny_clip_opts, name):
    out = str(tmp_path / name)
    train_in_process(
        [
            "--root",
            dtd_root,
            "--seed",
            "1",
            "--trainer",
            "CoOp",
            "--dataset-config-file",
            osp.join(ROOT, "configs/datasets/dtd.yaml"),
            "--config-file",
            osp.join(ROOT, "configs/trainers/CoOp/vit_b16_ctxv1.yaml"),
            "--optim-config-file",
            osp.join(ROOT, f"configs/optim/CoOp/{name}.yaml"),
            "--output-dir",
            out,
            *tiny_clip_opts,
            "TRAINER.COOP.PREC",
            "fp32",
            "OPTIM.MAX_EPOCH",
            "2",
            "DATASET.NUM_SHOTS",
            "4",
        ]
    )
    log = open(osp.join(out, "log.txt")).read()
    two_pass = OPTIMIZER_REGISTRY.get(name).needs_closure  # one-pass ones log no cos_g_gp
    assert f"Optimizer: {name}(sgd)" in log and ("cos_g_gp" if two_pass else "grad_norm") in log
    assert re.search(r"\* accuracy: [\d.]+%", log[log.index("Finish training") :])
    sd = torch.load(osp.join(out, "prompt_learner", "model.pth.tar-2"), weights_only=True)
    assert sd["optimizer"]["sharpness"]["num_steps"] > 0
