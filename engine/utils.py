"""Small utilities shared by the engine: files, seeding, meters, logging, accuracy."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import logging
import os
import os.path as osp
import random
import shutil
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np
import torch

from .errors import OutputError
from .faults import fault_point

logger = logging.getLogger("engine")


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------
def mkdir_if_missing(dirname: str) -> None:
    if dirname:
        os.makedirs(dirname, exist_ok=True)


def check_isfile(fpath: str) -> bool:
    isfile = osp.isfile(fpath)
    if not isfile:
        logger.warning('No file found at "%s"', fpath)
    return isfile


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once: os.umask can only be read by setting it


# errors of a write that the user fixes (space, permissions, a file where a folder should be)
OUTPUT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR}
)
TMP_SUFFIX = ".tmp"  # atomic writes go to ".<name>.<random>.tmp" in the target folder


class OutputWriteError(OutputError, OSError):
    """A write that failed for want of space or permission, as one clear message.

    Still an :class:`OSError` with the original ``errno`` (callers that fall back to another
    folder on ``OSError``, e.g. the dataset caches, keep working).
    """

    def __str__(self) -> str:
        return str(self.strerror)


def output_error(e: OSError, path: str, nbytes: int | None = None) -> OSError:
    """``e`` as an :class:`OutputWriteError` naming the folder (and, for a full disk, the bytes
    needed); other OSErrors are returned unchanged."""
    if isinstance(e, OutputWriteError) or e.errno not in OUTPUT_ERRNOS:
        return e
    folder = osp.dirname(osp.abspath(path))
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"{shutil.disk_usage(folder).free:,} bytes free"
        except OSError:
            free = "free space unknown"
        needed = f"{nbytes:,} bytes needed" if nbytes is not None else "size unknown"
        msg = (
            f"Cannot write {path}: no space left on the device of {folder} ({needed}, {free}). "
            "Free some space (or the quota) or write to another folder (--output-dir); files "
            "written before are intact and a re-run resumes from the last checkpoint."
        )
    elif e.errno == errno.ENOTDIR:
        msg = (
            f"Cannot write {path}: a part of the folder {folder} is a file, not a folder. "
            "Choose another output folder (--output-dir)."
        )
    else:
        msg = (
            f"Cannot write {path}: the folder {folder} is not writable ({os.strerror(e.errno)}"
            "; e.g. a read-only file system or missing permission). Make it writable or write "
            "to another folder (--output-dir)."
        )
    return OutputWriteError(e.errno, msg, path)


def _atomic_write(path: str, data: bytes | str, mode: str) -> None:
    """Write ``data`` through a temporary file in the same folder, then rename over ``path``.

    The file gets the mode a plain ``open(path, "w")`` would give (0666 minus the umask), not
    the 0600 of the temporary file, so files in shared dataset folders stay readable. A full
    disk or a read-only folder raises :class:`OutputWriteError` (an OSError) naming the folder
    and the bytes needed; the temporary file is removed, so nothing half-written is left.
    """
    directory = osp.dirname(osp.abspath(path))
    tmp = None
    try:
        mkdir_if_missing(directory)
        fd, tmp = tempfile.mkstemp(
            prefix=f".{osp.basename(path)}.", suffix=TMP_SUFFIX, dir=directory
        )
        with os.fdopen(fd, mode) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        fault_point(f"write:{osp.basename(path)}")  # tests kill here (engine/faults.py)
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None and osp.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError):
            nbytes = len(data.encode() if isinstance(data, str) else data)
            raise output_error(e, path, nbytes) from e
        raise


def _writer() -> bool:
    """Data-parallel runs (#29): only rank 0 writes the run's files (engine.distributed)."""
    from .distributed import is_main_process

    return is_main_process()


def atomic_write_text(path: str, text: str) -> None:
    if _writer():
        _atomic_write(path, text, "w")


def atomic_write_bytes(path: str, data: bytes) -> None:
    _atomic_write(path, data, "wb")


def atomic_torch_save(obj, path: str) -> None:
    """``torch.save`` that never leaves a half-written file behind."""
    if not _writer():  # data-parallel (#29): one writer
        return
    buffer = io.BytesIO()
    torch.save(obj, buffer)  # serialised first: the size is known if the disk is full
    _atomic_write(path, buffer.getbuffer(), "wb")


def remove_orphan_tmp_files(folder: str, skip_marker: str = "") -> list[str]:
    """Delete the temporary files that crashed atomic writes left under ``folder``.

    Only call this while no other process writes there (the run holds the folder's lock).
    Sub-folders holding a file named ``skip_marker`` (other runs' folders) are left alone.
    Returns the removed paths.
    """
    removed = []
    for dirpath, dirnames, filenames in os.walk(folder):
        if skip_marker:
            dirnames[:] = [d for d in dirnames if not osp.exists(osp.join(dirpath, d, skip_marker))]
        for name in filenames:
            if name.startswith(".") and name.endswith(TMP_SUFFIX) and name.count(".") >= 3:
                path = osp.join(dirpath, name)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                    removed.append(path)
    return removed


def read_json(fpath: str):
    with open(fpath) as f:
        return json.load(f)


def write_json(obj, fpath: str) -> None:
    """Write JSON (indent 4, as Dassl) atomically."""
    atomic_write_text(fpath, json.dumps(obj, indent=4, separators=(",", ": ")))


def user_cache_dir(*parts: str) -> str:
    """The per-user cache folder: ``$SAMPLE_PL_CACHE`` (default ``~/.cache/sample-pl``)."""
    base = osp.expanduser(os.environ.get("SAMPLE_PL_CACHE") or "~/.cache/sample-pl")
    return osp.join(base, *parts)


@contextlib.contextmanager
def file_lock(path: str):
    """Hold an exclusive ``fcntl.flock`` on the file ``path`` inside the block.

    Other processes (other runs of a grid) wait at the same lock; it is released when the block
    ends or the process dies. The holder removes the lock file when it is done; a waiter that
    then holds a removed file's lock tries again, so the lock never leaves files behind.
    """
    mkdir_if_missing(osp.dirname(osp.abspath(path)))
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break  # still the file at ``path``: the lock is ours
        except FileNotFoundError:
            pass  # removed by the previous holder: lock the new one
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)
        os.close(fd)  # releases the lock


def listdir_nohidden(path: str, sort: bool = False) -> list[str]:
    items = [f for f in os.listdir(path) if not f.startswith(".")]
    if sort:
        items.sort()
    return items


# ----------------------------------------------------------------------------------------------
# Seeding
# ----------------------------------------------------------------------------------------------
def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy and torch (CPU and all GPUs)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed used at the start of ``epoch`` so that a resumed run replays the same epoch."""
    return (seed * 100_003 + epoch * 7_919 + 17) % (2**31 - 1)


# ----------------------------------------------------------------------------------------------
# Meters
# ----------------------------------------------------------------------------------------------
def _as_number(v) -> float:
    if isinstance(v, torch.Tensor):
        return v.detach().float().item()
    return float(v)


class AverageMeter:
    """Running average of a scalar. Values may be 0-d tensors; they are read lazily (at print
    time), so updating the meter inside the step loop does not synchronise with the GPU."""

    def __init__(self, ema: bool = False):
        self.ema = ema
        self.reset()

    def reset(self) -> None:
        self._pending: list = []
        self._val = 0.0
        self._sum = 0.0
        self._count = 0

    def update(self, val, n: int = 1) -> None:
        self._pending.append((val, n))

    def _flush(self) -> None:
        if not self._pending:
            return
        tensors = [v for v, _ in self._pending if isinstance(v, torch.Tensor)]
        if tensors:  # one host transfer for everything pending
            values = iter(torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist())
        for v, n in self._pending:
            v = next(values) if isinstance(v, torch.Tensor) else float(v)
            self._val = v
            self._sum += v * n
            self._count += n
        self._pending.clear()

    @property
    def val(self) -> float:
        self._flush()
        return self._val

    @property
    def avg(self) -> float:
        self._flush()
        return self._sum / max(self._count, 1)

    @property
    def count(self) -> int:
        self._flush()
        return self._count


class MetricMeter:
    """A dict of AverageMeters, printed as ``name val (avg)``."""

    def __init__(self, delimiter: str = " "):
        self.meters: dict[str, AverageMeter] = defaultdict(AverageMeter)
        self.delimiter = delimiter

    def update(self, input_dict: dict) -> None:
        if input_dict is None:
            return
        if not isinstance(input_dict, dict):
            raise TypeError("Input to MetricMeter.update() must be a dictionary")
        for k, v in input_dict.items():
            self.meters[k].update(v)

    def __str__(self) -> str:
        return self.delimiter.join(
            f"{name} {meter.val:.4f} ({meter.avg:.4f})" for name, meter in self.meters.items()
        )


# ----------------------------------------------------------------------------------------------
# Logging
# ----------------------------------------------------------------------------------------------
class _Formatter(logging.Formatter):
    """Plain messages for INFO (the Dassl look); level names for warnings and errors."""

    def format(self, record: logging.LogRecord) -> str:
        msg = super().format(record)
        if record.levelno >= logging.WARNING:
            msg = f"{record.levelname}: {msg}"
        return msg


def setup_logger(output_dir: str | None = None) -> str | None:
    """Send the project's log records to stdout and to ``output_dir/log.txt``.

    Uses ``logging`` handlers (sys.stdout is never replaced). As in Dassl, an existing log.txt is
    kept and the new log gets a ``-YYYY-mm-dd-HH-MM-SS`` suffix. Returns the log file path.
    """
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for h in list(root.handlers):
        if getattr(h, "_engine_handler", False):
            root.removeHandler(h)
            h.close()
    fmt = _Formatter("%(message)s")
    stream = logging.StreamHandler(sys.stdout)
    stream.setFormatter(fmt)
    stream._engine_handler = True
    root.addHandler(stream)
    if not output_dir:
        return None
    fpath = output_dir if output_dir.endswith((".txt", ".log")) else osp.join(output_dir, "log.txt")
    if osp.exists(fpath):
        fpath += time.strftime("-%Y-%m-%d-%H-%M-%S")
    mkdir_if_missing(osp.dirname(fpath))
    fileh = logging.FileHandler(fpath)
    fileh.setFormatter(fmt)
    fileh._engine_handler = True
    root.addHandler(fileh)
    return fpath


def collect_env_info() -> str:
    import platform

    import torchvision

    lines = [
        f"Python: {platform.python_version()} ({sys.platform})",
        f"PyTorch: {torch.__version__}",
        f"torchvision: {torchvision.__version__}",
        f"CUDA available: {torch.cuda.is_available()}",
    ]
    if torch.cuda.is_available():
        lines.append(f"GPU: {torch.cuda.get_device_name(0)}")
    try:
        import open_clip

        lines.append(f"open_clip: {open_clip.__version__}")
    except ImportError:  # pragma: no cover
        pass
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Metrics and model helpers
# ----------------------------------------------------------------------------------------------
def compute_accuracy(output: torch.Tensor, target: torch.Tensor, topk=(1,)):
    """Top-k accuracies in percent (0-d tensors, no host synchronisation)."""
    maxk = max(topk)
    batch_size = target.size(0)
    if isinstance(output, (tuple, list)):
        output = output[0]
    _, pred = output.topk(maxk, 1, True, True)
    correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
    return [correct[:k].reshape(-1).float().sum() * (100.0 / batch_size) for k in topk]


def count_num_param(model: torch.nn.Module, trainable: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)
