"""The data-parallel equivalence suite (docs/distributed.md): gloo processes against one
process, same global batch (8 of 14 items: steps of 8 and 6 items) and seed, 4 steps.

Every case of a process count runs in one process group (spawned once, the cases in a loop);
each case compares the learnable parameters, the whole optimizer state and the step's state
(amp's GradScaler), bit-identical across the processes and equal to the one-process run:
float64 runs to 1e-11 (relative to the state's largest number), fp32 / fp16 / amp / bf16 runs
to their own rounding (3x the distance between the one-process run in that precision and in
float64), amp's scales (its skipped steps) exactly; evaluation (predictions, accuracy) equal.

- fast: 3 processes (uneven shards 3, 3, 2 then 2, 2, 2): the per-item optimizers (ESAM's
  global selection, SAF's records), m-sharpness, a resume 1 -> 3 -> 1 and the feature cache
  written once.
- slow: every registered trainer x every optimizer family (SGD alone and every registered
  sharpness-aware optimizer) on 2 and 3 processes, the other base optimizers and the variants
  on CoOp, resumes 1 -> 2 -> 3 -> 1; the precisions and the compiled path.
"""

from __future__ import annotations

import os
import os.path as osp
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from distributed_cases import (
    VARIANT_OPTIONS,
    Case,
    base_optimizers,
    checkpoint_dir,
    families,
    flat,
    run_case,
    state,
    trainable,
    two_pass,
    worker,
)

# float64: relative to the largest floating number of the compared state. 1e-11, not 1e-12:
# ESAM's and LookSAM's rho-0.5 ascents along normalised directions of gradients that cancel to
# about 1e-4 of their terms amplify float64's rounding to ~5e-12 (the others: ~1e-13)
F64_TOL = 1e-11


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_process(case: Case, dtd_root, deep_opts, root, **kw) -> dict:
    return run_case(case, dtd_root, deep_opts, osp.join(root, "one", case.id), **kw)


def spawn(world: int, previous: int, cases, dtd_root, deep_opts, root) -> dict:
    out = osp.join(root, f"world{world}")
    os.makedirs(out)
    args = (world, free_port(), cases, dtd_root, deep_opts, out, root, previous)
    mp.spawn(worker, args=args, nprocs=world, join=True)
    return torch.load(osp.join(out, f"results-{world}-0.pt"), weights_only=False)


def compare(cases, worlds, dtd_root, deep_opts, root) -> list[tuple]:
    """Run ``cases`` in one process, then in one group of each of ``worlds`` gloo processes
    (a resume case resumes from the checkpoint of the previous count: 1 -> worlds[0] -> ...,
    and at the end the last count's checkpoint in one process); assert that they agree.
    Returns the table rows (case, processes, max abs difference, tolerance, all-reduces,
    bytes of one all-reduce)."""
    root = str(root)
    refs = {}
    for case in cases:
        save = checkpoint_dir(root, 1, case) if case.resume else ""
        refs[case] = one_process(case, dtd_root, deep_opts, root, save_to=save)
        print(f"one process: {case.id}", flush=True)
        if case.prec != "float64":  # the precision's own rounding: against the float64 run
            wide = case._replace(prec="float64", compile="off", resume=False, cache=False)
            if wide not in refs:
                refs[wide] = one_process(wide, dtd_root, deep_opts, root)
    rows = []
    previous = 1
    for world in worlds:
        got = spawn(world, previous, cases, dtd_root, deep_opts, root)
        print(f"{world} processes: {len(cases)} cases", flush=True)
        for case in cases:
            rows.append(check(case, world, refs, got[case]))
        previous = world
    for case in (c for c in cases if c.resume):  # the last count's checkpoint in one process
        back = one_process(case, dtd_root, deep_opts, osp.join(root, "back"),
                           resume_from=checkpoint_dir(root, previous, case))  # fmt: skip
        back["ranks_equal"] = True
        rows.append(check(case, -previous, refs, back))
    return rows


def check(case: Case, world: int, refs: dict, b: dict) -> tuple:
    """Assert that ``b`` (the run on ``world`` processes; negative: resumed from it in one)
    equals the one-process run of ``case``; the table row."""
    a = refs[case]
    where = (case.id, world)
    assert b["ranks_equal"], where  # every process holds the same parameters and state
    x, y = state(a), state(b)
    assert x.shape == y.shape, where
    diff = float((x - y).abs().max())
    calls = b["allreduces"]
    if world > 0 and case.family not in ("looksam", "sample-k2") and not case.resume:
        passes = 1 if case.family.endswith("-local") or not two_pass(case.family) else 2
        if case.prec == "amp":  # a step whose first pass overflows has no second pass
            assert a["steps"] <= calls <= a["steps"] * passes, (where, calls)
        else:  # lookahead (excluded above): the second pass every 2 steps
            assert calls == a["steps"] * passes, (where, calls)
    if case.family.endswith("-local") and world > 0:  # m-sharpness: each process's own ascent
        assert diff > 1e-6, (where, diff)  # another method
        return (case, world, diff, None, calls, b["bytes"])
    assert not torch.equal(flat(b["params"]), b["begin"]), where  # trained
    if case.prec == "float64":
        tol = F64_TOL * max(1.0, magnitude(a))
        assert diff <= tol, (where, diff, tol)
    else:
        # amp: the same scales after every step, so the same steps skipped
        assert b["scales"] == a["scales"], (where, a["scales"], b["scales"])
        assert flat(b["step_state"]).tolist() == flat(a["step_state"]).tolist(), where
        if case.prec == "amp":
            print(f"amp {where}: scales {b['scales']}, skipped steps {skipped(b['scales'])}")
        wide = refs[case._replace(prec="float64", compile="off", resume=False, cache=False)]
        tol = 0.0
        for key in ("params", "optim"):
            rounding = float((flat(a[key]) - flat(wide[key])).abs().max())
            d = float((flat(a[key]) - flat(b[key])).abs().max())
            assert d <= 3 * rounding + 1e-7, (where, key, d, rounding)
            tol = max(tol, 3 * rounding + 1e-7)
        both = flat([a["params"], a["optim"]]), flat([b["params"], b["optim"]])
        diff = float((both[0] - both[1]).abs().max())
    if case.compile != "off":
        assert b["compiled"] and not b["fallback"], (where, b["compiled"], b["fallback"])
    if "preds" in b and case.prec == "float64":
        assert torch.equal(a["preds"], b["preds"]) and torch.equal(a["labels"], b["labels"])
        assert a["accuracy"] == b["accuracy"], where
    if case.cache and world > 0:
        saves = b["cache_by_rank"]
        assert saves[0][0] == 1 and len(saves[0][1]) == 1, saves  # rank 0 wrote it, once
        assert all(n == 0 and not files for n, files in saves[1:]), saves  # the others: never
        assert torch.equal(b["first_preds"], b["preds"])  # read back: the same predictions
    return (case, world, diff, tol, calls, b["bytes"])


def magnitude(res: dict) -> float:
    """The largest floating number of the parameters and optimizer state (not the generators'
    byte states)."""
    found = [0.0]

    def walk(obj):
        if isinstance(obj, torch.Tensor) and obj.is_floating_point() and obj.numel():
            found.append(float(obj.detach().abs().max()))
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk([res["params"], res["optim"]])
    return max(found)


def skipped(scales: list[float]) -> int:
    """amp's skipped steps: the updates that lowered the scale."""
    return sum(b < a for a, b in zip(scales, scales[1:]))


def report(rows) -> None:
    for case, world, diff, tol, calls, nbytes in rows:
        procs = f"{world}" if world > 0 else f"{-world}->1 (resumed)"
        limit = "different (another method)" if tol is None else f"tol {tol:.1e}"
        print("equivalence", case.id, procs, f"max|diff| {diff:.2e}", limit, calls, nbytes)


# -- fast -------------------------------------------------------------------------------------
def test_three_processes_equal_one(dtd_root, deep_opts, tmp_path):
    """Uneven shards (3, 3, 2 then 2, 2, 2): ESAM's global selection (both schedules), SAF's
    records, SAMPLe's moving average resumed 1 -> 3 -> 1, m-sharpness (another method), the
    evaluation gathered in order, and the feature cache that rank 0 alone reads and writes
    (a cache folder per process: the others' stay empty)."""
    cases = [
        Case("CoOp", "sample", evaluate=True, resume=True),
        Case("CoOp", "esam"),
        Case("CoOp", "esam-masked"),
        Case("CoOp", "saf"),
        Case("CoOp", "sam-local"),
        Case("CoOp", "sgd", cache=True),
    ]
    t0 = time.time()
    report(compare(cases, [3], dtd_root, deep_opts, tmp_path))
    print(f"wall {time.time() - t0:.1f} s")


# -- slow: the whole registry -----------------------------------------------------------------
def registry_cases() -> list[Case]:
    """Every trainer x every family (evaluated with SGD and SAMPLe), the other base optimizers
    and the variants on CoOp, and a resumed run of two trainers."""
    cases = [Case(t, f, evaluate=f in ("sgd", "sample")) for t in trainable() for f in families()]
    cases += [Case("CoOp", f) for f in base_optimizers()]
    cases += [Case("CoOp", f) for f in VARIANT_OPTIONS]
    cases += [Case(t, "sample", resume=True) for t in ("CoOp", "MaPLe")]
    return cases


def test_the_suite_covers_the_registries():
    """A newly registered trainer or optimizer is in the suite without an edit."""
    from engine.registry import TRAINER_REGISTRY
    from optim import list_optimizers

    cases = registry_cases()
    names = {c.family.split("-")[0] for c in cases}
    assert {s.name for s in list_optimizers()} <= names
    for t in TRAINER_REGISTRY:
        cls = TRAINER_REGISTRY.get(t)
        if cls.EVAL_ONLY or getattr(cls, "ALIAS_OF", ""):
            continue
        if getattr(cls, "DATA_PARALLEL", True):
            assert {f for c in cases if c.trainer == t for f in [c.family]} >= set(families())
        else:  # declared one-process (SkipTuning, ProGrad): refused, tested in its own file
            assert t not in {c.trainer for c in cases}


@pytest.mark.slow
def test_every_trainer_and_optimizer_family_in_two_and_three_processes(
    dtd_root, deep_opts, tmp_path
):
    t0 = time.time()
    report(compare(registry_cases(), [2, 3], dtd_root, deep_opts, tmp_path))
    print(f"wall {time.time() - t0:.1f} s")


@pytest.mark.slow
def test_precisions_and_the_compiled_path_in_two_processes(dtd_root, deep_opts, tmp_path):
    """fp32, fp16 (fp16 weights, fp32 prompts), amp (GradScaler: the same scales, so the same
    skipped steps, on every process and in one) and bf16 autocast, with SAMPLe on CoOp; the
    compiled encoders (MODEL.COMPILE aot_eager) under the gradient sync. Inductor's generated
    code is not run here: compiling it on CPU costs about a minute of CPU per process
    (tests/test_compile.py runs it in one process)."""
    cases = [Case("CoOp", "sample", p) for p in ("fp32", "fp16", "bf16", "amp")]
    cases += [Case("CoOp", "sample", "fp32", compile="aot_eager")]
    t0 = time.time()
    report(compare(cases, [2], dtd_root, deep_opts, tmp_path))
    print(f"wall {time.time() - t0:.1f} s")
