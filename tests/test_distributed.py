"""Data-parallel runs equal the one-process run (docs/distributed.md).

- The sampler: the shards of every step, in rank order, are the one-process batch.
- The equivalence suite of every trainer x optimizer family: tests/test_distributed_equivalence.py.
- ``torchrun --nproc_per_node 2 train.py`` gives the one-process run's checkpoint, resumes into
  one process, and a killed rank ends the run with a message naming it.
"""

from __future__ import annotations

import json
import os
import os.path as osp
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT
from helpers import coop_args

from engine.data.distributed import (
    ShardedBatchSampler,
    batch_sizes,
    check_shards,
    split_sizes,
)
from engine.data.manager import EpochSampler
from engine.distributed import env_from_slurm, first_host
from engine.errors import ConfigError
from optim.errors import OptimConfigError


# -- the sampler ------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shards_are_the_one_process_batches(world, drop_last):
    assert split_sizes(8, 3) == [3, 3, 2] and split_sizes(6, 4) == [2, 2, 1, 1]
    one = EpochSampler(23, shuffle=True, seed=5)
    one.set_epoch(3)
    keys = list(one)
    single = [keys[i : i + 8] for i in range(0, 23, 8)][: 2 if drop_last else 3]
    shards = []
    for r in range(world):
        s = ShardedBatchSampler(EpochSampler(23, True, 5), 8, drop_last, r, world)
        s.set_epoch(3)
        assert len(s) == len(single)
        shards.append(list(s))
    for step, batch in enumerate(single):
        got = [k for r in range(world) for k in shards[r][step]]
        assert got == batch  # same items, same order, same augmentation seeds
        assert [len(shards[r][step]) for r in range(world)] == split_sizes(len(batch), world)


def test_a_batch_a_process_gets_nothing_of_is_refused():
    assert batch_sizes(14, 4, False) == [4, 4, 4, 2]
    with pytest.raises(ConfigError, match=r"last batch of an epoch holds 2 item\(s\).*at most 2"):
        check_shards(14, 4, False, 3)
    check_shards(14, 4, True, 3)  # the partial batch is dropped
    with pytest.raises(ConfigError, match="DROP_LAST"):
        check_shards(14, 2, False, 3)


def test_slurm_variables_give_the_rendezvous():
    assert first_host("gpu[03-05,9],cpu1") == "gpu03" and first_host("node7") == "node7"
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
           "SLURM_NODELIST": "n[12-13]", "SLURM_JOB_ID": "41"}  # fmt: skip
    assert env_from_slurm(env) == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
        "MASTER_ADDR": "n12", "MASTER_PORT": "20041",
    }  # fmt: skip
    assert env_from_slurm({**env, "RANK": "0"}) == {}  # torchrun's own variables win
    assert env_from_slurm({**env, "SLURM_NTASKS": "1"}) == {}


# -- the equivalence suite: tests/test_distributed_equivalence.py ----------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_m_sharpness_is_refused_where_processes_would_drift(tiny_clip_opts, tmp_path):
    from optim.distributed import check_local_ascent
    from optim.fsam import FSAM
    from optim.sam import SAM
    from optim.sample import SAMPLe

    params = [torch.nn.Parameter(torch.zeros(3))]
    check_local_ascent(SAM(params, lr=0.1))  # the update is the perturbed gradient: allowed
    for opt, why in (
        (SAMPLe(params, lr=0.1), "its update uses the first-pass gradient"),
        (FSAM(params, lr=0.1), "moving average of the first-pass gradient"),
        (SAM(params, lr=0.1), "lookahead"),
    ):
        if why == "lookahead":
            opt.set_lookahead(2, 0.7)
        with pytest.raises(OptimConfigError, match=why):
            check_local_ascent(opt)


# -- real torchrun runs -----------------------------------------------------------------------
def torchrun(nproc: int, args: list[str], **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    cmd += ["--master_port", str(free_port()), osp.join(ROOT, "train.py"), *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT, **kw)  # fmt: skip


def last_state(out: str) -> dict:
    ckpt = torch.load(osp.join(out, "prompt_learner", "model.pth.tar-2"), weights_only=True)
    return ckpt


def run_args(root, out, tiny_clip_opts, *extra):
    return coop_args(root, out, tiny_clip_opts, "OPTIM.MAX_EPOCH", "2", "OPTIM.SAM.NAME",
                     "sample", "DATALOADER.TRAIN_X.BATCH_SIZE", "8", "TEST.FEATURE_CACHE",
                     "False", "DATASET.NUM_SHOTS", "2", "TRAIN.CHECKPOINT_FREQ", "1",
                     *extra)  # fmt: skip


def run_one_process(argv: list[str]) -> None:
    """train.py in this process (engine.runner, the grid's in-process path): one process."""
    from engine.runner import run_in_process

    assert run_in_process(argv) == 0


def test_torchrun_two_processes_equal_one_and_resume_into_one(dtd_root, tiny_clip_opts, tmp_path):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    run_one_process(run_args(dtd_root, one, tiny_clip_opts))
    p = torchrun(2, run_args(dtd_root, two, tiny_clip_opts))
    log2 = p.communicate(timeout=300)[0]
    assert p.returncode == 0, log2
    a, b = last_state(one), last_state(two)
    for k in a["state_dict"]:
        torch.testing.assert_close(b["state_dict"][k], a["state_dict"][k], rtol=2e-5, atol=1e-6)
    text = open(osp.join(two, "log.txt")).read()
    assert "Data-parallel run: 2 processes (gloo)" in text
    acc = [line for line in text.splitlines() if "* accuracy" in line]
    one_log = open(osp.join(one, "log.txt")).read().splitlines()
    assert acc and acc == [line for line in one_log if "* accuracy" in line]
    with open(osp.join(two, "cost.json")) as f:
        assert json.load(f)["processes"] == 2
    assert not [f for f in os.listdir(two) if f.startswith("log.txt-")]  # one log, rank 0's
    # the 2-process run's epoch-1 checkpoint resumed in one process: the same epoch 2
    resumed = str(tmp_path / "resumed")
    shutil.copytree(two, resumed)
    ckpt_dir = osp.join(resumed, "prompt_learner")
    for f in os.listdir(ckpt_dir):
        if f.endswith("-2"):
            os.remove(osp.join(ckpt_dir, f))
    with open(osp.join(ckpt_dir, "checkpoint"), "w") as f:
        f.write("model.pth.tar-1\n")
    run_one_process(run_args(dtd_root, resumed, tiny_clip_opts))
    logs = sorted(f for f in os.listdir(resumed) if f.startswith("log.txt-"))  # this run's
    assert logs and "Previous epoch: 1" in open(osp.join(resumed, logs[-1])).read()
    c = last_state(resumed)
    for k in a["state_dict"]:
        torch.testing.assert_close(c["state_dict"][k], a["state_dict"][k], rtol=2e-5, atol=1e-6)


def test_a_killed_rank_ends_the_run_with_its_name(dtd_root, tiny_clip_opts, tmp_path):
    out = str(tmp_path / "killed")
    p = torchrun(2, run_args(dtd_root, out, tiny_clip_opts, "OPTIM.MAX_EPOCH", "200",
                             "DISTRIBUTED.TIMEOUT", "30"), start_new_session=True)  # fmt: skip
    try:
        victim = None
        deadline = time.time() + 240
        while victim is None and time.time() < deadline:
            time.sleep(1)
            log = osp.join(out, "log.txt")
            if osp.isfile(log) and "epoch [2/200]" in open(log).read():
                victim = rank_pid(p.pid, 1)
        assert victim is not None, "the run never reached epoch 2"
        os.kill(victim, signal.SIGKILL)
        t0 = time.time()
        text = p.communicate(timeout=120)[0]
        assert time.time() - t0 < 90
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode != 0
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", text), text[-3000:]  # torchrun names it
    assert "SIGKILL" in text or "Signal 9" in text, text[-3000:]
    # the survivor says why it stopped, in one line, not as a failure of its own
    assert "rank 0 of 2 stopped: another process failed or stopped answering" in text


def test_failure_messages_name_the_rank_and_the_cause():
    from engine.distributed import failure_message

    assert failure_message(ValueError("bad value\nmore")) == (
        "Data-parallel run: rank 0 of 1 failed: ValueError: bad value"
    )
    lost = failure_message(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1"))
    assert "stopped: another process failed or stopped answering" in lost


def rank_pid(parent: int, rank: int) -> int | None:
    """The process id of torchrun's worker of ``rank`` (its environment says RANK)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError):
            continue
        if env.get(b"RANK") == str(rank).encode():
            return int(pid)
    return None


def test_grid_groups_gpus_and_launches_torchrun():
    from argparse import Namespace

    from experiments.grid_distributed import check_args, gpu_groups
    from experiments.grid_exec import GridError, torchrun_command

    assert gpu_groups(["0", "1", "2", "3"], 2) == ["0,1", "2,3"]
    with pytest.raises(GridError, match="multiple of 2 GPUs"):
        gpu_groups(["0", "1", "2"], 2)
    assert torchrun_command(["py", "train.py", "--seed", "1"], 2) == [
        "py", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "train.py", "--seed", "1",
    ]  # fmt: skip
    args = Namespace(gpus_per_run=2, in_process=False, per_gpu=1, slurm=True, slurm_gpus=1)
    assert check_args(args) == 2 and args.slurm_gpus == 2  # one GPU per process
    with pytest.raises(GridError, match="--in-process"):
        check_args(Namespace(gpus_per_run=2, in_process=True, per_gpu=1, slurm=False))


def slurm_args(**kw):
    from argparse import Namespace

    base = dict(gpus_per_run=8, nodes=2, in_process=False, per_gpu=1, slurm=True, slurm_gpus=1,
                slurm_time=60, slurm_cpus=16, slurm_parallel=4, slurm_partition="", slurm_mem=0,
                slurm_param=[])  # fmt: skip
    return Namespace(**{**base, **kw})


def test_grid_nodes_asks_slurm_for_the_nodes_and_runs_each_run_as_one_step(tmp_path, monkeypatch):
    """``--slurm --nodes 2 --gpus-per-run 8``: the job's sbatch script asks for 2 nodes with 4
    GPUs each (one task per node: the chain runs on the first; requeue and the time-limit
    signal as for every grid job); each run is one srun step of 2 x 4 processes."""
    import submitit

    from experiments.grid_distributed import check_args, launch_command, step_options
    from experiments.grid_slurm import ChainJob, submitit_params

    args = slurm_args()
    assert check_args(args) == 8 and args.slurm_gpus == 4  # GPUs per node
    executor = submitit.AutoExecutor(folder=str(tmp_path), cluster="slurm")
    executor.update_parameters(**submitit_params(args))
    script = executor._executor._make_submission_file_text("python -m submitit.core._submit", "x")
    for line in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4", "--cpus-per-task=16",
                 "--requeue", "--signal=USR2@90"):  # fmt: skip
        assert f"#SBATCH {line}\n" in script, (line, script)
    cmd = launch_command(["py", "train.py", "--seed", "1"], 8, 2, step_options(args, 8, 2))
    assert cmd == [
        "srun", "--overlap", "--nodes", "2", "--ntasks-per-node", "4", "--cpus-per-task", "4",
        "--gpus-per-node", "4", "--kill-on-bad-exit=1", "py", "train.py", "--seed", "1",
    ]  # fmt: skip
    cpu = slurm_args(slurm_gpus=0, gpus_per_run=4)  # gloo on CPU nodes: no GPU option
    assert check_args(cpu) == 4 and "--gpus-per-node" not in step_options(cpu, 4, 2)
    # one node: the job and the runs as before (torchrun on the job's node)
    one = slurm_args(nodes=1, gpus_per_run=2)
    assert check_args(one) == 2 and "nodes" not in submitit_params(one)
    assert launch_command(["py", "train.py"], 2, 1)[1:3] == ["-m", "torch.distributed.run"]
    # the job's other tasks (one per node) leave the chain to the first
    monkeypatch.setenv("SLURM_PROCID", "1")
    from experiments.protocols import Chain

    chain = Chain.__new__(Chain)
    chain.train = type("Run", (), {"label": "CoOp dtd seed1"})()
    assert "task 1" in ChainJob(8, 2)(chain, None)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(gpus_per_run=6, nodes=4), "must be a multiple of --nodes .*--nodes 3"),
        (dict(gpus_per_run=2, nodes=3), "must be a multiple of --nodes"),
        (dict(nodes=2, slurm=False), "add --slurm"),
        (dict(nodes=0), "--nodes must be at least 1"),
        (dict(gpus_per_run=8, nodes=2, slurm_cpus=2), "4 processes per node need at least"),
    ],
)
def test_grid_nodes_refuses_what_does_not_divide(kw, message):
    from experiments.grid_distributed import check_args
    from experiments.grid_exec import GridError

    with pytest.raises(GridError, match=message):
        check_args(slurm_args(**kw))
