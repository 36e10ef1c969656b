"""The cost of a grid's plan before it runs, and the estimate against the actual at the end.

``tools/grid.py`` (its ``--dry-run`` too) prints, for the runs it is about to run::

    Estimate: 24 runs (12 trainings, 9,600 steps): 1.85 GPU-hours of runs, about 0.47 h of
    wall time on 4 workers; costs from 12 cost.json of earlier runs on this host (0 runs at
    the default costs)

A run costs ``fixed + steps x step``:

- ``steps``: a training run's optimizer steps, from its merged config (``OPTIM.MAX_EPOCH`` plus
  the stage-2 epochs, the batch size and ``DROP_LAST``) and the size of its few-shot training
  set (shots x classes; the base half of the classes, rounded up, with
  ``DATASET.SUBSAMPLE_CLASSES base``; the class count from the dataset reader's layout). A
  resumed run counts the steps its ``cost.json`` has not recorded yet; an evaluation has none;
  a run whose size is unknown (a folder dataset, ``NUM_SHOTS`` <= 0) counts its fixed cost only
  and is named in the line;
- ``step`` and ``fixed``: from the ``cost.json`` of earlier training runs under the grid's output
  root (``mean_step_s``, and ``wall_s - train_time_s``: start-up, final test and exit), taken
  from this host's records when there are any, else from every host's; the closest match wins
  (same device, trainer, optimizer and batch size; then device, trainer and optimizer; then
  device and optimizer; then device), as the median of its records. Without any record for the
  device: :data:`DEFAULT_STEP_S` and :data:`DEFAULT_FIXED_S`. An evaluation run costs the fixed
  cost of its training (a start-up and a test);
- the wall time packs the chains (a training and its evaluations, run in order) onto the
  workers, longest first, each onto the least loaded worker.

After the grid ran, :func:`report_actual` prints the measured wall time and the runs' own times
(``wall_s`` of their ``cost.json``) beside the estimate.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
from dataclasses import dataclass, field

# Costs without any cost.json of the device. cuda: the issue-30 H200 measurements of a
# ViT-B/16 fp16 CoOp run, eager (SGD step 35 ms, SAMPLe 56 ms = 1.6x) and ~30 s of a whole
# process around the steps. cpu: no measured ViT-B/16 anchor (a rough 10 s per step of 32
# images); replaced by measured costs as soon as one run on the machine finished.
DEFAULT_STEP_S = {"cuda": 0.035, "cpu": 10.0}
DEFAULT_FIXED_S = {"cuda": 30.0, "cpu": 30.0}
TWO_PASS = ("sam", "fsam", "sagm", "sample", "gsam", "gam")  # default step x TWO_PASS_RATIO
TWO_PASS_RATIO = 1.6
COST_FILE = "cost.json"


@dataclass
class RunEstimate:
    """One run of the plan: ``seconds = fixed_s + steps * step_s`` (steps None: unknown)."""

    label: str
    stage: str
    steps: int | None
    step_s: float
    fixed_s: float
    measured: bool  # the costs come from cost.json records (else the defaults)

    @property
    def seconds(self) -> float:
        return self.fixed_s + (self.steps or 0) * self.step_s


@dataclass
class PlanEstimate:
    """The estimate of a plan: its runs, chains (indices into ``runs``), workers and device."""

    runs: list[RunEstimate] = field(default_factory=list)
    chains: list[list[int]] = field(default_factory=list)
    slots: int = 1
    device: str = "cpu"
    records: int = 0
    this_host: bool = False

    @property
    def run_seconds(self) -> float:
        return sum(r.seconds for r in self.runs)

    @property
    def wall_seconds(self) -> float:
        return packed_wall([sum(self.runs[i].seconds for i in c) for c in self.chains], self.slots)

    def describe(self) -> str:
        trainings = [r for r in self.runs if r.stage == "train"]
        steps = sum(r.steps or 0 for r in trainings)
        unit = "GPU" if self.device == "cuda" else "CPU"
        source = f"{self.records} cost.json of earlier runs" + (
            " on this host" if self.this_host else ""
        )
        defaults = sum(not r.measured for r in self.runs)
        line = (
            f"Estimate: {len(self.runs)} runs ({len(trainings)} trainings, {steps:,} steps): "
            f"{self.run_seconds / 3600:.2f} {unit}-hours of runs, about "
            f"{self.wall_seconds / 3600:.2f} h of wall time on {self.slots} worker(s); costs from "
            f"{source} ({defaults} runs at the default costs)"
        )
        unknown = [r.label for r in trainings if r.steps is None]
        if unknown:
            line += (
                f"; {len(unknown)} training(s) of unknown size counted at their fixed cost only "
                f"(e.g. {unknown[0]})"
            )
        return line


def packed_wall(durations: list[float], slots: int) -> float:
    """Wall time of jobs of ``durations`` on ``slots`` workers, longest first onto the least
    loaded worker."""
    loads = [0.0] * max(slots, 1)
    for d in sorted(durations, reverse=True):
        i = loads.index(min(loads))
        loads[i] += d
    return max(loads)


def cost_records(root: str) -> list[dict]:
    """The ``cost.json`` under ``root`` that have steps and a step time."""
    import json

    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "tensorboard"]
        if COST_FILE in files:
            try:
                with open(os.path.join(folder, COST_FILE)) as f:
                    cost = json.load(f)
            except (OSError, ValueError):
                continue
            if isinstance(cost, dict) and cost.get("steps") and cost.get("mean_step_s"):
                found.append(cost)
    return found


def _median(values) -> float | None:
    values = [v for v in values if isinstance(v, (int, float)) and v >= 0]
    return statistics.median(values) if values else None


def fixed_cost(record: dict) -> float | None:
    """A training run's seconds outside its training epochs (start-up, final test, exit)."""
    wall, train = record.get("wall_s"), record.get("train_time_s")
    if wall is None or train is None:
        return None
    return max(wall - train, 0.0)


class CostModel:
    """Step and fixed costs from ``records`` (this host's, when it has any), else defaults."""

    def __init__(self, records: list[dict], device: str, host: str | None = None):
        host = host or socket.gethostname()
        mine = [r for r in records if r.get("host") == host]
        self.records = mine or records
        self.this_host = bool(mine)
        self.device = device

    def _groups(self, trainer: str, optimizer: str, batch: int | None):
        same = [r for r in self.records if r.get("device") == self.device]
        yield [
            r
            for r in same
            if (r.get("trainer"), r.get("optimizer"), r.get("batch_size"))
            == (trainer, optimizer, batch)
        ]
        yield [r for r in same if (r.get("trainer"), r.get("optimizer")) == (trainer, optimizer)]
        yield [r for r in same if r.get("optimizer") == optimizer]
        yield same

    def costs(self, trainer: str, optimizer: str, batch: int | None) -> tuple[float, float, bool]:
        """``(step_s, fixed_s, measured)`` of a run."""
        step = fixed = None
        for group in self._groups(trainer, optimizer, batch):
            if step is None:
                step = _median(r.get("mean_step_s") for r in group)
            if fixed is None:
                fixed = _median(fixed_cost(r) for r in group)
        measured = step is not None
        if step is None:
            ratio = TWO_PASS_RATIO if optimizer in TWO_PASS else 1.0
            step = DEFAULT_STEP_S.get(self.device, DEFAULT_STEP_S["cpu"]) * ratio
        if fixed is None:
            fixed = DEFAULT_FIXED_S.get(self.device, DEFAULT_FIXED_S["cpu"])
        return step, fixed, measured


def dataset_classes(cfg) -> int | None:
    """The class count of ``cfg``'s dataset from its reader's layout (None: unknown)."""
    from engine.registry import DATASET_REGISTRY

    if cfg.DATASET.NAME not in DATASET_REGISTRY:
        return None
    layout = getattr(DATASET_REGISTRY.get(cfg.DATASET.NAME), "layout", None)
    n = getattr(layout, "num_classes", 0)
    return n or None


def training_steps(cfg) -> int | None:
    """Optimizer steps of a training run of ``cfg`` (None: its training set's size is unknown)."""
    from optim.staging import total_epochs

    n = dataset_classes(cfg)
    if n is None or cfg.DATASET.NUM_SHOTS <= 0:
        return None
    if cfg.DATASET.SUBSAMPLE_CLASSES == "base":
        n = math.ceil(n / 2)
    images, batch = n * cfg.DATASET.NUM_SHOTS, cfg.DATALOADER.TRAIN_X.BATCH_SIZE
    drop = cfg.DATALOADER.TRAIN_X.DROP_LAST and images >= batch
    per_epoch = images // batch if drop else math.ceil(images / batch)
    return per_epoch * total_epochs(cfg.OPTIM)


def estimate_plan(chains, setup, device: str, slots: int, records: list[dict] | None = None):
    """The :class:`PlanEstimate` of the runs of ``chains`` that are not done."""
    import datasets  # noqa: F401  (registers the readers)
    import trainers  # noqa: F401  (registers the trainers)
    from engine.cli import build_parser, setup_cfg
    from engine.cost import read_cost
    from experiments.protocols import run_status

    records = cost_records(setup.output) if records is None else records
    model = CostModel(records, device)
    plan = PlanEstimate(slots=slots, device=device, records=len(model.records))
    plan.this_host = model.this_host
    configs: dict[tuple, tuple] = {}
    for chain in chains:
        todo = [r for r in chain.runs if run_status(r) != "done"]
        if not todo:
            continue
        train = chain.train
        command = train.command(setup)[2:]
        key = tuple(command)  # without the seed and the folder: the same config
        key = tuple("" if k and key[k - 1] in ("--seed", "--output-dir") else a
                    for k, a in enumerate(key))  # fmt: skip
        if key not in configs:
            try:
                cfg = setup_cfg(build_parser().parse_args(command))
            except Exception:  # noqa: BLE001  (the pre-flight check reports bad configs)
                cfg = None
            steps = training_steps(cfg) if cfg is not None else None
            batch = cfg.DATALOADER.TRAIN_X.BATCH_SIZE if cfg is not None else None
            optimizer = (cfg.OPTIM.SAM.NAME or cfg.OPTIM.NAME) if cfg is not None else train.optim
            configs[key] = (steps, model.costs(train.trainer, optimizer, batch))
        steps, (step_s, fixed_s, measured) = configs[key]
        indices = []
        for run in todo:
            n = steps if run.stage == "train" else 0
            if run.stage == "train" and n is not None:
                done = (read_cost(run.out_dir) or {}).get("steps") or 0
                n = max(n - done, 0)
            plan.runs.append(RunEstimate(run.label, run.stage, n, step_s, fixed_s, measured))
            indices.append(len(plan.runs) - 1)
        plan.chains.append(indices)
    return plan


def plan_slots(args, detect_gpus=None) -> int:
    """Workers the grid will run at once (SLURM: ``--slurm-parallel``); ``--gpus auto`` counts
    the GPUs that ``detect_gpus("auto")`` finds (tools/grid.py's; none given: one)."""
    if getattr(args, "slurm", False):
        return max(getattr(args, "slurm_parallel", 1), 1)
    gpus = getattr(args, "gpus", None)
    if gpus and gpus != "auto":
        return len([g for g in gpus.split(",") if g.strip()]) * max(args.per_gpu, 1)
    if gpus == "auto":
        try:
            found = (detect_gpus("auto") if detect_gpus else None) or []
        except Exception:  # noqa: BLE001  (no nvidia-smi: counted as one worker)
            found = []
        return max(len(found), 1) * max(args.per_gpu, 1)
    return max(getattr(args, "workers", 1), 1)


def plan_device(args) -> str:
    """The device the grid's runs train on: cuda with GPUs (or SLURM GPUs), else cpu."""
    if getattr(args, "gpus", None):
        return "cuda"
    if getattr(args, "slurm", False) and getattr(args, "slurm_gpus", 0) > 0:
        return "cuda"
    return "cpu"


def report_plan(chains, setup, args, detect_gpus=None) -> PlanEstimate | None:
    """Print the estimate of the plan (before the grid runs); None when nothing is to run."""
    plan = estimate_plan(chains, setup, plan_device(args), plan_slots(args, detect_gpus))
    if plan.runs:
        print(plan.describe(), flush=True)
        return plan
    return None


def report_actual(plan: PlanEstimate | None, chains, wall_s: float) -> str:
    """Print the grid's measured wall time and its training runs' own times (``wall_s`` of their
    cost.json) beside the estimate; returns the line."""
    if plan is None:
        return ""
    from engine.cost import read_cost

    estimated = {r.label: r for r in plan.runs}
    own, est = 0.0, 0.0
    for chain in chains:
        run = chain.train
        cost = read_cost(run.out_dir) or {}
        if run.label in estimated and cost.get("wall_s") is not None:
            own += sum(s.get("wall_s") or 0.0 for s in cost.get("segments", [])) or cost["wall_s"]
            est += estimated[run.label].seconds
    line = (
        f"Actual: {wall_s / 3600:.3f} h of wall time (estimated {plan.wall_seconds / 3600:.3f} h, "
        f"x{wall_s / plan.wall_seconds:.2f})"
    )
    if est:
        line += (
            f"; training runs {own / 3600:.3f} h by their cost.json (estimated "
            f"{est / 3600:.3f} h, x{own / est:.2f})"
        )
    print(line, flush=True)
    return line
