"""Dassl's ``dassl.evaluation``: the evaluator registry and ``build_evaluator``."""

from engine.evaluator import build_evaluator
from engine.registry import EVALUATOR_REGISTRY

__all__ = ["EVALUATOR_REGISTRY", "build_evaluator"]
