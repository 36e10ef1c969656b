"""tools/benchmark.py: the timer's protocol, the evaluation arithmetic and a --small smoke run
(no timing assertions)."""

from __future__ import annotations

import json
import math
import os.path as osp
import subprocess
import sys

import pytest
from conftest import ROOT

from tools.benchmark import TARGETS, Timer, Timing, eval_seconds, mark_line, phases


def test_timer_interleaves_warms_up_and_stops_at_its_budget():
    order = []
    fns = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    times = Timer("cpu", warmup=2, steps=3, budget_s=100.0).measure(fns)
    assert order == ["a", "b"] * 5  # 2 warm-up rounds, 3 timed rounds, interleaved
    assert times["a"].calls == times["b"].calls == 3 and times["a"].seconds >= 0
    order.clear()
    times = Timer("cpu", warmup=3, steps=10, budget_s=0.0).measure(fns)
    assert order == ["a", "b"] * 2  # over budget: one warm-up round, one timed round
    assert times["a"].calls == 1
    order.clear()
    times = Timer("cpu", warmup=1, steps=1, budget_s=0.0, settle=3).measure(fns)
    assert order == ["a", "b"] * 5  # 3 settling rounds whatever the budget, 1 warm-up, 1 timed


def test_evaluation_seconds_encode_text_once_or_per_batch():
    # per call on 10 images: text 2 s (reference 3 s), images 1 s; 1,000 images in batches of 100
    times = {"setup": Timing(2.0, 1), "infer": Timing(1.0, 1)}
    times.update(ref_setup=Timing(3.0, 1), ref_infer=Timing(1.0, 1))
    project, reference = eval_seconds(times, per_call=10, batch=100, n_images=1000)
    assert project == 2.0 + 10 * 10 * 1.0
    assert reference == 10 * (3.0 + 10 * 1.0)


def test_run_phases_from_log_lines_count_compiled_first_calls():
    """--runs: the phases of a run from its log lines (the engine's own messages)."""
    marks = {}
    lines = [
        (1.0, "torch.compile (reduce-overhead): text_encoder, image_encoder"),
        (3.5, "torch.compile (reduce-overhead) text_encoder: first call 2.25 s (4 new graph(s) "
              "in this process), output equal to eager"),
        (3.8, "torch.compile (reduce-overhead) image_encoder: first call 0.25 s (0 new graph(s) "
              "in this process), output equal to eager"),
        (4.0, "epoch [1/1] batch [1/2] time 3.000 (3.000) ..."),
        (4.1, "epoch [1/1] batch [2/2] time 0.100 (1.550) ..."),
        (5.0, "* accuracy: 50.0%"),
    ]  # fmt: skip
    for now, line in lines:
        mark_line(marks, line, now)
    assert phases(marks, end=5.5) == {
        "to_first_step_s": 4.0, "steps_s": 0.1, "eval_s": 0.9, "exit_s": 0.5, "wall_s": 5.5,
        "compile_s": 2.5,
    }  # fmt: skip


@pytest.mark.slow
def test_small_run_writes_every_key(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--small", "--steps", "1", "--warmup", "0", "--optims", "sgd,sample"]
    args += ["--compile", "aot_eager"]  # the compiled default of a GPU, as CPU can trace it
    args += ["--trainers", "CoOp,MaPLe,NoSuchTrainer", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, osp.join(ROOT, "tools", "benchmark.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NoSuchTrainer is not registered: skipped" in proc.stderr
    result = json.loads(out.read_text())
    info = {"loader_images_per_s", "step_demand_images_per_s"}
    released = {"coop100_sgd_step_ms", "coop100_sample_step_ms"}
    vs_h200 = {"sgd_speedup_vs_released_h200", "sample_speedup_vs_released_h200"}
    assert set(result) == {*TARGETS, *info, *released, *vs_h200, "rows", "device"}
    assert all(result[k] > 0 for k in released) and all(result[k] is None for k in vs_h200)
    assert "vs the released code's 44.8 ms on an H200: n/a (not an H200)" in proc.stdout
    assert result["device"].startswith("cpu:")
    for key in TARGETS:
        assert key in proc.stdout  # the report names every target
        if key == "coop_sgd_step_ms":  # a GPU target
            assert result[key] is None
            continue
        assert math.isfinite(result[key]) and result[key] > 0, key
    demand = result["step_demand_images_per_s"]
    assert result["loader_over_step_demand"] == result["loader_images_per_s"] / demand
    rows = result["rows"]
    assert [(r["trainer"], r["optimizer"]) for r in rows] == [
        ("CoOp", "sgd"), ("CoOp", "sample"), ("MaPLe", "sgd"), ("MaPLe", "sample")
    ]  # fmt: skip
    for r in rows:
        assert r["prec"] == "fp32" and r["text_tokens"] < r["ref_text_tokens"] == 77
        assert r["step_ms"] > 0 and r["ref_step_ms"] > 0 and r["eval_images_per_s"] > 0
        assert r["peak_mem_mb"] is None  # CPU: not measured
        assert r["compile"] == "aot_eager" and r["eager_step_ms"] > 0 and not r["compile_fallback"]
    assert rows[0]["compile_s"] > 0  # the first compiled row pays the compilation
    assert rows[0]["batch"] == 32 and rows[2]["batch"] == 4 and rows[2]["depth"] == 9


@pytest.mark.slow
def test_efficient_mode_times_every_cheaper_optimizer_against_sgd(tmp_path):
    from tools.benchmark import EFFICIENT_OPTIMIZERS, EFFICIENT_STEPS_PER_CALL

    out = tmp_path / "efficient.json"
    args = ["--efficient", "--small", "--steps", "1", "--warmup", "0"]
    args += ["--efficient-trainers", "CoCoOp", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, osp.join(ROOT, "tools", "benchmark.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["steps_per_call"] == EFFICIENT_STEPS_PER_CALL
    rows = result["rows"]
    assert [r["optimizer"] for r in rows] == list(EFFICIENT_OPTIMIZERS)
    assert rows[0]["ratio_vs_sgd"] == 1.0
    for r in rows:
        assert r["trainer"] == "CoCoOp" and r["batch"] == 1 and r["step_ms"] > 0
        assert r["target"] is None  # the targets are CoOp's
    assert "x SGD" in proc.stdout
