"""Data model: splits, few-shot draws and caches, subsampling, transforms, loaders."""

from __future__ import annotations

import math
import os
import os.path as osp
import pickle
import random
import sys
import types

import pytest
import torch
from conftest import make_cfg

from engine.data import (
    DataManager,
    DatasetBase,
    DatasetNotFoundError,
    Datum,
    build_dataset,
    build_transform,
    load_or_create_fewshot,
    read_and_split_data,
    read_split,
    save_split,
    subsample_classes,
)
from engine.data.fewshot import load_coop_fewshot_pickle


def _items(n_labels=5, per=10, start=0):
    return [
        Datum(f"/x/c{y}/{i}.jpg", y, 0, f"class {y}")
        for y in range(start, start + n_labels)
        for i in range(per)
    ]


def coop_fewshot_reference(train, val, num_shots, seed):
    """CoOp's algorithm verbatim: global random seeded, random.sample per label."""
    random.seed(seed)

    def gen(source, k):
        tracker = {}
        for item in source:
            tracker.setdefault(item.label, []).append(item)
        out = []
        for items in tracker.values():
            out.extend(random.sample(items, k) if len(items) >= k else items)
        return out

    return gen(train, num_shots), gen(val, min(num_shots, 4))


def test_fewshot_equals_coop_draw(tmp_path):
    train, val = _items(6, 20), _items(6, 8)
    random.seed(12345)  # the global state must not matter
    ds = DatasetBase(train_x=train)
    few_train, few_val = load_or_create_fewshot(ds, train, val, 4, seed=3, root=str(tmp_path))
    ref_train, ref_val = coop_fewshot_reference(train, val, 4, 3)
    assert few_train == ref_train and few_val == ref_val
    assert len(few_train) == 24 and len(few_val) == 24


def test_fewshot_cache_reuse_and_invalidation(tmp_path):
    root = str(tmp_path)
    train, val = _items(4, 10), _items(4, 5)
    ds = DatasetBase(train_x=train)
    a = load_or_create_fewshot(ds, train, val, 2, seed=1, root=root)
    files = os.listdir(osp.join(root, "split_fewshot"))
    assert len(files) == 1 and files[0].startswith("shot_2-seed_1-")
    b = load_or_create_fewshot(ds, train, val, 2, seed=1, root=root)
    assert a[0] == b[0]
    # a different split (one image removed), shot count or seed -> a different cache file
    load_or_create_fewshot(ds, train[1:], val, 2, seed=1, root=root)
    load_or_create_fewshot(ds, train, val, 3, seed=1, root=root)
    load_or_create_fewshot(ds, train, val, 2, seed=2, root=root)
    assert len(os.listdir(osp.join(root, "split_fewshot"))) == 4


def test_reads_coop_pickle_cache(tmp_path):
    """A CoOp `shot_K-seed_S.pkl` pickles dassl.data.datasets.base_dataset.Datum objects."""
    root = str(tmp_path / "dtd")
    img_dir = osp.join(root, "images")
    train = [
        Datum(osp.join(img_dir, f"c{y}", f"{i}.jpg"), y, 0, f"c{y}")
        for y in range(3)
        for i in range(6)
    ]
    val = [
        Datum(osp.join(img_dir, f"c{y}", f"v{i}.jpg"), y, 0, f"c{y}")
        for y in range(3)
        for i in range(3)
    ]

    mod = types.ModuleType("dassl.data.datasets.base_dataset")

    class FakeDassl:  # Dassl's Datum keeps its fields in __dict__
        def __init__(self, impath, label, classname):
            self._impath, self._label, self._domain, self._classname = impath, label, 0, classname

    FakeDassl.__name__ = FakeDassl.__qualname__ = "Datum"
    FakeDassl.__module__ = mod.__name__
    mod.Datum = FakeDassl
    for name in ("dassl", "dassl.data", "dassl.data.datasets"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules[mod.__name__] = mod
    try:
        # paths from another machine: /home/someone/data/dtd/images/...
        chosen = [train[0], train[7], train[13]]
        data = {
            "train": [
                FakeDassl(
                    "/home/u/data/dtd/images/" + osp.relpath(d.impath, img_dir),
                    d.label,
                    d.classname,
                )
                for d in chosen
            ],
            "val": [],
        }
        os.makedirs(osp.join(root, "split_fewshot"))
        path = osp.join(root, "split_fewshot", "shot_1-seed_1.pkl")
        with open(path, "wb") as f:
            pickle.dump(data, f, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        for name in list(sys.modules):
            if name.startswith("dassl"):
                del sys.modules[name]
    raw = load_coop_fewshot_pickle(path)
    assert type(raw["train"][0]) is Datum and raw["train"][0].label == 0
    few_train, few_val = load_or_create_fewshot(
        DatasetBase(train_x=train), train, val, 1, seed=1, root=root
    )
    assert few_train == chosen and few_val == []


def test_subsample_base_new():
    items = _items(7, 2)
    base = subsample_classes(items, subsample="base")
    new = subsample_classes(items, subsample="new")
    assert sorted({d.label for d in base}) == list(range(math.ceil(7 / 2)))
    assert sorted({d.label for d in new}) == [0, 1, 2]
    assert {d.classname for d in new} == {"class 4", "class 5", "class 6"}
    with pytest.raises(ValueError, match="SUBSAMPLE_CLASSES"):
        subsample_classes(items, subsample="novel")


def test_split_generation_and_roundtrip(tmp_path, dtd_root):
    img_dir = osp.join(dtd_root, "dtd", "images")
    train, val, test = read_and_split_data(img_dir, rng=random.Random(0))
    assert (len(train), len(val), len(test)) == (35, 14, 21)  # 10 per class: 5/2/3
    path = str(tmp_path / "split.json")
    save_split(train, val, test, path, img_dir)
    tr, va, te = read_split(path, img_dir)
    assert tr == train and va == val and te == test


def test_dtd_reader_and_errors(dtd_root, tmp_path):
    cfg = make_cfg(
        [
            "--root",
            dtd_root,
            "--seed",
            "1",
            "DATASET.NUM_SHOTS",
            "2",
            "DATASET.SUBSAMPLE_CLASSES",
            "new",
        ]
    )
    ds = build_dataset(cfg)
    assert osp.isfile(osp.join(dtd_root, "dtd", "split_zhou_DescribableTextures.json"))
    assert ds.num_classes == 3 and len(ds.train_x) == 6 and len(ds.val) == 6
    assert ds.classnames == ["bumpy", "chequered", "cobwebbed"]
    assert ds.lab2cname[0] == ds.classnames[0]
    cfg = make_cfg(["--root", str(tmp_path / "nowhere")])
    with pytest.raises(DatasetNotFoundError, match=r"dtd/images.*Download DTD"):
        build_dataset(cfg)


def test_transforms_and_wrapper_views(dtd_root):
    cfg = make_cfg(
        [
            "--root",
            dtd_root,
            "--seed",
            "1",
            "INPUT.SIZE",
            "(16, 16)",
            "DATALOADER.K_TRANSFORMS",
            "2",
            "DATALOADER.RETURN_IMG0",
            "True",
            "DATALOADER.NUM_WORKERS",
            "0",
            "DATALOADER.TRAIN_X.BATCH_SIZE",
            "5",
            "INPUT.TRANSFORMS",
            "['random_resized_crop', 'random_flip', 'normalize']",
        ]
    )
    dm = DataManager(cfg)
    batch = next(iter(dm.train_loader_x))
    assert isinstance(batch["img"], list) and len(batch["img"]) == 2
    assert batch["img"][0].shape == (5, 3, 16, 16) and batch["img0"].shape == (5, 3, 16, 16)
    assert not torch.equal(batch["img"][0], batch["img"][1])
    test_batch = next(iter(dm.test_loader))
    assert test_batch["img"].shape[1:] == (3, 16, 16)
    with pytest.raises(ValueError, match="Unknown transform 'random_flop'"):
        build_transform(make_cfg(["INPUT.TRANSFORMS", "['random_flop']"]))


def test_loader_order_is_seeded_per_epoch(dtd_root):
    opts = [
        "--root",
        dtd_root,
        "--seed",
        "3",
        "INPUT.SIZE",
        "(16, 16)",
        "DATALOADER.NUM_WORKERS",
        "0",
        "DATALOADER.TRAIN_X.BATCH_SIZE",
        "4",
        "INPUT.TRANSFORMS",
        "['random_resized_crop', 'normalize']",
    ]
    loader = DataManager(make_cfg(opts)).train_loader_x

    def epoch(e):
        loader.sampler.set_epoch(e)
        torch.manual_seed(e * 999)  # the global RNG must not matter
        return [(b["index"], b["img"]) for b in loader]

    a, b, c = epoch(1), epoch(1), epoch(2)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    assert not all(torch.equal(x[0], y[0]) for x, y in zip(a, c))
    # no sample is dropped (CoOp's drop_last dropped up to a batch per epoch)
    assert sum(len(x[0]) for x in a) == len(loader.dataset)


def test_corrupt_image_names_path(tmp_path):
    from engine.data import read_image

    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not an image")
    with pytest.raises(OSError, match="bad.jpg"):
        read_image(str(bad))
