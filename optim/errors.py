"""The project's user-facing error base class (at the bottom of the import graph).

A :class:`UserError` is a problem the user can fix (a config key, a data file, a checkpoint, an
output folder): its message names the problem and the fix, and ``train.py`` prints it as one
paragraph without a traceback. Everything else keeps its traceback. ``engine.errors`` holds the
engine's subclasses; optimizers raise :class:`OptimConfigError` for bad ``OPTIM.*`` values.
"""


class UserError(Exception):
    """A problem with the user's input; the message is the whole explanation."""


class OptimConfigError(UserError, ValueError):
    """An invalid ``OPTIM.*`` value or combination."""


class StepContractError(UserError, RuntimeError):
    """A caller of the optimizer step (optim.step.OptimizerStep) that does not give what the
    optimizer needs (begin_step before the first forward, the step's batch, recorded logits)."""
