"""Scalar writers: tensorboard (optional) and ``scalars.jsonl``, with one host sync per flush.

Scalars (numbers or 0-d tensors still on the GPU) are queued by :meth:`ScalarWriter.add` and
written at :meth:`ScalarWriter.flush`, which moves every queued tensor to the host in one
transfer; the training loop flushes at its print frequency, so a step makes no host sync.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import os.path as osp
import threading
from collections.abc import Callable

import torch

from .faults import fault_point
from .utils import OUTPUT_ERRNOS, atomic_write_text, mkdir_if_missing, output_error

logger = logging.getLogger(__name__)


class ScalarWriter:
    """Queues ``{tag: value}`` rows per global step and writes them on :meth:`flush`."""

    def __init__(self):
        self._tb = None
        self._tb_dir = ""  # where tensorboard's writer goes once there is something to write
        self._file = None
        self._pending: list[tuple[int, dict]] = []
        self._path = ""

    def _tensorboard(self):
        """tensorboard's SummaryWriter, imported and started at the first flush with scalars
        (its import and its writer thread cost nothing in runs that write none)."""
        if self._tb is None and self._tb_dir:
            tb_dir, self._tb_dir = self._tb_dir, ""
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                logger.info("tensorboard is not installed: scalars go to scalars.jsonl only")
            else:
                _quiet_writer_thread_errors()
                self._tb = SummaryWriter(log_dir=tb_dir)
        return self._tb

    def open(
        self, output_dir: str, tensorboard_dir: str, keep: Callable[[dict], bool] | None = None
    ) -> None:
        """Open ``<output_dir>/scalars.jsonl`` (appending); a tensorboard writer (if installed)
        starts at the first flush.

        Args:
            keep: for a training run that starts or resumes in a folder, which existing rows to
                keep (``row -> bool``; a row is ``{"step": ..., tag: value, ...}``); the others
                (the steps the run is about to write again) are dropped by rewriting the file
                atomically, so each step is written once. The tensorboard events already in
                ``tensorboard_dir`` are rewritten to the kept rows too (tensorboard has no way
                to drop events of a tag but a new file).
        """
        from .distributed import is_main_process

        if not is_main_process():  # data-parallel (#29): rank 0 writes the scalars
            return
        path = osp.join(output_dir, "scalars.jsonl")
        kept = None
        if keep is not None and self._file is None:
            kept = self._drop_rows(path, keep) if osp.isfile(path) else []
        if self._tb is None:
            self._tb_dir = tensorboard_dir  # the writer starts with the first scalars written
            if kept is not None:
                self._rewrite_tensorboard(tensorboard_dir, kept)
        if self._file is None:
            try:
                mkdir_if_missing(output_dir)
                self._file = open(path, "a")  # noqa: SIM115
            except OSError as e:
                raise output_error(e, path) from e
            self._path = path

    @staticmethod
    def _drop_rows(path: str, keep: Callable[[dict], bool]) -> list[dict]:
        """Keep the rows of ``path`` that ``keep`` accepts (rewriting it if any goes); returns
        them."""
        with open(path) as f:
            lines = f.readlines()
        kept, rows = [], []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:  # a line cut by a kill while it was written
                continue
            if isinstance(row, dict) and keep(row):
                kept.append(line if line.endswith("\n") else line + "\n")
                rows.append(row)
        if len(kept) != len(lines):
            atomic_write_text(path, "".join(kept))
            logger.info(
                "scalars.jsonl: dropped %d rows of the resumed steps", len(lines) - len(kept)
            )
        return rows

    def _rewrite_tensorboard(self, tb_dir: str, rows: list[dict]) -> None:
        """Replace the event files in ``tb_dir`` by one holding ``rows`` (the rows of
        ``scalars.jsonl`` a resumed run keeps), so tensorboard shows each step once."""
        old = sorted(glob.glob(osp.join(tb_dir, "events.out.tfevents.*")))
        if not old:
            return
        tb = self._tensorboard()
        if tb is None:  # not installed: the old events stay as they are
            return
        for row in rows:
            for k, v in row.items():
                if k != "step":
                    tb.add_scalar(k, v, row.get("step", 0))
        tb.flush()  # a file of its own, named when the writer started: the old ones go
        for name in old:
            with contextlib.suppress(FileNotFoundError):
                os.remove(name)
        logger.info(
            "tensorboard: the events of %d earlier file(s) rewritten as the %d kept rows",
            len(old),
            len(rows),
        )

    def add(self, values: dict, global_step: int) -> None:
        """Queue scalars (numbers or 0-d tensors) for ``global_step``."""
        if values:
            self._pending.append((global_step, dict(values)))

    def flush(self) -> None:
        """Write the queued scalars (one host transfer for all tensors)."""
        if not self._pending:
            return
        tensors = [v for _, d in self._pending for v in d.values() if isinstance(v, torch.Tensor)]
        numbers = iter(
            torch.stack([t.detach().float().reshape(()).cpu() for t in tensors]).tolist()
            if tensors
            else []
        )
        tb = self._tensorboard()
        for step, d in self._pending:
            row = {
                k: (next(numbers) if isinstance(v, torch.Tensor) else float(v))
                for k, v in d.items()
            }
            if tb is not None:
                try:
                    for k, v in row.items():
                        tb.add_scalar(k, v, step)
                except OSError as e:  # its writer thread's error surfaces here
                    raise _tensorboard_error(e, tb) from e
            if self._file is not None:
                text = json.dumps({"step": step, **row}) + "\n"
                try:
                    self._file.write(text)
                except OSError as e:
                    raise output_error(e, self._path, len(text.encode())) from e
        self._pending.clear()
        if self._file is not None:
            try:
                self._file.flush()
            except OSError as e:
                raise output_error(e, self._path) from e
            fault_point("scalars")  # tests kill here (engine/faults.py)

    def close(self) -> None:
        """Flush and close both writers; a failed write (a full disk, a read-only folder) is
        raised as one :class:`~engine.utils.OutputWriteError` after both are closed."""
        errors = []
        try:
            self.flush()
        except OSError as e:
            self._pending.clear()  # not written; the error says where
            errors.append(e)
        self._tb_dir = ""
        if self._tb is not None:
            tb, self._tb = self._tb, None
            try:
                tb.close()  # writes the events still queued for its writer thread
            except OSError as e:
                errors.append(_tensorboard_error(e, tb))
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()  # writes what is still buffered
            except OSError as e:
                errors.append(output_error(e, self._path))
        if errors:
            raise errors[0]


def _quiet_writer_thread_errors() -> None:
    """Keep a failed write of tensorboard's writer thread (a full disk) from printing its own
    traceback: tensorboard raises the same error again in the training thread at its next
    write or at close, where :class:`ScalarWriter` reports it as one paragraph. Other threads'
    errors, and other errors, go to the previous ``threading.excepthook``."""
    if getattr(threading.excepthook, "_engine_writer_hook", False):
        return
    previous = threading.excepthook

    def hook(args):
        exc = args.exc_value
        writer_thread = type(args.thread).__name__ == "_AsyncWriterThread"
        if not (writer_thread and isinstance(exc, OSError) and exc.errno in OUTPUT_ERRNOS):
            previous(args)

    hook._engine_writer_hook = True
    threading.excepthook = hook


def _tensorboard_error(e: OSError, tb) -> OSError:
    """``e`` of tensorboard's writer as an OutputWriteError naming its event files' folder."""
    return output_error(e, osp.join(tb.get_logdir(), "events.out.tfevents.*"))
