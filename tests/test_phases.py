"""Start-up you can see: the phases before a run's first step (engine/phases.py) in log.txt and
cost.json, adding up to the time to the first step; heavy modules a run does not need are not
imported at start-up."""

from __future__ import annotations

import json
import os.path as osp
import subprocess
import sys
import time

import pytest
from conftest import ROOT
from helpers import coop_args
from test_startup import run_python

from engine import phases

# what a run does not need before its first step (each imported where it is used)
HEAVY = ("torch.utils.tensorboard", "tensorboard", "matplotlib", "scipy", "submitit", "pandas")
HEAVY += ("tools.report", "tools.make_tables", "tools.plotting", "huggingface_hub")


def test_clock_phases_are_contiguous(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(phases.time, "perf_counter", lambda: now[0])
    clock = phases.StartupClock(90.0)  # the process started 10 s ago: imports so far
    clock.enter("config")
    now[0] = 101.0
    with clock.phase("clip weights"):  # nested: the enclosing phase goes on after it
        now[0] = 103.5
    now[0] = 104.0
    clock.enter("first step")
    now[0] = 110.0
    clock.carve("compilation", 4.0)  # inside the first step
    clock.carve("compilation", 100.0)  # never more than the current phase holds
    result = clock.finish()
    assert result["time_to_first_step_s"] == 20.0
    assert result["phases"] == {
        "imports": 10.0,
        "config": 1.5,
        "clip weights": 2.5,
        "compilation": 6.0,
        "first step": 0.0,
    }
    now[0] = 200.0
    clock.enter("dataset")  # after the first step: nothing changes
    clock.carve("compilation", 1.0)
    assert clock.finish() is result and sum(result["phases"].values()) == 20.0
    assert phases.describe(result).startswith("Start-up: 20.00 s to the end of the first step")


def test_a_packed_workers_next_run_imports_nothing(monkeypatch):
    monkeypatch.setattr(phases, "_clock", None)
    monkeypatch.setattr(phases, "_process_start", None)
    phases.mark_process_start(time.perf_counter() - 5.0)
    first = phases.begin_run()
    assert first.seconds["imports"] >= 5.0 and first.stack == ["config"]
    second = phases.begin_run()  # the next run in the same process
    assert "imports" not in second.seconds and phases.current() is second
    assert 0 <= phases.process_start() <= time.perf_counter()  # this process's start


def test_a_runs_startup_phases_add_up_to_its_time_to_first_step(tmp_path, tiny_clip_opts):
    """A real train.py process (tiny CLIP, compiled with aot_eager so that compilation has a
    phase): log.txt and cost.json give the phases; they are non-negative and add up to the
    recorded time to the first step, which lies within the process's wall time as measured from
    outside it."""
    from datasets.synthetic import make_dtd

    data = make_dtd(str(tmp_path / "data"))
    out = tmp_path / "out"
    argv = coop_args(osp.dirname(data), str(out), tiny_clip_opts, "OPTIM.MAX_EPOCH", "1")
    argv += ["DATASET.NUM_SHOTS", "2", "MODEL.COMPILE", "aot_eager", "TEST.NO_TEST", "True"]
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, osp.join(ROOT, "train.py"), *argv],
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
        timeout=600,
    )
    outside = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    cost = json.loads((out / "cost.json").read_text())
    startup = cost["startup"]
    assert startup == cost["segments"][-1]["startup"]
    found = startup["phases"]
    expected = {"imports", "config", "dataset", "clip weights", "model build", "resume"}
    expected |= {"caches", "first batch", "compilation", "first step"}
    assert set(found) == expected, found
    assert list(found) == [p for p in phases.PHASES if p in found]  # in the order of a run
    assert all(s >= 0 for s in found.values()), found
    assert found["imports"] > 0.1 and found["compilation"] > 0  # torch; the first compiled call
    total = startup["time_to_first_step_s"]
    assert sum(found.values()) == pytest.approx(total, abs=1e-3)
    assert 0 < total < outside
    assert max(total, cost["train_time_s"]) <= cost["wall_s"] < outside
    log = (out / "log.txt").read_text()
    line = next(x for x in log.splitlines() if x.startswith("Start-up: "))
    assert f"{total:.2f} s to the end of the first step" in line
    assert all(f"{name} " in line for name in expected)


def test_starting_a_run_imports_no_heavy_module(tmp_path, tiny_clip_opts):
    """``import train`` and the config of a run (the start of every train.py process) import
    neither tensorboard, matplotlib, scipy, submitit nor the report tools: each is imported
    where it is used (scalars written, plots, Flowers102's .mat file, SLURM, reports)."""
    argv = coop_args(str(tmp_path), str(tmp_path / "out"), tiny_clip_opts)
    code = (
        "import sys, train\n"
        "from engine.cli import build_parser, setup_cfg\n"
        "from engine.validate import validate_cfg\n"
        f"validate_cfg(setup_cfg(build_parser().parse_args({argv!r})))\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    out = run_python(code, tmp_path)  # tests/test_startup.py's subprocess
    assert out.strip().splitlines()[-1] == "[]"
