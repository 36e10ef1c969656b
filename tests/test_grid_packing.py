"""tools/grid.py packs each worker's runs into one process by default on a GPU, runs a process per
run without one, and honours --in-process / --processes (the device count is injected here)."""

from __future__ import annotations

import pytest

from experiments import grid_exec
from experiments.grid_exec import choose_in_process, gpu_count
from tools import grid


def test_the_choice_rule():
    def no_gpu():
        return 0

    def one_gpu():
        return 1

    assert choose_in_process(None, None, 1, no_gpu)[0] is False  # CPU: a process per run
    assert choose_in_process(None, None, 1, one_gpu)[0] is True  # a visible GPU: packed
    assert choose_in_process(None, ["0", "1"], 1, no_gpu)[0] is True  # --gpus
    assert choose_in_process(None, ["0", "1"], 2, one_gpu)[0] is False  # torchrun processes
    assert choose_in_process(False, ["0"], 1, one_gpu) == (False, "--processes given")
    assert choose_in_process(True, None, 1, no_gpu) == (True, "--in-process given")


def test_gpu_count_without_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_count() == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert gpu_count() == 0


def test_flags_parse():
    parse = grid.build_parser().parse_args
    assert parse([]).in_process is None
    assert parse(["--in-process"]).in_process is True
    assert parse(["--processes"]).in_process is False
    with pytest.raises(SystemExit):
        parse(["--in-process", "--processes"])


@pytest.mark.parametrize(
    ("flags", "gpus", "packed"),
    [([], 1, True), ([], 0, False), (["--processes"], 1, False), (["--in-process"], 0, True)],
)
def test_the_grid_runs_what_it_chose(tmp_path, monkeypatch, capsys, flags, gpus, packed):
    """main() hands run_local the choice and prints it (run_local itself is the grid's: here
    replaced by a recorder, the runs' execution is tested in test_packed_runs.py)."""
    seen = {}

    def record(todo, setup, gpus, stream, per_gpu, in_process, workers, nproc):
        seen["in_process"] = in_process
        return []

    monkeypatch.setattr(grid_exec, "gpu_count", lambda: gpus)
    monkeypatch.setattr(grid, "run_local", record)
    data = tmp_path / "data"
    data.mkdir()
    argv = ["--trainers", "CoOp", "--optims", "sgd", "--datasets", "dtd", "--seeds", "1"]
    argv += ["--data", str(data), "--output", str(tmp_path / "out"), "--no-check", *flags]
    assert grid.main(argv) == 0
    assert seen["in_process"] is packed
    out = capsys.readouterr().out
    assert ("Runs: packed" if packed else "Runs: a process per run") in out


def test_a_packed_run_freezes_its_survivors(monkeypatch):
    """engine.runner.run_packed: after a run, what survived it is frozen (the next teardown's
    collection scans only the next run's objects); every UNFREEZE_EVERY runs it is unfrozen."""
    import gc

    from engine import runner

    calls = []
    monkeypatch.setattr(runner, "run_in_process", lambda argv: calls.append(argv) or 0)
    try:
        gc.unfreeze()
        assert runner.run_packed(["--x"], 1) == 0 and gc.get_freeze_count() > 0
        frozen = gc.get_freeze_count()
        runner.run_packed(["--y"], runner.UNFREEZE_EVERY)  # unfrozen first, frozen again after
        assert gc.get_freeze_count() <= frozen + 1000 and calls == [["--x"], ["--y"]]
        gc.unfreeze()
        monkeypatch.setattr(gc, "freeze", lambda: None)  # the unfreeze alone
        runner.run_packed(["--z"], runner.UNFREEZE_EVERY)
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
