"""The fixed cost of a run in a packed worker (``tools/benchmark.py --packed-gap``): the time from
one training run's end to the end of the next run's first training step, in one long-lived
process that runs them one after another as a ``tools/grid.py --in-process`` worker does
(:func:`engine.runner.run_packed`, with the caches of :func:`engine.runner.enable_run_caches`).

A run's end is the moment its result is recorded (``engine.phases.run_ended``: after its final
test, ``cost.json`` written); the gap holds the rest of that run (closing its log, collecting its
objects, stopping its loader workers) and the next run's start-up up to the end of its first step
(config, dataset, model build, loader workers, first batch, the step itself), whose phases its
``cost.json`` breaks down; ``fixed_s`` leaves out the first step itself (its phase ``first
step``: the step's compute, which every step costs). Not in the gap: the grid's own bookkeeping
and the one-line request over the worker's pipe (milliseconds).

With loader workers it measures both ways of a packed worker: the loader worker processes kept
for all its runs (engine/data/worker_pool.py, the default there) and a DataLoader forking and
joining them in every run (before the pool; ``worker_pool.allow(False)``), and the kept
workers' own memory (not shared with the parent) after each run.
"""

from __future__ import annotations

import contextlib
import json
import os
import os.path as osp
import statistics
import tempfile
import time

# (loader workers, kept across runs by the worker pool)
SETTINGS = ((0, False), (4, False), (4, True))


def setting_name(n_workers: int, kept: bool) -> str:
    if not n_workers:
        return "0 loader workers"
    how = "kept across runs (pool)" if kept else "forked per run (DataLoader)"
    return f"{n_workers} loader workers, {how}"


def packed_gaps(device: str = "cpu", runs: int = 4, settings=SETTINGS, epochs: int = 1) -> dict:
    """Consecutive CoOp runs (experiments.benchmark_runs.run_argv: the tiny CLIP on CPU) in this
    process, once per setting (loader workers, whether the worker pool keeps them); the gaps
    between them and the phases of the next run's start-up (medians over the runs after the
    first)."""
    import datasets  # noqa: F401  (registers the readers, as the worker does)
    import trainers  # noqa: F401  (registers the trainers, as the worker does)
    from engine import phases
    from engine.data import worker_pool
    from engine.runner import enable_run_caches, run_packed
    from experiments.benchmark_runs import make_run_data, run_argv
    from experiments.benchmark_steps import device_description

    tmp = tempfile.mkdtemp(prefix="packed-gap-")
    root = osp.join(tmp, "data")
    make_run_data(root, device)
    enable_run_caches()  # as the worker's serve() does
    marks: dict[str, list[float]] = {"first_step": [], "end": []}
    first_step_done, run_ended = phases.first_step_done, phases.run_ended

    def on_first_step(*args, **kwargs):
        result = first_step_done(*args, **kwargs)
        if result is not None:
            marks["first_step"].append(time.perf_counter())
        return result

    def on_end(*args, **kwargs):
        wall = run_ended(*args, **kwargs)
        marks["end"].append(time.perf_counter())
        return wall

    result = {"device": device_description(device), "runs_per_setting": runs, "settings": {}}
    phases.first_step_done, phases.run_ended = on_first_step, on_end
    try:
        for n_workers, kept in settings:
            marks["first_step"].clear()
            marks["end"].clear()
            outs, rss, asked = [], [], [0.0] * runs  # asked: the memory query, not in the gap
            worker_pool.allow(kept)
            for k in range(runs):
                out = osp.join(tmp, f"w{n_workers}{'k' if kept else ''}", f"run{k}")
                outs.append(out)
                argv = run_argv(root, out, device, k + 1, epochs, n_workers)
                with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
                    if run_packed(argv, k) != 0:  # as the worker's serve() runs them
                        raise RuntimeError(f"run {k} failed: {argv}")
                pool = worker_pool.current_pool()
                if kept and pool is not None:
                    t = time.perf_counter()
                    rss.append([round(s["private_bytes"] / 2**20, 1) for s in pool.stats()])
                    asked[k] = time.perf_counter() - t
            worker_pool.shutdown_pool()
            worker_pool.allow(True)
            gaps = [
                marks["first_step"][k + 1] - marks["end"][k] - asked[k] for k in range(runs - 1)
            ]
            startups = []
            for out in outs[1:]:
                with open(osp.join(out, "cost.json")) as f:
                    startups.append(json.load(f)["startup"])
            names = list(startups[0]["phases"])
            # the fixed cost: the gap without the next run's first step itself (its compute)
            fixed = [g - s["phases"].get("first step", 0.0) for g, s in zip(gaps, startups)]
            row = result["settings"][setting_name(n_workers, kept)] = {
                "gaps_s": [round(g, 3) for g in gaps],
                "median_gap_s": round(statistics.median(gaps), 3),
                "fixed_s": [round(f, 3) for f in fixed],
                "median_fixed_s": round(statistics.median(fixed), 3),
                "median_time_to_first_step_s": round(
                    statistics.median(s["time_to_first_step_s"] for s in startups), 3
                ),
                "median_phases_s": {
                    n: round(statistics.median(s["phases"].get(n, 0.0) for s in startups), 3)
                    for n in names
                },
            }
            if rss:  # after each run: memory held by the kept workers must not grow
                row["pool_worker_private_mb_after_each_run"] = rss
    finally:
        phases.first_step_done, phases.run_ended = first_step_done, run_ended
    result["target_s"] = 1.0
    result["cache_handoff"] = cache_handoff()
    return result


def print_packed_gaps(result: dict) -> None:
    print(f"Packed worker, from one run's end to the next run's first step ({result['device']}):")
    for name, row in result["settings"].items():
        top = sorted(row["median_phases_s"].items(), key=lambda kv: -kv[1])[:4]
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in top)
        print(
            f"  {name}: median {row['median_gap_s']:.2f} s (gaps {row['gaps_s']}); without the "
            f"first step's own compute {row['median_fixed_s']:.2f} s ({row['fixed_s']}); {parts}"
        )
        if "pool_worker_private_mb_after_each_run" in row:
            rss = [max(r) for r in row["pool_worker_private_mb_after_each_run"]]
            print(f"    kept workers' own memory after each run (largest, MB): {rss}")
    print(f"  target: <= {result['target_s']:.0f} s without the step itself")
    hand = result.get("cache_handoff")
    if hand:
        print(
            f"Decoded-image cache to kept workers, per run ({hand['images']} 500x375 images, "
            f"{hand['workers']} workers): "
            + "; ".join(
                f"{mode}: {hand[mode]['handoff_per_run_s']:.3f} s, "
                f"{hand[mode]['copied_per_run_mb']} MB copied (decoding {hand[mode]['decode_s']} s)"
                for mode in ("private", "shared blocks")
            )
        )


def cache_handoff(images: int = 200, workers: int = 4) -> dict:
    """How a run's decoded-image cache reaches loader workers kept from earlier runs (forked
    before it was decoded), on ``images`` 500x375 JPEGs: decoding the cache privately (a
    ``train.py`` process) or into shared-memory blocks (a packed worker,
    engine/data/image_cache.to_shared), and per run the hand-off to the workers
    (worker_pool.SharedImages.pack and pickling one copy per worker): a copy of the private
    cache into a new block, or the handles of the blocks the images already live in."""
    import numpy as np
    from PIL import Image

    from engine.config import get_cfg_default
    from engine.data import worker_pool
    from engine.data.base import Datum
    from engine.data.image_cache import DecodedImageCache, clear_process_store
    from engine.data.worker_pool import ForkingPickler, SharedImages

    folder = tempfile.mkdtemp(prefix="cache-handoff-")
    rng = np.random.default_rng(0)
    items = []
    for i in range(images):
        low = rng.integers(0, 255, (6, 8, 3), dtype=np.uint8)
        img = Image.fromarray(low).resize((500, 375), Image.BICUBIC)
        path = osp.join(folder, f"{i}.jpg")
        img.save(path, quality=90)
        items.append(Datum(path, 0, 0, "x"))
    cfg = get_cfg_default()
    result = {"images": images, "workers": workers}
    for mode, active in (("private", False), ("shared blocks", True)):
        clear_process_store()
        (worker_pool.activate if active else worker_pool.deactivate)()
        t = time.perf_counter()
        cache = DecodedImageCache.build(cfg, items)
        decode = time.perf_counter() - t
        worker_pool.deactivate()
        hand = []
        for _ in range(3):
            t = time.perf_counter()
            pack = SharedImages.pack(cache)
            for _ in range(workers):
                ForkingPickler.dumps(pack)
            hand.append(time.perf_counter() - t)
            del pack
        result[mode] = {
            "cache_mb": round(cache.nbytes / 2**20, 1),
            "decode_s": round(decode, 3),
            "handoff_per_run_s": round(min(hand), 4),
            "copied_per_run_mb": round(SharedImages.pack(cache).copied / 2**20, 1),
        }
    clear_process_store()
    return result
