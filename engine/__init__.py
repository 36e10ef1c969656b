"""The Dassl-style engine of this project: config, registries, data, trainers, CLIP.

Like Dassl, the package exposes ``get_cfg_default()``, ``build_dataset(cfg)`` and
``build_trainer(cfg)`` at its top level::

    from engine import get_cfg_default, build_dataset, build_trainer
"""

from .config import ConfigError, get_base_cfg_default, get_cfg_default
from .data import DatasetBase, Datum, build_dataset
from .registry import DATASET_REGISTRY, EVALUATOR_REGISTRY, TRAINER_REGISTRY, Registry
from .trainer import SimpleTrainer, TrainerBase, TrainerX


def build_trainer(cfg):
    """Build the trainer named ``cfg.TRAINER.NAME`` (Dassl's ``build_trainer``)."""
    import logging

    if not cfg.TRAINER.NAME:
        raise ValueError("TRAINER.NAME is empty: pass --trainer <name>")
    cls = TRAINER_REGISTRY.get(cfg.TRAINER.NAME)
    logging.getLogger(__name__).info("Loading trainer: %s", cfg.TRAINER.NAME)
    return cls(cfg)


__all__ = [
    "DATASET_REGISTRY",
    "EVALUATOR_REGISTRY",
    "TRAINER_REGISTRY",
    "ConfigError",
    "DatasetBase",
    "Datum",
    "Registry",
    "SimpleTrainer",
    "TrainerBase",
    "TrainerX",
    "build_dataset",
    "build_trainer",
    "get_base_cfg_default",
    "get_cfg_default",
]
