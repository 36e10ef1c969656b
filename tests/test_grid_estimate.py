"""The cost of a grid's plan before it runs (experiments/grid_estimate.py): steps from the runs'
configs and dataset sizes, step and fixed costs from earlier runs' cost.json (this host's
first) or the documented defaults, and the estimate against the actual at the end."""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest

from experiments import grid_estimate as ge
from experiments.grid_plan import expand, select
from experiments.protocols import Setup
from tools import grid

HOST = socket.gethostname()

# A stand-in for `python train.py ...`: the files the grid reads, and a training run's cost.json
# with its wall time (engine/cost.py)
FAKE_TRAIN = """#!{python}
import json, os, sys, time
args = sys.argv[2:]
opt = lambda name: args[args.index(name) + 1]
out, ev = opt("--output-dir"), "--eval-only" in args
time.sleep(0.3)
os.makedirs(os.path.join(out, "prompt_learner"), exist_ok=True)
with open(os.path.join(out, "log.txt"), "w") as f:
    f.write(("=> result" if ev else "Finish training") + "\\n* accuracy: 50.0%\\n")
if not ev:
    with open(os.path.join(out, "config.yaml"), "w") as f:
        f.write("OPTIM:\\n  MAX_EPOCH: 3\\n")
    for name, text in (("model.pth.tar-3", ""), ("checkpoint", "model.pth.tar-3\\n")):
        with open(os.path.join(out, "prompt_learner", name), "w") as f:
            f.write(text)
    cost = {{"steps": 6, "train_time_s": 0.1, "mean_step_s": 0.1 / 6, "wall_s": 0.3}}
    cost.update(device="cpu", trainer="CoOp", optimizer="sgd", batch_size=32)
    with open(os.path.join(out, "cost.json"), "w") as f:
        json.dump({{**cost, "segments": [cost]}}, f)
"""


def write_cost(folder, **cost) -> None:
    os.makedirs(folder, exist_ok=True)
    record = {"trainer": "CoOp", "device": "cpu", "batch_size": 32, "host": HOST, **cost}
    with open(os.path.join(folder, "cost.json"), "w") as f:
        json.dump(record, f)


def coop_chains(setup, optims=("sgd", "sample")):
    return expand(
        select(None, trainers=["CoOp"], optims=list(optims), datasets=["dtd"], seeds=[1]), setup
    )


def test_plan_from_configs_and_earlier_costs(tmp_path):
    out = tmp_path / "out"
    setup = Setup(data="d", output=str(out))
    # earlier CoOp + SGD runs on this host (fixed cost = wall - training time: 20 s and 30 s),
    # and one of another host that must not count while this host has records
    write_cost(out / "old" / "a", optimizer="sgd", steps=10, mean_step_s=0.5, train_time_s=5.0,
               wall_s=25.0)  # fmt: skip
    write_cost(out / "old" / "b", optimizer="sgd", steps=10, mean_step_s=0.7, train_time_s=7.0,
               wall_s=37.0)  # fmt: skip
    write_cost(out / "old" / "c", optimizer="sgd", steps=10, mean_step_s=50.0, train_time_s=500.0,
               wall_s=600.0, host="elsewhere")  # fmt: skip
    chains = coop_chains(setup)
    plan = ge.estimate_plan(chains, setup, "cpu", slots=2)
    assert plan.records == 2 and plan.this_host
    trains = [r for r in plan.runs if r.stage == "train"]
    evals = [r for r in plan.runs if r.stage == "eval"]
    assert len(trains) == 2 and len(evals) == 2
    # DTD base classes: ceil(47 / 2) = 24, x 16 shots = 384 images, batch 32: 12 steps per
    # epoch, CoOp's base-to-new config: 200 epochs
    assert [r.steps for r in trains] == [2400, 2400]
    for r in plan.runs:  # medians of this host's records
        assert (r.step_s, r.fixed_s, r.measured) == (pytest.approx(0.6), 25.0, True)
    assert evals[0].seconds == 25.0
    chain_s = 2400 * 0.6 + 25.0 + 25.0
    assert plan.run_seconds == pytest.approx(2 * chain_s)
    assert plan.wall_seconds == pytest.approx(chain_s)  # two chains on two workers
    assert ge.estimate_plan(chains, setup, "cpu", slots=1).wall_seconds == pytest.approx(
        2 * chain_s
    )
    line = plan.describe()
    assert "4 runs (2 trainings, 4,800 steps)" in line and "CPU-hours" in line
    assert "2 cost.json of earlier runs on this host (0 runs at the default costs)" in line
    # a resumed run counts the steps its cost.json has not recorded
    write_cost(chains[0].train.out_dir, optimizer="sgd", steps=400, mean_step_s=0.6,
               train_time_s=240.0)  # fmt: skip
    resumed = ge.estimate_plan(chains[:1], setup, "cpu", slots=1)
    assert resumed.runs[0].steps == 2000


def test_defaults_without_records_and_unknown_sizes(tmp_path):
    setup = Setup(data="d", output=str(tmp_path / "out"))
    plan = ge.estimate_plan(coop_chains(setup), setup, "cuda", slots=1, records=[])
    sgd, sample = (r for r in plan.runs if r.stage == "train")
    assert sgd.step_s == ge.DEFAULT_STEP_S["cuda"] and not sgd.measured
    assert sample.step_s == pytest.approx(ge.DEFAULT_STEP_S["cuda"] * ge.TWO_PASS_RATIO)
    assert sgd.fixed_s == ge.DEFAULT_FIXED_S["cuda"]
    assert "GPU-hours" in plan.describe() and "4 runs at the default costs" in plan.describe()
    # all shots of a dataset: the training set's size is not known before reading it
    full = Setup(data="d", output=str(tmp_path / "out"), opts=("DATASET.NUM_SHOTS", "-1"))
    plan = ge.estimate_plan(coop_chains(full, ("sgd",)), full, "cpu", slots=1, records=[])
    assert plan.runs[0].steps is None and plan.runs[0].seconds == ge.DEFAULT_FIXED_S["cpu"]
    assert "1 training(s) of unknown size counted at their fixed cost only" in plan.describe()
    assert ge.packed_wall([5.0, 4.0, 3.0, 3.0], 2) == 8.0  # longest first: 5 | 4, 4+3 | 5+3
    assert ge.plan_slots(grid.build_parser().parse_args(["--gpus", "0,1", "--per-gpu", "3"])) == 6
    assert ge.plan_device(grid.build_parser().parse_args(["--gpus", "0"])) == "cuda"
    assert ge.plan_device(grid.build_parser().parse_args(["--workers", "2"])) == "cpu"


def test_grid_prints_the_estimate_and_compares_it_with_the_actual(tmp_path, capsys, monkeypatch):
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_TRAIN.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))  # Setup.python's default
    out = str(tmp_path / "out")
    argv = ["--trainers", "CoOp", "--optims", "sgd", "--datasets", "dtd", "eurosat"]
    argv += ["--seeds", "1", "--output", out, "--data", "d", "--no-check", "--quiet"]
    assert grid.main([*argv, "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "Estimate: 4 runs (2 trainings, " in text and "0 cost.json" in text
    assert grid.main(argv) == 0
    text = capsys.readouterr().out
    assert "Estimate: 4 runs" in text
    actual = next(line for line in text.splitlines() if line.startswith("Actual: "))
    assert "h of wall time (estimated " in actual
    assert "training runs 0.000 h by their cost.json (estimated " in actual
    # the next plan (another seed) takes its costs from the runs that just finished
    assert grid.main([*argv[:8], "2", *argv[9:], "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "costs from 2 cost.json of earlier runs (0 runs at the default costs)" in text
