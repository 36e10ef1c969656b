"""A misspelled --trainer or a dataset root without the dataset: one message, printed once, before
any config is logged, and no output folder left behind (engine/preflight.py); every run's log
states its reproduction mode."""

from __future__ import annotations

import os.path as osp

import pytest
from conftest import ROOT, run_train

from engine.cli import run


def _args(root: str, out: str, trainer: str = "CoOp") -> list[str]:
    return [
        "--root",
        root,
        "--seed",
        "1",
        "--trainer",
        trainer,
        "--dataset-config-file",
        osp.join(ROOT, "configs/datasets/dtd.yaml"),
        "--config-file",
        osp.join(ROOT, "configs/trainers/CoOp/vit_b16_ctxv1.yaml"),
        "--output-dir",
        out,
    ]


def test_misspelled_trainer_is_one_line_before_anything_is_written(tmp_path, dtd_root):
    out = tmp_path / "run"
    proc = run_train(_args(dtd_root, str(out), trainer="CoOpp"), check=False)
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert lines == [
        "Error: Unknown trainer 'CoOpp' (do you mean [CoOp]?). Available trainers: "
        + lines[0].split("Available trainers: ")[1]
    ], lines  # nothing else: no config dump, no second copy of the message
    assert not out.exists()


def test_missing_dataset_root_is_one_message_and_no_folder(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(_args(str(tmp_path / "nowhere"), str(out))) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("Error: DescribableTextures: not found or incomplete under DATASET.ROOT")
    assert "missing: dtd/images/" in line and "How to get it:" in line
    assert not out.exists()


def test_folder_dataset_without_its_folder_is_refused_before_the_run_folder(tmp_path, capsys):
    out = tmp_path / "run"
    args = _args(str(tmp_path), str(out))
    args[args.index("--dataset-config-file") + 1] = osp.join(ROOT, "configs/datasets/folder.yaml")
    assert run([*args, "DATASET.FOLDER", "mydata"]) == 2
    err = capsys.readouterr().err
    assert "folder:mydata: not found" in err and "docs/own-dataset.md" in err
    assert not out.exists()


@pytest.mark.parametrize("repro", [[], ["--repro", "released"]])
def test_every_run_log_states_its_reproduction_mode(tmp_path, dtd_root, tiny_clip_opts, repro):
    out = tmp_path / "run"
    args = [*_args(dtd_root, str(out)), *repro, "--no-train", *tiny_clip_opts]
    assert run([*args, "DATASET.NUM_SHOTS", "2"]) == 0
    log = (out / "log.txt").read_text()
    mode = "released" if repro else "paper"
    (line,) = [x for x in log.splitlines() if x.startswith("Reproduction mode: ")]
    assert line.startswith(f"Reproduction mode: {mode} (")
    assert log.index(line) < log.index("** Config **")  # before the config dump
