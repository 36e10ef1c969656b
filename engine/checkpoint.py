"""Checkpoints in Dassl's layout, holding plain state dicts only.

``OUTPUT_DIR/<model name>/model.pth.tar-<epoch>`` (and ``model-best.pth.tar``) plus a text file
``OUTPUT_DIR/<model name>/checkpoint`` naming the newest file. Each file is
``{"state_dict", "epoch", "optimizer", "scheduler", "val_result", ...}`` where every value is a
tensor, number, string or container of those, so it loads with ``torch.load(weights_only=True)``.
Writes go to a temporary file that is renamed into place.
"""

from __future__ import annotations

import logging
import os.path as osp

import torch
from torch import nn

from .utils import atomic_torch_save, atomic_write_text

logger = logging.getLogger(__name__)


def save_checkpoint(state: dict, save_dir: str, is_best: bool = False, fname: str = "") -> str:
    """Save ``state`` as ``model.pth.tar-<epoch>`` (or ``model-best.pth.tar``, or ``fname``).

    Returns the path written in ``save_dir``. The ``checkpoint`` pointer file is updated after
    the checkpoint itself is complete, so a crash never leaves a pointer to a partial file.
    """
    state = dict(state)
    state["state_dict"] = {
        (k[7:] if k.startswith("module.") else k): v for k, v in state["state_dict"].items()
    }
    if not fname:
        fname = "model-best.pth.tar" if is_best else f"model.pth.tar-{state['epoch']}"
    fpath = osp.join(save_dir, fname)
    atomic_torch_save(state, fpath)
    if not is_best:
        atomic_write_text(osp.join(osp.dirname(fpath), "checkpoint"), fname + "\n")
    logger.info("Checkpoint saved to %s", fpath)
    return fpath


def load_checkpoint(fpath: str, map_location="cpu") -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` (``weights_only=True``)."""
    if not osp.exists(fpath):
        raise FileNotFoundError(f"Checkpoint not found: {fpath}")
    try:
        return torch.load(fpath, map_location=map_location, weights_only=True)
    except Exception as e:
        raise RuntimeError(
            f"Cannot load checkpoint {fpath} with weights_only=True ({e}). Checkpoints of this "
            "project hold plain state dicts only; files from other code bases may pickle objects."
        ) from e


def latest_checkpoint(model_dir: str) -> str | None:
    """The file named in ``model_dir/checkpoint``, or None."""
    pointer = osp.join(model_dir, "checkpoint")
    if not osp.isfile(pointer):
        return None
    with open(pointer) as f:
        name = f.readline().strip()
    path = osp.join(model_dir, name)
    return path if osp.isfile(path) else None


class CheckpointMixin:
    """The trainer's checkpoint I/O: save, resume and load every registered model.

    Needs ``self._models``, ``self._optims``, ``self._scheds`` (TrainerBase's registration) and
    ``self.device``.
    """

    _models: dict[str, nn.Module]

    def save_model(self, epoch: int, directory: str, is_best=False, val_result=None, model_name=""):
        for name in self.get_model_names():
            state = {
                "state_dict": self._models[name].state_dict(),
                "epoch": epoch + 1,
                "optimizer": self._optims[name].state_dict() if self._optims[name] else None,
                "scheduler": self._scheds[name].state_dict() if self._scheds[name] else None,
                "val_result": val_result,
            }
            state.update(self.extra_checkpoint_state())
            save_checkpoint(state, osp.join(directory, name), is_best=is_best, fname=model_name)

    def extra_checkpoint_state(self) -> dict:
        """More plain state for checkpoints (default: the optimizer step's, e.g. GradScaler)."""
        step = getattr(self, "optim_step", None)
        return step.state_dict() if step is not None else {}

    def load_extra_checkpoint_state(self, checkpoint: dict) -> None:
        step = getattr(self, "optim_step", None)
        if step is not None:
            step.load_state_dict(checkpoint)

    def resume_model_if_exist(self, directory: str) -> int:
        """Load the newest checkpoint of every registered model from ``directory``.

        Returns the epoch to start from (0 when there is nothing to resume).
        """
        names = self.get_model_names()
        paths = {name: latest_checkpoint(osp.join(directory, name)) for name in names}
        if any(p is None for p in paths.values()):
            return 0
        start_epoch = 0
        for name, path in paths.items():
            logger.info("Loading checkpoint from %s", path)
            checkpoint = load_checkpoint(path, map_location=self.device)
            self._load_module_state(name, checkpoint["state_dict"], path)
            if self._optims[name] is not None and checkpoint.get("optimizer") is not None:
                self._optims[name].load_state_dict(checkpoint["optimizer"])
            if self._scheds[name] is not None and checkpoint.get("scheduler") is not None:
                self._scheds[name].load_state_dict(checkpoint["scheduler"])
            self.load_extra_checkpoint_state(checkpoint)
            start_epoch = checkpoint["epoch"]
        logger.info("Previous epoch: %d", start_epoch)
        return start_epoch

    def load_model(self, directory: str, epoch: int | None = None) -> None:
        """Load ``model-best.pth.tar`` or ``model.pth.tar-<epoch>`` of each registered model."""
        if not directory:
            logger.warning("Note that load_model() is skipped as no pretrained model is given")
            return
        fname = "model-best.pth.tar" if epoch is None else f"model.pth.tar-{epoch}"
        for name in self.get_model_names():
            path = osp.join(directory, name, fname)
            if not osp.exists(path):
                raise FileNotFoundError(
                    f"Model not found at {path}: check --model-dir and --load-epoch "
                    f"(the training run saves model.pth.tar-<MAX_EPOCH>)"
                )
            checkpoint = load_checkpoint(path, map_location=self.device)
            self._load_module_state(name, checkpoint["state_dict"], path)
            val = checkpoint.get("val_result")
            suffix = f" (val result: {val:.1f})" if isinstance(val, (int, float)) else ""
            logger.info(
                'Loading weights to %s from "%s" (epoch = %s)%s',
                name,
                path,
                checkpoint.get("epoch"),
                suffix,
            )

    def _load_module_state(self, name: str, state_dict: dict, path: str) -> None:
        """Strict on learnable tensors; ignores extra keys (e.g. the class-dependent
        token_prefix/token_suffix buffers that CoOp-code-base checkpoints contain)."""
        module = self._models[name]
        own = module.state_dict()
        missing = [k for k in own if k not in state_dict]
        if missing:
            raise KeyError(f"Checkpoint {path} lacks {missing} for model '{name}'")
        for k, v in own.items():
            if state_dict[k].shape != v.shape:
                raise ValueError(
                    f"Checkpoint {path}: '{k}' has shape {tuple(state_dict[k].shape)} but the "
                    f"model expects {tuple(v.shape)}. Class-specific parameters (e.g. CoOp's "
                    "CSC context) cannot be loaded for a different set of classes."
                )
        ignored = sorted(set(state_dict) - set(own))
        if ignored:
            logger.info("Ignoring checkpoint keys not used by '%s': %s", name, ignored)
        module.load_state_dict({k: state_dict[k] for k in own}, strict=True)
        self.after_load_state(name)

    def after_load_state(self, name: str) -> None:
        """Hook after weights were loaded (e.g. to drop cached features)."""
