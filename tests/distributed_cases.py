"""The cases of the data-parallel equivalence suite (tests/test_distributed_equivalence.py),
importable by the spawned gloo processes: build a trainer x optimizer on the tiny CLIPs, train
a few steps through the engine's own epoch code, and return what must equal the one-process
run.

The families come from the optimizer registry (every registered sharpness-aware optimizer,
with SGD as its base, plus SGD alone), the trainers from the trainer registry, so a newly
registered optimizer or trainer joins the suite without an edit here.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import traceback
from typing import NamedTuple

import torch
import torch.distributed as dist
from conftest import make_cfg
from helpers import DEPTH, tiny_options

import datasets  # noqa: F401  (registers the readers)
import trainers  # noqa: F401  (registers the trainers)
from engine import build_trainer, distributed
from engine import compile as ec
from engine.registry import TRAINER_REGISTRY
from optim import list_optimizers

# OPTIM.SAM options of a family beyond the registry's defaults (the tiny runs' 4 steps must
# exercise the optimizer: a stage that starts at once, a lookahead within 4 steps, ...)
FAMILY_OPTIONS = {
    "fsam": ["OPTIM.SAM.LAMBDA", "0.5"],
    "sample": ["OPTIM.SAM.ALPHA", "0.05", "OPTIM.SAM.LAMBDA", "0.5"],
    "looksam": ["OPTIM.SAM.EVERY", "2"],
    "esam": ["OPTIM.SAM.GAMMA", "0.5"],
    "rwp": ["OPTIM.SAM.NOISE", "0.1"],
    "mrwp": ["OPTIM.SAM.NOISE", "0.1"],
    "saf": ["OPTIM.SAM.EPOCHS_BACK", "1", "OPTIM.SAM.TEMPERATURE", "2"],
    "mesa": ["OPTIM.SAM.EMA_DECAY", "0.5", "OPTIM.SAM.TEMPERATURE", "2"],
}
# variants of a family (name "<family>-<variant>"), run on CoOp
VARIANT_OPTIONS = {
    "sample-k2": ["OPTIM.SAM.ALPHA", "0.05", "OPTIM.SAM.EVERY", "2"],
    "esam-masked": ["OPTIM.SAM.GAMMA", "0.5", "OPTIM.SAM.SELECT_PASS", "masked"],
    "sam-adaptive": ["OPTIM.SAM.ADAPTIVE", "True"],
    # m-sharpness: another method with several processes (in one process: SAM)
    "sam-local": ["DISTRIBUTED.LOCAL_ASCENT", "True"],
}
BASE = "sgd"  # the papers' base optimizer: the base of every sharpness-aware family
BATCH = 8  # 14 training items (7 classes x 2 shots): global batches of 8 and 6
EPOCHS = 2
PRECISIONS = ("float64", "fp32", "fp16", "amp", "bf16")  # float64: fp32 run in float64


class Case(NamedTuple):
    """One run of the suite. ``prec``: one of PRECISIONS; ``compile``: MODEL.COMPILE;
    ``resume``: the run is cut after its first epoch and resumed from the checkpoint that the
    previous process count wrote (the chain 1 -> 2 -> 3 -> 1 of the suite); ``cache``: the
    evaluation features through the on-disk cache (one writer)."""

    trainer: str
    family: str
    prec: str = "float64"
    evaluate: bool = False
    compile: str = "off"
    resume: bool = False
    cache: bool = False

    @property
    def id(self) -> str:
        flags = [f for f, on in (("eval", self.evaluate), ("resume", self.resume),
                                 ("cache", self.cache)) if on]  # fmt: skip
        comp = [] if self.compile == "off" else [self.compile]
        return "-".join([self.trainer, self.family or "none", self.prec, *comp, *flags])


def families() -> list[str]:
    """SGD alone and every registered sharpness-aware optimizer (the registry's order)."""
    return [BASE, *(s.name for s in list_optimizers("sharpness"))]


def base_optimizers() -> list[str]:
    """Every registered base optimizer other than SGD (run alone, on CoOp)."""
    return [s.name for s in list_optimizers("base") if s.name != BASE]


def family_options(family: str) -> list[str]:
    """OPTIM options of ``family``: a base optimizer's name, or a sharpness-aware optimizer's
    (with its variant) over SGD."""
    bases = {s.name for s in list_optimizers("base")}
    if family in bases:
        return ["OPTIM.NAME", family, "OPTIM.SAM.NAME", ""]
    name = family.split("-")[0]
    extra = VARIANT_OPTIONS[family] if family in VARIANT_OPTIONS else FAMILY_OPTIONS.get(name, [])
    return ["OPTIM.NAME", BASE, "OPTIM.SAM.NAME", name, *extra]


def two_pass(family: str) -> bool:
    name = family.split("-")[0]
    return any(s.name == name and s.needs_closure for s in list_optimizers("sharpness"))


def case_options(case: Case, dtd_root, deep_opts, tmp) -> list[str]:
    node = TRAINER_REGISTRY.get(case.trainer).config_node()
    opts = ["--root", dtd_root, "--seed", "1", "--output-dir", os.path.join(tmp, "out")]
    opts += [*deep_opts, *tiny_options(case.trainer, _Path(tmp), DEPTH)]
    if case.prec != "float64":  # float64: built in the trainer's default, then converted
        opts += [f"TRAINER.{node}.PREC", case.prec]
    opts += ["MODEL.COMPILE", case.compile]
    opts += ["OPTIM.SAM.RHO", "0.5", *family_options(case.family)]
    opts += ["OPTIM.MAX_EPOCH", str(EPOCHS), "DATASET.NUM_SHOTS", "2", "OPTIM.LR", "0.05"]
    opts += ["DATALOADER.TRAIN_X.BATCH_SIZE", str(BATCH), "OPTIM.WARMUP_EPOCH", "0"]
    opts += ["OPTIM.MOMENTUM", "0.9", "TEST.FEATURE_CACHE", str(case.cache)]
    opts += ["TEST.FEATURE_CACHE_DIR", os.path.join(tmp, "feature_cache")]
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
def keep_float64(prec: str):
    """In a float64 case, ``Tensor.float()`` keeps float64 tensors (the trainers' fp32 casts of
    features and logits, e.g. CoPrompt's adapters): the whole step in float64, so the
    comparison sees the sync's rounding, not fp32's."""
    if prec != "float64":
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


def build(case: Case, dtd_root, deep_opts, tmp):
    """The case's trainer as the engine builds it (float64: converted after the build); an amp
    case's GradScaler starts at 2**10: the default 2**16 overflows the tiny fp16 model's steps,
    and where the scale sits at the overflow's edge a shard's fp16 backward can overflow where
    the whole batch's does not (or the reverse), so one process and N would skip different
    steps (every process of a run always skips alike: they check the same reduced gradient)."""
    tr = build_trainer(make_cfg(case_options(case, dtd_root, deep_opts, tmp), trainer=case.trainer))
    if case.prec == "float64":
        _to_dtype(tr, torch.float64)
    if case.prec == "amp":
        tr.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    return tr


def _record_scales(tr) -> list[float]:
    """The GradScaler's scale after every update (a skipped step halves it)."""
    scales: list[float] = []
    scaler = tr.optim_step.scaler
    if scaler is None:
        return scales
    update = scaler.update

    def recorded(*args, **kwargs):
        update(*args, **kwargs)
        scales.append(float(scaler.get_scale()))

    scaler.update = recorded
    return scales


def run_case(case: Case, dtd_root, deep_opts, tmp, save_to: str = "", resume_from: str = ""):
    """Train ``case`` for EPOCHS epochs as the engine's epoch loop does; returns the learnable
    state, the optimizer state, the step's state (GradScaler), the scales, the all-reduces and
    (``evaluate``) the test predictions.

    ``save_to``: also train the first epoch alone and checkpoint it there (rank 0 writes, as in
    a run). ``resume_from``: the returned run starts from the epoch-1 checkpoint there."""
    with keep_float64(case.prec):
        if save_to:
            tr = build(case, dtd_root, deep_opts, os.path.join(tmp, "first"))
            distributed.broadcast_state(tr)
            _epochs(tr, 0, 1)
            if distributed.is_main_process():
                tr.save_model(0, save_to)
            distributed.barrier()  # the checkpoint is on disk for every process
        return _run_case(case, dtd_root, deep_opts, tmp, resume_from)


def _epochs(tr, start: int, stop: int) -> None:
    for tr.epoch in range(start, stop):
        tr.before_epoch()
        tr.run_epoch()


def _run_case(case: Case, dtd_root, deep_opts, tmp, resume_from: str) -> dict:
    tr = build(case, dtd_root, deep_opts, tmp)
    start = tr.resume_model_if_exist(resume_from) if resume_from else 0
    assert start == (1 if resume_from else 0), (resume_from, start)
    distributed.broadcast_state(tr)
    begin = flat(learnable(tr))
    scales = _record_scales(tr)
    if case.compile != "off":
        tr.compile_model()
    _epochs(tr, start, EPOCHS)
    out = {
        "begin": begin,
        "params": learnable(tr),
        "optim": next(o for o in tr._optims.values() if o is not None).state_dict(),
        "step_state": tr.optim_step.state_dict(),
        "scales": scales,
        "steps": len(tr.train_loader_x) * (EPOCHS - start),
    }
    sync = tr.optim_step.grad_sync
    out["allreduces"] = sync.calls if sync is not None else None
    out["bytes"] = sync.bytes if sync is not None else None
    if case.compile != "off":
        forwards = ec.compiled_forwards(tr.model)
        out["compiled"] = sorted(forwards)
        out["fallback"] = {n: f.fallback for n, f in forwards.items() if f.fallback}
    if case.evaluate or case.cache:
        out.update(evaluate(tr, case))
    return out


def evaluate(tr, case: Case) -> dict:
    """The test set's accuracy, predictions and labels; a ``cache`` case evaluates twice (the
    second time from the cache) and counts this process's writes of the cache."""
    saves = []
    if case.cache:
        from engine.feature_cache import FeatureCache

        save = FeatureCache.save

        def counted(self, key, features, labels):
            saves.append(key)
            save(self, key, features, labels)

        FeatureCache.save = counted
    try:
        out = {}
        for _ in range(2 if case.cache else 1):
            tr.evaluator.reset()
            out["accuracy"] = tr.test()
            out["preds"] = torch.cat(tr.evaluator._preds).cpu()
            out["labels"] = torch.cat(tr.evaluator._gts).cpu()
            out.setdefault("first_preds", out["preds"])
    finally:
        if case.cache:
            FeatureCache.save = save
    if case.cache:
        folder = tr.cfg.TEST.FEATURE_CACHE_DIR
        out["cache_saves"] = len(saves)
        out["cache_files"] = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return out


def learnable(tr) -> dict:
    return {k: v.detach().clone() for k, v in tr.model.named_parameters() if v.requires_grad}


def trainable() -> list[str]:
    return sorted(
        n
        for n, cls in ((n, TRAINER_REGISTRY.get(n)) for n in TRAINER_REGISTRY)
        if not cls.EVAL_ONLY
        and not getattr(cls, "ALIAS_OF", "")
        and getattr(cls, "DATA_PARALLEL", True)  # SkipTuning: one process (it refuses more)
    )


def flat(obj) -> torch.Tensor:
    """Every tensor and number of ``obj`` (dicts, lists) flattened into one float64 vector."""
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


def state(res: dict) -> torch.Tensor:
    """What must be equal: parameters, optimizer state and the step's state (GradScaler)."""
    return flat([res["params"], res["optim"], res["step_state"]])


def checkpoint_dir(root: str, world: int, case: Case) -> str:
    return os.path.join(root, f"ckpt-{world}", case.id)


def worker(rank, world, port, cases, dtd_root, deep_opts, out_dir, ckpt_root, previous) -> None:
    """One gloo process: every case in turn, in one process group; rank 0 saves the results,
    every rank checks that the processes hold bit-identical parameters and optimizer state.
    A ``resume`` case checkpoints its first epoch under ``ckpt_root`` and resumes from the
    checkpoint that the run with ``previous`` processes wrote there."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    results = {}
    try:
        for case in cases:
            # a folder per process, the feature cache's too: as on nodes without a shared disk
            tmp = os.path.join(out_dir, f"r{rank}", case.id)
            os.makedirs(tmp, exist_ok=True)
            kw = {}
            if case.resume:
                kw = dict(save_to=checkpoint_dir(ckpt_root, world, case),
                          resume_from=checkpoint_dir(ckpt_root, previous, case))  # fmt: skip
            res = run_case(case, dtd_root, deep_opts, tmp, **kw)
            mine = state(res)
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            res["ranks_equal"] = all(torch.equal(every[0], e) for e in every)
            if case.cache:  # every process's count of cache writes
                saves = [None] * world
                dist.all_gather_object(saves, (res["cache_saves"], res["cache_files"]))
                res["cache_by_rank"] = saves
            results[case] = res
            if rank == 0:
                print(f"{world} processes: {case.id}", flush=True)
    except BaseException:
        results["error"] = f"rank {rank}: {traceback.format_exc()}"
        raise
    finally:
        if rank == 0 or "error" in results:
            torch.save(results, os.path.join(out_dir, f"results-{world}-{rank}.pt"))
        dist.destroy_process_group()
