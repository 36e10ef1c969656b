"""The declaration of an optimizer hyper-parameter (``OPTIM.SAM.<key>``): :class:`HParam`.

Each sharpness-aware optimizer declares its hyper-parameters once, next to its class
(``optim/<name>.py``): the config key, the constructor keyword, the default, one line of help
and the allowed range or values. The config's ``OPTIM.SAM`` node gains the keys with their
defaults (:func:`optim.build.add_optimizer_keys`), ``engine/validate.py`` checks the values
against the ranges, and the constructors check their arguments with :meth:`HParam.check`. This
module imports nothing heavy (the config checks read it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FP32_MAX = 3.4028234663852886e38  # the largest float32: a larger value overflows in the step
NONNEG = f"a number >= 0 and <= {FP32_MAX:.3g} (the float32 range)"
POS = f"a number > 0 and <= {FP32_MAX:.3g} (the float32 range)"


def nonneg(v) -> bool:
    return 0 <= v <= FP32_MAX


def positive(v) -> bool:
    return 0 < v <= FP32_MAX


@dataclass(frozen=True)
class HParam:
    """An ``OPTIM.SAM.<key>`` hyper-parameter passed to a sharpness-aware constructor, declared
    once next to the optimizer that introduced it (:func:`declare_hparam`): the config key and
    its default come from here (:func:`add_optimizer_keys`), and so do its check
    (engine.validate) and the constructor's (:meth:`check`).

    Attributes:
        key: the config key under OPTIM.SAM.
        kwarg: the constructor keyword.
        default: the config default (its type is the key's type).
        help: one line: what it is, its unit and allowed values (the config's comment).
        valid: the range test of a number (None: any value of the type).
        allowed: what ``valid`` accepts, in words (for messages).
        choices: the allowed values of a choice key (empty: not a choice key).
    """

    key: str
    kwarg: str
    default: Any
    help: str
    valid: Callable[[Any], bool] | None = field(default=None, compare=False)
    allowed: str = ""
    choices: tuple = ()

    def problem(self, value) -> str | None:
        """What is wrong with ``value`` (None: it is allowed)."""
        if self.choices and value not in self.choices:
            return f"one of {', '.join(map(str, self.choices))}"
        if self.valid is not None and not self.valid(value):
            return self.allowed
        return None

    def check(self, value) -> None:
        """Raise ValueError for a constructor argument outside the key's range."""
        problem = self.problem(value)
        if problem is not None:
            raise ValueError(f"Invalid {self.kwarg}: {value!r} (must be {problem})")


# Every declared OPTIM.SAM hyper-parameter by key (declare_hparam); an optimizer names them by
# key in register_optimizer, or passes an HParam
SAM_HPARAMS: dict[str, HParam] = {}


def declare_hparam(hparam: HParam) -> HParam:
    """Declare an ``OPTIM.SAM`` hyper-parameter (once per key; the same declaration again is a
    no-op, a different one for a declared key raises)."""
    known = SAM_HPARAMS.get(hparam.key)
    if known is not None and known != hparam:
        raise ValueError(
            f"OPTIM.SAM.{hparam.key} is declared already ({known}); reuse it by its key or "
            "choose another key"
        )
    SAM_HPARAMS[hparam.key] = hparam
    return hparam
