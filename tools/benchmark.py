"""Performance benchmark: per-step measurements, or whole-run costs with ``--runs``.

The command line of two modules cut along their jobs:

- :mod:`tools.benchmark_steps`: the training step, the evaluation and the data pipeline of the
  registered trainers against the reference style of the original code bases (ratios of the
  issue's targets, one row per trainer x optimizer x precision);
- :mod:`tools.benchmark_runs` (``--runs``): whole ``train.py`` runs (fixed cost as a process and
  in-process, runs per process with several workers, the paper grid's device-hours);
- :mod:`tools.benchmark_memory` (``--memory``): the peak memory of a training step per trainer at
  100 and 1,000 classes, plain and with the text-memory options;
- :mod:`tools.benchmark_efficient` (``--efficient``): the step of the cheaper sharpness-aware
  optimizers (LookSAM, SAMPLe-k, ESAM, RWP, m-RWP, SAF, MESA) relative to SGD;
- :mod:`experiments.benchmark_loader` (``--loader``): images/s per loader worker of the input
  pipelines (``INPUT.PIPELINE`` pil, tensor, tensor_device) and their pixel difference.

Usage::

    python tools/benchmark.py --device cuda --json out.json   # full size (a few minutes on a GPU)
    python tools/benchmark.py --small                          # reduced width, CPU, ~1 minute
    python tools/benchmark.py --device cpu --optims sgd,sample # full size on CPU (~20 minutes)
    python tools/benchmark.py --runs --json runs.json          # whole-run costs
    python tools/benchmark.py --memory --small --device cpu    # peak memory per trainer
    python tools/benchmark.py --efficient --small --json e.json  # LookSAM, ESAM, SAF, ... vs SGD
    python tools/benchmark.py --loader --json loader.json     # INPUT.PIPELINE pil vs tensor
    python tools/benchmark.py --packed-gap                     # a packed worker's gap between runs
    python tools/benchmark.py --startup --json docs/benchmarks/cpu_startup_vitb16.json  # start-up

The public names of both modules are importable from here as before.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

if __package__ in (None, ""):  # run as a script
    import _repo  # noqa: F401

from experiments.benchmark_efficient import (  # noqa: E402
    EFFICIENT_OPTIMIZERS,
    EFFICIENT_STEPS_PER_CALL,
    EFFICIENT_TARGETS,
    EFFICIENT_TRAINERS,
    efficient_costs,
    print_efficient_costs,
)
from experiments.benchmark_memory import (  # noqa: E402
    MEMORY_CHUNK,
    MEMORY_CLASSES,
    MEMORY_TRAINERS,
    MEMORY_VARIANTS,
    memory_report,
    memory_row,
    print_memory_report,
)
from experiments.benchmark_runs import (  # noqa: E402
    DATASET_CLASSES,
    RELEASED,
    TWO_PASS,
    grid_hours,
    grid_training_steps,
    in_process_run,
    make_run_data,
    mark_line,
    packed_wall,
    paper_grid_estimate,
    phases,
    print_run_costs,
    process_run,
    run_argv,
    run_costs,
    shlex_join,
)
from experiments.benchmark_steps import (  # noqa: E402
    DATASET,
    OPTIMIZERS,
    PRECISIONS,
    RELEASED_CLASSES,
    RELEASED_DEVICE,
    RELEASED_STEP_MS,
    SAMPLE_VS_REFERENCE,
    SMALL_CLIP,
    TARGETS,
    TRAINERS,
    Settings,
    Timer,
    Timing,
    bench_cfg,
    build,
    check_finite,
    class_names,
    cocoop_batching,
    compile_seconds,
    coop_parts,
    data_cfg,
    device_description,
    eager_cfg,
    eval_seconds,
    eval_times,
    feature_cache_eval,
    fmt_times,
    imagenet_eval,
    loader_throughput,
    make_jpeg_dataset,
    make_settings,
    measure_trainer,
    on_synthetic_classes,
    peak_mb,
    print_report,
    prompt_length,
    reference_style,
    release,
    resident_bytes,
    run,
    sample_over_sgd,
    step_fn,
    synthetic_batch,
    target_status,
    text_truncation,
    trainer_config_file,
    write_json,
)

__all__ = [
    "RELEASED",
    "TWO_PASS",
    "DATASET_CLASSES",
    "run_argv",
    "make_run_data",
    "phases",
    "mark_line",
    "process_run",
    "shlex_join",
    "in_process_run",
    "packed_wall",
    "grid_training_steps",
    "grid_hours",
    "run_costs",
    "paper_grid_estimate",
    "print_run_costs",
    "TRAINERS",
    "OPTIMIZERS",
    "PRECISIONS",
    "TARGETS",
    "SAMPLE_VS_REFERENCE",
    "DATASET",
    "SMALL_CLIP",
    "class_names",
    "Settings",
    "make_settings",
    "device_description",
    "Timing",
    "Timer",
    "reference_style",
    "on_synthetic_classes",
    "trainer_config_file",
    "bench_cfg",
    "build",
    "eager_cfg",
    "compile_seconds",
    "synthetic_batch",
    "resident_bytes",
    "step_fn",
    "check_finite",
    "eval_times",
    "eval_seconds",
    "measure_trainer",
    "prompt_length",
    "release",
    "peak_mb",
    "coop_parts",
    "fmt_times",
    "RELEASED_STEP_MS",
    "RELEASED_CLASSES",
    "RELEASED_DEVICE",
    "sample_over_sgd",
    "text_truncation",
    "imagenet_eval",
    "cocoop_batching",
    "make_jpeg_dataset",
    "data_cfg",
    "loader_throughput",
    "feature_cache_eval",
    "target_status",
    "print_report",
    "run",
    "write_json",
    "MEMORY_CHUNK",
    "MEMORY_CLASSES",
    "MEMORY_TRAINERS",
    "MEMORY_VARIANTS",
    "memory_report",
    "memory_row",
    "print_memory_report",
    "EFFICIENT_OPTIMIZERS",
    "EFFICIENT_STEPS_PER_CALL",
    "EFFICIENT_TARGETS",
    "EFFICIENT_TRAINERS",
    "efficient_costs",
    "print_efficient_costs",
]

logger = logging.getLogger("benchmark")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=("cpu", "cuda"), default=default_device)
    parser.add_argument("--small", action="store_true", help="reduced-width CLIP, fewer classes")
    parser.add_argument("--json", default="", help="write the results to this JSON file")
    parser.add_argument("--trainers", default=",".join(TRAINERS), help="comma-separated")
    parser.add_argument("--optims", default=",".join(OPTIMIZERS), help="comma-separated")
    parser.add_argument(
        "--precisions",
        default="",
        help="also measure CoOp with SGD and SAMPLe in these precisions (e.g. fp16,amp,bf16,fp32; "
        "every trainer is measured in its own config's precision, fp32 on CPU)",
    )
    parser.add_argument("--steps", type=int, help="timed calls (default: 10 GPU, 3 CPU)")
    parser.add_argument("--warmup", type=int, help="untimed calls first (default: 3 GPU, 0 CPU)")
    parser.add_argument(
        "--budget", type=float, default=30.0, help="seconds after which a group stops repeating"
    )
    parser.add_argument(
        "--eval-images-per-call",
        type=int,
        help="images per model_inference call (default: the test batch on GPU; 10 on CPU, 20 "
        "with --small)",
    )
    parser.add_argument("--workers", type=int, help="loader workers (default: 8 GPU, 0 CPU)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads with --device cpu (default 1: stable timings on a shared machine, "
        "where descheduled OpenMP threads slow small ops down many times; 0: torch's default)",
    )
    parser.add_argument(
        "--compile",
        default="auto",
        help="MODEL.COMPILE of the project's steps (default auto: reduce-overhead on a GPU, off "
        "on CPU; the reference style is always eager; with compilation on, each row also times "
        "the project's step eagerly)",
    )
    parser.add_argument("--verbose", action="store_true", help="the engine's INFO messages too")
    memory = parser.add_argument_group("peak memory (--memory)")
    memory.add_argument(
        "--memory",
        action="store_true",
        help="measure the peak memory of a training step instead: CoOp, KgCoOp, TCP, CoCoOp, "
        "MaPLe and PromptSRC (or --trainers) at --memory-classes, plain, in text chunks of "
        "--memory-chunk classes, in checkpointed chunks (MODEL.TEXT_CHUNK, "
        "MODEL.CHECKPOINT_TEXT), with the shared prompt prefix (MODEL.SHARED_PREFIX) and with "
        "both; each row also has the step's time",
    )
    memory.add_argument(
        "--memory-variants",
        default=",".join(MEMORY_VARIANTS),
        help=f"comma-separated, of {', '.join(MEMORY_VARIANTS)} (default: all)",
    )
    memory.add_argument(
        "--memory-chunk",
        type=int,
        default=MEMORY_CHUNK,
        help=f"MODEL.TEXT_CHUNK of the rows with the memory options (default {MEMORY_CHUNK})",
    )
    memory.add_argument(
        "--memory-classes",
        default=",".join(str(c) for c in MEMORY_CLASSES),
        help="comma-separated class counts (default 100,1000)",
    )
    eff = parser.add_argument_group("cheaper sharpness-aware optimizers (--efficient)")
    eff.add_argument(
        "--efficient",
        action="store_true",
        help="measure instead the step of LookSAM, SAMPLe-k5, ESAM, RWP, m-RWP, SAF, MESA (and "
        "SAM, SAMPLe) relative to the SGD step, interleaved in one process "
        "(docs/efficient-sharpness.md)",
    )
    eff.add_argument(
        "--efficient-trainers",
        default=",".join(EFFICIENT_TRAINERS),
        help="comma-separated (default CoOp,CoCoOp,MaPLe)",
    )
    parser.add_argument(
        "--loader",
        action="store_true",
        help="measure instead the training loader's input pipelines (INPUT.PIPELINE pil, "
        "tensor, tensor_device) on 500x375 JPEGs: images/s per worker, the device's share, one "
        "worker process end to end, and the pixel difference (experiments/benchmark_loader.py)",
    )
    parser.add_argument(
        "--packed-gap",
        action="store_true",
        help="measure instead the time from one run's end to the next run's first step in a "
        "packed worker, with 0 and 4 loader workers (4: kept across the runs by the worker "
        "pool, and forked per run) (experiments/benchmark_packed.py)",
    )
    parser.add_argument(
        "--startup",
        action="store_true",
        help="measure instead a fresh train.py process's start-up phases on a ViT-B/16-shaped "
        "CLIP read from a local file, --run-repeats + 1 processes, and what its imports are "
        "made of; with --json also writes the last run's cost.json beside it as <name>_cost.json "
        "(experiments/benchmark_startup.py)",
    )
    runs = parser.add_argument_group("whole runs (--runs)")
    runs.add_argument(
        "--runs",
        action="store_true",
        help="measure whole train.py runs instead: fixed cost as a process and in-process, "
        "runs per process with --run-workers, the paper grid's GPU-hours estimate",
    )
    runs.add_argument("--run-epochs", type=int, default=2, help="epochs of a measured run")
    runs.add_argument("--run-repeats", type=int, default=2, help="runs per mode (median)")
    runs.add_argument(
        "--run-workers",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1, 2],
        help="in-process worker counts for the throughput (default 1,2)",
    )
    runs.add_argument("--packed-runs", type=int, default=4, help="runs per throughput figure")
    runs.add_argument(
        "--run-opts",
        nargs="+",
        metavar="KEY VALUE",
        help="config options added to every measured run (e.g. MODEL.COMPILE default "
        "INPUT.PIPELINE tensor_device)",
    )
    runs.add_argument(
        "--step-ms",
        type=lambda v: tuple(float(x) for x in v.split(",")),
        help="SGD,SAMPLe step in ms on the target device for the grid estimate (e.g. the CoOp "
        "rows of a --device cuda benchmark); default: the released code's anchors",
    )
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.packed_gap:  # as a grid worker runs: torch's default threads
        from experiments.benchmark_packed import packed_gaps, print_packed_gaps

        result = packed_gaps(args.device, runs=args.packed_runs)
        print_packed_gaps(result)
        if args.json:
            write_json(args.json, result)
        return 0
    if args.startup:  # fresh processes, as a grid starts them
        from experiments.benchmark_startup import print_startup_costs, startup_costs

        result = startup_costs(repeats=args.run_repeats + 1)
        print_startup_costs(result)
        if args.json:
            write_json(args.json, result)
            stem = args.json[: -len(".json")] if args.json.endswith(".json") else args.json
            write_json(stem + "_cost.json", result["cost_json"])
        return 0
    if args.runs:  # torch's default threads and no log handler of its own, as train.py runs
        result = run_costs(args)
        print_run_costs(result)
        if args.json:
            write_json(args.json, result)
        return 0
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s")
    logger.setLevel(logging.INFO)
    if not args.verbose:  # known consequences of random weights and synthetic data
        for name in ("engine.clip.model", "trainers.coprompt", "datasets.common"):
            logging.getLogger(name).setLevel(logging.ERROR)
    if args.device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    if args.memory:
        result, failed = memory_report(args)
        print_memory_report(result)
        if args.json:
            write_json(args.json, result)
        if failed:
            print(f"FAILED measurements (tracebacks above): {', '.join(failed)}", file=sys.stderr)
        return 1 if failed else 0
    t0 = time.perf_counter()
    if args.loader:
        from experiments.benchmark_loader import loader_report, print_loader_report

        result = loader_report(args)
        print_loader_report(result)
        if args.json:
            write_json(args.json, result)
        return 0
    if args.efficient:
        result = efficient_costs(args)
        print_efficient_costs(result)
        print(f"\nTotal time: {time.perf_counter() - t0:.0f} s")
        if args.json:
            write_json(args.json, result)
        return 0
    result, failed = run(args)
    print_report(result)
    print(f"\nTotal time: {time.perf_counter() - t0:.0f} s")
    if args.json:
        write_json(args.json, result)
        print(f"Results written to {args.json}")
    if failed:
        print(f"FAILED measurements (tracebacks above): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
