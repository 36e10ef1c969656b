"""Checks of the data-side config values (DATASET.*, DATALOADER.*, INPUT.*), by key name.

The config merge already rejects unknown keys and wrong types; this checks the values, so that
``DATALOADER.NUM_WORKERS -1`` or ``DATALOADER.TRAIN_X.BATCH_SIZE 0`` stop at start-up with a
message naming the key instead of failing deep inside PyTorch.
"""

from __future__ import annotations

import logging

from engine.errors import ConfigError

logger = logging.getLogger(__name__)

SAMPLERS = ("RandomSampler", "SequentialSampler")
SUBSAMPLES = ("all", "base", "new")
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
PIPELINES = ("pil", "tensor", "tensor_device")  # INPUT.PIPELINE (engine/data/transforms.py)
PIPELINES_HELP = (
    "pil: Dassl's PIL operations, exact; tensor: uint8 tensors normalised on the device; "
    "tensor_device: tensor with the random resized crop's resize on the device"
)


def is_template(text: str) -> bool:
    """A prompt template: one ``{}`` (the class name) and no other braces."""
    return text.count("{}") == 1 and not any(c in text.replace("{}", "") for c in "{}")


def _problems(cfg) -> list[str]:
    d, dl, inp = cfg.DATASET, cfg.DATALOADER, cfg.INPUT
    out = []

    def need(ok: bool, key: str, value, rule: str) -> None:
        if not ok:
            out.append(f"{key} must be {rule}, got {value!r}")

    need(dl.NUM_WORKERS >= 0, "DATALOADER.NUM_WORKERS", dl.NUM_WORKERS, ">= 0 (0: main process)")
    need(dl.K_TRANSFORMS >= 1, "DATALOADER.K_TRANSFORMS", dl.K_TRANSFORMS, ">= 1")
    need(dl.CACHE_DECODED_MB >= 0, "DATALOADER.CACHE_DECODED_MB", dl.CACHE_DECODED_MB, ">= 0")
    for node in ("TRAIN_X", "TEST"):
        batch, sampler = dl[node].BATCH_SIZE, dl[node].SAMPLER
        need(batch >= 1, f"DATALOADER.{node}.BATCH_SIZE", batch, ">= 1")
        need(sampler in SAMPLERS, f"DATALOADER.{node}.SAMPLER", sampler, f"one of {SAMPLERS}")
    need(
        d.NUM_SHOTS >= -1,
        "DATASET.NUM_SHOTS",
        d.NUM_SHOTS,
        "a number of images per class, or -1 for all images",
    )
    need(d.NUM_LABELED >= -1, "DATASET.NUM_LABELED", d.NUM_LABELED, ">= 0, or -1 for all")
    need(0 <= d.VAL_PERCENT < 1, "DATASET.VAL_PERCENT", d.VAL_PERCENT, "in [0, 1)")
    if d.VAL_PERCENT != 0.1:  # Dassl's default; no reader of this project reads the key
        logger.warning(
            "DATASET.VAL_PERCENT %s has no effect: every reader takes its validation set from "
            "the dataset's split file (CoOp's split_zhou_*.json or the generated one)",
            d.VAL_PERCENT,
        )
    need(
        d.SUBSAMPLE_CLASSES in SUBSAMPLES,
        "DATASET.SUBSAMPLE_CLASSES",
        d.SUBSAMPLE_CLASSES,
        f"one of {SUBSAMPLES}",
    )
    need(
        not d.TEMPLATE or is_template(d.TEMPLATE),
        "DATASET.TEMPLATE",
        d.TEMPLATE,
        'empty or a text with one "{}" for the class name, e.g. "a photo of a {}, a type of bird."',
    )
    size = tuple(inp.SIZE)
    need(
        len(size) == 2 and all(isinstance(v, int) and v >= 1 for v in size),
        "INPUT.SIZE",
        size,
        "(height, width) in pixels, both >= 1",
    )
    need(
        inp.INTERPOLATION in INTERPOLATIONS,
        "INPUT.INTERPOLATION",
        inp.INTERPOLATION,
        f"one of {INTERPOLATIONS}",
    )
    pipeline = inp.get("PIPELINE", "pil")
    need(
        pipeline in PIPELINES,
        "INPUT.PIPELINE",
        pipeline,
        f"one of {PIPELINES} ({PIPELINES_HELP})",
    )
    if pipeline == "tensor_device" and not inp.NO_TRANSFORM:
        from .device_crop import device_crop_problem

        problem = device_crop_problem(inp.TRANSFORMS)
        if problem:
            out.append(problem)
    need(len(inp.PIXEL_MEAN) == 3, "INPUT.PIXEL_MEAN", inp.PIXEL_MEAN, "3 values (R, G, B)")
    need(
        len(inp.PIXEL_STD) == 3 and all(v > 0 for v in inp.PIXEL_STD),
        "INPUT.PIXEL_STD",
        inp.PIXEL_STD,
        "3 values (R, G, B), all > 0",
    )
    scale = tuple(inp.RRCROP_SCALE)
    need(
        len(scale) == 2 and 0 < scale[0] <= scale[1] <= 1,
        "INPUT.RRCROP_SCALE",
        scale,
        "(min, max) area fractions with 0 < min <= max <= 1",
    )
    return out


def validate_data_cfg(cfg) -> None:
    """Raise :class:`ConfigError` naming every data-side key whose value is invalid."""
    problems = _problems(cfg)
    if problems:
        raise ConfigError("Invalid config value(s): " + "; ".join(problems) + ".")
