"""Prompt-learning trainers, registered in engine.registry.TRAINER_REGISTRY on import."""

from . import cocoop, coop, coprompt, maple, tcp, zsclip  # noqa: F401
