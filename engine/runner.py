"""Several train.py runs in one process: the loop of a long-lived worker that
``tools/grid.py --in-process`` feeds with runs (started and driven by ``tools/worker.py``), and
the exit path of a process that ran them.

A run costs seconds of fixed work before its first step and after its last one: importing
torch, torchvision and open_clip, reading the CLIP checkpoint, starting loader workers, and
tearing the interpreter down. A worker pays the imports once and keeps the last CLIP checkpoint
read in memory (:func:`engine.clip.model.cache_weights`), the CLIP tower built from it (each run
gets its own copy, the RNG advanced as a build would; :mod:`engine.clip.tower_cache`) and the
parsed config files (:func:`enable_run_caches`); each run still builds its own model from the
seeded RNG, takes its run folder's lock, writes its own ``log.txt``, ``config.yaml``,
scalars and checkpoints, so its folder and numbers are those of a ``train.py`` process with the
same arguments (``tests/test_packed_runs.py``). Between runs the worker closes the run's log
handlers, stops the run's loader workers and frees the CUDA graphs recorded for the run's
parameters (engine.compile.release_cuda_graphs; the compiled code is kept for the next run).

Protocol (one JSON object per line): the parent writes ``{"argv": [...], "console": path}`` to
the worker's stdin; the worker runs ``train.py argv`` with its stdout and stderr appended to
``console`` (or inherited when ``console`` is null) and answers ``{"rc": code}`` on the file
descriptor it was given (``python -m tools.worker --reply-fd N``). A worker that dies (killed,
out of memory) leaves its run folder partial; the next grid invocation resumes it like any
interrupted run.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
import traceback

# what a crashed run answers (a train.py process that raised would exit with 1)
CRASHED = 1


def close_run_logging() -> None:
    """Detach and close the log handlers of the run that just ended (engine.utils.setup_logger
    marks them), so nothing else is written to its ``log.txt``."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_engine_handler", False):
            root.removeHandler(handler)
            handler.close()


def run_in_process(argv: list[str]) -> int:
    """Run ``train.py argv`` in this process; returns train.py's exit status.

    User errors and divergence return 2 and 3 as in ``train.py``; an unexpected exception is
    printed with its traceback and returns 1 (the next run starts clean: log handlers closed,
    loader workers stopped).
    """
    from engine.cli import run
    from engine.compile import release_cuda_graphs
    from engine.data.manager import shutdown_loaders

    try:
        return int(run(argv) or 0)
    except SystemExit as e:  # argparse errors
        return e.code if isinstance(e.code, int) else CRASHED
    except Exception:
        traceback.print_exc()
        return CRASHED
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        close_run_logging()
        # the loaders' workers first, each with its stop message: a loader that the collection
        # below finalises (in a reference cycle, its queues finalised in any order) can miss its
        # workers' stop and wait 5 s for each one (DataLoader's join timeout)
        shutdown_loaders()
        gc.collect()  # the run's trainer, model and loaders (reference cycles included)
        release_cuda_graphs()  # recorded for the run's parameters; the compiled code stays


@contextlib.contextmanager
def output_to(path: str | None):
    """Send this process's stdout and stderr (file descriptors 1 and 2, so C-level output too)
    to ``path``, appending; ``None``: leave them."""
    if not path:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def finish_process(code: int = 0) -> int:
    """Prepare a process that ran its runs to exit fast; returns ``code``.

    Flushes the logs and stops loader workers, then freezes the garbage collector: the
    interpreter's final collection walks every object that torch, torchvision and open_clip
    created (measured 1-2 s of a tiny CPU run's exit, 0.3 s with the collection skipped; see
    docs/benchmarks/). Nothing is lost: open files are flushed and closed by their owners and
    by ``logging.shutdown`` at exit as before.
    """
    from engine.data.manager import shutdown_loaders

    sys.stdout.flush()
    sys.stderr.flush()
    shutdown_loaders()
    gc.collect()
    gc.freeze()
    return code


UNFREEZE_EVERY = 32  # runs of a worker between collections that see the frozen objects too


def enable_run_caches(enabled: bool = True) -> None:
    """Keep for the next runs of this process what a run reads or builds the same way every
    time: the last CLIP checkpoint read (:func:`engine.clip.model.cache_weights`), the CLIP
    towers built from checkpoints, copied for each run (:mod:`engine.clip.tower_cache`), and
    the parsed YAML config files (:mod:`engine.yaml_files`) and the verdicts of the image checks
    on unchanged files (:func:`engine.data.image_check.cache_verdicts`). ``False`` drops them."""
    from engine.clip.model import cache_weights
    from engine.clip.tower_cache import cache_towers
    from engine.data.image_check import cache_verdicts
    from engine.yaml_files import cache_yaml

    cache_weights(enabled)
    cache_towers(enabled)
    cache_yaml(enabled)
    cache_verdicts(enabled)


def serve(reply_fd: int) -> int:
    """The worker loop: one run per request line on stdin, one answer line on ``reply_fd``.

    The trainers and datasets must be registered first (``tools/worker.py`` does it, as
    ``train.py`` does); what :func:`enable_run_caches` keeps serves the following runs.
    """
    enable_run_caches()
    runs = 0
    with os.fdopen(reply_fd, "w", buffering=1) as replies:
        for line in sys.stdin:
            if not line.strip():
                continue
            request = json.loads(line)
            with output_to(request.get("console")):
                rc = run_packed(list(request["argv"]), runs)
            runs += 1
            replies.write(json.dumps({"rc": rc}) + "\n")
    return 0


def run_packed(argv: list[str], done: int) -> int:
    """Run ``train.py argv`` as the next run of a packed worker that has run ``done`` runs.

    What survives the run's teardown (imports, the caches kept for the next runs) is then moved
    out of the garbage collector's sight (``gc.freeze``), so the next teardown's full collection
    scans that run's objects only (1.6 s -> 0.002 s measured on the shared CPU with 370,000
    objects alive); reference counting still frees frozen objects, and every
    :data:`UNFREEZE_EVERY` runs a teardown's collection sees them all again.
    """
    from engine.data import worker_pool

    if done % UNFREEZE_EVERY == 0:
        gc.unfreeze()
    worker_pool.activate()  # the run's loaders use worker processes kept for the next runs
    try:
        rc = run_in_process(argv)
    finally:
        worker_pool.deactivate()
    gc.freeze()
    return rc
