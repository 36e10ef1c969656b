"""Peak memory of one training step per trainer at 100 and 1,000 classes (``--memory`` of
``tools/benchmark.py``), plain and with the text-memory options (``MODEL.TEXT_CHUNK``,
``MODEL.CHECKPOINT_TEXT``, ``MODEL.SHARED_PREFIX``): ``torch.cuda.max_memory_allocated`` on a GPU,
engine.memory's tensor accounting on CPU (docs/backbones.md has the table); each row also has
the step's time (median of MEMORY_TIMED_STEPS steps after the measured one; process CPU time on
CPU, so rows of one run compare)::

    python tools/benchmark.py --memory --small --device cpu --json docs/benchmarks/cpu_memory.json
"""

from __future__ import annotations

import logging
import os.path as osp
import shutil
import statistics
import tempfile

import torch

from experiments.benchmark_efficient import efficient_measure
from experiments.benchmark_steps import (
    TRAINERS,
    Settings,
    bench_cfg,
    build,
    check_finite,
    class_names,
    device_description,
    eager_cfg,
    make_settings,
    release,
    resident_bytes,
    step_fn,
    synthetic_batch,
    write_json,
)

logger = logging.getLogger("benchmark")

MEMORY_TRAINERS = ("CoOp", "KgCoOp", "TCP", "CoCoOp", "MaPLe", "PromptSRC")
MEMORY_CLASSES = (100, 1000)
MEMORY_CHUNK = 50  # classes per chunk of the rows with the memory options (--memory-chunk)
# (MODEL.TEXT_CHUNK, MODEL.CHECKPOINT_TEXT, MODEL.SHARED_PREFIX) of each measured variant;
# None: --memory-chunk
MEMORY_VARIANTS = {
    "plain": (0, False, False),
    "chunks": (None, False, False),
    "checkpointed chunks": (None, True, False),
    "shared prefix": (0, False, True),
    "shared prefix + checkpointed chunks": (None, True, True),
}
MEMORY_TIMED_STEPS = 3
MEMORY_MEASURE = {
    "cuda": "torch.cuda.max_memory_allocated during the step, above the allocation before it",
    "cpu": "tensor accounting (engine.memory.TensorMemory): the largest sum of live tensor "
    "storages created during the step (forward, backward, recomputation, update)",
}


def memory_row(
    trainer: str, n_cls: int, variant: str, s: Settings, tmp: str, chunk_size: int = MEMORY_CHUNK
) -> dict:
    """The peak memory of one training step (SGD, the trainer's base-to-new config and batch,
    its precision on a GPU, fp32 on CPU, eager) on ``n_cls`` synthetic classes: ``step_mb``
    (activations and temporaries, :func:`engine.memory.peak_bytes`) and ``resident_mb`` (the
    model's tensors and the optimizer state, :func:`resident_bytes`); their sum is the step's
    total."""
    from engine.memory import peak_bytes

    chunk, checkpoint, shared = MEMORY_VARIANTS[variant]
    chunk = chunk_size if chunk is None else chunk
    extra = ("MODEL.TEXT_CHUNK", str(chunk), "MODEL.CHECKPOINT_TEXT", str(checkpoint))
    extra += ("MODEL.SHARED_PREFIX", str(shared))
    out = osp.join(tmp, "out", f"{trainer}_memory")
    cfg = eager_cfg(bench_cfg(trainer, "sgd", s, None, out, *extra))
    tr = build(cfg, class_names(n_cls))
    batch = synthetic_batch(cfg, n_cls, s.device)
    last: dict = {}
    step_fn(tr, batch, last)()  # the first step creates the optimizer's state (resident)
    step = peak_bytes(step_fn(tr, batch, last), s.device)
    resident = resident_bytes(tr)
    cuda = s.device == "cuda"
    wall, cpu = efficient_measure({"step": step_fn(tr, batch, last)}, MEMORY_TIMED_STEPS, 0, cuda)
    step_s = statistics.median((wall if cuda else cpu)["step"])  # process CPU time on CPU
    row = {
        "trainer": trainer,
        "classes": n_cls,
        "variant": variant,
        "text_chunk": chunk,
        "checkpoint_text": checkpoint,
        "shared_prefix": shared,
        "prec": tr.prec,
        "batch": cfg.DATALOADER.TRAIN_X.BATCH_SIZE,
        "step_mb": step / 2**20,
        "resident_mb": resident / 2**20,
        "total_mb": (step + resident) / 2**20,
        "step_ms": 1e3 * step_s,
        "finite_loss": check_finite(f"{trainer} ({variant}, {n_cls} classes)", last),
    }
    release(tr)
    del tr, last
    if s.device == "cuda":
        torch.cuda.empty_cache()
    return row


def memory_report(args) -> tuple[dict, list[str]]:
    """Every ``--trainers`` trainer that :data:`MEMORY_TRAINERS` lists, at ``--memory-classes``,
    in each of :data:`MEMORY_VARIANTS`: the JSON result and the failed measurements."""
    import trainers  # noqa: F401
    from engine.registry import TRAINER_REGISTRY

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available (use --device cpu)")
    classes = [int(c) for c in args.memory_classes.split(",")]
    unknown = set(args.memory_variants.split(",")) - set(MEMORY_VARIANTS)
    if unknown:
        raise SystemExit(f"--memory-variants: unknown {sorted(unknown)}; of {MEMORY_VARIANTS}")
    asked = args.trainers.split(",") if args.trainers != ",".join(TRAINERS) else MEMORY_TRAINERS
    tmp = tempfile.mkdtemp(prefix="sample-pl-memory-")
    rows: list[dict] = []
    failed: list[str] = []
    try:
        s = make_settings(args, tmp)
        backbone = "SMALL_CLIP (tools/benchmark.py)" if s.small else "ViT-B/16"
        result = {
            "device": device_description(s.device),
            "backbone": backbone + ", random weights",
            "measure": MEMORY_MEASURE[s.device],
            "rows": rows,
        }
        for trainer in asked:
            if trainer not in TRAINER_REGISTRY:
                logger.warning("Trainer %s is not registered: skipped", trainer)
                continue
            for n_cls in classes:
                for variant in args.memory_variants.split(","):
                    what = f"{trainer} {variant} {n_cls}"
                    try:
                        row = memory_row(trainer, n_cls, variant, s, tmp, args.memory_chunk)
                        rows.append(row)
                        logger.info("%s: %.1f MiB", what, rows[-1]["total_mb"])
                    except Exception:
                        logger.exception("%s FAILED (the other measurements go on)", what)
                        failed.append(what)
                    if args.json:
                        write_json(args.json, result)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result, failed


def print_memory_report(result: dict) -> None:
    from tabulate import tabulate

    cols = ["trainer", "classes", "variant", "prec", "batch", "step_mb", "resident_mb", "total_mb"]
    cols.append("step_ms")
    print(f"\nDevice: {result['device']}; backbone: {result['backbone']}")
    print(f"Measure: {result['measure']}")
    rows = [[r[c] for c in cols] for r in result["rows"]]
    print(tabulate(rows, headers=[c.replace("_", " ") for c in cols], floatfmt=".1f"))
