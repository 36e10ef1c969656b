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
- on several machines (``--slurm --nodes M``): each chain's job asks for M nodes with N / M
  GPUs each; the chain runs on the job's first task, and each run is one job step over every
  node, ``srun --nodes M --ntasks-per-node N/M --kill-on-bad-exit=1 python train.py ...``,
  whose processes meet through SLURM's variables (engine/distributed.py: the address is the
  first host of the step's node list, the port derived from the job id).
"""

from __future__ import annotations


class GridError(ValueError):
    """Bad grid arguments or failed pre-flight checks (raised by every grid module; defined
    here, the bottom of the grid's modules, and imported by experiments/grid_exec.py)."""


def torchrun_command(cmd: list[str], nproc: int) -> list[str]:
    """``[python, train.py, args...]`` as ``nproc`` data-parallel processes (#29: torchrun
    with a rendezvous of its own on a free local port; docs/distributed.md)."""
    if nproc <= 1:
        return list(cmd)
    python, script, *args = cmd
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return [python, *launch, script, *args]


def gpu_groups(gpus: list[str], nproc: int) -> list[str]:
    """The GPUs grouped ``nproc`` by ``nproc`` (``CUDA_VISIBLE_DEVICES`` of each worker)."""
    if len(gpus) < nproc or len(gpus) % nproc:
        raise GridError(
            f"--gpus-per-run {nproc} needs a multiple of {nproc} GPUs; --gpus gives "
            f"{len(gpus)} ({','.join(gpus)})"
        )
    return [",".join(gpus[i : i + nproc]) for i in range(0, len(gpus), nproc)]


def srun_command(cmd: list[str], nodes: int, per_node: int, opts=()) -> list[str]:
    """``[python, train.py, args...]`` as one SLURM job step of ``nodes`` x ``per_node`` tasks,
    one process each (the rendezvous from SLURM's variables). ``--overlap``: the step shares
    the first node with the job's own task (the chain's runner, idle while the step runs);
    ``--kill-on-bad-exit``: a failing process ends the others; ``opts``: the step's CPUs and
    GPUs (:func:`step_options`)."""
    return ["srun", "--overlap", "--nodes", str(nodes), "--ntasks-per-node", str(per_node),
            *opts, "--kill-on-bad-exit=1", *cmd]  # fmt: skip


def step_options(args, nproc: int, nodes: int) -> list[str]:
    """The CPUs and GPUs of a run's step: the job's per node, shared by the node's processes
    (every process sees the node's GPUs and takes the one of its ``LOCAL_RANK``). Stated, not
    inherited: srun would read the job's ``SLURM_CPUS_PER_TASK`` (one task per node) for
    each of the step's tasks."""
    per_node = nproc // nodes
    opts = ["--cpus-per-task", str(max(1, args.slurm_cpus // per_node))]
    if args.slurm_gpus:
        opts += ["--gpus-per-node", str(args.slurm_gpus)]
    return opts


def launch_command(cmd: list[str], nproc: int, nodes: int = 1, opts=()) -> list[str]:
    """How the grid starts one run of ``nproc`` processes on ``nodes`` machines."""
    if nodes > 1:
        return srun_command(cmd, nodes, nproc // nodes, opts)
    return torchrun_command(cmd, nproc)


def check_nodes(args, nproc: int) -> int:
    """The machines per run of ``--nodes`` (1: one), or a GridError naming the problem."""
    nodes = getattr(args, "nodes", 1)
    nodes = 1 if nodes is None else nodes
    if nodes < 1:
        raise GridError(f"--nodes must be at least 1, got {nodes}")
    if nodes == 1:
        return 1
    if not args.slurm:
        raise GridError(
            f"--nodes {nodes} runs each run over several machines through SLURM: add --slurm "
            "(locally a run uses the GPUs of this machine: --gpus-per-run)"
        )
    if nproc < nodes or nproc % nodes:
        raise GridError(
            f"--nodes {nodes} with --gpus-per-run {nproc}: every node runs the same number of "
            f"processes, so --gpus-per-run must be a multiple of --nodes (e.g. --gpus-per-run "
            f"{nodes * max(1, nproc // nodes)} or --nodes {_divisor(nproc, nodes)})"
        )
    if args.slurm_cpus < nproc // nodes:
        raise GridError(
            f"--nodes {nodes} with --gpus-per-run {nproc}: {nproc // nodes} processes per node "
            f"need at least as many CPUs per node; --slurm-cpus is {args.slurm_cpus}"
        )
    return nodes


def _divisor(n: int, below: int) -> int:
    """The largest divisor of ``n`` below ``below`` (a --nodes that fits)."""
    return max(d for d in range(1, below) if n % d == 0)


def check_args(args) -> int:
    """The processes per run of ``--gpus-per-run`` (1: one process), or a GridError naming the
    options that do not combine with it (``--nodes`` too, see :func:`check_nodes`)."""
    nproc = getattr(args, "gpus_per_run", 1) or 1
    if nproc < 1:
        raise GridError(f"--gpus-per-run must be at least 1, got {nproc}")
    nodes = check_nodes(args, nproc)
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
            args.slurm_gpus = nproc // nodes  # one GPU per process, on each of the job's nodes
    return nproc
