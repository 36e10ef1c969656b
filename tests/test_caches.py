"""Decoded-image cache and evaluation-feature cache: identical results, correct invalidation."""

from __future__ import annotations

import logging
import os

import torch
from conftest import make_cfg

from engine import build_trainer
from engine.data import DataManager


def _loader_batches(dtd_root, cache, budget="4096"):
    cfg = make_cfg(
        [
            "--root",
            dtd_root,
            "--seed",
            "5",
            "INPUT.SIZE",
            "(16, 16)",
            "INPUT.TRANSFORMS",
            "['random_resized_crop', 'random_flip', 'normalize']",
            "DATALOADER.NUM_WORKERS",
            "0",
            "DATALOADER.TRAIN_X.BATCH_SIZE",
            "6",
            "DATALOADER.CACHE_DECODED",
            str(cache),
            "DATALOADER.CACHE_DECODED_MB",
            budget,
        ]
    )
    dm = DataManager(cfg)
    assert dm.train_loader_x.dataset.images is None  # nothing decoded before training starts
    dm.cache_training_images()
    loader = dm.train_loader_x
    out = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        out += [(b["index"], b["img"]) for b in loader]
    return dm, out


def test_decoded_cache_gives_identical_batches(dtd_root):
    dm, plain = _loader_batches(dtd_root, cache=False)
    assert dm.train_loader_x.dataset.images is None
    dm, cached = _loader_batches(dtd_root, cache=True)
    assert len(dm.train_loader_x.dataset.images) == len(dm.dataset.train_x)
    for (i1, x1), (i2, x2) in zip(plain, cached):
        assert torch.equal(i1, i2) and torch.equal(x1, x2)


def test_decoded_cache_respects_its_budget(dtd_root):
    # 40x40 RGB images are 4,800 bytes: a 0 MB budget disables, 1 MB holds them all
    dm, _ = _loader_batches(dtd_root, cache=True, budget="0")
    assert dm.train_loader_x.dataset.images is None
    from engine.data.image_cache import DecodedImageCache

    cfg = make_cfg(["DATALOADER.CACHE_DECODED_MB", "1"])
    items = dm.dataset.train_x * 60  # 2,100 images of 4,800 bytes > 1 MB
    cache = DecodedImageCache.build(cfg, items)
    assert 0 < len(cache) < len(items) and cache.nbytes <= 2**20


def test_decoded_images_are_kept_between_runs_of_a_process(dtd_root, caplog):
    """A second run (a packed worker's next run) reuses the decoded tensors; a file changed on
    disk is decoded again; the store stays within the budget."""
    from PIL import Image

    from engine.data.image_cache import (
        DecodedImageCache,
        clear_process_store,
        process_store_info,
    )

    clear_process_store()
    dm, _ = _loader_batches(dtd_root, cache=False)
    items = dm.dataset.train_x
    cfg = make_cfg(["DATALOADER.CACHE_DECODED_MB", "1"])
    first = DecodedImageCache.build(cfg, items)
    assert process_store_info()[0] == len(items)
    changed = items[0].impath
    Image.new("RGB", (24, 16), (255, 0, 0)).save(changed)  # another size: another key
    caplog.set_level(logging.INFO, logger="engine.data.image_cache")
    second = DecodedImageCache.build(cfg, items)
    assert f"{len(items) - 1} images decoded by an earlier run" in caplog.text
    assert all(second.get(i) is first.get(i) for i in range(1, len(items)))  # the same tensors
    assert second.get(0).shape == (3, 16, 24) and second.get(0)[0].ge(250).all()  # JPEG
    tiny = make_cfg(["DATALOADER.CACHE_DECODED_MB", "0"])  # a run with another budget
    DecodedImageCache.build_checked(tiny, items)
    assert process_store_info()[0] == len(items) + 1  # budget 0 decodes nothing, trims nothing
    small = make_cfg(["DATALOADER.CACHE_DECODED_MB", "1"])
    DecodedImageCache.build(small, items * 60)  # 2,100 entries of the same 36 files fit
    assert process_store_info()[1] <= 2**20
    clear_process_store()
    assert process_store_info() == (0, 0)


def _coop(tmp_path, dtd_root, tiny_clip_opts, cache_dir, *extra):
    cfg = make_cfg(
        [
            "--root",
            dtd_root,
            "--seed",
            "1",
            "--output-dir",
            str(tmp_path / "o"),
            *tiny_clip_opts,
            "TRAINER.COOP.PREC",
            "fp32",
            "TRAINER.COOP.N_CTX",
            "4",
            "OPTIM.NAME",
            "sgd",
            "OPTIM.MAX_EPOCH",
            "1",
            "DATASET.NUM_SHOTS",
            "2",
            "TEST.FEATURE_CACHE_DIR",
            str(cache_dir),
            *extra,
        ]
    )
    return build_trainer(cfg)


def test_feature_cache_reuse_identical_results(tmp_path, dtd_root, tiny_clip_opts, caplog):
    caplog.set_level(logging.INFO)
    cache_dir = tmp_path / "cache"
    tr = _coop(tmp_path, dtd_root, tiny_clip_opts, cache_dir)
    tr.evaluator.reset()
    acc_first = tr.test()
    assert len(os.listdir(cache_dir)) == 1 and "features saved" in caplog.text
    preds_first = torch.cat(tr.evaluator._preds)
    acc_second = tr.test()
    assert "features loaded" in caplog.text
    assert acc_first == acc_second
    assert torch.equal(preds_first, torch.cat(tr.evaluator._preds))
    # the same predictions as the plain image path (no feature route at all)
    tr.frozen_image_encoder = lambda: None
    tr.test()
    assert torch.equal(preds_first, torch.cat(tr.evaluator._preds))


def test_feature_cache_key_changes(tmp_path, dtd_root, tiny_clip_opts):
    cache_dir = tmp_path / "cache"

    def files():
        return set(os.listdir(cache_dir)) if cache_dir.exists() else set()

    seen = set()
    for extra in (
        [],
        ["INPUT.INTERPOLATION", "bicubic"],  # another test transform
        ["DATASET.SUBSAMPLE_CLASSES", "new"],  # another image list
        ["TRAINER.COOP.PREC", "fp16"],  # other weights (half precision)
        ["TRAINER.COOP.PREC", "bf16"],  # same weights, other autocast
    ):
        tr = _coop(tmp_path, dtd_root, tiny_clip_opts, cache_dir, *extra)
        tr.test()
        new = files() - seen
        assert len(new) == 1, extra
        seen |= new
    tr = _coop(tmp_path, dtd_root, tiny_clip_opts, cache_dir)
    with torch.no_grad():
        tr.model.image_encoder.proj.add_(1e-3)  # changed image-encoder weights
    tr.test()
    assert len(files() - seen) == 1
