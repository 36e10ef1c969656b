"""Prompt-learning trainers, registered in engine.registry.TRAINER_REGISTRY on import."""

from . import coop, zsclip  # noqa: F401
