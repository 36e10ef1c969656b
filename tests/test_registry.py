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
