"""Dassl's ``dassl.engine``: ``TRAINER_REGISTRY``, ``TrainerX`` (a Dassl trainer file's base
class, on this project's engine), ``TrainerBase``, ``SimpleTrainer`` and ``build_trainer``."""

from engine import build_trainer

from .trainer import TRAINER_REGISTRY, ReplayError, SimpleTrainer, TrainerBase, TrainerX

__all__ = [
    "TRAINER_REGISTRY",
    "ReplayError",
    "SimpleTrainer",
    "TrainerBase",
    "TrainerX",
    "build_trainer",
]
