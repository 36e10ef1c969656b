"""Dassl's ``dassl.config``: ``get_cfg_default()``, the project's default config (Dassl's keys
and defaults plus this project's, with every registered trainer's ``TRAINER.<NODE>``)."""

from engine.config import get_cfg_default

__all__ = ["get_cfg_default"]
