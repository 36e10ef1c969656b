"""Trainer base classes with Dassl's vocabulary: TrainerBase, SimpleTrainer, TrainerX.

The optimizer step is one protocol owned by the engine (:meth:`TrainerX.forward_backward`).
A trainer states

(a) ``prepare_step(batch)``: what it computes without gradients, once per step (frozen encoder
    outputs, teacher features, per-step random choices); run under ``torch.no_grad()``, and
(b) ``compute_loss(inputs)``: its loss (and a dict of scalars to log) from those inputs.

The engine zeroes gradients, runs (b) and backward, and steps the optimizer. A two-pass
(sharpness-aware) optimizer receives a closure that re-evaluates only (b), so trainers contain
no optimizer-specific code. The engine also handles the precision modes, detects NaN/inf losses
(raising with epoch, batch and loss values), writes per-step optimizer diagnostics, runs the
staged switch from the base optimizer to the sharpness-aware one, and steps the LR scheduler once
per epoch.
"""

from __future__ import annotations

import datetime
import fnmatch
import json
import logging
import os.path as osp
import time
from collections import OrderedDict
from contextlib import nullcontext

import torch
from torch import nn
from tqdm import tqdm

import optim  # attributes are read at call time (optim imports engine.registry)

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .compile import check_compile_option, compile_encoders, mark_step
from .data import DataManager
from .evaluator import build_evaluator
from .feature_cache import (
    FeatureCache,
    cache_key,
    compute_features,
    data_fingerprint,
    module_fingerprint,
)
from .utils import AverageMeter, MetricMeter, epoch_seed, mkdir_if_missing, set_random_seed

logger = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "amp", "bf16")


class TrainerBase:
    """Registered models/optimizers/schedulers, checkpoints and the epoch loop."""

    @classmethod
    def add_config(cls, cfg) -> None:
        """Add this trainer's ``TRAINER.<NAME>`` keys to ``cfg`` (override per trainer)."""

    def __init__(self):
        self._models: OrderedDict[str, nn.Module] = OrderedDict()
        self._optims: OrderedDict[str, torch.optim.Optimizer | None] = OrderedDict()
        self._scheds: OrderedDict[str, object] = OrderedDict()
        self._writer = None
        self._scalar_file = None
        self._pending_scalars: list[tuple[int, dict]] = []

    # -- registration ---------------------------------------------------------------------
    def register_model(self, name: str = "model", model=None, optim=None, sched=None) -> None:
        """Register a learnable module with its optimizer and LR scheduler.

        The module's ``state_dict()`` is what checkpoints hold: register the learnable part
        (e.g. a prompt learner), and keep class-dependent tensors in non-persistent buffers.
        """
        if self.__dict__.get("_models") is None:
            raise AttributeError("Cannot assign model before super().__init__() call")
        if name in self._models:
            raise KeyError(f"A model named '{name}' is already registered")
        if model is None:
            raise ValueError(f"register_model('{name}'): model is None")
        self._models[name] = model
        self._optims[name] = optim
        self._scheds[name] = sched

    def get_model(self, name: str) -> nn.Module:
        """The registered module ``name`` (e.g. "prompt_learner")."""
        return self._models[self.get_model_names(name)[0]]

    def get_model_names(self, names=None) -> list[str]:
        names_real = list(self._models.keys())
        if names is None:
            return names_real
        names = [names] if isinstance(names, str) else list(names)
        for name in names:
            if name not in names_real:
                raise KeyError(f"Unknown model '{name}'; registered: {names_real}")
        return names

    # -- checkpoints ------------------------------------------------------------------------
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
        """More plain state for checkpoints (e.g. the GradScaler)."""
        return {}

    def load_extra_checkpoint_state(self, checkpoint: dict) -> None:
        pass

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

    # -- modes, LR, writer --------------------------------------------------------------------
    def set_model_mode(self, mode: str = "train", names=None) -> None:
        for name in self.get_model_names(names):
            if mode == "train":
                self._models[name].train()
            elif mode in ("test", "eval"):
                self._models[name].eval()
            else:
                raise KeyError(f"Unknown model mode '{mode}'")

    def update_lr(self, names=None) -> None:
        for name in self.get_model_names(names):
            if self._scheds[name] is not None:
                self._scheds[name].step()

    def get_current_lr(self, names=None) -> float:
        name = self.get_model_names(names)[0]
        return self._optims[name].param_groups[0]["lr"]

    def init_writer(self, log_dir: str) -> None:
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                logger.info("tensorboard is not installed: scalars go to scalars.jsonl only")
            else:
                self._writer = SummaryWriter(log_dir=log_dir)
        if self._scalar_file is None:
            mkdir_if_missing(self.output_dir)
            self._scalar_file = open(osp.join(self.output_dir, "scalars.jsonl"), "a")  # noqa: SIM115

    def close_writer(self) -> None:
        self.flush_scalars()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._scalar_file is not None:
            self._scalar_file.close()
            self._scalar_file = None

    def write_scalar(self, tag: str, value, global_step: int) -> None:
        """Queue a scalar (a number or a 0-d tensor); written at the next flush."""
        self._pending_scalars.append((global_step, {tag: value}))

    def write_scalars(self, values: dict, global_step: int) -> None:
        if values:
            self._pending_scalars.append((global_step, dict(values)))

    def flush_scalars(self) -> None:
        """Write queued scalars (one host transfer for all tensors) to tensorboard/jsonl."""
        if not self._pending_scalars:
            return
        tensors = [
            v for _, d in self._pending_scalars for v in d.values() if isinstance(v, torch.Tensor)
        ]
        numbers = iter(
            torch.stack([t.detach().float().reshape(()).cpu() for t in tensors]).tolist()
            if tensors
            else []
        )
        for step, d in self._pending_scalars:
            row = {
                k: (next(numbers) if isinstance(v, torch.Tensor) else float(v))
                for k, v in d.items()
            }
            if self._writer is not None:
                for k, v in row.items():
                    self._writer.add_scalar(k, v, step)
            if self._scalar_file is not None:
                self._scalar_file.write(json.dumps({"step": step, **row}) + "\n")
        self._pending_scalars.clear()
        if self._scalar_file is not None:
            self._scalar_file.flush()

    # -- loop -------------------------------------------------------------------------------
    def train(self, start_epoch: int, max_epoch: int) -> None:
        """Generic loop: before_train; for each epoch before/run/after_epoch; after_train."""
        self.start_epoch = start_epoch
        self.max_epoch = max_epoch
        self.before_train()
        try:
            for self.epoch in range(self.start_epoch, self.max_epoch):  # noqa: B020
                self.before_epoch()
                self.run_epoch()
                self.after_epoch()
            self.after_train()
        finally:
            self.close_writer()

    def before_train(self):
        pass

    def after_train(self):
        pass

    def before_epoch(self):
        pass

    def after_epoch(self):
        pass

    def run_epoch(self):
        raise NotImplementedError

    def test(self, split=None):
        raise NotImplementedError

    def parse_batch_train(self, batch):
        raise NotImplementedError

    def parse_batch_test(self, batch):
        raise NotImplementedError

    def forward_backward(self, batch):
        raise NotImplementedError

    def model_inference(self, input):
        raise NotImplementedError

    # -- Dassl compatibility helpers ----------------------------------------------------------
    def detect_anomaly(self, loss: torch.Tensor) -> None:
        if not torch.isfinite(loss).all():
            raise FloatingPointError("Loss is infinite or NaN!")

    def model_zero_grad(self, names=None) -> None:
        for name in self.get_model_names(names):
            if self._optims[name] is not None:
                self._optims[name].zero_grad(set_to_none=True)

    def model_backward(self, loss: torch.Tensor) -> None:
        self.detect_anomaly(loss)
        loss.backward()

    def model_update(self, names=None) -> None:
        for name in self.get_model_names(names):
            if self._optims[name] is not None:
                opt = self._optims[name]
                getattr(opt, "base_optimizer", opt).step()

    def model_backward_and_update(self, loss: torch.Tensor, names=None) -> None:
        self.model_zero_grad(names)
        self.model_backward(loss)
        self.model_update(names)


class SimpleTrainer(TrainerBase):
    """A trainer with one data manager, one evaluator and the engine's step protocol."""

    def __init__(self, cfg):
        super().__init__()
        self.check_cfg(cfg)
        if torch.cuda.is_available() and cfg.USE_CUDA:
            self.device = torch.device("cuda")
            torch.backends.cudnn.benchmark = True
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        else:
            self.device = torch.device("cpu")
        self.start_epoch = self.epoch = 0
        self.max_epoch = cfg.OPTIM.MAX_EPOCH
        self.output_dir = cfg.OUTPUT_DIR
        self.cfg = cfg
        self.prec = self._precision(cfg)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.prec == "amp" else None
        self._checks: list[tuple[int, int, torch.Tensor, dict]] = []
        self._stage_applied = False
        if cfg.SEED >= 0:  # the same seed gives the same model (e.g. random prompt init) in-process
            set_random_seed(cfg.SEED)
        check_compile_option(cfg.MODEL.COMPILE)
        self.build_data_loader()
        self.build_model()
        if cfg.MODEL.COMPILE and isinstance(getattr(self, "model", None), nn.Module):
            compile_encoders(self.model, cfg.MODEL.COMPILE)
        self.evaluator = build_evaluator(cfg, lab2cname=self.lab2cname)
        self.best_result = -float("inf")

    # -- configuration ----------------------------------------------------------------------
    def check_cfg(self, cfg) -> None:
        """Validate trainer-specific config values (override); raise ValueError naming the key."""

    def trainer_cfg(self, cfg=None):
        """This trainer's ``TRAINER.<NAME>`` node (None if it has none)."""
        cfg = cfg or self.cfg
        key = type(self).__name__.upper()
        return cfg.TRAINER.get(key, None)

    def _precision(self, cfg) -> str:
        node = self.trainer_cfg(cfg)
        prec = node.PREC if node is not None and "PREC" in node else "fp32"
        if prec not in PRECISIONS:
            raise ValueError(
                f"TRAINER.{type(self).__name__.upper()}.PREC must be one of {PRECISIONS}, "
                f"got {prec!r}"
            )
        if prec == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError("PREC bf16 needs a GPU with bfloat16 support; use amp or fp32")
        return prec

    def autocast(self):
        """The autocast context of the precision mode (amp: fp16, bf16: bfloat16)."""
        if self.prec == "amp":
            return torch.autocast(self.device.type, dtype=torch.float16)
        if self.prec == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    # -- building ---------------------------------------------------------------------------
    def build_data_loader(self) -> None:
        """Create the data manager and its loaders (Dassl's attributes)."""
        dm = DataManager(self.cfg)
        self.train_loader_x = dm.train_loader_x
        self.val_loader = dm.val_loader
        self.test_loader = dm.test_loader
        self.num_classes = dm.num_classes
        self.num_source_domains = dm.num_source_domains
        self.lab2cname = dm.lab2cname
        self.dm = dm

    def build_model(self) -> None:
        raise NotImplementedError

    # -- loop hooks -------------------------------------------------------------------------
    def train(self):
        super().train(self.start_epoch, self.max_epoch)

    def before_train(self):
        sam = self.cfg.OPTIM.SAM
        if sam.NAME and sam.START_EPOCH >= self.max_epoch:
            raise ValueError(
                f"OPTIM.SAM.NAME is {sam.NAME!r} but its stage never starts: "
                f"OPTIM.SAM.START_EPOCH {sam.START_EPOCH} >= OPTIM.MAX_EPOCH {self.max_epoch}. "
                "Set OPTIM.SAM.START_EPOCH below MAX_EPOCH (e.g. OPTIM.SAM.START_EPOCH 1 for "
                "MaPLe's 2-epoch cross-dataset config), or OPTIM.SAM.NAME '' for the base "
                "optimizer only"
            )
        directory = self.cfg.RESUME or self.cfg.OUTPUT_DIR
        self.start_epoch = self.resume_model_if_exist(directory)
        dm = getattr(self, "dm", None)
        if dm is not None and self.start_epoch < self.max_epoch:
            dm.cache_training_images()
        self.init_writer(osp.join(self.output_dir, "tensorboard"))
        self.time_start = time.time()

    def after_train(self):
        logger.info("Finish training")
        do_test = not self.cfg.TEST.NO_TEST
        if do_test:
            if self.cfg.TEST.FINAL_MODEL == "best_val":
                logger.info("Deploy the model with the best val performance")
                self.load_model(self.output_dir)
            else:
                logger.info("Deploy the last-epoch model")
            self.test()
        elapsed = str(datetime.timedelta(seconds=round(time.time() - self.time_start)))
        logger.info("Elapsed: %s", elapsed)

    def before_epoch(self):
        if self.cfg.SEED >= 0:  # every epoch starts from a seed of its own: exact resume
            set_random_seed(epoch_seed(self.cfg.SEED, self.epoch) + 1)
        sampler = getattr(self.train_loader_x, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        self._apply_stage()

    def after_epoch(self):
        last_epoch = (self.epoch + 1) == self.max_epoch
        do_test = not self.cfg.TEST.NO_TEST
        freq = self.cfg.TRAIN.CHECKPOINT_FREQ
        meet_checkpoint_freq = (self.epoch + 1) % freq == 0 if freq > 0 else False
        if do_test and self.cfg.TEST.FINAL_MODEL == "best_val" and self.val_loader is not None:
            curr_result = self.test(split="val")
            if curr_result > self.best_result:
                self.best_result = curr_result
                self.save_model(self.epoch, self.output_dir, val_result=curr_result, is_best=True)
        if meet_checkpoint_freq or last_epoch:
            self.save_model(self.epoch, self.output_dir)

    # -- staged training (OPTIM.SAM.START_EPOCH / FREEZE) -------------------------------------
    def _sam_active(self) -> bool:
        return self.epoch >= self.cfg.OPTIM.SAM.START_EPOCH

    def _apply_stage(self) -> None:
        """From OPTIM.SAM.START_EPOCH on, freeze the parameters matching OPTIM.SAM.FREEZE."""
        patterns = list(self.cfg.OPTIM.SAM.FREEZE)
        if self._stage_applied or not patterns or not self._sam_active():
            return
        frozen = []
        for mname, module in self._models.items():
            for pname, p in module.named_parameters():
                if any(fnmatch.fnmatch(pname, pat) for pat in patterns) and p.requires_grad:
                    p.requires_grad_(False)
                    p.grad = None
                    frozen.append(f"{mname}.{pname}")
        if not frozen:
            names = [n for m in self._models.values() for n, _ in m.named_parameters()]
            raise ValueError(
                f"OPTIM.SAM.FREEZE {patterns} matches no parameter; parameter names: {names}"
            )
        self._stage_applied = True
        logger.info(
            "Epoch %d: the sharpness-aware stage starts; frozen: %s",
            self.epoch + 1,
            ", ".join(frozen),
        )

    # -- checkpoint extras ------------------------------------------------------------------
    def extra_checkpoint_state(self) -> dict:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_extra_checkpoint_state(self, checkpoint: dict) -> None:
        if self.scaler is not None and checkpoint.get("scaler"):
            self.scaler.load_state_dict(checkpoint["scaler"])

    # -- evaluation -------------------------------------------------------------------------
    def before_test(self) -> None:
        """Called once before an evaluation loop (e.g. to compute class text features)."""

    def after_test(self) -> None:
        """Called once after an evaluation loop (e.g. to drop cached features)."""

    def frozen_image_encoder(self) -> nn.Module | None:
        """The frozen image encoder whose raw output alone feeds the evaluation logits, or None.

        Trainers that return it (zero-shot CLIP, CoOp, CoCoOp, TCP) implement
        :meth:`model_inference_features`; the engine then encodes each evaluation set once and
        reuses the features from the on-disk cache (``TEST.FEATURE_CACHE``).
        """
        return None

    def model_inference_features(self, features: torch.Tensor) -> torch.Tensor:
        """Logits from raw frozen image features ``[batch, dim]`` (see frozen_image_encoder)."""
        raise NotImplementedError

    @torch.no_grad()
    def test(self, split: str | None = None) -> float:
        """Evaluate on ``split`` (default TEST.SPLIT) and return the first metric (accuracy)."""
        self.set_model_mode("eval")
        self.evaluator.reset()
        split = split or self.cfg.TEST.SPLIT
        if split == "val" and self.val_loader is not None:
            loader = self.val_loader
        else:
            split, loader = "test", self.test_loader
        logger.info("Evaluate on the *%s* set", split)
        encoder = self.frozen_image_encoder()
        self.before_test()
        try:
            if encoder is not None:
                features, labels = self._eval_features(encoder, loader, split)
                step = loader.batch_size or 100
                for i in range(0, len(labels), step):
                    if self.cfg.MODEL.COMPILE:
                        mark_step()
                    with self.autocast():
                        output = self.model_inference_features(features[i : i + step])
                    self.evaluator.process(output.float(), labels[i : i + step])
            else:
                for batch in tqdm(loader, desc=f"eval {split}", leave=False, disable=None):
                    input, label = self.parse_batch_test(batch)
                    with self.autocast():
                        output = self.model_inference(input)
                    self.evaluator.process(output.float(), label)
        finally:
            self.after_test()
        results = self.evaluator.evaluate()
        for k, v in results.items():
            self.write_scalar(f"{split}/{k}", v, self.epoch)
        self.flush_scalars()
        return list(results.values())[0]

    def _eval_features(self, encoder: nn.Module, loader, split: str):
        """Raw features of the evaluation images: from the disk cache or computed (and cached)."""
        cfg = self.cfg
        dtype = compute_dtype(encoder)

        def encode(images):
            return encoder(images.to(dtype))

        cache = FeatureCache(cfg.TEST.FEATURE_CACHE_DIR) if cfg.TEST.FEATURE_CACHE else None
        key = None
        if cache is not None:
            key = cache_key(
                weights=module_fingerprint(encoder),
                precision=self.prec,
                device=self.device.type,
                dataset=cfg.DATASET.NAME,
                split=split,
                data=data_fingerprint(loader.dataset.data_source),
                transform=repr(loader.dataset.transform),
            )
            hit = cache.load(key)
            if hit is not None:
                logger.info("Evaluation features loaded from %s", cache.path(key))
                return hit["features"].to(self.device), hit["labels"].to(self.device)
        wrapped = tqdm(loader, desc=f"encode {split}", leave=False, disable=None)
        features, labels = compute_features(encode, wrapped, self.device, self.autocast)
        if cache is not None:
            cache.save(key, features, labels)
            logger.info("Evaluation features saved to %s", cache.path(key))
        return features, labels.to(self.device)

    def model_inference(self, input):
        return self.model(input)

    def parse_batch_test(self, batch):
        dev = self.device
        return batch["img"].to(dev, non_blocking=True), batch["label"].to(dev, non_blocking=True)


class TrainerX(SimpleTrainer):
    """A trainer over labelled data (``train_loader_x``) with the engine's step protocol."""

    # -- the step protocol ------------------------------------------------------------------
    def parse_batch_train(self, batch):
        dev = self.device
        return batch["img"].to(dev, non_blocking=True), batch["label"].to(dev, non_blocking=True)

    def prepare_step(self, batch_inputs):
        """(a) The work of a step that does not depend on learnable parameters.

        Runs once per step under ``torch.no_grad()`` and the precision's autocast. Default:
        return the parsed batch unchanged.
        """
        return batch_inputs

    def compute_loss(self, inputs):
        """(b) The loss from the prepared inputs: ``loss`` or ``(loss, {name: scalar})``.

        Called once per pass (twice per step with a sharpness-aware optimizer), under autocast.
        """
        raise NotImplementedError

    def _loss(self, inputs):
        with self.autocast():
            out = self.compute_loss(inputs)
        loss, summary = out if isinstance(out, tuple) else (out, {})
        return loss, summary

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def forward_backward(self, batch) -> dict:
        """One training step: prepare (no grad) -> loss -> backward -> optimizer step."""
        if self.cfg.MODEL.COMPILE:
            mark_step()
        parsed = self.parse_batch_train(batch)
        with torch.no_grad(), self.autocast():
            inputs = self.prepare_step(parsed)
        names = [n for n in self.get_model_names() if self._optims[n] is not None]
        optims = [self._optims[n] for n in names]
        self.model_zero_grad(names)
        loss, summary = self._loss(inputs)
        self._backward(loss)
        two_pass = [o for o in optims if optim.get_optimizer_spec(o).needs_closure]
        if two_pass and self._sam_active():
            if len(optims) != 1:
                raise ValueError(
                    "A sharpness-aware optimizer needs a single registered optimizer; this "
                    f"trainer registers {names}"
                )
            stats = self._two_pass_step(optims[0], inputs, loss)
        else:
            self._one_pass_step(optims)
            stats = {}
        self._checks.append((self.epoch, self.batch_idx, loss.detach(), summary))
        out = {"loss": loss.detach(), **summary}
        out.update(stats)
        return out

    def _one_pass_step(self, optims) -> None:
        # before OPTIM.SAM.START_EPOCH a sharpness-aware wrapper steps its base optimizer
        targets = [getattr(o, "base_optimizer", o) for o in optims]
        if self.scaler is None:
            for opt in targets:
                opt.step()
            return
        for opt in targets:
            self.scaler.step(opt)  # unscales, skips the step on inf/NaN gradients
        self.scaler.update()

    def _two_pass_step(self, opt, inputs, loss) -> dict:
        scaler = self.scaler

        def closure():
            loss_p, _ = self._loss(inputs)
            self._backward(loss_p)
            if scaler is not None:
                grads = [
                    p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None
                ]
                torch._foreach_mul_(grads, inv_scale)
            return loss_p.detach()

        if scaler is None:
            opt.step(closure, loss=loss.detach())
        else:
            # GradScaler cannot drive a closure: run the passes here with one scale for both
            scale = scaler.get_scale()
            inv_scale = 1.0 / scale
            scaler.unscale_(opt)  # first-pass gradients unscaled, inf/NaN recorded
            if not _grads_finite(opt):
                opt.zero_grad(set_to_none=True)
                scaler.update()  # backs off: the first pass overflowed
                return {}
            opt.first_step(zero_grad=True)
            closure()
            if _grads_finite(opt):
                opt.second_step()
                scaler.update()
            else:  # the perturbed pass overflowed: restore, skip, back off
                opt.restore()
                opt.zero_grad(set_to_none=True)
                scaler.update(scale * scaler.get_backoff_factor())
                return {}
        return dict(getattr(opt, "last_stats", None) or {})

    def _check_finite(self) -> None:
        """Raise on the first non-finite loss since the last check (one host sync)."""
        if not self._checks:
            return
        losses = torch.stack([c[2].float().reshape(()) for c in self._checks])
        bad = ~torch.isfinite(losses)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            epoch, batch_idx, value, summary = self._checks[i]
            terms = {k: float(v) for k, v in summary.items()}
            self._checks.clear()
            raise FloatingPointError(
                f"Loss became infinite or NaN at epoch {epoch + 1}/{self.max_epoch}, batch "
                f"{batch_idx + 1}/{self.num_batches}: loss = {float(value)}; terms = {terms}. "
                "Try a lower OPTIM.LR, PREC fp32/amp instead of fp16, or a larger ADAM_EPS."
            )
        self._checks.clear()

    # -- the epoch --------------------------------------------------------------------------
    def run_epoch(self):
        self.set_model_mode("train")
        losses = MetricMeter()
        batch_time = AverageMeter()
        data_time = AverageMeter()
        self.num_batches = len(self.train_loader_x)
        print_freq = self.cfg.TRAIN.PRINT_FREQ
        end = time.time()
        for self.batch_idx, batch in enumerate(self.train_loader_x):  # noqa: B020
            data_time.update(time.time() - end)
            loss_summary = self.forward_backward(batch)
            batch_time.update(time.time() - end)
            losses.update(loss_summary)
            n_iter = self.epoch * self.num_batches + self.batch_idx
            self.write_scalars({f"train/{k}": v for k, v in loss_summary.items()}, n_iter)
            self.write_scalar("train/lr", self.get_current_lr(), n_iter)
            meet_freq = (self.batch_idx + 1) % print_freq == 0
            if meet_freq or self.num_batches < print_freq:
                self._check_finite()
                self.flush_scalars()
                nb_remain = self.num_batches - self.batch_idx - 1
                nb_remain += (self.max_epoch - self.epoch - 1) * self.num_batches
                eta = str(datetime.timedelta(seconds=int(batch_time.avg * nb_remain)))
                logger.info(
                    f"epoch [{self.epoch + 1}/{self.max_epoch}] "
                    f"batch [{self.batch_idx + 1}/{self.num_batches}] "
                    f"time {batch_time.val:.3f} ({batch_time.avg:.3f}) "
                    f"data {data_time.val:.3f} ({data_time.avg:.3f}) "
                    f"{losses} "
                    f"lr {self.get_current_lr():.4e} "
                    f"eta {eta}"
                )
            end = time.time()
        self._check_finite()
        self.flush_scalars()
        self.update_lr()


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype a module computes in: that of its first conv/linear weight (fp16 CLIP keeps
    embeddings and norms in fp32)."""
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            return m.weight.dtype
    return next(module.parameters()).dtype


def _grads_finite(opt) -> bool:
    grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return True
    return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
