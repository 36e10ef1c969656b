"""Per-step measurements: training step, evaluation and data pipeline, against the reference style.

Drives the registered trainers (CoOp, CoCoOp, TCP, MaPLe, CoPrompt, KgCoOp, IVLP, PromptSRC;
missing ones are skipped with a note) through their real step protocol
(``trainer.forward_backward(batch)``) on ViT-B/16-sized
CLIP models with random weights (no download) and synthetic batches at each trainer's base-to-new
settings (its ``experiments/protocols.py`` config: batch size, context length, prompt depth,
precision;
50 base classes), for SGD (the trainer's base optimizer), SAM, SAGM and SAMPLe with the paper's
values (``configs/optim/<trainer>/``; staged configs are measured in their sharpness-aware stage).
Every measurement is repeated in the same process for the *reference style* of the original code
bases: prompts at the full 77 tokens (``MODEL.TEXT_FULL_LENGTH True``), the frozen
work of ``prepare_step`` (image encoder, teachers) run again in every pass, and the class text
features re-encoded for every evaluation batch.

Run through ``tools/benchmark.py`` (this module has no command line of its own)::

    python tools/benchmark.py --device cuda --json out.json   # full size (a few minutes on a GPU)
    python tools/benchmark.py --small                          # reduced width, CPU, ~1 minute
    python tools/benchmark.py --device cpu --optims sgd,sample # full size on CPU (~20 minutes)

``--json FILE`` writes the ratios of the issue's targets (``TARGETS``), a ``rows`` list (one
entry per trainer x optimizer x precision) and a ``device`` string; it is rewritten after every
measurement, and a failed measurement is reported (exit status 1) without stopping the others
(its key stays null). Times are medians of ``--steps`` timed calls after ``--warmup`` calls,
interleaving the compared variants (so load changes on a shared machine hit both), with CUDA
synchronisation around every timed call; with compilation on (``--compile``, default ``auto``:
on a GPU), every measurement first makes 3 untimed rounds, whatever the budget (compilation and
the compiled encoders' first calls, which are checked against eager); a measurement group
stops repeating once it has used ``--budget`` seconds (at least one call).
On CPU torch runs one thread by default (``--threads``): on a shared machine descheduled OpenMP
threads slow small operations down many times, which would distort the ratios.

Evaluation: the per-call costs of ``before_test()`` (class text features) and
``model_inference(images)`` are measured on ``--eval-images-per-call`` images (default: the test
batch) and combined into the time of one evaluation of a test set in test batches: the project
encodes the text once per evaluation, the reference style once per batch. With fewer images per
call than the test batch (the CPU default for ViT-B/16) the image cost is scaled linearly.
Peak memory: ``torch.cuda.max_memory_allocated`` during the path's calls minus what was allocated
before them, plus the path's own weights and optimizer state; not measured on CPU.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import os.path as osp
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from engine.compile import CHECKED_CALLS, compiled_forwards, resolve_compile
from experiments import ROOT

logger = logging.getLogger("benchmark")

TRAINERS = ("CoOp", "CoCoOp", "TCP", "MaPLe", "CoPrompt", "KgCoOp", "IVLP", "PromptSRC")
OPTIMIZERS = ("sgd", "sam", "sagm", "sample")  # sgd: the trainer config's base optimizer
PRECISIONS = ("fp16", "amp", "bf16", "fp32")
# the targets: JSON key -> (comparison, bound)
TARGETS = {
    "text_trunc_speedup": (">=", 3.0),
    "sample_over_sgd_step": ("<=", 1.3),
    "sgd_speedup_vs_reference": (">=", 1.5),
    "eval_speedup_vs_reference": (">=", 4.0),
    "step_over_parts": ("<=", 1.2),
    "cocoop_batched_speedup": (">=", 1.2),
    "decoded_cache_loader_speedup": (">=", 2.0),
    "eval_feature_cache_speedup": (">=", 10.0),
    # issue 12 (GPU): CoOp fp16 SGD step at batch 32 / 50 classes, SAMPLe over SGD, and SAMPLe
    # against the reference style for CoOp, CoCoOp and MaPLe at their published batch sizes
    "coop_sgd_step_ms": ("<=", 6.0),
    "sample_speedup_vs_reference_min": (">=", 2.0),
    # the decoded-image loader against what the CoOp + SGD step consumes (images/s)
    "loader_over_step_demand": (">=", 1.0),
}
SAMPLE_VS_REFERENCE = ("CoOp", "CoCoOp", "MaPLe")
DATASET = "DescribableTextures"  # templates of TCP/CoPrompt; the images are synthetic
# --small: a narrow CLIP with the depth the deep-prompt trainers need (MaPLe/CoPrompt prompt 9
# blocks, TCP injects before text block 8)
SMALL_CLIP = {
    "embed_dim": 128,
    "quick_gelu": True,
    "vision_cfg": {
        "image_size": 224,
        "layers": 9,
        "width": 128,
        "patch_size": 32,
        "head_width": 64,
    },
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 128, "heads": 2, "layers": 9},
}
_ADJECTIVES = (  # words of the synthetic class names
    "red striped small wild golden spotted giant common northern dwarf black white mountain sea "
    "desert river snowy royal tiny great"
)
_NOUNS = (
    "fox tulip aircraft beetle owl fern sparrow orchid lizard maple salmon truck violin teapot "
    "cactus heron moth otter pine lantern crab daisy falcon kettle lily marmot newt oak parrot "
    "quail robin shark thistle urchin viper walrus yak zebra badger camel dingo egret finch gecko "
    "hare ibis jackal koala lemur mink"
)


def class_names(n: int) -> list[str]:
    """``n`` distinct class names of 2-7 words (every 97th is long, as in real datasets)."""
    names = [f"{a} {noun}" for noun in _NOUNS.split() for a in _ADJECTIVES.split()]
    if n > len(names):
        raise ValueError(f"At most {len(names)} synthetic class names, asked for {n}")
    return [f"{s} with long tail feathers" if i % 97 == 96 else s for i, s in enumerate(names[:n])]


# ----------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------
@dataclass
class Settings:
    """What one benchmark run measures and how often (see :func:`make_settings`)."""

    device: str
    small: bool
    trainers: tuple[str, ...]
    optims: tuple[str, ...]
    precisions: tuple[str, ...]  # a CoOp sweep besides each trainer's own precision
    warmup: int
    steps: int
    budget_s: float
    eval_images_per_call: int | None  # None: the test batch
    workers: int
    base_classes: int = 50  # base half of a typical dataset
    text_classes: int = 100  # target 1: CoOp-style prompts, n_ctx 4
    eval_classes: int = 1000  # target 3: ImageNet scale
    eval_test_images: int = 50000  # ImageNet's test set, in batches of the config's 100
    row_test_images: int = 2500  # the test set of each row's evaluation throughput
    cocoop_batch: int = 8
    loader_per_class: int = 16  # 16-shot training set of loader_classes classes
    loader_classes: int = 10
    cache_test_images: int = 5000
    compile: str = "auto"  # MODEL.COMPILE of the project's paths (the reference style: off)
    model_opts: list[str] = field(default_factory=list)


def make_settings(args, tmp: str) -> Settings:
    cuda = args.device == "cuda"
    small = args.small
    precisions = tuple(args.precisions.split(",")) if args.precisions else ()
    for p in precisions:
        if p not in PRECISIONS:
            raise SystemExit(f"--precisions: unknown precision {p!r}; choose from {PRECISIONS}")
    s = Settings(
        device=args.device,
        small=small,
        trainers=tuple(args.trainers.split(",")),
        optims=tuple(args.optims.split(",")),
        precisions=precisions,
        warmup=args.warmup if args.warmup is not None else (3 if cuda else int(small)),
        steps=args.steps if args.steps is not None else (10 if cuda else 3),
        budget_s=args.budget,
        eval_images_per_call=args.eval_images_per_call or (None if cuda else 20 if small else 10),
        workers=args.workers if args.workers is not None else (8 if cuda else 0),
        compile=args.compile,
    )
    if small:
        from engine.clip.toy import write_tiny_clip

        cfg_path, _ = write_tiny_clip(osp.join(tmp, "small_clip"), config=SMALL_CLIP)
        s.model_opts = ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", cfg_path]
        s.base_classes, s.eval_classes, s.row_test_images = 10, 200, 500
        s.loader_per_class, s.loader_classes, s.cache_test_images = 8, 5, 40
    else:
        s.model_opts = ["MODEL.BACKBONE.NAME", "ViT-B/16"]
        if not cuda:
            s.cache_test_images = 48
    s.model_opts += ["MODEL.BACKBONE.PRETRAINED", "False"]
    unknown = [o for o in s.optims if o not in OPTIMIZERS]
    if unknown:
        raise SystemExit(f"--optims: unknown {unknown}; choose from {OPTIMIZERS}")
    return s


def device_description(device: str) -> str:
    if device == "cuda":
        name = torch.cuda.get_device_name(0)
        mem = torch.cuda.get_device_properties(0).total_memory / 2**30
        return f"cuda: {name} ({mem:.0f} GiB), torch {torch.__version__}"
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f if "model name" in ln), model)
    return f"cpu: {model}, {torch.get_num_threads()} threads, torch {torch.__version__}"


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------
@dataclass
class Timing:
    seconds: float  # median
    calls: int
    peak_bytes: int = 0  # CUDA: max over calls of the memory allocated above the start


class Timer:
    """Interleaved, synchronised timing of several callables (see the module docstring)."""

    def __init__(self, device: str, warmup: int, steps: int, budget_s: float, settle: int = 0):
        self.cuda = device == "cuda"
        self.warmup, self.steps, self.budget_s = warmup, steps, budget_s
        self.settle = settle  # untimed rounds before the warm-up, whatever the budget

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _call(self, fn: Callable[[], object]) -> tuple[float, int]:
        self._sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            start_bytes = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        fn()
        self._sync()
        elapsed = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() - start_bytes if self.cuda else 0
        return elapsed, peak

    def measure(self, fns: dict[str, Callable[[], object]]) -> dict[str, Timing]:
        for _ in range(self.settle):  # compiled paths: compilation and the checked first calls
            for fn in fns.values():
                self._call(fn)
        start = time.perf_counter()
        for i in range(self.warmup):
            if i and time.perf_counter() - start > self.budget_s:
                break
            for fn in fns.values():
                self._call(fn)
        times: dict[str, list[float]] = {k: [] for k in fns}
        peaks = dict.fromkeys(fns, 0)
        start = time.perf_counter()
        for _ in range(self.steps):
            for k, fn in fns.items():
                elapsed, peak = self._call(fn)
                times[k].append(elapsed)
                peaks[k] = max(peaks[k], peak)
            if time.perf_counter() - start > self.budget_s:
                break
        return {k: Timing(statistics.median(v), len(v), peaks[k]) for k, v in times.items()}


# ----------------------------------------------------------------------------------------------
# Trainers on synthetic data, and their reference style
# ----------------------------------------------------------------------------------------------
def reference_style(base: type) -> type:
    """``base`` with the reference code bases' step: the frozen work of ``prepare_step`` (image
    encoder, teacher features) is run inside ``compute_loss``, i.e. in every pass of a
    sharpness-aware optimizer. Results are identical (tests/test_performance.py); the class keeps
    ``base``'s name, which selects its ``TRAINER.<NAME>`` config node."""

    def prepare_step(self, batch_inputs):
        return batch_inputs

    def compute_loss(self, inputs):
        return base.compute_loss(self, base.prepare_step(self, inputs))

    methods = {"prepare_step": prepare_step, "compute_loss": compute_loss}
    return type(base.__name__, (base,), methods)


def on_synthetic_classes(base: type, classnames: list[str]) -> type:
    """``base`` without a dataset: ``build_data_loader`` only provides ``classnames``."""

    def build_data_loader(self):
        self.dm = SimpleNamespace(
            dataset=SimpleNamespace(classnames=list(classnames)),
            num_classes=len(classnames),
            cache_training_images=lambda: None,  # no images to decode
        )
        self.train_loader_x = self.val_loader = self.test_loader = None
        self.num_classes = len(classnames)
        self.num_source_domains = 1
        self.lab2cname = dict(enumerate(classnames))

    return type(base.__name__, (base,), {"build_data_loader": build_data_loader})


def trainer_config_file(trainer: str) -> str:
    """The trainer's base-to-new config (experiments/protocols.py)."""
    from experiments.protocols import trainer_cfgs

    cfg = trainer_cfgs(trainer)["base2new"]
    return osp.join(ROOT, "configs", "trainers", trainer, f"{cfg}.yaml")


def bench_cfg(trainer: str, optim_name: str, s: Settings, prec: str | None, out: str, *extra):
    """The merged config of a trainer's base-to-new config plus the paper's optimizer values
    (train.py's merge order), on the benchmark's random-weight CLIP."""
    import datasets  # noqa: F401  (registers the readers)
    import trainers  # noqa: F401  (registers the trainers)
    from engine.cli import build_parser, setup_cfg

    args = ["--trainer", trainer, "--output-dir", out, "--seed", "1"]
    args += ["--config-file", trainer_config_file(trainer)]
    opts = [*s.model_opts, "DATASET.NAME", DATASET, "USE_CUDA", str(s.device == "cuda")]
    opts += ["DATALOADER.NUM_WORKERS", str(s.workers), "MODEL.COMPILE", s.compile]
    if optim_name != "sgd":
        path = osp.join(ROOT, "configs", "optim", trainer, f"{optim_name}.yaml")
        args += ["--optim-config-file", path]
    node = f"TRAINER.{trainer.upper()}"
    if prec or s.device == "cpu":
        opts += [f"{node}.PREC", prec or "fp32"]  # fp16 weights are for GPUs
    if trainer == "CoPrompt":
        opts += [f"{node}.FALLBACK_TEMPLATES", "True"]  # no description files needed
    return setup_cfg(build_parser().parse_args(args + opts + list(extra)))


def build(cfg, classnames: list[str], reference: bool = False):
    """A registered trainer on synthetic classes, ready for ``forward_backward``; with
    ``reference`` its reference style (full-length prompts, frozen work in every pass, eager:
    the released code bases compile nothing)."""
    import trainers  # noqa: F401  (registers the trainers)
    from engine.registry import TRAINER_REGISTRY

    cls = on_synthetic_classes(TRAINER_REGISTRY.get(cfg.TRAINER.NAME), classnames)
    if reference:
        cls = reference_style(cls)
        cfg = eager_cfg(cfg, "MODEL.TEXT_FULL_LENGTH", "True")  # 77-token prompts
    tr = cls(cfg)
    tr.before_train()  # the engine's hook (e.g. CoPrompt's description features)
    tr.batch_idx = 0
    tr.epoch = tr.optim_step.staging.start_epoch  # the sharpness-aware stage (staged: stage 2)
    tr.before_epoch()  # seeds and the staged freeze
    tr.set_model_mode("train")
    return tr


def eager_cfg(cfg, *opts: str):
    """``cfg`` with MODEL.COMPILE off (and the ``KEY VALUE`` options ``opts``): the reference
    style, and the micro-benchmarks of one part (text truncation, evaluation, CoCoOp batching),
    where compiling only the project's side of a comparison would measure the compiler instead
    of the part."""
    cfg = cfg.clone()
    cfg.defrost()
    cfg.MODEL.COMPILE = "off"
    cfg.merge_from_list(list(opts))
    cfg.freeze()
    return cfg


def compile_seconds(tr) -> float | None:
    """Seconds of the first calls (compilation included) of ``tr``'s compiled encoders; None
    when nothing is compiled."""
    from engine.compile import compiled_forwards

    forwards = compiled_forwards(tr.model)
    if not forwards:
        return None
    return sum(sum(f.first_calls.values()) for f in forwards.values())


def synthetic_batch(cfg, n_cls: int, device: str, batch_size: int | None = None) -> dict:
    g = torch.Generator().manual_seed(0)
    b = batch_size or cfg.DATALOADER.TRAIN_X.BATCH_SIZE
    h, w = cfg.INPUT.SIZE
    views = [torch.randn(b, 3, h, w, generator=g) for _ in range(cfg.DATALOADER.K_TRANSFORMS)]
    label = torch.randint(n_cls, (b,), generator=g)
    if device == "cuda":  # as the loader delivers them
        views, label = [v.pin_memory() for v in views], label.pin_memory()
    return {"img": views[0] if len(views) == 1 else views, "label": label}


def resident_bytes(tr) -> int:
    """Bytes of the trainer's model tensors and optimizer state (each storage once)."""
    seen, total = set(), 0
    tensors = [*tr.model.parameters(), *tr.model.buffers()]
    for opt in tr._optims.values():
        for o in (opt, getattr(opt, "base_optimizer", None)):
            if o is not None:
                tensors += [v for st in o.state.values() for v in st.values() if torch.is_tensor(v)]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def step_fn(tr, batch, last: dict) -> Callable[[], None]:
    def run():
        last["out"] = tr.forward_backward(batch)

    return run


def check_finite(name: str, last: dict) -> bool:
    """Whether the last step's loss was finite (a warning otherwise: its timing is suspect)."""
    loss = last["out"]["loss"]
    finite = bool(torch.isfinite(loss))
    if not finite:
        logger.warning("%s: non-finite loss %s in the benchmark step", name, float(loss))
    return finite


# ----------------------------------------------------------------------------------------------
# Evaluation cost
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def eval_times(tr, ref, s: Settings, timer: Timer) -> tuple[dict[str, Timing], int, int]:
    """Per-call seconds of ``before_test`` and ``model_inference`` (project and reference) on
    ``per_call`` images; returns (timings, per_call, test batch)."""
    test_batch = tr.cfg.DATALOADER.TEST.BATCH_SIZE
    per_call = min(test_batch, s.eval_images_per_call or test_batch)
    h, w = tr.cfg.INPUT.SIZE
    images = torch.randn(per_call, 3, h, w, generator=torch.Generator().manual_seed(1))
    images = images.to(tr.device)

    def infer(t):
        def run():  # as SimpleTrainer.test: before_test outside autocast, compiled or not
            with t.compiled_batch(per_call, per_call, training=False), t.autocast():
                t.model_inference(images)

        return run

    def setup(t):
        def run():
            with t.compiled_batch(1, 1, training=False):
                t.before_test()

        return run

    for t in (tr, ref):
        t.set_model_mode("eval")
        setup(t)()
    try:
        fns = {"setup": setup(tr), "infer": infer(tr)}
        times = timer.measure({**fns, "ref_setup": setup(ref), "ref_infer": infer(ref)})
    finally:
        for t in (tr, ref):
            t.after_test()
            t.set_model_mode("train")
    return times, per_call, test_batch


def eval_seconds(times: dict[str, Timing], per_call: int, batch: int, n_images: int):
    """Seconds of one evaluation of ``n_images`` in batches of ``batch``: (project, reference)."""
    n_batches = math.ceil(n_images / batch)
    scale = batch / per_call
    project = times["setup"].seconds + n_batches * scale * times["infer"].seconds
    reference = n_batches * (times["ref_setup"].seconds + scale * times["ref_infer"].seconds)
    return project, reference


# ----------------------------------------------------------------------------------------------
# The trainer x optimizer matrix
# ----------------------------------------------------------------------------------------------
def measure_trainer(
    name: str, optims, s: Settings, timer: Timer, tmp: str, prec: str | None, keys: dict, rows
) -> None:
    """Append the rows of one trainer to ``rows``: a step per optimizer and its evaluation
    throughput (measured once), project and reference style; CoOp + SGD also times target 4's
    parts."""
    names = class_names(s.base_classes)
    eval_row = None
    for optim_name in optims:
        cfg = bench_cfg(name, optim_name, s, prec, osp.join(tmp, "out", name))
        tr, ref = build(cfg, names), build(cfg, names, reference=True)
        batch = synthetic_batch(cfg, len(names), s.device)
        last_p, last_r = {}, {}
        fns = {"project": step_fn(tr, batch, last_p), "reference": step_fn(ref, batch, last_r)}
        eager = build(eager_cfg(cfg), names) if tr.compile_mode else None
        if eager is not None:  # the compiled default against the same path run eagerly
            fns["eager"] = step_fn(eager, batch, {})
        parts = name == "CoOp" and optim_name == "sgd" and prec is None
        if parts:
            fns.update(coop_parts(tr, batch))
        times = timer.measure(fns)
        finite = check_finite(f"{name}+{optim_name}", last_p)
        finite &= check_finite(f"{name}+{optim_name} (reference)", last_r)
        if parts:
            parts_s = sum(times[k].seconds for k in ("image_fwd", "text_fwd_bwd", "update"))
            keys["step_over_parts"] = times["project"].seconds / parts_s
            logger.info("CoOp + SGD parts: %s", fmt_times(times))
        if eval_row is None:
            et, per_call, test_batch = eval_times(tr, ref, s, timer)
            ev_p, ev_r = eval_seconds(et, per_call, test_batch, s.row_test_images)
            eval_row = {
                "eval_images_per_s": s.row_test_images / ev_p,
                "ref_eval_images_per_s": s.row_test_images / ev_r,
                "eval_speedup_vs_reference": ev_r / ev_p,
                "eval_test_batch": test_batch,
                "eval_images_per_call": per_call,
            }
        pl = tr.model.prompt_learner
        row = {
            "trainer": name,
            "optimizer": optim_name,
            "base_optimizer": cfg.OPTIM.NAME,
            "prec": tr.prec,
            "batch": cfg.DATALOADER.TRAIN_X.BATCH_SIZE,
            "classes": len(names),
            "n_ctx": pl.n_ctx,
            "depth": getattr(pl, "depth", None),
            "text_tokens": prompt_length(pl),
            "ref_text_tokens": prompt_length(ref.model.prompt_learner),
            "step_ms": 1e3 * times["project"].seconds,
            "ref_step_ms": 1e3 * times["reference"].seconds,
            "step_speedup_vs_reference": times["reference"].seconds / times["project"].seconds,
            "compile": tr.compile_mode or "off",
            "eager_step_ms": 1e3 * times["eager"].seconds if eager is not None else None,
            "compile_s": compile_seconds(tr),
            "compile_fallback": "; ".join(
                f"{k}: {f.fallback}" for k, f in compiled_forwards(tr.model).items() if f.fallback
            ),
            "timed_steps": times["project"].calls,
            "finite_loss": finite,
            "peak_mem_mb": peak_mb(tr, times["project"], s),
            "ref_peak_mem_mb": peak_mb(ref, times["reference"], s),
            **eval_row,
            "eval_test_images": s.row_test_images,
        }
        rows.append(row)
        logger.info(
            "%s + %s (%s): step %.1f ms, reference %.1f ms",
            name,
            optim_name,
            row["prec"],
            row["step_ms"],
            row["ref_step_ms"],
        )
        release(*(t for t in (tr, ref, eager) if t is not None))


def prompt_length(prompt_learner) -> int:
    """Tokens per encoded prompt: [SOS] + context + the rest (cut, or all 77)."""
    pl = prompt_learner
    return int(pl.token_prefix.shape[1] + pl.n_ctx + pl.token_suffix.shape[1])


def release(*trainers) -> None:
    """Close what ``before_train`` opened (the trainers' scalar writers)."""
    for tr in trainers:
        tr.close_writer()


def peak_mb(tr, timing: Timing, s: Settings) -> float | None:
    if s.device != "cuda":
        return None
    return (resident_bytes(tr) + timing.peak_bytes) / 2**20


def coop_parts(tr, batch) -> dict[str, Callable[[], None]]:
    """Target 4's unavoidable parts of a CoOp step, each alone: the image encoder forward
    without gradients (the engine's ``prepare_step``, batch transfer included), the text encoder
    forward and backward at the truncated length, and the optimizer update."""
    weight = None

    def image_fwd():
        with torch.no_grad(), tr.autocast():
            tr.prepare_step(tr.parse_batch_train(batch))

    def text_fwd_bwd():
        nonlocal weight
        with tr.autocast():
            f = tr.model.encode_text().float()
        if weight is None:
            weight = torch.randn(f.shape, generator=torch.Generator().manual_seed(2)).to(f.device)
        (f * weight).sum().backward()

    return {"image_fwd": image_fwd, "text_fwd_bwd": text_fwd_bwd, "update": tr.optim.step}


def fmt_times(times: dict[str, Timing]) -> str:
    return ", ".join(f"{k} {1e3 * t.seconds:.1f} ms" for k, t in times.items())


# ----------------------------------------------------------------------------------------------
# The single-purpose measurements
# ----------------------------------------------------------------------------------------------
# The released code bases' CoOp step as issue 12 measured it on one H200 (fp16, random-weight
# ViT-B/16 at 224 px, 100 classes, batch 32, median step): the original CoOp (Dassl) with SGD and
# the SAMPLe authors' code with SAMPLe. Compared only on an H200 (another device has other times).
RELEASED_STEP_MS = {"sgd": 30.4, "sample": 44.8}
RELEASED_CLASSES = 100
RELEASED_DEVICE = "H200"


def sample_over_sgd(
    s: Settings, timer: Timer, tmp: str, keys: dict | None = None, n_cls: int | None = None
) -> float:
    """Target 2: CoOp + SAMPLe step over CoOp + SGD step, the two timed against each other (the
    matrix times each against its reference style). With ``keys``, also the two steps at
    ``n_cls`` classes against the released code's (:data:`RELEASED_STEP_MS`)."""
    names = class_names(n_cls or s.base_classes)
    steps, last, built = {}, {}, []
    for optim_name in ("sgd", "sample"):
        cfg = bench_cfg("CoOp", optim_name, s, None, osp.join(tmp, "out", "two_pass"))
        built.append(build(cfg, names))
        steps[optim_name] = step_fn(built[-1], synthetic_batch(cfg, len(names), s.device), last)
    times = timer.measure(steps)
    release(*built)
    check_finite("CoOp (SGD vs SAMPLe)", last)
    logger.info("CoOp steps, %d classes: %s", len(names), fmt_times(times))
    if keys is not None:
        on_anchor_device = RELEASED_DEVICE in device_description(s.device)
        for name in ("sgd", "sample"):
            ms = 1e3 * times[name].seconds
            keys[f"coop{len(names)}_{name}_step_ms"] = ms
            speedup = RELEASED_STEP_MS[name] / ms if on_anchor_device else None
            keys[f"{name}_speedup_vs_released_h200"] = speedup
    return times["sample"].seconds / times["sgd"].seconds


def text_truncation(s: Settings, timer: Timer, tmp: str) -> float:
    """Target 1: CoOp's text encoder forward + backward, n_ctx 4, ``text_classes`` classes."""
    names = class_names(s.text_classes)
    cfg = eager_cfg(bench_cfg("CoOp", "sgd", s, None, osp.join(tmp, "out", "text")))
    tr, ref = build(cfg, names), build(cfg, names, reference=True)
    with torch.no_grad(), tr.autocast():
        features = tr.model.encode_text()
        identical = torch.equal(features, ref.model.encode_text())
    if not identical:
        logger.warning("Truncated and full-length text features DIFFER")
    weight = torch.randn(features.shape, generator=torch.Generator().manual_seed(2))

    def fwd_bwd(t):
        def run():
            t.model.zero_grad(set_to_none=True)
            with t.autocast():
                f = t.model.encode_text().float()
            (f * weight.to(f.device)).sum().backward()

        return run

    times = timer.measure({"truncated": fwd_bwd(tr), "full_77": fwd_bwd(ref)})
    release(tr, ref)
    logger.info(
        "Text encoding, %d classes, n_ctx %d (fwd+bwd): %s; identical features: %s",
        len(names),
        tr.model.prompt_learner.n_ctx,
        fmt_times(times),
        identical,
    )
    return times["full_77"].seconds / times["truncated"].seconds


def imagenet_eval(s: Settings, timer: Timer, tmp: str) -> float:
    """Target 3b: CoOp evaluation at ImageNet scale (``eval_classes`` classes, test batch 100,
    ``eval_test_images`` images) against the reference, which re-encodes the class prompts for
    every batch."""
    names = class_names(s.eval_classes)
    cfg = eager_cfg(bench_cfg("CoOp", "sgd", s, None, osp.join(tmp, "out", "eval")))
    tr, ref = build(cfg, names), build(cfg, names, reference=True)
    times, per_call, batch = eval_times(tr, ref, s, timer)
    release(tr, ref)
    project, reference = eval_seconds(times, per_call, batch, s.eval_test_images)
    logger.info(
        "Evaluation, %d classes, %d images in batches of %d (per call on %d images: %s): "
        "project %.1f s, reference %.1f s",
        len(names),
        s.eval_test_images,
        batch,
        per_call,
        fmt_times(times),
        project,
        reference,
    )
    return reference / project


def cocoop_batching(s: Settings, timer: Timer, tmp: str) -> float:
    """Target 5: CoCoOp's batched (images x classes) text encoding against the per-image loop of
    CoCoOp's code (the project's ``encode_text`` on one image at a time), forward + backward of
    the cross-entropy, ``cocoop_batch`` images."""
    names = class_names(s.base_classes)
    cfg = eager_cfg(bench_cfg("CoCoOp", "sgd", s, None, osp.join(tmp, "out", "cocoop")))
    tr = build(cfg, names)
    model = tr.model
    batch = synthetic_batch(cfg, len(names), s.device, batch_size=s.cocoop_batch)
    with torch.no_grad(), tr.autocast():
        features, label = tr.prepare_step(tr.parse_batch_train(batch))

    def logits_batched():
        return model.logits(features, model.encode_text(features))

    def logits_loop():
        return torch.cat(
            [model.logits(f, model.encode_text(f)) for f in features.split(1)]
        )  # [batch, n_cls]

    def step(logits_fn):
        def run():
            model.zero_grad(set_to_none=True)
            with tr.autocast():
                logits = logits_fn()
            F.cross_entropy(logits.float(), label).backward()

        return run

    with torch.no_grad(), tr.autocast():
        diff = (logits_batched().float() - logits_loop().float()).abs().max().item()
    times = timer.measure({"batched": step(logits_batched), "per_image_loop": step(logits_loop)})
    release(tr)
    logger.info(
        "CoCoOp text encoding, %d images x %d classes (fwd+bwd): %s; max |logit difference| %.2g",
        s.cocoop_batch,
        len(names),
        fmt_times(times),
        diff,
    )
    return times["per_image_loop"].seconds / times["batched"].seconds


# ----------------------------------------------------------------------------------------------
# Data pipeline: a dataset of real-size JPEGs
# ----------------------------------------------------------------------------------------------
def make_jpeg_dataset(root: str, s: Settings) -> str:
    """A DTD-layout dataset of ~500x375 JPEGs with a split file: ``loader_per_class`` training
    images per class and ``cache_test_images`` test entries (cycling over the files)."""
    from PIL import Image

    from engine.utils import write_json

    rng = np.random.default_rng(0)
    image_dir = osp.join(root, "dtd", "images")
    train = []
    for label in range(s.loader_classes):
        cname = f"class{label}"
        os.makedirs(osp.join(image_dir, cname), exist_ok=True)
        for i in range(s.loader_per_class):
            low = rng.uniform(0, 255, (6, 8, 3)).astype(np.uint8)  # smooth colour field + noise
            img = np.asarray(Image.fromarray(low).resize((500, 375), Image.BICUBIC), np.float32)
            img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
            rel = f"{cname}/{cname}_{i:03d}.jpg"
            Image.fromarray(img).save(osp.join(image_dir, rel), quality=90)
            train.append([rel, label, cname])
    test = [train[i % len(train)] for i in range(s.cache_test_images)]
    split = {"train": train, "val": train[: s.loader_classes], "test": test}
    write_json(split, osp.join(root, "dtd", "split_zhou_DescribableTextures.json"))
    return root


def data_cfg(s: Settings, root: str, out: str, *extra):
    import datasets  # noqa: F401  (registers the readers)
    import trainers  # noqa: F401  (registers the trainers)
    from engine.cli import build_parser, setup_cfg

    args = ["--root", root, "--trainer", "CoOp", "--output-dir", out, "--seed", "1"]
    args += ["--dataset-config-file", osp.join(ROOT, "configs", "datasets", "dtd.yaml")]
    args += ["--config-file", trainer_config_file("CoOp")]
    opts = [*s.model_opts, "USE_CUDA", str(s.device == "cuda")]
    opts += ["DATASET.NUM_SHOTS", str(s.loader_per_class), "DATALOADER.NUM_WORKERS", str(s.workers)]
    if s.device == "cpu":
        opts += ["TRAINER.COOP.PREC", "fp32"]
    return setup_cfg(build_parser().parse_args(args + opts + list(extra)))


def loader_throughput(s: Settings, timer: Timer, root: str, tmp: str, keys: dict) -> float:
    """Target 6: training-loader throughput (CoOp's transforms) with decoded images cached in
    memory against decoding every epoch; ``keys["loader_images_per_s"]``: the cached loader's
    images per second."""
    from engine.data import DataManager

    loaders, epoch = {}, [0]
    for name, cached in (("decode_each_epoch", "False"), ("decoded_cache", "True")):
        cfg = data_cfg(s, root, osp.join(tmp, "out", "loader"), "DATALOADER.CACHE_DECODED", cached)
        dm = DataManager(cfg)
        dm.cache_training_images()  # what the trainer does when training starts
        loaders[name] = dm.train_loader_x

    def one_epoch(loader):
        def run():
            epoch[0] += 1
            loader.sampler.set_epoch(epoch[0])
            for _ in loader:
                pass

        return run

    times = timer.measure({k: one_epoch(v) for k, v in loaders.items()})
    n = len(loaders["decoded_cache"].dataset)
    keys["loader_images_per_s"] = n / times["decoded_cache"].seconds
    logger.info(
        "Training loader, %d JPEGs of 500x375, %d workers: %s",
        n,
        s.workers,
        ", ".join(f"{k} {n / t.seconds:.1f} images/s" for k, t in times.items()),
    )
    return times["decode_each_epoch"].seconds / times["decoded_cache"].seconds


def feature_cache_eval(s: Settings, root: str, tmp: str) -> float:
    """Target 7: ``trainer.test()`` of a fresh CoOp trainer, first run (features computed and
    cached) against a second run (a new trainer on the same data: features loaded)."""
    from engine import build_trainer

    cache_dir = osp.join(tmp, "feature_cache")
    cfg = data_cfg(s, root, osp.join(tmp, "out", "cache"), "TEST.FEATURE_CACHE_DIR", cache_dir)
    seconds, accuracies = [], []
    for _ in range(2):
        tr = build_trainer(cfg)
        if s.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        accuracies.append(tr.test())
        seconds.append(time.perf_counter() - t0)
        tr.close_writer()
        del tr
    if accuracies[0] != accuracies[1]:
        logger.warning("Cached evaluation features gave another accuracy: %s", accuracies)
    logger.info(
        "Evaluation of %d images: first run %.2f s, second run (cached features) %.2f s",
        s.cache_test_images,
        *seconds,
    )
    return seconds[0] / seconds[1]


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------
def target_status(key: str, value: float | None) -> str:
    if value is None:
        return "not measured"
    op, bound = TARGETS[key]
    ok = value >= bound if op == ">=" else value <= bound
    return f"{'reached' if ok else 'NOT reached'} (target {op} {bound})"


def print_report(result: dict) -> None:
    from tabulate import tabulate

    cols = [
        "trainer",
        "optimizer",
        "prec",
        "batch",
        "text_tokens",
        "step_ms",
        "ref_step_ms",
        "step_speedup_vs_reference",
        "compile",
        "eager_step_ms",
        "compile_s",
        "peak_mem_mb",
        "eval_images_per_s",
        "eval_speedup_vs_reference",
    ]
    rows = [[r[c] for c in cols] for r in result["rows"]]
    print(f"\nDevice: {result['device']}")
    print(tabulate(rows, headers=[c.replace("_", " ") for c in cols], floatfmt=".2f"))
    print()
    for key in TARGETS:
        value = result.get(key)
        shown = "n/a" if value is None else f"{value:.2f}"
        print(f"{key:32s} {shown:>8s}  {target_status(key, value)}")
    for key in ("loader_images_per_s", "step_demand_images_per_s"):
        if result.get(key) is not None:
            print(f"{key:32s} {result[key]:8.0f}")
    n = RELEASED_CLASSES
    if result.get(f"coop{n}_sgd_step_ms") is not None:
        for name in ("sgd", "sample"):
            speedup = result.get(f"{name}_speedup_vs_released_h200")
            vs = f"{speedup:.2f}x" if speedup is not None else f"n/a (not an {RELEASED_DEVICE})"
            print(
                f"CoOp {name} step, {n} classes: {result[f'coop{n}_{name}_step_ms']:.1f} ms; vs "
                f"the released code's {RELEASED_STEP_MS[name]} ms on an H200: {vs}"
            )


def run(args) -> tuple[dict, list[str]]:
    """Every measurement of ``args``: (the JSON result, the names of failed measurements)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available (use --device cpu)")
    import trainers  # noqa: F401
    from engine.registry import TRAINER_REGISTRY

    tmp = tempfile.mkdtemp(prefix="sample-pl-bench-")
    try:
        s = make_settings(args, tmp)
        settle = CHECKED_CALLS if resolve_compile(s.compile, s.device) else 0
        timer = Timer(s.device, s.warmup, s.steps, s.budget_s, settle)
        registered = [t for t in s.trainers if t in TRAINER_REGISTRY]
        for t in s.trainers:
            if t not in TRAINER_REGISTRY:
                logger.warning("Trainer %s is not registered: skipped", t)
        logger.info("Settings: %s", s)
        keys: dict[str, float | None] = dict.fromkeys(TARGETS)
        failed: list[str] = []
        rows: list[dict] = []
        device = device_description(s.device)

        def guarded(what: str, fn: Callable[[], object]) -> None:
            """Run one measurement (``what``: its JSON key, or a name); a failure is reported
            and the run goes on. The JSON file is rewritten after each measurement, so an
            interrupted run leaves what it measured."""
            try:
                value = fn()
                if what in keys:
                    keys[what] = value
            except Exception:
                logger.exception("%s FAILED (the other measurements go on)", what)
                failed.append(what)
            if args.json:
                write_json(args.json, {**keys, "rows": rows, "device": device})

        guarded("text_trunc_speedup", partial(text_truncation, s, timer, tmp))
        for name in registered:  # each trainer in its own precision
            guarded(name, partial(measure_trainer, name, s.optims, s, timer, tmp, None, keys, rows))
        coop = {r["optimizer"]: r for r in rows if r["trainer"] == "CoOp"}
        if "sgd" in coop:
            keys["sgd_speedup_vs_reference"] = coop["sgd"]["step_speedup_vs_reference"]
            if s.device == "cuda":  # a GPU target (its batch 32, 50 classes, the config's fp16)
                keys["coop_sgd_step_ms"] = coop["sgd"]["step_ms"]
        sample_rows = [
            r for r in rows if r["optimizer"] == "sample" and r["trainer"] in SAMPLE_VS_REFERENCE
        ]
        if sample_rows:
            keys["sample_speedup_vs_reference_min"] = min(
                r["step_speedup_vs_reference"] for r in sample_rows
            )
        if "CoOp" in registered:
            own = bench_cfg("CoOp", "sgd", s, None, osp.join(tmp, "out", "CoOp")).TRAINER.COOP.PREC
            optims = [o for o in s.optims if o in ("sgd", "sample")]
            for prec in s.precisions:  # the precision sweep: CoOp with SGD and SAMPLe
                if prec != own:
                    sweep = (measure_trainer, "CoOp", optims, s, timer, tmp, prec, keys, rows)
                    guarded(f"CoOp in {prec}", partial(*sweep))
            guarded("sample_over_sgd_step", partial(sample_over_sgd, s, timer, tmp))
            released = partial(sample_over_sgd, s, timer, tmp, keys, RELEASED_CLASSES)
            guarded("released code anchors", released)
            guarded("eval_speedup_vs_reference", partial(imagenet_eval, s, timer, tmp))
        if "CoCoOp" in TRAINER_REGISTRY:
            guarded("cocoop_batched_speedup", partial(cocoop_batching, s, timer, tmp))
        root = make_jpeg_dataset(osp.join(tmp, "data"), s)
        loader = partial(loader_throughput, s, timer, root, tmp, keys)
        guarded("decoded_cache_loader_speedup", loader)
        if keys.get("loader_images_per_s") and "sgd" in coop:  # the step's demand, images/s
            demand = coop["sgd"]["batch"] / (coop["sgd"]["step_ms"] / 1e3)
            keys["step_demand_images_per_s"] = demand
            keys["loader_over_step_demand"] = keys["loader_images_per_s"] / demand
        guarded("eval_feature_cache_speedup", partial(feature_cache_eval, s, root, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {**keys, "rows": rows, "device": device}, failed


def write_json(path: str, result: dict) -> None:
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
