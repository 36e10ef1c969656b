"""The engine's registries (trainers, datasets, evaluators); the class is ``optim.registry``'s.

Packages above the engine fill them on import (``import trainers``, ``import datasets``): the
engine itself never imports a trainer or dataset module.
"""

from optim.registry import Registry, RegistryError

TRAINER_REGISTRY = Registry("trainer")
DATASET_REGISTRY = Registry("dataset")
EVALUATOR_REGISTRY = Registry("evaluator")

__all__ = [
    "DATASET_REGISTRY",
    "EVALUATOR_REGISTRY",
    "TRAINER_REGISTRY",
    "Registry",
    "RegistryError",
]
