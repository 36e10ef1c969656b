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
"""

from __future__ import annotations

import contextlib
import json
import os
import os.path as osp
import statistics
import tempfile
import time


def packed_gaps(device: str = "cpu", runs: int = 4, workers=(0, 4), epochs: int = 1) -> dict:
    """Consecutive CoOp runs (experiments.benchmark_runs.run_argv: the tiny CLIP on CPU) in this
    process, once per loader worker count; the gaps between them and the phases of the next
    run's start-up (medians over the runs after the first)."""
    import datasets  # noqa: F401  (registers the readers, as the worker does)
    import trainers  # noqa: F401  (registers the trainers, as the worker does)
    from engine import phases
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
        for n_workers in workers:
            marks["first_step"].clear()
            marks["end"].clear()
            outs = []
            for k in range(runs):
                out = osp.join(tmp, f"w{n_workers}", f"run{k}")
                outs.append(out)
                argv = run_argv(root, out, device, k + 1, epochs, n_workers)
                with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
                    if run_packed(argv, k) != 0:  # as the worker's serve() runs them
                        raise RuntimeError(f"run {k} failed: {argv}")
            gaps = [marks["first_step"][k + 1] - marks["end"][k] for k in range(runs - 1)]
            startups = []
            for out in outs[1:]:
                with open(osp.join(out, "cost.json")) as f:
                    startups.append(json.load(f)["startup"])
            names = list(startups[0]["phases"])
            # the fixed cost: the gap without the next run's first step itself (its compute)
            fixed = [g - s["phases"].get("first step", 0.0) for g, s in zip(gaps, startups)]
            result["settings"][f"{n_workers} loader workers"] = {
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
    finally:
        phases.first_step_done, phases.run_ended = first_step_done, run_ended
    result["target_s"] = 1.0
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
    print(f"  target: <= {result['target_s']:.0f} s without the step itself")
