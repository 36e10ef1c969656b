"""Dataset readers in the CoOp folder layouts, registered under the CoOp names."""

from . import dtd  # noqa: F401
