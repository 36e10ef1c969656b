"""tools/download_data.py and tools/check_data.py --verify against a loopback server on 127.0.0.1.

Tiny archives in each source's real structure (tests/dataset_archives.py) are served through
``$SAMPLE_PL_DATA_MIRROR``, Google Drive files included (gdown fetches their mirror copies);
their checksums come from a test-only table passed with ``--checksums`` (the recorded table of
published checksums is never changed). Nothing here reaches beyond the machine.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import multiprocessing
import os
import os.path as osp
import shutil
import socket
import subprocess
import sys
import tarfile
import time

import dataset_archives
import pytest
from conftest import ROOT
from dataset_archives import build, build_sources, write_checksums
from dataset_trees import BUILDERS
from test_weights_download import _waiting_on_lock, server  # noqa: F401  (the loopback server)

from datasets import PAPER_DATASETS
from experiments import verify_data
from experiments.layouts import find_layout
from tools import check_data, download_data

DTD_ARCHIVE = "dtd/dtd-r1.0.1.tar.gz"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return build_sources(str(tmp_path_factory.mktemp("sources")), PAPER_DATASETS)


@pytest.fixture
def mirror(server, sources, tmp_path, monkeypatch):  # noqa: F811
    """The tiny files served under the mirror variable; returns (server, root, argv prefix)."""
    server.files.update(sources.served)
    monkeypatch.setenv(download_data.MIRROR_ENV, server.base + "/mirror")
    monkeypatch.delenv("SAMPLE_PL_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(download_data, "RETRY_WAIT_S", 0.0)
    monkeypatch.setattr(download_data, "DRIVE_RETRIES", 0)
    root = str(tmp_path / "data")
    table = write_checksums(str(tmp_path / "checksums.json"), sources.checksums)
    return server, root, ["--root", root, "--checksums", table, "--quiet"]


def requests_for(srv, key: str, sources) -> list:
    return [r for r in srv.requests if r[0] == sources.paths[key]]


def leftovers(root: str) -> list[str]:
    """Temporary unpack folders and completion markers under ``root``."""
    found = glob.glob(osp.join(root, "*", download_data.UNPACKING + "*"))
    return found + glob.glob(osp.join(root, "*", download_data.MARKER + "*"))


def test_every_dataset_fetched_unpacked_read_and_verified_ready(mirror, sources, capsys):
    srv, root, argv = mirror
    assert download_data.main(argv) == 1  # ImageNet's images and Stanford Cars come by hand
    out = capsys.readouterr().out
    for name in ("cars_train.tgz", "cars_test.tgz", "car_devkit.tgz"):
        assert f"stanford_cars/{name}: by hand: the original Stanford host" in out
        assert f"Put {name} in {root}/stanford_cars/ and rerun" in out
    for name in ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar", "ILSVRC2012_devkit_t12"):
        assert f"imagenet/{name}" in out and f"Put {name}" in out
    for name, files in sources.by_hand.items():  # what a person brings
        folder = find_layout(name).dir(root)
        for filename, data in files.items():
            with open(osp.join(folder, filename), "wb") as f:
                f.write(data)
    served = len(srv.requests)
    assert sorted(r[0] for r in srv.requests) == sorted(sources.served)  # each file once

    assert download_data.main(argv) == 0
    assert len(srv.requests) == served  # everything complete: nothing fetched again
    reference = {n: verify_data.Reference.of_tree(e) for n, e in sources.expected.items()}
    for name in PAPER_DATASETS:
        data = build(name, root)
        expected = sources.expected[name]
        assert data.classnames == expected.names, name
        sizes = (len(data.train_x), len(data.val or []), len(data.test))
        if name in ("ImageNetV2", "ImageNetSketch", "ImageNetA", "ImageNetR"):
            sizes = (0, 0, sizes[2])
        assert sizes == expected.sizes, name
        status, details = verify_data.verify_dataset(root, name, reference[name])
        assert status == check_data.READY, (name, details)
    assert leftovers(root) and not glob.glob(osp.join(root, "*", download_data.UNPACKING + "*"))


def test_corrupted_archive_is_deleted_and_nothing_unpacked(mirror, sources, capsys):
    srv, root, argv = mirror
    path = sources.paths[DTD_ARCHIVE]
    good = srv.files[path]
    srv.files[path] = good[:-10] + b"0123456789"
    assert download_data.main([*argv, "dtd"]) == 1
    out = capsys.readouterr().out
    want = sources.checksums[DTD_ARCHIVE][1]
    assert f"{DTD_ARCHIVE}: the downloaded file" in out and f"expected {want}" in out
    assert "it was deleted and nothing was unpacked" in out
    assert not osp.exists(osp.join(root, "dtd", "images")) and not leftovers(root)
    assert not os.listdir(osp.join(root, download_data.STAGING, "dtd"))


def test_dropped_connection_resumes_with_range_and_restarts_without(mirror, sources):
    srv, root, argv = mirror
    path = sources.paths["eurosat/EuroSAT.zip"]
    size = len(srv.files[path])
    assert download_data.main([*argv, "--small-only", "eurosat"]) == 0  # the split file only
    srv.cut, srv.cut_at = 1, size // 3
    srv.requests.clear()
    assert download_data.main([*argv, "eurosat"]) == 0
    assert srv.requests == [(path, None), (path, f"bytes={size // 3}-")]
    assert len(os.listdir(osp.join(root, "eurosat", "2750"))) == 10

    srv.ranges, srv.cut = False, 1  # a srv that ignores Range: start over
    shutil.rmtree(osp.join(root, "eurosat"))
    srv.requests.clear()
    assert download_data.main([*argv, "eurosat"]) == 0
    assert [r[1] for r in srv.requests if r[0] == path] == [None, f"bytes={size // 3}-"]
    assert len(os.listdir(osp.join(root, "eurosat", "2750"))) == 10


def _fetch_in_child(argv):
    try:
        code = download_data.main(argv)
    except BaseException:
        os._exit(2)
    os._exit(code)


def test_two_invocations_at_once_make_one_download(mirror, sources):
    srv, root, argv = mirror
    srv.gate.clear()  # responses wait until both processes are in
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_fetch_in_child, args=([*argv, "dtd"],)) for _ in range(2)]
    for p in procs:
        p.start()
    lock = osp.join(root, download_data.STAGING, "dtd.lock")
    deadline = time.time() + 20
    while time.time() < deadline and not (
        srv.requests and osp.exists(lock) and _waiting_on_lock(lock)
    ):
        time.sleep(0.05)
    assert srv.requests and _waiting_on_lock(lock)  # one fetches, one waits
    srv.gate.set()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(r[0] for r in srv.requests) == sorted(
        sources.paths[k] for k in (DTD_ARCHIVE, "dtd/split_zhou_DescribableTextures.json")
    )


def test_full_disk_while_unpacking_leaves_nothing_that_looks_complete(
    mirror, sources, monkeypatch, capsys
):
    srv, root, argv = mirror
    real = tarfile.copyfileobj
    calls = []

    def full_disk(src, dst, length=None, *args, **kwargs):  # the disk fills on the 3rd file
        calls.append(length)
        if len(calls) == 3:
            dst.write(src.read(max(1, (length or 2) // 2)))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(src, dst, length, *args, **kwargs)

    monkeypatch.setattr(tarfile, "copyfileobj", full_disk)
    assert download_data.main([*argv, "dtd"]) == 1
    out = capsys.readouterr().out
    assert "No space left on device" in out and "nothing of it was put in place" in out
    assert not osp.exists(osp.join(root, "dtd", "images")) and not leftovers(root)
    status, _ = check_data.check_dataset(root, "dtd")
    assert status != check_data.READY
    monkeypatch.setattr(tarfile, "copyfileobj", real)
    assert download_data.main([*argv, "dtd"]) == 0  # the kept archive: unpacked, not fetched
    assert len(requests_for(srv, DTD_ARCHIVE, sources)) == 1
    reference = verify_data.Reference.of_tree(sources.expected["DescribableTextures"])
    assert verify_data.verify_dataset(root, "dtd", reference)[0] == check_data.READY


def test_drive_file_changed_after_pinning_is_refused(mirror, sources, capsys):
    srv, root, argv = mirror
    key = "dtd/split_zhou_DescribableTextures.json"
    assert download_data.main([*argv, "--small-only", "dtd"]) == 0
    pins = download_data.Pins(root).read()
    assert pins[key]["source"].startswith("gdrive:")
    split = osp.join(root, key)
    os.remove(split)
    srv.files[sources.paths[key]] = b'{"train": [], "val": [], "test": []}'
    assert download_data.main([*argv, "--small-only", "dtd"]) == 1
    out = capsys.readouterr().out
    assert f"{key}: the downloaded file" in out and "changed after it was pinned: refused" in out
    assert pins[key]["sha256"] in out and not osp.exists(split)
    with open(split, "w") as f:  # edited in place: reported, left alone
        f.write("{}")
    assert download_data.main([*argv, "--small-only", "dtd"]) == 1
    assert "it was left as it is" in capsys.readouterr().out


def test_no_network_gives_one_paragraph_per_missing_file(mirror, sources, monkeypatch, capsys):
    _, root, argv = mirror
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(download_data.MIRROR_ENV, f"http://127.0.0.1:{port}/mirror")
    assert download_data.main([*argv, "dtd", "OxfordFlowers"]) == 1
    out = capsys.readouterr().out
    paragraphs = out.split("file(s) not fetched:\n\n")[1].strip().split("\n\n")
    keys = [p.split(": ", 2)[1] for p in paragraphs]
    assert keys == [
        DTD_ARCHIVE,
        "dtd/split_zhou_DescribableTextures.json",
        "oxford_flowers/102flowers.tgz",
        "oxford_flowers/imagelabels.mat",
        "oxford_flowers/cat_to_name.json",
        "oxford_flowers/split_zhou_OxfordFlowers.json",
    ]
    assert all(
        "\n" not in p and "Fetch it on a machine with internet access" in p for p in paragraphs
    )
    assert f"MD5 must be {sources.checksums[DTD_ARCHIVE][1]}" in paragraphs[0]

    monkeypatch.setenv("SAMPLE_PL_OFFLINE", "1")

    def no_connection(*args, **kwargs):
        raise AssertionError("a connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", no_connection)
    assert download_data.main([*argv, "dtd"]) == 1
    assert capsys.readouterr().out.count("offline (SAMPLE_PL_OFFLINE") == 2


def test_list_names_sources_and_checksum_origins(capsys, tmp_path):
    assert download_data.main(["--root", str(tmp_path), "--list"]) == 0
    out = capsys.readouterr().out
    assert "md5 fff73e5086ae6bdbea199a49dfb8a4c1 (torchvision 0.29.1" in out
    assert "SHA256 pinned on first download" in out and "[by hand]" in out


# ----------------------------------------------------------------------------------------------
# check_data --verify
# ----------------------------------------------------------------------------------------------
def test_verify_lists_missing_unreadable_and_empty_classes(tmp_path, capsys):
    root = str(tmp_path)
    expected = BUILDERS["DescribableTextures"](root)
    build("DescribableTextures", root)  # saves the split file
    reference = verify_data.Reference.of_tree(expected)
    status, lines = verify_data.verify_dataset(root, "dtd", reference)
    assert status == "ready" and "train: 20 of 20 images readable" in lines
    images = sorted(glob.glob(osp.join(root, "dtd", "images", "*", "*.jpg")))
    os.remove(images[0])
    with open(images[1], "r+b") as f:  # cut short
        f.truncate(100)
    status, lines = verify_data.verify_dataset(root, "dtd", reference)
    assert status == "partial"
    text = "\n".join(lines)
    assert "1 of" in text and images[0] in text and "missing" in text
    assert f"{images[1]} (truncated" in text or f"{images[1]} (unreadable" in text
    assert check_data.main(["--root", root, "--verify", "dtd"]) == 1
    assert "partial" in capsys.readouterr().out
    os.remove(osp.join(root, "dtd", "split_zhou_DescribableTextures.json"))
    status, lines = verify_data.verify_dataset(root, "dtd", reference)
    assert status == "partial" and "a generated split is not the paper's" in lines[0]

    expected = BUILDERS["FGVCAircraft"](root)  # the dataset's own lists: one class left out
    reference = verify_data.Reference.of_tree(expected)
    assert verify_data.verify_dataset(root, "FGVCAircraft", reference)[0] == "ready"
    test_list = osp.join(root, "fgvc_aircraft", "images_variant_test.txt")
    kept = [line for line in open(test_list) if not line.strip().endswith("A300B4")]
    with open(test_list, "w") as f:
        f.writelines(kept)
    status, lines = verify_data.verify_dataset(root, "FGVCAircraft", reference)
    assert status == "partial" and "test: no image of class(es) [1]" in lines
    assert (
        verify_data.verify_dataset(root, "FGVCAircraft")[1][0] == "4 classes, the dataset has 100"
    )


def test_imagenet_flat_validation_images_are_offered_and_sorted(tmp_path, capsys):
    root = str(tmp_path / "data")
    expected = BUILDERS["ImageNet"](root)
    reference = verify_data.Reference.of_tree(expected)
    folder = osp.join(root, "imagenet")
    val = osp.join(folder, "images", "val")
    assert verify_data.verify_dataset(root, "ImageNet", reference)[0] == "ready"
    wnids = sorted(os.listdir(val))
    images = [(w, n) for w in wnids for n in sorted(os.listdir(osp.join(val, w)))]
    archives = dataset_archives.imagenet_archives(folder)
    val_tar, devkit = archives["ILSVRC2012_img_val.tar"], archives["ILSVRC2012_devkit_t12.tar.gz"]
    shutil.rmtree(val)
    for name, data in (
        ("ILSVRC2012_img_val.tar", val_tar),
        ("ILSVRC2012_devkit_t12.tar.gz", devkit),
    ):
        with open(osp.join(folder, name), "wb") as f:
            f.write(data)
    status, lines = verify_data.verify_dataset(root, "ImageNet", reference)
    assert status == "partial" and "ILSVRC2012_img_val.tar found" in lines[1]
    assert "--sort-imagenet-val" in lines[1]

    table = {
        "imagenet/ILSVRC2012_img_val.tar": ["md5", hashlib.md5(val_tar).hexdigest()],
        "imagenet/ILSVRC2012_devkit_t12.tar.gz": ["md5", hashlib.md5(devkit).hexdigest()],
    }
    argv = ["--root", root, "--checksums", write_checksums(str(tmp_path / "c.json"), table)]
    assert download_data.main([*argv, "--sort-imagenet-val"]) == 0
    assert "sorted 10 validation images into 5 wnid folders" in capsys.readouterr().out
    assert verify_data.verify_dataset(root, "ImageNet", reference)[0] == "ready"
    for k, (wnid, _) in enumerate(images):
        assert osp.isfile(osp.join(val, wnid, f"ILSVRC2012_val_{k + 1:08d}.JPEG"))

    for wnid in wnids:  # the archive unpacked as it is (flat): sorted in place
        for name in os.listdir(osp.join(val, wnid)):
            os.rename(osp.join(val, wnid, name), osp.join(val, name))
        os.rmdir(osp.join(val, wnid))
    status, lines = verify_data.verify_dataset(root, "ImageNet", reference)
    assert status == "partial" and "holds 10 images outside wnid folders" in lines[0]
    assert download_data.main([*argv, "--sort-imagenet-val"]) == 0
    assert verify_data.verify_dataset(root, "ImageNet", reference)[0] == "ready"

    with open(osp.join(folder, "ILSVRC2012_devkit_t12.tar.gz"), "ab") as f:
        f.write(b"damage")
    assert download_data.main([*argv, "--sort-imagenet-val"]) == 1
    out = capsys.readouterr().out
    assert f"expected {table['imagenet/ILSVRC2012_devkit_t12.tar.gz'][1]}" in out


@pytest.mark.slow
def test_scripts_in_fresh_processes_fetch_through_the_mirror_and_verify_ready(mirror):
    _, root, argv = mirror
    env = dict(os.environ, PYTHONPATH=ROOT)
    tool = [sys.executable, osp.join(ROOT, "tools", "download_data.py")]
    proc = subprocess.run([*tool, *argv, "EuroSAT"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "status: ready" in proc.stdout
    check = [sys.executable, osp.join(ROOT, "tools", "check_data.py"), "--root", root]
    proc = subprocess.run([*check, "--verify", "eurosat"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # all 10 classes: the real reference
    assert "train: 20 of 20 images readable" in proc.stdout and "1 of 1 ready" in proc.stdout
