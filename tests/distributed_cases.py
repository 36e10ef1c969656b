"""The cases of the data-parallel equivalence suite (tests/test_distributed.py), importable by
the spawned gloo processes: build a trainer x optimizer on the tiny CLIPs, train a few steps
through the engine's own epoch code, and return what must equal the one-process run."""

from __future__ import annotations

import contextlib
import datetime
import os
import traceback

import torch
import torch.distributed as dist
from conftest import make_cfg
from helpers import DEPTH, tiny_options

import datasets  # noqa: F401  (registers the readers)
import trainers  # noqa: F401  (registers the trainers)
from engine import build_trainer, distributed
from engine.registry import TRAINER_REGISTRY

# OPTIM.SAM options of each family in the suite ("": the base optimizer alone)
FAMILIES = {
    "": [],
    "sam": [],
    "sagm": [],
    "fsam": ["OPTIM.SAM.LAMBDA", "0.5"],
    "sample": ["OPTIM.SAM.ALPHA", "0.05", "OPTIM.SAM.LAMBDA", "0.5"],
    "sample-k2": ["OPTIM.SAM.EVERY", "2"],
    "looksam": ["OPTIM.SAM.EVERY", "2"],
    "esam": ["OPTIM.SAM.GAMMA", "0.5"],
    "esam-masked": ["OPTIM.SAM.GAMMA", "0.5", "OPTIM.SAM.SELECT_PASS", "masked"],
    "rwp": ["OPTIM.SAM.NOISE", "0.1"],
    "mrwp": ["OPTIM.SAM.NOISE", "0.1"],
    "saf": ["OPTIM.SAM.EPOCHS_BACK", "1", "OPTIM.SAM.TEMPERATURE", "2"],
    "mesa": ["OPTIM.SAM.EMA_DECAY", "0.5", "OPTIM.SAM.TEMPERATURE", "2"],
    # m-sharpness: another method with several processes (in one process: SAM)
    "sam-local": ["DISTRIBUTED.LOCAL_ASCENT", "True"],
}
BATCH = 8  # 14 training items (7 classes x 2 shots): global batches of 8 and 6
EPOCHS = 2


def case_options(trainer, family, dtd_root, deep_opts, tmp) -> list[str]:
    name = family.split("-")[0]
    opts = ["--root", dtd_root, "--seed", "1", "--output-dir", os.path.join(tmp, "out")]
    opts += [*deep_opts, *tiny_options(trainer, _Path(tmp), DEPTH)]
    opts += ["OPTIM.SAM.NAME", name, "OPTIM.SAM.RHO", "0.5", *FAMILIES[family]]
    opts += ["OPTIM.MAX_EPOCH", str(EPOCHS), "DATASET.NUM_SHOTS", "2", "OPTIM.LR", "0.05"]
    opts += ["DATALOADER.TRAIN_X.BATCH_SIZE", str(BATCH), "OPTIM.NAME", "sgd"]
    opts += ["OPTIM.MOMENTUM", "0.9", "TEST.FEATURE_CACHE", "False", "OPTIM.WARMUP_EPOCH", "0"]
    return opts


class _Path(str):
    """A folder path with the ``/`` and ``mkdir`` that helpers.tiny_options uses."""

    def __truediv__(self, other):
        return _Path(os.path.join(self, other))

    def mkdir(self, exist_ok=False):
        os.makedirs(self, exist_ok=exist_ok)


def _to_dtype(tr, dtype) -> None:
    if hasattr(tr, "load_descriptions"):
        tr.load_descriptions()
    tr.model.to(dtype)
    for m in tr.model.modules():  # open_clip's fp32 LayerNorm: in the model's dtype (float64)
        if isinstance(m, torch.nn.LayerNorm):
            m.__class__ = torch.nn.LayerNorm
    for m in tr.model.modules():  # the models' recorded compute dtype
        if isinstance(m.__dict__.get("dtype"), torch.dtype):
            m.dtype = dtype


@contextlib.contextmanager
def keep_float64(dtype):
    """In a float64 case, ``Tensor.float()`` keeps float64 tensors (the trainers' fp32 casts of
    features and logits, e.g. CoPrompt's adapters): the whole step in float64, so the
    comparison sees the sync's rounding, not fp32's."""
    if dtype != torch.float64:
        yield
        return
    original = torch.Tensor.float

    def wide(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    torch.Tensor.float = wide
    try:
        yield
    finally:
        torch.Tensor.float = original


def run_case(trainer, family, dtype, dtd_root, deep_opts, tmp, evaluate=False) -> dict:
    """Train ``trainer`` with ``family`` for EPOCHS epochs as the engine's epoch loop does;
    returns the learnable state, the optimizer state and (``evaluate``) the test predictions."""
    with keep_float64(dtype):
        return _run_case(trainer, family, dtype, dtd_root, deep_opts, tmp, evaluate)


def _run_case(trainer, family, dtype, dtd_root, deep_opts, tmp, evaluate) -> dict:
    opts = case_options(trainer, family, dtd_root, deep_opts, tmp)
    tr = build_trainer(make_cfg(opts, trainer=trainer))
    if dtype != torch.float32:
        _to_dtype(tr, dtype)
    distributed.broadcast_state(tr)
    for tr.epoch in range(EPOCHS):
        tr.before_epoch()
        tr.run_epoch()
    out = {
        "params": {
            k: v.detach().clone() for k, v in tr.model.named_parameters() if v.requires_grad
        },
        "optim": next(o for o in tr._optims.values() if o is not None).state_dict(),
        "steps": len(tr.train_loader_x) * EPOCHS,
    }
    sync = tr.optim_step.grad_sync
    out["allreduces"] = sync.calls if sync is not None else None
    out["bytes"] = sync.bytes if sync is not None else None
    if evaluate:
        tr.evaluator.reset()
        out["accuracy"] = tr.test()
        out["preds"] = torch.cat(tr.evaluator._preds).cpu()
        out["labels"] = torch.cat(tr.evaluator._gts).cpu()
    return out


def trainable() -> list[str]:
    return sorted(
        n
        for n, cls in ((n, TRAINER_REGISTRY.get(n)) for n in TRAINER_REGISTRY)
        if not cls.EVAL_ONLY
        and not getattr(cls, "ALIAS_OF", "")
        and getattr(cls, "DATA_PARALLEL", True)  # SkipTuning: one process (it refuses more)
    )


def flat(obj) -> torch.Tensor:
    """Every tensor of ``obj`` (dicts, lists) flattened into one float64 vector."""
    parts = []
    if isinstance(obj, torch.Tensor):
        parts.append(obj.detach().double().reshape(-1))
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            parts.append(flat(obj[k]))
    elif isinstance(obj, (list, tuple)):
        parts.extend(flat(o) for o in obj)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        parts.append(torch.tensor([float(obj)], dtype=torch.float64))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def worker(rank, world, port, cases, dtd_root, deep_opts, out_dir) -> None:
    """One gloo process: every case in turn; rank 0 saves the results, every rank checks that
    the processes hold bit-identical parameters and optimizer state."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    results = {}
    try:
        for trainer, family, dtype, evaluate in cases:
            tmp = os.path.join(out_dir, f"r{rank}", f"{trainer}-{family}-{dtype}")
            os.makedirs(tmp, exist_ok=True)
            res = run_case(trainer, family, dtype, dtd_root, deep_opts, tmp, evaluate)
            mine = flat([res["params"], res["optim"]])
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            res["ranks_equal"] = all(torch.equal(every[0], e) for e in every)
            results[(trainer, family, str(dtype))] = res
    except BaseException:
        results["error"] = f"rank {rank}: {traceback.format_exc()}"
        raise
    finally:
        if rank == 0 or "error" in results:
            torch.save(results, os.path.join(out_dir, f"results-{world}-{rank}.pt"))
        dist.destroy_process_group()
