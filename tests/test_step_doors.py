"""Every registered optimizer through every door: the optimizer step's contract.

Whoever drives the optimizer step (the engine's ``TrainerX``, a Dassl trainer file with CoOp's
``model_backward_and_update(loss)`` or CoCoOp's own ``loss.backward(); optim.step()``, loaded
with ``--plugin``, run by a packed worker or as train.py's own process, the way a SLURM job runs
it) goes through :class:`optim.step.OptimizerStep`, which
calls what the optimizer declares it needs (``begin_step`` before the first forward, recorded
logits, per-item passes) and refuses a step that was not opened. So every registered optimizer
gives, through every door, the parameters of the engine's path (float64, a linear model:
tests/examples/step_doors.py); a caller that forgets ``begin_step`` is refused.
"""

from __future__ import annotations

import os
import os.path as osp
import runpy
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, make_cfg

from optim import OPTIMIZER_REGISTRY
from optim.errors import StepContractError

DOORS_FILE = osp.join(ROOT, "tests", "examples", "step_doors.py")
CLASSES = ["a", "b", "c"]
EPOCHS = 3

# every registered optimizer, with values that make its special parts act within 3 epochs
_SPECIAL = {
    "looksam": ["OPTIM.SAM.EVERY", "2"],
    "saf": ["OPTIM.SAM.EPOCHS_BACK", "1", "OPTIM.SAM.TRAJ_START", "0"],
    "mesa": ["OPTIM.SAM.EMA_DECAY", "0.5", "OPTIM.SAM.TRAJ_START", "0"],
    "esam": ["OPTIM.SAM.GAMMA", "0.5"],
}


def optimizer_opts(name: str) -> list[str]:
    """``KEY VALUE`` options of a run with the registered optimizer ``name`` ("esam:masked":
    ESAM's masked selected pass)."""
    name, _, select = name.partition(":")
    if OPTIMIZER_REGISTRY.get(name).kind == "base":
        return ["OPTIM.NAME", name]
    opts = ["OPTIM.NAME", "sgd", "OPTIM.SAM.NAME", name, *_SPECIAL.get(name, [])]
    return opts + (["OPTIM.SAM.SELECT_PASS", select] if select else [])


OPTIMIZERS = [*OPTIMIZER_REGISTRY, "esam:masked"]
COMMON = ["SEED", "1", "OPTIM.LR", "0.5", "OPTIM.MOMENTUM", "0.9", "OPTIM.WEIGHT_DECAY", "0.001"]


@pytest.fixture(scope="module")
def doors():
    """The file's trainer classes, registered in a copy of the trainer registry (the test
    session's registry is left as it was)."""
    from engine.registry import TRAINER_REGISTRY

    saved = dict(TRAINER_REGISTRY._obj_map)
    try:
        names = runpy.run_path(DOORS_FILE)
    finally:
        TRAINER_REGISTRY._obj_map.clear()
        TRAINER_REGISTRY._obj_map.update(saved)
    return {k: names[k] for k in ("DoorsEngine", "DoorsDassl", "DoorsDasslOwnStep")}


@pytest.fixture(scope="module")
def batches():
    g = torch.Generator().manual_seed(3)
    return [
        {
            "img": torch.randn(4, 3, 8, 8, generator=g),
            "label": torch.randint(0, len(CLASSES), (4,), generator=g),
            "index": torch.arange(4 * i, 4 * i + 4),
        }
        for i in range(3)
    ]


def train(cls, opts: list[str], batches, unchecked_without_begin_step=False) -> list:
    """The parameters after ``EPOCHS`` epochs over ``batches``, as the epoch loop steps.

    ``unchecked_without_begin_step``: this trainer's calls of ``begin_step`` removed and the
    step's check of its contract turned off (what a caller that forgets it used to get)."""
    tr = cls(make_cfg([*COMMON, *opts]), classnames=CLASSES)
    if unchecked_without_begin_step:
        tr.optim_step.begin_step = lambda batch, epoch: None
        tr.optim_step._check_open = lambda opt, batch, epoch: None
    tr.optim_step.check_caller(tr.step_gives(), type(tr).__name__)
    tr.num_batches = len(batches)
    tr.set_model_mode("train")
    for tr.epoch in range(EPOCHS):  # noqa: B020
        tr.optim_step.begin_epoch(tr.epoch, tr._models)
        for tr.batch_idx, batch in enumerate(batches):  # noqa: B020
            tr.train_step(batch)
        if tr.ENGINE_STEPS_LR:
            tr.update_lr()
    return [p.detach().clone() for p in tr.model.parameters()]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_through_every_door_gives_the_engines_parameters(name, doors, batches):
    opts = optimizer_opts(name)
    engine = train(doors["DoorsEngine"], opts, batches)
    for door in ("DoorsDassl", "DoorsDasslOwnStep"):
        params = train(doors[door], opts, batches)
        for a, b in zip(params, engine):  # bit for bit: the same operations in float64
            assert a.dtype == torch.float64 and torch.equal(a, b), f"{name} via {door}"


@pytest.mark.parametrize("door", ["DoorsEngine", "DoorsDassl", "DoorsDasslOwnStep"])
def test_a_caller_without_begin_step_is_refused_and_would_differ(door, doors, batches):
    """begin_step removed from one caller: the step refuses it before any update; without that
    check RWP and MESA would silently train something else (the comparison above fails)."""
    cls = doors[door]
    tr = cls(make_cfg([*COMMON, *optimizer_opts("rwp")]), classnames=CLASSES)
    tr.optim_step.begin_step = lambda batch, epoch: None
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.num_batches, tr.batch_idx = len(batches), 0
    with pytest.raises(StepContractError, match="was not opened with"):
        tr.train_step(batches[0])
    assert all(torch.equal(a, b) for a, b in zip(tr.model.parameters(), before))
    for name in ("rwp", "mesa"):
        engine = train(doors["DoorsEngine"], optimizer_opts(name), batches)
        broken = train(cls, optimizer_opts(name), batches, unchecked_without_begin_step=True)
        assert not all(torch.allclose(a, b) for a, b in zip(broken, engine)), (name, door)


def test_a_step_of_its_own_is_refused_before_training(doors, batches):
    """An engine trainer with a forward_backward of its own gives the optimizer nothing: a
    sharpness-aware optimizer is refused before the first step, one-pass ones run."""
    engine_cls = doors["DoorsEngine"]

    class OwnStep(engine_cls):
        def forward_backward(self, batch):
            image, label = self.parse_batch_train(batch)
            self.model_backward_and_update(self.classification_loss(self.model(image), label))
            return {}

    for name in ("sam", "rwp", "saf"):
        tr = OwnStep(make_cfg([*COMMON, *optimizer_opts(name)]), classnames=CLASSES)
        with pytest.raises(
            StepContractError, match=rf"The optimizer '{name}' needs .*prepare_step"
        ):
            tr.optim_step.check_caller(tr.step_gives(), "OwnStep's step", "state prepare_step")
    train(OwnStep, optimizer_opts("adam"), batches)


DOORS = ("DoorsEngine", "DoorsDassl", "DoorsDasslOwnStep")


@pytest.mark.slow
def test_every_optimizer_through_the_plugin_file_in_one_packed_worker(tmp_path, dtd_root):
    """train.py runs of the plugin file's three trainers for every registered optimizer, one
    after another in one packed worker (experiments/worker.py, as ``tools/grid.py --in-process``
    runs a chain) on a generated dataset: after 3 epochs both Dassl doors' parameters equal the
    engine trainer's, bit for bit, and every optimizer trained something else than SGD. The
    worker keeps its process between runs, so a run that left state behind (a registry entry,
    a switch, a seed) would change the runs after it. A SLURM job (experiments/grid_slurm.py)
    runs the same train.py command lines, each as a process of its own: one such run (SAF, the
    Dassl file's own step) gives the worker's parameters too."""
    from engine.clip.toy import TINY_OPTS
    from experiments.worker import Worker

    dtd = osp.join(ROOT, "configs/datasets/dtd.yaml")
    console = str(tmp_path / "console.txt")
    # one thread: a tiny model's steps cost less than a thread pool's hand-offs (0.45 s of CPU a
    # run instead of 1.1 s), and every run here uses the same
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)

    def argv(name: str, door: str, out: str) -> list[str]:
        return [
            "--root", dtd_root, "--seed", "1", "--trainer", door,
            "--dataset-config-file", dtd, "--output-dir", out, "--plugin", DOORS_FILE,
            *TINY_OPTS, *COMMON, *optimizer_opts(name), "OPTIM.MAX_EPOCH", str(EPOCHS),
            "DATASET.NUM_SHOTS", "2", "DATALOADER.TRAIN_X.BATCH_SIZE", "7",  # 2 steps an epoch
            "TEST.NO_TEST", "True",
        ]  # fmt: skip

    worker = Worker(env=env)
    outs = {}
    try:
        for name in OPTIMIZERS:
            for door in DOORS:
                out = outs[name, door] = str(tmp_path / f"{name.replace(':', '-')}-{door}")
                assert worker.run(argv(name, door, out), console) == 0, open(console).read()[-3000:]
    finally:
        worker.close()
    own = str(tmp_path / "process")  # a SLURM job's run: train.py in a process of its own
    cmd = [sys.executable, osp.join(ROOT, "train.py"), *argv("saf", "DoorsDasslOwnStep", own)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    def params(out):
        path = osp.join(out, "model", f"model.pth.tar-{EPOCHS}")
        return torch.load(path, weights_only=True)["state_dict"]

    def assert_equal(out, engine, what):
        for key, value in params(out).items():
            assert torch.equal(value, engine[key]), (*what, key)  # bit for bit

    sgd = params(outs["sgd", "DoorsEngine"])
    for name in OPTIMIZERS:
        engine = params(outs[name, "DoorsEngine"])
        assert engine["fc.weight"].dtype == torch.float64
        if name != "sgd":
            assert not torch.allclose(engine["fc.weight"], sgd["fc.weight"]), name  # not SGD
        base = name.partition(":")[0]
        label = f"{base}(sgd)" if OPTIMIZER_REGISTRY.get(base).kind == "sharpness" else base
        for door in DOORS[1:]:
            assert_equal(outs[name, door], engine, (name, door))
            log = open(osp.join(outs[name, door], "log.txt")).read()
            assert f"Optimizer: {label} over" in log, (name, door)
    assert_equal(own, params(outs["saf", "DoorsEngine"]), ("saf", "train.py process"))
    assert "traj_loss" in open(osp.join(own, "log.txt")).read()
