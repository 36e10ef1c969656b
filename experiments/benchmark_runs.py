"""Whole-run costs (``tools/benchmark.py --runs``): the fixed cost of a ``train.py`` run as a
process and in-process, runs per process with several in-process workers, and the paper grid's
device-hours estimate from them.

The runs are CoOp base-class runs on a generated dataset: on CPU with the tiny CLIP, on a GPU
with a random-weight ViT-B/16 in fp16. Phases are read from the engine's own log lines
(:func:`mark_line`): start to first logged step, the steps, the evaluation, result line to exit,
and the compiled encoders' first calls.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import os.path as osp
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from types import SimpleNamespace

from experiments import ROOT
from experiments.benchmark_steps import device_description

# -- whole runs: fixed cost, runs per process, the paper grid's GPU-hours (--runs) -------------
# The released code's costs as the issue measured them on one H200 (fp16 CoOp, random ViT-B/16,
# batch 32): SGD step ~30 ms, the SAMPLe step 1.6x its SGD step, ~20 s of fixed cost per run
# (start-up and shutdown). Not measured here: the anchors of the released-code estimate.
RELEASED = {"fixed_s": 20.0, "sgd_step_ms": 30.0, "two_pass_ratio": 1.6}
TWO_PASS = ("sam", "fsam", "sagm", "sample")
# classes of the paper's datasets (base = the first half, rounded up, as Dassl subsamples)
DATASET_CLASSES = {
    "imagenet": 1000,
    "caltech101": 100,
    "oxford_pets": 37,
    "stanford_cars": 196,
    "oxford_flowers": 102,
    "food101": 101,
    "fgvc_aircraft": 100,
    "sun397": 397,
    "dtd": 47,
    "eurosat": 10,
    "ucf101": 101,
}


def run_argv(root: str, out: str, device: str, seed: int, epochs: int, workers: int, opts=()):
    """train.py arguments of one CoOp base-class run on the generated dataset under ``root``
    (CPU: the tiny CLIP written there; CUDA: a random-weight ViT-B/16 in fp16), with the
    config options ``opts`` last."""
    argv = ["--root", root, "--seed", str(seed), "--trainer", "CoOp", "--output-dir", out]
    argv += ["--dataset-config-file", osp.join(ROOT, "configs/datasets/dtd.yaml")]
    argv += ["--config-file", osp.join(ROOT, "configs/trainers/CoOp/vit_b16_ctxv1.yaml")]
    if device == "cpu":
        argv += ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", osp.join(root, "clip.json")]
        argv += ["MODEL.BACKBONE.PATH", osp.join(root, "clip.pt"), "INPUT.SIZE", "(32, 32)"]
        argv += ["TRAINER.COOP.PREC", "fp32", "USE_CUDA", "False"]
    else:
        argv += ["MODEL.BACKBONE.NAME", "ViT-B/16", "MODEL.BACKBONE.PRETRAINED", "False"]
    argv += ["DATASET.NUM_SHOTS", "8", "DATASET.SUBSAMPLE_CLASSES", "base", "OPTIM.MAX_EPOCH"]
    argv += [str(epochs), "TRAIN.PRINT_FREQ", "1", "DATALOADER.NUM_WORKERS", str(workers)]
    return argv + ["TEST.FEATURE_CACHE", "False", *opts]


def make_run_data(root: str, device: str) -> None:
    from datasets.synthetic import DTD_CLASSES, make_image_folder
    from engine.clip.toy import TINY_CLIP_CONFIG, write_tiny_clip

    size = 40 if device == "cpu" else 256
    make_image_folder(osp.join(root, "dtd", "images"), DTD_CLASSES, per_class=16, size=size)
    if device == "cpu":
        cfg_path, ckpt = write_tiny_clip(osp.join(root, "tiny"), TINY_CLIP_CONFIG)
        os.replace(cfg_path, osp.join(root, "clip.json"))
        os.replace(ckpt, osp.join(root, "clip.pt"))


def phases(marks: dict, end: float) -> dict:
    """Seconds from the start to the first logged step, of the steps, of the evaluation and
    from the result line to the end of the run (``marks``: times of the log lines), and the
    first calls of compiled encoders (compilation included; part of the first step)."""
    first, last = marks.get("first_step", end), marks.get("last_step", end)
    result = marks.get("result", end)
    return {
        "to_first_step_s": round(first, 3),
        "steps_s": round(last - first, 3),
        "eval_s": round(result - last, 3),
        "exit_s": round(end - result, 3),
        "wall_s": round(end, 3),
        "compile_s": round(marks.get("compile_s", 0.0), 3),
    }


def mark_line(marks: dict, line: str, now: float) -> None:
    if line.startswith("epoch ["):
        marks.setdefault("first_step", now)
        marks["last_step"] = now
    elif line.startswith("* accuracy"):
        marks["result"] = now
    elif line.startswith("torch.compile (") and ": first call " in line:
        seconds = float(line.split(": first call ", 1)[1].split(" s", 1)[0])
        marks["compile_s"] = marks.get("compile_s", 0.0) + seconds


def process_run(argv: list[str], root: str = ROOT) -> dict:
    """One ``train.py`` process (of the code under ``root``), timed from its start to its exit
    by its output lines."""
    import subprocess

    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=root)
    t0 = time.perf_counter()
    cmd = [sys.executable, osp.join(root, "train.py"), *argv]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    marks: dict = {}
    for line in proc.stdout:
        mark_line(marks, line, time.perf_counter() - t0)
    if proc.wait() != 0:
        raise RuntimeError(f"train.py exited with {proc.returncode}: {shlex_join(cmd)}")
    return phases(marks, time.perf_counter() - t0)


def shlex_join(cmd: list[str]) -> str:
    import shlex

    return shlex.join(cmd)


class _Marks(logging.Handler):
    """Times of the engine's log lines in this process (the in-process runs)."""

    def __init__(self):
        super().__init__()
        self.t0 = time.perf_counter()
        self.marks: dict = {}

    def emit(self, record):
        mark_line(self.marks, record.getMessage(), time.perf_counter() - self.t0)


def in_process_run(argv: list[str]) -> dict:
    """One run in this process after others (imports paid, CLIP checkpoint cached), timed from
    the call to its return (log handlers closed, loader workers stopped)."""
    from engine.runner import run_in_process

    handler = _Marks()
    logging.getLogger().addHandler(handler)
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
            rc = run_in_process(argv)
    finally:
        logging.getLogger().removeHandler(handler)
    if rc != 0:
        raise RuntimeError(f"in-process run exited with {rc}: {shlex_join(argv)}")
    return phases(handler.marks, time.perf_counter() - handler.t0)


def packed_wall(runs: list[list[str]], workers: int) -> float:
    """Seconds for ``runs`` on ``workers`` in-process workers (engine/runner.py), each taking
    the next run when it finishes one (as tools/grid.py --in-process --workers N)."""
    import threading
    from queue import Empty, Queue

    from experiments.worker import Worker

    queue: Queue = Queue()
    for argv in runs:
        queue.put(argv)
    codes: list[int] = []

    def work() -> None:
        worker = Worker()
        try:
            while True:
                try:
                    argv = queue.get_nowait()
                except Empty:
                    return
                codes.append(worker.run(argv, console=os.devnull))
        finally:
            worker.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(codes):
        raise RuntimeError(f"packed runs failed: exit codes {codes}")
    return time.perf_counter() - t0


def grid_training_steps() -> list[tuple[str, str, int]]:
    """``(stage, optimizer, optimizer steps)`` of every run of ``tools/grid.py --preset paper``
    (evaluations: 0 steps), from the runs' merged configs and the datasets' class counts."""
    from engine.cli import build_parser, setup_cfg
    from experiments.grid_plan import expand, repro_modes, select
    from experiments.protocols import Setup

    args = SimpleNamespace(preset="paper", repro=None)
    setup = Setup(data="DATA", repro=repro_modes(args)[0])
    runs, cache = [], {}
    for chain in expand(select("paper"), setup):
        train = chain.train
        key = (train.trainer, train.cfg, train.optim, train.dataset, train.protocol)
        if key not in cache:
            cfg = setup_cfg(build_parser().parse_args(train.command(setup)[2:]))
            n = DATASET_CLASSES.get(train.dataset, 1000)
            n = math.ceil(n / 2) if cfg.DATASET.SUBSAMPLE_CLASSES == "base" else n
            images, batch = n * cfg.DATASET.NUM_SHOTS, cfg.DATALOADER.TRAIN_X.BATCH_SIZE
            drop = cfg.DATALOADER.TRAIN_X.DROP_LAST and images >= batch
            per_epoch = images // batch if drop else math.ceil(images / batch)
            epochs = cfg.OPTIM.MAX_EPOCH + max(cfg.OPTIM.SAM.STAGE2_EPOCHS, 0)
            cache[key] = per_epoch * epochs
        runs.append(("train", train.optim, cache[key]))
        runs += [("eval", r.optim, 0) for r in chain.evals]
    return runs


def grid_hours(runs, fixed_s: float, sgd_step_ms: float, two_pass_ratio: float) -> float:
    """Device-hours of ``runs`` at a fixed cost per run and a step time (two-pass optimizers:
    ``two_pass_ratio`` times the SGD step); evaluation images not counted (the same work for
    both code bases, small next to training)."""
    total = 0.0
    for _, optim, steps in runs:
        step = sgd_step_ms * (two_pass_ratio if optim in TWO_PASS else 1.0) / 1000
        total += fixed_s + steps * step
    return total / 3600


def run_costs(args) -> dict:
    """The --runs measurements: per-run phases as a process and in-process, runs per process
    throughput with 1 and N workers, and the paper grid's device-hours estimate."""
    import datasets  # noqa: F401
    import trainers  # noqa: F401

    device, tmp = args.device, tempfile.mkdtemp(prefix="sample-pl-runs-")
    # the runs' caches (compiled graphs, recorded CLIP builds, ...) start empty: the first
    # process is cold, the later ones warm
    saved_cache = os.environ.get("SAMPLE_PL_CACHE")
    os.environ["SAMPLE_PL_CACHE"] = osp.join(tmp, "cache")
    opts = list(getattr(args, "run_opts", None) or [])
    try:
        root = osp.join(tmp, "data")
        make_run_data(root, device)
        workers = args.workers if args.workers is not None else 2
        argv = partial(
            run_argv, root, device=device, epochs=args.run_epochs, workers=workers, opts=opts
        )
        out = partial(osp.join, tmp, "out")
        process = [process_run(argv(out(f"p{i}"), seed=1)) for i in range(args.run_repeats)]
        in_process_run(argv(out("warmup"), seed=1))  # imports and the checkpoint read paid
        inproc = [in_process_run(argv(out(f"i{i}"), seed=1)) for i in range(args.run_repeats)]
        packed = {}
        for n in args.run_workers:
            runs = [argv(out(f"w{n}_{k}"), seed=k + 1) for k in range(args.packed_runs)]
            wall = packed_wall(runs, n)
            packed[str(n)] = {"runs": len(runs), "wall_s": round(wall, 2),
                              "runs_per_hour": round(3600 * len(runs) / wall, 1)}  # fmt: skip
    finally:
        if saved_cache is None:
            os.environ.pop("SAMPLE_PL_CACHE", None)
        else:
            os.environ["SAMPLE_PL_CACHE"] = saved_cache
        shutil.rmtree(tmp, ignore_errors=True)

    def median(rows, key):
        return round(statistics.median(r[key] for r in rows), 3)

    keys = ("to_first_step_s", "steps_s", "eval_s", "exit_s", "wall_s", "compile_s")
    result = {
        "device": device_description(device),
        "process": {k: median(process, k) for k in keys},
        "in_process": {k: median(inproc, k) for k in keys},
        "packed": packed,
        # one by one: the first process with empty caches, the later ones warm; the first
        # in-process run is a packed worker's second run (after the warm-up run)
        "process_runs": [
            {"caches": "cold" if i == 0 else "warm", **r} for i, r in enumerate(process)
        ],
        "in_process_runs": inproc,
    }
    result["run"] = (
        f"CoOp base classes, 8 shots, {args.run_epochs} epochs, {workers} loader workers, "
        + ("tiny CLIP, fp32, CPU" if device == "cpu" else "random ViT-B/16, fp16")
        + (f", {' '.join(opts)}" if opts else "")
    )
    for name in ("process", "in_process"):
        r = result[name]
        r["fixed_s"] = round(r["to_first_step_s"] + r["exit_s"], 3)
    result["grid"] = paper_grid_estimate(result, args)
    return result


def paper_grid_estimate(result: dict, args) -> dict:
    """The paper grid's device-hours: the released code from the issue's anchors (RELEASED),
    this code from ``--step-ms`` (SGD and SAMPLe step on the target device; default: the
    released anchors) and the fixed cost measured here in-process."""
    runs = grid_training_steps()
    steps = sum(s for _, _, s in runs)
    sgd_ms, sample_ms = args.step_ms or (RELEASED["sgd_step_ms"], None)
    ratio = (sample_ms / sgd_ms) if sample_ms else RELEASED["two_pass_ratio"]
    fixed = result["in_process"]["fixed_s"]
    released = grid_hours(runs, RELEASED["fixed_s"], RELEASED["sgd_step_ms"], 1.6)
    ours = grid_hours(runs, fixed, sgd_ms, ratio)
    return {
        "runs": len(runs),
        "training_runs": sum(st == "train" for st, _, _ in runs),
        "optimizer_steps": steps,
        "released_hours": round(released, 1),
        "released_anchors": RELEASED,
        "project_hours": round(ours, 1),
        "project_inputs": {"fixed_s": fixed, "sgd_step_ms": sgd_ms, "two_pass_ratio": ratio},
        "project_over_released": round(ours / released, 3),
    }


def print_run_costs(result: dict) -> None:
    print(f"\nDevice: {result['device']}\nRun: {result['run']}")
    for name in ("process", "in_process"):
        r = result[name]
        print(
            f"{name:>10}: start to first step {r['to_first_step_s']:.2f} s, steps "
            f"{r['steps_s']:.2f} s, evaluation {r['eval_s']:.2f} s, result to end "
            f"{r['exit_s']:.2f} s (fixed {r['fixed_s']:.2f} s, wall {r['wall_s']:.2f} s; "
            f"compiled encoders' first calls {r['compile_s']:.2f} s)"
        )
    for name, rows in (
        ("process", result["process_runs"]),
        ("in-process", result["in_process_runs"]),
    ):
        for i, r in enumerate(rows):
            what = f"{r['caches']} caches" if "caches" in r else f"run {i + 2} of a worker"
            print(
                f"  {name} {i + 1} ({what}): first step at {r['to_first_step_s']:.2f} s, "
                f"compile {r['compile_s']:.2f} s, wall {r['wall_s']:.2f} s"
            )
    for n, p in result["packed"].items():
        print(f"{n} in-process worker(s): {p['runs']} runs in {p['wall_s']:.1f} s, "
              f"{p['runs_per_hour']:.0f} runs/hour")  # fmt: skip
    g = result["grid"]
    print(
        f"Paper grid ({g['runs']} runs, {g['training_runs']} trainings, "
        f"{g['optimizer_steps']:,} steps): released code {g['released_hours']:.1f} GPU-hours "
        f"(the issue's H200 anchors: {RELEASED['fixed_s']:.0f} s per run, SGD step "
        f"{RELEASED['sgd_step_ms']:.0f} ms, two-pass x{RELEASED['two_pass_ratio']}); this code "
        f"{g['project_hours']:.1f} ({g['project_inputs']}) = {g['project_over_released']:.2f}x"
    )
