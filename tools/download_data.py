"""Fetch the publicly downloadable parts of the paper's datasets into the CoOp layouts.

Usage::

    python tools/download_data.py --root DATA --list           # what can and cannot be fetched
    python tools/download_data.py --root DATA EuroSAT dtd      # fetch these datasets
    python tools/download_data.py --root DATA                  # everything that can be fetched
    python tools/download_data.py --root DATA --small-only     # only split and class-name files

This is the only part of the project that uses the internet (nothing downloads at run time and
the tests never run it).

* Public archives are fetched with urllib, unpacked into the expected layout and deleted.
* Files on Google Drive (CoOp's ``split_zhou_*.json``, OxfordFlowers' ``cat_to_name.json``,
  ImageNet's ``classnames.txt``, the UCF101 middle frames) need gdown (``pip install gdown``,
  not a project requirement); without it they are listed with their links to fetch by hand.
* Some data cannot be fetched automatically and is listed with instructions instead:
  ImageNet (image-net.org requires an account), Stanford Cars (its original links are gone),
  ImageNet-Sketch (Google Drive folder and mirrors).
* Whatever a download provides is skipped when already there. The links are those published
  by the dataset authors and by CoOp; if one has moved, the download fails with the dataset's
  manual instructions.

Each dataset is checked afterwards as ``tools/check_data.py`` does. The files to fetch are the
``downloads`` of the readers' ``LAYOUT`` declarations (``datasets/``).
"""

from __future__ import annotations

import argparse
import os
import os.path as osp
import shutil
import sys
import tarfile
import urllib.error
import urllib.request
import zipfile

if __package__ in (None, ""):  # run as a script
    import _repo  # noqa: F401


from datasets import PAPER_DATASETS  # noqa: E402
from datasets.common import Download, Layout  # noqa: E402
from tools.check_data import READY, check_dataset, find_layout  # noqa: E402


class DownloadError(RuntimeError):
    """A file could not be fetched; the message says how to get it by hand."""


def gdrive_id(url: str) -> str | None:
    return url[len("gdrive:") :] if url.startswith("gdrive:") else None


def human_link(url: str) -> str:
    """A link a person can open in a browser."""
    file_id = gdrive_id(url)
    return f"https://drive.google.com/file/d/{file_id}/view" if file_id else url


def fetch_url(url: str, dest: str) -> None:
    """Stream ``url`` to ``dest`` (through ``dest.part``, renamed when complete)."""
    part = dest + ".part"
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(part, "wb") as f:
            total = int(response.headers.get("Content-Length") or 0)
            done, shown = 0, -1
            while chunk := response.read(1 << 20):
                f.write(chunk)
                done += len(chunk)
                pct = done * 100 // total if total else -1
                if pct // 10 != shown // 10:
                    shown = pct
                    print(f"  {done / 2**20:,.0f} MiB" + (f" ({pct}%)" if total else ""))
    except (urllib.error.URLError, OSError) as e:
        if osp.exists(part):
            os.remove(part)
        raise DownloadError(f"could not fetch {url}: {e}") from e
    os.replace(part, dest)


def fetch_gdrive(file_id: str, dest: str) -> None:
    """Fetch a public Google Drive file with gdown."""
    link = human_link(f"gdrive:{file_id}")
    try:
        import gdown
    except ImportError as e:
        raise DownloadError(
            f"{osp.basename(dest)} is on Google Drive: `pip install gdown` and re-run, or open "
            f"{link} in a browser and save the file as {dest}"
        ) from e
    part = dest + ".part"
    result = gdown.download(f"https://drive.google.com/uc?id={file_id}", part, quiet=False)
    if not result or not osp.isfile(part):
        raise DownloadError(f"gdown could not fetch {link}; save it by hand as {dest}")
    os.replace(part, dest)


def _member_name(name: str, strip: str) -> str:
    """``name`` without the leading folder ``strip`` ("" for ``strip`` itself)."""
    if strip and name.rstrip("/") == strip.rstrip("/"):
        return ""
    return name[len(strip) :] if strip and name.startswith(strip) else name


def extract(archive: str, dest_dir: str, strip: str = "") -> None:
    """Unpack a .zip or .tar(.gz) into ``dest_dir``, dropping the leading folder ``strip``.

    Raises:
        DownloadError: an unknown archive type, or a member that would land outside dest_dir.
    """
    dest_dir = osp.abspath(dest_dir)
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                name = _member_name(info.filename, strip)
                if not name:
                    continue
                target = osp.normpath(osp.join(dest_dir, name))
                if not target.startswith(dest_dir + os.sep):
                    raise DownloadError(f"{archive}: member {info.filename!r} leaves {dest_dir}")
                if info.is_dir():
                    os.makedirs(target, exist_ok=True)
                    continue
                os.makedirs(osp.dirname(target), exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    elif tarfile.is_tarfile(archive):
        with tarfile.open(archive) as tf:
            members = []
            for member in tf.getmembers():
                name = _member_name(member.name, strip)
                if name:
                    member.name = name
                    members.append(member)
            try:  # the "data" filter refuses absolute paths, links out of dest_dir, devices
                tf.extractall(dest_dir, members=members, filter="data")
            except tarfile.FilterError as e:
                raise DownloadError(f"{archive}: unsafe member: {e}") from e
    else:
        raise DownloadError(f"{archive} is neither a zip nor a tar archive")


def fetch(root: str, layout: Layout, item: Download) -> str:
    """Fetch (and unpack) one download unless what it provides is there; return a status."""
    dataset_dir = layout.dir(root)
    target = osp.normpath(osp.join(dataset_dir, item.target()))
    if osp.exists(target):
        return f"present: {osp.relpath(target, osp.dirname(dataset_dir))}"
    dest_dir = osp.normpath(osp.join(dataset_dir, item.extract_to))
    os.makedirs(dest_dir, exist_ok=True)
    path = osp.join(dest_dir, item.filename)
    print(f"  fetching {human_link(item.url)}")
    file_id = gdrive_id(item.url)
    if file_id:
        fetch_gdrive(file_id, path)
    else:
        fetch_url(item.url, path)
    if item.extract:
        print(f"  unpacking {item.filename}")
        extract(path, dest_dir, item.strip)
        os.remove(path)
        if item.inner:
            inner = osp.join(dest_dir, item.inner)
            extract(inner, dest_dir)
            os.remove(inner)
    return f"fetched: {osp.relpath(target, osp.dirname(dataset_dir))}"


def describe(layout: Layout) -> list[str]:
    """What ``--list`` prints for a dataset."""
    lines = [f"{layout.name} ({layout.folder}/):"]
    for item in layout.downloads:
        tool = " [gdown]" if gdrive_id(item.url) else ""
        lines.append(f"  {item.target()}: {human_link(item.url)}{tool}")
    if layout.manual:
        lines.append(f"  by hand: {layout.manual}. {layout.how}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Fetch the publicly downloadable parts of the datasets (needs internet)."
    )
    parser.add_argument("--root", required=True, help="the dataset root (DATASET.ROOT)")
    parser.add_argument("names", nargs="*", help="datasets (default: all of the paper's)")
    parser.add_argument("--list", action="store_true", help="only list what would be fetched")
    parser.add_argument(
        "--small-only",
        action="store_true",
        help="only files that are not archives (split files, class-name files, label files)",
    )
    args = parser.parse_args(argv)
    try:
        layouts = [find_layout(n) for n in args.names or PAPER_DATASETS]
    except KeyError as e:
        parser.error(str(e.args[0]))
    if None in layouts:
        parser.error("only datasets with a declared layout (datasets/*.py LAYOUT) can be fetched")

    if args.list:
        for layout in layouts:
            print("\n".join(describe(layout)))
        return 0

    failed = []
    for layout in layouts:
        print(f"{layout.name} -> {layout.dir(args.root)}")
        for item in layout.downloads:
            if args.small_only and item.extract:
                continue
            try:
                print(f"  {fetch(args.root, layout, item)}")
            except DownloadError as e:
                failed.append(layout.name)
                print(f"  FAILED: {e}\n  How to get it: {layout.how}")
        if layout.manual:
            print(f"  by hand: {layout.manual}")
        status, details = check_dataset(args.root, layout.name)
        print(f"  status: {status}" + ("" if status == READY else f" ({details[0]})"))
    if failed:
        print(f"\nSome downloads failed: {', '.join(sorted(set(failed)))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
