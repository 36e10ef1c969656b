"""Start-up and shutdown: what importing the packages pulls in, the tensorboard writer started
only when scalars are written, loader workers stopped without waiting, nothing left to join at
exit (engine/runner.py)."""

from __future__ import annotations

import os
import os.path as osp
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT


def run_python(code: str, tmp_path, extra_path: str = "") -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (extra_path, ROOT) if p))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def fake_library(folder, name: str, marker) -> None:
    """A package ``name`` that leaves ``marker`` behind when it is imported."""
    os.makedirs(folder / name, exist_ok=True)
    (folder / name / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")


@pytest.mark.slow
def test_packages_import_neither_transformers_nor_timm(tmp_path):
    # stand-ins for the libraries of the towers the project does not use: open_clip imports
    # both at its own import time when they are installed (transformers costs ~8 s on a GPU host)
    fakes = tmp_path / "fakes"
    for name in ("transformers", "timm"):
        fake_library(fakes, name, tmp_path / f"{name}.imported")
    out = run_python(
        """
        import sys
        import datasets, trainers, engine, engine.clip
        print(sorted(m for m in ("transformers", "timm", "open_clip") if m in sys.modules))
        """,
        tmp_path,
        extra_path=str(fakes),
    )
    assert out.split("\n")[0] == "['open_clip']"  # no None placeholder left in sys.modules
    assert not any(n.endswith(".imported") for n in os.listdir(tmp_path))


@pytest.mark.slow
def test_a_timm_vision_tower_still_builds(tmp_path):
    out = run_python(
        """
        import sys
        from engine.clip.model import build_clip
        assert "timm" not in sys.modules
        vision = {"timm_model_name": "resnet18", "image_size": 32}
        text = {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}
        model = build_clip({"embed_dim": 32, "vision_cfg": vision, "text_cfg": text})
        print(type(model.visual).__name__, "timm" in sys.modules)
        """,
        tmp_path,
    )
    assert out.split() == ["TimmModel", "True"]


@pytest.mark.slow
def test_compile_off_imports_no_dynamo(tmp_path):
    path = osp.join(ROOT, "engine", "compile.py")
    out = run_python(
        f"""
        import importlib.util, sys
        import torch
        spec = importlib.util.spec_from_file_location("c", {path!r})
        compile_module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(compile_module)  # alone: torchvision imports torch._dynamo
        assert compile_module.compile_encoders(torch.nn.Linear(2, 2), "") == []
        compile_module.mark_step()
        print("torch._dynamo" in sys.modules)
        """,
        tmp_path,
    )
    assert out.strip() == "False"


def test_clip_checkpoint_cache_gives_the_same_model(tiny_clip, monkeypatch):
    import torch

    from engine.clip import model as clip_model
    from engine.config import get_cfg_default

    cfg = get_cfg_default()
    cfg.MODEL.BACKBONE.NAME, cfg.MODEL.BACKBONE.CONFIG = "", tiny_clip[0]
    cfg.MODEL.BACKBONE.PATH = tiny_clip[1]
    reads = []
    real = clip_model.read_state_dict
    monkeypatch.setattr(clip_model, "read_state_dict", lambda p: reads.append(p) or real(p))
    torch.manual_seed(0)
    plain = clip_model.load_clip(cfg, "fp16").state_dict()
    clip_model.cache_weights(True)
    try:
        for _ in range(2):
            torch.manual_seed(0)
            cached = clip_model.load_clip(cfg, "fp16").state_dict()
            assert all(torch.equal(plain[k], cached[k]) for k in plain)
    finally:
        clip_model.cache_weights(False)
    assert len(reads) == 2  # once without the cache, once for both cached loads


def test_tensorboard_writer_starts_with_the_first_scalars(tmp_path):
    from engine.writers import ScalarWriter

    writer = ScalarWriter()
    tb = str(tmp_path / "tensorboard")
    writer.open(str(tmp_path), tb)
    writer.flush()  # nothing queued: no writer, no folder
    assert writer._tb is None and not osp.exists(tb)
    writer.add({"train/loss": 1.5}, 0)
    writer.flush()
    writer.close()
    assert open(tmp_path / "scalars.jsonl").read() == '{"step": 0, "train/loss": 1.5}\n'
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return
    assert os.listdir(tb)  # the event file


@pytest.mark.slow
def test_a_run_leaves_no_worker_thread_or_handler_behind(tmp_path, tiny_clip_opts):
    from datasets.synthetic import make_dtd

    data = make_dtd(str(tmp_path / "data"))
    argv = ["--root", osp.dirname(data), "--seed", "1", "--trainer", "CoOp"]
    argv += ["--dataset-config-file", osp.join(ROOT, "configs/datasets/dtd.yaml")]
    argv += ["--output-dir", str(tmp_path / "out"), *tiny_clip_opts]
    argv += ["DATALOADER.NUM_WORKERS", "2", "OPTIM.MAX_EPOCH", "2", "DATASET.NUM_SHOTS", "2"]
    argv += ["TRAINER.COOP.PREC", "fp32"]
    out = run_python(
        f"""
        import logging, multiprocessing, sys, threading, time
        from torch.utils.data import dataloader
        import datasets, trainers
        from engine.runner import finish_process, run_in_process
        # who stopped the loaders' workers: the run's end (engine.data.manager.shutdown_loaders)
        # or a garbage collector's finaliser (DataLoader's __del__: the loader's queues may be
        # finalised first, its workers then miss their stop message and end 5 s later)
        stoppers, shutdown = [], dataloader._MultiProcessingDataLoaderIter._shutdown_workers
        def recorded(self):
            if not self._shutdown:
                stoppers.append(sys._getframe(1).f_code.co_name)
            shutdown(self)
        dataloader._MultiProcessingDataLoaderIter._shutdown_workers = recorded
        assert run_in_process({argv!r}) == 0
        handlers = [h for h in logging.getLogger().handlers if getattr(h, "_engine_handler", 0)]
        joined = [t for t in threading.enumerate() if not t.daemon]  # exit waits for these
        print(sorted(set(stoppers)))
        print(len(joined), len(multiprocessing.active_children()), len(handlers))
        t = time.time()
        finish_process(0)
        print(f"{{time.time() - t:.3f}}")
        """,
        tmp_path,
    )
    lines = out.strip().splitlines()
    assert "__del__" not in lines[-3] and "shutdown_loader" in lines[-3]  # stopped at the run's end
    assert lines[-2] == "1 0 0"  # the main thread only, no loader worker, the run's log closed
    assert "* accuracy" in open(tmp_path / "out" / "log.txt").read()
