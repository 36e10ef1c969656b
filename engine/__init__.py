"""The Dassl-style engine of this project: config, registries, data, trainer bases, CLIP.

Like Dassl, the package exposes ``get_cfg_default()``, ``build_dataset(cfg)`` and
``build_trainer(cfg)`` at its top level::

    from engine import get_cfg_default, build_dataset, build_trainer
"""

from .config import ConfigError, get_base_cfg_default, get_cfg_default
from .data import DatasetBase, Datum, build_dataset
from .registry import DATASET_REGISTRY, EVALUATOR_REGISTRY, TRAINER_REGISTRY, Registry
from .trainer import SimpleTrainer, TrainerBase, TrainerX


def build_trainer(cfg, classnames: list[str] | None = None):
    """Build the trainer named ``cfg.TRAINER.NAME`` (Dassl's ``build_trainer``).

    With ``classnames`` the model is built for those classes without reading any dataset
    (no data loaders), e.g. to inspect or evaluate a model in a notebook. Trainers register
    when their package is imported (``import trainers``): the engine never imports them.
    """
    import logging

    if not cfg.TRAINER.NAME:
        raise ConfigError("TRAINER.NAME is empty: pass --trainer <name>")
    cls = TRAINER_REGISTRY.get(cfg.TRAINER.NAME)
    logging.getLogger(__name__).info("Loading trainer: %s", cfg.TRAINER.NAME)
    if classnames is None:
        return cls(cfg)
    return cls(cfg, classnames=classnames)


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
