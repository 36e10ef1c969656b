"""The 15 dataset readers on miniature trees in their CoOp layouts, and tools/check_data.py."""

from __future__ import annotations

import io
import json
import math
import os
import os.path as osp
import pickle
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile

import pytest
from conftest import ROOT, make_cfg
from dataset_trees import BUILDERS, CONFIGS, WNIDS, coop_pickle, write_classnames, write_images

from datasets import PAPER_DATASETS
from datasets.imagenet import ImageNet
from engine.data import DataManager, DatasetNotFoundError, build_dataset
from engine.registry import DATASET_REGISTRY
from tools import check_data, download_data

EVAL_ONLY = ("ImageNetV2", "ImageNetSketch", "ImageNetA", "ImageNetR")
TRAINABLE = tuple(n for n in PAPER_DATASETS if n not in EVAL_ONLY)

# what to delete from each tree, and the path the start-up error must name
MISSING_PIECE = {
    "ImageNet": ("imagenet/images/val", "imagenet/images/val/"),
    "Caltech101": ("caltech-101/101_ObjectCategories", "caltech-101/101_ObjectCategories/"),
    "OxfordPets": ("oxford_pets/annotations/test.txt", "oxford_pets/annotations/test.txt"),
    "StanfordCars": ("stanford_cars/devkit/cars_meta.mat", "stanford_cars/devkit/cars_meta.mat"),
    "OxfordFlowers": ("oxford_flowers/cat_to_name.json", "oxford_flowers/cat_to_name.json"),
    "Food101": ("food-101/images", "food-101/images/"),
    "FGVCAircraft": (
        "fgvc_aircraft/images_variant_val.txt",
        "fgvc_aircraft/images_variant_val.txt",
    ),
    "SUN397": ("sun397/Testing_01.txt", "sun397/Testing_01.txt"),
    "DescribableTextures": ("dtd/images", "dtd/images/"),
    "EuroSAT": ("eurosat/2750", "eurosat/2750/"),
    "UCF101": ("ucf101/ucfTrainTestlist/classInd.txt", "ucf101/ucfTrainTestlist/classInd.txt"),
    "ImageNetV2": (
        "imagenetv2/classnames.txt",
        "imagenetv2/classnames.txt or imagenet/classnames.txt",
    ),
    "ImageNetSketch": ("imagenet-sketch/images", "imagenet-sketch/images/"),
    "ImageNetA": ("imagenet-adversarial/imagenet-a", "imagenet-adversarial/imagenet-a/"),
    "ImageNetR": ("imagenet-rendition/imagenet-r", "imagenet-rendition/imagenet-r/"),
}


def build(name: str, root: str, *opts: str, seed: int = 1):
    cfg = make_cfg(
        ["--root", root, "--seed", str(seed), *opts],
        dataset_cfg=f"configs/datasets/{CONFIGS[name]}.yaml",
    )
    return build_dataset(cfg)


def listing(ds):
    return [list(ds.train_x or []), list(ds.val or []), list(ds.test or [])]


def test_every_paper_dataset_has_a_reader_config_and_layout():
    assert set(CONFIGS) == set(PAPER_DATASETS) == set(BUILDERS)
    for name, stem in CONFIGS.items():
        cfg = make_cfg([], dataset_cfg=f"configs/datasets/{stem}.yaml")
        assert cfg.DATASET.NAME == name
        layout = DATASET_REGISTRY.get(name).layout
        assert layout.name == name and layout.how and layout.num_classes > 0


@pytest.mark.parametrize("name", PAPER_DATASETS)
def test_reader_names_labels_splits_and_subsampling(name, tmp_path):
    root = str(tmp_path)
    expected = BUILDERS[name](root)
    ds = build(name, root)
    assert ds.classnames == expected.names
    assert ds.num_classes == len(expected.names)
    assert ds.lab2cname == dict(enumerate(expected.names))
    train, val, test = listing(ds)
    for item in train + val + test:
        assert item.classname == expected.names[item.label]
        assert osp.isfile(item.impath), item.impath
    if name in EVAL_ONLY:  # all images are the test set; train_x is the same list (as CoOp)
        assert (len(test), val) == (expected.sizes[2], []) and train == test
    elif name == "ImageNet":  # val images are the test set and also serve as val
        assert (len(train), len(test)) == expected.sizes[::2] and val == test
    else:
        assert (len(train), len(val), len(test)) == expected.sizes
        paths = [item.impath for item in train + val + test]
        assert len(set(paths)) == len(paths)

    layout = DATASET_REGISTRY.get(name).layout
    if layout.split_file:  # generated, saved, then read back whatever the seed
        assert layout.has_split_file(root)
        assert listing(build(name, root, seed=5)) == [train, val, test]

    m = math.ceil(len(expected.names) / 2)
    for subsample, names in (("base", expected.names[:m]), ("new", expected.names[m:])):
        part = build(name, root, "DATASET.SUBSAMPLE_CLASSES", subsample)
        assert part.classnames == names
        assert {item.label for item in part.test} == set(range(len(names)))
        kept = [item for item in test if (item.label < m) == (subsample == "base")]
        assert [item.impath for item in part.test] == [item.impath for item in kept]


@pytest.mark.parametrize("name", TRAINABLE)
def test_fewshot_draws_are_seeded_and_cached(name, tmp_path):
    root = str(tmp_path)
    BUILDERS[name](root)
    full_train, full_val, _ = listing(build(name, root))
    a = build(name, root, "DATASET.NUM_SHOTS", "2")
    per_class = {}
    for item in full_train:
        per_class[item.label] = per_class.get(item.label, 0) + 1
    assert len(a.train_x) == sum(min(2, n) for n in per_class.values())
    assert set(a.train_x) <= set(full_train)
    if name == "ImageNet":
        assert a.val == a.test  # no val split: few-shot draws train images only
    else:
        assert set(a.val) <= set(full_val) and len(a.val) <= 2 * a.num_classes

    cache_dir = osp.join(a.dataset_dir, "split_fewshot")
    (cache,) = os.listdir(cache_dir)
    stamp = os.stat(osp.join(cache_dir, cache)).st_mtime_ns
    b = build(name, root, "DATASET.NUM_SHOTS", "2")
    assert listing(b) == listing(a)
    assert os.listdir(cache_dir) == [cache]
    assert os.stat(osp.join(cache_dir, cache)).st_mtime_ns == stamp

    c = build(name, root, "DATASET.NUM_SHOTS", "2", seed=2)
    assert c.train_x != a.train_x and len(os.listdir(cache_dir)) == 2
    base = build(name, root, "DATASET.NUM_SHOTS", "2", "DATASET.SUBSAMPLE_CLASSES", "base")
    assert [d.impath for d in base.train_x] == [
        d.impath for d in a.train_x if d.label < math.ceil(a.num_classes / 2)
    ]
    assert len(os.listdir(cache_dir)) == 2  # subsampling comes after the cached draw


@pytest.mark.parametrize("name", PAPER_DATASETS)
def test_missing_piece_fails_at_startup(name, tmp_path):
    root = str(tmp_path)
    BUILDERS[name](root)
    rel, shown = MISSING_PIECE[name]
    path = osp.join(root, rel)
    shutil.rmtree(path) if osp.isdir(path) else os.remove(path)
    with pytest.raises(DatasetNotFoundError) as err:
        build(name, root)
    msg = str(err.value)
    assert msg.startswith(f"{name}: ") and shown in msg and "How to get it:" in msg
    assert DATASET_REGISTRY.get(name).layout.how in msg


def test_nothing_is_scanned_before_the_layout_check(tmp_path, monkeypatch):
    root = str(tmp_path)
    BUILDERS["ImageNet"](root)
    os.remove(osp.join(root, "imagenet", "classnames.txt"))
    monkeypatch.setattr(ImageNet, "read_splits", lambda *a: pytest.fail("scanned"))
    with pytest.raises(DatasetNotFoundError, match="imagenet/classnames.txt"):
        build("ImageNet", root)


def test_split_file_is_read_and_a_new_split_gets_a_new_fewshot_cache(tmp_path):
    root = str(tmp_path)
    BUILDERS["Caltech101"](root)
    build("Caltech101", root, "DATASET.NUM_SHOTS", "1")
    split_path = osp.join(root, "caltech-101", "split_zhou_Caltech101.json")
    with open(split_path) as f:
        split = json.load(f)
    assert split["train"][0][0].count("/") == 1  # "<class>/<image>", relative to the images
    split["train"] = [row for row in split["train"] if not row[0].startswith("anchor/")][1:]
    split["train"].append(["anchor/anchor_0.jpg", 5, "anchor"])
    with open(split_path, "w") as f:
        json.dump(split, f)
    ds = build("Caltech101", root)
    assert len(ds.train_x) == 30 - 5 - 1 + 1
    assert [d.impath for d in ds.train_x if d.label == 5] == [
        osp.join(root, "caltech-101", "101_ObjectCategories", "anchor", "anchor_0.jpg")
    ]
    few = build("Caltech101", root, "DATASET.NUM_SHOTS", "1")
    assert len(os.listdir(osp.join(root, "caltech-101", "split_fewshot"))) == 2
    assert {d.impath for d in few.train_x} <= {d.impath for d in ds.train_x}


def test_generated_split_depends_on_the_seed_only(tmp_path):
    root = str(tmp_path)
    BUILDERS["OxfordFlowers"](root)
    split_path = osp.join(root, "oxford_flowers", "split_zhou_OxfordFlowers.json")
    first = listing(build("OxfordFlowers", root, seed=3))
    os.remove(split_path)
    assert listing(build("OxfordFlowers", root, seed=3)) == first
    os.remove(split_path)
    assert listing(build("OxfordFlowers", root, seed=4)) != first


def test_generated_flowers_split_equals_coops(tmp_path):
    """CoOp's generation, verbatim: the global ``random`` seeded with the run seed, classes in
    order of first appearance in imagelabels.mat, 50/20/30 of each shuffled class."""
    import random

    from scipy.io import loadmat

    root = str(tmp_path)
    BUILDERS["OxfordFlowers"](root)
    ds = build("OxfordFlowers", root, seed=7)
    d = osp.join(root, "oxford_flowers")
    random.seed(7)
    tracker = {}
    for i, label in enumerate(loadmat(osp.join(d, "imagelabels.mat"))["labels"][0]):
        tracker.setdefault(int(label), []).append(osp.join(d, "jpg", f"image_{i + 1:05d}.jpg"))
    want = [[], [], []]
    for label, paths in tracker.items():
        random.shuffle(paths)
        n_train, n_val = round(len(paths) * 0.5), round(len(paths) * 0.2)
        for k, part in enumerate((paths[:n_train], paths[n_train : n_train + n_val])):
            want[k] += [(p, label - 1) for p in part]
        want[2] += [(p, label - 1) for p in paths[n_train + n_val :]]
    assert [[(x.impath, x.label) for x in items] for items in listing(ds)] == want


def test_split_file_makes_generation_inputs_optional_and_images_are_spot_checked(tmp_path):
    root = str(tmp_path)
    BUILDERS["OxfordPets"](root)
    build("OxfordPets", root)  # writes the split file
    shutil.rmtree(osp.join(root, "oxford_pets", "annotations"))
    assert build("OxfordPets", root).num_classes == 4
    for i in range(6, 9):  # the test images of Bengal
        os.remove(osp.join(root, "oxford_pets", "images", f"Bengal_{i}.jpg"))
    with pytest.raises(DatasetNotFoundError, match=r"image\(s\) that the split lists.*Bengal_"):
        build("OxfordPets", root)


def test_split_file_with_a_label_gap_is_rejected(tmp_path):
    root = str(tmp_path)
    BUILDERS["DescribableTextures"](root)
    split_path = osp.join(root, "dtd", "split_zhou_DescribableTextures.json")
    rows = [["banded/banded_0.jpg", 0, "banded"], ["bubbly/bubbly_0.jpg", 2, "bubbly"]]
    with open(split_path, "w") as f:
        json.dump({"train": rows, "val": [], "test": rows}, f)
    with pytest.raises(ValueError, match=r"labels must run 0\.\.2 without gaps.*label\(s\) \[1\]"):
        build("DescribableTextures", root)


def test_imagenet_lists_are_cached_and_invalidated(tmp_path, monkeypatch):
    root = str(tmp_path)
    BUILDERS["ImageNet"](root)
    first = listing(build("ImageNet", root))
    cache = osp.join(root, "imagenet", "preprocessed_sample_pl.pkl")  # CoOp owns preprocessed.pkl
    with open(cache, "rb") as f:
        data = pickle.load(f)  # plain Python types only
    assert data["train"][0] == ("train/n01440764/n01440764_0.JPEG", 0)
    assert len(data["train"]) == 20 and len(data["test"]) == 10
    assert data["classnames"] == [WNIDS[w] for w in sorted(WNIDS)]

    with monkeypatch.context() as m:
        m.setattr(ImageNet, "scan", lambda self: pytest.fail("re-listed the images"))
        assert listing(build("ImageNet", root)) == first

    time.sleep(0.05)  # past the file system's time stamp granularity
    train_dir = osp.join(root, "imagenet", "images", "train", "n01443537")
    write_images([osp.join(train_dir, "extra.JPEG")])
    again = build("ImageNet", root)
    assert len(again.train_x) == 21
    assert osp.join(train_dir, "extra.JPEG") in {d.impath for d in again.train_x}


def test_imagenet_uses_coop_caches(tmp_path):
    root = str(tmp_path)
    BUILDERS["ImageNet"](root)
    images = osp.join(root, "imagenet", "images")
    wnids = sorted(WNIDS)

    def coop_lists(datum):  # CoOp's preprocessed.pkl, missing one training image
        def rows(split, n):
            return [
                datum(osp.join(images, split, w, name), y, WNIDS[w])
                for y, w in enumerate(wnids)
                for name in sorted(os.listdir(osp.join(images, split, w)))[:n]
            ]

        return {"train": rows("train", 4)[:-1], "test": rows("val", 2)}

    coop_pickle(coop_lists, osp.join(root, "imagenet", "preprocessed.pkl"))
    ds = build("ImageNet", root)
    assert len(ds.train_x) == 19 and len(ds.test) == 10

    def coop_fewshot(datum):  # written on another machine: other absolute paths, no val
        return {
            "train": [
                datum(f"/home/u/data/imagenet/images/train/{w}/{w}_3.JPEG", y, WNIDS[w])
                for y, w in enumerate(wnids[:4])
            ]
            + [datum(f"/home/u/data/imagenet/images/train/{wnids[4]}/{wnids[4]}_0.JPEG", 4, "x")]
        }

    os.makedirs(osp.join(root, "imagenet", "split_fewshot"))
    coop_pickle(coop_fewshot, osp.join(root, "imagenet", "split_fewshot", "shot_1-seed_1.pkl"))
    few = build("ImageNet", root, "DATASET.NUM_SHOTS", "1")
    assert [d.impath for d in few.train_x] == [
        osp.join(images, "train", w, f"{w}_{0 if y == 4 else 3}.JPEG") for y, w in enumerate(wnids)
    ]
    assert few.classnames == [WNIDS[w] for w in wnids]


def test_imagenet_needs_the_same_class_folders_in_train_and_val(tmp_path):
    root = str(tmp_path)
    BUILDERS["ImageNet"](root)
    shutil.rmtree(osp.join(root, "imagenet", "images", "val", "n01494475"))
    with pytest.raises(DatasetNotFoundError, match=r"in only one of them: \['n01494475'\]"):
        build("ImageNet", root)


def test_eval_only_sets_find_the_imagenet_classnames_and_feed_a_datamanager(tmp_path):
    root = str(tmp_path)
    BUILDERS["ImageNetA"](root)
    os.remove(osp.join(root, "imagenet-adversarial", "classnames.txt"))
    with pytest.raises(
        DatasetNotFoundError,
        match="imagenet-adversarial/classnames.txt or imagenet/classnames.txt",
    ):
        build("ImageNetA", root)
    write_classnames(osp.join(root, "imagenet", "classnames.txt"))
    ds = build("ImageNetA", root, "DATASET.NUM_SHOTS", "1")  # ignored: evaluation only
    assert ds.classnames == ["goldfish", "great white shark", "hammerhead shark"]
    assert len(ds.test) == 6 and not osp.exists(osp.join(ds.dataset_dir, "split_fewshot"))

    opts = ["DATALOADER.NUM_WORKERS", "0", "DATALOADER.TEST.BATCH_SIZE", "4"]
    opts += ["INPUT.SIZE", "(16, 16)"]
    cfg = make_cfg(["--root", root, *opts], dataset_cfg="configs/datasets/imagenet_a.yaml")
    dm = DataManager(cfg)
    assert dm.val_loader is None and dm.num_classes == 3
    batch = next(iter(dm.test_loader))
    assert batch["img"].shape == (4, 3, 16, 16)


def test_imagenetv2_needs_every_numbered_folder(tmp_path):
    root = str(tmp_path)
    BUILDERS["ImageNetV2"](root)
    shutil.rmtree(osp.join(root, "imagenetv2", "imagenetv2-matched-frequency-format-val", "3"))
    with pytest.raises(DatasetNotFoundError, match=r"class folder not found: .*format-val/3"):
        build("ImageNetV2", root)


# ----------------------------------------------------------------------------------------------
# tools/check_data.py and tools/download_data.py
# ----------------------------------------------------------------------------------------------
def test_check_data_ready_missing_partial(tmp_path, capsys):
    root = str(tmp_path)
    BUILDERS["EuroSAT"](root)  # all 10 classes
    status, details = check_data.check_dataset(root, "eurosat")
    assert status == "ready" and "split_zhou_EuroSAT.json absent" in details[0]

    status, details = check_data.check_dataset(root, "Caltech101")
    assert status == "missing" and details[-1].startswith("how to get it: Caltech 101")

    BUILDERS["Caltech101"](root)  # 6 of the 100 classes
    status, details = check_data.check_dataset(root, "caltech-101")
    assert status == "partial" and "has 6 class folders, the dataset has 100" in details[0]

    BUILDERS["ImageNetR"](root)
    shutil.rmtree(osp.join(root, "imagenet-rendition", "imagenet-r"))
    status, details = check_data.check_dataset(root, "ImageNetR")
    assert status == "partial" and details[0] == "missing: imagenet-rendition/imagenet-r/"

    assert check_data.main(["--root", root, "EuroSAT"]) == 0
    assert check_data.main(["--root", root, "EuroSAT", "Caltech101", "imagenet_r"]) == 1
    out = capsys.readouterr().out
    assert "ready" in out and "partial" in out and "How to get what is missing" in out
    assert "1 of 3 ready" in out


def test_check_data_reports_readers_without_a_layout_as_unchecked(tmp_path, monkeypatch):
    class NoLayoutSet:  # e.g. a user's reader that checks its own data
        pass

    monkeypatch.setitem(DATASET_REGISTRY._obj_map, "NoLayoutSet", NoLayoutSet)
    status, details = check_data.check_dataset(str(tmp_path), "NoLayoutSet")
    assert status == "unchecked" and "declares no layout" in details[0]
    assert check_data.main(["--root", str(tmp_path), "NoLayoutSet"]) == 0
    with pytest.raises(KeyError, match="Unknown dataset 'NoSuchSet'"):
        check_data.check_dataset(str(tmp_path), "NoSuchSet")


@pytest.mark.slow
def test_check_data_script_exit_status(tmp_path):
    proc = subprocess.run(
        [sys.executable, osp.join(ROOT, "tools", "check_data.py"), "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "0 of 15 ready" in proc.stdout and "missing" in proc.stdout


def test_download_tool_lists_and_unpacks_without_network(tmp_path, capsys, monkeypatch):
    assert download_data.main(["--root", str(tmp_path), "--list"]) == 0
    out = capsys.readouterr().out
    assert "drive.google.com/file/d/1hyarUivQE36mY6jSomru6Fjd-JzwcCzN" in out
    assert "by hand: the images (image-net.org" in out

    archive = str(tmp_path / "a.tar.gz")
    with tarfile.open(archive, "w:gz") as tf:
        for name in ("fgvc-aircraft-2013b/data/images/1.jpg", "fgvc-aircraft-2013b/data/x.txt"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tf.addfile(info, io.BytesIO(b"ok"))
    download_data.extract(archive, str(tmp_path / "out"), strip="fgvc-aircraft-2013b/data/")
    assert sorted(os.listdir(tmp_path / "out")) == ["images", "x.txt"]

    evil = str(tmp_path / "evil.zip")
    with zipfile.ZipFile(evil, "w") as zf:
        zf.writestr("../escaped.txt", "x")
    with pytest.raises(download_data.DownloadError, match="leaves"):
        download_data.extract(evil, str(tmp_path / "out"))

    monkeypatch.setitem(sys.modules, "gdown", None)  # gdown not installed
    with pytest.raises(download_data.DownloadError, match="gdown is not installed"):
        download_data.fetch_gdrive("abc", str(tmp_path / "split.json"))
