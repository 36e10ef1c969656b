"""Checkpoints in Dassl's layout, holding plain state dicts only.

``OUTPUT_DIR/<model name>/model.pth.tar-<epoch>`` (and ``model-best.pth.tar``) plus a text file
``OUTPUT_DIR/<model name>/checkpoint`` naming the newest file. Each file is
``{"state_dict", "epoch", "optimizer", "scheduler", "val_result", "trainer", ...}`` where every
value is a tensor, number, string or container of those, so it loads with
``torch.load(weights_only=True)``. Writes go to a temporary file that is renamed into place.

Besides Dassl's files, every epoch that writes no ``model.pth.tar-<E>`` replaces a rolling
``model-last.pth.tar`` (not named in the ``checkpoint`` pointer, which CoOp/Dassl tools read),
so a killed run loses at most one epoch; resume takes whichever is newer. It is removed when a
numbered checkpoint of a later epoch is written (the last epoch always writes one).

No checkpoint with a non-finite tensor is ever written (:class:`FloatingPointError` instead).

Checkpoints of the original code bases (Dassl, CoOp, CoCoOp, MaPLe, CoPrompt, TCP) load too:
their files pickle a few torch objects (e.g. the ``CosineAnnealingLR`` that Dassl's warmup
scheduler state holds, with its optimizer) and NumPy scalars, which are allowed by an explicit
list (:data:`SAFE_GLOBALS`); anything else is refused. Their tensor names are mapped to this
project's (MaPLe and CoPrompt saved the whole model: ``prompt_learner.*``, CoPrompt's
``adapter_image.fc.*``), and a checkpoint that does not fit the model is one
:class:`~engine.errors.CheckpointError` naming the trainer that made it and the missing, extra
or differently shaped tensors.
"""

from __future__ import annotations

import collections
import logging
import os
import os.path as osp
import pickle
import re
import zipfile

import numpy as np
import torch
from torch import nn

from .errors import CheckpointError
from .utils import atomic_torch_save, atomic_write_text

logger = logging.getLogger(__name__)

ROLLING_NAME = "model-last.pth.tar"  # the per-epoch checkpoint (not in Dassl's layout)
UNKNOWN_TRAINER = "an unknown trainer"  # infer_trainer's answer when nothing tells


def _plain_defaultdict(default_factory=None, *args):
    """Stands in for ``collections.defaultdict`` when loading (optimizer ``state`` in pickled
    optimizers): a plain dict, which the weights-only unpickler may fill."""
    return {}


def _safe_globals() -> list:
    sched = torch.optim.lr_scheduler
    numpy_core = getattr(np, "_core", None) or np.core
    multiarray = numpy_core.multiarray
    return [
        # LR schedulers and optimizers that Dassl's checkpoints pickle (the warmup scheduler's
        # successor, which holds its optimizer)
        sched.CosineAnnealingLR,
        sched.StepLR,
        sched.MultiStepLR,
        sched.ExponentialLR,
        sched.LinearLR,
        sched.ConstantLR,
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.RMSprop,
        torch.optim.RAdam,
        (_plain_defaultdict, "collections.defaultdict"),
        collections.Counter,  # MultiStepLR.milestones
        dict,
        # NumPy scalars and arrays (e.g. val_result), under NumPy 1 and 2 module names
        (multiarray.scalar, "numpy.core.multiarray.scalar"),
        (multiarray.scalar, "numpy._core.multiarray.scalar"),
        (multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
        (multiarray._reconstruct, "numpy._core.multiarray._reconstruct"),
        np.dtype,
        np.ndarray,
        *(type(np.dtype(t)) for t in (np.float64, np.float32, np.float16, np.int64, np.int32)),
        type(np.dtype(np.bool_)),
    ]


SAFE_GLOBALS = _safe_globals()


def _check_finite(state: dict, fpath: str) -> None:
    """Raise FloatingPointError if any floating tensor in ``state`` has a NaN/inf (one sync)."""
    named: list[tuple[str, torch.Tensor]] = []

    def walk(prefix, obj):
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point() or obj.is_complex():
                named.append((prefix, obj))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}[{i}]", v)
        elif isinstance(obj, float) and not np.isfinite(obj):
            named.append((prefix, torch.tensor(obj)))

    walk("", state)
    if not named:
        return
    flags = torch.stack([torch.isfinite(t).all().cpu() for _, t in named])
    if bool(flags.all()):
        return
    bad = [name for (name, _), ok in zip(named, flags.tolist()) if not ok]
    raise FloatingPointError(
        f"Refusing to write checkpoint {fpath}: non-finite (NaN/inf) values in {bad[:8]}"
        f"{' ...' if len(bad) > 8 else ''}. The run diverged; the last checkpoint in the folder "
        "is the last finite one. Try a lower OPTIM.LR, or PREC fp32/amp instead of fp16."
    )


def save_checkpoint(
    state: dict, save_dir: str, is_best: bool = False, fname: str = "", pointer: bool = True
) -> str:
    """Save ``state`` as ``model.pth.tar-<epoch>`` (or ``model-best.pth.tar``, or ``fname``).

    Returns the path written in ``save_dir``. The ``checkpoint`` pointer file is updated after
    the checkpoint itself is complete (unless ``pointer`` is False or ``is_best``), so a crash
    never leaves a pointer to a partial file. Raises FloatingPointError (writing nothing) when a
    tensor is not finite.
    """
    state = dict(state)
    state["state_dict"] = {
        (k[7:] if k.startswith("module.") else k): v for k, v in state["state_dict"].items()
    }
    if not fname:
        fname = "model-best.pth.tar" if is_best else f"model.pth.tar-{state['epoch']}"
    fpath = osp.join(save_dir, fname)
    _check_finite(state, fpath)
    atomic_torch_save(state, fpath)
    if pointer and not is_best:
        atomic_write_text(osp.join(osp.dirname(fpath), "checkpoint"), fname + "\n")
    logger.info("Checkpoint saved to %s", fpath)
    return fpath


def _refused_globals(fpath: str) -> list[str]:
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(fpath)
    except Exception:  # noqa: BLE001 - only for the message
        return []
    allowed = set()
    for g in SAFE_GLOBALS:
        if isinstance(g, tuple):
            allowed.add(g[1])
        else:
            allowed.add(f"{g.__module__}.{g.__qualname__}")
    return [name for name in found if name not in allowed and name != "builtins.dict"]


def load_checkpoint(fpath: str, map_location="cpu") -> dict:
    """Load a checkpoint of this project or of the original code bases, weights only.

    Only tensors, plain containers and the classes in :data:`SAFE_GLOBALS` are unpickled;
    anything else (arbitrary code) raises :class:`CheckpointError`, as does a file that is not a
    checkpoint (truncated, another format).
    """
    if not osp.exists(fpath):
        raise CheckpointError(f"Checkpoint not found: {fpath}")
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            checkpoint = torch.load(fpath, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        refused = _refused_globals(fpath)
        what = f" ({', '.join(refused)})" if refused else ""
        raise CheckpointError(
            f"Refused to load checkpoint {fpath}: it pickles Python objects{what} outside the "
            "classes that checkpoints of this project and of Dassl/CoOp/CoCoOp/MaPLe/CoPrompt/"
            "TCP contain, and unpickling them could run arbitrary code. Use a checkpoint from a "
            "trusted run of one of those code bases (a state dict of tensors)."
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as e:
        raise CheckpointError(
            f"Cannot read checkpoint {fpath}: it is truncated or not a PyTorch checkpoint "
            f"({str(e).splitlines()[0][:200]}). Delete it (a re-run resumes from the previous "
            "checkpoint) or point --model-dir to another run."
        ) from None
    if not isinstance(checkpoint, dict):
        raise CheckpointError(
            f"Checkpoint {fpath} holds a {type(checkpoint).__name__}, not a dict of tensors "
            "(a Dassl-style checkpoint or a state dict)"
        )
    return checkpoint


def latest_checkpoint(model_dir: str) -> str | None:
    """The file named in ``model_dir/checkpoint``, or None."""
    pointer = osp.join(model_dir, "checkpoint")
    if not osp.isfile(pointer):
        return None
    with open(pointer) as f:
        name = f.readline().strip()
    path = osp.join(model_dir, name)
    return path if osp.isfile(path) else None


# -- tensors of the original code bases -----------------------------------------------------------
# buffers and frozen parts that original checkpoints hold and this project rebuilds (PromptSRC's
# ZS_image_encoder: its frozen teacher inside the prompt learner)
_IGNORED_SUFFIXES = ("token_prefix", "token_suffix", "tokenized_prompts", "prompt_embeddings")
_IGNORED_PREFIXES = (
    "image_encoder.",
    "text_encoder.",
    "model_distill.",
    "logit_scale",
    "ZS_image_encoder.",
)
# renames of tensors of the original code bases (prefix -> prefix)
_RENAMES = (
    ("adapter_image.fc.", "image_adapter."),
    ("adapter_text.fc.", "text_adapter."),
    ("representation_learner.", ""),  # MMRL's whole CustomCLIP: its learnable module and
    ("image_encoder.proj_rep", "proj_rep"),  # the image tower's new projection
)
# IVLP's and PromptSRC's whole-model names (PromptSRC's code base, also the SAMPLe authors'
# SAMPLeSRC): the first vision prompt on the image encoder, the deep prompts of block N >= 1 as
# ``VPT_shallow`` parameters of the blocks themselves. Here: vpt, deep_vision.N-1, deep_text.N-1.
_FIRST_VISION_PROMPT = "image_encoder.VPT"
_DEEP_PROMPT = re.compile(r"^(image|text)_encoder\.transformer\.resblocks\.(\d+)\.VPT_shallow$")


def _ignorable(key: str) -> bool:
    return key.endswith(_IGNORED_SUFFIXES) or key.startswith(_IGNORED_PREFIXES)


def _ivlp_name(key: str) -> str:
    """This project's name of a tensor of PromptSRC's code base's IVLP-style whole model."""
    if key == _FIRST_VISION_PROMPT:
        return "vpt"
    deep = _DEEP_PROMPT.match(key)
    if deep:
        tower = "deep_vision" if deep.group(1) == "image" else "deep_text"
        return f"{tower}.{int(deep.group(2)) - 1}"  # block N's prompt: deep_*[N-1]
    return key[len("prompt_learner.") :] if key.startswith("prompt_learner.") else key


def _candidates(state_dict: dict) -> list[tuple[dict, dict]]:
    """The checkpoint's tensors under the names this project may use, each with a map from
    the new name to the saved one: as saved; with the original code bases' renames; without
    MaPLe/CoPrompt's whole-model ``prompt_learner.``; with IVLP/PromptSRC's whole-model names
    (deep prompts by block)."""
    plain = {(k[7:] if k.startswith("module.") else k): v for k, v in state_dict.items()}
    renamed, origin = {}, {}
    for k, v in plain.items():
        new = k
        for old, to in _RENAMES:
            if new.startswith(old):
                new = to + new[len(old) :]
        renamed[new], origin[new] = v, k
    stripped = {
        k[len("prompt_learner.") :]: v for k, v in plain.items() if k.startswith("prompt_learner.")
    }
    ivlp = {_ivlp_name(k): (k, v) for k, v in plain.items()}
    return [
        (plain, {}),
        (renamed, origin),
        (stripped, {k: f"prompt_learner.{k}" for k in stripped}),
        ({k: v for k, (_, v) in ivlp.items()}, {k: old for k, (old, _) in ivlp.items()}),
    ]


def _named(keys: list[str], origin: dict) -> list[str]:
    """``keys`` with the name each has in the checkpoint where that differs."""
    return [f"{k} (saved as {origin[k]})" if origin.get(k, k) != k else k for k in keys]


def infer_trainer(checkpoint: dict, path: str) -> tuple[str, str]:
    """(trainer name, how it is known) of the code that wrote ``checkpoint``."""
    if checkpoint.get("trainer"):
        return str(checkpoint["trainer"]), "stored in the checkpoint"
    sd = checkpoint["state_dict"]
    keys = list(sd)
    folder = osp.basename(osp.dirname(osp.abspath(path)))
    how = "inferred from its folder and tensor names"
    if any(k.endswith(("VPT", "VPT_shallow")) for k in keys):
        if any("ZS_image_encoder." in k for k in keys):  # PromptSRC's frozen teacher
            return "PromptSRC", how + "; the SAMPLe authors' SAMPLeSRC saves the same tensors"
        return "IVLP", how
    if any("adapter" in k for k in keys):
        return "CoPrompt", how
    if folder == "MultiModalPromptLearner" or any("compound_prompt" in k for k in keys):
        return "MaPLe", how
    if any(k.startswith("meta_net.") for k in keys):
        out = sd.get("meta_net.linear2.weight")
        ctx = sd.get("ctx")
        if out is not None and ctx is not None and out.shape[0] == ctx.shape[-1]:
            return "CoCoOp", how
        return "TCP", how
    if "ctx" in keys:
        return "CoOp", how
    return UNKNOWN_TRAINER, how


def _apply_config_hparams(optim, sched, config_groups: list, config_base_lrs: list) -> None:
    """After a resume, the config's hyperparameters (LR, weight decay, ...) win over those in
    the checkpoint's optimizer state (the same values unless the config changed, e.g. a lower
    OPTIM.LR after a divergence with --force-resume); momenta and the epoch come from the
    checkpoint."""
    if optim is None or len(config_groups) != len(optim.param_groups):
        return
    for group, config in zip(optim.param_groups, config_groups):
        group.update(config)
    if config_base_lrs and hasattr(sched, "base_lrs"):
        sched.base_lrs = config_base_lrs
        if hasattr(sched, "_apply"):
            sched._apply()  # the LR of the resumed epoch under the config's schedule


class CheckpointMixin:
    """The trainer's checkpoint I/O: save, resume and load every registered model.

    Needs ``self._models``, ``self._optims``, ``self._scheds`` (TrainerBase's registration) and
    ``self.device``.
    """

    _models: dict[str, nn.Module]

    def trainer_name(self) -> str:
        """The registered name of this trainer (stored in checkpoints)."""
        cfg = getattr(self, "cfg", None)
        return cfg.TRAINER.NAME if cfg is not None and cfg.TRAINER.NAME else type(self).__name__

    def _model_state(self, name: str, epoch: int, val_result=None) -> dict:
        state = {
            "state_dict": self._models[name].state_dict(),
            "epoch": epoch + 1,
            "optimizer": self._optims[name].state_dict() if self._optims[name] else None,
            "scheduler": self._scheds[name].state_dict() if self._scheds[name] else None,
            "val_result": val_result,
            "trainer": self.trainer_name(),
        }
        state.update(self.extra_checkpoint_state())
        return state

    def save_model(self, epoch: int, directory: str, is_best=False, val_result=None, model_name=""):
        """Dassl's save: ``model.pth.tar-<epoch+1>`` (or model-best / ``model_name``) per model,
        then drop a rolling checkpoint that is now older."""
        for name in self.get_model_names():
            state = self._model_state(name, epoch, val_result)
            save_checkpoint(state, osp.join(directory, name), is_best=is_best, fname=model_name)
        if not is_best and not model_name:
            self.remove_rolling_checkpoint(directory)

    def save_rolling_checkpoint(self, epoch: int, directory: str) -> None:
        """Replace ``<model>/model-last.pth.tar`` (the newest epoch; not in the pointer file)."""
        for name in self.get_model_names():
            state = self._model_state(name, epoch)
            save_checkpoint(state, osp.join(directory, name), fname=ROLLING_NAME, pointer=False)

    def remove_rolling_checkpoint(self, directory: str) -> None:
        for name in self.get_model_names():
            path = osp.join(directory, name, ROLLING_NAME)
            if osp.isfile(path):
                os.remove(path)

    def extra_checkpoint_state(self) -> dict:
        """More plain state for checkpoints (default: the optimizer step's, e.g. GradScaler)."""
        step = getattr(self, "optim_step", None)
        return step.state_dict() if step is not None else {}

    def load_extra_checkpoint_state(self, checkpoint: dict) -> None:
        step = getattr(self, "optim_step", None)
        if step is not None:
            step.load_state_dict(checkpoint)

    def _newest_checkpoint(self, model_dir: str) -> tuple[str, dict] | None:
        """(path, checkpoint) of the newer of the pointer's file and the rolling one."""
        found = []
        for path in (latest_checkpoint(model_dir), osp.join(model_dir, ROLLING_NAME)):
            if path is not None and osp.isfile(path):
                found.append((path, load_checkpoint(path, map_location=self.device)))
        if not found:
            return None
        return max(found, key=lambda pc: int(pc[1].get("epoch", 0)))

    def resume_model_if_exist(self, directory: str) -> int:
        """Load the newest checkpoint of every registered model from ``directory``.

        The newest is the file named in ``<model>/checkpoint`` or the rolling
        ``<model>/model-last.pth.tar``, whichever holds the later epoch. Returns the epoch to
        start from (0 when there is nothing to resume).
        """
        names = self.get_model_names()
        found = {name: self._newest_checkpoint(osp.join(directory, name)) for name in names}
        if any(f is None for f in found.values()):
            return 0
        start_epoch = 0
        for name, (path, checkpoint) in found.items():
            logger.info("Loading checkpoint from %s", path)
            self._load_module_state(name, checkpoint, path)
            if checkpoint.get("trainer") is None:  # another code base: its own state formats
                logger.warning(
                    "%s was not written by this project: its optimizer and LR-scheduler state "
                    "are not restored",
                    path,
                )
            else:
                optim, sched = self._optims[name], self._scheds[name]
                config_groups = [
                    {k: v for k, v in g.items() if k != "params"}
                    for g in (optim.param_groups if optim is not None else [])
                ]
                config_base_lrs = list(getattr(sched, "base_lrs", []))
                if optim is not None and checkpoint.get("optimizer") is not None:
                    optim.load_state_dict(checkpoint["optimizer"])
                if sched is not None and checkpoint.get("scheduler") is not None:
                    sched.load_state_dict(checkpoint["scheduler"])
                self.load_extra_checkpoint_state(checkpoint)
                _apply_config_hparams(optim, sched, config_groups, config_base_lrs)
            start_epoch = int(checkpoint["epoch"])
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
                there = sorted(os.listdir(directory)) if osp.isdir(directory) else None
                raise CheckpointError(
                    f"Model not found at {path}: check --model-dir and --load-epoch (the "
                    "training run saves model.pth.tar-<MAX_EPOCH>; without --load-epoch "
                    "model-best.pth.tar is loaded)"
                    + _epochs_found(osp.join(directory, name))
                    + (f"; {directory} holds {there}" if there is not None else "")
                )
            checkpoint = load_checkpoint(path, map_location=self.device)
            self._load_module_state(name, checkpoint, path)
            val = checkpoint.get("val_result")
            suffix = f" (val result: {float(val):.1f})" if isinstance(val, (int, float)) else ""
            logger.info(
                'Loading weights to %s from "%s" (epoch = %s)%s',
                name,
                path,
                checkpoint.get("epoch"),
                suffix,
            )

    def _load_module_state(self, name: str, checkpoint: dict, path: str) -> None:
        """Load the checkpoint's tensors into model ``name``, mapping the original code bases'
        names; the class-dependent buffers (token_prefix/token_suffix) and frozen CLIP weights
        that their files contain are ignored. Anything else that does not fit raises one
        CheckpointError naming the trainer that made the checkpoint."""
        module = self._models[name]
        own = module.state_dict()
        if "state_dict" not in checkpoint:  # a bare state dict (older callers)
            checkpoint = {"state_dict": checkpoint}
        best, best_score = None, None
        for cand, origin in _candidates(checkpoint["state_dict"]):
            missing = [k for k in own if k not in cand]
            extra = [k for k in cand if k not in own and not _ignorable(k)]
            shapes = [
                f"{_named([k], origin)[0]}: checkpoint {tuple(cand[k].shape)}, model "
                f"{tuple(v.shape)}"
                for k, v in own.items()
                if k in cand and tuple(cand[k].shape) != tuple(v.shape)
            ]
            score = len(missing) + len(extra) + len(shapes)
            if best_score is None or score < best_score:
                best, best_score = (cand, origin, missing, extra, shapes), score
        cand, origin, missing, extra, shapes = best
        made_by, how = infer_trainer(checkpoint, path)
        this = self.trainer_name()
        if missing or extra or shapes:
            parts = []
            if missing:
                parts.append(f"missing tensors {missing}")
            if extra:
                parts.append(f"unexpected tensors {_named(extra, origin)}")
            if shapes:
                parts.append("different shapes (" + "; ".join(shapes) + ")")
            known = made_by != UNKNOWN_TRAINER
            which = f"--trainer {made_by} and its config files" if known else "its config.yaml"
            raise CheckpointError(
                f"Checkpoint {path} was made by {made_by} ({how}) and does not fit this {this} "
                f"model '{name}': {', '.join(parts)}. Evaluate it with the trainer and the "
                f"TRAINER.* settings (N_CTX, PROMPT_DEPTH, CSC, ...) of the run that made it "
                f"({which}), or give a checkpoint of a {this} run with these settings."
            )
        if made_by != this and checkpoint.get("trainer"):
            logger.warning("%s was made by %s, loaded into %s", path, made_by, this)
        ignored = sorted(k for k in cand if k not in own)
        if ignored:
            shown = ignored if len(ignored) <= 6 else [*ignored[:6], f"... ({len(ignored)} in all)"]
            logger.info("Ignoring checkpoint keys not used by '%s': %s", name, shown)
        module.load_state_dict({k: cand[k] for k in own}, strict=True)
        self.after_load_state(name)

    def after_load_state(self, name: str) -> None:
        """Hook after weights were loaded (e.g. to drop cached features)."""


def _epochs_found(folder: str) -> str:
    """``; the epochs found there: 50, 100 (--load-epoch N)`` for the numbered checkpoints of a
    model folder (none: says so)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return ""
    prefix = "model.pth.tar-"
    epochs = sorted(int(n[len(prefix) :]) for n in names if n[len(prefix) :].isdigit()
                    and n.startswith(prefix))  # fmt: skip
    best = "model-best.pth.tar" in names
    if not epochs:
        only = ", only model-best.pth.tar (loaded without --load-epoch)" if best else ""
        return f"; {folder} holds no numbered checkpoint{only}"
    shown = ", ".join(map(str, epochs))
    also = ", and model-best.pth.tar (without --load-epoch)" if best else ""
    return f"; the epochs found in {folder}: {shown} (--load-epoch N){also}"
