"""Deterministic kill points, for the tests of killed runs and grids.

``SAMPLE_PL_KILL_AT=POINT[@N]`` makes the process that reaches ``POINT`` for the ``N``-th time
(default: the first) kill its whole process group with SIGKILL, as a node failure, an
out-of-memory kill or ``kill -9`` of a grid and its ``train.py`` would. Unset (always, outside
tests), :func:`fault_point` is one dictionary lookup. The points:

- ``write:<file name>``: an atomic write of ``<file name>`` (a checkpoint such as
  ``model-last.pth.tar`` or ``model.pth.tar-2``, ``scalars.jsonl``, ...) has its temporary file
  complete and not yet renamed into place (engine/utils.py);
- ``scalars``: rows were appended to ``scalars.jsonl`` (engine/writers.py);
- ``evaluate``: an evaluation has computed its logits and not yet logged its result
  (engine/evaluation.py).

Counts are per process (an in-process grid worker counts across its runs).
"""

from __future__ import annotations

import os
import signal
import sys

KILL_AT_ENV = "SAMPLE_PL_KILL_AT"
_reached: dict[str, int] = {}


def parse_kill_at(spec: str) -> tuple[str, int]:
    """``"POINT@N"`` -> ``(POINT, N)``; ``"POINT"`` -> ``(POINT, 1)``."""
    point, sep, nth = spec.strip().rpartition("@")
    if not sep:
        return spec.strip(), 1
    if not nth.isdigit() or int(nth) < 1:
        raise ValueError(f"{KILL_AT_ENV}={spec!r}: write POINT or POINT@N with N >= 1")
    return point, int(nth)


def fault_point(point: str) -> None:
    """Kill this process group with SIGKILL if ``$SAMPLE_PL_KILL_AT`` names this occurrence of
    ``point``; otherwise nothing."""
    spec = os.environ.get(KILL_AT_ENV)
    if not spec:
        return
    wanted, nth = parse_kill_at(spec)
    if wanted != point:
        return
    _reached[point] = _reached.get(point, 0) + 1
    if _reached[point] == nth:
        sys.stdout.flush()
        sys.stderr.flush()
        os.killpg(os.getpgrp(), signal.SIGKILL)
