"""Several train.py runs in one process: a long-lived worker that ``tools/grid.py --in-process``
feeds with runs, and the exit path of a process that ran them.

A run costs seconds of fixed work before its first step and after its last one: importing
torch, torchvision and open_clip, reading the CLIP checkpoint, starting loader workers, and
tearing the interpreter down. A worker pays the imports once and keeps the last CLIP checkpoint
read in memory (:func:`engine.clip.model.cache_weights`); each run still builds its own model
from the seeded RNG, takes its run folder's lock, writes its own ``log.txt``, ``config.yaml``,
scalars and checkpoints, so its folder and numbers are those of a ``train.py`` process with the
same arguments (``tests/test_packed_runs.py``). Between runs the worker closes the run's log
handlers and stops the run's loader workers.

Protocol (one JSON object per line): the parent writes ``{"argv": [...], "console": path}`` to
the worker's stdin; the worker runs ``train.py argv`` with its stdout and stderr appended to
``console`` (or inherited when ``console`` is null) and answers ``{"rc": code}`` on the file
descriptor given by ``--reply-fd``. A worker that dies (killed, out of memory) leaves its run
folder partial; the next grid invocation resumes it like any interrupted run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import subprocess
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
        gc.collect()  # the run's trainer, model and loaders (reference cycles included)
        shutdown_loaders()


def prepare_worker() -> None:
    """Import what train.py imports (registries) and keep CLIP checkpoints in memory."""
    import datasets  # noqa: F401  (registers the dataset readers)
    import trainers  # noqa: F401  (registers the trainers)
    from engine.clip.model import cache_weights

    cache_weights(True)


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


def serve(reply_fd: int) -> int:
    """The worker loop: one run per request line on stdin, one answer line on ``reply_fd``."""
    prepare_worker()
    with os.fdopen(reply_fd, "w", buffering=1) as replies:
        for line in sys.stdin:
            if not line.strip():
                continue
            request = json.loads(line)
            with output_to(request.get("console")):
                rc = run_in_process(list(request["argv"]))
            replies.write(json.dumps({"rc": rc}) + "\n")
    return finish_process(0)


class Worker:
    """A worker process seen from the parent: :meth:`run` sends one run and waits for it.

    Args:
        env: the worker's environment (e.g. ``CUDA_VISIBLE_DEVICES``); None: this one's.
        python: the interpreter.
    """

    def __init__(self, env: dict | None = None, python: str = sys.executable):
        self.env = env
        self.python = python
        self.proc: subprocess.Popen | None = None
        self._replies = None

    def start(self) -> None:
        read_fd, write_fd = os.pipe()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(self.env if self.env is not None else os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        cmd = [self.python, "-m", "engine.runner", "--reply-fd", str(write_fd)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, text=True, env=env, cwd=os.getcwd(), pass_fds=(write_fd,)
        )
        os.close(write_fd)
        self._replies = os.fdopen(read_fd)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def run(self, argv: list[str], console: str | None = None) -> int:
        """Run ``train.py argv`` in the worker (started on first use, restarted after a death);
        returns its exit status, or the worker's (negative: killed by a signal) if it died."""
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self.start()
        request = json.dumps({"argv": list(argv), "console": console}) + "\n"
        try:
            self.proc.stdin.write(request)
            self.proc.stdin.flush()
            line = self._replies.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:  # the worker died during the run
            code = self.proc.wait()
            self.close()
            return code if code else CRASHED
        return int(json.loads(line)["rc"])

    def close(self) -> None:
        """Stop the worker (it finishes after its current run) and wait for it."""
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            self.proc.wait()
            self.proc = None
        if self._replies is not None:
            self._replies.close()
            self._replies = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A worker that runs train.py runs in-process.")
    parser.add_argument("--reply-fd", type=int, required=True, help="where answers go")
    args = parser.parse_args(argv)
    return serve(args.reply_fd)


if __name__ == "__main__":
    sys.exit(main())
