"""The SmallWorld: deterministic generation, the reader's splits and base/new halves, the small
CLIP's pretraining script, the shipped weights' zero-shot accuracy and the demo pipeline."""

from __future__ import annotations

import hashlib
import os
import os.path as osp
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, make_cfg

import datasets.small_world as sw
from engine import build_trainer
from engine.clip import load_clip
from engine.data import DatasetNotFoundError

TINY_COUNTS = {"train": 3, "val": 1, "test": 2}
SMALL_WORLD_CFG = "configs/datasets/small_world.yaml"
SMALL_WORLD_TRAINER_CFG = "configs/trainers/CoOp/small_world.yaml"
SHIPPED_WEIGHTS = osp.join(ROOT, "assets", "small_world_clip.pt")


def _tree_hashes(folder: str) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            path = osp.join(dirpath, name)
            with open(path, "rb") as f:
                out[osp.relpath(path, folder)] = hashlib.sha1(f.read()).hexdigest()
    return out


def _colours(classnames) -> set[str]:
    return {name.split(" ")[0] for name in classnames}


@pytest.fixture(scope="module")
def world_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("world"))
    sw.generate_small_world(root, counts=TINY_COUNTS)
    return root


# -- generation ---------------------------------------------------------------------------------
def test_generation_is_deterministic(tmp_path, world_root):
    again = sw.generate_small_world(str(tmp_path / "a"), counts=TINY_COUNTS)
    first = _tree_hashes(osp.join(world_root, sw.DATASET_FOLDER))
    assert _tree_hashes(again) == first
    assert len([p for p in first if p.endswith(".png")]) == 64 * sum(TINY_COUNTS.values())
    other = sw.generate_small_world(str(tmp_path / "b"), seed=1, counts=TINY_COUNTS)
    assert _tree_hashes(other) != first


def test_generate_refuses_to_overwrite_and_checks_counts(tmp_path, world_root):
    with pytest.raises(FileExistsError, match="--force"):
        sw.generate_small_world(world_root, counts=TINY_COUNTS)
    with pytest.raises(ValueError, match="train/val/test"):
        sw.generate_small_world(str(tmp_path), counts={"test": 0})


def test_rendering_draws_the_class_colour():
    rng = np.random.default_rng(0)
    labels = [sw.CLASSNAMES.index("red circle"), sw.CLASSNAMES.index("blue square")]
    scenes = [sw.sample_scene(rng, y) for y in labels]
    for scene, (r, g, b) in zip(scenes, ((215, 35, 35), (40, 75, 215))):
        image = sw.render(scene, rng).astype(int)  # [32, 32, 3]
        centre = image[int(scene.cy), int(scene.cx)]
        assert np.abs(centre - np.array([r, g, b])).max() < 60


def test_rotate_hue():
    pixels = np.array([[[255, 0, 0], [128, 128, 128], [0, 0, 255]]], dtype=np.uint8)
    out = sw.rotate_hue(pixels, 120.0)
    assert out.tolist() == [[[0, 255, 0], [128, 128, 128], [255, 0, 0]]]
    rng = np.random.default_rng(0)
    images, _ = sw.render_batch([0, 9, 27, 50], rng)
    back = sw.rotate_hue(sw.rotate_hue(images, 30.0), -30.0).astype(int)
    assert np.abs(back - images).max() <= 2
    assert sw.rotate_hue(images, 0.0) is images


# -- reader -------------------------------------------------------------------------------------
def _reader(root: str, *opts: str):
    cfg = make_cfg(["--root", root, *opts], dataset_cfg=SMALL_WORLD_CFG)
    return sw.SmallWorld(cfg)


def test_reader_splits_and_base_new_colours(world_root):
    full = _reader(world_root)
    assert full.num_classes == 64 and full.classnames == sw.CLASSNAMES
    assert [len(full.train_x), len(full.val), len(full.test)] == [
        64 * TINY_COUNTS[s] for s in ("train", "val", "test")
    ]
    assert full.classnames[:2] == ["red circle", "red square"]
    base = _reader(world_root, "DATASET.SUBSAMPLE_CLASSES", "base", "DATASET.NUM_SHOTS", "2")
    new = _reader(world_root, "DATASET.SUBSAMPLE_CLASSES", "new", "DATASET.NUM_SHOTS", "2")
    assert base.num_classes == new.num_classes == 32
    assert len(base.train_x) == 32 * 2 and len(base.test) == 32 * TINY_COUNTS["test"]
    assert _colours(base.classnames) == {"red", "green", "blue", "yellow"}
    assert _colours(new.classnames) == {"purple", "orange", "pink", "brown"}
    shapes = {name.split(" ")[1] for name in new.classnames}
    assert shapes == set(sw.SHAPES)  # every shape on both sides, no colour shared


def test_reader_generates_on_first_use(tmp_path, monkeypatch):
    monkeypatch.setattr(sw, "DEFAULT_COUNTS", {"train": 1, "val": 1, "test": 1})
    reader = _reader(str(tmp_path), "DATASET.SUBSAMPLE_CLASSES", "new")
    assert osp.isfile(osp.join(str(tmp_path), sw.DATASET_FOLDER, sw.SPLIT_FILE))
    assert len(reader.test) == 32


def test_reader_errors(tmp_path):
    with pytest.raises(ValueError, match="--root"):
        sw.SmallWorld(make_cfg([], dataset_cfg=SMALL_WORLD_CFG))
    os.makedirs(tmp_path / sw.DATASET_FOLDER)  # a folder without its split file
    with pytest.raises(DatasetNotFoundError, match="--force"):
        _reader(str(tmp_path))


# -- pretraining --------------------------------------------------------------------------------
def _pretrain(model_config: str, output: str) -> dict:
    from tools import pretrain_small_clip

    argv = ["--model-config", model_config, "--output", output, "--steps", "3"]
    argv += ["--batch-size", "16", "--pool-size", "48", "--eval-images", "64", "--threads", "1"]
    argv += ["--warmup", "1", "--log-every", "1"]
    args = pretrain_small_clip.build_parser().parse_args(argv)
    return pretrain_small_clip.pretrain(args)


def test_pretraining_script_writes_a_loadable_reproducible_checkpoint(tmp_path, tiny_clip):
    cfg_path, _ = tiny_clip
    threads = torch.get_num_threads()
    out_a, out_b = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    record = _pretrain(cfg_path, out_a)
    _pretrain(cfg_path, out_b)
    assert torch.get_num_threads() == threads  # restored
    assert [row["step"] for row in record["loss_curve"]] == [1, 2, 3]
    assert set(record["zero_shot"]) == {
        "canonical_all",
        "shifted_all",
        "shifted_base",
        "shifted_new",
    }
    assert osp.isfile(str(tmp_path / "a.train.json"))
    sd_a = torch.load(out_a, weights_only=True)
    sd_b = torch.load(out_b, weights_only=True)
    assert sd_a["token_embedding.weight"].dtype == torch.float16
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)  # same seed, same weights
    opts = ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", cfg_path]
    model = load_clip(make_cfg(opts + ["MODEL.BACKBONE.PATH", out_a]))
    with torch.no_grad():
        assert model.encode_image(torch.zeros(2, 3, 32, 32)).shape == (2, 32)


# -- the shipped small CLIP ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def eval_root(tmp_path_factory):
    """A world with 6 test images per class (192 per half)."""
    root = str(tmp_path_factory.mktemp("eval_world"))
    sw.generate_small_world(root, counts={"train": 1, "val": 1, "test": 6})
    return root


@pytest.mark.parametrize("half", ["base", "new"])
def test_shipped_weights_zero_shot_in_band(eval_root, tmp_path, half):
    """ZeroshotCLIP ("a photo of a {}.") with the shipped weights on 192 test images."""
    backbone = ["MODEL.BACKBONE.CONFIG", osp.join(ROOT, "configs/clip/small_world_clip.json")]
    backbone += ["MODEL.BACKBONE.PATH", SHIPPED_WEIGHTS]
    cfg = make_cfg(
        ["--root", eval_root, "--output-dir", str(tmp_path), *backbone]
        + ["DATASET.SUBSAMPLE_CLASSES", half, "TEST.FEATURE_CACHE", "False", "VERBOSE", "False"],
        trainer="ZeroshotCLIP",
        dataset_cfg=SMALL_WORLD_CFG,
        config_file=SMALL_WORLD_TRAINER_CFG,
    )
    accuracy = build_trainer(cfg).test()
    chance = 100 / 32
    assert 40.0 <= accuracy <= 85.0, f"zero-shot {half} accuracy {accuracy:.1f}% (chance {chance})"


# -- the demo -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_demo_runs_end_to_end_in_the_fast_setting(tmp_path):
    out = str(tmp_path / "demo")
    env = dict(
        os.environ,
        DEMO_FAST="1",
        DEMO_OUTPUT=out,
        DEMO_OPTIMS="sgd sample",
        PYTHON=sys.executable,
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        ["bash", osp.join(ROOT, "scripts", "demo.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = open(osp.join(out, "table.txt")).read()
    assert re.search(r"^Zero-shot CLIP +\d+\.\d\d +\d+\.\d\d +\d+\.\d\d$", table, re.M), table
    assert "±" not in table  # one seed: no spread shown, none to define
    assert "Zero-shot CLIP" in open(osp.join(out, "report", "index.html")).read()
    rows = {line.split()[0]: line for line in table.splitlines() if line.startswith("CoOp")}
    assert set(rows) == {"CoOp", "CoOp+SAMPLe"}
    for line in rows.values():  # Base, New and HM measured (the paper has no SmallWorld)
        assert len(re.findall(r"\b\d+\.\d\d\b", line)) >= 3, line
    runs = osp.join(out, "base2new", "test_new", "small_world", "shots_2", "CoOp")
    assert sorted(os.listdir(runs)) == ["small_world+sample-ep1", "small_world+sgd-ep1"]
