"""Value checks of the engine's OPTIM/TRAIN/TEST keys (and MODEL.TEXT_CHUNK), run first.

The ``OPTIM.SAM`` hyper-parameters are checked from their declarations in optim/
(:class:`optim.build.HParam`: range or choices, next to each optimizer).

Types are checked when configs are merged (:mod:`engine.config`); this module checks values:
ranges and choices, each failure a :class:`~engine.errors.ConfigError` naming the key, the value
and what is allowed. Trainers check their own ``TRAINER.<NODE>`` keys in ``check_cfg``; the data
keys (``DATASET``/``DATALOADER``/``INPUT``) are checked by the data side.
"""

from __future__ import annotations

from optim.hparams import FP32_MAX as _FP32_MAX  # a larger LR overflows in the step
from optim.hparams import NONNEG as _NONNEG
from optim.hparams import POS as _POS

from .errors import ConfigError

# (key, test, what is allowed): numbers
_RANGES = (
    ("OPTIM.MAX_EPOCH", lambda v: v >= 1, "an integer >= 1"),
    ("OPTIM.LR", lambda v: 0 < v <= _FP32_MAX, _POS),
    ("OPTIM.WEIGHT_DECAY", lambda v: 0 <= v <= _FP32_MAX, _NONNEG),
    ("OPTIM.MOMENTUM", lambda v: 0 <= v < 1, "a number in [0, 1)"),
    ("OPTIM.GAMMA", lambda v: 0 < v <= _FP32_MAX, _POS),
    ("OPTIM.ADAM_BETA1", lambda v: 0 <= v < 1, "a number in [0, 1)"),
    ("OPTIM.ADAM_BETA2", lambda v: 0 <= v < 1, "a number in [0, 1)"),
    ("OPTIM.ADAM_EPS", lambda v: 0 < v <= _FP32_MAX, _POS),
    ("OPTIM.WARMUP_CONS_LR", lambda v: 0 <= v <= _FP32_MAX, _NONNEG),
    ("OPTIM.WARMUP_MIN_LR", lambda v: 0 <= v <= _FP32_MAX, _NONNEG),
    ("OPTIM.SAM.START_EPOCH", lambda v: v >= 0, "an integer >= 0"),
    ("MODEL.TEXT_CHUNK", lambda v: v >= 0, "an integer >= 0 (class prompts per chunk; 0: all)"),
    ("TRAIN.PRINT_FREQ", lambda v: v >= 1, "an integer >= 1 (batches between progress lines)"),
    ("TRAIN.CHECKPOINT_FREQ", lambda v: v >= 0, "an integer >= 0 (0: the last epoch only)"),
)


def _choices() -> tuple:
    """(key, allowed values) of the choice keys (imported lazily: optim imports are heavy)."""
    from optim.lr_scheduler import AVAI_SCHEDS

    return (
        ("OPTIM.LR_SCHEDULER", AVAI_SCHEDS),
        ("OPTIM.WARMUP_TYPE", ("constant", "linear")),
        ("TEST.FINAL_MODEL", ("last_step", "best_val")),
        ("TEST.SPLIT", ("test", "val")),
    )


def _get(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _hparam_checks(cfg) -> tuple[list, list]:
    """The range and choice checks of the declared OPTIM.SAM hyper-parameters (optim/)."""
    from optim.build import sam_hparams

    ranges, choices = [], []
    for h in sam_hparams():
        key = f"OPTIM.SAM.{h.key}"
        if key not in {k for k, _, _ in _RANGES} and h.key in cfg.OPTIM.SAM:
            if h.choices:
                choices.append((key, tuple(h.choices)))
            elif h.valid is not None:
                ranges.append((key, h.valid, h.allowed))
    return ranges, choices


def validate_cfg(cfg) -> None:
    """Raise :class:`ConfigError` for the first invalid OPTIM/TRAIN/TEST value (names the key)."""
    hparam_ranges, hparam_choices = _hparam_checks(cfg)
    for key, ok, allowed in (*_RANGES, *hparam_ranges):
        value = _get(cfg, key)
        if not ok(value):
            raise ConfigError(f"Config key {key} must be {allowed}, got {value!r}")
    for key, allowed in (*_choices(), *hparam_choices):
        value = _get(cfg, key)
        if value not in allowed:
            import difflib

            close = difflib.get_close_matches(str(value), allowed, n=1)
            hint = f" (do you mean {close[0]}?)" if close else ""
            raise ConfigError(
                f"Config key {key} must be one of {', '.join(allowed)}; got {value!r}{hint}"
            )
