"""Dassl's LR sequences and plain, resumable scheduler state."""

from __future__ import annotations

import pytest
import torch

from engine.config import get_base_cfg_default
from optim import build_lr_scheduler


def _sched(**kw):
    cfg = get_base_cfg_default().OPTIM
    for k, v in kw.items():
        cfg[k] = v
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.LR)
    return opt, build_lr_scheduler(opt, cfg)


def _lrs(opt, sched, n):
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        sched.step()
    return out


def test_cosine_constant_warmup_matches_dassl():
    opt, sched = _sched(
        LR=0.002, MAX_EPOCH=10, LR_SCHEDULER="cosine", WARMUP_EPOCH=1, WARMUP_TYPE="constant"
    )
    lrs = _lrs(opt, sched, 10)
    expected = [
        1e-5,
        0.002,
        0.001951,
        0.001809,
        0.001588,
        0.001309,
        0.001,
        0.000691,
        0.000412,
        0.000191,
    ]
    assert lrs == pytest.approx(expected, abs=1e-6)


def test_linear_warmup_and_no_recount():
    opt, sched = _sched(
        LR=0.1,
        MAX_EPOCH=6,
        LR_SCHEDULER="single_step",
        STEPSIZE=(2,),
        WARMUP_EPOCH=2,
        WARMUP_TYPE="linear",
        WARMUP_MIN_LR=0.01,
    )
    assert _lrs(opt, sched, 6) == pytest.approx([0.01, 0.05, 0.1, 0.1, 0.01, 0.01])
    opt, sched = _sched(
        LR=0.1,
        MAX_EPOCH=6,
        LR_SCHEDULER="single_step",
        STEPSIZE=(2,),
        WARMUP_EPOCH=2,
        WARMUP_TYPE="constant",
        WARMUP_RECOUNT=False,
    )
    assert _lrs(opt, sched, 6) == pytest.approx([1e-5, 1e-5, 0.01, 0.01, 0.001, 0.001])


def test_multi_step():
    opt, sched = _sched(LR=1.0, LR_SCHEDULER="multi_step", STEPSIZE=(1, 3), GAMMA=0.5)
    assert _lrs(opt, sched, 5) == pytest.approx([1.0, 0.5, 0.5, 0.25, 0.25])


def test_state_dict_is_plain_and_resumes(tmp_path):
    opt, sched = _sched(
        LR=0.002, MAX_EPOCH=10, LR_SCHEDULER="cosine", WARMUP_EPOCH=1, WARMUP_TYPE="constant"
    )
    for _ in range(4):
        sched.step()
    path = tmp_path / "s.pt"
    torch.save(sched.state_dict(), path)
    opt2, sched2 = _sched(
        LR=0.002, MAX_EPOCH=10, LR_SCHEDULER="cosine", WARMUP_EPOCH=1, WARMUP_TYPE="constant"
    )
    sched2.load_state_dict(torch.load(path, weights_only=True))
    assert _lrs(opt2, sched2, 6) == pytest.approx(_lrs(opt, sched, 6))


def test_unknown_scheduler():
    with pytest.raises(ValueError, match="Unknown OPTIM.LR_SCHEDULER 'cosin'"):
        _sched(LR_SCHEDULER="cosin")
