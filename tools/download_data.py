"""Fetch the paper's datasets into the CoOp layouts, checked, resumable and atomic.

Usage::

    python tools/download_data.py --root DATA                  # every dataset of the paper
    python tools/download_data.py --root DATA EuroSAT dtd      # these datasets
    python tools/download_data.py --root DATA --list           # sources, checksums, by hand
    python tools/download_data.py --root DATA --small-only     # only files that are not archives

This is the only part of the project that uses the internet (nothing downloads at run time; the
tests serve everything from a loopback server through the mirror variable).

* Every file is checked: against the published checksum recorded in
  ``experiments/data_checksums.py`` (torchvision's MD5s of the same archives) or, for files
  without a
  published one (CoOp's Google Drive files, some hosts), against the SHA256 pinned on its first
  download in ``DATA/sample-pl-data.lock.json`` (:data:`LOCK_FILE`): a file whose content
  changed since is refused. A file with a wrong checksum is deleted and nothing is unpacked;
  the error names the file and the expected checksum.
* A broken transfer resumes with an HTTP Range request (it starts over when the server ignores
  Range); the data lands in ``DATA/.downloads/<dataset folder>/`` and is moved into place only
  once checked. Google Drive files come through gdown (a requirement), which resumes too.
* Archives are unpacked into a temporary folder next to their target and moved into place at
  the end, the folder the readers look for last, followed by a completion marker
  (``.unpacked-<archive>`` in the dataset folder): a half-unpacked tree is never taken for a
  complete one, and what an interrupted run (or a full disk) leaves is cleared by the next run.
  Whatever is complete is skipped.
* ``$SAMPLE_PL_DATA_MIRROR`` (:data:`MIRROR_ENV`) redirects every source: ``https://host/path``
  becomes ``<mirror>/host/path`` and the Google Drive file ``<id>`` becomes
  ``<mirror>/gdrive/<id>``. ``SAMPLE_PL_OFFLINE=1`` (or ``HF_HUB_OFFLINE=1``) touches no network.
* One lock per dataset (``DATA/.downloads/<folder>.lock``): invocations started together fetch
  each file once.
* What cannot be fetched (ImageNet's images: image-net.org needs an account; Stanford Cars: its
  host is gone) is printed as one paragraph per file: what to get, from where, where to put it;
  a by-hand archive put in its dataset folder is checked and unpacked by the next run.

Each dataset is checked afterwards as ``tools/check_data.py`` does (``--verify`` there proves a
root ready: every image of every split present and readable). The files to fetch are the
``downloads`` of the readers' ``LAYOUT`` declarations (``datasets/``).
"""

from __future__ import annotations

import argparse
import glob
import http.client
import json
import logging
import os
import os.path as osp
import shlex
import shutil
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import zipfile

if __package__ in (None, ""):  # run as a script
    import _repo  # noqa: F401


from datasets import PAPER_DATASETS  # noqa: E402
from datasets.common import Download, Layout  # noqa: E402
from engine.clip import weights  # noqa: E402  (the checked, resumable download of the weights)
from experiments.data_checksums import PUBLISHED  # noqa: E402
from tools.check_data import READY, check_dataset, find_layout  # noqa: E402

MIRROR_ENV = "SAMPLE_PL_DATA_MIRROR"  # a base URL replacing every source's host
LOCK_FILE = "sample-pl-data.lock.json"  # in the root: SHA256 pinned on first download
LOCK_FORMAT = "sample-prompt-learning/data-pins/1"
STAGING = ".downloads"  # in the root: files in transit and the per-dataset locks
MARKER = ".unpacked-"  # + archive name, in the dataset folder: the archive is fully in place
UNPACKING = ".unpacking-"  # + archive name: the temporary folder of an unpack in progress

ATTEMPTS = 3  # tries of one HTTP download (a dropped connection resumes where it stopped)
RETRY_WAIT_S = 2.0  # seconds before the second try, doubled for each further one
DRIVE_RETRIES = 2  # gdown's own retries of a Google Drive file

Checksums = dict  # key (path under the root) -> (algorithm, digest[, origin])


class DownloadError(RuntimeError):
    """A file could not be fetched or checked; the message says what to do (one paragraph)."""


def gdrive_id(url: str) -> str | None:
    return url[len("gdrive:") :] if url.startswith("gdrive:") else None


def human_link(url: str) -> str:
    """A link a person can open in a browser."""
    file_id = gdrive_id(url)
    return f"https://drive.google.com/file/d/{file_id}/view" if file_id else url


def source_url(url: str) -> str:
    """Where ``url`` is fetched from: itself, or its copy on ``$SAMPLE_PL_DATA_MIRROR``."""
    mirror = os.environ.get(MIRROR_ENV, "").strip().rstrip("/")
    file_id = gdrive_id(url)
    if not mirror:
        return f"https://drive.google.com/uc?id={file_id}" if file_id else url
    if file_id:
        return f"{mirror}/gdrive/{file_id}"
    parts = urllib.parse.urlsplit(url)
    return f"{mirror}/{parts.netloc}{parts.path}"


def load_checksums(path: str) -> Checksums:
    """A checksum table from a JSON file ``{"<folder>/<file>": ["md5"|"sha256", "<digest>"]}``.

    Raises:
        DownloadError: the file is not such a table.
    """
    try:
        with open(path) as f:
            table = json.load(f)
        out = {}
        for key, (algorithm, digest) in table.items():
            if algorithm not in ("md5", "sha256"):
                raise ValueError(f"{key}: algorithm {algorithm!r} is not md5 or sha256")
            out[key] = (algorithm, digest.lower(), f"--checksums {path}")
        return out
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise DownloadError(
            f"--checksums {path}: expected a JSON object "
            '{"<dataset folder>/<file name>": ["md5" or "sha256", "<hex digest>"]}: ' + str(e)
        ) from None


# ----------------------------------------------------------------------------------------------
# Pinned checksums (files without a published one)
# ----------------------------------------------------------------------------------------------
class Pins:
    """The root's lock file: the SHA256 of each file without a published checksum, recorded on
    its first download (or first sight) and required ever after."""

    def __init__(self, root: str):
        self.path = osp.join(root, LOCK_FILE)

    def read(self) -> dict:
        if not osp.isfile(self.path):
            return {}
        try:
            with open(self.path) as f:
                data = json.load(f)
            return dict(data["files"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DownloadError(
                f"{self.path} is damaged ({e}): it pins the checksums of the files without a "
                "published one; restore it from a backup, or delete it to pin the files anew"
            ) from None

    def get(self, key: str) -> dict | None:
        return self.read().get(key)

    def pin(self, key: str, sha256: str, source: str) -> None:
        os.makedirs(osp.join(osp.dirname(self.path), STAGING), exist_ok=True)
        with weights.file_lock(osp.join(osp.dirname(self.path), STAGING, LOCK_FILE + ".lock")):
            files = self.read()
            old = files.get(key)
            if old and old["sha256"] != sha256:
                raise DownloadError(f"{key}: pinned as {old['sha256']} in {self.path}")
            files[key] = {"sha256": sha256, "source": source, "pinned": time.strftime("%Y-%m-%d")}
            data = {"format": LOCK_FORMAT, "files": dict(sorted(files.items()))}
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1)
                f.write("\n")
            os.replace(tmp, self.path)


def file_digest(path: str, algorithm: str) -> str:
    if algorithm == "md5":
        from torchvision.datasets.utils import calculate_md5

        return calculate_md5(path)
    return weights.file_sha256(path)


class Context:
    """What one invocation works with: the root, the checksum table, the pins, the output."""

    def __init__(self, root: str, checksums: Checksums | None = None, progress: bool = True):
        self.root = osp.abspath(osp.expanduser(root))
        self.checksums = PUBLISHED if checksums is None else checksums
        self.pins = Pins(self.root)
        self.progress = progress

    def expected(self, key: str) -> tuple[str, str, str] | None:
        """``(algorithm, digest, origin)`` a file must have, or None before it is pinned."""
        if key in self.checksums:
            algorithm, digest, *origin = self.checksums[key]
            return algorithm, digest, origin[0] if origin else "the checksum table"
        pin = self.pins.get(key)
        if pin:
            return "sha256", pin["sha256"], f"pinned on first download in {self.pins.path}"
        return None

    def check(self, path: str, key: str, source: str, downloaded: bool) -> str:
        """Check ``path`` (the file ``key``) or pin it; returns what was done.

        Raises:
            DownloadError: the checksum differs from the recorded or pinned one.
        """
        expected = self.expected(key)
        if expected is None:
            digest = weights.file_sha256(path)
            self.pins.pin(key, digest, source)
            return f"SHA256 {digest[:12]}... pinned in {LOCK_FILE} (no published checksum)"
        algorithm, want, origin = expected
        got = file_digest(path, algorithm)
        if got == want.lower():
            return f"{algorithm.upper()} checked ({origin})"
        pinned = origin.startswith("pinned")
        reason = (
            "the file changed after it was pinned: refused. If the new content is intended, "
            f'delete the entry "{key}" from {self.pins.path} and rerun'
            if pinned
            else "a damaged transfer, a damaged mirror or a changed file"
        )
        what = "the downloaded file" if downloaded else "the file"
        fate = "it was deleted and nothing was unpacked" if downloaded else "it was left as it is"
        raise DownloadError(
            f"{key}: {what} {path} has {algorithm.upper()} {got}, expected {want} ({origin}); "
            f"{fate}: {reason}"
        )


# ----------------------------------------------------------------------------------------------
# Transfers
# ----------------------------------------------------------------------------------------------
def http_download(url: str, dest: str, what: str, progress: bool = True) -> bool:
    """Fetch ``url`` into ``dest`` through ``dest.part``, resuming it with HTTP Range after a
    broken connection (starting over when the server ignores Range); returns whether the
    file was resumed. The transfer is the CLIP weights' (:func:`engine.clip.weights._transfer`).

    Raises:
        DownloadError: the server refuses the file or the connection fails ``ATTEMPTS`` times.
    """
    part = dest + ".part"
    resumed = False
    last = ""
    for attempt in range(1, ATTEMPTS + 1):
        have = osp.getsize(part) if osp.isfile(part) else 0
        try:
            offset, _ = weights._transfer(url, part, have, what, progress)
        except urllib.error.HTTPError as e:
            if e.code == 416 and have:  # the partial file does not fit the server's file
                os.remove(part)
                continue
            last = f"HTTP {e.code} {e.reason}"
            if e.code < 500 or attempt == ATTEMPTS:
                raise DownloadError(f"{url} answered {last}") from None
        except (
            urllib.error.URLError,
            OSError,
            http.client.HTTPException,
            weights._Incomplete,
        ) as e:
            last = str(getattr(e, "reason", None) or e) or type(e).__name__
            if attempt == ATTEMPTS:
                kept = osp.getsize(part) if osp.isfile(part) else 0
                note = f" ({kept} bytes kept in {part}: the next run resumes)" if kept else ""
                raise DownloadError(f"could not fetch {url}: {last}{note}") from None
        else:
            os.replace(part, dest)
            return resumed or bool(offset)
        resumed = resumed or have > 0
        time.sleep(RETRY_WAIT_S * 2 ** (attempt - 1))
    raise DownloadError(f"could not fetch {url}: the server keeps refusing the partial file")


def drive_download(url: str, dest: str, progress: bool = True) -> None:
    """Fetch a Google Drive file (or its mirror copy) with gdown, which resumes a partial file.

    Raises:
        DownloadError: gdown is missing or cannot fetch the file.
    """
    try:
        import gdown
    except ImportError:
        raise DownloadError(
            "gdown is not installed: `pip install -r requirements.txt` (it pins gdown) and rerun"
        ) from None
    try:
        result = gdown.download(
            url,
            dest,
            quiet=not progress,
            resume=True,
            use_cookies=False,
            retries=DRIVE_RETRIES,
            timeout=weights.TIMEOUT_S,
        )
    except Exception as e:  # gdown's and requests' errors: a line of reason each
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DownloadError(f"gdown could not fetch {url}: {reason}") from None
    if not result or not osp.isfile(dest):
        raise DownloadError(f"gdown could not fetch {url}")


def fetch_gdrive(file_id: str, dest: str, progress: bool = True) -> None:
    """Fetch the public Google Drive file ``file_id`` into ``dest`` (no checksum: see fetch)."""
    drive_download(source_url(f"gdrive:{file_id}"), dest, progress)


def transfer(item: Download, dest: str, progress: bool) -> bool:
    """Fetch ``item`` into ``dest``; returns whether an HTTP transfer was resumed."""
    url = source_url(item.url)
    if gdrive_id(item.url):
        drive_download(url, dest, progress)
        return False
    return http_download(url, dest, item.filename, progress)


# ----------------------------------------------------------------------------------------------
# Unpacking
# ----------------------------------------------------------------------------------------------
def _member_name(name: str, strip: str) -> str:
    """``name`` without the leading folder ``strip`` ("" for ``strip`` itself and for macOS
    resource forks)."""
    if name.startswith("__MACOSX/"):
        return ""
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


def _remove(path: str) -> None:
    if osp.isdir(path) and not osp.islink(path):
        shutil.rmtree(path)
    elif osp.lexists(path):
        os.remove(path)


def unpack(archive: str, dataset_dir: str, item: Download) -> None:
    """Unpack ``archive`` into a temporary folder of the dataset folder, then move its entries
    into place, what ``item`` provides last (so its presence means the rest is there).

    Raises:
        DownloadError: the archive cannot be unpacked (e.g. the disk is full); nothing of it is
            left in place.
    """
    dest_dir = osp.normpath(osp.join(dataset_dir, item.extract_to))
    os.makedirs(dataset_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=UNPACKING + item.filename + "-", dir=dataset_dir)
    try:
        extract(archive, tmp, item.strip)
        if item.inner:
            inner = osp.join(tmp, item.inner)
            extract(inner, tmp)
            os.remove(inner)
        if not osp.exists(dest_dir):
            os.makedirs(osp.dirname(dest_dir), exist_ok=True)
            os.rename(tmp, dest_dir)  # one rename: the whole tree appears at once
            return
        target = osp.normpath(osp.join(dataset_dir, item.target()))
        last = osp.relpath(target, dest_dir).split(os.sep)[0]
        entries = sorted(os.listdir(tmp), key=lambda e: (e == last, e))
        for entry in entries:
            dst = osp.join(dest_dir, entry)
            _remove(dst)  # a leftover of an interrupted run (its target was not in place)
            os.rename(osp.join(tmp, entry), dst)
        os.rmdir(tmp)
    except (OSError, EOFError, tarfile.TarError, zipfile.BadZipFile, DownloadError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = e if isinstance(e, DownloadError) else f"{type(e).__name__}: {e}"
        raise DownloadError(
            f"unpacking {archive} into {dest_dir} failed ({reason}); nothing of it was put in "
            f"place and the checked archive is kept at {archive}: fix the cause (e.g. free "
            "disk space) and rerun"
        ) from None


def write_marker(path: str, record: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# One file, one dataset
# ----------------------------------------------------------------------------------------------
def item_key(layout: Layout, item: Download) -> str:
    """The file's path under the root: the key of the checksum table and of the pins."""
    if item.extract:
        return f"{layout.folder}/{item.filename}"
    return osp.normpath(osp.join(layout.folder, item.extract_to, item.filename))


def rel(ctx: Context, path: str) -> str:
    return osp.relpath(path, ctx.root)


def missing_paragraph(ctx: Context, layout: Layout, item: Download, dest: str, why: str) -> str:
    """One paragraph: which file is missing, why, and how to get it by hand."""
    key = item_key(layout, item)
    expected = ctx.expected(key)
    check = (
        f" Its {expected[0].upper()} must be {expected[1]} ({expected[2]})."
        if expected
        else f" Its SHA256 is pinned in {LOCK_FILE} when it first arrives."
    )
    if item.by_hand:
        return (
            f"{key}: by hand: {item.by_hand}. Originally at {item.url}. Put {item.filename} in "
            f"{osp.dirname(dest)}/ and rerun this command: it checks it and unpacks it into the "
            f"layout.{check}"
        )
    q = shlex.quote
    return (
        f"{key}: {why}. Fetch it on a machine with internet access (`python "
        f"tools/download_data.py --root DATA {layout.name}`, then copy DATA/{layout.folder}/ "
        f"and DATA/{LOCK_FILE}) or by hand from {human_link(item.url)} into {q(dest)}"
        + (f" (`curl -fL -C - -o {q(dest)} {q(item.url)}`)." if not gdrive_id(item.url) else ".")
        + check
    )


def fetch(ctx: Context, layout: Layout, item: Download) -> str:
    """Fetch, check and (for an archive) unpack one download unless it is complete; returns a
    status line.

    Raises:
        DownloadError: one paragraph saying what is missing or wrong and what to do.
    """
    dataset_dir = layout.dir(ctx.root)
    key = item_key(layout, item)
    staging = osp.join(ctx.root, STAGING, layout.folder)
    if item.extract:
        target = osp.normpath(osp.join(dataset_dir, item.target()))
        marker = osp.join(dataset_dir, MARKER + item.filename)
        if osp.exists(target):
            if osp.isfile(marker):
                return f"complete: {rel(ctx, target)}"
            return f"present: {rel(ctx, target)} (not unpacked by this tool: not checked here)"
        archive = osp.join(dataset_dir, item.filename)  # where a person puts it
    else:
        target = archive = osp.normpath(osp.join(dataset_dir, item.extract_to, item.filename))
        if osp.isfile(target):
            return f"present: {rel(ctx, target)}, {ctx.check(target, key, item.url, False)}"

    downloaded = not osp.isfile(archive)  # an archive put in place by hand is unpacked as it is
    if downloaded and item.by_hand:
        raise DownloadError(missing_paragraph(ctx, layout, item, archive, "by hand"))
    if downloaded:
        if weights.is_offline():
            why = "offline (SAMPLE_PL_OFFLINE or HF_HUB_OFFLINE is set): nothing was downloaded"
            raise DownloadError(missing_paragraph(ctx, layout, item, archive, why))
        os.makedirs(staging, exist_ok=True)
        archive = osp.join(staging, item.filename)
        if not osp.isfile(archive):
            print(f"  fetching {source_url(item.url)}", flush=True)
            try:
                resumed = transfer(item, archive, ctx.progress)
            except DownloadError as e:
                raise DownloadError(
                    missing_paragraph(ctx, layout, item, archive, str(e).rstrip("."))
                ) from None
        else:
            resumed = False
        try:
            note = ctx.check(archive, key, item.url, True)
        except DownloadError:
            os.remove(archive)
            if not resumed:
                raise
            print("  the resumed file has the wrong checksum: fetching it again", flush=True)
            transfer(item, archive, ctx.progress)
            try:
                note = ctx.check(archive, key, item.url, True)
            except DownloadError:
                os.remove(archive)
                raise
    else:
        note = ctx.check(archive, key, item.url, False)

    if not item.extract:
        os.makedirs(osp.dirname(target), exist_ok=True)
        os.replace(archive, target)
        return f"fetched: {rel(ctx, target)}, {note}"
    print(f"  unpacking {item.filename} ({note})", flush=True)
    if osp.exists(marker):  # from an earlier copy whose target has gone
        os.remove(marker)
    unpack(archive, dataset_dir, item)
    expected = ctx.expected(key)
    write_marker(
        marker,
        {
            "archive": item.filename,
            "source": item.url,
            "checksum": list(expected[:2]) if expected else None,
            "unpacked": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
    )
    if downloaded:
        os.remove(archive)
    return f"{'fetched and ' if downloaded else ''}unpacked: {rel(ctx, target)}, {note}"


def clear_leftovers(dataset_dir: str) -> None:
    """Remove the temporary folders of unpacks that were interrupted (under the dataset's
    lock, so none is in progress)."""
    for path in glob.glob(osp.join(glob.escape(dataset_dir), UNPACKING + "*")):
        shutil.rmtree(path, ignore_errors=True)


def fetch_dataset(ctx: Context, layout: Layout, small_only: bool = False) -> list[str]:
    """Fetch every download of ``layout`` under the dataset's lock; returns the paragraphs of
    what could not be fetched."""
    problems = []
    os.makedirs(osp.join(ctx.root, STAGING), exist_ok=True)
    with weights.file_lock(osp.join(ctx.root, STAGING, layout.folder + ".lock")):
        clear_leftovers(layout.dir(ctx.root))
        for item in layout.downloads:
            if small_only and item.extract:
                continue
            try:
                print(f"  {fetch(ctx, layout, item)}", flush=True)
            except DownloadError as e:
                problems.append(f"{layout.name}: {e}")
                print(f"  NOT FETCHED: {item_key(layout, item)}", flush=True)
        if layout.name == "ImageNet" and not small_only:
            problems += [f"ImageNet: {p}" for p in prepare_imagenet(ctx)]
    return problems


# ----------------------------------------------------------------------------------------------
# ImageNet's flat validation images, sorted into wnid folders (what valprep.sh does)
# ----------------------------------------------------------------------------------------------
IMAGENET_VAL_TAR = "ILSVRC2012_img_val.tar"
IMAGENET_DEVKIT = "ILSVRC2012_devkit_t12.tar.gz"


def imagenet_val_wnids(devkit_dir: str) -> list[str]:
    """The wnid of validation image 1, 2, ... from an unpacked devkit (``data/meta.mat``'s
    synsets and ``data/ILSVRC2012_validation_ground_truth.txt``, 1-based class ids)."""
    from scipy.io import loadmat

    synsets = loadmat(osp.join(devkit_dir, "data", "meta.mat"), squeeze_me=True)["synsets"]
    wnid_of = {
        int(i): str(w)
        for i, w, n in zip(synsets["ILSVRC2012_ID"], synsets["WNID"], synsets["num_children"])
        if int(n) == 0  # the 1,000 leaf classes
    }
    truth = osp.join(devkit_dir, "data", "ILSVRC2012_validation_ground_truth.txt")
    with open(truth) as f:
        return [wnid_of[int(line)] for line in f if line.strip()]


def sort_imagenet_val(ctx: Context) -> str:
    """Put ImageNet's validation images into ``imagenet/images/val/<wnid>/``.

    Reads the devkit (``imagenet/ILSVRC2012_devkit_t12.tar.gz``, checked) for the ground truth;
    unpacks ``imagenet/ILSVRC2012_img_val.tar`` (checked) when ``images/val/`` does not exist
    (sorted in a temporary folder, renamed into place at the end), or sorts the flat images
    already in ``images/val/`` (each a rename; rerunnable).

    Raises:
        DownloadError: the devkit or the images are missing, damaged or do not match.
    """
    folder = osp.join(ctx.root, "imagenet")
    devkit, tar = osp.join(folder, IMAGENET_DEVKIT), osp.join(folder, IMAGENET_VAL_TAR)
    val = osp.join(folder, "images", "val")
    if not osp.isfile(devkit):
        raise DownloadError(
            f"imagenet/{IMAGENET_DEVKIT}: by hand: the validation labels are in ImageNet's "
            f"development kit (image-net.org, ILSVRC2012 downloads, with an account): put it in "
            f"{folder}/ and rerun"
        )
    print(f"  {ctx.check(devkit, 'imagenet/' + IMAGENET_DEVKIT, 'image-net.org', False)}")
    with tempfile.TemporaryDirectory(dir=folder, prefix=UNPACKING + "devkit-") as tmp:
        extract(devkit, tmp, "ILSVRC2012_devkit_t12/")
        wnids = imagenet_val_wnids(tmp)
    work = val
    if not osp.isdir(val):
        if not osp.isfile(tar):
            raise DownloadError(
                f"imagenet/{IMAGENET_VAL_TAR}: by hand (image-net.org, with an account): put it "
                f"in {folder}/ and rerun"
            )
        print(f"  {ctx.check(tar, 'imagenet/' + IMAGENET_VAL_TAR, 'image-net.org', False)}")
        os.makedirs(osp.dirname(val), exist_ok=True)
        work = tempfile.mkdtemp(prefix=UNPACKING + IMAGENET_VAL_TAR + "-", dir=folder)
        try:
            extract(tar, work)
        except (OSError, tarfile.TarError, DownloadError) as e:
            shutil.rmtree(work, ignore_errors=True)
            raise DownloadError(f"unpacking {tar} failed ({e}); nothing was put in place") from None
    flat = sorted(e.name for e in os.scandir(work) if e.is_file() and not e.name.startswith("."))
    if len(flat) != len(wnids) and work != val:
        shutil.rmtree(work, ignore_errors=True)
        raise DownloadError(
            f"{tar} holds {len(flat)} images, the devkit's ground truth {len(wnids)}: they do not "
            "belong together"
        )
    moved = 0
    for name in flat:
        stem = osp.splitext(name)[0]
        if not stem.startswith("ILSVRC2012_val_"):
            continue
        n = int(stem.rsplit("_", 1)[1])  # 1-based, as in the ground truth file
        if not 1 <= n <= len(wnids):
            raise DownloadError(
                f"{osp.join(work, name)}: no image {n} in the devkit's ground truth"
            )
        os.makedirs(osp.join(work, wnids[n - 1]), exist_ok=True)
        os.rename(osp.join(work, name), osp.join(work, wnids[n - 1], name))
        moved += 1
    if work != val:
        os.rename(work, val)
    return f"sorted {moved:,} validation images into {len(set(wnids)):,} wnid folders of {val}"


IMAGENET_TRAIN_TAR = "ILSVRC2012_img_train.tar"
IMAGENET_BY_HAND = (
    "image-net.org gives the ILSVRC-2012 images only to registered users who accept its terms "
    "(its ILSVRC2012 downloads page)"
)


def unpack_imagenet_train(tar: str, train_dir: str) -> None:
    """``ILSVRC2012_img_train.tar`` (one ``<wnid>.tar`` per class) into ``train_dir/<wnid>/``:
    unpacked in a temporary folder next to it, renamed into place at the end.

    Raises:
        DownloadError: unpacking failed (nothing is left in place).
    """
    folder = osp.dirname(train_dir)
    os.makedirs(folder, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=UNPACKING + IMAGENET_TRAIN_TAR + "-", dir=folder)
    try:
        extract(tar, tmp)
        for inner in sorted(glob.glob(osp.join(glob.escape(tmp), "*.tar"))):
            extract(inner, osp.splitext(inner)[0])
            os.remove(inner)
        os.rename(tmp, train_dir)
    except (OSError, EOFError, tarfile.TarError, DownloadError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DownloadError(
            f"unpacking {tar} into {train_dir} failed ({e}); nothing of it was put in place: fix "
            "the cause (e.g. free disk space) and rerun"
        ) from None


def prepare_imagenet(ctx: Context) -> list[str]:
    """ImageNet's images from the archives a person put in ``imagenet/`` (checked against
    torchvision's MD5s): the training archive unpacked into wnid folders, the validation images
    sorted into them (:func:`sort_imagenet_val`). Returns a paragraph per archive still needed.
    """
    folder = osp.join(ctx.root, "imagenet")
    train_dir, val_dir = (osp.join(folder, "images", s) for s in ("train", "val"))
    problems = []
    train_tar = osp.join(folder, IMAGENET_TRAIN_TAR)
    key = f"imagenet/{IMAGENET_TRAIN_TAR}"
    try:
        if osp.isdir(train_dir):
            print(f"  present: {rel(ctx, train_dir)}")
        elif osp.isfile(train_tar):
            note = ctx.check(train_tar, key, "image-net.org", False)
            print(f"  unpacking {IMAGENET_TRAIN_TAR} ({note})", flush=True)
            unpack_imagenet_train(train_tar, train_dir)
            print(f"  unpacked: {rel(ctx, train_dir)}; {train_tar} can be deleted")
        else:
            problems.append(hand_paragraph(ctx, key, folder, "images/train/<wnid>/"))
    except DownloadError as e:
        problems.append(str(e))
    flat = osp.isdir(val_dir) and any(
        e.is_file() and not e.name.startswith(".") for e in os.scandir(val_dir)
    )
    if osp.isdir(val_dir) and not flat:
        print(f"  present: {rel(ctx, val_dir)}")
        return problems
    needed = [IMAGENET_DEVKIT] + ([] if flat else [IMAGENET_VAL_TAR])
    absent = [n for n in needed if not osp.isfile(osp.join(folder, n))]
    if absent:
        where = "sorts images/val/ into wnid folders" if flat else "images/val/<wnid>/"
        return problems + [hand_paragraph(ctx, f"imagenet/{n}", folder, where) for n in absent]
    try:
        print(f"  {sort_imagenet_val(ctx)}", flush=True)
    except DownloadError as e:
        problems.append(str(e))
    return problems


def hand_paragraph(ctx: Context, key: str, folder: str, into: str) -> str:
    """One paragraph for an ImageNet archive that comes by hand."""
    expected = ctx.expected(key)
    check = f" Its MD5 must be {expected[1]} ({expected[2]})." if expected else ""
    return (
        f"{key}: by hand: {IMAGENET_BY_HAND}. Put {osp.basename(key)} in {folder}/ and rerun "
        f"this command: it checks it and unpacks it into {into} (or unpack it there yourself; "
        f"symbolic links to an existing copy work).{check}"
    )


def describe(layout: Layout, checksums: Checksums | None = None) -> list[str]:
    """What ``--list`` prints for a dataset."""
    checksums = PUBLISHED if checksums is None else checksums
    lines = [f"{layout.name} ({layout.folder}/):"]
    for item in layout.downloads:
        key = item_key(layout, item)
        tool = " [gdown]" if gdrive_id(item.url) else ""
        if key in checksums:
            algorithm, digest, *origin = checksums[key]
            check = f"{algorithm} {digest} ({origin[0] if origin else 'checksum table'})"
        else:
            check = f"SHA256 pinned on first download in {LOCK_FILE}"
        hand = " [by hand]" if item.by_hand else ""
        target = osp.normpath(item.target()) + ("/" if item.target().endswith("/") else "")
        lines.append(f"  {target}: {human_link(item.url)}{tool}{hand}\n    {check}")
    if layout.name == "ImageNet":
        for name in (IMAGENET_TRAIN_TAR, IMAGENET_VAL_TAR, IMAGENET_DEVKIT):
            algorithm, digest, *origin = checksums.get(f"imagenet/{name}", ("", "", ""))
            check = f"{algorithm} {digest} ({origin[0] if origin else ''})" if digest else ""
            lines.append(f"  {name}: image-net.org [by hand]\n    {check or 'pinned'}")
    if layout.manual:
        lines.append(f"  by hand: {layout.manual}. {layout.how}")
    return lines


def main(argv: list[str] | None = None, checksums: Checksums | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Fetch the datasets into their CoOp layouts, checked (needs internet)."
    )
    parser.add_argument("--root", required=True, help="the dataset root (DATASET.ROOT)")
    parser.add_argument("names", nargs="*", help="datasets (default: all of the paper's)")
    parser.add_argument("--list", action="store_true", help="only list what would be fetched")
    parser.add_argument(
        "--small-only",
        action="store_true",
        help="only files that are not archives (split files, class-name files, label files)",
    )
    parser.add_argument(
        "--checksums",
        metavar="FILE.json",
        help="a checksum table replacing the recorded one (experiments/data_checksums.py), e.g. "
        "for a "
        'mirror with repacked archives: {"<folder>/<file>": ["md5" or "sha256", "<digest>"]}',
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument(
        "--sort-imagenet-val",
        action="store_true",
        help=f"sort ImageNet's validation images into wnid folders (from imagenet/"
        f"{IMAGENET_VAL_TAR} or a flat images/val/, with imagenet/{IMAGENET_DEVKIT}), as "
        "valprep.sh does",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="  %(message)s", stream=sys.stdout)
    try:
        layouts = [find_layout(n) for n in args.names or PAPER_DATASETS]
    except KeyError as e:
        parser.error(str(e.args[0]))
    if None in layouts:
        parser.error("only datasets with a declared layout (datasets/*.py LAYOUT) can be fetched")
    try:
        if args.checksums:
            checksums = load_checksums(args.checksums)
    except DownloadError as e:
        parser.error(str(e))

    if args.list:
        for layout in layouts:
            print("\n".join(describe(layout, checksums)))
        return 0

    ctx = Context(args.root, checksums, progress=not args.quiet)
    if args.sort_imagenet_val:
        try:
            print(f"ImageNet: {sort_imagenet_val(ctx)}")
        except DownloadError as e:
            print(f"ImageNet: {e}")
            return 1
        return 0
    problems = []
    for layout in layouts:
        print(f"{layout.name} -> {layout.dir(ctx.root)}", flush=True)
        problems += fetch_dataset(ctx, layout, args.small_only)
        status, details = check_dataset(ctx.root, layout.name)
        print(f"  status: {status}" + ("" if status == READY else f" ({details[0]})"), flush=True)
    if problems:
        print(f"\n{len(problems)} file(s) not fetched:\n")
        print("\n\n".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
