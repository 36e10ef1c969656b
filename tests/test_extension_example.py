"""A new optimizer and a new trainer are picked up by the shared tests without editing them.

``tests/examples/example_plugin.py`` registers ``shrinksam`` (a new sharpness-aware optimizer
with a new OPTIM.SAM key) and ``LabelSmoothCoOp`` (a new trainer with its own config node). The
shared suites run in a subprocess with the plugin loaded; their cases for the two new entries
must exist and pass. The float64 fidelity suite asks for a hand computation of the new
optimizer's equations (the one thing written by hand).
"""

from __future__ import annotations

import os
import os.path as osp
import re
import subprocess
import sys

import pytest

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


@pytest.mark.slow
def test_new_optimizer_and_trainer_run_through_the_shared_suites():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, osp.join(ROOT, "tests", "examples")]))
    suites = ["tests/test_optim.py", "tests/test_trainer_matrix.py", "tests/test_architecture.py"]
    suites += ["tests/test_optim_engine.py::test_registry_metadata"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "example_plugin", *suites]
    select = "(shrinksam or LabelSmoothCoOp or registry_metadata) and not hand"
    cmd += ["-k", select, "-p", "no:cacheprovider", "-rA"]  # -rA: a line for each passed test
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    passed = int(re.search(r"(\d+) passed", out).group(1))
    assert passed >= 25, out[-2000:]  # optimizer math cases + trainer matrix + architecture
    listing = "\n".join(line for line in proc.stdout.splitlines() if line.startswith("PASSED "))
    for case in (
        "shrinksam-paper",
        "LabelSmoothCoOp-fp16-sample",
        "LabelSmoothCoOp-fp32-shrinksam",
    ):
        assert case in listing, case
    assert (
        "test_every_trainer_builds_from_class_names_and_reports_its_outputs[LabelSmoothCoOp]"
        in (listing)
    )


@pytest.mark.slow
def test_the_new_key_comes_from_the_registry_entry():
    code = (
        "import example_plugin, trainers, datasets\n"
        "from engine.config import get_cfg_default\n"
        "cfg = get_cfg_default()\n"
        "print(cfg.OPTIM.SAM.SHRINK, cfg.TRAINER.LABELSMOOTHCOOP.SMOOTHING)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, osp.join(ROOT, "tests", "examples")]))
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["0.5", "0.1"]


_CONFIGURE = """
import json, sys
import datasets, trainers
from engine.cli import build_parser, setup_cfg
from engine.errors import ConfigError
from engine.validate import validate_cfg
from optim import build_optimizer
import torch

def cfg_of(*opts):
    args = ["--plugin", sys.argv[1], "--trainer", "CoOp", *opts]
    return setup_cfg(build_parser().parse_args(args))

cfg = cfg_of("OPTIM.NAME", "sgd", "OPTIM.SAM.NAME", "shrinksam", "OPTIM.SAM.SHRINK", "0.25")
validate_cfg(cfg)
opt = build_optimizer(cfg, [torch.nn.Parameter(torch.zeros(3))])
try:
    validate_cfg(cfg_of("OPTIM.SAM.SHRINK", "2.0"))
    error = None
except ConfigError as e:
    error = str(e)
print(json.dumps([cfg.OPTIM.SAM.SHRINK, type(opt).__name__, opt.defaults["shrink"], error]))
"""


def test_a_plugin_optimizer_is_configured_and_checked_from_its_hparam():
    """``--plugin`` with the example file: its new key OPTIM.SAM.SHRINK merges from the command
    line, reaches the constructor and is range-checked from its HParam, with no edit in engine/."""
    import json

    env = dict(os.environ, PYTHONPATH=ROOT)
    plugin = osp.join(ROOT, "tests", "examples", "example_plugin.py")
    proc = subprocess.run(
        [sys.executable, "-c", _CONFIGURE, plugin],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    shrink, cls, kwarg, error = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (shrink, cls, kwarg) == (0.25, "ShrinkSAM", 0.25)
    assert error == "Config key OPTIM.SAM.SHRINK must be a number in (0, 1], got 2.0"
