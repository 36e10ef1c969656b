"""End-to-end runs of train.py on a generated DTD dataset and the tiny CLIP: in a subprocess
(train, then evaluate; the error paths' exit status and stderr), and in-process
(helpers.train_in_process) where the point is the run (resume, seeds), not the process."""

from __future__ import annotations

import os
import os.path as osp
import re
import shutil

import pytest
import torch
from conftest import run_train
from helpers import coop_args, train_in_process

pytestmark = pytest.mark.slow


_args = coop_args  # this module's runs: helpers.coop_args


def _accuracy_after(log: str, marker: str) -> float:
    tail = log[log.rindex(marker) :]
    return float(re.findall(r"\* accuracy: ([\.\deE+-]+)%", tail)[-1])


def _ckpt(out, epoch):
    path = osp.join(out, "prompt_learner", f"model.pth.tar-{epoch}")
    return torch.load(path, weights_only=True)


def test_train_then_evaluate_new_classes(tmp_path, dtd_root, tiny_clip_opts):
    out = str(tmp_path / "train_base")
    run_train(
        _args(
            dtd_root,
            out,
            tiny_clip_opts,
            "OPTIM.MAX_EPOCH",
            "2",
            "DATASET.SUBSAMPLE_CLASSES",
            "base",
        )
    )
    log = open(osp.join(out, "log.txt")).read()
    assert "Finish training" in log and "epoch [2/2] batch [4/4]" in log
    _accuracy_after(log, "Finish training")
    assert "SEED: 1" in open(osp.join(out, "config.yaml")).read()
    ckpt = _ckpt(out, 2)
    assert list(ckpt["state_dict"]) == ["ctx"] and ckpt["epoch"] == 2
    assert ckpt["optimizer"]["state"] and ckpt["scheduler"]["last_epoch"] == 2
    assert osp.isfile(osp.join(out, "tensorboard", os.listdir(osp.join(out, "tensorboard"))[0]))
    new = str(tmp_path / "test_new")
    flags = ["--eval-only", "--model-dir", out, "--load-epoch", "2"]
    run_train(_args(dtd_root, new, tiny_clip_opts, "DATASET.SUBSAMPLE_CLASSES", "new", flags=flags))
    log = open(osp.join(new, "log.txt")).read()
    assert "# classes  3" in log and "=> result" in log
    _accuracy_after(log, "=> result")


def test_resume_after_interruption_matches_uninterrupted(tmp_path, dtd_root, tiny_clip_opts):
    full = str(tmp_path / "full")
    # SAMPLe: the resumed run needs the momentum and the moving average from the checkpoint
    extra = ["OPTIM.MAX_EPOCH", "4", "TRAIN.CHECKPOINT_FREQ", "1", "OPTIM.SAM.NAME", "sample"]
    train_in_process(_args(dtd_root, full, tiny_clip_opts, *extra))
    # the same run "killed" after epoch 2: later checkpoints gone, pointer at epoch 2
    cut = str(tmp_path / "cut")
    shutil.copytree(full, cut)
    for e in (3, 4):
        os.remove(osp.join(cut, "prompt_learner", f"model.pth.tar-{e}"))
    with open(osp.join(cut, "prompt_learner", "checkpoint"), "w") as f:
        f.write("model.pth.tar-2\n")
    os.remove(osp.join(cut, "log.txt"))
    train_in_process(_args(dtd_root, cut, tiny_clip_opts, *extra))
    log = open(osp.join(cut, "log.txt")).read()
    assert "Previous epoch: 2" in log and "epoch [3/4]" in log and "epoch [1/4]" not in log
    a, b = _ckpt(full, 4), _ckpt(cut, 4)
    assert torch.equal(a["state_dict"]["ctx"], b["state_dict"]["ctx"])
    full_log = open(osp.join(full, "log.txt")).read()
    assert _accuracy_after(full_log, "Finish training") == _accuracy_after(log, "Finish training")


def test_seed_zero_is_a_seed(tmp_path, dtd_root, tiny_clip_opts):
    outs = []
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        out = str(tmp_path / name)
        train_in_process(_args(dtd_root, out, tiny_clip_opts, "OPTIM.MAX_EPOCH", "1", seed=seed))
        outs.append(_ckpt(out, 1)["state_dict"]["ctx"])
    assert "SEED: 0" in open(osp.join(tmp_path / "a", "config.yaml")).read()
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])


@pytest.mark.parametrize(
    "change, message",
    [
        (["--trainer", "CoOpp"], r"Unknown trainer 'CoOpp' \(do you mean \[CoOp\]\?\)"),
        (["OPTIM.LRR", "0.1"], r"Unknown config key 'OPTIM.LRR'.*do you mean OPTIM.LR"),
        (["OPTIM.MAX_EPOCH", "many"], r"OPTIM.MAX_EPOCH expects an int"),
        (["--root", "/nonexistent/data"], r"DescribableTextures.*/nonexistent/data.*dtd/images"),
        (["MODEL.BACKBONE.PATH", "/nonexistent/clip.pt"], r"MODEL.BACKBONE.PATH does not exist"),
    ],
)
def test_bad_input_gives_clear_error(tmp_path, dtd_root, tiny_clip_opts, change, message):
    args = _args(dtd_root, str(tmp_path / "o"), tiny_clip_opts, "OPTIM.MAX_EPOCH", "1")
    if change[0].startswith("--"):
        i = args.index(change[0])
        args[i + 1] = change[1]
    else:
        args += change
    proc = run_train(args, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert re.search(message, proc.stderr), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
