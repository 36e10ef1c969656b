"""Dassl's ``dassl.metrics``: ``compute_accuracy(output, target, topk=(1,))`` (percent, 0-d
tensors: ``compute_accuracy(...)[0].item()`` works as with Dassl)."""

from engine.utils import compute_accuracy

__all__ = ["compute_accuracy"]
