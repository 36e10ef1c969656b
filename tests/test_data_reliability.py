"""Issue 15, data side: unreadable images, damaged split/cache files, read-only dataset folders,
CoOp-owned files, concurrent split generation and data-side config values.

Command-line behaviour is tested through ``train.py`` subprocesses (exit 2 and one paragraph
on stderr, no traceback); the rest in-process.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import os.path as osp
import pickle
import stat
import time

import pytest
from conftest import ROOT, make_cfg, run_train
from dataset_trees import BUILDERS, coop_pickle
from helpers import train_in_process

from datasets.dtd import DescribableTextures
from datasets.imagenet import ImageNet
from engine.data import (
    DataManager,
    ImageReadError,
    SplitFileError,
    UnreadableImagesError,
    build_dataset,
    cache_files,
)
from engine.data.image_check import find_unreadable, image_problem
from engine.errors import ConfigError, DataError

DTD_CFG = osp.join(ROOT, "configs/datasets/dtd.yaml")
COOP_CFG = osp.join(ROOT, "configs/trainers/CoOp/vit_b16_ctxv1.yaml")
SPLIT = "split_zhou_DescribableTextures.json"
SKIP = ("DATASET.SKIP_UNREADABLE", "True")


def _train_args(root, out, tiny_clip_opts, *extra, trainer="CoOp", flags=()):
    return [
        *("--root", root, "--seed", "1", "--trainer", trainer),
        *("--dataset-config-file", DTD_CFG, "--output-dir", out, *flags),
        *(["--config-file", COOP_CFG] if trainer == "CoOp" else []),
        *tiny_clip_opts,
        *extra,
    ]


def _dtd(root, *opts, seed=1):
    return build_dataset(make_cfg(["--root", root, "--seed", str(seed), *opts]))


def _truncate(path):
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])


def _break_three(paths):
    """A truncated, a zero-byte and a non-image file; returns {path: expected reason}."""
    _truncate(paths[0])
    open(paths[1], "wb").close()
    with open(paths[2], "w") as f:
        f.write("<html>404 Not Found</html>")
    return {paths[0]: "truncated", paths[1]: "zero-byte", paths[2]: "not an image"}


def _no_traceback(proc):
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout


# ----------------------------------------------------------------------------------------------
# Row 1: unreadable images
# ----------------------------------------------------------------------------------------------
def test_image_problem_reasons(tmp_path, dtd_root):
    good = sorted(
        osp.join(dp, f) for dp, _, fs in os.walk(osp.join(dtd_root, "dtd", "images")) for f in fs
    )
    expected = _break_three(good[:3])
    assert image_problem(good[3]) is None
    with open(good[4], "ab") as f:  # trailing bytes after the end marker: still a valid JPEG
        f.write(b"\0" * 4000)
    assert image_problem(good[4]) is None
    assert "file not found" in image_problem(str(tmp_path / "missing.jpg"))
    for path, reason in expected.items():
        assert reason in image_problem(path), (path, image_problem(path))


@pytest.mark.slow
def test_unreadable_training_images_all_listed_before_the_first_step(
    tmp_path, dtd_root, tiny_clip_opts
):
    ds = _dtd(dtd_root)  # generates and saves the split
    expected = _break_three([d.impath for d in ds.train_x[::12]])
    out = str(tmp_path / "out")
    args = _train_args(dtd_root, out, tiny_clip_opts, "OPTIM.MAX_EPOCH", "1")
    proc = run_train(args, check=False)
    _no_traceback(proc)
    assert f"3 of {len(ds.train_x)} training images cannot be read" in proc.stderr
    for path, reason in expected.items():
        assert f"{path}: {reason}" in proc.stderr
    assert "DATASET.SKIP_UNREADABLE True" in proc.stderr
    assert "epoch [" not in proc.stdout  # stopped before the first step

    skip = str(tmp_path / "skip")
    train_in_process(_train_args(dtd_root, skip, tiny_clip_opts, "OPTIM.MAX_EPOCH", "1", *SKIP))
    log = open(osp.join(skip, "log.txt")).read()
    assert f"Skipping 3 unreadable training image(s) of {len(ds.train_x)}" in log
    assert "Finish training" in log and "=> result" in log


@pytest.mark.slow
def test_unreadable_test_images_reported_by_an_evaluation_only_run(
    tmp_path, dtd_root, tiny_clip_opts
):
    ds = _dtd(dtd_root)
    bad = [ds.test[0].impath, ds.test[-1].impath]
    _truncate(bad[0])
    open(bad[1], "wb").close()

    def args(out, *extra):
        flags = ["--eval-only"]
        return _train_args(
            dtd_root, out, tiny_clip_opts, *extra, trainer="ZeroshotCLIP", flags=flags
        )

    proc = run_train(args(str(tmp_path / "zs")), check=False)
    _no_traceback(proc)
    assert f"2 of {len(ds.test)} test images cannot be read" in proc.stderr
    assert f"{bad[0]}: truncated" in proc.stderr and f"{bad[1]}: zero-byte" in proc.stderr

    proc = run_train(args(str(tmp_path / "zs_skip"), *SKIP))
    assert f"Skipping 2 unreadable test image(s) of {len(ds.test)}" in proc.stdout
    assert f"* total: {len(ds.test) - 2}" in proc.stdout


def test_image_failing_in_a_loader_worker_names_the_file_without_the_worker_traceback(
    dtd_root,
):
    cfg = make_cfg(["--root", dtd_root, "--seed", "1", "DATALOADER.NUM_WORKERS", "1"])
    dm = DataManager(cfg)  # the start-up check passes
    victim = dm.dataset.test[3].impath
    _truncate(victim)  # damaged after the check
    with pytest.raises(ImageReadError) as info:
        for _ in dm.test_loader:
            pass
    msg = str(info.value)
    assert isinstance(info.value, DataError) and victim in msg and "truncated" in msg
    assert "Traceback" not in msg and "DataLoader worker" in msg


@pytest.mark.slow
def test_training_check_and_skip_update_the_loader_and_the_decoded_cache(dtd_root):
    ds = _dtd(dtd_root)
    expected = _break_three([d.impath for d in ds.train_x[:3]])
    for cache in ("True", "False"):
        opts = ["DATALOADER.NUM_WORKERS", "0", "DATALOADER.CACHE_DECODED", cache]
        dm = DataManager(make_cfg(["--root", dtd_root, "--seed", "1", *opts]))
        with pytest.raises(UnreadableImagesError) as info:
            dm.cache_training_images()
        assert [p for p, _ in info.value.bad] == list(expected)
        dm = DataManager(
            make_cfg(["--root", dtd_root, "--seed", "1", *opts, "DATASET.SKIP_UNREADABLE", "True"])
        )
        dm.cache_training_images()
        loader = dm.train_loader_x
        n = len(ds.train_x) - 3
        assert len(loader.dataset) == len(loader.sampler) == len(dm.dataset.train_x) == n
        seen = [p for b in loader for p in b["impath"]]
        assert len(seen) == n and not set(seen) & set(expected)
        if cache == "True":
            assert len(loader.dataset.images) == n


def test_check_cost_per_1000_images(tmp_path):
    """The fast check reads headers and file ends (~0.05 ms per image when cached by the OS);
    a loose bound here only catches an accidental full decode (~2-4 ms per 500x375 JPEG)."""
    from datasets.synthetic import make_image_folder
    from engine.data import Datum

    make_image_folder(str(tmp_path), ["a", "b"], per_class=500, size=64)
    items = [Datum(osp.join(dp, f), 0, 0, "a") for dp, _, fs in os.walk(str(tmp_path)) for f in fs]
    find_unreadable(items)  # warm the page cache
    start = time.perf_counter()
    assert find_unreadable(items) == []
    assert time.perf_counter() - start < 2.0


# ----------------------------------------------------------------------------------------------
# Row 2: damaged split and few-shot cache files
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_invalid_split_json_is_one_clear_error(tmp_path, dtd_root, tiny_clip_opts):
    path = osp.join(dtd_root, "dtd", SPLIT)
    with open(path, "w") as f:
        f.write('{"train": [["banded/banded_0000.jpg", 0, "banded"],')  # cut off
    proc = run_train(_train_args(dtd_root, str(tmp_path / "o"), tiny_clip_opts), check=False)
    _no_traceback(proc)
    assert path in proc.stderr and "not valid JSON" in proc.stderr
    assert "Delete it" in proc.stderr and "download_data.py" in proc.stderr


@pytest.mark.parametrize(
    "content",
    ['{"train": []}', "[1, 2]", '{"train": [[1]], "val": [], "test": []}', "\udcff"],
)
def test_split_with_the_wrong_structure_is_a_data_error(dtd_root, content):
    path = osp.join(dtd_root, "dtd", SPLIT)
    with open(path, "w", errors="surrogateescape") as f:
        f.write(content)
    with pytest.raises(SplitFileError, match=f"Split file {path} .*Delete it"):
        _dtd(dtd_root)


def test_damaged_fewshot_cache_is_drawn_again_with_a_warning(dtd_root, caplog):
    first = _dtd(dtd_root, "DATASET.NUM_SHOTS", "2").train_x
    cache_dir = osp.join(dtd_root, "dtd", "split_fewshot")
    (name,) = os.listdir(cache_dir)
    for damage in ("{not json", '{"train": 3}'):
        with open(osp.join(cache_dir, name), "w") as f:
            f.write(damage)
        with caplog.at_level(logging.WARNING):
            again = _dtd(dtd_root, "DATASET.NUM_SHOTS", "2").train_x
        assert again == first and "is damaged" in caplog.text
        assert os.listdir(cache_dir) == [name]
        json.load(open(osp.join(cache_dir, name)))  # rewritten
        caplog.clear()


# ----------------------------------------------------------------------------------------------
# Row 3: read-only dataset folders
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    path = tmp_path / "user-cache"
    monkeypatch.setenv("SAMPLE_PL_CACHE", str(path))
    monkeypatch.setattr(cache_files, "_announced", set())
    return path


def _dtd_files(root):
    return sorted(os.listdir(osp.join(root, "dtd")))


def test_read_only_dataset_folder_uses_the_user_cache(dtd_root, user_cache, monkeypatch, caplog):
    """Simulates a read-only mount: ``os.access(W_OK)`` is False for the dataset tree (as on a
    read-only file system, even for root); nothing may be written there."""
    real_access = os.access
    data = osp.join(dtd_root, "dtd")

    def access(path, mode, **kw):
        if mode & os.W_OK and osp.abspath(path).startswith(data):
            return False
        return real_access(path, mode, **kw)

    monkeypatch.setattr(cache_files.os, "access", access)
    before = _dtd_files(dtd_root)
    with caplog.at_level(logging.INFO):
        a = _dtd(dtd_root, "DATASET.NUM_SHOTS", "2")
    assert _dtd_files(dtd_root) == before  # nothing written into the dataset folder
    fallback = user_cache / "datasets" / data.lstrip(os.sep)
    assert (fallback / SPLIT).is_file() and len(os.listdir(fallback / "split_fewshot")) == 1
    assert caplog.text.count("cannot be written") == 1  # logged once for both files
    # the next run reads both files from the user cache
    monkeypatch.setattr(DescribableTextures, "generate_split", lambda *a: pytest.fail("split"))
    b = _dtd(dtd_root, "DATASET.NUM_SHOTS", "2", seed=1)
    assert b.train_x == a.train_x and b.test == a.test


def test_unwritable_cache_paths_fall_back_for_root_too(tmp_path, dtd_root, user_cache):
    """Root writes through ``chmod -w``, so this blocks the paths themselves: the split file's
    path is a folder and ``split_fewshot`` a file, and the real writes fail with OSError."""
    data = osp.join(dtd_root, "dtd")
    os.makedirs(osp.join(data, SPLIT))
    open(osp.join(data, "split_fewshot"), "w").close()
    a = _dtd(dtd_root, "DATASET.NUM_SHOTS", "1")
    fallback = user_cache / "datasets" / data.lstrip(os.sep)
    assert (fallback / SPLIT).is_file() and len(os.listdir(fallback / "split_fewshot")) == 1
    assert _dtd(dtd_root, "DATASET.NUM_SHOTS", "1").train_x == a.train_x


@pytest.mark.skipif(os.geteuid() == 0, reason="chmod -w does not stop root")
def test_chmod_read_only_dataset_folder(dtd_root, user_cache):
    data = osp.join(dtd_root, "dtd")
    os.chmod(data, 0o555)
    try:
        _dtd(dtd_root, "DATASET.NUM_SHOTS", "1")
        assert not osp.exists(osp.join(data, SPLIT))
        assert (user_cache / "datasets" / data.lstrip(os.sep) / SPLIT).is_file()
    finally:
        os.chmod(data, 0o755)


# ----------------------------------------------------------------------------------------------
# Row 4: files of the CoOp code bases are never overwritten
# ----------------------------------------------------------------------------------------------
def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_coop_imagenet_and_fewshot_pickles_are_never_written(tmp_path):
    root = str(tmp_path)
    BUILDERS["ImageNet"](root)
    folder = osp.join(root, "imagenet")
    coop = osp.join(folder, "preprocessed.pkl")

    def elsewhere(datum):  # CoOp's file from another copy: not usable here, must stay
        return {"train": [datum("/elsewhere/x.JPEG", 0, "tench")], "test": []}

    coop_pickle(elsewhere, coop)
    before = open(coop, "rb").read()
    old = os.umask(0o022)
    try:
        ds = build_dataset(
            make_cfg(
                ["--root", root, "--seed", "1", "DATASET.NUM_SHOTS", "1"],
                dataset_cfg="configs/datasets/imagenet.yaml",
            )
        )
    finally:
        os.umask(old)
    assert len(ds.train_x) == 5
    assert open(coop, "rb").read() == before
    own = osp.join(folder, "preprocessed_sample_pl.pkl")
    assert _mode(own) == 0o644
    (fewshot,) = os.listdir(osp.join(folder, "split_fewshot"))
    assert fewshot.endswith(".json") and _mode(osp.join(folder, "split_fewshot", fewshot)) == 0o644


def test_old_project_preprocessed_pkl_is_moved_to_its_own_name(tmp_path, monkeypatch):
    root = str(tmp_path)
    BUILDERS["ImageNet"](root)
    cfg = make_cfg(["--root", root], dataset_cfg="configs/datasets/imagenet.yaml")
    first = build_dataset(cfg)
    folder = osp.join(root, "imagenet")
    os.replace(osp.join(folder, "preprocessed_sample_pl.pkl"), osp.join(folder, "preprocessed.pkl"))
    monkeypatch.setattr(ImageNet, "scan", lambda self: pytest.fail("re-listed"))
    assert build_dataset(cfg).train_x == first.train_x
    assert not osp.exists(osp.join(folder, "preprocessed.pkl"))
    with open(osp.join(folder, "preprocessed_sample_pl.pkl"), "rb") as f:
        assert pickle.load(f)["format"].startswith("sample-prompt-learning/")


# ----------------------------------------------------------------------------------------------
# Row 5: split and few-shot files are generated once, under a lock
# ----------------------------------------------------------------------------------------------
def _race_worker(root, seed, queue):
    real = DescribableTextures.generate_split

    def slow(self, rng):  # a slow folder scan: both runs are inside it at the same time
        time.sleep(1.0)
        return real(self, rng)

    DescribableTextures.generate_split = slow
    ds = _dtd(root, "DATASET.NUM_SHOTS", "2", seed=seed)
    queue.put((seed, [d.impath for d in ds.test], [d.impath for d in ds.train_x]))


def test_two_seeds_racing_on_a_missing_split_use_the_saved_split(dtd_root):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(dtd_root, s, queue)) for s in (1, 2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        seed, test, train = queue.get(timeout=120)
        results[seed] = (test, train)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    saved = _dtd(dtd_root)  # the split file on disk
    saved_train = {d.impath for d in saved.train_x}
    for test, train in results.values():  # without the lock, seed 2 tests on seed 1's split
        assert test == [d.impath for d in saved.test]
        assert set(train) <= saved_train  # the few-shot draws (per seed) come from it
    assert not [f for f in os.listdir(osp.join(dtd_root, "dtd")) if f.endswith(".lock")]


# ----------------------------------------------------------------------------------------------
# Row 6: data-side config values are validated by key name
# ----------------------------------------------------------------------------------------------
BAD_VALUES = [
    ("DATALOADER.NUM_WORKERS", "-1"),
    ("DATALOADER.TRAIN_X.BATCH_SIZE", "0"),
    ("DATALOADER.TEST.BATCH_SIZE", "0"),
    ("DATALOADER.K_TRANSFORMS", "0"),
    ("DATALOADER.TRAIN_X.SAMPLER", "RandomSamplr"),
    ("DATASET.NUM_SHOTS", "-4"),
    ("DATASET.SUBSAMPLE_CLASSES", "novel"),
    ("DATASET.VAL_PERCENT", "1.5"),
    ("INPUT.SIZE", "(224, 0)"),
    ("INPUT.PIXEL_STD", "[0.2, 0.0, 0.2]"),
]


@pytest.mark.parametrize("key,value", BAD_VALUES)
def test_bad_data_config_values_name_the_key(dtd_root, key, value):
    cfg = make_cfg(["--root", dtd_root, key, value])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        DataManager(cfg)


@pytest.mark.slow
def test_bad_config_value_on_the_command_line(tmp_path, dtd_root, tiny_clip_opts):
    args = _train_args(dtd_root, str(tmp_path / "o"), tiny_clip_opts)
    proc = run_train(args + ["DATALOADER.NUM_WORKERS", "-1"], check=False)
    _no_traceback(proc)
    assert "DATALOADER.NUM_WORKERS must be >= 0" in proc.stderr
