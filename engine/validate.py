"""Value checks of the engine's OPTIM/TRAIN/TEST keys (and MODEL.TEXT_CHUNK), run first.

Types are checked when configs are merged (:mod:`engine.config`); this module checks values:
ranges and choices, each failure a :class:`~engine.errors.ConfigError` naming the key, the value
and what is allowed. Trainers check their own ``TRAINER.<NODE>`` keys in ``check_cfg``; the data
keys (``DATASET``/``DATALOADER``/``INPUT``) are checked by the data side.
"""

from __future__ import annotations

from .errors import ConfigError

_FP32_MAX = 3.4028234663852886e38  # the largest float32: a larger LR overflows in the step
_POS = f"a number > 0 and <= {_FP32_MAX:.3g} (the float32 range)"
_NONNEG = f"a number >= 0 and <= {_FP32_MAX:.3g} (the float32 range)"

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
    ("OPTIM.SAM.RHO", lambda v: 0 <= v <= _FP32_MAX, _NONNEG),
    ("OPTIM.SAM.ALPHA", lambda v: 0 <= v <= _FP32_MAX, _NONNEG),
    ("OPTIM.SAM.LAMBDA", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    ("OPTIM.SAM.START_EPOCH", lambda v: v >= 0, "an integer >= 0"),
    ("MODEL.TEXT_CHUNK", lambda v: v >= 0, "an integer >= 0 (class prompts per chunk; 0: all)"),
    ("OPTIM.SAM.EVERY", lambda v: v >= 0, "an integer >= 0 (0: the optimizer's own k)"),
    ("OPTIM.SAM.LOOK_ALPHA", lambda v: 0 <= v <= _FP32_MAX, _NONNEG),
    ("OPTIM.SAM.BETA", lambda v: 0 < v <= 1, "a number in (0, 1]"),
    ("OPTIM.SAM.GAMMA", lambda v: 0 < v <= 1, "a number in (0, 1]"),
    ("OPTIM.SAM.NOISE", lambda v: 0 <= v <= _FP32_MAX, _NONNEG),
    ("OPTIM.SAM.MIX", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    ("OPTIM.SAM.TEMPERATURE", lambda v: 0 < v <= _FP32_MAX, _POS),
    ("OPTIM.SAM.TRAJ_START", lambda v: v >= 0, "an integer >= 0"),
    ("OPTIM.SAM.EPOCHS_BACK", lambda v: v >= 1, "an integer >= 1"),
    ("OPTIM.SAM.EMA_DECAY", lambda v: 0 <= v < 1, "a number in [0, 1)"),
    ("TRAIN.PRINT_FREQ", lambda v: v >= 1, "an integer >= 1 (batches between progress lines)"),
    ("TRAIN.CHECKPOINT_FREQ", lambda v: v >= 0, "an integer >= 0 (0: the last epoch only)"),
)


def _choices() -> tuple:
    """(key, allowed values) of the choice keys (imported lazily: optim imports are heavy)."""
    from optim.lr_scheduler import AVAI_SCHEDS
    from optim.sharpness import SCHEDULES, VARIANTS

    return (
        ("OPTIM.LR_SCHEDULER", AVAI_SCHEDS),
        ("OPTIM.WARMUP_TYPE", ("constant", "linear")),
        ("OPTIM.SAM.VARIANT", VARIANTS),
        ("OPTIM.SAM.SCHEDULE", SCHEDULES),
        ("OPTIM.SAM.SELECT_PASS", ("subset", "masked")),
        ("TEST.FINAL_MODEL", ("last_step", "best_val")),
        ("TEST.SPLIT", ("test", "val")),
    )


def _get(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def validate_cfg(cfg) -> None:
    """Raise :class:`ConfigError` for the first invalid OPTIM/TRAIN/TEST value (names the key)."""
    for key, ok, allowed in _RANGES:
        value = _get(cfg, key)
        if not ok(value):
            raise ConfigError(f"Config key {key} must be {allowed}, got {value!r}")
    for key, allowed in _choices():
        value = _get(cfg, key)
        if value not in allowed:
            import difflib

            close = difflib.get_close_matches(str(value), allowed, n=1)
            hint = f" (do you mean {close[0]}?)" if close else ""
            raise ConfigError(
                f"Config key {key} must be one of {', '.join(allowed)}; got {value!r}{hint}"
            )
