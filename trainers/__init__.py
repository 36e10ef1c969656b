"""Prompt-learning trainers, registered in engine.registry.TRAINER_REGISTRY on import."""

from . import (  # noqa: F401
    cocoop,
    coop,
    coprompt,
    dept,
    ivlp,
    kgcoop,
    maple,
    mmrl,
    prograd,
    promptsrc,
    sample_aliases,
    skiptuning,
    tcp,
    zsclip,
)
