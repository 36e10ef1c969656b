"""Where a run's start-up goes: the time of each phase before its first training step.

Every training run logs one line (``log.txt``) and records in ``cost.json`` (its segment's
``startup``, :mod:`engine.cost`) how long it took from the start of its process to the end of its
first training step, split into phases that add up to that time::

    Start-up: 21.40 s to the end of the first step: imports 9.02 s, config 0.31 s, dataset 0.80 s,
    clip weights 3.10 s, model build 0.52 s, resume 0.00 s, caches 2.40 s, first batch 0.91 s,
    compilation 3.93 s, first step 0.41 s

- ``imports``: from the start of the process (the kernel's start time of the process on Linux,
  so the interpreter's own start counts) to the start of :func:`engine.cli.run`; zero for the
  second and later runs of a packed worker (``engine/runner.py``), which imports nothing again;
- ``config``: config merge, run folder checks, the log and ``config.yaml``;
- ``dataset``: the dataset index (reading split files, the few-shot draw) and the loaders;
- ``clip weights``: finding and reading the CLIP checkpoint (:func:`engine.clip.model.load_clip`;
  also the open_clip import when it happens there);
- ``model build``: the rest of the trainer's construction (prompt learner, text features, the
  optimizer step, the evaluator);
- ``resume``: the checks before training and reading a checkpoint when resuming;
- ``caches``: caches built before training: the decoded training images
  (``DATALOADER.CACHE_DECODED``). The frozen test features (``TEST.FEATURE_CACHE``) are computed
  at the first test, after training, so they are not part of the start-up;
- ``first batch``: epoch set-up, starting the loader's workers and delivering the first batch;
- ``compilation``: the first calls of the compiled encoders inside the first step (graph capture
  and code generation, or a load from the persistent cache; :mod:`engine.compile`);
- ``first step``: the rest of the first training step.

The phases are contiguous (each starts where the previous one ends), so their sum equals the
time to the end of the first step up to float rounding; a phase entered twice adds up. The
clock is one per process and is restarted by every run (:func:`begin_run`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

logger = logging.getLogger(__name__)

PHASES = (
    "imports",
    "config",
    "dataset",
    "clip weights",
    "model build",
    "resume",
    "caches",
    "first batch",
    "compilation",
    "first step",
)

_process_start: float | None = None  # perf_counter time of the process start, until consumed
_clock: StartupClock | None = None


def process_start() -> float:
    """The start of this process on the ``time.perf_counter`` clock: the kernel's record of
    when the process started (Linux, 10 ms resolution), else now."""
    now = time.perf_counter()
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of proc(5): start time in clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now
    return now - age if 0 <= age < 3600 else now


class StartupClock:
    """Contiguous phases from ``start`` to the end of the first training step."""

    def __init__(self, start: float, first: str = "imports"):
        self.start = start
        self.mark = start
        self.stack = [first]
        self.seconds: dict[str, float] = {}
        self.result: dict | None = None  # set when the first step ended

    def _charge(self) -> None:
        now = time.perf_counter()
        name = self.stack[-1]
        self.seconds[name] = self.seconds.get(name, 0.0) + (now - self.mark)
        self.mark = now

    def enter(self, name: str) -> None:
        """End the current phase; ``name`` runs from now."""
        if self.result is None:
            self._charge()
            self.stack[-1] = name

    @contextlib.contextmanager
    def phase(self, name: str):
        """``name`` inside the block; the enclosing phase goes on after it."""
        if self.result is not None:
            yield
            return
        self._charge()
        self.stack.append(name)
        try:
            yield
        finally:
            if self.result is None and len(self.stack) > 1:
                self._charge()
                self.stack.pop()

    def carve(self, name: str, seconds: float) -> None:
        """Move ``seconds`` just spent in the current phase to phase ``name`` (e.g. the
        compilation inside the first step), never more than the current phase holds."""
        if self.result is not None or seconds <= 0:
            return
        self._charge()
        current = self.stack[-1]
        moved = min(seconds, self.seconds.get(current, 0.0))
        self.seconds[current] -= moved
        self.seconds[name] = self.seconds.get(name, 0.0) + moved

    def finish(self) -> dict:
        """End the clock (the first step ended): ``{"time_to_first_step_s", "phases"}``."""
        if self.result is None:
            self._charge()
            end = self.mark
            known = [p for p in PHASES if p in self.seconds]
            other = [p for p in self.seconds if p not in PHASES]
            self.result = {
                "time_to_first_step_s": end - self.start,
                "phases": {p: self.seconds[p] for p in known + other},
            }
        return self.result


def mark_process_start(start: float | None = None) -> None:
    """Called first thing by ``train.py``: the process's start (default: :func:`process_start`)
    from which the first run's ``imports`` phase counts."""
    global _process_start
    _process_start = process_start() if start is None else start


def begin_run() -> StartupClock:
    """Start the clock of a run (:func:`engine.cli.run`): the first run of a process counts its
    imports from :func:`mark_process_start`; a later run (packed worker) starts now."""
    global _clock, _process_start
    from . import compile_cache

    compile_cache._current_key = None  # nothing recorded for an earlier run that did not end
    if _process_start is not None:
        _clock = StartupClock(_process_start)
        _process_start = None
        _clock.enter("config")
    else:
        _clock = StartupClock(time.perf_counter(), first="config")
    return _clock


def current() -> StartupClock | None:
    """The running clock (None outside a run)."""
    return _clock


def enter(name: str) -> None:
    """The current run's start-up is in phase ``name`` from now (a no-op outside a run and after
    its first step)."""
    if _clock is not None:
        _clock.enter(name)


def phase(name: str):
    """A block of the current run's start-up in phase ``name`` (see :meth:`StartupClock.phase`)."""
    return _clock.phase(name) if _clock is not None else contextlib.nullcontext()


def carve(name: str, seconds: float) -> None:
    """See :meth:`StartupClock.carve` (a no-op outside a run)."""
    if _clock is not None:
        _clock.carve(name, seconds)


def describe(result: dict) -> str:
    """The log line of a start-up breakdown."""
    parts = ", ".join(f"{name} {s:.2f} s" for name, s in result["phases"].items())
    return f"Start-up: {result['time_to_first_step_s']:.2f} s to the end of the first step: {parts}"


def first_step_done(cost=None, device=None) -> dict | None:
    """Called after every training step; after the first one of the run, ends the clock, logs
    the breakdown and hands it to ``cost`` (:class:`engine.cost.RunCost`, written to
    ``cost.json``). Returns the breakdown the first time, None afterwards."""
    if _clock is None or _clock.result is not None:
        return None
    if device is not None and getattr(device, "type", "") == "cuda":
        import torch

        torch.cuda.synchronize(device)
    result = _clock.finish()
    logger.info("%s", describe(result))
    if cost is not None:
        cost.startup = result
    return result


def run_ended(cost=None) -> float | None:
    """Called when a training run ends (after its final test): records in ``cost`` the run's
    wall time from the clock's start (the process start for a process's first run) and writes
    ``cost.json``; returns that time."""
    if cost is not None:  # MODEL.COMPILE auto's record of the step time (engine.compile_cache)
        from .compile_cache import run_ended as record_step

        record_step(cost.summary().get("mean_step_s"))
    if _clock is None:
        return None
    wall = time.perf_counter() - _clock.start
    if cost is not None:
        cost.wall_s = wall
        cost.write()
    return wall
