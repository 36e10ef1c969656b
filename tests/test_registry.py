"""Registries: duplicates raise, unknown names suggest, expected names are registered."""

from __future__ import annotations

import pytest

from engine.registry import DATASET_REGISTRY, TRAINER_REGISTRY, Registry, RegistryError


def test_duplicate_and_unknown():
    reg = Registry("widget")

    @reg.register()
    class Foo:
        pass

    with pytest.raises(RegistryError, match="already registered"):
        reg.register(Foo)
    reg.register(Foo, force=True)
    with pytest.raises(RegistryError, match=r"Unknown widget 'Fooo'.*do you mean \[Foo\]"):
        reg.get("Fooo")
    with pytest.raises(RegistryError, match="Available widgets: Foo"):
        reg.get("zzz")


def test_expected_names_registered():
    import datasets  # noqa: F401
    import trainers  # noqa: F401

    for name in ("CoOp", "ZeroshotCLIP", "ZeroshotCLIP2"):
        assert name in TRAINER_REGISTRY
    assert "DescribableTextures" in DATASET_REGISTRY
    with pytest.raises(RegistryError, match=r"do you mean \[CoOp\]"):
        TRAINER_REGISTRY.get("coop")


def test_engine_top_level_api(dtd_root):
    """Like Dassl: get_cfg_default, build_dataset and build_trainer at the package's top level."""
    from engine import build_dataset, build_trainer, get_cfg_default

    cfg = get_cfg_default()
    cfg.DATASET.NAME = "DescribableTextures"
    cfg.DATASET.ROOT = dtd_root
    ds = build_dataset(cfg)
    assert ds.num_classes == 7 and len(ds.classnames) == 7 and ds.train_x and ds.test
    assert ds.lab2cname[0] == ds.classnames[0]
    assert callable(build_trainer)


@pytest.mark.slow
def test_train_py_help():
    import subprocess
    import sys

    from conftest import ROOT

    out = subprocess.run(
        [sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0
    for flag in (
        "--root",
        "--seed",
        "--eval-only",
        "--model-dir",
        "--load-epoch",
        "--no-train",
        "--dataset-config-file",
        "--config-file",
        "--optim-config-file",
        "--backbone",
    ):
        assert flag in out.stdout
