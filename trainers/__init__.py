"""Prompt-learning trainers, registered in engine.registry.TRAINER_REGISTRY on import."""

from . import (  # noqa: F401
    cocoop,
    coop,
    coprompt,
    ivlp,
    kgcoop,
    maple,
    mmrl,
    promptsrc,
    sample_aliases,
    tcp,
    zsclip,
)
