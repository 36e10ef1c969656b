"""What a run costs: training time, steps, step time and peak memory (``cost.json``).

Every training run keeps ``<OUTPUT_DIR>/cost.json`` up to date (written atomically after each
epoch, so an interrupted run leaves what it spent), next to its results, so a table can show
what each point of accuracy costs::

    {"optimizer": "sample", "base_optimizer": "sgd", "device": "cpu", "precision": "fp32",
     "steps": 1200, "train_time_s": 95.1, "mean_step_s": 0.079, "peak_cpu_rss_mb": 812.4,
     "peak_cuda_mb": null, "segments": [{...}]}

- ``train_time_s``: wall time of the training epochs (the batch loops; the final test,
  evaluation-only work and start-up are not counted), summed over the run's segments;
- ``steps``: training steps (batches) taken; ``mean_step_s = train_time_s / steps`` (data
  loading included; on a GPU the time is taken after a synchronisation at the end of each epoch);
- ``peak_cpu_rss_mb``: the process's maximum resident set size (``getrusage``), the largest
  over the segments; ``peak_cuda_mb``: ``torch.cuda.max_memory_allocated`` (None on CPU);
- ``segments``: one entry per process that trained (a resumed run adds one: first and last
  epoch, steps, time, peaks), so the totals are those of the whole run;
- ``startup`` (in each segment, and the last one's at the top): the time from the process's start
  to the end of its first training step and its phases (:mod:`engine.phases`);
- ``wall_s`` (in each segment, and the last one's at the top): the process's time from its start
  (a packed worker's run: from the run's start) to the end of the run's final test; with
  ``startup`` and ``train_time_s`` it gives a run's fixed cost (``experiments/grid_estimate.py``);
- ``host`` (in each segment, and the last one's at the top): the machine that ran it.
"""

from __future__ import annotations

import json
import os.path as osp
import resource
import socket
import sys
import time

import torch

from .utils import atomic_write_text

COST_NAME = "cost.json"


def peak_rss_mb() -> float:
    """The process's maximum resident set size in MiB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def read_cost(output_dir: str) -> dict | None:
    """The ``cost.json`` of a run folder, or None when there is none (or it is unreadable)."""
    path = osp.join(output_dir, COST_NAME)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class RunCost:
    """Accumulates the training time of one process and keeps ``cost.json`` up to date.

    Args:
        device: the training device (its CUDA peak is read when it is a GPU).
        output_dir: the run folder.
        meta: what the run is (optimizer, trainer, precision, ...), written as is.
        resumed: the process resumed a run: the segments of ``cost.json`` are kept.
    """

    def __init__(self, device: torch.device, output_dir: str, meta: dict, resumed: bool):
        self.device = torch.device(device)
        self.output_dir = output_dir
        self.meta = dict(meta)
        old = read_cost(output_dir) if resumed else None
        self.earlier = list(old.get("segments", [])) if old else []
        self.steps = 0
        self.seconds = 0.0
        self.first_epoch: int | None = None
        self.last_epoch: int | None = None
        self.startup: dict | None = None  # engine.phases.first_step_done
        self.wall_s: float | None = None  # engine.phases.run_ended
        self._t0: float | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start_epoch(self, epoch: int) -> None:
        """Called when an epoch's batch loop starts."""
        self._sync()
        self._t0 = time.perf_counter()
        if self.first_epoch is None:
            self.first_epoch = epoch

    def end_epoch(self, epoch: int, steps: int) -> dict:
        """Called when the batch loop of ``epoch`` ended after ``steps`` steps; writes
        ``cost.json`` and returns it."""
        if self._t0 is not None:
            self._sync()
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None
            self.steps += steps
            self.last_epoch = epoch
        return self.write()

    def segment(self) -> dict:
        """This process's entry."""
        cuda = None
        if self.device.type == "cuda":
            cuda = torch.cuda.max_memory_allocated(self.device) / 2**20
        return {
            "epochs": [self.first_epoch, self.last_epoch],
            "steps": self.steps,
            "train_time_s": self.seconds,
            "peak_cpu_rss_mb": peak_rss_mb(),
            "peak_cuda_mb": cuda,
            "startup": self.startup,
            "wall_s": self.wall_s,
            "host": socket.gethostname(),
        }

    def summary(self) -> dict:
        """The whole run: the earlier segments and this one, with totals."""
        segments = [*self.earlier, self.segment()]
        steps = sum(s["steps"] for s in segments)
        seconds = sum(s["train_time_s"] for s in segments)
        cuda = [s["peak_cuda_mb"] for s in segments if s["peak_cuda_mb"] is not None]
        return {
            **self.meta,
            "steps": steps,
            "train_time_s": seconds,
            "mean_step_s": seconds / steps if steps else None,
            "peak_cpu_rss_mb": max(s["peak_cpu_rss_mb"] for s in segments),
            "peak_cuda_mb": max(cuda) if cuda else None,
            "startup": segments[-1].get("startup"),
            "wall_s": segments[-1].get("wall_s"),
            "host": segments[-1].get("host"),
            "segments": segments,
        }

    def write(self) -> dict:
        """Write ``cost.json`` atomically; returns what was written."""
        cost = self.summary()
        atomic_write_text(osp.join(self.output_dir, COST_NAME), json.dumps(cost, indent=1) + "\n")
        return cost
