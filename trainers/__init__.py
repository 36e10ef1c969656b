"""Prompt-learning trainers, registered in engine.registry.TRAINER_REGISTRY on import."""

from . import cocoop, coop, tcp, zsclip  # noqa: F401
