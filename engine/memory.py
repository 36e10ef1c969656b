"""Peak tensor memory of a piece of work, on a GPU and on the CPU (tools/benchmark.py --memory,
tests/test_text_memory.py).

- CUDA: ``torch.cuda.max_memory_allocated`` during the work, minus what was allocated before it
  (the caching allocator's own count of live tensor bytes).
- CPU: :class:`TensorMemory`, an accounting of tensor storages. A ``TorchDispatchMode`` sees
  every tensor that an operator returns inside the block (forward, backward and the recomputed
  forward of an activation checkpoint alike); each new storage adds its ``nbytes`` to the live
  total and a finaliser subtracts them when the storage is freed (torch keeps one Python object
  per storage while anything, the autograd graph included, holds it). The peak of that total
  is the CPU counterpart of CUDA's measure: the largest sum of tensor bytes alive at once,
  above what existed before the block. Not counted: tensors created before the block (weights,
  optimizer state), and scratch memory that kernels (oneDNN, BLAS) allocate outside tensors.
  It slows small operators down (a Python call per operator): a measure, not a timer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorMemory(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created inside ``with TensorMemory() as m``.

    Attributes:
        live: bytes of the storages created in the block that are still alive.
        peak: the largest ``live`` seen.
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # storage id -> bytes, while alive

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata  # the C++ storage: views and in-place results share it
        if key in self._sizes:
            return
        n = storage.nbytes()
        self._sizes[key] = n
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_sparse:
                self._track(t.untyped_storage())
        return out


def peak_bytes(fn: Callable[[], object], device: str) -> int:
    """Peak tensor bytes allocated while ``fn()`` runs, above what was allocated before it:
    ``torch.cuda.max_memory_allocated`` on ``cuda``, :class:`TensorMemory` on ``cpu``."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    with TensorMemory() as m:
        fn()
    return m.peak
