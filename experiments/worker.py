"""A long-lived process that runs train.py runs in-process, and its handle in the parent.

``tools/grid.py --in-process`` (and ``tools/benchmark.py --runs``) start one :class:`Worker` per
worker slot and send it the runs of their chains one after another. The worker
(``python -m tools.worker --reply-fd N``) registers the trainers and datasets as ``train.py``
does, then serves runs with :func:`engine.runner.serve` (the protocol is described there). A
worker that dies (killed, out of memory) fails its current run, leaving its folder partial for
the next grid invocation to resume; the next run starts a new worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CRASHED = 1  # what a run answers when its worker died without an exit status


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
        env = dict(self.env if self.env is not None else os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
        cmd = [self.python, "-m", "tools.worker", "--reply-fd", str(write_fd)]
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
