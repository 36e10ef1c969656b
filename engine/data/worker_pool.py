"""Loader worker processes kept across the runs of a packed worker (engine/runner.py).

A ``DataLoader`` with ``num_workers > 0`` forks its worker processes when it is first iterated
and joins them when it is done (a persistent training loader: at the end of its run); a packed
worker that runs train.py runs one after another pays that for every run's training and test
loaders (docs/performance.md, "Packed workers"). Inside a packed worker
(:func:`engine.runner.run_packed` calls :func:`activate`) the loaders built by
:func:`engine.data.manager.build_data_loader` (:class:`PooledLoader`) instead send their work to
one pool of worker processes that lives as long as the process:

- A loader's dataset (the :class:`~engine.data.manager.DatasetWrapper`: its items, transforms and
  decoded-image cache) is sent to every worker when the loader is first iterated (again only
  if its items, cache or transforms were replaced), and dropped from them when the run ends
  (:func:`release_all`, called between runs by ``shutdown_loaders``), so memory does not grow
  across runs.
- The decoded-image cache: workers forked before a run cannot see the images the parent decodes
  for it, so in a packed worker the images are decoded into blocks of shared memory
  (engine/data/image_cache.py, ``to_shared``; the process-wide store keeps them for the next
  runs) and a run hands them over as one handle per block (:class:`SharedImages`; images
  decoded privately, before the pool was active, are copied into a block for the run). The pool
  is forked before the first run's images are decoded (:func:`prepare_pool`), so a worker maps
  a block only while a run uses it. The choice is measured in docs/performance.md.
- The batches are those of the DataLoader: the same batch sampler iterated in the parent, batch
  ``i`` of an epoch made by worker ``i % N`` with DataLoader's prefetching (two batches per
  worker), the dataset fetched and collated by torch's own fetcher, each worker seeded as a
  DataLoader seeds its workers (a base seed drawn from the parent's generator when the
  DataLoader would draw it, plus the worker's index), and each loader's random state kept apart
  in the workers. Per-sample seeds (:class:`~engine.data.manager.EpochSampler`) make the pixels
  independent of the worker anyway. ``tests/test_worker_pool.py`` compares them bit for bit.
- An exception in a worker reaches the iteration with the worker's traceback (as DataLoader's
  does); the pool stays usable. A worker that dies marks the pool broken and the next iteration
  builds a new one; a different ``NUM_WORKERS`` also builds a new one. An iteration abandoned
  (a failed or killed run, a ``break``) is cancelled: workers skip its queued batches and its
  late results are dropped, never delivered to another iteration.
- The workers stop with the process (:func:`shutdown_pool` at exit: a stop message, joined).

Outside a packed worker (a train.py process) :class:`PooledLoader` is a plain ``DataLoader``.
Loaders that the pool cannot serve fall back to DataLoader's own workers: an iterable dataset,
a ``worker_init_fn``, a ``generator``, a ``timeout``, ``in_order=False``, a multiprocessing
context, or a dataset that cannot be pickled (a lambda transform in a Dassl-style trainer file:
logged once). Trainers that build their own ``DataLoader`` keep it.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import gc
import itertools
import logging
import os
import os.path as osp
import pickle
import queue
import random
import signal
import sys
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as tmp
from torch._utils import ExceptionWrapper
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils import worker as torch_worker
from torch.utils.data._utils.pin_memory import pin_memory as pin_batch
from torch.utils.data.dataloader import _DatasetKind

from .device_finish import FinishingLoader
from .image_cache import SHM_RESERVE, is_dense, place, shm_free

logger = logging.getLogger(__name__)

POLL_S = 1.0  # how often a waiting worker checks its parent, and the parent its workers
CANCEL_SLOTS = 1024  # ring of cancelled iteration ids shared with the workers
STOP_TIMEOUT_S = 5.0

# what pickling a dataset raises for a lambda, a local class or an open file
_PICKLING_ERRORS = (pickle.PicklingError, TypeError, AttributeError)


class DatasetNotPicklable(Exception):
    """A loader's dataset cannot be sent to the pool's workers (it cannot be pickled, or its
    decoded images do not fit the shared memory)."""


_active = False  # True inside a packed worker (activate)
_allowed = True  # False: packed workers use a DataLoader per run (allow(False); benchmarks)
_POOL: WorkerPool | None = None
_LOADER_KEYS = itertools.count(1)
_ITER_IDS = itertools.count(1)  # 0 is the workers' replies to control messages


def allow(flag: bool) -> None:
    """Whether :func:`activate` may turn the pool on (False: packed workers fork a loader's
    workers per run as before; the benchmark's comparison)."""
    global _allowed
    _allowed = bool(flag)
    if not _allowed:
        deactivate()


def activate() -> None:
    """Serve the process's pooled loaders from the kept worker pool (a packed worker)."""
    global _active
    _active = _allowed


def deactivate() -> None:
    global _active
    _active = False


def is_active() -> bool:
    return _active


# -- the decoded-image cache in shared memory ------------------------------------------------
class SharedImages:
    """A decoded-image cache (``index -> uint8 [3, H, W]``) that workers forked before the run
    can read: its images in blocks of shared memory, each block pickled as one handle.

    Images already in shared memory (decoded in a packed worker: image_cache.to_shared) are
    referenced where they are; others (decoded before the pool was active) are copied into one
    new block for the run.
    """

    def __init__(
        self,
        blocks: list[torch.Tensor],
        spans: dict[int, tuple],
        copied: int = 0,
        token: str | None = None,
    ):
        self.blocks = blocks  # flat uint8 tensors over whole storages
        self.spans = spans  # index -> (block, offset, shape, strides)
        self.copied = copied  # bytes copied for the run (images not yet in shared memory)
        self.token = token  # the main process's cache (image_cache.cache_of)

    @classmethod
    def pack(cls, cache) -> SharedImages:
        blocks, block_of, spans, private, total = [], {}, {}, {}, 0
        for idx, tensor in cache.tensors().items():
            storage = tensor.untyped_storage()
            if not (storage.is_shared() and is_dense(tensor)):
                private[idx] = tensor
                continue
            if storage.data_ptr() not in block_of:
                block_of[storage.data_ptr()] = len(blocks)
                blocks.append(torch.empty(0, dtype=torch.uint8).set_(storage))
            where = (block_of[storage.data_ptr()], tensor.storage_offset())
            spans[idx] = (*where, tuple(tensor.shape), tensor.stride())
        if private:
            total = sum(t.numel() for t in private.values())
            if shm_free() < total + SHM_RESERVE:
                raise DatasetNotPicklable(
                    f"its {total / 2**20:.0f} MB of decoded images do not fit /dev/shm "
                    f"({shm_free() / 2**20:.0f} MB free)"
                )
            flat = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(total))
            offset = 0
            for idx, tensor in private.items():
                placed = place(flat, offset, tensor)  # its own strides: a memory copy
                spans[idx] = (len(blocks), offset, tuple(placed.shape), placed.stride())
                offset += tensor.numel()
            blocks.append(flat)
        return cls(blocks, spans, total, getattr(cache, "token", None))

    def get(self, idx: int) -> torch.Tensor | None:
        span = self.spans.get(idx)
        if span is None:
            return None
        block, offset, shape, stride = span
        return torch.as_strided(self.blocks[block], shape, stride, offset)

    def __len__(self) -> int:
        return len(self.spans)


def _fingerprint(dataset) -> tuple:
    """What a registration depends on: a change makes the loader send its dataset again."""
    items = getattr(dataset, "data_source", None)
    return (
        id(dataset),
        id(items),
        len(items) if items is not None else -1,
        id(getattr(dataset, "images", None)),
        id(getattr(dataset, "transform", None)),
    )


# -- the worker processes ---------------------------------------------------------------------
def _console() -> str | None:
    """The regular file this process's stdout goes to now (None: a terminal, a pipe)."""
    try:
        path = os.readlink("/proc/self/fd/1")
    except OSError:
        return None
    return path if osp.isfile(path) else None


def _memory() -> dict:
    """This process's resident memory and the part of it that is its own (not shared with the
    parent it was forked from), in bytes (-1 where /proc cannot tell)."""
    out = {"rss_bytes": -1, "private_bytes": -1}
    try:
        with open("/proc/self/smaps_rollup") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return out
    kb = lambda name: int(fields.get(name, "-1 kB").split()[0])  # noqa: E731
    out["rss_bytes"] = kb("Rss") * 1024
    out["private_bytes"] = (kb("Private_Clean") + kb("Private_Dirty")) * 1024
    return out


class _WorkerState:
    """One worker's datasets and the random state of each loader it serves."""

    def __init__(self, wid: int, num_workers: int):
        self.wid, self.num_workers = wid, num_workers
        self.datasets: dict[int, object] = {}  # key -> (dataset, fetcher) or ExceptionWrapper
        self.seeds: dict[int, int] = {}
        self.rng: dict[int, tuple] = {}  # key -> saved (random, torch, numpy) states
        self.current: int | None = None
        self.console: str | None = None

    def follow(self, console: str | None) -> None:
        """Write this process's output (warnings, prints) where the parent's goes now: a
        packed worker sends each run's output to that run's console file (runner.output_to)."""
        if not console or console == self.console:
            return
        try:
            fd = os.open(console, os.O_WRONLY | os.O_APPEND)
        except OSError:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        self.console = console

    def _save(self) -> tuple:
        np_state = None
        if torch_worker.HAS_NUMPY:
            import numpy as np

            np_state = np.random.get_state()
        return random.getstate(), torch.get_rng_state(), np_state

    def _restore(self, state: tuple) -> None:
        random.setstate(state[0])
        torch.set_rng_state(state[1])
        if state[2] is not None:
            import numpy as np

            np.random.set_state(state[2])

    def switch(self, key: int) -> None:
        """Make ``key``'s random state the process's (a DataLoader's workers serve one loader)."""
        if self.current == key:
            return
        if self.current is not None and self.current in self.datasets:
            self.rng[self.current] = self._save()
        if key in self.rng:
            self._restore(self.rng.pop(key))
        self.current = key
        entry = self.datasets.get(key)
        if isinstance(entry, tuple):
            torch_worker._worker_info = torch_worker.WorkerInfo(
                id=self.wid,
                num_workers=self.num_workers,
                seed=self.seeds.get(key, 0) + self.wid,
                dataset=entry[0],
            )

    def receive(self, key: int, payload: bytes, images_payload: bytes | None) -> None:
        """Hold the dataset of loader ``key`` (a method: no local of the loop refers to it)."""
        self.drop([key])
        try:
            dataset, auto_collation, collate_fn, drop_last = pickle.loads(payload)
            if images_payload is not None:
                dataset.images = pickle.loads(images_payload)
            fetcher = _DatasetKind.create_fetcher(
                _DatasetKind.Map, dataset, auto_collation, collate_fn, drop_last
            )
            self.datasets[key] = (dataset, fetcher)
        except Exception:
            self.datasets[key] = ExceptionWrapper(
                where=f"in loader pool worker {self.wid}, receiving a dataset"
            )

    def seed(self, key: int, base_seed: int) -> None:
        """Seed as DataLoader's ``_worker_loop`` seeds worker ``wid``."""
        self.switch(key)
        self.seeds[key] = base_seed
        seed = base_seed + self.wid
        random.seed(seed)
        torch.manual_seed(seed)
        if torch_worker.HAS_NUMPY:
            import numpy as np

            np.random.seed(torch_worker._generate_state(base_seed, self.wid))

    def drop(self, keys) -> None:
        for key in list(self.datasets) if keys is None else keys:
            self.datasets.pop(key, None)
            self.seeds.pop(key, None)
            self.rng.pop(key, None)
            if self.current == key:
                self.current = None
        torch_worker._worker_info = None
        gc.collect()


def _worker_loop(wid, num_workers, tasks, results, cancelled, parent_pid):
    """A pool worker: datasets arrive pickled, batches of (loader key, indices) go out."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    torch.set_num_threads(1)  # as DataLoader's workers
    gc.freeze()  # the parent's objects at the fork: never ours to collect
    state = _WorkerState(wid, num_workers)
    while True:
        try:
            msg = tasks.get(timeout=POLL_S)
        except queue.Empty:
            if os.getppid() != parent_pid:  # the parent died without stopping us
                return
            continue
        if msg is None:
            return
        kind = msg[0]
        if kind == "task":
            _, key, iter_id, idx, index = msg
            if cancelled[iter_id % CANCEL_SLOTS] == iter_id:
                continue  # an abandoned iteration: nobody waits for this batch
            entry = state.datasets.get(key)
            try:
                if isinstance(entry, ExceptionWrapper):
                    data = entry
                elif entry is None:
                    raise RuntimeError(f"loader {key} has no dataset in pool worker {wid}")
                else:
                    state.switch(key)
                    data = entry[1].fetch(index)
            except Exception:
                data = ExceptionWrapper(where=f"in loader pool worker {wid}")
            results.put((iter_id, idx, data))
            del data, entry  # a dropped dataset must not stay referenced from here
        elif kind == "data":
            state.follow(msg[4])
            state.receive(*msg[1:4])
            del msg  # the payload: nothing of a dropped dataset may stay referenced here
        elif kind == "seed":
            state.seed(msg[1], msg[2])
        elif kind == "drop":
            state.drop(msg[1])
        elif kind == "stats":
            results.put((0, wid, {"datasets": len(state.datasets), **_memory()}))


class WorkerPool:
    """``num_workers`` worker processes serving every pooled loader of the process."""

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self.results = tmp.Queue()
        self.cancelled = tmp.RawArray("q", CANCEL_SLOTS)
        self.queues, self.procs = [], []
        self.registered: dict[int, tuple] = {}  # loader key -> fingerprint
        self.packs: dict[int, tuple] = {}  # loader key -> (cache object, SharedImages)
        self.pending: dict[int, dict[int, object]] = {}  # live iteration -> its arrived batches
        self.seeded: set[int] = set()  # loader keys whose workers were seeded
        self.broken = False
        for wid in range(num_workers):
            tasks = tmp.Queue()
            tasks.cancel_join_thread()  # as DataLoader's index queues
            proc = tmp.Process(
                target=_worker_loop,
                args=(wid, num_workers, tasks, self.results, self.cancelled, os.getpid()),
                daemon=True,
            )
            proc.start()
            self.queues.append(tasks)
            self.procs.append(proc)
        logger.info(
            "Loader worker pool: %d processes (pids %s), kept for the runs of this process",
            num_workers,
            " ".join(str(p.pid) for p in self.procs),
        )

    # registration --------------------------------------------------------------------------
    def register(self, loader) -> None:
        """Send ``loader``'s dataset to every worker unless they hold this version of it.

        Raises:
            DatasetNotPicklable: the caller falls back to DataLoader's workers.
        """
        key, dataset = loader._pool_key, loader.dataset
        fingerprint = _fingerprint(dataset)
        if self.registered.get(key) == fingerprint:
            return
        sent, shared = dataset, None
        images = getattr(dataset, "images", None)
        if images is not None and hasattr(images, "tensors"):
            pack = self.packs.get(key)
            if pack is None or pack[0] is not images:
                pack = (images, SharedImages.pack(images))
                self.packs[key] = pack
            sent, shared = copy.copy(dataset), pack[1]
            sent.images = None  # sent apart: handles to its shared memory, one set per worker
        elif key in self.packs:
            del self.packs[key]
        obj = (sent, loader._auto_collation, loader.collate_fn, loader.drop_last)
        # pickled here, so an error is raised to the caller instead of in a queue's feeder
        # thread; the dataset once for all workers, the images' handles once per worker
        try:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            handles = [
                None if shared is None else bytes(ForkingPickler.dumps(shared)) for _ in self.queues
            ]
        except _PICKLING_ERRORS as e:
            raise DatasetNotPicklable(str(e)) from e
        console = _console()
        for tasks, images_payload in zip(self.queues, handles):
            tasks.put(("data", key, payload, images_payload, console))
        self.registered[key] = fingerprint

    def seed(self, key: int, base_seed: int) -> None:
        for tasks in self.queues:
            tasks.put(("seed", key, base_seed))

    def release(self, keys=None) -> None:
        """Drop the datasets of ``keys`` (None: all) from the workers; cancel what is queued."""
        if keys is None:
            for iter_id in list(self.pending):
                self.cancel(iter_id)
            self.registered.clear()
            self.packs.clear()
            self.seeded.clear()
        else:
            for key in keys:
                self.registered.pop(key, None)
                self.packs.pop(key, None)
                self.seeded.discard(key)
        if not self.broken:
            for tasks in self.queues:
                tasks.put(("drop", None if keys is None else list(keys)))

    # results ---------------------------------------------------------------------------------
    def cancel(self, iter_id: int) -> None:
        self.cancelled[iter_id % CANCEL_SLOTS] = iter_id
        self.pending.pop(iter_id, None)

    def check_alive(self) -> None:
        for wid, proc in enumerate(self.procs):
            if not proc.is_alive():
                self.broken = True
                raise RuntimeError(
                    f"Loader pool worker {wid} (pid {proc.pid}) exited unexpectedly with exit "
                    f"code {proc.exitcode}; the next iteration starts a new pool. A code of -9 "
                    "is usually the out-of-memory killer: use fewer DATALOADER.NUM_WORKERS or a "
                    "smaller DATALOADER.CACHE_DECODED_MB"
                )

    def receive(self, iter_id: int, idx: int):
        """Batch ``idx`` of iteration ``iter_id``; batches of other live iterations that arrive
        meanwhile are kept for them, those of cancelled ones dropped."""
        box = self.pending.setdefault(iter_id, {})
        while idx not in box:
            try:
                rid, ridx, data = self.results.get(timeout=POLL_S)
            except queue.Empty:
                self.check_alive()
                continue
            if rid in self.pending:
                self.pending[rid][ridx] = data
        return box.pop(idx)

    def stats(self) -> list[dict]:
        """Each worker's ``{"datasets": held, "rss_bytes", "private_bytes"}`` (_memory)."""
        for tasks in self.queues:
            tasks.put(("stats",))
        replies: dict[int, dict] = {}
        while len(replies) < self.num_workers:
            try:
                rid, second, data = self.results.get(timeout=POLL_S)
            except queue.Empty:
                self.check_alive()
                continue
            if rid == 0:  # a reply: (0, worker, stats)
                replies[second] = data
            elif rid in self.pending:  # a batch: (iteration, index, data)
                self.pending[rid][second] = data
        return [replies[w] for w in range(self.num_workers)]

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def shutdown(self) -> None:
        """Stop and join every worker (terminate those that do not stop)."""
        for tasks, proc in zip(self.queues, self.procs):
            if proc.is_alive():
                with contextlib.suppress(OSError, ValueError):
                    tasks.put(None)
        for proc in self.procs:
            proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                proc.terminate()
                proc.join(STOP_TIMEOUT_S)
        for q in (*self.queues, self.results):
            q.cancel_join_thread()
            q.close()
        self.pending.clear()
        self.packs.clear()
        self.registered.clear()
        self.broken = True


def current_pool() -> WorkerPool | None:
    return _POOL


def _pool_for(num_workers: int) -> WorkerPool | None:
    """The pool with ``num_workers`` workers (a new one when the count differs or the pool
    broke); None when another count's pool is still being iterated (then DataLoader serves)."""
    global _POOL
    if _POOL is not None and (_POOL.num_workers != num_workers or _POOL.broken):
        if _POOL.pending and not _POOL.broken:
            return None
        _POOL.shutdown()
        _POOL = None
    if _POOL is None:
        _POOL = WorkerPool(num_workers)
    return _POOL


def prepare_pool(loader) -> None:
    """Start the pool that will serve ``loader`` now, if it will serve it and is not running:
    workers forked before a run's images are decoded hold no mapping of them (a mapping
    inherited at the fork would keep their shared memory alive as long as the pool)."""
    if _active and isinstance(loader, PooledLoader) and not _unsupported(loader):
        _pool_for(loader.num_workers)


def release_all() -> None:
    """End of a run: drop every dataset from the workers, cancel unfinished iterations."""
    if _POOL is not None:
        _POOL.release()


def shutdown_pool() -> None:
    """Stop the pool's workers (at exit; also before a fork-sensitive step or in tests)."""
    global _POOL
    if _POOL is not None:
        _POOL.shutdown()
        _POOL = None


atexit.register(shutdown_pool)


# -- the loaders -------------------------------------------------------------------------------
class _PoolIter:
    """One pass over a pooled loader (DataLoader's prefetching and in-order delivery)."""

    def __init__(self, loader, pool: WorkerPool):
        self.pool, self.key = pool, loader._pool_key
        self.id = next(_ITER_IDS)
        self.pin = loader.pin_memory and torch.accelerator.is_available()
        self.sampler_iter = iter(loader._index_sampler)
        self.sent = self.rcvd = 0
        self.exhausted = False
        self.length = len(loader)
        pool.pending[self.id] = {}
        for _ in range(loader.prefetch_factor * pool.num_workers):
            self._put()

    def _put(self) -> None:
        if self.exhausted:
            return
        try:
            index = next(self.sampler_iter)
        except StopIteration:
            self.exhausted = True
            return
        n = self.pool.num_workers
        self.pool.queues[self.sent % n].put(("task", self.key, self.id, self.sent, index))
        self.sent += 1

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return self.length

    def __next__(self):
        if self.rcvd >= self.sent:
            self.close()
            raise StopIteration
        try:
            data = self.pool.receive(self.id, self.rcvd)
        except BaseException:
            self.close()
            raise
        self.rcvd += 1
        self._put()
        if isinstance(data, ExceptionWrapper):
            self.close()
            data.reraise()
        if self.pin:
            data = pin_batch(data)
        return data

    def close(self) -> None:
        if self.id in self.pool.pending:
            self.pool.cancel(self.id)

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter exit the pool may be gone
            self.close()


def _unsupported(loader) -> str | None:
    """Why the pool cannot serve ``loader`` (None: it can)."""
    if loader.num_workers <= 0:
        return "no workers"
    if isinstance(loader.dataset, IterableDataset):
        return "an iterable dataset"
    for attr, value in (
        ("worker_init_fn", None),
        ("generator", None),
        ("multiprocessing_context", None),
        ("timeout", 0),
    ):
        if getattr(loader, attr, value) != value:
            return f"a {attr}"
    if not getattr(loader, "in_order", True):
        return "in_order=False"
    return None


class PooledLoader(DataLoader):
    """A ``DataLoader`` (same arguments, same batches) whose iterations use the process's kept
    worker pool while :func:`is_active` (a packed worker), and DataLoader's own workers
    otherwise."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pool_key = next(_LOADER_KEYS)
        self._pool_refused: str | None = None

    def __iter__(self):
        if not _active or self._pool_refused or _unsupported(self):
            return super().__iter__()
        pool = _pool_for(self.num_workers)
        if pool is None:
            return super().__iter__()
        try:
            pool.register(self)
        except DatasetNotPicklable as e:
            self._pool_refused = f"its dataset cannot be sent to the kept workers: {e}"
            logger.info("Loader pool: %s; this loader forks its own workers", self._pool_refused)
            return super().__iter__()
        if not (self.persistent_workers and self._pool_key in pool.seeded):
            # DataLoader draws its base seed here: per iteration, or once with persistent workers
            base_seed = torch.empty((), dtype=torch.int64).random_(generator=self.generator)
            pool.seed(self._pool_key, base_seed.item())
            pool.seeded.add(self._pool_key)
        return _PoolIter(self, pool)

    def release_pool(self) -> None:
        """Drop this loader's dataset from the pool's workers (its next iteration sends it)."""
        if _POOL is not None and self._pool_key in _POOL.registered:
            _POOL.release([self._pool_key])


class PooledFinishingLoader(FinishingLoader, PooledLoader):
    """:class:`~engine.data.device_finish.FinishingLoader` over a :class:`PooledLoader`."""
