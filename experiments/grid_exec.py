"""How the grid runs a chain: run counters with an ETA, and the execution of a chain's
unfinished runs as processes or in an in-process worker. Shared by the local grid
(``tools/grid.py``) and the SLURM jobs (``experiments/grid_slurm.py``), which import it, never each
other's modules for it.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import os
import os.path as osp
import shlex
import socket
import subprocess
import threading
import time

from experiments.grid_distributed import GridError, launch_command, torchrun_command  # noqa: F401
from experiments.protocols import Chain, ProtocolError, Run, Setup, load_epoch, run_status
from experiments.results import read_run


# -- progress ---------------------------------------------------------------------------------
class Progress:
    """Thread-safe run counters with elapsed time and a rough ETA."""

    def __init__(self, total: int):
        self.total, self.started, self.finished, self.failed = total, 0, 0, []
        self.started_dirs: set[str] = set()  # the folders of the runs this process started
        self.t0 = time.time()
        self.lock = threading.Lock()

    def _clock(self) -> str:
        elapsed = time.time() - self.t0
        text = f"elapsed {datetime.timedelta(seconds=round(elapsed))}"
        if self.finished:
            left = elapsed / self.finished * (self.total - self.finished)
            text += f", ETA {datetime.timedelta(seconds=round(left))}"
        return text

    def start(self, run: Run, cmd: list[str], status: str, where: str) -> None:
        action = "resume" if status == "partial" and run.stage == "train" else "run"
        with self.lock:
            self.started += 1
            self.started_dirs.add(run.out_dir)
            print(f"[{action} {self.started}/{self.total}{where}] {run.label}", flush=True)
            print(f"  {shlex.join(cmd)}", flush=True)

    def done(self, run: Run, problem: str | None, seconds: float) -> None:
        with self.lock:
            self.finished += 1
            took = datetime.timedelta(seconds=round(seconds))
            if problem:
                self.failed.append(problem)
                print(f"[FAILED {self.finished}/{self.total}] {problem} ({took})", flush=True)
            else:
                acc = read_run(run.out_dir, run.stage).accuracy
                print(
                    f"[done {self.finished}/{self.total}] {run.label}: accuracy {acc:.2f}% "
                    f"({took}; {self._clock()})",
                    flush=True,
                )


# -- execution --------------------------------------------------------------------------------
# Given to every train.py run of a grid: a run whose folder another process holds (a second grid
# on the same output, a requeued job) is waited for, and a run found finished once its folder's
# lock is held ends at once, so a run is never trained or evaluated twice (engine/run_folder.py).
GRID_FLAGS = ("--skip-done", "--wait-for-folder")


CLAIMS = ".claims"  # under the output root: one lock file per chain a local grid works on


class ChainClaim:
    """A local grid's hold on a chain: ``<output>/.claims/<chain>.lock``, ``flock``-ed by the
    grid while one of its workers runs the chain, so a second grid on the same output takes
    other chains (the run folders' own locks are taken only once train.py has started, seconds
    later). The lock dies with the grid; the emptied file stays.
    """

    def __init__(self, output: str, chain: Chain):
        rel = osp.relpath(chain.train.out_dir, output)
        name = hashlib.sha1(rel.encode()).hexdigest()[:16]
        self.path = osp.join(output, CLAIMS, f"{name}.lock")
        self.what = rel
        self._fd: int | None = None

    def take(self, wait: bool = False) -> str | None:
        """Hold the claim; returns None, or (without ``wait``) the holder when another process
        holds it."""
        os.makedirs(osp.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            os.close(fd)
            return holder or "another grid"
        info = f"grid pid {os.getpid()} on host {socket.gethostname()}, since {time.ctime()}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{info}: {self.what}\n".encode(), 0)
        self._fd = fd
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None


def held_runs(chain: Chain) -> list[tuple[Run, str]]:
    """The unfinished runs of ``chain`` whose folders another process holds, with the holder
    (``pid N on host H, since ...``)."""
    from engine.run_folder import lock_holder

    held = []
    for run in chain.runs:
        if run_status(run) != "done":
            holder = lock_holder(run.out_dir)
            if holder:
                held.append((run, holder))
    return held


def _execute(cmd: list[str], out_dir: str, env: dict | None, stream: bool, worker=None) -> int:
    """Run ``cmd`` (a train.py command) as a process, or in ``worker`` (tools.worker.Worker:
    ``train.py``'s arguments run in that process); output in ``console.txt`` unless ``stream``.
    """
    console = None
    if not stream:
        os.makedirs(out_dir, exist_ok=True)
        console = osp.join(out_dir, "console.txt")
        with open(console, "a") as f:
            f.write(f"\n$ {shlex.join(cmd)}\n")
    if worker is not None:
        return worker.run(cmd[2:], console)  # cmd: [python, train.py, args...]
    if console is None:
        return subprocess.run(cmd, env=env).returncode
    with open(console, "a") as f:
        return subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode


def execute_chain(
    chain: Chain,
    setup: Setup,
    progress: Progress,
    env: dict | None = None,
    stream: bool = True,
    where: str = "",
    worker=None,
    nproc: int = 1,
    nodes: int = 1,
    step_opts=(),
) -> None:
    """Run the unfinished runs of ``chain`` in order (evaluations need a finished training);
    ``worker``: an in-process worker (tools.worker.Worker) that runs them, else processes;
    ``nproc`` > 1: each run is that many data-parallel processes (torchrun; ``nodes`` > 1: one
    srun step over that many machines, experiments/grid_distributed.py)."""
    for run in chain.runs:
        status = run_status(run)
        if status == "done":
            continue
        t0 = time.time()
        try:
            epoch = None
            if run.stage == "eval":
                if run_status(chain.train) != "done":
                    raise ProtocolError("its training run has no result")
                epoch = load_epoch(run.model_dir)
            cmd = run.command(setup, epoch)
            cmd[2:2] = GRID_FLAGS  # [python, train.py, flags..., args...]
            if nproc > 1:  # data-parallel runs (#29): experiments/grid_distributed.py
                cmd = launch_command(cmd, nproc, nodes, step_opts)
        except ProtocolError as e:
            progress.done(run, f"{run.label}: not run: {e}", 0)
            continue
        progress.start(run, cmd, status, where)
        rc = _execute(cmd, run.out_dir, env, stream, worker)
        problem = None
        if rc != 0:
            hint = "" if stream else f"; see {osp.join(run.out_dir, 'console.txt')}"
            problem = f"{run.label}: train.py exited with {rc}{hint}"
        elif run_status(run) != "done":
            problem = f"{run.label}: train.py ended without a result line in {run.out_dir}"
        progress.done(run, problem, time.time() - t0)


# -- packed workers by default on a GPU -------------------------------------------------------
def gpu_count() -> int:
    """The GPUs this process would use: 0 without importing torch when ``CUDA_VISIBLE_DEVICES``
    hides them all or the machine shows no NVIDIA driver (neither ``/dev/nvidiactl`` nor
    ``nvidia-smi``), else ``torch.cuda.device_count()``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    import shutil

    if not osp.exists("/dev/nvidiactl") and shutil.which("nvidia-smi") is None:
        return 0
    import torch

    return torch.cuda.device_count()


def choose_in_process(
    in_process: bool | None, gpus: list[str] | None, nproc: int = 1, device_count=None
) -> tuple[bool, str]:
    """Whether the local grid packs each worker's runs into one long-lived process, and why.

    ``in_process``: ``--in-process`` (True), ``--processes`` (False) or neither (None: the
    default). The default packs on a GPU (``--gpus``, or a GPU visible to the grid,
    ``device_count()``, :func:`gpu_count` unless given): imports, the CLIP checkpoint read, the
    compiled graphs and the decoded images are then paid once per worker, not once per run.
    Without a GPU every run stays a ``train.py`` process (the CPU default), and data-parallel
    runs (``--gpus-per-run`` > 1) are always torchrun processes.
    """
    if in_process is not None:
        how = "--in-process" if in_process else "--processes"
        return in_process, f"{how} given"
    if nproc > 1:
        return False, "--gpus-per-run runs torchrun processes"
    if gpus:
        return True, f"the default with GPUs (--gpus: {','.join(gpus)}); --processes: one per run"
    count = (device_count or gpu_count)()
    if count > 0:
        return True, f"the default on a GPU ({count} visible); --processes: one per run"
    return False, "the default without a GPU; --in-process packs them"
