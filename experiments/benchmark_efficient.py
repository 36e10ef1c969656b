"""The cheaper sharpness-aware optimizers' step cost relative to SGD (``--efficient`` of
``tools/benchmark.py``; docs/efficient-sharpness.md)::

    python tools/benchmark.py --efficient --small --json e.json  # LookSAM, ESAM, SAF, ... vs SGD
"""

from __future__ import annotations

import logging
import os
import os.path as osp
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from engine.compile import CHECKED_CALLS
from experiments.benchmark_steps import (
    Settings,
    bench_cfg,
    build,
    class_names,
    device_description,
    make_settings,
    release,
    synthetic_batch,
    write_json,
)
from experiments.paper_results import EFFICIENT_OPTIMIZERS

logger = logging.getLogger("benchmark")

# docs/efficient-sharpness.md. Every optimizer of EFFICIENT_OPTIMIZERS is timed against the
# trainer's SGD step in one process, interleaved (efficient_measure: wall and process-CPU time;
# --steps rounds after --warmup), on the trainer's base-to-new config (its published batch) with its
# configs/optim/<trainer>/<name>.yaml. A timed call is EFFICIENT_STEPS_PER_CALL
# consecutive steps (one period of the k = 5 lookahead, so LookSAM and SAMPLe-k5 are timed over
# their ascent and the steps between); SAF/MESA's trajectory term is on from the first step
# (OPTIM.SAM.TRAJ_START -1: from the first epoch; SAF at an epoch with records E epochs back:
# the KL is computed).
EFFICIENT_TRAINERS = ("CoOp", "CoCoOp", "MaPLe")
EFFICIENT_STEPS_PER_CALL = 5
EFFICIENT_CLASSES = 50  # base half of a typical dataset, whatever --small
# the targets on CPU, CoOp at its published batch: step / SGD step <= bound
EFFICIENT_TARGETS = {
    "looksam": 1.3,
    "sample_k5": 1.3,
    "saf": 1.15,
    "mesa": 1.15,
    "rwp": 1.15,
    "esam": 1.6,
}


def efficient_steps_fn(tr, batch, last: dict, n: int) -> Callable[[], None]:
    """``n`` consecutive training steps of ``tr`` on ``batch`` (one timed call)."""

    def run():
        for _ in range(n):
            last["out"] = tr.forward_backward(batch)
            tr.batch_idx += 1

    return run


def efficient_measure(
    fns: dict[str, Callable[[], None]], rounds: int, warmup: int, cuda: bool
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and process-CPU seconds of each call of ``fns``, ``rounds`` interleaved rounds after
    ``warmup`` untimed ones. The CPU time of a one-thread process counts only the time it ran,
    so it is the stable measure on a shared CPU (descheduled time inflates the wall time)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            if cuda:
                torch.cuda.synchronize()
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            if cuda:
                torch.cuda.synchronize()
            wall[k].append(time.perf_counter() - w0)
            cpu[k].append(time.process_time() - c0)
    return wall, cpu


def efficient_costs_of(trainer: str, s: Settings, tmp: str) -> list[dict]:
    """The rows of one trainer: each optimizer's step against the SGD step, interleaved."""
    names = class_names(EFFICIENT_CLASSES)
    fns, built, last = {}, [], {}
    for optim_name in EFFICIENT_OPTIMIZERS:
        out = osp.join(tmp, "out", "efficient", trainer, optim_name)
        cfg = bench_cfg(trainer, optim_name, s, None, out, "OPTIM.SAM.TRAJ_START", "-1")
        tr = build(cfg, names)
        if optim_name == "saf":  # records from E epochs back exist: the KL term is computed
            tr.epoch = max(tr.epoch, cfg.OPTIM.SAM.EPOCHS_BACK)
        batch = synthetic_batch(cfg, len(names), s.device)
        batch["index"] = torch.arange(len(batch["label"]))  # SAF keys its records by item
        fns[optim_name] = efficient_steps_fn(tr, batch, last, EFFICIENT_STEPS_PER_CALL)
        built.append((optim_name, cfg, tr))
    settle = CHECKED_CALLS if any(tr.compile_mode for _, _, tr in built) else 0
    wall, cpu = efficient_measure(fns, s.steps, s.warmup + settle, s.device == "cuda")
    release(*(tr for _, _, tr in built))
    med = {k: statistics.median(v) for k, v in wall.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    on_cpu = s.device == "cpu"
    rows = []
    for optim_name, cfg, tr in built:
        ratio = med[optim_name] / med["sgd"]
        cpu_ratio = cpu_med[optim_name] / cpu_med["sgd"]
        judged = cpu_ratio if on_cpu else ratio
        bound = EFFICIENT_TARGETS.get(optim_name) if trainer == "CoOp" else None
        rows.append(
            {
                "trainer": trainer,
                "optimizer": optim_name,
                "base_optimizer": cfg.OPTIM.NAME,
                "prec": tr.prec,
                "batch": cfg.DATALOADER.TRAIN_X.BATCH_SIZE,
                "classes": len(names),
                "step_ms": 1e3 * med[optim_name] / EFFICIENT_STEPS_PER_CALL,
                "ratio_vs_sgd": ratio,
                "min_ratio_vs_sgd": min(wall[optim_name]) / min(wall["sgd"]),
                "cpu_ratio_vs_sgd": cpu_ratio if on_cpu else None,
                "target": bound,
                "meets_target": None if bound is None else judged <= bound,
                "timed_calls": len(wall[optim_name]),
            }
        )
    logger.info(
        "%s: %s", trainer, ", ".join(f"{r['optimizer']} {r['ratio_vs_sgd']:.2f}x" for r in rows)
    )
    return rows


def efficient_costs(args) -> dict:
    """``--efficient``: the step cost of every cheaper optimizer relative to SGD per trainer."""
    import trainers  # noqa: F401

    tmp = tempfile.mkdtemp(prefix="sample-pl-bench-")
    try:
        s = make_settings(args, tmp)
        result = {
            "device": device_description(s.device),
            "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "small_clip": s.small,
            "steps_per_call": EFFICIENT_STEPS_PER_CALL,
            "timed_calls": s.steps,
            "judged_by": "cpu_ratio_vs_sgd" if s.device == "cpu" else "ratio_vs_sgd",
            "targets": {k: f"CoOp step / SGD step <= {v}" for k, v in EFFICIENT_TARGETS.items()},
            "rows": [],
        }
        for trainer in args.efficient_trainers.split(","):
            result["rows"] += efficient_costs_of(trainer, s, tmp)
            if args.json:
                write_json(args.json, result)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def print_efficient_costs(result: dict) -> None:
    cpu = result["judged_by"] == "cpu_ratio_vs_sgd"
    print(
        f"\nStep cost relative to SGD ({result['device']}; a timed call = "
        f"{result['steps_per_call']} steps; medians of {result['timed_calls']} interleaved calls; "
        f"targets judged by the {'process CPU time' if cpu else 'wall time'})"
    )
    head = f"{'trainer':<8} {'optimizer':<10} {'batch':>5} {'step ms':>9} {'x SGD':>6}"
    print(head + (f" {'x SGD cpu':>9}" if cpu else "") + "  target")
    for r in result["rows"]:
        target = "" if r["target"] is None else f"<= {r['target']}"
        status = "" if r["meets_target"] is None else (" met" if r["meets_target"] else " MISSED")
        line = f"{r['trainer']:<8} {r['optimizer']:<10} {r['batch']:>5} {r['step_ms']:>9.1f} "
        line += f"{r['ratio_vs_sgd']:>6.2f}"
        if cpu:
            line += f" {r['cpu_ratio_vs_sgd']:>9.2f}"
        print(f"{line}  {target}{status}")
