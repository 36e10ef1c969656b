"""Grids under faults (issue 36): two grids on one output share its runs and run each once; a
grid killed with SIGKILL (its process group, at chosen points: checkpoint writes, logged steps,
evaluations) and re-invoked ends with the files of an uninterrupted grid, each scalar step once.

The toy grid: CoOp with SGD and SAMPLe on the DTD layout, base-to-new, one seed, 2 epochs, runs
packed in one worker process per grid (``--in-process``). Kills come from
``SAMPLE_PL_KILL_AT`` (engine/faults.py), never from sleeps.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import os.path as osp
import subprocess
import sys
import threading

import pytest
from conftest import ROOT
from test_packed_runs import MEASURED, files, last_log, numbers

from engine.faults import KILL_AT_ENV, parse_kill_at
from engine.run_folder import RunFolder, lock_holder
from engine.trainer import _scalar_row_before
from engine.writers import ScalarWriter
from experiments.grid_exec import ChainClaim
from experiments.grid_plan import expand
from experiments.results import read_run
from tools import grid

EPOCHS = 2


def toy_argv(data: str, out: str, tiny_clip_opts) -> list[str]:
    argv = ["--trainers", "CoOp", "--optims", "sgd", "sample", "--datasets", "dtd"]
    argv += ["--seeds", "1", "--data", data, "--output", out, "--shots", "2", "--no-check"]
    argv += ["--quiet", "--in-process"]
    opts = [*tiny_clip_opts, "OPTIM.MAX_EPOCH", str(EPOCHS), "TEST.FEATURE_CACHE", "False"]
    return argv + ["--", *opts, "TRAINER.COOP.PREC", "fp32", "TRAINER.COOP.N_CTX", "4"]


def start_grid(argv: list[str], kill_at: str = "") -> subprocess.Popen:
    """tools/grid.py in a process group of its own (its worker with it)."""
    env = dict(os.environ, PYTHONPATH=ROOT)  # the reference's thread count: the same numbers
    env.pop(KILL_AT_ENV, None)
    if kill_at:
        env[KILL_AT_ENV] = kill_at
    cmd = [sys.executable, osp.join(ROOT, "tools", "grid.py"), *argv]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def run_dirs(out: str) -> list[str]:
    return sorted(
        osp.dirname(p) for p in glob.glob(osp.join(out, "**", "config.yaml"), recursive=True)
    )


def scalar_rows(run: str) -> list[dict]:
    path = osp.join(run, "scalars.jsonl")
    return [json.loads(x) for x in open(path)] if osp.isfile(path) else []


def repeated_steps(rows: list[dict]) -> list:
    seen = collections.Counter((tag, r["step"]) for r in rows for tag in r if tag != "step")
    return [k for k, n in seen.items() if n > 1]


def tensorboard_scalars(run: str) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar event in ``run/tensorboard``, sorted."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    found = []
    for path in glob.glob(osp.join(run, "tensorboard", "events.out.tfevents.*")):
        for event in EventFileLoader(path).Load():
            for v in event.summary.value:
                value = v.tensor.float_val[0] if v.HasField("tensor") else v.simple_value
                found.append((v.tag, event.step, value))
    return sorted(found)


def assert_same_grids(ref: str, out: str) -> None:
    """Every file of ``out`` equals the uninterrupted grid's ``ref``: checkpoints, scalars and
    splits bit for bit, configs up to the output root, the same results in the newest logs
    (read as experiments/results.py reads them), the same tensorboard scalars, each step once.
    Not compared: logs (a resumed run writes log.txt-<time>), what the grid writes beside the
    runs (console.txt, .lock files) and what cost.json measured or counted (the kills' work)."""
    fa, fb = ({k: v for k, v in files(d).items() if "log.txt" not in k} for d in (ref, out))
    assert sorted(fa) == sorted(fb)
    for rel, path in fa.items():
        x, y = (open(p, "rb").read() for p in (path, fb[rel]))
        if osp.basename(rel) == "cost.json":  # the time a kill lost is spent: counted, not here
            x, y = ({k: v for k, v in json.loads(t).items()
                     if k not in (*MEASURED, "steps", "segments")} for t in (x, y))  # fmt: skip
            assert x == y, rel
        elif rel.endswith((".yaml", ".json")):
            assert x.replace(ref.encode(), b"OUT") == y.replace(out.encode(), b"OUT"), rel
        else:
            assert x == y, rel
    runs = run_dirs(ref)
    assert len(runs) == 4 and [osp.relpath(r, ref) for r in runs] == [
        osp.relpath(r, out) for r in run_dirs(out)
    ]
    for a in runs:
        b = osp.join(out, osp.relpath(a, ref))
        ra, rb = read_run(a), read_run(b)  # what parse_results / make_tables read
        assert ra.status == rb.status == "done" and ra.accuracy == rb.accuracy, b
        result = [[x for x in numbers(last_log(r)) if x.startswith("* ")] for r in (a, b)]
        assert result[0] and result[0] == result[1], b
        assert repeated_steps(scalar_rows(b)) == [], b
        tb = tensorboard_scalars(b)
        assert tb == tensorboard_scalars(a), b
        assert len(set((t, s) for t, s, _ in tb)) == len(tb), b


@pytest.fixture(scope="module")
def toy(tmp_path_factory, tiny_clip_opts):
    """The data and an uninterrupted toy grid (the reference)."""
    base = tmp_path_factory.mktemp("grid_faults")
    from datasets.synthetic import make_dtd

    data = str(base / "data")
    make_dtd(data)
    ref = str(base / "reference")
    assert grid.main(toy_argv(data, ref, tiny_clip_opts)) == 0
    return data, ref


@pytest.mark.slow
def test_two_grids_on_one_output_run_each_run_once(toy, tmp_path, tiny_clip_opts):
    data, ref = toy
    out = str(tmp_path / "two")
    argv = toy_argv(data, out, tiny_clip_opts)
    first, second = start_grid(argv), start_grid(argv)
    logs = [p.communicate(timeout=300)[0] for p in (first, second)]
    assert (first.returncode, second.returncode) == (0, 0), logs
    assert all("All runs finished." in log for log in logs)
    for run in run_dirs(out):  # trained or evaluated once: one log, one start, one result
        assert [n for n in os.listdir(run) if n.startswith("log.txt")] == ["log.txt"], run
        log = open(osp.join(run, "log.txt")).read()
        assert log.count("** Arguments **") == 1 and log.count("=> result") == 1, run
    assert_same_grids(ref, out)


# the kills, in the order a grid reaches them (the SGD chain runs first; counts are per worker)
KILLS = [
    # epoch 1's rows logged, its checkpoint in its temporary file: the re-run starts over
    "write:model-last.pth.tar",
    # epoch 2's rows logged after epoch 1's checkpoint, the last checkpoint being written: the
    # re-run resumes from epoch 1 and logs epoch 2 again
    f"write:model.pth.tar-{EPOCHS}",
    # the last checkpoint in place, the final test's logits computed, no result yet: the re-run
    # resumes after the last epoch and only tests (its rows at the last epoch, not at step 0)
    "evaluate@1",
]


@pytest.mark.slow
def test_a_grid_killed_at_several_points_ends_as_an_uninterrupted_one(
    toy, tmp_path, tiny_clip_opts
):
    data, ref = toy
    out = str(tmp_path / "killed")
    argv = toy_argv(data, out, tiny_clip_opts)
    train = next(r for r in run_dirs(ref) if "train_base" in r and "+sample" not in r)
    train = osp.join(out, osp.relpath(train, ref))
    model = osp.join(train, "prompt_learner")
    for point in KILLS:
        proc = start_grid(argv, kill_at=point)
        stdout = proc.communicate(timeout=300)[0]
        assert proc.returncode == -9, (point, stdout)  # the grid died with its worker
        rows = scalar_rows(train)
        steps = {r["step"] for r in rows if "train/loss" in r}
        assert repeated_steps(rows) == [], (point, repeated_steps(rows))
        if point.startswith("write:"):
            name = point.split(":")[1]
            assert glob.glob(osp.join(model, f".{name}.*.tmp")), point  # half done, not in place
            assert not osp.exists(osp.join(model, name)), point
            assert steps == set(range(2 * (1 + KILLS.index(point)))), point  # 2 steps an epoch
        else:
            assert osp.isfile(osp.join(model, f"model.pth.tar-{EPOCHS}")), point
            assert read_run(train).status == "no_result", point
    assert grid.main(argv) == 0
    assert_same_grids(ref, out)


# -- the pieces, in-process ------------------------------------------------------------------------
def test_skip_done_stops_at_a_finished_run_under_its_lock(toy, tiny_clip_opts, capsys):
    from engine.cli import run

    data, ref = toy
    argv, opts = grid.split_opts(toy_argv(data, ref, tiny_clip_opts))
    args = grid.build_parser().parse_args(argv)
    setup = grid.setup_from_args(args, opts)
    chain = expand(grid.grids_from_args(args), setup)[0]
    finished = chain.train.out_dir
    args = chain.train.command(setup)[2:]  # [python, train.py, args...]
    before = sorted(os.listdir(finished)), open(osp.join(finished, "scalars.jsonl")).read()
    assert run(["--skip-done", *args]) == 0
    assert "Already done" in capsys.readouterr().out
    assert (
        sorted(os.listdir(finished)),
        open(osp.join(finished, "scalars.jsonl")).read(),
    ) == before
    # another experiment in the folder is not "done": the usual refusal
    assert run(["--skip-done", *args, "OPTIM.LR", "0.5"]) == 2
    assert "holds a run of another experiment" in capsys.readouterr().err


def test_result_log_agrees_with_parse_results(tmp_path):
    from run_folders import eval_log, train_log, write_run

    cases = {
        "train_done": (train_log(71.5), False),
        "train_killed": (train_log(None, val_acc=50.0), False),  # a val result is no result
        "train_old_dassl_done": (train_log(70.0, end="Finished training"), False),
        "eval_done": (eval_log(60.0), True),
        "eval_killed": (eval_log(None), True),
    }
    for name, (text, eval_only) in cases.items():
        run = str(tmp_path / name)
        write_run(run, text)
        expected = read_run(run, "eval" if eval_only else "train").status == "done"
        assert (RunFolder(run).result_log(eval_only) is not None) == expected, name
        assert expected == name.endswith("done"), name
    run = str(tmp_path / "resumed")  # an interrupted log, then the resumed one with the result
    write_run(run, train_log(None))
    write_run(run, train_log(72.0), name="log.txt-2026-01-01-00-00-00")
    assert RunFolder(run).result_log(False).endswith("log.txt-2026-01-01-00-00-00")


def test_lock_holder_and_waiting_for_a_folder(tmp_path):
    path = str(tmp_path / "run")
    assert lock_holder(path) is None and not osp.exists(path)  # a look creates nothing
    first = RunFolder(path)
    first.acquire()
    assert lock_holder(path).startswith(f"pid {os.getpid()} on host")
    second = RunFolder(path)
    waiter = threading.Thread(target=second.acquire, kwargs={"wait": True})
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # waits while the first holds the folder
    first.release()
    waiter.join(10)
    assert not waiter.is_alive() and lock_holder(path).startswith(f"pid {os.getpid()}")
    second.release()
    assert lock_holder(path) is None


def test_a_chain_claim_is_held_by_one_grid(tmp_path):
    chain = expand(
        grid.select(None, trainers=["CoOp"], datasets=["dtd"], seeds=[1]),
        grid.Setup(output=str(tmp_path)),
    )[0]
    mine, theirs = ChainClaim(str(tmp_path), chain), ChainClaim(str(tmp_path), chain)
    assert mine.take() is None
    holder = theirs.take()
    assert holder.startswith(f"grid pid {os.getpid()}") and "train_base" in holder
    mine.release()
    assert theirs.take() is None
    theirs.release()
    assert open(mine.path).read() == ""


def test_resumed_rows_and_tensorboard_events_are_kept_once(tmp_path):
    pytest.importorskip("tensorboard")
    out, tb = str(tmp_path), str(tmp_path / "tensorboard")
    writer = ScalarWriter()
    writer.open(out, tb)
    for step in range(6):  # 3 epochs of 2 steps, an evaluation after each, a final test
        writer.add({"train/loss": float(step)}, step)
    for epoch in range(3):
        writer.add({"val/accuracy": 10.0 * epoch}, epoch)
    writer.add({"test/accuracy": 50.0}, 2)
    writer.close()
    keep = lambda row: _scalar_row_before(row, start_iter=4, start_epoch=2)  # noqa: E731
    writer = ScalarWriter()
    writer.open(out, tb, keep=keep)  # resumed from epoch 2's checkpoint
    writer.close()
    kept = [("train/loss", s, float(s)) for s in range(4)]
    kept += [("val/accuracy", e, 10.0 * e) for e in range(2)]
    assert tensorboard_scalars(out) == sorted(kept)
    rows = scalar_rows(out)
    assert sorted((t, r["step"], v) for r in rows for t, v in r.items() if t != "step") == sorted(
        kept
    )


def test_kill_at_names_a_point_and_an_occurrence():
    assert parse_kill_at("write:model.pth.tar-2") == ("write:model.pth.tar-2", 1)
    assert parse_kill_at("evaluate@2") == ("evaluate", 2)
    with pytest.raises(ValueError, match="POINT@N"):
        parse_kill_at("evaluate@0")
