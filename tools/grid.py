"""Expand an experiment grid into runs and execute the unfinished ones.

A grid is trainers x optimizers x datasets x seeds x protocols (``base2new``,
``cross_dataset``, ``domain_gen``, ``few_shot``: x shots); presets hold the paper's grids. Runs
are grouped in chains (a training run, then the evaluations of its model) and a chain is the unit
of scheduling:

- locally, one chain after another (train.py's output streams to the terminal);
- ``--gpus 0,1,2,3`` (or ``auto``): one worker per GPU (``CUDA_VISIBLE_DEVICES``), each run's
  output in ``<run dir>/console.txt``, a progress line per run;
- ``--slurm``: one SLURM job per chain through submitit (``experiments/grid_slurm.py``: GPUs per
  job, ``--slurm-wait``, ``--status``, requeues and time limits; docs/cluster.md).

``--per-gpu N`` packs N workers onto each GPU (after a free-memory check, ``--worker-mem-gb``);
``--workers N`` runs N workers without GPUs. ``--in-process``: each worker is one long-lived
process that runs its chains' runs in-process (``engine/runner.py``: imports, the CLIP
checkpoint read and the compiled graphs paid once; folders, logs and numbers as with one train.py
process per run); ``--processes``: every run is its own train.py process. Without either, a grid
that runs on a GPU (``--gpus``, or a GPU visible to it) packs its runs and a grid without one
runs a process per run (``experiments/grid_exec.py``: ``choose_in_process``); data-parallel runs
(``--gpus-per-run``) are always processes. The grid prints its choice (``Runs: ...``).

Finished runs (a result line in their log) are skipped; a run folder without a result is
re-run into the same folder, where train.py resumes from the last checkpoint. A run whose folder
another process holds (a second grid on the same output) is left for last, then waited for; a
run found finished once its folder's lock is held is not run again (train.py --skip-done
--wait-for-folder), so two grids on one output share its runs and each runs once. Before anything
starts, the data (``tools/check_data.py``), the merged configs and the CLIP weights are
checked. The output layout is described in ``experiments/protocols.py``.

Examples::

    python tools/grid.py --preset paper --dry-run                  # 2,100 runs and their folders
    python tools/grid.py --preset paper --trainers CoOp --gpus auto --data DATA
    python tools/grid.py --trainers CoOp MaPLe --optims sgd sample --datasets dtd eurosat \\
        --seeds 1 2 3 --data DATA -- MODEL.BACKBONE.PATH /weights/ViT-B-16.pt
    python tools/grid.py --preset paper-transfer --slurm --slurm-partition gpu --data DATA
    python tools/grid.py --preset sweep --dry-run     # Figure 3: rho and lambda sweeps
    python tools/grid.py --preset efficient --trainers CoOp --dry-run   # LookSAM, ESAM, SAF, ...
    python tools/grid.py --preset sweep-rho --trainers CoOp --datasets dtd \
        --sweep OPTIM.SAM.RHO 0.02 0.1 --data DATA   # own values; tools/plot_sweep.py plots them
    python tools/grid.py --protocols few_shot --trainers CoOp --optims sgd sample \
        --datasets dtd eurosat --shots 1 2 4 8 16 --data DATA   # CoOp's few-shot curve

Datasets (``--datasets``, ``--xd-targets``) are config stems of ``configs/datasets/``,
``folder:NAME`` (your own images in ``DATA/NAME``, ``DATASET.NAME Folder``) or paths of dataset
config files of one's own (``my/birds.yaml``; docs/own-dataset.md).
``--plugin FILE.py|MODULE`` (repeatable) is given to every train.py command and to the data
check, so a user's own trainer, reader or optimizer runs without an edit of the project (as
``$SAMPLE_PL_PLUGINS`` does for every process).

Everything after ``--`` is passed to every train.py command as KEY VALUE options (options that
change the experiment belong with a ``--tag``, or their runs share the default folders).

``--repro paper|released`` (both: ``--repro paper released``; default ``$REPRO``) picks the
reproduction mode (docs/reproducing.md): ``paper`` keeps the folders above,
``released`` (an emulation of the SAMPLe authors' released code) runs ``train.py --repro
released`` into folders tagged ``released`` (``{cfg}+{optim}-released``). Without either, every
grid runs ``paper``, as train.py, the scripts and the demo do (one rule: ``paper`` unless
``released`` is named; docs/reproducing.md).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import replace
from queue import Empty, Queue

if __package__ in (None, ""):  # run as a script
    import _repo  # noqa: F401

from experiments.grid_estimate import report_actual, report_plan  # noqa: E402
from experiments.grid_exec import (  # noqa: E402
    ChainClaim,
    GridError,
    Progress,
    choose_in_process,
    execute_chain,
    held_runs,
)
from experiments.grid_plan import (  # noqa: E402
    AXES,
    PRESETS,
    SubGrid,
    expand_modes,
    repro_modes,
    select,
    sweep_variants,
)
from experiments.paper_results import (  # noqa: E402
    EFFICIENT_OPTIMIZERS,
    EXTRA_TRAINERS,
    OPTIMIZERS,
    TRAINERS,
)
from experiments.protocols import (  # noqa: E402
    PROTOCOLS,
    REPRO_MODES,
    Chain,
    ProtocolError,
    Setup,
    fetch_weights,
    preflight,
    run_status,
    shots_warnings,
)


def detect_gpus(spec: str | None) -> list[str] | None:
    """GPU ids from ``--gpus`` (``0,1`` or ``auto``); None = one worker, environment as is."""
    if not spec:
        return None
    if spec != "auto":
        return [g.strip() for g in spec.split(",") if g.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip()] or None
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] or None


def check_gpu_memory(gpus: list[str], per_gpu: int, worker_mem_gb: float) -> None:
    """Refuse ``--per-gpu N`` when a GPU has less free memory than N workers need (read with
    nvidia-smi; skipped when it is not available)."""
    if per_gpu <= 1 or worker_mem_gb <= 0:
        return
    query = ["nvidia-smi", "--query-gpu=index,memory.free", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        print("--per-gpu: nvidia-smi is not available, free GPU memory not checked")
        return
    free = {}
    for line in out.splitlines():
        idx, _, mib = line.partition(",")
        if mib.strip().isdigit():
            free[idx.strip()] = int(mib) / 1024
    need = per_gpu * worker_mem_gb
    short = [f"gpu {g}: {free[g]:.1f} GB free" for g in gpus if g in free and free[g] < need]
    if short:
        raise GridError(
            f"--per-gpu {per_gpu} needs {need:.1f} GB per GPU ({worker_mem_gb:g} GB per worker, "
            f"--worker-mem-gb): {'; '.join(short)}. Use fewer workers per GPU or free the GPUs"
        )


def run_local(
    chains: list[Chain],
    setup: Setup,
    gpus: list[str] | None,
    stream: bool,
    per_gpu: int = 1,
    in_process: bool = False,
    workers: int = 1,
    nproc: int = 1,
) -> list:
    """Execute chains with ``per_gpu`` workers per GPU (without GPUs: ``workers`` workers);
    returns the failures.

    A worker takes the next chain when it finishes one. ``in_process``: each worker is one
    long-lived process running its runs in-process (engine/runner.py); else every run is a
    train.py process.
    """
    todo = {r.out_dir for c in chains for r in c.runs if run_status(r) != "done"}
    progress = Progress(len(todo))
    queue: Queue = Queue()
    for chain in chains:
        queue.put(chain)
    deferred: set[str] = set()  # chains put back once because another process held them

    def take(chain: Chain) -> ChainClaim | None:
        """The claim of ``chain`` (ChainClaim), or None when another process holds the chain
        or one of its runs and other chains wait: ``chain`` is then put back, once; the second
        time this waits for the other grid's claim (train.py waits for a run folder's lock)."""
        claim = ChainClaim(setup.output, chain)
        holder = claim.take()
        held = [(chain.train, holder)] if holder else held_runs(chain)
        if not held:
            return claim
        claim.release()
        run, holder = held[0]
        with progress.lock:
            later = chain.train.out_dir not in deferred and not queue.empty()
            if later:
                deferred.add(chain.train.out_dir)
                queue.put(chain)
            what = "other chains first" if later else "waiting for it"
            print(f"[held] {run.label}: in use by {holder}; {what}", flush=True)
        if later:
            return None
        claim.take(wait=True)
        return claim

    def worker(gpu: str | None, slot: int) -> None:
        env = None if gpu is None else dict(os.environ, CUDA_VISIBLE_DEVICES=gpu)
        where = "" if gpu is None else f" gpu {gpu}"
        where += f" worker {slot}" if max(per_gpu, workers) > 1 else ""
        runner = None
        if in_process:
            from experiments.worker import Worker

            runner = Worker(env, python=setup.python)
        try:
            while True:
                try:
                    chain = queue.get_nowait()
                except Empty:
                    return
                claim = take(chain)
                if claim is None:
                    continue
                try:
                    execute_chain(chain, setup, progress, env, stream, where, runner, nproc)
                finally:
                    claim.release()
        finally:
            if runner is not None:
                runner.close()

    slots = [(g, k) for g in gpus for k in range(per_gpu)] if gpus else []
    slots = slots or [(None, k) for k in range(max(workers, 1))]
    if len(slots) == 1:
        worker(*slots[0])
    else:
        threads = [threading.Thread(target=worker, args=s, daemon=True) for s in slots]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    elsewhere = [
        r
        for c in chains
        for r in c.runs
        if r.out_dir in todo and r.out_dir not in progress.started_dirs and run_status(r) == "done"
    ]
    if elsewhere:
        print(f"{len(elsewhere)} run(s) finished by another process (a grid beside this one)")
    return progress.failed


def submit_slurm(chains: list[Chain], setup: Setup, args) -> list:
    """Submit one job per chain (a job array) with submitit; returns the jobs
    (``experiments/grid_slurm.py``)."""
    from experiments.grid_slurm import submit

    return submit(chains, setup, args)


def run_slurm(chains: list[Chain], setup: Setup, args) -> int:
    """``--slurm``: submit the chains that have no queued or running job, then with
    ``--slurm-wait`` wait for them."""
    from experiments.grid_slurm import live_jobs, read_records, wait

    live = live_jobs(setup.output)
    busy = [c for c in chains if c.train.out_dir in live]
    for chain in busy:
        print(f"already in SLURM (job {live[chain.train.out_dir]}): {chain.train.label}")
    chains = [c for c in chains if c.train.out_dir not in live]
    if not chains:
        print("Nothing to submit: every unfinished chain has a queued or running job")
        return 0
    jobs = submit_slurm(chains, setup, args)
    if not args.slurm_wait:
        return 0
    ids = {str(j.job_id) for j in jobs}
    return wait([r for r in read_records(setup.output) if r["job_id"] in ids], args.slurm_poll)


# -- command line -----------------------------------------------------------------------------
def add_grid_args(parser: argparse.ArgumentParser) -> None:
    """The grid and layout options (shared with tools/make_tables.py)."""
    g = parser.add_argument_group("grid")
    g.add_argument("--preset", choices=sorted(PRESETS), help="the paper's grids")
    g.add_argument("--protocols", nargs="+", choices=PROTOCOLS, help="default: base2new")
    g.add_argument("--trainers", nargs="+", help=f"e.g. {' '.join(TRAINERS + EXTRA_TRAINERS)}")
    g.add_argument(
        "--optims",
        nargs="+",
        help=f"e.g. {' '.join(OPTIMIZERS)}, or the cheaper "
        f"{' '.join(o for o in EFFICIENT_OPTIMIZERS if o not in OPTIMIZERS)} (default: sample)",
    )
    g.add_argument(
        "--datasets",
        nargs="+",
        help="base-to-new and few-shot datasets (default: the 11): config stems, folder:NAME for "
        "your own images in DATA/NAME, or a dataset config file PATH.yaml",
    )
    g.add_argument("--seeds", nargs="+", type=int, help="any seeds >= 0 (default: 1 2 3)")
    g.add_argument(
        "--xd-targets", nargs="+", help="cross-dataset targets (default: the 10; or folder:NAME)"
    )
    g.add_argument("--dg-targets", nargs="+", help="domain generalization targets (default: 4)")
    g.add_argument(
        "--cfg",
        nargs="+",
        default=[],
        metavar="[TRAINER=]CFG",
        help="trainer config names (configs/trainers/<TRAINER>/<CFG>.yaml) overriding defaults",
    )
    g.add_argument(
        "--sweep",
        nargs="+",
        metavar="KEY VALUE",
        help="sweep a config key, e.g. --sweep OPTIM.SAM.RHO 0.02 0.05 0.1 (replaces the values "
        "of a sweep preset; runs go to {cfg}+{optim}-rho0.02 ...)",
    )
    lay = parser.add_argument_group("layout")
    lay.add_argument("--output", default=os.environ.get("OUTPUT") or "output", help="output root")
    lay.add_argument(
        "--shots",
        type=int,
        nargs="+",
        help="training shots per class: base2new, cross_dataset and domain_gen take one value "
        "(default 16); few_shot one or more (default 1 2 4 8 16)",
    )
    lay.add_argument("--tag", default="", help="suffix of the optimizer folder component")
    lay.add_argument(
        "--repro",
        nargs="+",
        choices=REPRO_MODES,
        help="reproduction mode(s): paper and/or released (the SAMPLe authors' released code "
        "emulated; folders tagged 'released'). Default: $REPRO, else paper (as train.py)",
    )


def apply_sweep(grids: list[SubGrid], sweep: list[str] | None) -> list[SubGrid]:
    """``--sweep KEY V1 V2 ...``: sweep config ``KEY`` over the values.

    Sub-grids that sweep ``KEY`` (a preset's) get these values instead of theirs; without such
    a sub-grid every sub-grid sweeps ``KEY`` (e.g. a grid given by ``--trainers``).
    """
    if not sweep:
        return grids
    if len(sweep) < 2:
        raise GridError(f"--sweep {' '.join(sweep)}: give a config key and its values")
    key, values = sweep[0], sweep[1:]
    variants = sweep_variants(key, values)
    swept = [g for g in grids if any(v[:1] == (key,) for v in g.variants)]
    if swept:
        return [replace(g, variants=variants) if g in swept else g for g in grids]
    if any(v for g in grids for v in g.variants):
        raise GridError(f"--sweep {key}: the preset sweeps other keys; choose a matching preset")
    return [replace(g, variants=variants) for g in grids]


def grids_from_args(args) -> list[SubGrid]:
    grids = select(args.preset, **{k: getattr(args, k) for k in AXES})
    if not grids:
        raise GridError("The selection is empty: no part of the preset matches the given axes")
    return apply_sweep(grids, getattr(args, "sweep", None))


def setup_shots(grids, shots: list[int] | None) -> int:
    """``Setup.shots``: the one ``--shots`` value of base2new and the transfer protocols (16
    without one); for a grid of only ``few_shot``, its largest shots (what the data check
    checks).

    Raises:
        GridError: several values for a grid with another protocol than few_shot.
    """
    protocols = {p for g in grids for p in g.protocols}
    if protocols == {"few_shot"}:
        return max(s for g in grids for s in g.shots)
    if shots and len(shots) > 1:
        raise GridError(
            f"--shots {' '.join(map(str, shots))}: several values are for the few_shot "
            f"protocol only; the others ({', '.join(sorted(protocols - {'few_shot'}))}) take "
            "one value (run the few-shot grid on its own)"
        )
    return shots[0] if shots else 16


def setup_from_args(args, opts: list[str] | None = None) -> Setup:
    from engine.plugins import absolute_spec  # a run may start elsewhere: files by full path

    grids = grids_from_args(args)
    trainers = {t for g in grids for t in g.trainers}
    cfgs = {}
    for item in args.cfg:
        trainer, sep, cfg = item.rpartition("=")
        if not sep:
            if len(trainers) != 1:
                raise GridError(f"--cfg {cfg}: several trainers, use --cfg TRAINER={cfg}")
            trainer = next(iter(trainers))
        cfgs[trainer] = cfg
    if len(opts or []) % 2:
        raise GridError(f"Options after -- must be KEY VALUE pairs, got {opts}")
    return Setup(
        data=getattr(args, "data", "") or "",
        output=args.output,
        shots=setup_shots(grids, args.shots),
        tag=args.tag,
        opts=tuple(opts or ()),
        cfgs=tuple(sorted(cfgs.items())),
        repro=repro_modes(args)[0],
        plugins=tuple(absolute_spec(p) for p in getattr(args, "plugin", None) or []),
    )


def split_opts(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(grid arguments, KEY VALUE options after --)``."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def print_plan(chains: list[Chain], setup: Setup, dry_run: bool, commands: bool) -> int:
    """List the runs (all of them in a dry run, else those that will run); returns how many."""
    counts = {"done": 0, "partial": 0, "todo": 0}
    for chain in chains:
        train_done = run_status(chain.train) == "done"
        for run in chain.runs:
            status = run_status(run)
            counts[status] += 1
            if status == "done" and not dry_run:
                continue
            action = {"done": "skip", "partial": "resume", "todo": "run"}[status]
            if run.stage == "eval" and status != "done" and not train_done:
                action = "after training"
            print(f"{action:>14}  {run.label}\n{'':>16}{run.out_dir}")
            if commands:
                epoch = "{last epoch of the training run}" if run.stage == "eval" else None
                print(f"{'':>16}{shlex.join(run.command(setup, epoch))}")
    print(
        f"{sum(counts.values())} runs in {len(chains)} chains: {counts['done']} done (skipped), "
        f"{counts['partial']} to resume or re-run, {counts['todo']} to run"
    )
    return counts["partial"] + counts["todo"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_grid_args(parser)
    parser.add_argument("--data", default=os.environ.get("DATA", ""), help="dataset root ($DATA)")
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="FILE_OR_MODULE",
        help="a module registering your own trainer, reader or optimizer, given to every "
        "train.py run and to the data check (.py path or module name; repeatable)",
    )
    parser.add_argument("--dry-run", action="store_true", help="list runs and folders only")
    parser.add_argument("--commands", action="store_true", help="also list train.py commands")
    parser.add_argument("--no-check", action="store_true", help="skip the pre-flight checks")
    parser.add_argument(
        "--no-data-check", action="store_true", help="skip only tools/check_data.py"
    )
    run = parser.add_argument_group("execution")
    run.add_argument("--gpus", help="one worker per GPU: ids (0,1,2,3) or auto")
    run.add_argument("--quiet", action="store_true", help="train.py output to console.txt")
    packing = run.add_mutually_exclusive_group()
    packing.add_argument(
        "--in-process",
        action="store_const",
        const=True,
        default=None,
        help="each worker runs its runs in one long-lived process (imports and the CLIP "
        "checkpoint read paid once; same folders, logs and numbers). The default on a GPU",
    )
    packing.add_argument(
        "--processes",
        dest="in_process",
        action="store_const",
        const=False,
        help="every run its own train.py process (the default without a GPU)",
    )
    run.add_argument(
        "--per-gpu", type=int, default=1, help="workers per GPU (with --gpus; memory checked)"
    )
    run.add_argument("--workers", type=int, default=1, help="workers without --gpus (CPU)")
    run.add_argument(
        "--gpus-per-run",
        type=int,
        default=1,
        help="processes per run (torchrun; docs/distributed.md): N GPUs of --gpus per run, "
        "N gloo processes without GPUs, N GPUs per SLURM job",
    )
    run.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="with --slurm and --gpus-per-run N: machines per run (each SLURM job asks for "
        "this many nodes with N / nodes GPUs each; each run is one srun step over them)",
    )
    run.add_argument(
        "--worker-mem-gb",
        type=float,
        default=4.0,
        help="GPU memory a worker needs, for the --per-gpu check (0: no check)",
    )
    slurm = parser.add_argument_group("SLURM (submitit)")
    slurm.add_argument("--slurm", action="store_true", help="submit one job per chain")
    slurm.add_argument("--slurm-partition", default="", help="partition")
    slurm.add_argument(
        "--slurm-gpus", type=int, default=1, help="GPUs per job (0 for CPU partitions)"
    )
    slurm.add_argument(
        "--slurm-time",
        type=int,
        default=24 * 60,
        help="minutes per job; a longer chain is requeued at the limit and goes on",
    )
    slurm.add_argument("--slurm-cpus", type=int, default=8, help="CPUs per job")
    slurm.add_argument("--slurm-mem", type=int, default=0, help="memory per job in GB")
    slurm.add_argument("--slurm-parallel", type=int, default=64, help="running jobs at most")
    slurm.add_argument("--slurm-param", nargs="+", help="more submitit parameters KEY=VALUE")
    slurm.add_argument(
        "--slurm-max-requeues",
        type=int,
        default=10,
        help="time-limit requeues of a job at most (submitit's max_num_timeout)",
    )
    slurm.add_argument(
        "--slurm-wait",
        action="store_true",
        help="wait for the jobs; print each requeue and each chain's end (exit 1 unless all done)",
    )
    slurm.add_argument(
        "--slurm-poll", type=float, default=30.0, help="seconds between SLURM queries when waiting"
    )
    slurm.add_argument(
        "--status",
        action="store_true",
        help="the state of the chains submitted to SLURM from --output (queued, running, done, "
        "failed, cancelled), from the run folders and sacct/squeue",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv, opts = split_opts(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
    if args.status:
        from experiments.grid_slurm import status

        return status(args.output)
    try:
        setup = setup_from_args(args, opts)
        chains = expand_modes(grids_from_args(args), setup, repro_modes(args))
        pending = print_plan(chains, setup, args.dry_run, args.commands)
        for line in shots_warnings(chains, setup) if pending else []:  # dry runs included
            print(f"warning: {line}", flush=True)
        plan = report_plan(chains, setup, args, detect_gpus) if pending else None  # the estimate
        if args.dry_run or not pending:
            return 0
        if not setup.data:
            raise GridError("No dataset root: pass --data DIR or set DATA=/path/to/datasets")
        from experiments.grid_distributed import check_args, gpu_groups

        nproc = check_args(args)  # data-parallel runs (#29)
        todo = [c for c in chains if any(run_status(r) != "done" for r in c.runs)]
        if not args.no_check:
            fetch_weights(todo, setup)  # CLIP weights fetched once, before any run or job starts
            print("Checking data, configs and CLIP weights ...", flush=True)
            problems = preflight(todo, setup, data=not args.no_data_check)
            if problems:
                raise GridError("Pre-flight checks failed:\n- " + "\n- ".join(problems))
        if args.slurm:
            return run_slurm(todo, setup, args)
        gpus = detect_gpus(args.gpus)
        if gpus and nproc > 1:
            gpus = gpu_groups(gpus, nproc)
        if args.per_gpu < 1 or args.workers < 1:
            raise GridError("--per-gpu and --workers must be at least 1")
        if gpus:
            check_gpu_memory(gpus, args.per_gpu, args.worker_mem_gb)
        slots = len(gpus) * args.per_gpu if gpus else args.workers
        stream = not args.quiet and slots == 1
        in_process, why = choose_in_process(args.in_process, gpus, nproc)
        kind = "packed: one long-lived process per worker" if in_process else "a process per run"
        print(f"Runs: {kind} ({why})", flush=True)
        started = time.perf_counter()
        failed = run_local(todo, setup, gpus, stream, args.per_gpu, in_process, args.workers, nproc)
        report_actual(plan, todo, time.perf_counter() - started)  # the estimate against the actual
    except (GridError, ProtocolError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    if failed:
        print(f"\n{len(failed)} run(s) failed:\n- " + "\n- ".join(failed), file=sys.stderr)
        return 1
    print("All runs finished.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
