"""Dassl's ``dassl.data``: the engine's ``DataManager``."""

from engine.data import DataManager, DatasetWrapper

__all__ = ["DataManager", "DatasetWrapper"]
