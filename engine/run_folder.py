"""A run folder (OUTPUT_DIR) is owned by one process and belongs to one experiment.

- **Lock**: ``<output>/.lock`` holds the owner's pid and host and is ``fcntl.flock``-ed for the
  run's life; a second run into the folder stops with an :class:`OutputError` naming the owner
  (or, ``train.py --wait-for-folder``, waits for it). The lock dies with its process, so a
  stale file of a killed run is simply taken over. :func:`lock_holder` tells who holds a folder
  (the grid skips such runs until last).
- **Done**: :meth:`RunFolder.result_log` finds the run's result in its logs; ``train.py
  --skip-done`` checks it once it holds the lock and stops there (a grid running beside another
  never repeats a run the other just finished).
- **Experiment**: ``<output>/experiment.json`` holds the config keys that define the experiment
  (all keys but those in :data:`NOT_EXPERIMENT_KEYS`: paths, logging, worker counts, ...). A
  re-run with different values stops with the differing keys, before ``config.yaml`` is
  rewritten; ``train.py --overwrite`` moves the old content aside and starts over,
  ``--force-resume`` continues with the new values.
- **No experiment yet**: a folder that holds no checkpoint (its earlier run only evaluated, or
  failed or stopped before its first checkpoint) has nothing a re-run could resume or mix with,
  so it belongs to no experiment: a run with other values proceeds, as Dassl re-runs into any
  folder, and the earlier run's ``log.txt``, ``scalars.jsonl`` and ``tensorboard/`` are kept as
  ``<name>-<time>`` (:meth:`RunFolder.set_aside_previous_run`).
- **Divergence**: a run that stopped on NaN/inf leaves ``<output>/diverged.json``; a re-run
  refuses to resume past it unless ``--force-resume`` (or ``--overwrite``) is given.
- **Orphans**: temporary files of atomic writes that a crash left behind are removed when a run
  takes the folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import logging
import os
import os.path as osp
import re
import socket
import time

from .errors import OutputError
from .utils import atomic_write_text, output_error, remove_orphan_tmp_files

logger = logging.getLogger(__name__)

# a run's result in its log (as experiments/results.py reads it)
_ACCURACY_RE = re.compile(r"\* accuracy: ([\.\deE+-]+)%")
_TRAIN_END_RE = re.compile(r"Finish(?:ed)? training")
_RESULT_RE = re.compile(r"=> result\b")

LOCK_NAME = ".lock"
EXPERIMENT_NAME = "experiment.json"
DIVERGED_NAME = "diverged.json"

# Config keys that do not change what a run computes (paths, logging, speed, resume): a re-run
# may change them freely. Every other key defines the experiment. A key ending in "." excludes
# the whole node.
NOT_EXPERIMENT_KEYS = (
    "VERSION",
    "OUTPUT_DIR",
    "RESUME",
    "USE_CUDA",
    "VERBOSE",
    "DISTRIBUTED.TIMEOUT",  # how long a data-parallel run waits for a silent process
    "DISTRIBUTED.BACKEND",
    "PLUGINS",  # where code comes from (a path may be written two ways); TRAINER.NAME counts
    "DATASET.ROOT",
    "DATALOADER.NUM_WORKERS",
    "DATALOADER.CACHE_DECODED",
    "DATALOADER.CACHE_DECODED_MB",
    "DATALOADER.TEST.BATCH_SIZE",
    "MODEL.BACKBONE.PATH",
    "MODEL.BACKBONE.URL",
    "MODEL.BACKBONE.SHA256",
    "MODEL.BACKBONE.CONFIG",
    "MODEL.COMPILE",
    "TRAIN.PRINT_FREQ",
    "TRAIN.CHECKPOINT_FREQ",
    "TEST.PER_CLASS_RESULT",
    "TEST.COMPUTE_CMAT",
    "TEST.NO_TEST",
    "TEST.FEATURE_CACHE",
    "TEST.FEATURE_CACHE_DIR",
)


def _flatten(node, prefix: str = "") -> dict:
    out = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = list(v) if isinstance(v, tuple) else v
    return out


def _excluded(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in NOT_EXPERIMENT_KEYS)


def _trainer_node(cfg) -> str | None:
    from .registry import TRAINER_REGISTRY

    try:
        return TRAINER_REGISTRY.get(cfg.TRAINER.NAME).config_node()
    except Exception:  # noqa: BLE001 - an unknown trainer fails later with its own message
        return None


def experiment_config(cfg, run: dict | None = None) -> dict:
    """The flat ``{key: value}`` that defines the experiment of ``cfg`` (plus ``RUN.*`` entries
    for how the run uses the config, e.g. ``RUN.EVAL_ONLY``).

    Of ``TRAINER`` only ``NAME`` and the run's trainer node count (the other trainers' keys do
    not change this run).
    """
    node = _trainer_node(cfg)
    keep = ("TRAINER.NAME", f"TRAINER.{node}.") if node else ("TRAINER.NAME",)
    flat = {
        k: v
        for k, v in _flatten(cfg).items()
        if not _excluded(k) and (not k.startswith("TRAINER.") or k.startswith(keep))
    }
    for k, v in (run or {}).items():
        flat[f"RUN.{k}"] = v
    return flat


def _differences(old: dict, new: dict) -> list[str]:
    """Keys with other values; keys on one side only (added or removed by a newer version of
    this code, with their defaults) do not count, except the ``RUN.*`` entries."""
    diffs = []
    for key in sorted(set(old) | set(new)):
        if (key not in old or key not in new) and not key.startswith("RUN."):
            continue
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if a != b:
            diffs.append(f"{key}: {a!r} in the folder, {b!r} now")
    return diffs


class RunFolder:
    """The output folder of one run: take it with :meth:`acquire`, give it back with
    :meth:`release` (or use it as a context manager)."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        # the differences to the folder's recorded experiment that were accepted because the
        # folder holds no checkpoint (see check_experiment); empty otherwise
        self.reclaimed: list[str] = []

    # -- lock ------------------------------------------------------------------------------------
    def acquire(self, wait: bool = False) -> None:
        """Create the folder and hold its lock; raise OutputError if another process holds it,
        or with ``wait`` wait until it gives the folder back (it finished, failed or died)."""
        lock = osp.join(self.path, LOCK_NAME)
        try:
            os.makedirs(self.path, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except FileExistsError as e:
            raise OutputError(
                f"Output folder {self.path} is a file, not a folder: choose another --output-dir"
            ) from e
        except OSError as e:
            raise output_error(e, lock) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = ""
            with contextlib.suppress(OSError):
                owner = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            if wait:
                print(
                    f"Output folder {self.path} is in use by another run "
                    f"({owner or 'owner unknown'}): waiting for it to finish",
                    flush=True,
                )
                fcntl.flock(fd, fcntl.LOCK_EX)  # blocks until the holder releases or dies
                self._hold(fd)
                return
            os.close(fd)
            raise OutputError(
                f"Output folder {self.path} is in use by another run ({owner or 'owner unknown'})."
                " Two runs in one folder would mix their checkpoints and logs: wait for it to "
                "finish (or stop it), or choose another --output-dir."
            ) from None
        self._hold(fd)

    def _hold(self, fd: int) -> None:
        """Record this process as the holder of the locked ``fd``."""
        info = f"pid {os.getpid()} on host {socket.gethostname()}, since {time.ctime()}\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # releases the flock
            self._fd = None

    def __enter__(self) -> RunFolder:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # -- the run's result ------------------------------------------------------------------------
    def result_log(self, eval_only: bool) -> str | None:
        """The newest log of the folder that holds the run's result, or None.

        A training run's result is an accuracy after its ``Finish training`` line, an
        ``--eval-only`` run's one after ``=> result``; the same rule as experiments/results.py,
        which the grid reads (``log.txt``, then ``log.txt-<time>``, newest first).
        """
        first = osp.join(self.path, "log.txt")
        logs = [first] if osp.isfile(first) else []
        logs += sorted(p for p in glob.glob(first + "-*") if osp.isfile(p))
        marker = _RESULT_RE if eval_only else _TRAIN_END_RE
        for path in reversed(logs):
            with open(path, errors="replace") as f:
                text = f.read()
            found = marker.search(text)
            if found and _ACCURACY_RE.search(text, found.end()):
                return path
        return None

    # -- orphans ---------------------------------------------------------------------------------
    def remove_orphans(self) -> None:
        """Delete temporary files of atomic writes that crashed (we hold the lock) in the folder
        and its sub-folders, except sub-folders that are run folders of their own."""
        removed = remove_orphan_tmp_files(self.path, skip_marker=LOCK_NAME)
        if removed:
            logger.info("Removed %d unfinished temporary file(s) of a crashed run", len(removed))

    # -- experiment ------------------------------------------------------------------------------
    def _recorded(self) -> tuple[dict | None, str]:
        path = osp.join(self.path, EXPERIMENT_NAME)
        if osp.isfile(path):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError), open(path) as f:
                return json.load(f)["config"], path
        return None, path

    def same_experiment(self, flat: dict) -> bool:
        """Whether the folder records no experiment or the experiment ``flat`` (up to keys of
        one side only, see :meth:`check_experiment`)."""
        old, _ = self._recorded()
        return old is None or not _differences(old, flat)

    def check_experiment(self, flat: dict, force: bool = False) -> None:
        """Compare ``flat`` (see :func:`experiment_config`) with the folder's experiment.

        Raises OutputError listing the differing keys unless ``force`` (continue with the new
        values).
        """
        old, path = self._recorded()
        if old is None or old == flat:
            return
        diffs = _differences(old, flat)
        if not diffs:
            return
        if not self.holds_checkpoints():  # nothing to resume or to mix with: no experiment
            self.reclaimed = diffs
            return
        if force:
            logger.warning(
                "--force-resume: continuing %s with a changed experiment: %s",
                self.path,
                "; ".join(diffs),
            )
            return
        shown = diffs if len(diffs) <= 12 else [*diffs[:12], f"... ({len(diffs)} keys in all)"]
        raise OutputError(
            f"Output folder {self.path} holds a run of another experiment ({path}): "
            + "; ".join(shown)
            + ". Use another --output-dir, or pass --overwrite to move the old run aside and "
            "start over, or --force-resume to continue it with the new values."
        )

    def holds_checkpoints(self) -> bool:
        """Whether ``<output>/<model>/`` holds a checkpoint (numbered, best or rolling): what a
        re-run would resume."""
        from .checkpoint import ROLLING_NAME

        names = ("checkpoint", "model-best.pth.tar", ROLLING_NAME)
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.path):
                if not entry.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(OSError):
                    for f in os.listdir(entry.path):
                        if f in names or f.startswith("model.pth.tar-"):
                            return True
        return False

    def set_aside_previous_run(self) -> list[str]:
        """Keep the earlier run's ``log.txt``, ``scalars.jsonl`` and ``tensorboard/`` (of a
        folder accepted by :meth:`check_experiment` without a checkpoint) as ``<name>-<time of
        its last write>``, Dassl's suffix; returns the new names."""
        kept = []
        for name in ("log.txt", "scalars.jsonl", "tensorboard"):
            path = osp.join(self.path, name)
            if not osp.exists(path):
                continue
            stamp = time.strftime("-%Y-%m-%d-%H-%M-%S", time.localtime(osp.getmtime(path)))
            dest, n = path + stamp, 1
            while osp.exists(dest):
                n += 1
                dest = f"{path}{stamp}-{n}"
            try:
                os.replace(path, dest)
            except OSError as e:
                raise output_error(e, dest) from e
            kept.append(osp.basename(dest))
        return kept

    def record_experiment(self, flat: dict) -> None:
        atomic_write_text(
            osp.join(self.path, EXPERIMENT_NAME),
            json.dumps({"config": flat}, indent=1, sort_keys=True, default=str) + "\n",
        )

    # -- divergence ------------------------------------------------------------------------------
    def check_divergence(self, force: bool = False) -> None:
        """Refuse to resume a run that diverged, unless ``force``."""
        marker = read_divergence(self.path)
        if marker is None:
            return
        where = f"epoch {marker.get('epoch')}, batch {marker.get('batch')}"
        if force:
            logger.warning(
                "--force-resume: resuming %s, which diverged at %s, from its last finite "
                "checkpoint",
                self.path,
                where,
            )
            return
        raise OutputError(
            f"The run in {self.path} diverged at {where} ({marker.get('message', '')[:300]}). "
            "Resuming it with the same settings would diverge again. Pass --overwrite to start "
            "over, or change the settings (e.g. a lower OPTIM.LR) and pass --force-resume to "
            f"continue from its last finite checkpoint ({DIVERGED_NAME} has the details)."
        )

    # -- starting over ---------------------------------------------------------------------------
    def move_aside(self) -> str | None:
        """Move the folder's content (not the lock) to ``<output>.old-<time>``; returns it."""
        entries = [e for e in os.listdir(self.path) if e != LOCK_NAME]
        if not entries:
            return None
        base = f"{self.path.rstrip(os.sep)}.old-{time.strftime('%Y%m%d-%H%M%S')}"
        dest, n = base, 1
        while osp.exists(dest):
            n += 1
            dest = f"{base}-{n}"
        try:
            os.makedirs(dest)
            for e in entries:
                os.replace(osp.join(self.path, e), osp.join(dest, e))
        except OSError as e:
            raise output_error(e, dest) from e
        return dest


def lock_holder(path: str) -> str | None:
    """Who holds the lock of run folder ``path`` (``"pid N on host H, since ..."``), or None
    when no process does (no folder, no lock file, or a stale one of a dead process).

    A look only: it takes a shared lock for an instant and never creates anything.
    """
    try:
        fd = os.open(osp.join(path, LOCK_NAME), os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            return owner or "owner unknown"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def write_divergence(output_dir: str, epoch: int, batch: int, message: str) -> None:
    """Write ``<output>/diverged.json`` (best effort: the FloatingPointError is what matters)."""
    data = {"epoch": epoch, "batch": batch, "message": message, "time": time.ctime()}
    try:
        atomic_write_text(osp.join(output_dir, DIVERGED_NAME), json.dumps(data, indent=1) + "\n")
    except OSError as e:
        logger.warning("Could not write %s: %s", DIVERGED_NAME, e)


def read_divergence(output_dir: str) -> dict | None:
    path = osp.join(output_dir, DIVERGED_NAME)
    if not osp.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    return data if isinstance(data, dict) else {}


def clear_divergence(output_dir: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(osp.join(output_dir, DIVERGED_NAME))
