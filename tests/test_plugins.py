"""Plugins: a user's own trainer / optimizer / reader, loaded by --plugin, PLUGINS or
$SAMPLE_PL_PLUGINS without editing the project (engine/plugins.py).

Plugins register into the process-wide registries, so every case runs in a subprocess."""

from __future__ import annotations

import os
import os.path as osp
import subprocess
import sys

import pytest
from conftest import ROOT, run_train
from helpers import coop_args

EXAMPLE = osp.join(ROOT, "tests", "examples", "example_plugin.py")


def _python(code: str, env_extra: dict | None = None, cwd: str = ROOT):
    env = dict(os.environ)
    env.pop("SAMPLE_PL_PLUGINS", None)
    env.update(PYTHONPATH=ROOT, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )


_SETUP = (
    "import datasets, trainers\n"
    "from engine.cli import build_parser, setup_cfg\n"
    "from engine.registry import TRAINER_REGISTRY\n"
    "from optim.build import OPTIMIZER_REGISTRY\n"
)


def test_plugin_from_flag_file_and_environment_adds_its_keys_once(tmp_path):
    cfg_file = tmp_path / "plugin.yaml"
    cfg_file.write_text(
        f"PLUGINS: ['{EXAMPLE}']\nTRAINER:\n  LABELSMOOTHCOOP:\n    SMOOTHING: 0.2\n"
    )
    argvs = [
        ["--plugin", EXAMPLE, "--trainer", "LabelSmoothCoOp", "OPTIM.SAM.SHRINK", "0.3"],
        ["--trainer", "LabelSmoothCoOp", "--config-file", str(cfg_file)],
        ["--trainer", "LabelSmoothCoOp", "PLUGINS", f"['{EXAMPLE}']"],
        ["--trainer", "LabelSmoothCoOp"],
    ]
    code = _SETUP + (
        f"for argv in {argvs!r}:\n"
        "    cfg = setup_cfg(build_parser().parse_args(argv))\n"
        "    node = cfg.TRAINER.LABELSMOOTHCOOP\n"
        "    print(list(cfg.PLUGINS), cfg.OPTIM.SAM.SHRINK, node.SMOOTHING)\n"
        "print('shrinksam' in OPTIMIZER_REGISTRY, 'LabelSmoothCoOp' in TRAINER_REGISTRY)\n"
    )
    proc = _python(code, {"SAMPLE_PL_PLUGINS": EXAMPLE})  # the same plugin, named 4 ways
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == f"['{EXAMPLE}'] 0.3 0.1"  # env + flag: one entry, imported once
    assert lines[1] == f"['{EXAMPLE}'] 0.5 0.2"  # PLUGINS in the config file
    assert lines[2] == f"['{EXAMPLE}'] 0.5 0.1"
    assert lines[3] == f"['{EXAMPLE}'] 0.5 0.1"  # the environment alone
    assert lines[4] == "True True"


def test_without_the_plugin_its_trainer_and_keys_are_unknown():
    code = _SETUP + (
        "from engine.errors import ConfigError, RegistryError\n"
        "try:\n"
        "    setup_cfg(build_parser().parse_args(['--trainer', 'CoOp', 'OPTIM.SAM.SHRINK', '1']))\n"
        "except ConfigError as e:\n"
        "    print('refused:', e)\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused: Unknown config key 'OPTIM.SAM.SHRINK'" in proc.stdout


def test_a_module_name_plugin_and_its_sibling_imports(tmp_path):
    pkg = tmp_path / "mylab"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helper_mod.py").write_text("VALUE = 7\n")
    (pkg / "reader.py").write_text(
        "from engine.registry import DATASET_REGISTRY\n"
        "from datasets.dtd import DescribableTextures\n"
        "@DATASET_REGISTRY.register()\n"
        "class MyTextures(DescribableTextures):\n"
        "    pass\n"
    )
    (tmp_path / "standalone.py").write_text(
        "import helper_sibling\nprint('sibling', helper_sibling.X)\n"
    )
    (tmp_path / "helper_sibling.py").write_text("X = 3\n")
    code = (
        "from engine.plugins import load_plugins\n"
        "from engine.registry import DATASET_REGISTRY\n"
        f"print(load_plugins(['mylab.reader', {str(tmp_path / 'standalone.py')!r}]))\n"
        "print('MyTextures' in DATASET_REGISTRY)\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([ROOT, str(tmp_path)])}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
        env=dict(os.environ, **env),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["sibling 3", "['mylab.reader', 'standalone']", "True"]


@pytest.mark.parametrize(
    "spec, content, message",
    [
        ("missing_plugin.py", None, "Plugin file not found: "),
        ("no_such_module_xyz", None, "Plugin module 'no_such_module_xyz' not found"),
        ("broken.py", "import math\nraise RuntimeError('boom')\n", "failed to import: "),
        ("badimport.py", "import not_installed_pkg_q\n", "No module named 'not_installed_pkg_q'"),
    ],
)
def test_bad_plugins_are_one_paragraph_naming_the_plugin(tmp_path, spec, content, message):
    if content is not None:
        (tmp_path / spec).write_text(content)
    path = str(tmp_path / spec) if spec.endswith(".py") else spec
    proc = run_train(["--trainer", "CoOp", "--plugin", path], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert message in proc.stderr and path in proc.stderr
    if spec == "broken.py":
        assert "RuntimeError: boom" in proc.stderr and f"{path}:2" in proc.stderr


@pytest.mark.slow
def test_train_py_runs_a_plugin_trainer_with_a_plugin_optimizer(tmp_path, dtd_root, tiny_clip_opts):
    out = str(tmp_path / "run")
    args = coop_args(
        dtd_root, out, tiny_clip_opts, "OPTIM.MAX_EPOCH", "1", "OPTIM.SAM.NAME", "shrinksam",
        "TRAINER.LABELSMOOTHCOOP.PREC", "fp32",
        trainer="LabelSmoothCoOp", flags=("--plugin", EXAMPLE),
    )  # fmt: skip
    args.remove("TRAINER.COOP.PREC")
    args.remove("fp32")  # the CoOp node's precision key: this trainer has its own node
    run_train(args)
    log = open(osp.join(out, "log.txt")).read()
    assert "Finish training" in log and "* accuracy:" in log
    assert f"- {EXAMPLE}" in open(osp.join(out, "config.yaml")).read()
    # a re-run with the plugin named through the environment is the same experiment: resumes
    proc = run_train([a for a in args if a not in ("--plugin", EXAMPLE)], check=False)
    assert proc.returncode != 0  # without the plugin the trainer does not exist ...
    env_before = os.environ.get("SAMPLE_PL_PLUGINS")
    os.environ["SAMPLE_PL_PLUGINS"] = EXAMPLE
    try:
        run_train([a for a in args if a not in ("--plugin", EXAMPLE)])  # ... with it: it does
    finally:
        if env_before is None:
            del os.environ["SAMPLE_PL_PLUGINS"]
        else:
            os.environ["SAMPLE_PL_PLUGINS"] = env_before
