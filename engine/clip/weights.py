"""Where CLIP weights come from, and a download that can be trusted (docs/weights.md).

- OpenAI's names (``ViT-B/16``, ``RN50``, ...): the addresses OpenAI's ``clip`` package uses
  (:data:`OPENAI_SHA256`; the SHA256 of each file is a component of its address), downloaded into
  ``~/.cache/clip`` (the folder of OpenAI's package, so both share one copy). The environment
  variable ``SAMPLE_PL_CLIP_MIRROR`` replaces OpenAI's host and prefix with a mirror's base URL
  (``<mirror>/<sha256>/<file>``).
- ``MODEL.BACKBONE.URL`` + ``MODEL.BACKBONE.SHA256``: any other address (an internal mirror, a file
  server, ``file://``), downloaded into ``~/.cache/clip/sha256-<first 16 digits>/<file name>``.
- open_clip's pretrained tags (``arch:tag``, ``hf-hub:org/name``): through open_clip and
  huggingface_hub into their standard cache (:func:`fetch_open_clip`, :func:`hf_hub_file`).

:func:`fetch` is the download: it checks the SHA256, writes ``<file>.part`` in the same folder and
renames it (after an fsync) only when the checksum matches, so a partial file is never taken as a
checkpoint; an interrupted download resumes with an HTTP Range request when the server supports
it (else it starts over); a lock on ``<file>.lock`` (``fcntl.flock``) makes many processes asking
for one file do one download; a cached file whose checksum is wrong is reported and fetched again.
With ``HF_HUB_OFFLINE=1`` or ``SAMPLE_PL_OFFLINE=1`` nothing touches the network. Every failure is
one :class:`DownloadError` paragraph naming the address, the cache path and the manual command.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client
import logging
import os
import os.path as osp
import shlex
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

from optim.errors import UserError

logger = logging.getLogger(__name__)

OPENAI_BASE = "https://openaipublic.azureedge.net/clip/models"
MIRROR_ENV = "SAMPLE_PL_CLIP_MIRROR"  # a base URL replacing OPENAI_BASE
OFFLINE_ENV = "SAMPLE_PL_OFFLINE"  # 1: never touch the network (as HF_HUB_OFFLINE=1)

# OpenAI's released checkpoints: file name in ~/.cache/clip -> SHA256 (the address is
# OPENAI_BASE/<sha256>/<file name>, as in OpenAI's clip package and open_clip's pretrained table)
OPENAI_SHA256 = {
    "RN50.pt": "afeb0e10f9e5a86da6080e35cf09123aca3b358a0c3e3b6c78a7b63bc04b6762",
    "RN101.pt": "8fa8567bab74a42d41c5915025a8e4538c3bdbe8804a470a72f30b0d94fab599",
    "RN50x4.pt": "7e526bd135e493cef0776de27d5f42653e6b4c8bf9e0f653bb11773263205fdd",
    "RN50x16.pt": "52378b407f34354e150460fe41077663dd5b39c54cd0bfd2b27167a4a06ec9aa",
    "RN50x64.pt": "be1cfb55d75a9666199fb2206c106743da0f6468c9d327f3e0d0a543a9919d9c",
    "ViT-B-32.pt": "40d365715913c9da98579312b702a82c18be219cc2a73407c4526f58eba950af",
    "ViT-B-16.pt": "5806e77cd80f8b59890b7e101eabd078d9fb84e6937f9e85e4ecb61988df416f",
    "ViT-L-14.pt": "b8cca3fd41ae0c99ba7e8951adf17d267cdb84cd88be6f7c2e0eca1737a03836",
    "ViT-L-14-336px.pt": "3035c92b350959924f9f00213499208652fc7ea050643e8b385c2dac08641f02",
}

ATTEMPTS = 3  # tries of one download (a dropped connection resumes where it stopped)
RETRY_WAIT_S = 2.0  # seconds before the second try, doubled for each further one
TIMEOUT_S = 60.0  # seconds without data before a connection counts as dropped
CHUNK = 1 << 20


class BackboneError(UserError, RuntimeError):
    """The CLIP backbone cannot be built or its weights cannot be found/loaded."""


class DownloadError(BackboneError):
    """A CLIP weights file that could not be fetched (network, checksum, offline)."""


def clip_cache_dir() -> str:
    """``~/.cache/clip``: where OpenAI's clip package (and open_clip's URL downloads) keep files."""
    return osp.expanduser("~/.cache/clip")


def is_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` or ``SAMPLE_PL_OFFLINE`` is set to 1/true/yes/on."""
    return any(
        os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
        for var in ("HF_HUB_OFFLINE", OFFLINE_ENV)
    )


def openai_url(file_name: str) -> str:
    """The address of one of OpenAI's checkpoints (on ``$SAMPLE_PL_CLIP_MIRROR`` when set)."""
    base = os.environ.get(MIRROR_ENV, "").strip().rstrip("/") or OPENAI_BASE
    return f"{base}/{OPENAI_SHA256[file_name]}/{file_name}"


def check_sha256(sha256: str, key: str = "MODEL.BACKBONE.SHA256") -> str:
    """``sha256`` in lower case, or a :class:`BackboneError` when it is not 64 hex digits."""
    value = sha256.strip().lower()
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise BackboneError(
            f"{key} must be the 64 hexadecimal digits that `sha256sum FILE` prints, got {sha256!r}"
        )
    return value


def url_cache_path(url: str, sha256: str) -> str:
    """Where the file at ``url`` is kept: OpenAI's cache file when ``sha256`` is one of OpenAI's
    checkpoints, else ``~/.cache/clip/sha256-<first 16 digits>/<file name of the URL>``."""
    if not sha256:
        raise BackboneError(
            f"MODEL.BACKBONE.URL {url} needs MODEL.BACKBONE.SHA256: the file's SHA256 (64 hex "
            "digits, `sha256sum FILE`), so that a damaged or substituted file is never loaded"
        )
    sha256 = check_sha256(sha256)
    for file_name, known in OPENAI_SHA256.items():
        if known == sha256:
            return osp.join(clip_cache_dir(), file_name)
    name = osp.basename(urllib.parse.urlsplit(url).path) or "weights.pt"
    return osp.join(clip_cache_dir(), f"sha256-{sha256[:16]}", name)


# files whose checksum this process already computed: (real path, size, mtime) -> sha256
_DIGESTS: dict = {}


def file_sha256(path: str) -> str:
    """The SHA256 of a file (remembered for the process while its size and mtime do not change)."""
    st = os.stat(path)
    key = (osp.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(CHUNK):
                h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def manual_command(url: str, dest: str, sha256: str) -> str:
    """The shell commands that fetch ``url`` into ``dest`` by hand and check it."""
    q = shlex.quote
    return (
        f"mkdir -p {q(osp.dirname(dest))} && curl -fL -C - -o {q(dest)} {q(url)} "
        f"(or wget -c -O {q(dest)} {q(url)}), then `sha256sum {q(dest)}` must print {sha256}"
    )


def _failure(what: str, url: str, dest: str, sha256: str, reason: str) -> DownloadError:
    q = shlex.quote
    args = f"--url {q(url)} --sha256 {sha256}" if "://" in what else q(what)
    return DownloadError(
        f"Cannot get the CLIP weights {what} from {url}: {reason}. The file belongs at {dest}. "
        f"Fetch it on a machine with internet access with `python tools/download_weights.py "
        f"{args}` (it writes to the same path), or by hand: {manual_command(url, dest, sha256)}."
    )


@contextlib.contextmanager
def file_lock(path: str):
    """An exclusive ``fcntl.flock`` on ``path`` (created if needed; left in place afterwards)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Waiting for another process that downloads %s", path[: -len(".lock")])
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def fetch(url: str, dest: str, sha256: str, what: str = "", progress: bool = True) -> str:
    """``dest`` holding the file at ``url`` whose SHA256 is ``sha256``; downloaded when missing.

    A cached file with another checksum is reported (logged) and fetched again. Raises
    :class:`DownloadError` (offline, network failure, checksum mismatch: nothing is left at
    ``dest``); ``what`` names the weights in messages (default: the file name).
    """
    sha256 = check_sha256(sha256)
    dest = osp.abspath(dest)
    what = what or osp.basename(dest)
    if osp.exists(dest) and not osp.isfile(dest):
        raise _failure(what, url, dest, sha256, f"{dest} exists and is not a regular file")
    stale = ""
    if osp.isfile(dest):
        digest = file_sha256(dest)
        if digest == sha256:
            return dest
        stale = f"the cached file has SHA256 {digest}, expected {sha256} (damaged or incomplete)"
    if is_offline():
        reason = "offline (HF_HUB_OFFLINE or SAMPLE_PL_OFFLINE is set), nothing was downloaded"
        if stale:
            reason += f"; {stale}: delete it"
        raise _failure(what, url, dest, sha256, reason)
    if stale:
        logger.warning("%s: %s; fetching it again", dest, stale)
    os.makedirs(osp.dirname(dest), exist_ok=True)
    with file_lock(dest + ".lock"):
        if osp.isfile(dest) and file_sha256(dest) == sha256:  # another process fetched it
            return dest
        _download(url, dest, sha256, what, progress)
    return dest


class _Incomplete(Exception):
    """The connection ended before the announced length."""


def _download(url: str, dest: str, sha256: str, what: str, progress: bool) -> None:
    """Download into ``dest + ".part"`` (resuming it), check, fsync and rename it to ``dest``."""
    part = dest + ".part"
    for attempt in range(1, ATTEMPTS + 1):
        have = osp.getsize(part) if osp.isfile(part) else 0
        try:
            offset, digest = _transfer(url, part, have, what, progress)
        except urllib.error.HTTPError as e:
            if e.code == 416 and have:  # the partial file does not fit the server's file
                os.remove(part)
                continue
            if e.code < 500 or attempt == ATTEMPTS:
                raise _failure(what, url, dest, sha256, f"HTTP {e.code} {e.reason}") from None
            last = f"HTTP {e.code} {e.reason}"
        except (urllib.error.URLError, OSError, http.client.HTTPException, _Incomplete) as e:
            last = str(getattr(e, "reason", None) or e) or type(e).__name__
            if attempt == ATTEMPTS:
                kept = osp.getsize(part) if osp.isfile(part) else 0
                note = f" ({kept} bytes kept in {part}: the next try resumes)" if kept else ""
                raise _failure(what, url, dest, sha256, f"{last}{note}") from None
        else:
            if digest == sha256:
                _publish(part, dest)
                st = os.stat(dest)
                _DIGESTS[(osp.realpath(dest), st.st_size, st.st_mtime_ns)] = digest
                logger.info("Downloaded %s to %s (SHA256 checked)", url, dest)
                return
            os.remove(part)
            if offset and attempt < ATTEMPTS:  # a stale partial file: start over once
                logger.warning("%s: resumed file has the wrong SHA256; starting over", part)
                continue
            raise _failure(
                what,
                url,
                dest,
                sha256,
                f"the downloaded file has SHA256 {digest}, expected "
                f"{sha256}; it was deleted (a wrong address or a damaged mirror)",
            )
        wait = RETRY_WAIT_S * 2 ** (attempt - 1)
        logger.warning(
            "Download of %s failed (%s); try %d of %d in %.0f s",
            url,
            last,
            attempt + 1,
            ATTEMPTS,
            wait,
        )
        time.sleep(wait)
    raise _failure(what, url, dest, sha256, "the server keeps refusing the partial file")


def _transfer(url: str, part: str, have: int, what: str, progress: bool) -> tuple[int, str]:
    """One request appending to ``part`` from byte ``have`` (or rewriting it when the server
    ignores the Range header); returns the offset it started at and the SHA256 of ``part``
    (hashed while the data lands)."""
    headers = {"User-Agent": "sample-pl-weights"}
    if have:
        headers["Range"] = f"bytes={have}-"
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
        resumed = have and resp.status == 206
        content_range = resp.headers.get("Content-Range", "")
        if resumed and not content_range.startswith(f"bytes {have}-"):
            os.remove(part)  # start over on the next try
            raise _Incomplete(f"unexpected Content-Range {content_range!r}")
        offset = have if resumed else 0
        length = resp.headers.get("Content-Length")
        total = offset + int(length) if length and length.isdigit() else None
        if have:
            how = f"resuming at byte {have}" if resumed else "the server cannot resume: restarting"
            logger.info("Downloading %s (%s)", url, how)
        else:
            logger.info("Downloading %s", url)
        from tqdm import tqdm

        h = hashlib.sha256()
        if resumed:
            with open(part, "rb") as f:
                while block := f.read(CHUNK):
                    h.update(block)
        got = 0
        with (
            open(part, "ab" if resumed else "wb") as f,
            tqdm(
                total=total,
                initial=offset,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=what,
                file=sys.stderr,
                disable=not progress,
                mininterval=1.0,
            ) as bar,
        ):
            while block := resp.read(CHUNK):
                f.write(block)
                h.update(block)
                got += len(block)
                bar.update(len(block))
            f.flush()
            os.fsync(f.fileno())
        if total is not None and offset + got < total:
            raise _Incomplete(f"connection closed after {offset + got} of {total} bytes")
    return offset, h.hexdigest()


def _publish(part: str, dest: str) -> None:
    """Rename the checked ``part`` to ``dest`` atomically and make the rename durable."""
    os.replace(part, dest)
    fd = os.open(osp.dirname(dest), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fetch_openai(file_name: str, what: str = "", progress: bool = True) -> str:
    """``~/.cache/clip/<file_name>`` (one of :data:`OPENAI_SHA256`), downloaded when missing."""
    dest = osp.join(clip_cache_dir(), file_name)
    return fetch(openai_url(file_name), dest, OPENAI_SHA256[file_name], what, progress)


def fetch_url(url: str, sha256: str, what: str = "", progress: bool = True) -> str:
    """The file at ``url`` (``MODEL.BACKBONE.URL``), checked against ``sha256``."""
    return fetch(url, url_cache_path(url, sha256), sha256, what or url, progress)


# -- open_clip's pretrained tags -------------------------------------------------------------------
def _hf_cache_dir() -> str:
    import huggingface_hub.constants

    return huggingface_hub.constants.HF_HUB_CACHE


def _open_clip_failure(what: str, source: str, reason: str, manual: str) -> DownloadError:
    return DownloadError(
        f"Cannot get the CLIP weights {what} from {source}: {reason}. open_clip keeps them in "
        f"{_hf_cache_dir()} (Hugging Face files) or {clip_cache_dir()} (URLs). Fetch them on a "
        f"machine with internet access with `python tools/download_weights.py "
        f"{shlex.quote(what)}` and copy that cache, or by hand: {manual}."
    )


def hf_hub_file(repo: str, filenames: tuple[str, ...], what: str, download: bool) -> str | None:
    """The first of ``filenames`` of the Hugging Face repository ``repo`` in the local cache, or
    downloaded (``download=True``, not offline) with ``huggingface_hub.hf_hub_download``."""
    import huggingface_hub

    for name in filenames:
        found = huggingface_hub.try_to_load_from_cache(repo, name)
        if isinstance(found, str) and osp.isfile(found):
            return found
    if not download:
        return None
    manual = f"`hf download {repo} {filenames[0]}` (huggingface_hub's command line)"
    if is_offline():
        reason = "offline (HF_HUB_OFFLINE or SAMPLE_PL_OFFLINE is set) and not in the cache"
        raise _open_clip_failure(what, f"hf-hub:{repo}", reason, manual)
    errors = []
    for name in filenames:
        try:
            return huggingface_hub.hf_hub_download(repo_id=repo, filename=name)
        except Exception as e:  # not in the repository, network, authentication
            errors.append(f"{name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    raise _open_clip_failure(what, f"hf-hub:{repo}", "; ".join(errors), manual)


def fetch_open_clip(pretrained_cfg: dict, what: str) -> str:
    """The weights of an open_clip pretrained tag (``open_clip.get_pretrained_cfg``): OpenAI's
    files through :func:`fetch_openai`, Hugging Face files through :func:`hf_hub_file`, other
    URLs through open_clip's own download into ``~/.cache/clip``."""
    url = pretrained_cfg.get("url", "")
    if url.startswith(OPENAI_BASE) and osp.basename(url) in OPENAI_SHA256:
        return fetch_openai(osp.basename(url), what)
    hub = pretrained_cfg.get("hf_hub", "")
    if hub:
        repo_id, file_name = _split_hub(hub)
        names = (
            (file_name,)
            if file_name
            else ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
        )
        return hf_hub_file(repo_id, names, what, download=True)
    if not url:
        raise BackboneError(f"open_clip has no download for {what}: give MODEL.BACKBONE.PATH")
    dest = osp.join(clip_cache_dir(), osp.basename(url))
    manual = f"mkdir -p {clip_cache_dir()} && curl -fL -o {shlex.quote(dest)} {shlex.quote(url)}"
    if is_offline():
        reason = "offline (HF_HUB_OFFLINE or SAMPLE_PL_OFFLINE is set) and not in the cache"
        raise _open_clip_failure(what, url, reason, manual)
    from open_clip.pretrained import download_pretrained_from_url

    os.makedirs(clip_cache_dir(), exist_ok=True)
    with file_lock(dest + ".lock"):
        try:
            return download_pretrained_from_url(url, cache_dir=clip_cache_dir())
        except Exception as e:
            raise _open_clip_failure(what, url, str(e).splitlines()[0], manual) from None


def _split_hub(hub: str) -> tuple[str, str]:
    """open_clip's ``hf_hub`` entry ``org/name/`` or ``org/name/file`` -> (repo id, file)."""
    parts = hub.split("/")
    return "/".join(parts[:2]), "/".join(parts[2:])
