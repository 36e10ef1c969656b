"""The loader worker pool of a packed worker (engine/data/worker_pool.py): the batches of
DataLoader bit for bit, failures that reach the run and leave the pool usable, nothing stale
between iterations, no leftover processes, and a packed worker that forks its loader workers
once for all its runs."""

from __future__ import annotations

import json
import multiprocessing
import os
import os.path as osp
import re
import signal
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, make_cfg, run_train
from torch.utils.data import DataLoader

from engine.data import DataManager, DatasetWrapper
from engine.data import worker_pool as wp
from engine.data.distributed import ShardedBatchSampler
from engine.data.image_cache import clear_process_store
from engine.data.manager import EpochSampler, shutdown_loader

COOP = ["random_resized_crop", "random_flip", "normalize"]  # the default training transforms


@pytest.fixture(autouse=True)
def fresh_pool():
    """Every test starts and ends without a pool, outside a packed worker."""
    wp.shutdown_pool()
    yield
    wp.deactivate()
    wp.allow(True)
    wp.shutdown_pool()


def loader_cfg(root: str, pipeline: str = "pil", seed: str = "2", *extra):
    return make_cfg(
        [
            "--root", root, "--seed", seed, "INPUT.PIPELINE", pipeline, "INPUT.SIZE", "(24, 24)",
            "INPUT.TRANSFORMS", str(COOP), "DATALOADER.NUM_WORKERS", "2",
            "DATALOADER.TRAIN_X.BATCH_SIZE", "8", "DATALOADER.TRAIN_X.DROP_LAST", "True",
            "DATALOADER.TEST.BATCH_SIZE", "16", *extra,
        ]
    )  # fmt: skip


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def shm_mappings(pid: int) -> set[str]:
    """The shared-memory files process ``pid`` maps."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if "/dev/shm/" in line}


def assert_same_batches(a: list, b: list) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            if isinstance(x[key], torch.Tensor):
                assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), key
            else:
                assert x[key] == y[key], key


def passes(dm: DataManager, sharded) -> tuple[list, torch.Tensor]:
    """Two training epochs, the test set and a data-parallel shard's epoch, from one state of
    the global generator; and that generator's state after them (what the loaders drew)."""
    torch.manual_seed(7)
    out = []
    for epoch in (0, 1):
        dm.train_loader_x.sampler.set_epoch(epoch)
        out += list(dm.train_loader_x)
    out += list(dm.test_loader)
    sharded.batch_sampler.set_epoch(1)
    out += list(sharded)
    return out, torch.get_rng_state()


CASES = [("pil", "2", "copied"), ("tensor", "2", "shared"), ("pil", "-1", "shared")]


@pytest.mark.parametrize("pipeline,seed,cache", CASES)
def test_pool_gives_the_dataloaders_batches_bit_for_bit(dtd_root_shared, pipeline, seed, cache):
    """Training (shuffled, drop_last, decoded-image cache), test, and the data-parallel sharded
    batch sampler: the same batches, in the same order, to the last bit, and the same draws
    from the parent's generator; unseeded (SEED -1) too, as the workers are seeded as
    DataLoader's. The cache decoded in a packed worker is in shared memory (not copied for the
    run); one decoded before is copied once. The pooled loaders fork nothing after the pool."""
    clear_process_store()
    cfg = loader_cfg(dtd_root_shared, pipeline, seed)

    def build():
        dm = DataManager(cfg)
        dm.cache_training_images()
        assert dm.train_loader_x.dataset.images, "the decoded-image cache is under test"
        wrapper = dm.train_loader_x.dataset
        shard = ShardedBatchSampler(EpochSampler(len(wrapper), True, 3), 8, True, 1, world=3)
        return dm, wp.PooledLoader(wrapper, batch_size=1, batch_sampler=shard, num_workers=2)

    dm, sharded = build()
    before, rng_before = passes(dm, sharded)  # DataLoader's workers: not in a packed worker
    assert wp.current_pool() is None
    for loader in (dm.train_loader_x, dm.test_loader, sharded):
        shutdown_loader(loader)

    wp.activate()
    if cache == "shared":  # built in the packed worker: decoded into shared memory
        clear_process_store()
        dm, sharded = build()
        at_fork = [shm_mappings(pid) for pid in wp.current_pool().pids()]
    after, rng_after = passes(dm, sharded)
    pool = wp.current_pool()
    assert pool is not None and dm.train_loader_x._pool_refused is None
    assert {dm.train_loader_x._pool_key, dm.test_loader._pool_key} <= set(pool.registered)
    images, pack = pool.packs[dm.train_loader_x._pool_key]
    assert len(pack) == len(images) and (pack.copied == 0) == (cache == "shared")
    assert_same_batches(before, after)
    assert torch.equal(rng_before, rng_after)
    # a second pass: no process forked, the same batches again
    children = {p.pid for p in multiprocessing.active_children()}
    again, _ = passes(dm, sharded)
    assert {p.pid for p in multiprocessing.active_children()} == children
    assert set(pool.pids()) == children
    if seed != "-1":
        assert_same_batches(before, again)
    # the end of the run: the workers map none of its shared memory any more
    wp.release_all()
    assert all(s["datasets"] == 0 for s in pool.stats())
    if cache == "shared":
        now = [shm_mappings(pid) for pid in pool.pids()]
        assert now == at_fork


class FailingWrapper(DatasetWrapper):
    """Item 5 cannot be made (a module-level class: the pool pickles it)."""

    def __getitem__(self, key):
        idx = key[0] if isinstance(key, tuple) else key
        if idx == 5:
            raise ValueError("item 5 is broken on purpose")
        return super().__getitem__(key)


def test_failures_reach_the_run_and_leave_nothing_stale(dtd_root_shared):
    """An exception in a worker reaches the iteration with the worker's traceback and the pool
    serves the next iteration; an abandoned iteration (a failed or killed run) leaves no batch
    for the next one; the end of a run drops every dataset from the workers."""
    cfg = loader_cfg(dtd_root_shared, "pil", "2", "DATALOADER.NUM_WORKERS", "2")
    dm = DataManager(cfg)
    items, tfm = dm.test_loader.dataset.data_source, dm.tfm_test
    wp.activate()
    failing = wp.PooledLoader(FailingWrapper(cfg, items, tfm), batch_size=2, num_workers=2)
    with pytest.raises(ValueError, match="item 5 is broken on purpose") as info:
        list(failing)
    message = str(info.value)
    assert "in loader pool worker" in message and "Traceback" in message
    assert "FailingWrapper" in message or "__getitem__" in message
    pool = wp.current_pool()
    wp.deactivate()
    expected = list(dm.test_loader)  # DataLoader's batches
    shutdown_loader(dm.test_loader)
    wp.activate()
    assert_same_batches(expected, list(dm.test_loader))
    assert wp.current_pool() is pool and not pool.broken

    # abandoned after one batch, then another iteration: its own batches only, in order
    iterator = iter(dm.test_loader)
    next(iterator)
    del iterator
    assert_same_batches(expected, list(dm.test_loader))
    assert not pool.pending
    iterator = iter(failing)  # a run killed mid-epoch: its iteration is still open
    next(iterator)
    wp.release_all()  # the end of the run (shutdown_loaders between a worker's runs)
    assert all(s["datasets"] == 0 for s in pool.stats())
    assert not pool.pending and not pool.registered
    assert_same_batches(expected, list(dm.test_loader))  # sent again: the next run's use


def test_dead_worker_count_change_and_exit_leave_no_processes(dtd_root_shared):
    """A worker killed mid-iteration: the iteration fails with a clear error and the next one
    runs on a new pool; a different NUM_WORKERS builds a new pool; the old workers are joined
    (no zombie), and shutdown_pool stops the last ones."""
    dm = DataManager(loader_cfg(dtd_root_shared))
    wp.deactivate()
    expected = list(dm.test_loader)
    shutdown_loader(dm.test_loader)
    wp.activate()
    assert_same_batches(expected, list(dm.test_loader))
    first = wp.current_pool()
    old = first.pids()
    os.kill(old[0], signal.SIGKILL)
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        list(dm.test_loader)
    assert_same_batches(expected, list(dm.test_loader))
    second = wp.current_pool()
    assert second is not first and not set(second.pids()) & set(old)
    assert not any(alive(pid) for pid in old)

    three = DataManager(loader_cfg(dtd_root_shared, "pil", "2", "DATALOADER.NUM_WORKERS", "3"))
    assert_same_batches(expected, list(three.test_loader))
    third = wp.current_pool()
    assert third.num_workers == 3 and not any(alive(pid) for pid in second.pids())
    wp.shutdown_pool()
    assert not any(alive(pid) for pid in third.pids())


def test_unpicklable_dataset_and_own_dataloaders_keep_working(dtd_root_shared):
    """A Dassl-style trainer file's loader whose dataset cannot be pickled (a lambda transform)
    falls back to DataLoader's own workers; a DataLoader a trainer builds itself works beside
    the pool."""
    cfg = loader_cfg(dtd_root_shared)
    dm = DataManager(cfg)
    items = dm.test_loader.dataset.data_source
    wp.activate()
    tfm = dm.tfm_test
    loader = wp.PooledLoader(
        DatasetWrapper(cfg, items, lambda img: tfm(img)), batch_size=16, num_workers=2
    )
    own = DataLoader(DatasetWrapper(cfg, items, tfm), batch_size=16, num_workers=2)
    expected = list(dm.test_loader)
    assert_same_batches(expected, list(loader))
    assert "cannot be sent" in loader._pool_refused and "lambda" in loader._pool_refused
    assert_same_batches(expected, list(own))


def test_a_cache_larger_than_the_shared_memory_uses_dataloaders_workers(
    dtd_root_shared, monkeypatch
):
    """A /dev/shm without room (a container's default is 64 MB): the images stay private and
    the training loader forks its own workers, with the same batches."""
    from engine.data import image_cache

    clear_process_store()
    cfg = loader_cfg(dtd_root_shared)
    dm = DataManager(cfg)
    dm.cache_training_images()
    expected = list(dm.train_loader_x)
    shutdown_loader(dm.train_loader_x)
    clear_process_store()
    monkeypatch.setattr(image_cache, "shm_free", lambda: 0)
    monkeypatch.setattr(wp, "shm_free", lambda: 0)
    wp.activate()
    dm = DataManager(cfg)
    dm.cache_training_images()
    images = dm.train_loader_x.dataset.images.tensors().values()
    assert images and not any(t.untyped_storage().is_shared() for t in images)
    assert_same_batches(expected, list(dm.train_loader_x))
    assert "do not fit /dev/shm" in dm.train_loader_x._pool_refused
    assert_same_batches(list(dm.test_loader), list(dm.test_loader))  # no images: the pool
    assert dm.test_loader._pool_key in wp.current_pool().registered


class PrintingWrapper(DatasetWrapper):
    """Writes to file descriptor 2 from the worker (as a warning or a C library would; pytest
    replaces sys.stderr, not the descriptor)."""

    def __getitem__(self, key):
        os.write(2, f"making item {key} of {self.cfg.OUTPUT_DIR}\n".encode())
        return super().__getitem__(key)


def test_kept_workers_write_to_the_current_runs_console(dtd_root_shared, tmp_path):
    """A worker's own output goes where the run's does (a packed worker's console file per
    run, engine.runner.output_to), not to the console of the run that forked the pool."""
    from engine.runner import output_to

    wp.activate()
    for run in ("first", "second"):
        cfg = loader_cfg(dtd_root_shared, "pil", "2", "OUTPUT_DIR", run)
        dm = DataManager(cfg)
        items = dm.test_loader.dataset.data_source[:4]
        wrapper = PrintingWrapper(cfg, items, dm.tfm_test)
        loader = wp.PooledLoader(wrapper, batch_size=2, num_workers=2)
        with output_to(str(tmp_path / f"{run}.txt")):
            list(loader)
    first, second = (open(tmp_path / f"{r}.txt").read() for r in ("first", "second"))
    assert first.count("of first") == 4 and second.count("of second") == 4
    assert "second" not in first


def pool_pids(log: str) -> list[int]:
    found = re.findall(r"Loader worker pool: \d+ processes \(pids ([\d ]+)\)", log)
    return [int(p) for line in found for p in line.split()]


@pytest.mark.slow
def test_packed_worker_forks_its_loader_workers_once(dtd_root, tiny_clip_opts, tmp_path):
    """A packed worker (tools/worker.py: engine.runner.serve and run_packed) runs three CoOp
    runs with DATALOADER.NUM_WORKERS 2: the first forks the pool, the others reuse it; the
    second run's folder is that of a train.py process (DataLoader's workers) bit for bit; the
    workers are gone when the worker process exits."""
    from test_packed_runs import assert_same_runs

    read_fd, write_fd = os.pipe()
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.worker", "--reply-fd", str(write_fd)],
        stdin=subprocess.PIPE, text=True, env=env, cwd=ROOT, pass_fds=(write_fd,),
    )  # fmt: skip
    os.close(write_fd)
    outs = [str(tmp_path / "packed" / f"run{k}") for k in range(3)]

    def argv(seed: int, out: str) -> list[str]:
        return [
            "--root", dtd_root, "--seed", str(seed), "--trainer", "CoOp",
            "--dataset-config-file", osp.join(ROOT, "configs/datasets/dtd.yaml"),
            "--output-dir", out, *tiny_clip_opts, "OPTIM.MAX_EPOCH", "2",
            "DATASET.NUM_SHOTS", "2", "DATALOADER.NUM_WORKERS", "2",
            "DATALOADER.TRAIN_X.BATCH_SIZE", "4", "TEST.FEATURE_CACHE", "False",
        ]  # fmt: skip

    with os.fdopen(read_fd) as replies:
        for k, out in enumerate(outs):
            request = {"argv": argv(k + 1, out), "console": str(tmp_path / f"console{k}.txt")}
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            assert json.loads(replies.readline()) == {"rc": 0}, open(request["console"]).read()
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    logs = []
    for out in outs:
        with open(osp.join(out, "log.txt")) as f:
            logs.append(f.read())
        assert "* accuracy" in logs[-1]
    pids = pool_pids(logs[0])
    assert len(pids) == 2 and not pool_pids(logs[1]) and not pool_pids(logs[2])
    assert not any(alive(pid) for pid in pids)
    reference = str(tmp_path / "process" / "run1")
    run_train(argv(2, reference))
    assert_same_runs(outs[1], reference)
