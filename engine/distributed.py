"""One experiment over several processes (GPUs, machines): data parallelism on torch.distributed.

``torchrun --nproc_per_node N train.py ...`` or ``srun`` with one task per GPU runs one run
data-parallel (docs/distributed.md):

- :func:`init_from_env` joins the process group from torchrun's variables (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) or, under ``srun``, from
  SLURM's (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; the address is the first host
  of ``SLURM_NODELIST``, the port derived from ``SLURM_JOB_ID`` unless ``MASTER_PORT`` is set).
  NCCL on GPUs, gloo on CPU; every collective fails after ``DISTRIBUTED.TIMEOUT`` seconds, so a
  dead process never leaves the others hanging.
- The batches: ``DATALOADER.TRAIN_X.BATCH_SIZE`` stays the *global* batch, each process gets a
  contiguous shard of it (:mod:`engine.data.distributed`).
- The gradients: the optimizer step all-reduces every pass's gradients, weighted by the
  process's share of the pass's items (:mod:`optim.distributed`), so every optimizer sees the
  one-process gradient. This is done here rather than by wrapping the model in
  ``DistributedDataParallel``: DDP all-reduces inside ``backward()`` with equal weights and
  once per backward, while the sharpness-aware steps run two or three passes per step (some
  without gradients, some on a subset of the items, ESAM's) and need the weighted global mean
  of exactly the gradients the optimizer reads. The prompts are kilobytes to megabytes, so one
  flat all-reduce per pass costs little against the frozen encoders' work.
- Evaluation: each process evaluates a contiguous shard of the set; the logits (or frozen
  features) are gathered in order, so accuracy, per-class numbers and predictions are those
  of one process (no padded or duplicated images).
- One writer: rank 0 writes ``log.txt``, ``config.yaml``, scalars, ``cost.json``,
  checkpoints and caches (:func:`is_main_process` guards the writes); the other processes
  log warnings and errors to stderr with their rank.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import sys

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# What every process reports when it stops on an error: the message names the rank.
FAILED = "Data-parallel run: rank {rank} of {world} failed: {cause}"


def data_parallel() -> tuple[int, int] | None:
    """``(rank, world_size)`` of a data-parallel run (more than one process), else None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    return (dist.get_rank(), world) if world > 1 else None


def rank() -> int:
    dp = data_parallel()
    return dp[0] if dp else 0


def world_size() -> int:
    dp = data_parallel()
    return dp[1] if dp else 1


def shard_size(global_batch: int) -> int:
    """This process's items of a full global batch (the batch itself in one process)."""
    from .data.distributed import split_sizes

    dp = data_parallel()
    return global_batch if dp is None else split_sizes(global_batch, dp[1])[dp[0]]


def barrier() -> None:
    """Wait for every process (a no-op in one process)."""
    if data_parallel() is not None:
        dist.barrier()


def is_main_process() -> bool:
    """Whether this process writes the run's files (rank 0, or the only process)."""
    return rank() == 0


# -- joining the group ------------------------------------------------------------------------
def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[01-03,7],gpu2`` -> ``node01``."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"Cannot read the SLURM node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(3)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def env_from_slurm(env: dict) -> dict:
    """torchrun's variables from SLURM's (one task per process under ``srun``); ``{}`` when
    this is no multi-task SLURM step or torchrun's variables are already set."""
    if "RANK" in env or int(env.get("SLURM_NTASKS", "1") or 1) <= 1 or "SLURM_PROCID" not in env:
        return {}
    job = int(env.get("SLURM_JOB_ID", "0") or 0)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or "localhost"
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env["SLURM_NTASKS"],
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodelist),
        "MASTER_PORT": env.get("MASTER_PORT") or str(20000 + job % 20000),
    }


def init_from_env(cfg) -> tuple[int, int] | None:
    """Join the process group when this process is one of several (torchrun or srun); returns
    ``(rank, world_size)``, or None for a one-process run (nothing is initialised)."""
    if data_parallel() is not None:
        return data_parallel()
    os.environ.update(env_from_slurm(dict(os.environ)))
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return None
    use_cuda = torch.cuda.is_available() and cfg.USE_CUDA
    backend = cfg.DISTRIBUTED.BACKEND or ("nccl" if use_cuda else "gloo")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if not use_cuda or local >= torch.cuda.device_count():
            raise RuntimeError(
                f"DISTRIBUTED.BACKEND nccl needs one GPU per process: LOCAL_RANK {local}, "
                f"{torch.cuda.device_count() if use_cuda else 0} GPU(s) visible"
            )
        torch.cuda.set_device(local)
    timeout = datetime.timedelta(seconds=float(cfg.DISTRIBUTED.TIMEOUT))
    dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
    return data_parallel()


def setup_follower_logging() -> None:
    """A process other than rank 0: warnings and errors to stderr, marked with its rank."""
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank()}] %(levelname)s %(message)s"))
    handler._engine_handler = True
    root.addHandler(handler)


_released = False  # rank 0 told the others whether the run goes on (once per run)


# what rank 0 tells the others when it finds the run finished under the folder's lock (--skip-done)
ALREADY_DONE = "already done"


def release_followers(error: str | None = None) -> None:
    """Rank 0: the run folder is ready (or ``error``: the run stops before training); the others
    wait for it. Once per run: later calls do nothing."""
    global _released
    if data_parallel() is not None and not _released:
        _released = True
        dist.broadcast_object_list([error], src=0)


def wait_for_main() -> str | None:
    """A follower: wait until rank 0 has prepared the run folder; rank 0's error, or None."""
    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# a collective that failed because another process died or went silent (gloo, NCCL)
_PEER_LOST = ("closed by peer", "reset by peer", "timed out", "timeout", "broken pipe")


def failure_message(error: BaseException) -> str:
    """The one line a failing process prints: its rank and the cause; a process whose
    collective failed because another one died says so (that process names its own cause,
    and torchrun/srun name the first process that failed)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    lost = isinstance(error, getattr(dist, "DistBackendError", ())) or any(
        k in text.lower() for k in _PEER_LOST
    )
    if lost:
        return (
            f"Data-parallel run: rank {rank()} of {world_size()} stopped: another process failed "
            f"or stopped answering ({type(error).__name__}: {text[:300]})"
        )
    return FAILED.format(rank=rank(), world=world_size(), cause=f"{type(error).__name__}: {text}")


def shutdown() -> None:
    """Leave the process group (end of the run)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# -- the trainer's side -----------------------------------------------------------------------
def attach(trainer) -> None:
    """Give a trainer's optimizer step the gradient sync of this run (no-op in one process)."""
    if data_parallel() is None:
        return
    from optim.distributed import GradientSync, check_local_ascent

    from .errors import ConfigError

    local = bool(trainer.cfg.DISTRIBUTED.LOCAL_ASCENT)
    step = trainer.optim_step
    if local:
        if trainer.prec == "amp":
            raise ConfigError(
                "DISTRIBUTED.LOCAL_ASCENT True with PREC amp: the processes' first passes may "
                "overflow differently; use PREC fp32 or bf16, or LOCAL_ASCENT False"
            )
        for opt in step.sharp:
            check_local_ascent(opt)
    step.grad_sync = GradientSync(local_ascent=local)


@torch.no_grad()
def broadcast_state(trainer) -> None:
    """Rank 0's parameters and buffers of every registered model to every process (at the
    start of training, after a resume), so the processes start identical."""
    if data_parallel() is None:
        return
    for name in trainer.get_model_names():
        for t in trainer.get_model(name).state_dict().values():
            if isinstance(t, torch.Tensor):
                dist.broadcast(t, src=0)


def collective_device() -> torch.device:
    """Where the default group's collectives take their tensors (NCCL: this GPU; gloo: CPU)."""
    if data_parallel() is not None and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def main_decides(value):
    """Rank 0's ``value`` on every process (one process: ``value``): a decision that every
    process must take alike, e.g. whether rank 0 found the feature cache."""
    if data_parallel() is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_tensors(tensors: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
    """Rank 0's ``tensors`` on every process, on the collectives' device (the other processes
    pass None; one process: ``tensors``)."""
    if data_parallel() is None:
        return tensors
    meta = [[(tuple(t.shape), t.dtype) for t in tensors] if is_main_process() else None]
    dist.broadcast_object_list(meta, src=0)
    device, out = collective_device(), []
    for i, (shape, dtype) in enumerate(meta[0]):
        if is_main_process():
            t = tensors[i].to(device).contiguous()
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=0)
        out.append(t)
    return out


def gather_rows(t: torch.Tensor) -> torch.Tensor:
    """The rows of ``t`` of every process, in rank order (one process: ``t``)."""
    if data_parallel() is None:
        return t
    from optim.distributed import GradientSync

    return GradientSync().gather_items(t)[0]


def cost_meta() -> dict:
    """What ``cost.json`` says of the processes of the run."""
    return {"processes": world_size(), "backend": dist.get_backend() if data_parallel() else ""}
