"""Error types of the engine, all :class:`~optim.errors.UserError` (printed without traceback).

- :class:`ConfigError`: an unknown key, a wrong type or an invalid value (names the key).
- :class:`DataError`: a missing or unreadable dataset file (names the path and the fix).
- :class:`CheckpointError`: a checkpoint that cannot be loaded into this model.
- :class:`OutputError`: the output folder cannot be written (full disk, read-only, locked).
"""

from optim.errors import OptimConfigError, UserError
from optim.registry import RegistryError


class ConfigError(UserError, ValueError):
    """A configuration problem (unknown key, wrong type, invalid value)."""


class DataError(UserError):
    """A dataset problem: missing folder or split file, unreadable image or JSON."""


class CheckpointError(UserError):
    """A checkpoint that is missing, unsafe or does not fit the model."""


class OutputError(UserError):
    """An output folder that cannot be written or is owned by another run."""


__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "OptimConfigError",
    "OutputError",
    "RegistryError",
    "UserError",
]
