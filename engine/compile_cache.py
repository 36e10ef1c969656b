"""Compilation that pays for itself: the persistent compile caches and ``MODEL.COMPILE auto``'s
decision.

**The cache folder.** torch keeps compiled code in inductor's FX-graph cache and the
AOT-autograd cache (both on by default) under ``$TORCHINDUCTOR_CACHE_DIR``, whose default is a
per-user folder in ``/tmp`` of each node. Every compilation of this project
(:class:`engine.compile.CompiledForward`) uses one folder instead (:func:`cache_dir`):

- ``$TORCHINDUCTOR_CACHE_DIR`` when it is set (to anything but torch's ``/tmp`` default);
- else ``<cache root>/compile``: ``$SAMPLE_PL_CACHE/compile`` (default
  ``~/.cache/sample-pl/compile``), beside the project's other caches (evaluation features,
  few-shot splits).

A cluster puts ``$SAMPLE_PL_CACHE`` (or ``$TORCHINDUCTOR_CACHE_DIR``) on a shared file system, so
a configuration compiles once per cluster rather than once per node or job: a later process
still traces the model with dynamo (seconds) but loads the generated code instead of
generating and compiling it. Measured on this project's 2-core CPU (inductor, ``tests/
test_compile_cache.py``): the warm process's compilation takes <= 20% of the cold one's, with
bit-identical outputs and gradients. Triton's kernel cache lives inside the same folder.

**auto.** ``MODEL.COMPILE auto`` (the default) compiles the training steps of a run on a GPU only
when it pays (:func:`decide`): when the persistent cache already holds the graphs of this
configuration (it was compiled before with this folder: a warm compile costs seconds), or when
``steps x (eager step - compiled step) > compile seconds``. The run's steps come from its loader
and epochs; the compile seconds and eager step time from this folder's record
(``sample-pl-compiles.json``: what earlier runs of the same configuration, or else of the same
device, measured), else from the defaults below (issue 30, one H200, ViT-B/16 fp16 CoOp: a cold
compilation of ~35 s in the first steps, eager step 35 ms, compiled 6.4 ms: ratio ~0.2). The
decision and its numbers are logged. On CPU ``auto`` stays eager (no GPU numbers to weigh).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import os.path as osp
import statistics

logger = logging.getLogger(__name__)

RECORD_NAME = "sample-pl-compiles.json"
DEFAULT_COMPILE_S = 35.0  # cold compilation of a run's encoders (H200, ViT-B/16)
DEFAULT_EAGER_STEP_S = 0.035  # eager CoOp step (H200, fp16, batch 32)
COMPILED_RATIO = 0.2  # compiled step / eager step (H200: 6.4 / 35.3 SGD, 10.7 / 55.9 SAMPLe)

_current_key: str | None = None  # the configuration whose compilations are being recorded
_current_compiled = False


def cache_dir() -> str:
    """The folder of the persistent compile caches (see the module docstring)."""
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env and not _is_torch_default(env):
        return osp.abspath(osp.expanduser(env))
    from .utils import user_cache_dir

    return user_cache_dir("compile")


def _is_torch_default(path: str) -> bool:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # pragma: no cover  (another torch layout)
        return False
    return osp.abspath(path) == osp.abspath(default_cache_dir())


def use_persistent_cache() -> str:
    """Point inductor's caches at :func:`cache_dir` and make sure that the FX-graph and
    AOT-autograd caches are on; returns the folder. Idempotent."""
    directory = cache_dir()
    os.makedirs(directory, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    if hasattr(functorch_config, "enable_autograd_cache"):
        functorch_config.enable_autograd_cache = True
    return directory


def _record_path() -> str:
    return osp.join(cache_dir(), RECORD_NAME)


def read_records() -> dict:
    """``{key: {"device", "compile_s", "eager_step_s", ...}}`` of this cache folder."""
    try:
        with open(_record_path()) as f:
            records = json.load(f)
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def _update_record(key: str, **values) -> None:
    from .utils import atomic_write_text, file_lock

    path = _record_path()
    os.makedirs(osp.dirname(path), exist_ok=True)
    with file_lock(path + ".lock"):
        records = read_records()
        entry = records.setdefault(key, {})
        for name, value in values.items():
            if name == "add_compile_s":
                entry["compile_s"] = entry.get("compile_s", 0.0) + value
            else:
                entry[name] = value
        atomic_write_text(path, json.dumps(records, indent=1, sort_keys=True) + "\n")


def config_key(**parts) -> str:
    """The record key of a configuration (what selects its compiled graphs)."""
    import torch

    return json.dumps({**parts, "torch": torch.__version__}, sort_keys=True)


def decide(
    steps: int,
    key: str,
    device: str,
    records: dict | None = None,
) -> tuple[bool, str]:
    """``(compile?, why)`` for a run of ``steps`` training steps of configuration ``key`` on
    ``device`` (a description such as the GPU's name), from the cache folder's records."""
    records = read_records() if records is None else records
    mine = records.get(key, {})
    if mine.get("compiled"):
        return True, (
            f"the persistent cache ({cache_dir()}) holds this configuration's graphs (compiled "
            f"before; first calls {mine.get('compile_s') or 0.0:.1f} s)"
        )
    same = [r for r in records.values() if r.get("device") == device]
    cold = [r["cold_compile_s"] for r in same if r.get("cold_compile_s")]
    compile_s, c_src = DEFAULT_COMPILE_S, "default"
    if cold:
        compile_s, c_src = statistics.median(cold), "recorded on this device"
    eager, e_src = mine.get("eager_step_s"), "this configuration's"
    if eager is None:
        others = [r["eager_step_s"] for r in same if r.get("eager_step_s")]
        eager, e_src = DEFAULT_EAGER_STEP_S, "default"
        if others:
            eager, e_src = statistics.median(others), "this device's"
    saved = steps * eager * (1 - COMPILED_RATIO)
    pays = saved > compile_s
    why = (
        f"{steps:,} steps x {1000 * eager * (1 - COMPILED_RATIO):.1f} ms saved per step "
        f"({e_src} eager step {1000 * eager:.1f} ms, compiled ~{COMPILED_RATIO:.0%} of it) = "
        f"{saved:.1f} s {'>' if pays else '<='} {compile_s:.1f} s of compilation ({c_src})"
    )
    return pays, why


def begin(key: str, device: str, compiled: bool) -> None:
    """The run of configuration ``key`` starts, compiled or not: its compilations are recorded
    (:func:`note_compile`) and its step time at the end (:func:`run_ended`)."""
    global _current_key, _current_compiled
    _current_key, _current_compiled = key, compiled
    with contextlib.suppress(OSError):
        if compiled:
            warm = bool(read_records().get(key, {}).get("compiled"))
            _update_record(key, device=device, compile_s=0.0, warm=warm, compiled=True)
        else:
            _update_record(key, device=device)


def note_compile(seconds: float) -> None:
    """A compiled encoder's first call took ``seconds`` (compilation included)."""
    if _current_key is None:
        return
    with contextlib.suppress(OSError):
        _update_record(_current_key, add_compile_s=seconds)
        entry = read_records().get(_current_key, {})
        if not entry.get("warm"):
            _update_record(_current_key, cold_compile_s=entry.get("compile_s", seconds))


def run_ended(mean_step_s: float | None) -> None:
    """Record the mean step time (eager or compiled) of the run begun by :func:`begin`."""
    global _current_key
    key, _current_key = _current_key, None
    if key is None or not mean_step_s:
        return
    name = "compiled_step_s" if _current_compiled else "eager_step_s"
    with contextlib.suppress(OSError):
        _update_record(key, **{name: mean_step_s})


def auto_compiles(trainer) -> bool:
    """``MODEL.COMPILE auto`` for ``trainer``'s training run: decide (:func:`decide`), log the
    decision with its numbers, and start recording this configuration's costs."""
    import torch

    cfg, dev = trainer.cfg, trainer.device
    loader = getattr(trainer, "train_loader_x", None)
    steps = len(loader) * trainer.max_epoch if loader is not None else 0
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    bb = cfg.MODEL.BACKBONE
    key = config_key(
        trainer=cfg.TRAINER.NAME,
        backbone=[bb.NAME, osp.basename(bb.CONFIG), osp.basename(bb.PATH)],
        classes=getattr(trainer, "num_classes", 0),
        batch=cfg.DATALOADER.TRAIN_X.BATCH_SIZE,
        input=list(cfg.INPUT.SIZE),
        precision=trainer.prec,
        optimizer=cfg.OPTIM.SAM.NAME or cfg.OPTIM.NAME,
        device=device,
        mode=trainer.compile_mode,
    )
    pays, why = decide(steps, key, device)
    logger.info(
        "MODEL.COMPILE auto: %s: %s",
        f"compiling ({trainer.compile_mode})" if pays else "eager",
        why,
    )
    begin(key, device, pays)
    return pays
