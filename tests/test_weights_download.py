"""CLIP weights downloads (engine/clip/weights.py) against a loopback HTTP server on 127.0.0.1.

OpenAI's address table is redirected to the server with ``SAMPLE_PL_CLIP_MIRROR`` and a checksum
entry of the test's file; open_clip's Hugging Face downloads are replaced by a recording stand-in.
Nothing here reaches beyond the machine.
"""

from __future__ import annotations

import hashlib
import http.server
import multiprocessing
import os
import os.path as osp
import pickle
import socket
import subprocess
import sys
import threading
import time
import zipfile

import pytest
import torch
from conftest import ROOT, make_cfg

from engine.clip import weights
from engine.clip.model import UnusableWeightsError, ensure_weights, load_clip, read_state_dict
from engine.clip.weights import DownloadError


class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves ``server.files``; ``server.cut``: the next N responses stop after ``cut_at``
    bytes; ``server.ranges``: honour Range headers; ``server.gate``: an Event each response
    waits for before its body."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        srv = self.server
        srv.requests.append((self.path, self.headers.get("Range")))
        data = srv.files.get(self.path)
        if data is None:
            self.send_error(404)
            return
        start, status = 0, 200
        rng = self.headers.get("Range")
        if rng and srv.ranges:
            start, status = int(rng.split("=")[1].split("-")[0]), 206
        body = data[start:]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        srv.gate.wait(30)
        if srv.cut:
            srv.cut -= 1
            self.wfile.write(body[: srv.cut_at])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        half = len(body) // 2
        self.wfile.write(body[:half])
        self.wfile.flush()
        srv.midway(self.path)
        self.wfile.write(body[half:])

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.files, srv.requests, srv.cut, srv.cut_at, srv.ranges = {}, [], 0, 0, True
    srv.gate = threading.Event()
    srv.gate.set()
    srv.midway = lambda path: None
    srv.base = f"http://127.0.0.1:{srv.server_address[1]}"
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield srv
    srv.gate.set()
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def online(tmp_path, monkeypatch):
    """A fresh home folder (so ~/.cache/clip is empty) and Hugging Face cache, the offline
    switches off, no waits between tries."""
    import huggingface_hub.constants

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.delenv("SAMPLE_PL_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(weights, "RETRY_WAIT_S", 0.0)
    return tmp_path / "home" / ".cache" / "clip"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _serve_openai(server, monkeypatch, data: bytes, file_name="ViT-B-16.pt", sha=None) -> str:
    """Serve ``data`` as OpenAI's ``file_name`` through the mirror variable; returns its path."""
    sha = sha or _sha(data)
    monkeypatch.setitem(weights.OPENAI_SHA256, file_name, sha)
    monkeypatch.setenv(weights.MIRROR_ENV, server.base + "/mirror/")
    path = f"/mirror/{sha}/{file_name}"
    server.files[path] = data
    return path


def _cache_files(folder) -> list[str]:
    """What the cache folder holds besides lock files."""
    if not osp.isdir(folder):
        return []
    return sorted(n for n in os.listdir(folder) if not n.endswith(".lock"))


def _tiny_backbone(tiny_clip) -> list[str]:
    return ["MODEL.BACKBONE.NAME", "ViT-B/16", "MODEL.BACKBONE.CONFIG", tiny_clip[0]]


def test_openai_name_is_downloaded_checked_and_renamed_at_the_end(
    tiny_clip, server, online, monkeypatch
):
    data = open(tiny_clip[1], "rb").read()
    path = _serve_openai(server, monkeypatch, data)
    dest = online / "ViT-B-16.pt"
    seen = {}

    def midway(_):  # half the body sent: the client writes the partial file, not the checkpoint
        deadline = time.time() + 5
        while not osp.exists(f"{dest}.part") and time.time() < deadline:
            time.sleep(0.01)
        seen.update(dest=dest.exists(), part=osp.exists(f"{dest}.part"))

    server.midway = midway
    model = load_clip(make_cfg(_tiny_backbone(tiny_clip)))
    assert seen == {"dest": False, "part": True}  # mid-download: only the partial file exists
    assert dest.read_bytes() == data and _cache_files(online) == ["ViT-B-16.pt"]
    assert server.requests == [(path, None)]
    sd, _ = read_state_dict(tiny_clip[1])
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())
    load_clip(make_cfg(_tiny_backbone(tiny_clip)))  # cached and checked: no second request
    assert len(server.requests) == 1


def test_wrong_checksum_is_an_error_and_leaves_nothing(server, online, monkeypatch):
    _serve_openai(server, monkeypatch, b"not the weights", sha=_sha(b"the weights"))
    with pytest.raises(DownloadError) as e:
        ensure_weights(make_cfg(["--backbone", "ViT-B/16"]))
    msg = str(e.value)
    assert f"SHA256 {_sha(b'not the weights')}, expected {_sha(b'the weights')}" in msg
    assert server.base + "/mirror/" in msg and str(online / "ViT-B-16.pt") in msg
    assert "sha256sum" in msg and "\n" not in msg
    assert _cache_files(online) == []


def test_dropped_connection_keeps_no_checkpoint_and_resumes(server, online, monkeypatch):
    data = os.urandom(300_000)
    path = _serve_openai(server, monkeypatch, data)
    dest = online / "ViT-B-16.pt"
    monkeypatch.setattr(weights, "ATTEMPTS", 1)
    server.cut, server.cut_at = 1, 100_000
    with pytest.raises(DownloadError, match="connection closed after 100000 of 300000 bytes"):
        weights.fetch_openai("ViT-B-16.pt")
    assert not dest.exists() and osp.getsize(f"{dest}.part") == 100_000
    assert weights.fetch_openai("ViT-B-16.pt") == str(dest)  # the second try resumes
    assert dest.read_bytes() == data and _cache_files(online) == ["ViT-B-16.pt"]
    assert server.requests == [(path, None), (path, "bytes=100000-")]


def test_dropped_connection_restarts_without_range_support_and_retries_by_itself(
    server, online, monkeypatch
):
    data = os.urandom(200_000)
    path = _serve_openai(server, monkeypatch, data)
    server.ranges, server.cut, server.cut_at = False, 1, 50_000
    assert weights.fetch_openai("ViT-B-16.pt") == str(online / "ViT-B-16.pt")  # ATTEMPTS tries
    assert (online / "ViT-B-16.pt").read_bytes() == data
    assert server.requests == [(path, None), (path, "bytes=50000-")]  # answered with 200: restart
    assert _cache_files(online) == ["ViT-B-16.pt"]


def _fetch_in_child(url, dest, sha):
    try:
        weights.fetch(url, dest, sha, progress=False)
    except BaseException:
        os._exit(1)
    os._exit(0)


def _waiting_on_lock(lock_path: str) -> bool:
    """Whether /proc/locks shows a process waiting for the flock of ``lock_path``."""
    ino = os.stat(lock_path).st_ino
    with open("/proc/locks") as f:
        return any("->" in line and f":{ino} " in line for line in f)


def test_two_processes_asking_at_once_make_one_download(server, online, tmp_path):
    data = os.urandom(100_000)
    server.files["/w.pt"] = data
    dest = str(tmp_path / "cache" / "w.pt")
    server.gate.clear()  # responses wait until both processes are in
    ctx = multiprocessing.get_context("fork")
    args = (server.base + "/w.pt", dest, _sha(data))
    procs = [ctx.Process(target=_fetch_in_child, args=args) for _ in range(2)]
    for p in procs:
        p.start()
    deadline = time.time() + 20
    while time.time() < deadline and not (
        server.requests and osp.exists(dest + ".lock") and _waiting_on_lock(dest + ".lock")
    ):
        time.sleep(0.05)
    assert server.requests and _waiting_on_lock(dest + ".lock")  # one downloads, one waits
    server.gate.set()
    for p in procs:
        p.join(20)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(server.requests) == 1 and open(dest, "rb").read() == data


@pytest.mark.parametrize("switch", ["SAMPLE_PL_OFFLINE", "HF_HUB_OFFLINE"])
def test_offline_touches_no_network(switch, server, online, monkeypatch):
    _serve_openai(server, monkeypatch, b"weights")
    monkeypatch.setenv(switch, "1")

    def no_connection(*args, **kwargs):
        raise AssertionError("a connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", no_connection)
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_connection)
    for name in ("ViT-B/16", "ViT-B-16:laion2b_s34b_b88k", "hf-hub:org/clip"):
        with pytest.raises(DownloadError, match="offline") as e:
            ensure_weights(make_cfg(["--backbone", name]))
        assert "\n" not in str(e.value) and "tools/download_weights.py" in str(e.value)
    with pytest.raises(DownloadError, match="curl -fL .*sha256sum"):
        weights.fetch_openai("ViT-B-16.pt")
    assert server.requests == [] and _cache_files(online) == []


def test_cached_file_with_wrong_checksum_is_reported_and_fetched_again(
    server, online, monkeypatch, caplog
):
    _serve_openai(server, monkeypatch, b"good weights")
    online.mkdir(parents=True)
    (online / "ViT-B-16.pt").write_bytes(b"good wei")  # cut short by a copy
    monkeypatch.setenv("SAMPLE_PL_OFFLINE", "1")
    with pytest.raises(DownloadError, match="cached file has SHA256 .* delete it"):
        weights.fetch_openai("ViT-B-16.pt")
    monkeypatch.delenv("SAMPLE_PL_OFFLINE")
    with caplog.at_level("WARNING", logger="engine.clip.weights"):
        weights.fetch_openai("ViT-B-16.pt")
    assert "fetching it again" in caplog.text and "ViT-B-16.pt" in caplog.text
    assert (online / "ViT-B-16.pt").read_bytes() == b"good weights" and len(server.requests) == 1


def _crafted_torchscript(tmp_path) -> tuple[str, str]:
    """A TorchScript archive whose data.pkl calls os.system (to touch a marker file)."""
    good = str(tmp_path / "good_ts.pt")
    torch.jit.script(torch.nn.Linear(2, 2)).save(good)
    marker = str(tmp_path / "marker")

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = str(tmp_path / "crafted.pt")
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(path, "w") as out:
        for name in src.namelist():
            data = src.read(name)
            out.writestr(name, pickle.dumps(Payload(), 2) if name.endswith("/data.pkl") else data)
    return path, marker


def test_unusable_weight_files_are_one_paragraph(tiny_clip, tmp_path):
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    cut = tmp_path / "cut.pt"
    data = open(tiny_clip[1], "rb").read()
    cut.write_bytes(data[: len(data) // 2])
    crafted, marker = _crafted_torchscript(tmp_path)
    reasons = {str(empty): "empty", str(cut): "central directory", crafted: "TorchScript reader"}
    for path, reason in reasons.items():
        opts = ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", tiny_clip[0]]
        with pytest.raises(UnusableWeightsError) as e:
            load_clip(make_cfg([*opts, "MODEL.BACKBONE.PATH", path]))
        msg = str(e.value)
        assert path in msg and reason in msg and "Delete it and fetch it again" in msg
        assert "\n" not in msg and e.value.__cause__ is None
    assert not osp.exists(marker)  # the crafted archive's code never ran


def test_url_and_sha256_through_the_config(tiny_clip, server, online):
    data = open(tiny_clip[1], "rb").read()
    server.files["/files/tiny.pt"] = data
    url, sha = server.base + "/files/tiny.pt", _sha(data)
    opts = ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", tiny_clip[0]]
    cfg = make_cfg([*opts, "MODEL.BACKBONE.URL", url, "MODEL.BACKBONE.SHA256", sha.upper()])
    model = load_clip(cfg)
    dest = online / f"sha256-{sha[:16]}" / "tiny.pt"
    assert dest.read_bytes() == data and server.requests == [("/files/tiny.pt", None)]
    assert torch.equal(
        model.visual.conv1.weight, read_state_dict(str(dest))[0]["visual.conv1.weight"]
    )
    with pytest.raises(weights.BackboneError, match="needs MODEL.BACKBONE.SHA256"):
        load_clip(make_cfg([*opts, "MODEL.BACKBONE.URL", url]))
    both = [*opts, "MODEL.BACKBONE.URL", url, "MODEL.BACKBONE.SHA256", sha]
    with pytest.raises(weights.BackboneError, match="are both set"):
        load_clip(make_cfg([*both, "MODEL.BACKBONE.PATH", tiny_clip[1]]))


def test_open_clip_tags_download_through_huggingface_hub(tmp_path, online, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename))
        path = tmp_path / "hf_files" / repo_id / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"w")
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    path = ensure_weights(make_cfg(["--backbone", "ViT-B-16:laion2b_s34b_b88k"]))
    assert calls == [("laion/CLIP-ViT-B-16-laion2B-s34B-b88K", "open_clip_model.safetensors")]
    assert path.endswith("open_clip_model.safetensors")
    ensure_weights(make_cfg(["--backbone", "hf-hub:org/clip"]))  # its config and its weights
    assert calls[1:] == [("org/clip", "open_clip_config.json"), ("org/clip", calls[0][1])]


def test_grid_fetches_each_backbone_once_before_runs(tiny_clip, server, online):
    from experiments.grid_plan import expand, select
    from experiments.protocols import Setup, fetch_weights

    data = open(tiny_clip[1], "rb").read()
    server.files["/tiny.pt"] = data
    opts = ("MODEL.BACKBONE.URL", server.base + "/tiny.pt", "MODEL.BACKBONE.SHA256", _sha(data))
    setup = Setup(data="d", opts=opts)
    axes = dict(trainers=["CoOp"], optims=["sgd", "sample"], datasets=["dtd", "eurosat"])
    chains = expand(select(None, seeds=[1], **axes), setup)
    fetch_weights(chains, setup)
    assert len(chains) == 4 and server.requests == [("/tiny.pt", None)]
    assert (online / f"sha256-{_sha(data)[:16]}" / "tiny.pt").read_bytes() == data


@pytest.mark.slow
def test_download_weights_tool(server, online, capsys):
    from tools import download_weights

    data = os.urandom(50_000)
    server.files["/x/model.pt"] = data
    url, sha = server.base + "/x/model.pt", _sha(data)
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, osp.join(ROOT, "tools", "download_weights.py"), "--url", url]
    proc = subprocess.run(cmd + ["--sha256", sha], capture_output=True, text=True, env=env)
    dest = online / f"sha256-{sha[:16]}" / "model.pt"
    assert proc.returncode == 0, proc.stderr
    assert f"{url}: {dest}" in proc.stdout and dest.read_bytes() == data
    assert download_weights.main(["--check", "--url", url, "--sha256", sha]) == 0
    assert download_weights.main(["--check", "RN50"]) == 1  # not in the cache
    assert download_weights.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert f"{url}: ok ({dest})" in out
    assert "RN50: missing" in out and "ViT-L/14@336px" in out
    assert len(server.requests) == 1
