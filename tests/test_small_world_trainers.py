"""The new trainers' SmallWorld configs (configs/trainers/<trainer>/small_world.yaml, the demo's
setting with each trainer's published values; docs/trainers.md "The new trainers on the small
world"): each merges, builds on the shipped small CLIP (3 blocks per tower) and evaluates."""

from __future__ import annotations

import os.path as osp
import random

import pytest
from conftest import make_cfg

import datasets.small_world as sw
from engine import build_trainer
from trainers.skiptuning import feature_batches

TRAINERS = ("ProGrad", "DePT_CoOp", "DePT_MaPLe", "MMRL", "SkipTuning")


@pytest.fixture(scope="module")
def world_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("world"))
    sw.generate_small_world(root, counts={"train": 1, "val": 1, "test": 1})
    return root


@pytest.mark.parametrize("trainer", TRAINERS)
def test_small_world_config_builds_and_evaluates(world_root, tmp_path, trainer):
    config = osp.join("configs", "trainers", trainer, "small_world.yaml")
    cfg = make_cfg(
        ["--root", world_root, "--output-dir", str(tmp_path), "DATASET.SUBSAMPLE_CLASSES", "base"]
        + ["TEST.FEATURE_CACHE", "False", "VERBOSE", "False"],
        trainer=trainer,
        dataset_cfg="configs/datasets/small_world.yaml",
        config_file=config,
    )
    assert cfg.MODEL.BACKBONE.PATH == "assets/small_world_clip.pt"
    tr = build_trainer(cfg)
    learnable = [p for p in tr.model.parameters() if p.requires_grad]
    assert learnable and all(p.dtype.is_floating_point for p in learnable)
    if trainer == "MMRL":  # the upper two of the small CLIP's three blocks
        assert tr.model.rep_layers == [2, 3]
    if trainer == "DePT_MaPLe":  # prompts in blocks 0-1, the last block unprompted
        learner = tr.model.prompt_learner
        assert learner.depth == 2 and len(learner.compound_prompts_text) == 1
    if trainer == "SkipTuning":  # block 0 frozen, blocks 1-2 tuned in the image tower
        blocks = tr.model.image.visual.transformer.resblocks
        tuned = [any(p.requires_grad for p in b.parameters()) for b in blocks]
        assert tr.model.start == 1 and tuned == [False, True, True]
        # its one-class batches fit the demo's 16 shots of each of the 32 base classes
        labels = [y for y in range(32) for _ in range(16)]
        size = cfg.DATALOADER.TRAIN_X.BATCH_SIZE
        batches = feature_batches(labels, size, True, random.Random(0))
        assert len(batches) == 32 * 16 // size
    accuracy = tr.test()
    assert 0.0 <= accuracy <= 100.0
