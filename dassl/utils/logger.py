"""Dassl's ``dassl.utils.logger``: ``setup_logger(output)`` (log.txt in the run folder)."""

from engine.utils import setup_logger

__all__ = ["setup_logger"]
