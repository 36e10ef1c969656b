"""The grid on a real one-node SLURM cluster (tools/slurm_local.py: Debian's slurm-wlm, munge,
slurmdbd and mariadb, installed when missing): submit, wait, status, a requeued job that resumes,
a cancelled chain, and a time limit shorter than a chain."""

from __future__ import annotations

import json
import os
import os.path as osp
import subprocess
import sys
import time

import pytest
from conftest import ROOT

from experiments.grid_slurm import JOBS_FILE
from tools import grid, make_tables, slurm_local

# one worker of a parallel run (the README's `-n 2 --dist loadfile`) runs this file: one cluster
# (its daemons, ports and state folder) is started once, and no other worker starts another
pytestmark = pytest.mark.slow
EPOCHS = 10  # long enough to requeue the training in its middle (a rolling checkpoint a epoch)


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory):
    """A running one-node cluster (installed when missing), stopped at the end of the session."""
    reason = slurm_local.unavailable_reason()
    if reason:
        pytest.skip(reason)
    installed = slurm_local.install()
    cluster = slurm_local.LocalCluster(str(tmp_path_factory.mktemp("slurm")))
    started = cluster.start()
    print(f"\nSLURM cluster: installed in {installed:.1f} s, started in {started:.1f} s")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def slurm_cluster(local_cluster):
    """The cluster, with SLURM_CONF pointing the grid's commands (sbatch, sacct, ...) to it for
    this module's tests."""
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = local_cluster.conf
    yield local_cluster
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous


@pytest.fixture(scope="module")
def toy(tmp_path_factory, tiny_clip_opts):
    from datasets.synthetic import make_dtd

    base = tmp_path_factory.mktemp("slurm_grid")
    make_dtd(str(base / "data"))
    return base, tiny_clip_opts


def grid_argv(toy, out: str, *flags: str) -> list[str]:
    base, clip_opts = toy
    argv = ["--trainers", "CoOp", "--optims", "sgd", "sample", "--datasets", "dtd"]
    argv += ["--seeds", "1", "--repro", "paper", "--data", str(base / "data"), "--output", out]
    argv += ["--shots", "4", "--no-check", "--slurm", "--slurm-gpus", "0", "--slurm-cpus", "1"]
    argv += ["--slurm-poll", "1", *flags, "--", *clip_opts, "OPTIM.MAX_EPOCH", str(EPOCHS)]
    return argv + ["TEST.FEATURE_CACHE", "False", "TRAINER.COOP.PREC", "fp32"]


def chain_dirs(out: str, optim: str) -> tuple[str, str]:
    comp = "vit_b16_ctxv1" + ("" if optim == "sgd" else f"+{optim}")
    return tuple(
        osp.join(out, "base2new", stage, "dtd", "shots_4", "CoOp", comp, "seed1")
        for stage in ("train_base", "test_new")
    )


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def logs(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("log.txt"))


def results(folder: str) -> list[str]:
    """The result lines of a run's newest log."""
    return [line for line in read(osp.join(folder, logs(folder)[-1])).splitlines() if "* " in line]


def wait_for(what: str, ready, timeout: float = 180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = ready()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def reference(slurm_cluster, toy, tmp_path_factory):
    """The tiny grid (2 chains: CoOp with SGD and with SAMPLe, train + test) run on SLURM."""
    out = str(tmp_path_factory.mktemp("reference") / "out")
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, osp.join(ROOT, "tools", "grid.py"), *grid_argv(toy, out, "--slurm-wait")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(f"\nSLURM tiny grid: submit to done in {time.time() - t0:.1f} s")
    return out, proc


def test_grid_submits_waits_and_skips_what_is_done(reference, toy, capsys):
    out, proc = reference
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    assert text.count("submitted job ") == 2 and "2 chains: 2 done, 0 failed, 0 cancelled" in text
    assert "[done] job " in text and "CoOp+sample base2new train_base dtd seed1" in text
    assert grid.main(["--status", "--output", out]) == 0
    status = capsys.readouterr().out
    assert (
        status.count("     done  job ") == 2
        and "2 chains: 2 done (SLURM states from sacct)" in status
    )
    assert grid.main(grid_argv(toy, out, "--slurm-wait")) == 0  # nothing left: nothing submitted
    text = capsys.readouterr().out
    assert "4 runs in 2 chains: 4 done (skipped)" in text and "submitted" not in text
    argv = ["--output", out, "--shots", "4", "--trainers", "CoOp", "--optims", "sgd", "sample"]
    argv += ["--datasets", "dtd", "--seeds", "1", "--repro", "paper"]
    (panel,) = make_tables.build_tables(make_tables.build_parser().parse_args(argv))
    assert len(panel.rows) == 2 and all(cell.value is not None for cell in panel.rows[0][1:3])


def test_a_failed_submission_leaves_nothing_behind(slurm_cluster, toy, tmp_path, capsys):
    out = str(tmp_path / "out")
    # two GPUs: the node has one stand-in GPU, so sbatch refuses the job array
    assert grid.main(grid_argv(toy, out, "--slurm-gpus", "2")) == 2
    err = capsys.readouterr().err
    assert "SLURM submission failed" in err and "Requested node configuration" in err
    assert not osp.exists(osp.join(out, "slurm"))


def test_requeue_cancel_and_time_limit(reference, slurm_cluster, toy, tmp_path, capsys):
    """One submission, two chains and a one-minute time limit: the SGD chain's job is requeued
    (scontrol requeue) in the middle of its training, then gets submitit's time-limit signal
    during its evaluation; the SAMPLe chain is cancelled. The SGD chain ends with the reference's
    checkpoint and numbers; the next invocation submits only the cancelled chain."""
    ref_out, _ = reference
    out = str(tmp_path / "out")
    flags = ("--slurm-time", "1", "--slurm-param", "slurm_signal_delay_s=5", "--slurm-wait")
    cmd = [sys.executable, osp.join(ROOT, "tools", "grid.py"), *grid_argv(toy, out, *flags)]
    waiting = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        jobs_file = osp.join(out, "slurm", JOBS_FILE)
        wait_for(
            "the submission", lambda: osp.isfile(jobs_file) and len(read(jobs_file).split()) > 1
        )
        sgd, sample = (json.loads(line)["job_id"] for line in read(jobs_file).splitlines())
        slurm_cluster.run("scancel", sample)
        train_dir, test_dir = chain_dirs(out, "sgd")
        rolling = osp.join(train_dir, "prompt_learner", "model-last.pth.tar")
        wait_for("the first epoch's checkpoint", lambda: osp.isfile(rolling))
        slurm_cluster.run("scontrol", "requeue", sgd)
        requeued = time.time()
        job_log = osp.join(out, "slurm", sgd, f"{sgd}_0_log.out")
        wait_for("the second attempt", lambda: "attempt 2 on" in read(job_log))
        with capsys.disabled():
            print(f"\nSLURM requeue to resume: {time.time() - requeued:.1f} s")
        # the evaluation started in the second attempt: submitit's time-limit signal, as SLURM
        # sends it signal_delay_s before the limit (unless SLURM's own clock already did)
        wait_for("the evaluation", lambda: osp.isfile(osp.join(test_dir, "console.txt")))
        if "timed-out" not in read(job_log.replace(".out", ".err")):
            slurm_cluster.run("scancel", "--signal=USR2", sgd, check=False)
        stdout, _ = waiting.communicate(timeout=300)
    finally:
        waiting.kill()
    assert waiting.returncode == 1, stdout  # one chain cancelled
    assert f"[requeued] job {sgd}: CoOp base2new train_base dtd seed1 (attempt 2)" in stdout
    assert f"[requeued] job {sgd}: CoOp base2new train_base dtd seed1 (attempt 3)" in stdout
    assert f"[cancelled] job {sample}: CoOp+sample" in stdout and f"[done] job {sgd}" in stdout
    assert "2 chains: 1 done, 0 failed, 1 cancelled" in stdout
    job_logs = read(job_log) + read(job_log.replace(".out", ".err"))  # submitit's log lines
    assert "this job is timed-out" in job_logs and "Requeued job" in job_logs
    # the training resumed from its rolling checkpoint once and was never run again
    train_logs = logs(train_dir)
    assert len(train_logs) == 2, train_logs
    resumed = read(osp.join(train_dir, train_logs[-1]))
    epoch = int(resumed.split("Previous epoch: ")[1].split()[0])
    assert 1 <= epoch < EPOCHS
    ref_train, ref_test = chain_dirs(ref_out, "sgd")
    final = osp.join("prompt_learner", f"model.pth.tar-{EPOCHS}")
    with open(osp.join(train_dir, final), "rb") as a, open(osp.join(ref_train, final), "rb") as b:
        assert a.read() == b.read()  # bit for bit the uninterrupted run's checkpoint
    assert not osp.isfile(rolling)
    for ours, ref in ((train_dir, ref_train), (test_dir, ref_test)):
        assert results(ours) and results(ours) == results(ref)
    assert grid.main(["--status", "--output", out]) == 0
    status = capsys.readouterr().out
    assert f"     done  job {sgd}: CoOp base2new" in status and "requeued " in status
    assert f"cancelled  job {sample}: CoOp+sample" in status and "1 done, 1 cancelled" in status
    # the next invocation submits the cancelled chain only
    assert grid.main(grid_argv(toy, out, "--slurm-wait")) == 0
    text = capsys.readouterr().out
    assert text.count("submitted job ") == 1 and "CoOp+sample base2new train_base" in text
    assert "1 chains: 1 done" in text


def test_grid_gpus_per_run_two_on_slurm(slurm_cluster, toy, tmp_path):
    """``--gpus-per-run 2 --slurm-gpus 0 --nodes 1``: each chain's job runs its runs as 2 gloo
    processes (torchrun); training and the evaluation of the new classes are data-parallel
    runs. (Several nodes: tests/test_distributed.py checks the job's script and the steps.)"""
    base, clip_opts = toy
    out = str(tmp_path / "out")
    argv = ["--trainers", "CoOp", "--optims", "sample", "--datasets", "dtd", "--seeds", "1"]
    argv += ["--repro", "paper", "--data", str(base / "data"), "--output", out, "--shots", "4"]
    argv += ["--no-check", "--slurm", "--slurm-gpus", "0", "--slurm-cpus", "1"]
    argv += ["--slurm-poll", "1", "--slurm-wait", "--gpus-per-run", "2", "--nodes", "1"]
    argv += ["--", *clip_opts]
    argv += ["OPTIM.MAX_EPOCH", "2", "TEST.FEATURE_CACHE", "False", "TRAINER.COOP.PREC", "fp32"]
    proc = subprocess.run(
        [sys.executable, osp.join(ROOT, "tools", "grid.py"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chains: 1 done" in proc.stdout
    train_dir, test_dir = chain_dirs(out, "sample")
    for folder in (train_dir, test_dir):
        log = read(osp.join(folder, logs(folder)[-1]))
        assert "Data-parallel run: 2 processes (gloo)" in log and "* accuracy:" in log
        assert "--nproc_per_node 2" in read(osp.join(folder, "console.txt"))
    with open(osp.join(train_dir, "cost.json")) as f:
        assert json.load(f)["processes"] == 2
