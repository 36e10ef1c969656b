"""Reproduction modes: ``paper`` and ``released`` (docs/reproducing.md).

A mode is the config key ``REPRODUCTION`` plus an overlay of config files merged after the
trainer, dataset and optimizer config files and before the command line's ``KEY VALUE``
options (which still win):

- ``paper``: ``configs/repro/paper.yaml``, the method as the paper writes it (the decisions the
  paper leaves open are made in the ``configs/optim/**`` files: update gradient, staging);
- ``released``: ``configs/repro/released.yaml`` and, where they exist,
  ``configs/repro/released/<TRAINER>.yaml`` and ``configs/repro/released/<TRAINER>/<OPTIM>.yaml``
  (``<OPTIM>``: ``OPTIM.SAM.NAME``, e.g. CoCoOp's own SAMPLe copy): an emulation of the SAMPLe
  authors' released code
  (mean update gradient and its ||m|| through the optimizers' ``reference`` variants, LR stepped
  per batch and per epoch, constant rho, no staging, Dassl's ``drop_last``).
"""

from __future__ import annotations

import os.path as osp

from .errors import ConfigError

MODES = ("paper", "released")
REPRO_DIR = osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))), "configs", "repro")


def overlay_files(mode: str, trainer: str = "", optim: str = "") -> list[str]:
    """The overlay files of ``mode`` for ``trainer`` and optimizer ``optim``, in merge order."""
    if mode not in MODES:
        raise ConfigError(f"REPRODUCTION {mode!r}: one of {', '.join(MODES)} (docs/reproducing.md)")
    files = [osp.join(REPRO_DIR, f"{mode}.yaml")]
    if trainer:
        files.append(osp.join(REPRO_DIR, mode, f"{trainer}.yaml"))
        if optim:
            files.append(osp.join(REPRO_DIR, mode, trainer, f"{optim}.yaml"))
    return [f for f in files if osp.isfile(f)]


def apply_reproduction(cfg, mode: str, opts: list[str], translate=None) -> None:
    """Merge the overlay of ``mode`` into ``cfg``, then ``opts`` again (they win).

    Args:
        cfg: the merged config (not frozen).
        mode: ``paper`` or ``released`` (empty: ``cfg.REPRODUCTION``).
        opts: the command line's ``KEY VALUE`` options, already merged once.
        translate: the trainer's key translation, applied to ``opts`` as the first time
            (:func:`engine.config.merge_from_list`).
    """
    from .config import merge_from_file, merge_from_list

    mode = mode or cfg.REPRODUCTION
    for path in overlay_files(mode, cfg.TRAINER.NAME, cfg.OPTIM.SAM.NAME):
        merge_from_file(cfg, path)
    cfg.REPRODUCTION = mode
    merge_from_list(cfg, opts, translate=translate)
    if cfg.REPRODUCTION != mode:
        raise ConfigError(
            f"--repro {mode} and REPRODUCTION {cfg.REPRODUCTION} disagree: give the mode once"
        )
