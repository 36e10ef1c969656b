"""Runs packed into long-lived worker processes (``tools/grid.py --in-process``, engine/runner.py)
give the folders and numbers of one train.py process per run, and a packed chain resumes after
its worker is killed."""

from __future__ import annotations

import json
import os
import os.path as osp
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT

from tools import grid

OPTIMS = ("sgd", "sample")
# files whose content names the run's time, host or process (compared separately or not at all)
VOLATILE = ("console.txt", ".lock", "events.out.tfevents")


def grid_argv(data: str, out: str, tiny_clip_opts, *flags) -> list[str]:
    argv = ["--trainers", "CoOp", "--optims", *OPTIMS, "--datasets", "dtd", "--seeds", "1"]
    argv += ["--data", data, "--output", out, "--shots", "2", "--no-check", "--quiet", *flags]
    opts = [*tiny_clip_opts, "OPTIM.MAX_EPOCH", "3", "TEST.FEATURE_CACHE", "False"]
    return argv + ["--", *opts, "TRAINER.COOP.PREC", "fp32", "TRAINER.COOP.N_CTX", "4"]


def files(out: str) -> dict[str, str]:
    """``{path relative to out: full path}`` of every file but the volatile ones."""
    found = {}
    for folder, _, names in os.walk(out):
        for name in names:
            if not any(v in name for v in VOLATILE):
                path = osp.join(folder, name)
                found[osp.relpath(path, out)] = path
    return found


def numbers(log: str) -> list[str]:
    """The lines of a log.txt that carry numbers, without times and paths."""
    keep = []
    for line in log.splitlines():
        if line.startswith(("epoch [", "* ")):
            line = re.sub(r" (time|data) [\d.]+ \([\d.]+\)| eta \S+", "", line)
            keep.append(line)
    return keep


def last_log(folder: str) -> str:
    """The newest log of a run folder (a resumed run keeps log.txt and writes log.txt-<time>)."""
    logs = sorted(n for n in os.listdir(folder) if n.startswith("log.txt"))
    with open(osp.join(folder, logs[-1])) as f:
        return f.read()


MEASURED = ("train_time_s", "mean_step_s", "peak_cpu_rss_mb", "peak_cuda_mb", "startup", "wall_s")


def counted_cost(cost: dict, segments: bool = True) -> dict:
    """A run's cost.json without what is measured (times, memory): what it counted (a resumed
    run has a segment per process: ``segments`` False compares the totals only)."""
    out = {k: v for k, v in cost.items() if k not in MEASURED and k != "segments"}
    if segments:
        out["segments"] = [
            {k: v for k, v in s.items() if k not in MEASURED} for s in cost["segments"]
        ]
    return out


def assert_same_runs(a: str, b: str, resumed: bool = False) -> None:
    """Same files, bit for bit (checkpoints, scalars, splits), same configs up to the output
    root, same numbers in the logs; ``resumed``: b's runs were interrupted and resumed, so only
    the result lines of their newest logs are compared."""
    fa, fb = files(a), files(b)
    if resumed:
        fa, fb = ({k: v for k, v in f.items() if "log.txt" not in k} for f in (fa, fb))
        for rel in fa:
            if osp.basename(rel) == "config.yaml":
                run_a, run_b = osp.dirname(fa[rel]), osp.dirname(fb[rel])
                results = [[x for x in numbers(last_log(r)) if x.startswith("* ")]
                           for r in (run_a, run_b)]  # fmt: skip
                assert results[0] and results[0] == results[1], rel
    assert sorted(fa) == sorted(fb)
    for rel, path in fa.items():
        with open(path, "rb") as f:
            x = f.read()
        with open(fb[rel], "rb") as f:
            y = f.read()
        if osp.basename(rel) == "log.txt":
            x, y = (numbers(t.decode()) for t in (x, y))
            assert x and x == y, rel
        elif osp.basename(rel) == "cost.json":  # measured times and memory differ; what ran not
            x, y = (counted_cost(json.loads(t), segments=not resumed) for t in (x, y))
            assert x["steps"] and x == y, rel
        elif rel.endswith((".yaml", ".json")):
            assert x.replace(a.encode(), b"OUT") == y.replace(b.encode(), b"OUT"), rel
        else:  # checkpoints, scalars.jsonl, split files: bit for bit
            assert x == y, rel


@pytest.fixture(scope="module")
def separate(tmp_path_factory, tiny_clip_opts):
    """The grid with one train.py process per run (the reference)."""
    base = tmp_path_factory.mktemp("packed")
    from datasets.synthetic import make_dtd

    make_dtd(str(base / "data"))
    out = str(base / "separate")
    assert grid.main(grid_argv(str(base / "data"), out, tiny_clip_opts)) == 0
    return str(base / "data"), out


@pytest.mark.slow  # with the fixture: a dozen tiny runs, about a minute on 2 cores
def test_packed_workers_give_the_folders_and_numbers_of_separate_processes(
    separate, tmp_path, tiny_clip_opts
):
    data, reference = separate
    out = str(tmp_path / "packed")
    argv = grid_argv(data, out, tiny_clip_opts, "--in-process", "--workers", "2")
    assert grid.main(argv) == 0
    assert_same_runs(reference, out)
    copied = 0  # runs whose CLIP tower was a copy of an earlier run's (engine/clip/tower_cache)
    for rel in files(out):  # the runs' own logs, as train.py writes them
        if rel.endswith("log.txt"):
            with open(osp.join(out, rel)) as f:
                log = f.read()
            assert log.count("** Arguments **") == 1
            copied += "a copy of the tower built for an earlier run" in log
    assert copied >= 2  # the later runs of both workers: the same numbers as fresh builds


@pytest.mark.slow
def test_a_packed_chain_resumes_after_its_worker_is_killed(separate, tmp_path, tiny_clip_opts):
    data, reference = separate
    out = str(tmp_path / "killed")
    argv = grid_argv(data, out, tiny_clip_opts, "--in-process")
    cmd = [sys.executable, osp.join(ROOT, "tools", "grid.py"), *argv]
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    trains = [r for r, _, names in os.walk(reference) if "train_base" in r and "log.txt" in names]
    first = next(r for r in trains if "+sample" not in r)  # the sgd chain runs first
    train_dir = osp.join(out, osp.relpath(first, reference))
    rolling = osp.join(train_dir, "prompt_learner", "model-last.pth.tar")
    deadline = time.time() + 240
    while time.time() < deadline and not osp.isfile(rolling):  # epoch 1 saved: kill the worker
        time.sleep(0.01)
    with open(osp.join(train_dir, ".lock")) as f:
        pid = int(f.read().split()[1])  # "pid N on host ..." : the worker holding the run
    assert pid != proc.pid
    os.kill(pid, signal.SIGKILL)
    stdout, _ = proc.communicate(timeout=240)
    assert proc.returncode == 1, stdout  # the killed run failed, the grid went on
    assert not osp.isfile(osp.join(train_dir, "prompt_learner", "model.pth.tar-3"))
    assert grid.main(argv) == 0  # the re-run resumes the partial chain
    assert "Previous epoch: 1" in last_log(train_dir)  # resumed from the killed run's epoch
    assert_same_runs(reference, out, resumed=True)


def test_paper_grid_estimate_counts_every_run():
    from tools.benchmark import grid_hours, grid_training_steps

    runs = grid_training_steps()
    assert len(runs) == 2100  # tools/grid.py --preset paper
    trainings = [r for r in runs if r[0] == "train"]
    assert all(steps > 0 for _, _, steps in trainings)
    assert all(steps == 0 for stage, _, steps in runs if stage == "eval")
    assert grid_hours(runs, 20.0, 0.0, 1.6) == pytest.approx(2100 * 20 / 3600)
    two = [("train", "sgd", 1000), ("train", "sample", 1000), ("eval", "sample", 0)]
    assert grid_hours(two, 0.0, 36.0, 1.5) == pytest.approx((36 + 54) / 3600)
