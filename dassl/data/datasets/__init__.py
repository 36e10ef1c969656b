"""Dassl's ``dassl.data.datasets``: the dataset registry and data model (a CoOp-family dataset
reader registers with ``@DATASET_REGISTRY.register()`` as in Dassl)."""

from engine.data import DatasetBase, Datum, build_dataset
from engine.registry import DATASET_REGISTRY

__all__ = ["DATASET_REGISTRY", "DatasetBase", "Datum", "build_dataset"]
