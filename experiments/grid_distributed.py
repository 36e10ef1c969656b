"""The grid's data-parallel runs (``tools/grid.py --gpus-per-run N``; docs/distributed.md).

Each run of the grid is one ``torchrun --standalone --nproc_per_node N train.py ...`` (a
rendezvous on a free local port of its own, so runs side by side never meet), beside the
one-run-per-GPU and packed modes:

- locally with ``--gpus``: the GPUs are grouped N by N (``--gpus 0,1,2,3 --gpus-per-run 2``:
  two workers, on GPUs ``0,1`` and ``2,3``); without GPUs, every run is N gloo processes;
- on SLURM (``--slurm``): each chain's job asks for N GPUs on one node (``--slurm-gpus 0``: a
  CPU job, N gloo processes) and runs its runs through torchrun; requeues and time limits
  resume the interrupted run from its last checkpoint as for one-process runs (a checkpoint of
  an N-process run resumes with any number of processes).
"""

from __future__ import annotations

from experiments.grid_exec import GridError, torchrun_command  # noqa: F401  (the launcher)


def gpu_groups(gpus: list[str], nproc: int) -> list[str]:
    """The GPUs grouped ``nproc`` by ``nproc`` (``CUDA_VISIBLE_DEVICES`` of each worker)."""
    if len(gpus) < nproc or len(gpus) % nproc:
        raise GridError(
            f"--gpus-per-run {nproc} needs a multiple of {nproc} GPUs; --gpus gives "
            f"{len(gpus)} ({','.join(gpus)})"
        )
    return [",".join(gpus[i : i + nproc]) for i in range(0, len(gpus), nproc)]


def check_args(args) -> int:
    """The processes per run of ``--gpus-per-run`` (1: one process), or a GridError naming the
    options that do not combine with it."""
    nproc = getattr(args, "gpus_per_run", 1) or 1
    if nproc < 1:
        raise GridError(f"--gpus-per-run must be at least 1, got {nproc}")
    if nproc == 1:
        return 1
    if args.in_process:
        raise GridError(
            "--gpus-per-run runs every run as torchrun processes; --in-process workers run "
            "one process's runs: use one of them"
        )
    if args.per_gpu > 1:
        raise GridError("--gpus-per-run and --per-gpu (several runs on one GPU) do not combine")
    if args.slurm:
        if args.slurm_gpus not in (0, 1, nproc):
            raise GridError(
                f"--gpus-per-run {nproc} on SLURM: the job asks for {nproc} GPUs (the default "
                f"with this option) or none (--slurm-gpus 0: gloo on CPU); got --slurm-gpus "
                f"{args.slurm_gpus}"
            )
        if args.slurm_gpus:
            args.slurm_gpus = nproc  # one GPU per process, on the job's node
    return nproc
