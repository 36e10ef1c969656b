"""Dassl's ``dassl.utils.registry``."""

from engine.registry import Registry

__all__ = ["Registry"]
