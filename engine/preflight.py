"""The checks of a run's names and dataset made before its output folder is touched.

``train.py`` (:func:`engine.cli.main`) calls :func:`check_run_inputs` right after the config is
merged and its values checked: a misspelled ``--trainer``, an unknown ``DATASET.NAME`` or a
dataset root that lacks the dataset stop the run with one message (the registry's "do you mean"
or the reader's missing pieces and how to get them), before the config is logged and before the
output folder or its log file exist. The reader checks the same layout again at start-up.
"""

from __future__ import annotations

from .errors import ConfigError
from .registry import DATASET_REGISTRY, TRAINER_REGISTRY


def check_trainer(cfg) -> None:
    """Raise :class:`~engine.errors.RegistryError` when ``TRAINER.NAME`` is not registered."""
    if not cfg.TRAINER.NAME:
        raise ConfigError("No trainer given: pass --trainer NAME (e.g. --trainer CoOp)")
    TRAINER_REGISTRY.get(cfg.TRAINER.NAME)  # unknown: "Unknown trainer 'X' (do you mean [Y]?)"


def check_dataset(cfg) -> None:
    """Raise when ``DATASET.NAME`` is not registered, or when its reader declares a layout
    (``layout_for(cfg)``) that ``DATASET.ROOT`` lacks (:class:`~engine.data.DatasetNotFoundError`
    naming every missing piece and how to obtain it)."""
    if not cfg.DATASET.NAME:
        raise ConfigError(
            "DATASET.NAME is empty: pass --dataset-config-file or DATASET.NAME <name>"
        )
    reader = DATASET_REGISTRY.get(cfg.DATASET.NAME)
    layout_for = getattr(reader, "layout_for", None)
    layout = layout_for(cfg) if callable(layout_for) else None
    if layout is None:  # a reader without a declared layout checks its data itself
        return
    missing = layout.missing(cfg.DATASET.ROOT)
    if missing:
        raise layout.not_found(cfg.DATASET.ROOT, missing)


def check_run_inputs(cfg) -> None:
    """The trainer and the dataset of ``cfg``, checked before any file is written."""
    check_trainer(cfg)
    check_dataset(cfg)
