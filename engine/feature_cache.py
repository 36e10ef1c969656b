"""Evaluation-image features of a frozen CLIP image encoder, cached on disk.

Zero-shot CLIP, CoOp, CoCoOp and TCP never change CLIP's image encoder, so the features of a
test set are the same for every run of a grid on that dataset (every trainer, optimizer and
seed). The engine stores the raw encoder outputs under a key made of

- a SHA-1 of the image encoder's weights (as loaded, so precision-converted weights differ),
- the precision mode and device type (autocast changes the numbers),
- the dataset name, split and a hash of its (image path, label) list,
- the test transform (its repr, which includes sizes, interpolation and normalisation),

so any change of these gives a new key and a stale cache is never reused. Files are written
atomically (``<dir>/<key>.pt``, ``{"features": [N, D], "labels": [N]}``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import os.path as osp

import torch
from torch import nn

from .utils import atomic_torch_save

logger = logging.getLogger(__name__)


def default_dir() -> str:
    """``$SAMPLE_PL_CACHE/eval_features`` (default ``~/.cache/sample-pl/eval_features``)."""
    return osp.join(os.environ.get("SAMPLE_PL_CACHE", "~/.cache/sample-pl"), "eval_features")


def module_fingerprint(module: nn.Module) -> str:
    """SHA-1 of a module's parameters and buffers (names, dtypes, shapes, bytes); memoised on
    the module, which must therefore stay frozen."""
    cached = getattr(module, "_weights_fingerprint", None)
    if cached is not None:
        return cached
    h = hashlib.sha1()
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        # reshape(-1): 0-d buffers (a ResNet's BatchNorm num_batches_tracked) cannot be viewed
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    fp = h.hexdigest()
    module._weights_fingerprint = fp
    return fp


def data_fingerprint(data_source) -> str:
    h = hashlib.sha1()
    for item in data_source:
        h.update(f"{item.impath}\t{item.label}\n".encode())
    return h.hexdigest()


def cache_key(**parts) -> str:
    return hashlib.sha1(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


class FeatureCache:
    """A folder of cached feature files."""

    def __init__(self, directory: str = ""):
        self.directory = osp.expanduser(directory or default_dir())

    def path(self, key: str) -> str:
        return osp.join(self.directory, f"{key}.pt")

    def load(self, key: str) -> dict | None:
        path = self.path(key)
        if not osp.isfile(path):
            return None
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a damaged file is recomputed
            logger.warning("Ignoring unreadable feature cache %s (%s)", path, e)
            return None

    def save(self, key: str, features: torch.Tensor, labels: torch.Tensor) -> None:
        atomic_torch_save({"features": features.cpu(), "labels": labels.cpu()}, self.path(key))


@torch.no_grad()
def compute_features(encoder, loader, device, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``encoder`` over ``loader`` (``[N, D]`` features, ``[N]`` labels)."""
    feats, labels = [], []
    for batch in loader:
        with autocast():
            feats.append(encoder(batch["img"].to(device)))
        labels.append(batch["label"])
    return torch.cat(feats), torch.cat(labels)
