"""The grid on SLURM (``tools/grid.py --slurm``): one job per chain, submitted with submitit.

- **Submit**: a job array, one task per unfinished chain, asking for ``--slurm-gpus`` GPUs
  (0 for CPU partitions). Each job runs :class:`ChainJob`: the chain's unfinished runs, one
  train.py process each, output in each run's ``console.txt``; submitit's files (pickles, the
  job's log) go to ``<output>/slurm/<job id>/``. ``<output>/slurm/jobs.jsonl`` records every
  submitted chain (job id, runs, logs): ``--status`` and ``--slurm-wait`` read it. A failed
  submission (sbatch refused it) removes what it wrote there. Chains whose job is still queued
  or running are not submitted again.
- **Requeue** (preemption, ``scontrol requeue``, a node failure; jobs are submitted with
  ``--requeue``): SLURM starts the job's script again and the job runs its chain again. A
  finished run is skipped (its log has a result) and the run that was interrupted resumes from
  its rolling checkpoint (``model-last.pth.tar``, written every epoch), so at most one epoch is
  lost and nothing finished is trained twice. On SIGTERM a job stops without a result file, so
  submitit does not take the interrupted attempt for the job's end.
- **Time limit** (``--slurm-time``): SLURM sends submitit's signal (USR2) ``signal_delay_s``
  before the limit; :meth:`ChainJob.checkpoint` hands the same chain back to submitit, which
  requeues the job (at most ``--slurm-max-requeues`` times), and the chain continues as above.
  A chain longer than the time limit thus completes over several jobs' time.
- **Wait / status**: job states come from ``sacct`` (SLURM accounting; without it ``squeue``,
  which forgets a job once it ended) and the runs' results from the run folders.
"""

from __future__ import annotations

import contextlib
import json
import os
import os.path as osp
import re
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

from experiments.grid_distributed import step_options
from experiments.protocols import REPO, Chain, Setup, run_status
from experiments.results import read_run

JOBS_FILE = "jobs.jsonl"
# SLURM job states (sacct/squeue, first word) -> the chain's state while its runs are not done
QUEUED = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "SUSPENDED",
          "RESIZING", "SPECIAL_EXIT"}  # fmt: skip
RUNNING = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "STOPPED"}
CANCELLED = {"CANCELLED", "REVOKED"}
ENDS = ("done", "failed", "cancelled")


class JobStopped(BaseException):
    """SLURM stopped the job (requeue, preemption, scancel): no result is written, so submitit
    and the grid do not read the interrupted attempt as the job's outcome."""


# -- the job ----------------------------------------------------------------------------------
class ChainJob:
    """What a SLURM job runs: the unfinished runs of one chain (submitit pickles this object
    with the chain and the setup).

    ``checkpoint`` is submitit's hook for its time-limit/preemption signal: it returns the same
    call, which submitit requeues; the next attempt skips finished runs and resumes the
    interrupted one from its last epoch.
    """

    def __init__(self, nproc: int = 1, nodes: int = 1, step_opts=()):
        self.nproc = nproc  # data-parallel processes per run (#29: --gpus-per-run)
        self.nodes = nodes  # machines per run (#29: --nodes): one srun step per run
        self.step_opts = list(step_opts)  # the step's CPUs and GPUs (grid_distributed)

    def __call__(self, chain: Chain, setup: Setup) -> str:
        from experiments.grid_exec import Progress, execute_chain

        nodes = getattr(self, "nodes", 1)
        if nodes > 1 and int(os.environ.get("SLURM_PROCID") or 0) != 0:
            # a job over several nodes starts this on every node: the first runs the chain,
            # whose runs are srun steps over all of them
            return f"{chain.train.label}: task {os.environ['SLURM_PROCID']} (the runs' steps)"

        attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0) + 1
        todo = sum(run_status(r) != "done" for r in chain.runs)
        print(
            f"{chain.train.label}: attempt {attempt} on {socket.gethostname()}, "
            f"{todo} of {len(chain.runs)} runs to do",
            flush=True,
        )
        progress = Progress(todo)
        with _stop_on_sigterm():
            execute_chain(chain, setup, progress, stream=False, nproc=getattr(self, "nproc", 1),
                          nodes=nodes, step_opts=getattr(self, "step_opts", ()))  # fmt: skip
        if progress.failed:
            raise RuntimeError("\n".join(progress.failed))
        return f"{chain.train.label}: done"

    def checkpoint(self, chain: Chain, setup: Setup):
        from submitit.helpers import DelayedSubmission

        print(
            f"{chain.train.label}: time limit or preemption signal: back to submitit to requeue; "
            "the next attempt skips the finished runs and resumes the interrupted one",
            flush=True,
        )
        return DelayedSubmission(self, chain, setup)


@contextlib.contextmanager
def _stop_on_sigterm():
    """SIGTERM (SLURM ends the job: requeue, preemption, scancel) raises :class:`JobStopped`;
    the running train.py is killed (it got the signal too) and keeps its last checkpoint."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        print(f"signal {signal.Signals(signum).name}: SLURM ends this attempt", flush=True)
        raise JobStopped(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- submission -------------------------------------------------------------------------------
def slurm_folder(output: str) -> str:
    return osp.join(output, "slurm")


def submitit_params(args) -> dict:
    """The submitit parameters of ``tools/grid.py --slurm-*`` options."""
    from experiments.grid_exec import GridError

    if args.slurm_gpus < 0 or args.slurm_time < 1:
        raise GridError("--slurm-gpus must be >= 0 and --slurm-time >= 1 (minutes)")
    params = {
        "name": "sample-grid",
        "timeout_min": args.slurm_time,
        "tasks_per_node": 1,
        "cpus_per_task": args.slurm_cpus,
        "slurm_array_parallelism": args.slurm_parallel,
        # the time-limit signal: 90 s before the end, at most half of a short limit
        "slurm_signal_delay_s": min(90, args.slurm_time * 30),
        "slurm_additional_parameters": {"requeue": True},  # preempted jobs come back
        "slurm_setup": [
            f"cd {shlex.quote(os.getcwd())}",
            f"export PYTHONPATH={shlex.quote(REPO)}:${{PYTHONPATH:-}}",
        ],
    }
    if args.slurm_gpus:
        params["gpus_per_node"] = args.slurm_gpus
    nodes = getattr(args, "nodes", 1) or 1
    if nodes > 1:  # data-parallel runs over several machines (#29): one task per node here
        params["nodes"] = nodes
    if args.slurm_partition:
        params["slurm_partition"] = args.slurm_partition
    if args.slurm_mem:
        params["mem_gb"] = args.slurm_mem
    for item in args.slurm_param or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise GridError(f"--slurm-param {item!r}: use KEY=VALUE (a submitit parameter)")
        params[key] = int(value) if value.isdigit() else value
    return params


def submit(chains: list[Chain], setup: Setup, args) -> list:
    """Submit one job per chain (a job array) with submitit; returns the jobs.

    Chains are recorded in ``<output>/slurm/jobs.jsonl``; on a failed submission everything it
    wrote under ``<output>/slurm/`` is removed and a GridError names sbatch's complaint.
    """
    from experiments.grid_exec import GridError

    try:
        import submitit
    except ImportError as e:
        raise GridError(
            "--slurm needs the package submitit: pip install submitit (in requirements.txt)"
        ) from e
    params = submitit_params(args)
    folder = slurm_folder(setup.output)
    existed = osp.isdir(folder)
    before = set(os.listdir(folder)) if existed else set()
    try:
        executor = submitit.AutoExecutor(
            folder=osp.join(folder, "%j"),
            cluster=getattr(args, "slurm_cluster", None) or "slurm",
            slurm_max_num_timeout=args.slurm_max_requeues,
        )
        executor.update_parameters(**params)
        nproc = getattr(args, "gpus_per_run", 1) or 1  # data-parallel runs (#29)
        nodes = getattr(args, "nodes", 1) or 1
        job = ChainJob(nproc, nodes, step_options(args, nproc, nodes) if nodes > 1 else ())
        jobs = executor.map_array(job, chains, [setup] * len(chains))
    except Exception as e:
        _remove_new_files(folder, before, existed)
        if isinstance(e, GridError):
            raise
        raise GridError(
            f"SLURM submission failed ({type(e).__name__}): {str(e).strip()[-1500:]}\n"
            "Nothing was submitted and nothing is left in "
            f"{folder}. Check the --slurm-* options (e.g. --slurm-gpus 0 on a partition "
            "without GPUs, --slurm-partition)"
        ) from e
    records = [job_record(job.job_id, chain, setup.output) for job, chain in zip(jobs, chains)]
    os.makedirs(folder, exist_ok=True)
    with open(osp.join(folder, JOBS_FILE), "a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    for record in records:
        print(f"submitted job {record['job_id']}: {record['label']} "
              f"(+{len(record['runs']) - 1} evaluations)")  # fmt: skip
    return jobs


def _remove_new_files(folder: str, before: set, existed: bool) -> None:
    """Remove what a failed submission left in ``folder`` (pickles, sbatch files, job folders)."""
    if not osp.isdir(folder):
        return
    for name in set(os.listdir(folder)) - before:
        path = osp.join(folder, name)
        if osp.isdir(path) and not osp.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)
    if not existed:
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def job_record(job_id: str, chain: Chain, output: str) -> dict:
    """What ``jobs.jsonl`` keeps of a submitted chain."""
    logs = osp.join(slurm_folder(output), job_id, f"{job_id}_0_log")
    return {
        "job_id": str(job_id),
        "label": chain.train.label,
        "train_dir": chain.train.out_dir,
        "runs": [[r.out_dir, r.stage] for r in chain.runs],
        "log": f"{logs}.err",
        "submitted": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def read_records(output: str) -> list[dict]:
    """The latest submission of each chain recorded under ``output`` (submission order)."""
    latest: dict[str, dict] = {}
    path = osp.join(slurm_folder(output), JOBS_FILE)
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        for line in f:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                record = json.loads(line)
                latest.pop(record["train_dir"], None)
                latest[record["train_dir"]] = record
    return list(latest.values())


# -- SLURM's view -----------------------------------------------------------------------------
@dataclass
class JobInfo:
    state: str  # the current attempt's state (first word, e.g. CANCELLED of "CANCELLED by 0")
    requeues: int  # earlier attempts (sacct -D lists one line per attempt)


def _expand_ids(job_id: str) -> list[str]:
    """``12_3`` -> [``12_3``]; a pending array line ``12_[0-2,5%4]`` -> its tasks."""
    m = re.fullmatch(r"(\d+)_\[([\d,\-]+)(?:%\d+)?\]", job_id)
    if not m:
        return [job_id]
    ids = []
    for part in m.group(2).split(","):
        lo, _, hi = part.partition("-")
        ids += [f"{m.group(1)}_{i}" for i in range(int(lo), int(hi or lo) + 1)]
    return ids


def slurm_jobs(job_ids: list[str]) -> tuple[str, dict[str, JobInfo]]:
    """``(source, {job id: JobInfo})`` of the jobs SLURM knows, from ``sacct`` (source "sacct";
    ``squeue`` for jobs not in the accounting yet) or, without accounting, from ``squeue``
    alone (source "squeue": it forgets a job once it ended); ``("", {})`` when neither answers.

    A job known to neither ended without ever running (e.g. an array task cancelled while
    pending: it gets no accounting record).
    """
    mains = sorted({j.split("_")[0] for j in job_ids})
    if not mains:
        return "", {}
    cmd = ["sacct", "-X", "-D", "-n", "-P", "-o", "JobID,State", "-j", ",".join(mains)]
    out = _query(cmd)
    info: dict[str, JobInfo] = {}
    for line in (out or "").splitlines():
        jid, _, state = line.partition("|")
        for one in _expand_ids(jid.strip()):
            seen = info.get(one)
            info[one] = JobInfo((state.split() or ["UNKNOWN"])[0], seen.requeues + 1 if seen else 0)
    if out is None or any(j not in info for j in job_ids):
        queue = _query(["squeue", "-h", "-r", "-o", "%i|%T"])
        if queue is None and out is None:
            return "", {}
        for line in (queue or "").splitlines():
            jid, _, state = line.partition("|")
            jid = jid.strip()
            if jid in job_ids and jid not in info:
                info[jid] = JobInfo(state.strip() or "UNKNOWN", 0)
    return ("sacct" if out is not None else "squeue"), info


def _query(cmd: list[str]) -> str | None:
    """A SLURM command's output; None when it fails or hangs (without a slurm.conf, SLURM's
    commands retry for a minute)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def chain_state(record: dict, source: str, jobs: dict[str, JobInfo]) -> tuple[str, str]:
    """``(state, detail)`` of a recorded chain: done (every run has a result), queued, running,
    cancelled, failed, or ``unknown`` (SLURM cannot say and the runs are not all done)."""
    runs = record["runs"]
    done = sum(read_run(d, stage).status == "done" for d, stage in runs)
    detail = f"{done}/{len(runs)} runs done"
    if done == len(runs):
        return "done", detail
    info = jobs.get(record["job_id"])
    if info is None:
        if source == "sacct":  # no record and not queued: removed before it ever ran
            return "cancelled", detail + ", job removed before it started"
        if source == "squeue":  # without accounting, how an ended job ended is not known
            return "failed", detail + ", job ended (no SLURM accounting to tell how)"
        return "unknown", detail + ", SLURM not reachable"
    detail += f", SLURM {info.state}"
    if info.state in QUEUED:
        return "queued", detail
    if info.state in RUNNING:
        return "running", detail
    if info.state in CANCELLED:
        return "cancelled", detail
    return "failed", detail


def failure_logs(record: dict) -> str:
    """The logs to read for a chain that did not finish: the first unfinished run's console.txt
    and the job's log."""
    logs = []
    for out_dir, stage in record["runs"]:
        if read_run(out_dir, stage).status != "done":
            console = osp.join(out_dir, "console.txt")
            if osp.isfile(console):
                logs.append(console)
            break
    return ", ".join([*logs, record["log"]])


def live_jobs(output: str) -> dict[str, str]:
    """``{training run folder: job id}`` of recorded chains whose job is queued or running."""
    records = read_records(output)
    if not records:
        return {}
    source, jobs = slurm_jobs([r["job_id"] for r in records])
    return {
        r["train_dir"]: r["job_id"]
        for r in records
        if chain_state(r, source, jobs)[0] in ("queued", "running")
    }


# -- wait and status --------------------------------------------------------------------------
def _end_line(state: str, record: dict, detail: str) -> str:
    line = f"[{state}] job {record['job_id']}: {record['label']} ({detail})"
    if state == "failed":
        line += f"; logs: {failure_logs(record)}"
    elif state == "cancelled":
        line += "; the next invocation of the grid submits it again"
    return line


def wait(records: list[dict], poll_s: float = 30.0) -> int:
    """Wait until every recorded chain's job ended, printing each requeue and each chain's end
    (done, failed with its logs, cancelled); 0 when every chain is done, else 1."""
    from experiments.grid_exec import GridError

    source, _ = slurm_jobs([r["job_id"] for r in records])
    if not source:
        raise GridError("--slurm-wait: neither sacct nor squeue answers (is SLURM reachable?)")
    print(f"Waiting for {len(records)} jobs (SLURM states from {source}) ...", flush=True)
    ended: dict[str, str] = {}
    requeues = {r["job_id"]: 0 for r in records}
    while len(ended) < len(records):
        source, jobs = slurm_jobs([r["job_id"] for r in records])
        for record in records:
            jid = record["job_id"]
            if jid in ended:
                continue
            info = jobs.get(jid)
            if info and info.requeues > requeues[jid]:
                requeues[jid] = info.requeues
                print(f"[requeued] job {jid}: {record['label']} (attempt {info.requeues + 1})",
                      flush=True)  # fmt: skip
            state, detail = chain_state(record, source, jobs)
            job_over = info is None or info.state not in QUEUED | RUNNING
            if state in ENDS and (job_over or state != "done"):
                ended[jid] = state
                print(_end_line(state, record, detail), flush=True)
        if len(ended) < len(records):
            time.sleep(poll_s)
    counts = {s: sum(v == s for v in ended.values()) for s in ENDS}
    print(f"{len(records)} chains: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return 0 if counts["done"] == len(records) else 1


def status(output: str) -> int:
    """Print the state of every chain submitted from ``output`` (``tools/grid.py --status``)."""
    records = read_records(output)
    if not records:
        print(f"No SLURM submission recorded in {osp.join(slurm_folder(output), JOBS_FILE)}")
        return 0
    source, jobs = slurm_jobs([r["job_id"] for r in records])
    counts: dict[str, int] = {}
    for record in records:
        state, detail = chain_state(record, source, jobs)
        counts[state] = counts.get(state, 0) + 1
        info = jobs.get(record["job_id"])
        if info and info.requeues:
            detail += f", requeued {info.requeues}x"
        line = f"{state:>9}  job {record['job_id']}: {record['label']} ({detail})"
        if state in ("failed", "cancelled", "unknown"):
            line += f"\n{'':>11}logs: {failure_logs(record)}"
        print(line)
    where = f"SLURM states from {source}" if source else "SLURM not reachable: run folders only"
    order = ("queued", "running", "done", "failed", "cancelled", "unknown")
    summary = ", ".join(f"{counts[s]} {s}" for s in order if s in counts)
    print(f"{len(records)} chains: {summary} ({where})")
    return 0
