"""Dassl's ``dassl.utils.meters``."""

from engine.utils import AverageMeter, MetricMeter

__all__ = ["AverageMeter", "MetricMeter"]
