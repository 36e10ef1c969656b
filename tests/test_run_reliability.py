"""Long runs survive kills, NaNs, full disks, concurrent and changed re-runs, and load the
checkpoints of the original code bases (issue 15, run side).

Command-line behaviour is tested through train.py in a subprocess (``run_train``); the rest
in-process on the tiny CLIP.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import os.path as osp
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import ROOT, make_cfg, run_train
from helpers import coop_args, train_in_process

from engine import build_trainer
from engine.checkpoint import ROLLING_NAME, load_checkpoint, save_checkpoint
from engine.cli import build_parser
from engine.errors import CheckpointError, ConfigError, OutputError
from engine.run_folder import NOT_EXPERIMENT_KEYS, RunFolder, experiment_config
from engine.validate import validate_cfg
from engine.writers import ScalarWriter

CLASSES = ["banded", "blotchy", "braided"]


_args = coop_args  # this module's runs: helpers.coop_args


def _popen(args):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=os.environ["OMP_NUM_THREADS"])
    return subprocess.Popen(
        [sys.executable, osp.join(ROOT, "train.py"), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _wait_for(predicate, proc, timeout=240):
    t0 = time.time()
    while time.time() - t0 < timeout:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"train.py ended early ({proc.returncode}): {proc.stderr.read()}")
        time.sleep(0.02)
    raise AssertionError("timed out")


def _epoch_of(path):
    try:
        return load_checkpoint(path)["epoch"]
    except Exception:  # noqa: BLE001 - not yet there
        return 0


def _user_error(proc, code=2):
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


def _log(out):
    return open(osp.join(out, "log.txt")).read()


def _all_finite(path):
    ck = load_checkpoint(path)
    return all(torch.isfinite(v).all() for v in ck["state_dict"].values())


# -- 1 + 6: a kill costs at most one epoch; orphans removed; scalars written once -----------------
@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, dtd_root_shared, tiny_clip_opts):
    """A 5-epoch run (CHECKPOINT_FREQ 0) killed with SIGKILL once its rolling checkpoint holds
    epoch 2, with orphan .tmp files planted, then re-run into the same folder."""
    out = str(tmp_path_factory.mktemp("interrupted") / "run")
    args = _args(dtd_root_shared, out, tiny_clip_opts, "OPTIM.MAX_EPOCH", "5")
    rolling = osp.join(out, "prompt_learner", ROLLING_NAME)
    proc = _popen(args)
    try:
        _wait_for(lambda: _epoch_of(rolling) >= 2, proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed_at = load_checkpoint(rolling)["epoch"]
    assert 2 <= killed_at < 5
    pointer_before = osp.exists(osp.join(out, "prompt_learner", "checkpoint"))
    orphans = [
        osp.join(out, "prompt_learner", ".model.pth.tar-3.k2j4h1.tmp"),
        osp.join(out, ".scalars.jsonl.x8f0q2.tmp"),
    ]
    for p in orphans:
        with open(p, "wb") as f:
            f.write(b"partial")
    scalars_before = open(osp.join(out, "scalars.jsonl")).read().splitlines()
    os.rename(osp.join(out, "log.txt"), osp.join(out, "log-killed.txt"))
    train_in_process(args)  # the resumed run (the kill above is the subprocess's part)
    return dict(
        out=out,
        killed_at=killed_at,
        pointer_before=pointer_before,
        orphans=orphans,
        scalars_before=scalars_before,
        args=args,
    )


@pytest.mark.slow
def test_kill_resumes_from_the_rolling_checkpoint(interrupted):
    out, e = interrupted["out"], interrupted["killed_at"]
    assert not interrupted["pointer_before"]  # the rolling file is not in Dassl's pointer
    log = _log(out)
    assert f"Previous epoch: {e}" in log
    assert f"epoch [{e + 1}/5]" in log and "epoch [1/5]" not in log
    assert "Finish training" in log and "* accuracy:" in log
    files = sorted(os.listdir(osp.join(out, "prompt_learner")))
    assert files == ["checkpoint", "model.pth.tar-5"]  # the rolling file is gone at the end
    ck = load_checkpoint(osp.join(out, "prompt_learner", "model.pth.tar-5"))
    assert ck["epoch"] == 5 and ck["trainer"] == "CoOp"


def test_resume_takes_the_newer_of_pointer_and_rolling_checkpoint(coop, tmp_path):
    out = str(tmp_path)
    coop.save_model(1, out)  # model.pth.tar-2, named in the pointer
    coop.save_rolling_checkpoint(2, out)  # epoch 3
    assert coop.resume_model_if_exist(out) == 3
    assert open(osp.join(out, "prompt_learner", "checkpoint")).read() == "model.pth.tar-2\n"
    coop.save_model(3, out)  # a numbered checkpoint of a later epoch drops the rolling one
    assert not osp.exists(osp.join(out, "prompt_learner", ROLLING_NAME))
    assert coop.resume_model_if_exist(out) == 4


def test_orphan_tmp_files_are_removed_on_start(interrupted):
    assert not any(osp.exists(p) for p in interrupted["orphans"])
    leftovers = [
        osp.join(d, f) for d, _, fs in os.walk(interrupted["out"]) for f in fs if f.endswith(".tmp")
    ]
    assert leftovers == []


def test_resumed_run_writes_each_scalar_step_once(interrupted):
    rows = [json.loads(x) for x in open(osp.join(interrupted["out"], "scalars.jsonl"))]
    seen = collections.Counter((tag, r["step"]) for r in rows for tag in r if tag != "step")
    assert seen and max(seen.values()) == 1, [k for k, n in seen.items() if n > 1][:5]
    train_steps = sorted({r["step"] for r in rows if "train/loss" in r})
    assert train_steps == list(range(len(train_steps)))  # every step of the 5 epochs, once
    # the killed run had flushed rows of the epoch it did not finish: they were dropped
    before = [json.loads(x) for x in interrupted["scalars_before"] if x.strip()]
    assert max(r["step"] for r in before) >= interrupted["killed_at"] * 7 - 1


# -- 5: a run folder belongs to one experiment -----------------------------------------------------
@pytest.mark.slow
def test_changed_config_is_refused_then_forced_or_started_over(interrupted, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(interrupted["out"], out)
    args = [out if a == interrupted["out"] else a for a in interrupted["args"]]
    config_before = open(osp.join(out, "config.yaml")).read()
    err = _user_error(run_train([*args, "OPTIM.LR", "0.01"], check=False))
    assert "holds a run of another experiment" in err
    assert "OPTIM.LR: 0.002 in the folder, 0.01 now" in err
    assert "--overwrite" in err and "--force-resume" in err
    assert open(osp.join(out, "config.yaml")).read() == config_before  # not rewritten
    # paths, logging and worker counts are not the experiment: accepted
    train_in_process([*args, "TRAIN.PRINT_FREQ", "3", "DATALOADER.TEST.BATCH_SIZE", "5"])
    # an --eval-only run into a training folder is another experiment too
    flags = ["--eval-only", "--model-dir", interrupted["out"], "--load-epoch", "5"]
    err = _user_error(run_train([*flags, *args], check=False))
    assert "RUN.EVAL_ONLY: False in the folder, True now" in err
    # --force-resume continues with the new values (the run is complete: it re-tests)
    run_train(["--force-resume", *args, "OPTIM.LR", "0.01"])
    assert "LR: 0.01" in open(osp.join(out, "config.yaml")).read()
    # --overwrite starts over: the old content is moved aside
    run_train(["--overwrite", "--no-train", *args, "OPTIM.LR", "0.005"])
    moved = [d for d in os.listdir(tmp_path) if d.startswith("run.old-")]
    assert len(moved) == 1
    assert osp.isfile(osp.join(tmp_path, moved[0], "prompt_learner", "model.pth.tar-5"))
    assert not osp.exists(osp.join(out, "prompt_learner"))
    assert "--overwrite" in _log(out)
    assert "--overwrite" in build_parser().format_help()  # train.py --help's text


def test_experiment_fingerprint_keys(tiny_clip_opts, tmp_path):
    flat = experiment_config(make_cfg(tiny_clip_opts, trainer="CoOp"), {"EVAL_ONLY": False})
    assert "TRAINER.COOP.N_CTX" in flat and "TRAINER.NAME" in flat and "OPTIM.LR" in flat
    assert not any(k.startswith("TRAINER.COCOOP.") for k in flat)  # other trainers' keys
    assert not set(flat) & set(NOT_EXPERIMENT_KEYS)  # paths, logging, workers, ...
    folder = RunFolder(str(tmp_path))
    folder.record_experiment(flat)
    (tmp_path / "prompt_learner").mkdir()  # a trained run: its checkpoint
    (tmp_path / "prompt_learner" / "model.pth.tar-1").write_bytes(b"")
    newer = {**flat, "OPTIM.A_NEW_KEY": 1}  # a key added by a newer version of the code
    folder.check_experiment(newer)
    with pytest.raises(OutputError, match=r"TRAINER.COOP.N_CTX: 16 in the folder, 8 now"):
        folder.check_experiment({**flat, "TRAINER.COOP.N_CTX": 8})


def test_orphans_of_nested_run_folders_are_left_alone(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "other_run" / "m").mkdir(parents=True)
    (tmp_path / "other_run" / ".lock").write_text("")
    ours = tmp_path / "m" / ".model.pth.tar-1.abc.tmp"
    theirs = tmp_path / "other_run" / "m" / ".model.pth.tar-1.abc.tmp"
    for p in (ours, theirs):
        p.write_bytes(b"x")
    with RunFolder(str(tmp_path)) as folder:
        folder.remove_orphans()
    assert not ours.exists() and theirs.exists()


# -- 4: a run folder is owned by one process -------------------------------------------------------
@pytest.mark.slow
def test_second_run_into_a_busy_folder_is_refused(tmp_path, dtd_root, tiny_clip_opts):
    out = str(tmp_path / "run")
    args = _args(dtd_root, out, tiny_clip_opts, "OPTIM.MAX_EPOCH", "200")
    first = _popen(args)
    try:
        _wait_for(lambda: osp.isfile(osp.join(out, "log.txt")), first)
        # stopped, the first run still holds the folder's lock; its 200 epochs no longer take
        # the CPU from the second run's start-up (they made this test wait on wall time)
        first.send_signal(signal.SIGSTOP)
        err = _user_error(run_train(args, check=False))
        assert f"in use by another run (pid {first.pid} on host" in err
        assert "choose another --output-dir" in err
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    lock = osp.join(out, ".lock")
    assert f"pid {first.pid}" in open(lock).read()  # a stale lock of a dead process
    # taken over by a run in this process (the holder is another, dead process), then released
    train_in_process(
        _args(dtd_root, out, tiny_clip_opts, "OPTIM.MAX_EPOCH", "200", flags=["--no-train"])
    )
    assert open(lock).read() == ""


def test_lock_is_per_folder_and_released(tmp_path):
    a = RunFolder(str(tmp_path / "a"))
    a.acquire()
    with pytest.raises(OutputError, match=rf"in use by another run \(pid {os.getpid()}"):
        RunFolder(str(tmp_path / "a")).acquire()
    with RunFolder(str(tmp_path / "b")):
        pass
    a.release()
    with RunFolder(str(tmp_path / "a")):
        assert f"pid {os.getpid()} on host" in open(tmp_path / "a" / ".lock").read()


# -- 2: NaN never persists -------------------------------------------------------------------------
@pytest.mark.slow
def test_diverged_run_keeps_its_last_finite_checkpoint_and_is_not_resumed_blindly(
    tmp_path, dtd_root, tiny_clip_opts
):
    out = str(tmp_path / "run")
    # the CoOp config warms up at 1e-5 for epoch 1; epoch 2 at LR 1e30 diverges
    bad = _args(dtd_root, out, tiny_clip_opts, "OPTIM.MAX_EPOCH", "2", "OPTIM.LR", "1e30")
    err = _user_error(run_train(bad, check=False), code=3)
    assert re.search(r"Error: (Loss|Parameters) became infinite or NaN at epoch 2/2", err)
    marker = json.load(open(osp.join(out, "diverged.json")))
    assert marker["epoch"] == 2 and "infinite or NaN" in marker["message"]
    assert os.listdir(osp.join(out, "prompt_learner")) == [ROLLING_NAME]
    rolling = osp.join(out, "prompt_learner", ROLLING_NAME)
    assert load_checkpoint(rolling)["epoch"] == 1 and _all_finite(rolling)
    # a re-run does not resume past the divergence
    err = _user_error(run_train(bad, check=False))
    assert "diverged at epoch 2" in err and "--force-resume" in err and "--overwrite" in err
    # ... unless asked, with a sane LR: it resumes from the last finite checkpoint
    good = _args(dtd_root, out, tiny_clip_opts, "OPTIM.MAX_EPOCH", "2", flags=["--force-resume"])
    train_in_process(good)
    log = open(sorted(osp.join(out, f) for f in os.listdir(out) if f.startswith("log.txt"))[-1])
    log = log.read()
    assert "Previous epoch: 1" in log and "epoch [2/2]" in log and "Finish training" in log
    assert not osp.exists(osp.join(out, "diverged.json"))


@pytest.mark.slow
def test_lr_that_overflows_fp32_is_a_config_error(tmp_path, dtd_root, tiny_clip_opts):
    args = _args(dtd_root, str(tmp_path / "o"), tiny_clip_opts, "OPTIM.LR", "1e39")
    err = _user_error(run_train(args, check=False))
    assert err.count("OPTIM.LR") == 1 and "float32 range" in err
    assert not osp.exists(tmp_path / "o")  # refused before the output folder is touched


def test_no_checkpoint_with_nonfinite_tensors_is_written(tmp_path):
    state = {"state_dict": {"ctx": torch.ones(2, 3)}, "epoch": 1, "optimizer": None}
    save_checkpoint(state, str(tmp_path))
    state["state_dict"]["ctx"][0, 1] = float("nan")
    state["epoch"] = 2
    with pytest.raises(
        FloatingPointError, match=r"Refusing to write checkpoint.*\['state_dict.ctx'"
    ):
        save_checkpoint(state, str(tmp_path))
    state["state_dict"]["ctx"].fill_(1.0)
    state["optimizer"] = {"state": {0: {"momentum_buffer": torch.tensor([float("inf")])}}}
    with pytest.raises(FloatingPointError, match="optimizer.state.0.momentum_buffer"):
        save_checkpoint(state, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "model.pth.tar-1"]
    assert open(tmp_path / "checkpoint").read() == "model.pth.tar-1\n"


@pytest.fixture(scope="module")
def coop(tiny_clip_opts):
    return build_trainer(make_cfg(tiny_clip_opts, trainer="CoOp"), classnames=CLASSES)


def test_parameters_that_blow_up_with_a_finite_loss_stop_the_run(coop):
    ctx = coop.get_model("prompt_learner").ctx
    saved = ctx.detach().clone()
    coop.num_batches = 7
    try:
        coop.finite.record(1, 6, torch.tensor(0.5), {})
        coop._check_finite()  # all finite: nothing
        with torch.no_grad():
            ctx[0, 0] = float("inf")
        coop.finite.record(1, 6, torch.tensor(0.5), {})
        with pytest.raises(FloatingPointError, match=r"Parameters became infinite or NaN at "):
            coop._check_finite()
        with pytest.raises(FloatingPointError, match="Refusing to write checkpoint"):
            coop.save_rolling_checkpoint(1, "/nonexistent/never/written")
    finally:
        with torch.no_grad():
            ctx.copy_(saved)


def test_weights_blown_up_by_the_last_step_of_an_epoch(tmp_path, dtd_root, tiny_clip_opts):
    """The last step of epoch 2 makes the context inf while its loss is finite: the run stops
    before the epoch's checkpoint, keeping epoch 1's, and marks the folder as diverged."""
    out = str(tmp_path / "run")
    cfg = make_cfg(
        [*tiny_clip_opts, "DATASET.ROOT", dtd_root, "OUTPUT_DIR", out, "OPTIM.MAX_EPOCH", "3",
         "DATASET.NUM_SHOTS", "4", "TRAINER.COOP.PREC", "fp32", "SEED", "1"],
        trainer="CoOp",
    )  # fmt: skip
    trainer = build_trainer(cfg)
    step = trainer.forward_backward

    def forward_backward(batch):
        result = step(batch)
        if trainer.epoch == 1 and trainer.batch_idx == trainer.num_batches - 1:
            with torch.no_grad():
                trainer.get_model("prompt_learner").ctx.mul_(float("inf"))
        return result

    trainer.forward_backward = forward_backward
    with pytest.raises(FloatingPointError, match=r"Parameters became infinite or NaN at epoch 2/3"):
        trainer.train()
    assert os.listdir(osp.join(out, "prompt_learner")) == [ROLLING_NAME]
    rolling = osp.join(out, "prompt_learner", ROLLING_NAME)
    assert load_checkpoint(rolling)["epoch"] == 1 and _all_finite(rolling)
    assert json.load(open(osp.join(out, "diverged.json")))["epoch"] == 2


@pytest.mark.slow
def test_evaluation_refuses_nonfinite_logits(tmp_path, dtd_root, tiny_clip_opts):
    model_dir = tmp_path / "model"
    (model_dir / "prompt_learner").mkdir(parents=True)
    ctx = torch.full((4, 32), float("nan"))  # N_CTX 4; this project never writes such a file
    torch.save(
        {"state_dict": {"ctx": ctx}, "epoch": 2}, model_dir / "prompt_learner/model.pth.tar-2"
    )
    flags = ["--eval-only", "--model-dir", str(model_dir), "--load-epoch", "2"]
    proc = run_train(_args(dtd_root, str(tmp_path / "eval"), tiny_clip_opts, flags=flags), False)
    err = _user_error(proc, code=3)
    assert "non-finite (NaN/inf) logits" in err and "no accuracy is reported" in err
    assert "* accuracy" not in proc.stdout


# -- 3: disk full, read-only output --------------------------------------------------------------
def _fail_with(code):
    def fsync(fd):
        raise OSError(code, os.strerror(code))

    return fsync


def test_disk_full_names_the_folder_and_the_bytes_and_leaves_nothing_half_written(
    tmp_path, monkeypatch
):
    folder = tmp_path / "prompt_learner"
    state = {"state_dict": {"ctx": torch.ones(64, 32)}, "epoch": 1}
    save_checkpoint(state, str(folder))
    monkeypatch.setattr(os, "fsync", _fail_with(errno.ENOSPC))
    state["epoch"] = 2
    with pytest.raises(OutputError) as info:
        save_checkpoint(state, str(folder))
    msg = str(info.value)
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert f"no space left on the device of {folder}" in msg
    needed = int(re.search(r"\(([\d,]+) bytes needed", msg).group(1).replace(",", ""))
    assert needed > 64 * 32 * 4  # the size of the serialised checkpoint
    assert sorted(os.listdir(folder)) == ["checkpoint", "model.pth.tar-1"]  # no .tmp, no -2
    assert load_checkpoint(str(folder / "model.pth.tar-1"))["epoch"] == 1
    monkeypatch.setattr(os, "fsync", _fail_with(errno.EROFS))
    with pytest.raises(OutputError, match=rf"the folder {folder} is not writable"):
        save_checkpoint(state, str(folder))


def test_scalar_writer_on_a_full_disk(tmp_path, monkeypatch):
    writer = ScalarWriter()
    writer.open(str(tmp_path), str(tmp_path / "tb"))
    writer.add({"train/loss": 1.0}, 0)

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            pass

    writer._file = Full()
    with pytest.raises(OutputError, match=r"scalars.jsonl: no space left.*bytes needed"):
        writer.flush()


@pytest.mark.slow
def test_unwritable_output_folder_is_one_clear_error(tmp_path, dtd_root, tiny_clip_opts):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the output folder's parent should be")
    out = str(blocker / "run")
    err = _user_error(run_train(_args(dtd_root, out, tiny_clip_opts), check=False))
    assert err.startswith("Error: ") and str(blocker) in err and "--output-dir" in err
    assert len(err.strip().splitlines()) == 1


# -- 8: config values are validated with their key ------------------------------------------------
@pytest.mark.parametrize(
    "key, value, message",
    [
        ("OPTIM.MAX_EPOCH", "0", r"OPTIM.MAX_EPOCH must be an integer >= 1, got 0"),
        ("OPTIM.MAX_EPOCH", "-3", r"OPTIM.MAX_EPOCH must be an integer >= 1, got -3"),
        ("OPTIM.LR", "0", r"OPTIM.LR must be a number > 0"),
        ("OPTIM.LR", "-0.1", r"OPTIM.LR must be a number > 0"),
        (
            "OPTIM.SAM.VARIANT",
            "papr",
            r"OPTIM.SAM.VARIANT must be one of paper, reference.*papr.*do you mean paper",
        ),
        ("OPTIM.SAM.SCHEDULE", "sqrt", r"OPTIM.SAM.SCHEDULE must be one of constant, inv_sqrt"),
        ("TRAIN.PRINT_FREQ", "0", r"TRAIN.PRINT_FREQ must be an integer >= 1"),
        ("TRAIN.CHECKPOINT_FREQ", "-1", r"TRAIN.CHECKPOINT_FREQ must be an integer >= 0"),
        (
            "OPTIM.LR_SCHEDULER",
            "cosin",
            r"OPTIM.LR_SCHEDULER must be one of .*\(do you mean cosine",
        ),
        ("OPTIM.WARMUP_TYPE", "exp", r"OPTIM.WARMUP_TYPE must be one of constant, linear"),
        ("OPTIM.SAM.LAMBDA", "1.5", r"OPTIM.SAM.LAMBDA must be a number in \[0, 1\]"),
        ("OPTIM.WEIGHT_DECAY", "1e39", r"OPTIM.WEIGHT_DECAY must be a number >= 0 and <= 3.4e\+38"),
        ("TEST.FINAL_MODEL", "best", r"TEST.FINAL_MODEL must be one of last_step, best_val"),
    ],
)
def test_config_values_are_validated_with_their_key(tiny_clip_opts, key, value, message):
    cfg = make_cfg([*tiny_clip_opts, key, value])
    with pytest.raises(ConfigError, match=message):
        validate_cfg(cfg)
    with pytest.raises(ConfigError, match=message):  # before anything is built
        build_trainer(cfg, classnames=CLASSES)


@pytest.mark.slow
def test_zero_epochs_on_the_command_line(tmp_path, dtd_root, tiny_clip_opts):
    args = _args(dtd_root, str(tmp_path / "o"), tiny_clip_opts, "OPTIM.MAX_EPOCH", "0")
    err = _user_error(run_train(args, check=False))
    assert "Config key OPTIM.MAX_EPOCH must be an integer >= 1, got 0" in err


# -- 9: checkpoints of the original code bases -----------------------------------------------------
def _dassl_checkpoint(state_dict, epoch=2):
    """A checkpoint as Dassl's save_model writes it for CoOp-family trainers (SGD, cosine with
    Dassl's constant warmup, whose state dict holds the successor scheduler object)."""
    params = [torch.nn.Parameter(v.clone()) for v in state_dict.values() if v.is_floating_point()]
    optim = torch.optim.SGD(params, lr=0.002, momentum=0.9)
    successor = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=float(epoch))
    sum(p.sum() for p in params).backward()
    optim.step()
    successor.step()
    warmup_state = {  # dassl.optim.lr_scheduler.ConstantWarmupScheduler.state_dict()
        "successor": successor,
        "warmup_epoch": 1,
        "cons_lr": 1e-5,
        "base_lrs": [0.002],
        "last_epoch": epoch,
        "verbose": False,
        "_step_count": epoch + 1,
        "_get_lr_called_within_step": False,
        "_last_lr": [np.float64(0.0019)],
    }
    return {
        "state_dict": state_dict,
        "epoch": epoch,
        "optimizer": optim.state_dict(),
        "scheduler": warmup_state,
        "val_result": np.float64(71.25),
    }


@pytest.mark.slow
def test_eval_from_an_original_coop_checkpoint(tmp_path, dtd_root, tiny_clip_opts):
    ctx = torch.randn(4, 32) * 0.02  # vit_b16_ctxv1: N_CTX 4
    sd = {"ctx": ctx, "token_prefix": torch.randn(7, 1, 32), "token_suffix": torch.randn(7, 60, 32)}
    model_dir = tmp_path / "coop_original"
    (model_dir / "prompt_learner").mkdir(parents=True)
    torch.save(_dassl_checkpoint(sd), model_dir / "prompt_learner" / "model.pth.tar-2")
    with pytest.raises(Exception, match="Weights only load failed"):  # what plain loading does
        torch.load(model_dir / "prompt_learner" / "model.pth.tar-2", weights_only=True)
    flags = ["--eval-only", "--model-dir", str(model_dir), "--load-epoch", "2"]
    out = str(tmp_path / "eval")
    train_in_process(_args(dtd_root, out, tiny_clip_opts, flags=flags))
    log = _log(out)
    assert "val result: 71.2" in log and "=> result" in log and "* accuracy:" in log


@pytest.mark.slow
def test_evil_pickle_is_refused_in_one_paragraph(tmp_path, dtd_root, tiny_clip_opts):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    model_dir = tmp_path / "evil"
    (model_dir / "prompt_learner").mkdir(parents=True)
    torch.save(
        {"state_dict": {"ctx": torch.zeros(4, 32)}, "x": Evil()},
        model_dir / "prompt_learner/model.pth.tar-1",
    )
    flags = ["--eval-only", "--model-dir", str(model_dir), "--load-epoch", "1"]
    proc = run_train(_args(dtd_root, str(tmp_path / "e"), tiny_clip_opts, flags=flags), False)
    err = _user_error(proc)
    assert "Refused to load checkpoint" in err and "system" in err
    assert len(err.strip().splitlines()) == 1 and not marker.exists()


@pytest.fixture(scope="module")
def maple_opts(tiny_clip_opts):
    return [*tiny_clip_opts, "TRAINER.MAPLE.PROMPT_DEPTH", "2", "TRAINER.MAPLE.N_CTX", "2"]


def test_original_maple_and_coprompt_checkpoints_map_to_this_projects_names(
    tmp_path, tiny_clip_opts, maple_opts
):
    maple = build_trainer(make_cfg(maple_opts, trainer="MaPLe"), classnames=CLASSES)
    name = "MultiModalPromptLearner"
    own = maple.get_model(name).state_dict()
    # MaPLe registered its whole CustomCLIP: prompt learner, frozen encoders, token buffers
    whole = {f"prompt_learner.{k}": torch.randn_like(v) for k, v in own.items()}
    whole["prompt_learner.token_prefix"] = torch.randn(3, 1, 32)
    whole["image_encoder.conv1.weight"] = torch.randn(64, 3, 8, 8)
    whole["logit_scale"] = torch.tensor(4.6)
    (tmp_path / "maple" / name).mkdir(parents=True)
    torch.save(_dassl_checkpoint(whole), tmp_path / "maple" / name / "model.pth.tar-2")
    maple.load_model(str(tmp_path / "maple"), epoch=2)
    for k, v in maple.get_model(name).state_dict().items():
        assert torch.equal(v, whole[f"prompt_learner.{k}"]), k

    cfg = make_cfg(
        [*tiny_clip_opts, "TRAINER.COPROMPT.PROMPT_DEPTH", "2", "TRAINER.COPROMPT.N_CTX", "2",
         "DATALOADER.K_TRANSFORMS", "2"],
        trainer="CoPrompt",
    )  # fmt: skip
    coprompt = build_trainer(cfg, classnames=CLASSES)
    own = coprompt.get_model(name).state_dict()
    original = {}  # CoPrompt's names: adapter_image.fc.*, adapter_text.fc.*
    for k, v in own.items():
        k = k.replace("image_adapter.", "adapter_image.fc.").replace(
            "text_adapter.", "adapter_text.fc."
        )
        original[k] = torch.randn_like(v)
    original["model_distill.visual.conv1.weight"] = torch.randn(64, 3, 8, 8)
    (tmp_path / "coprompt" / name).mkdir(parents=True)
    torch.save(_dassl_checkpoint(original), tmp_path / "coprompt" / name / "model.pth.tar-2")
    coprompt.load_model(str(tmp_path / "coprompt"), epoch=2)
    got = coprompt.get_model(name).state_dict()
    assert torch.equal(got["image_adapter.0.weight"], original["adapter_image.fc.0.weight"])
    assert torch.equal(got["prompt_learner.ctx"], original["prompt_learner.ctx"])


@pytest.mark.parametrize(
    "trainer, opts",
    [("CoCoOp", ("TRAINER.COCOOP.PREC", "fp32")), ("TCP", ("TRAINER.TCP.INJECT_LAYER", "1"))],
)
def test_original_cocoop_and_tcp_checkpoints_load(tmp_path, tiny_clip_opts, trainer, opts):
    model = build_trainer(make_cfg([*tiny_clip_opts, *opts], trainer=trainer), classnames=CLASSES)
    own = model.get_model("prompt_learner").state_dict()
    original = {k: torch.randn_like(v) for k, v in own.items()}  # ctx, meta_net.linear1/2.*
    original["token_prefix"] = torch.randn(3, 1, 32)
    original["token_suffix"] = torch.randn(3, 72, 32)
    (tmp_path / "prompt_learner").mkdir()
    torch.save(_dassl_checkpoint(original), tmp_path / "prompt_learner" / "model.pth.tar-2")
    model.load_model(str(tmp_path), epoch=2)
    for k, v in model.get_model("prompt_learner").state_dict().items():
        assert torch.equal(v, original[k]), k


# -- 10: checkpoints of another trainer or other settings -----------------------------------------
@pytest.mark.slow
def test_coop_checkpoint_given_to_cocoop(tmp_path, dtd_root, tiny_clip_opts):
    model_dir = tmp_path / "coop"
    (model_dir / "prompt_learner").mkdir(parents=True)
    sd = {"ctx": torch.randn(4, 32), "token_prefix": torch.randn(7, 1, 32)}
    torch.save(_dassl_checkpoint(sd), model_dir / "prompt_learner" / "model.pth.tar-2")
    flags = ["--eval-only", "--model-dir", str(model_dir), "--load-epoch", "2"]
    extra = ("TRAINER.COCOOP.PREC", "fp32")
    args = _args(
        dtd_root, str(tmp_path / "e"), tiny_clip_opts, *extra, trainer="CoCoOp", flags=flags
    )
    err = _user_error(run_train(args, check=False))
    assert "was made by CoOp (inferred from its folder and tensor names)" in err
    assert "does not fit this CoCoOp model 'prompt_learner'" in err
    assert "missing tensors ['meta_net.linear1.weight'" in err and "--trainer CoOp" in err
    assert len(err.strip().splitlines()) == 1


def test_other_n_ctx_or_depth_names_the_tensors(tmp_path, coop, tiny_clip_opts, maple_opts):
    other = build_trainer(
        make_cfg([*tiny_clip_opts, "TRAINER.COOP.N_CTX", "4"], trainer="CoOp"), classnames=CLASSES
    )
    other.save_model(1, str(tmp_path / "n_ctx4"))
    with pytest.raises(CheckpointError) as info:
        coop.load_model(str(tmp_path / "n_ctx4"), epoch=2)
    msg = str(info.value)
    assert "made by CoOp (stored in the checkpoint)" in msg
    assert "ctx: checkpoint (4, 32), model (16, 32)" in msg and "N_CTX" in msg

    shallow = build_trainer(
        make_cfg([*tiny_clip_opts, "TRAINER.MAPLE.PROMPT_DEPTH", "1", "TRAINER.MAPLE.N_CTX", "2"],
                 trainer="MaPLe"),
        classnames=CLASSES,
    )  # fmt: skip
    shallow.save_model(0, str(tmp_path / "depth1"))
    maple = build_trainer(make_cfg(maple_opts, trainer="MaPLe"), classnames=CLASSES)
    with pytest.raises(CheckpointError, match=r"made by MaPLe.*missing tensors \['compound_"):
        maple.load_model(str(tmp_path / "depth1"), epoch=1)
