"""Compilation that pays for itself (engine/compile_cache.py): MODEL.COMPILE auto compiles when the
run is long enough or the persistent cache holds its graphs, and a second process with the
cache folder warm compiles in a fraction of the cold time with identical results."""

from __future__ import annotations

import json
import logging
import os
import os.path as osp
import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT
from test_compile import trainer_cfg

import engine.compile as ec
import engine.compile_cache as cc
import engine.trainer as et
from engine import build_trainer


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    """A fresh cache root ($SAMPLE_PL_CACHE) for the test; inductor's variable restored after."""
    monkeypatch.setenv("SAMPLE_PL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(cc, "_current_key", None)
    yield tmp_path / "cache"
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


def test_the_decision_weighs_steps_against_compilation(cache_root):
    assert cc.cache_dir() == str(cache_root / "compile")
    key = cc.config_key(trainer="CoOp", device="gpu")
    eager_saving = cc.DEFAULT_EAGER_STEP_S * (1 - cc.COMPILED_RATIO)
    short = int(cc.DEFAULT_COMPILE_S / eager_saving) - 1  # saves just under the compile time
    pays, why = cc.decide(short, key, "gpu", records={})
    assert not pays and "(default)" in why and "<=" in why
    assert cc.decide(short + 2, key, "gpu", records={})[0]
    # measured on this device (another configuration): 0.1 s eager steps, 2 s to compile
    other = {"device": "gpu", "eager_step_s": 0.1, "cold_compile_s": 2.0}
    pays, why = cc.decide(30, key, "gpu", records={"other": other})  # 30 x 0.08 = 2.4 s > 2 s
    assert pays and "recorded on this device" in why and "this device's eager step" in why
    assert not cc.decide(20, key, "gpu", records={"other": other})[0]  # 1.6 s <= 2 s
    assert not cc.decide(30, key, "another gpu", records={"other": other})[0]  # defaults
    # compiled before with this cache folder: the graphs are there, a short run compiles too
    warm = {key: {"device": "gpu", "compiled": True, "compile_s": 40.0}}
    pays, why = cc.decide(1, key, "gpu", records=warm)
    assert pays and "holds this configuration's graphs" in why


def test_auto_decides_per_run_and_records_what_it_measured(
    cache_root, tmp_path, dtd_root, deep_opts, monkeypatch, caplog
):
    """A CPU stand-in for a GPU (a CPU backend for ``auto``, as tests/test_compile.py does): a short
    run stays eager and records its step time; once this device's records say compilation is
    cheap, the run compiles and records its compile time; the next run of that configuration
    compiles because the cache holds its graphs, however short."""
    # dynamo's "eager" backend: the decision and its records are the same, the compile cheaper
    monkeypatch.setattr(et, "resolve_compile", lambda v, d: "eager" if v == "auto" else "")
    no_test = ("TEST.NO_TEST", "True")

    def run(name):
        cfg = trainer_cfg("CoOp", tmp_path / name, dtd_root, deep_opts, "auto", "", *no_test)
        tr = build_trainer(cfg)
        with caplog.at_level(logging.INFO, logger="engine.compile_cache"):
            tr.train()
        return tr, caplog.records[-1].getMessage() if caplog.records else ""

    caplog.clear()
    tr, _ = run("eager")
    assert not ec.compiled_forwards(tr.model)
    assert "MODEL.COMPILE auto: eager: 4 steps x" in caplog.text and "(default)" in caplog.text
    records = cc.read_records()
    (key,) = records
    assert records[key]["eager_step_s"] == pytest.approx(tr.cost.summary()["mean_step_s"])
    # this device compiled another configuration in next to no time: compiling pays
    records["other"] = {"device": "cpu", "cold_compile_s": 1e-6}
    with open(osp.join(cc.cache_dir(), cc.RECORD_NAME), "w") as f:
        json.dump(records, f)
    caplog.clear()
    tr, _ = run("compiled")
    assert ec.compiled_forwards(tr.model) and "compiling (eager): 4 steps x" in caplog.text
    entry = cc.read_records()[key]
    assert entry["compiled"] and entry["compile_s"] > 0 and entry["cold_compile_s"] > 0
    assert entry["compiled_step_s"] == pytest.approx(tr.cost.summary()["mean_step_s"])
    records = cc.read_records()
    records["other"]["cold_compile_s"] = 1e6  # compiling anew would never pay now
    with open(osp.join(cc.cache_dir(), cc.RECORD_NAME), "w") as f:
        json.dump(records, f)
    caplog.clear()
    tr, _ = run("warm")
    assert ec.compiled_forwards(tr.model) and "holds this configuration's graphs" in caplog.text


WARM_COLD = """
import json, sys, time
import torch
from torch import nn
import engine.compile as ec
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
fwd = ec.CompiledForward("mlp", m.forward, "default")
x = torch.randn(8, 16)
start = time.perf_counter()
out = fwd(x)
out.square().sum().backward()  # the backward graph is compiled (and cached) here
seconds = time.perf_counter() - start
assert not fwd.fallback, fwd.fallback
print(json.dumps({"s": seconds, "out": out.detach().flatten().tolist(),
                  "grads": [p.grad.flatten().tolist() for p in m.parameters()]}))
"""


@pytest.mark.slow  # two processes compiling with inductor: ~40 s of CPU
@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU code needs a C++ compiler")
def test_a_warm_cache_compiles_in_a_fifth_of_the_cold_time(tmp_path):
    """Inductor (the GPU modes' compiler) on CPU, through the project's CompiledForward: the
    second process finds the generated code in the cache folder under $SAMPLE_PL_CACHE."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(PYTHONPATH=ROOT, SAMPLE_PL_CACHE=str(tmp_path / "cache"))
    results = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(WARM_COLD)],
            capture_output=True,
            text=True,
            cwd=str(tmp_path),
            env=env,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = results
    assert warm["out"] == cold["out"] and warm["grads"] == cold["grads"]  # bit for bit
    assert warm["s"] <= 0.2 * cold["s"], (cold["s"], warm["s"])
    folder = tmp_path / "cache" / "compile"
    assert any(os.scandir(folder)), "nothing was cached in the documented folder"
