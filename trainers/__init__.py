"""Prompt-learning trainers, registered in engine.registry.TRAINER_REGISTRY on import."""

from . import cocoop, coop, coprompt, ivlp, kgcoop, maple, promptsrc, tcp, zsclip  # noqa: F401
