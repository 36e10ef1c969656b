"""Shared fixtures: a tiny random-weight CLIP on disk and generated datasets."""

from __future__ import annotations

import collections
import os
import os.path as osp
import subprocess
import sys

import pytest

import datasets  # noqa: F401  (registers the readers, as train.py does)
import trainers  # noqa: F401  (registers the trainers, as train.py does)

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))

os.environ.setdefault("OMP_NUM_THREADS", "2")
# tests never download CLIP weights (engine/clip/weights.py); the download tests lift this switch
# around a loopback server of their own
os.environ.setdefault("SAMPLE_PL_OFFLINE", "1")
if "SAMPLE_PL_CACHE" not in os.environ:  # caches of the tests never go to the home folder
    import tempfile

    os.environ["SAMPLE_PL_CACHE"] = tempfile.mkdtemp(prefix="sample-pl-test-cache-")
# A parallel run (pytest-xdist, the README's `-n 2`): each worker process computes on one core (two
# workers with two threads each would oversubscribe two cores; train.py subprocesses started by
# the tests follow OMP_NUM_THREADS) and keeps its caches in a folder of its own.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ["SAMPLE_PL_CACHE"] = osp.join(os.environ["SAMPLE_PL_CACHE"], XDIST_WORKER)
    os.makedirs(os.environ["SAMPLE_PL_CACHE"], exist_ok=True)


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory):
    """(config json path, checkpoint path) of a tiny random CLIP."""
    from engine.clip.toy import write_tiny_clip

    return write_tiny_clip(str(tmp_path_factory.mktemp("clip")))


@pytest.fixture(scope="session")
def tiny_clip_opts(tiny_clip):
    from engine.clip.toy import TINY_OPTS

    cfg_path, ckpt = tiny_clip
    return [
        "MODEL.BACKBONE.NAME",
        "",
        "MODEL.BACKBONE.CONFIG",
        cfg_path,
        "MODEL.BACKBONE.PATH",
        ckpt,
        *TINY_OPTS,
    ]


@pytest.fixture(scope="session")
def deep_opts(tmp_path_factory):
    """Options selecting a tiny CLIP with 4 text and 4 vision blocks (deep-prompt trainers)."""
    from helpers import write_deep_clip

    return write_deep_clip(str(tmp_path_factory.mktemp("deep_clip")))


@pytest.fixture
def dtd_root(tmp_path):
    """A fresh DTD-layout dataset (7 classes x 10 images, no split file)."""
    from datasets.synthetic import make_dtd

    root = tmp_path / "data"
    make_dtd(str(root))
    return str(root)


@pytest.fixture(scope="session")
def dtd_root_shared(tmp_path_factory):
    from datasets.synthetic import make_dtd

    root = tmp_path_factory.mktemp("shared_data")
    make_dtd(str(root), per_class=12)
    return str(root)


def run_train(args: list[str], check: bool = True, timeout: int = 300):
    """Run train.py in a subprocess; returns the CompletedProcess."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=os.environ["OMP_NUM_THREADS"])
    proc = subprocess.run(
        [sys.executable, osp.join(ROOT, "train.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"train.py failed ({proc.returncode})\nSTDOUT:\n{proc.stdout[-4000:]}\n"
            f"STDERR:\n{proc.stderr[-4000:]}"
        )
    return proc


def make_cfg(opts=(), trainer="CoOp", dataset_cfg="configs/datasets/dtd.yaml", config_file=None):
    """A merged config like train.py builds it."""
    from engine.cli import build_parser, setup_cfg

    args = ["--trainer", trainer, "--dataset-config-file", osp.join(ROOT, dataset_cfg)]
    if config_file:
        args += ["--config-file", osp.join(ROOT, config_file)]
    return setup_cfg(build_parser().parse_args(args + list(opts)))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line at the end: what was not run, grouped by test file and reason (e.g. the SLURM
    tests without a local cluster, the browser check without Chromium), and the tests that
    ``-m`` left out."""
    groups: dict[tuple[str, str], int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ").split("\n")[0]
        key = (report.nodeid.split("::")[0], reason)
        groups[key] = groups.get(key, 0) + 1
    parts = [f"{path} x{n}: {reason}" for (path, reason), n in sorted(groups.items())]
    deselected = len(terminalreporter.stats.get("deselected", []))
    if deselected:
        how = [f"{flag} {value!r}" for flag, value in (
            ("-m", config.getoption("markexpr")), ("-k", config.getoption("keyword"))
        ) if value]  # fmt: skip
        parts.append(f"{deselected} deselected by {' '.join(how) or 'the command line'}")
    if parts:
        terminalreporter.write_line("Not run: " + "; ".join(parts))


def pytest_configure(config):
    """A parallel run (``-n 2 --dist loadfile``, the README's command) sends each test file to one
    worker as a whole: the file's module-scoped fixtures (a trained run, a grid) are built once,
    its tests run in file order (the page order of tests/test_docs.py's blocks) and the files that
    share a service (tests/test_slurm_cluster.py's one cluster) keep it to themselves. The files
    go out in the order the workers collected them (see below), not by their number of tests."""
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """On a worker of a parallel run, the files with the most slow tests (end-to-end runs) come
    first, so that the two workers end together on short tests instead of one waiting for the
    other's last file of subprocess runs. A stable sort: each file's tests keep their order."""
    if XDIST_WORKER:
        slow = collections.Counter(str(it.path) for it in items if it.get_closest_marker("slow"))
        items.sort(key=lambda item: -slow[str(item.path)])
