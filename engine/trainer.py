"""Trainer base classes with Dassl's vocabulary: TrainerBase, SimpleTrainer, TrainerX.

A trainer states two things (the step protocol):

(a) ``prepare_step(batch)``: what it computes without gradients, once per step (frozen encoder
    outputs, teacher features, per-step random choices); run under ``torch.no_grad()``, and
(b) ``compute_loss(inputs)``: its loss (and a dict of scalars to log) from those inputs.

A trainer computes its cross-entropy with ``self.classification_loss(logits, label)``, which
records the pass's logits for the step (per-item losses for ESAM's selection, the outputs for
SAF/MESA's trajectory loss); ``select_inputs(inputs, subset)`` takes the prepared inputs of a
part of the batch (a second pass on selected items). The engine runs (b) and hands the loss,
with a function that re-runs (b), and the batch (:class:`optim.step.StepBatch`: the loss on all
or part of it, the recorded outputs, the items' dataset indices) to the optimizer's step object
(:class:`optim.step.OptimizerStep`, built from ``OPTIM``), which owns backward, precision
scaling, sharpness-aware second passes and staging. So trainers contain no optimizer-specific
code. The engine detects NaN/inf losses and parameters (raising with epoch,
batch and loss terms; the run folder is marked as diverged), writes per-step diagnostics and
steps the LR scheduler once per epoch (and, with ``OPTIM.LR_STEP_PER_BATCH``, after every batch
of the sharpness-aware stage too).

The other concerns live next to this file: the step protocol's trainer methods and Dassl's
step names (:mod:`engine.step_protocol`), checkpoint I/O (:mod:`engine.checkpoint`), scalar
writers (:mod:`engine.writers`), evaluation and the feature cache (:mod:`engine.evaluation`);
the staging rule is :mod:`optim.staging`. The step's contract (``begin_step`` before the first
forward, what the optimizer needs) is checked by the optimizer step itself.

A trainer's model can be built without any dataset: ``build_trainer(cfg, classnames=[...])``
(or ``Trainer(cfg, classnames=...)``) skips the data loaders.
"""

from __future__ import annotations

import datetime
import logging
import os.path as osp
import time
from collections import OrderedDict
from contextlib import nullcontext
from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from optim.sharpness import STEP_NEEDS
from optim.staging import total_epochs
from optim.step import PassOutputs, StepBatch, build_step

from . import distributed, phases
from .checkpoint import CheckpointMixin
from .compile import AUTO, compile_encoders, eager, mark_step, resolve_compile
from .compile_cache import auto_compiles
from .cost import RunCost
from .data import DataManager
from .errors import ConfigError
from .evaluation import EvaluationMixin, compute_dtype
from .evaluator import build_evaluator
from .finite import FiniteWatch
from .run_folder import clear_divergence, write_divergence
from .step_protocol import STEP_FIX, DasslStepNames, StepProtocol, batch_len
from .trainer_interface import TrainerInterface
from .utils import AverageMeter, MetricMeter, epoch_seed, set_random_seed
from .validate import validate_cfg
from .writers import ScalarWriter

logger = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "amp", "bf16")

# The end-of-training lines of Dassl's current ("Finish training": CoOp's parse_test_res.py
# starts reading results after it) and older versions ("Finished training": the parsers of
# MaPLe, PromptSRC and KgCoOp); each is written alone on its line, as their parsers compare
# whole (stripped) lines.
TRAIN_END_LINES = ("Finish training", "Finished training")


def _scalar_row_before(row: dict, start_iter: int, start_epoch: int) -> bool:
    """Whether a ``scalars.jsonl`` row precedes a (re)start at ``start_epoch`` (training rows are
    indexed by iteration, evaluation rows by epoch). The final test's rows (``test/``) come
    after the last checkpoint: a resumed run always writes them again."""
    step = row.get("step", 0)
    if any(k.startswith("train/") for k in row):
        return step < start_iter
    if any(k.startswith("test/") for k in row):
        return False
    return step < start_epoch


class ModelOutput(NamedTuple):
    """What every trainer's :meth:`TrainerX.model_outputs` returns for a batch of images.

    Attributes:
        image_features: L2-normalised image features ``[batch, dim]``.
        text_features: L2-normalised class text features ``[n_cls, dim]``, or ``[batch, n_cls,
            dim]`` when they depend on the image (CoCoOp).
        logits: ``[batch, n_cls]``.
    """

    image_features: torch.Tensor
    text_features: torch.Tensor
    logits: torch.Tensor


class TrainerBase(TrainerInterface, DasslStepNames, CheckpointMixin):
    """Registered models/optimizers/schedulers, checkpoints, scalar writers and the epoch loop."""

    EVAL_ONLY = False  # True: nothing to train (zero-shot CLIP); grids and tests skip training

    def __init__(self):
        self._models: OrderedDict[str, nn.Module] = OrderedDict()
        self._optims: OrderedDict[str, torch.optim.Optimizer | None] = OrderedDict()
        self._scheds: OrderedDict[str, object] = OrderedDict()
        self.writer = ScalarWriter()

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

    # -- checkpoints: engine.checkpoint.CheckpointMixin --------------------------------------

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
        self.writer.open(self.output_dir, log_dir)

    def close_writer(self) -> None:
        self.writer.close()

    def write_scalar(self, tag: str, value, global_step: int) -> None:
        """Queue a scalar (a number or a 0-d tensor); written at the next flush."""
        self.writer.add({tag: value}, global_step)

    def write_scalars(self, values: dict, global_step: int) -> None:
        self.writer.add(values, global_step)

    def flush_scalars(self) -> None:
        self.writer.flush()

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
        except FloatingPointError as e:
            self.on_divergence(e)
            raise
        finally:
            self.close_writer()

    def on_divergence(self, error: FloatingPointError) -> None:
        """Called when training diverged (NaN/inf), before the error propagates."""

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


class SimpleTrainer(EvaluationMixin, TrainerBase):
    """A trainer with one data manager, one evaluator and the engine's step protocol.

    Args:
        cfg: the merged config.
        classnames: build the model for these classes without reading any dataset (no data
            loaders: ``test()`` and ``train()`` need a dataset, the model and its parts work).
    """

    def __init__(self, cfg, classnames: list[str] | None = None):
        super().__init__()
        validate_cfg(cfg)  # OPTIM/TRAIN/TEST values, before anything is built
        self.check_cfg(cfg)
        if torch.cuda.is_available() and cfg.USE_CUDA:
            self.device = torch.device("cuda")
            torch.backends.cudnn.benchmark = True
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        else:
            self.device = torch.device("cpu")
        self.start_epoch = self.epoch = 0
        self.max_epoch = total_epochs(cfg.OPTIM)  # MAX_EPOCH + OPTIM.SAM.STAGE2_EPOCHS
        self.output_dir = cfg.OUTPUT_DIR
        self.cfg = cfg
        self.prec = self._precision(cfg)
        self.finite = FiniteWatch()  # NaN/inf losses and parameters, checked at PRINT_FREQ
        if cfg.SEED >= 0:  # the same seed gives the same model (e.g. random prompt init) in-process
            set_random_seed(cfg.SEED)
        self.compile_mode = resolve_compile(cfg.MODEL.COMPILE, self.device.type)
        self.compiled_modules: list[str] | None = None  # None: compile_model() not run yet
        phases.enter("dataset")  # start-up phases (engine.phases)
        if classnames is None:
            self.build_data_loader()
        else:
            self.set_classnames(classnames)
        phases.enter("model build")
        self.build_model()
        if isinstance(getattr(self, "model", None), nn.Module):
            from .clip.model import check_input_size  # lazily, as every engine use of open_clip
            from .clip.text import configure_text_encoders, text_options

            check_input_size(cfg, self.model)  # the CLIP image tower's size
            # the MODEL.TEXT_* keys (TEXT_MEMORY auto: chosen for this model and free memory)
            configure_text_encoders(self.model, text_options(cfg, self.model, self.device))
        if cfg.MODEL.COMPILE != AUTO:  # an explicit mode: evaluation-only runs compile too
            self.compile_model()
        self.optim_step = build_step(
            cfg, list(self._optims.values()), precision=self.prec, device_type=self.device.type
        )
        distributed.attach(self)  # data-parallel (#29): the step's gradient sync
        self.evaluator = build_evaluator(cfg, lab2cname=self.lab2cname)
        self.best_result = -float("inf")

    def compile_model(self) -> list[str]:
        """Compile the prompt-dependent encoders with the resolved ``MODEL.COMPILE`` mode
        (engine.compile; ``auto`` compiles when training starts). Idempotent; returns the names of
        the compiled modules."""
        model = getattr(self, "model", None)
        if self.compile_mode and self.compiled_modules is None and isinstance(model, nn.Module):
            if self.cfg.MODEL.COMPILE == AUTO and not auto_compiles(self):  # engine.compile_cache
                self.compiled_modules = []
                return []
            self.compiled_modules = compile_encoders(model, self.compile_mode)
        return self.compiled_modules or []

    def compiled_batch(self, n: int, full: int, training: bool = True):
        """A context for a batch of ``n`` items where the compiled encoders take ``full``: a
        smaller batch (the last of an epoch or test set) runs eagerly, outside the graphs. With
        ``MODEL.COMPILE auto`` evaluation (``training`` False) runs eagerly too: an evaluation
        calls the encoders too few times to repay compiling its no-grad graphs."""
        if not self.compiled_modules:
            return nullcontext()
        mark_step()
        auto_eval = not training and self.cfg.MODEL.COMPILE == AUTO
        return eager() if n < full or auto_eval else nullcontext()

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler of PREC amp (owned by the optimizer step), else None."""
        return self.optim_step.scaler

    @scaler.setter
    def scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        self.optim_step.scaler = scaler

    @property
    def classnames(self) -> list[str]:
        """The class names the model is built for (the dataset's, or those given)."""
        return self.dm.dataset.classnames if self.dm is not None else self._classnames

    # -- configuration ----------------------------------------------------------------------
    def check_cfg(self, cfg) -> None:
        """Validate trainer-specific config values (override); raise ValueError naming the key."""

    def trainer_cfg(self, cfg=None):
        """This trainer's ``TRAINER.<NODE>`` node (None if it has none), see config_node()."""
        cfg = cfg or self.cfg
        return cfg.TRAINER.get(self.config_node(), None)

    def cfg_key(self, key: str) -> str:
        """The full name of this trainer's key ``key``, e.g. "TRAINER.COOP.N_CTX" (messages)."""
        return f"TRAINER.{self.config_node()}.{key}"

    def _precision(self, cfg) -> str:
        node = self.trainer_cfg(cfg)
        prec = node.PREC if node is not None and "PREC" in node else "fp32"
        if prec not in PRECISIONS:
            raise ConfigError(f"{self.cfg_key('PREC')} must be one of {PRECISIONS}, got {prec!r}")
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
    def set_classnames(self, classnames: list[str]) -> None:
        """No dataset: the classes alone (Dassl's attributes set, loaders None)."""
        self._classnames = list(classnames)
        self.dm = self.train_loader_x = self.val_loader = self.test_loader = None
        self.num_classes = len(self._classnames)
        self.num_source_domains = 1
        self.lab2cname = dict(enumerate(self._classnames))

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
        if self.dm is None:
            raise RuntimeError("This trainer was built from class names only: it has no data")
        phases.enter("resume")
        self.optim_step.check(self.cfg.OPTIM.SAM.NAME, self.max_epoch)
        self.optim_step.check_caller(self.step_gives(), f"{type(self).__name__}'s step", STEP_FIX)
        self.compile_model()
        directory = self.cfg.RESUME or self.cfg.OUTPUT_DIR
        self.start_epoch = self.resume_model_if_exist(directory)
        distributed.broadcast_state(self)  # data-parallel (#29): every process starts as rank 0
        dm = getattr(self, "dm", None)
        if dm is not None and self.start_epoch < self.max_epoch:
            phases.enter("caches")
            dm.cache_training_images()
        if self.start_epoch > 0:  # the final test of a run resumed after its last epoch
            self.epoch = self.start_epoch - 1  # logs at that epoch, as without the interruption
        # rows of a killed run after its last checkpoint (or of one killed before its first)
        # are written again from here: drop them, so each step is in the logs once
        start_iter = self.start_epoch * len(self.train_loader_x) if self.start_epoch else 0
        keep = partial(_scalar_row_before, start_iter=start_iter, start_epoch=self.start_epoch)
        self.writer.open(self.output_dir, osp.join(self.output_dir, "tensorboard"), keep=keep)
        self.time_start = time.time()
        self.cost = RunCost(self.device, self.output_dir, self._cost_meta(), self.start_epoch > 0)
        phases.enter("first batch")

    def after_train(self):
        for line in TRAIN_END_LINES:
            logger.info(line)
        self.log_cost()
        do_test = not self.cfg.TEST.NO_TEST
        if do_test:
            if self.cfg.TEST.FINAL_MODEL == "best_val":
                logger.info("Deploy the model with the best val performance")
                distributed.barrier()  # data-parallel (#29): rank 0 has written model-best
                self.load_model(self.output_dir)
            else:
                logger.info("Deploy the last-epoch model")
            self.test()
        if distributed.is_main_process():  # data-parallel (#29): one writer
            clear_divergence(self.output_dir)  # finished: a diverged-and-resumed run recovered
        phases.run_ended(getattr(self, "cost", None))  # cost.json's wall_s
        elapsed = str(datetime.timedelta(seconds=round(time.time() - self.time_start)))
        logger.info("Elapsed: %s", elapsed)

    def _cost_meta(self) -> dict:
        """What ``cost.json`` says the run is (engine.cost)."""
        optim = self.cfg.OPTIM
        return {
            "optimizer": optim.SAM.NAME or optim.NAME,
            "base_optimizer": optim.NAME,
            "every": optim.SAM.get("EVERY", 0),
            "trainer": self.cfg.TRAINER.NAME,
            "device": self.device.type,
            "precision": self.prec,
            "batch_size": self.cfg.DATALOADER.TRAIN_X.BATCH_SIZE,
            "trainable_params": sum(  # the cost table's column (experiments/cost_table.py)
                p.numel() for m in self._models.values() for p in m.parameters() if p.requires_grad
            ),
            **distributed.cost_meta(),  # data-parallel (#29): the number of processes
        }

    def log_cost(self) -> None:
        """Log the run's training cost (``cost.json``, written after every epoch)."""
        cost = getattr(self, "cost", None)
        if cost is None or not cost.steps:
            return
        out = cost.summary()
        cuda = out["peak_cuda_mb"]
        logger.info(
            "Training cost: %d steps, %.1f s (%.4f s per step), peak CPU RSS %.0f MiB%s",
            out["steps"],
            out["train_time_s"],
            out["mean_step_s"],
            out["peak_cpu_rss_mb"],
            "" if cuda is None else f", peak CUDA {cuda:.0f} MiB",
        )

    def on_divergence(self, error: FloatingPointError) -> None:
        """Write ``diverged.json`` (epoch, batch, message): a re-run into this folder then
        refuses to resume past the divergence unless asked (train.py --force-resume)."""
        if not distributed.is_main_process():  # data-parallel (#29): one writer
            return
        write_divergence(
            self.output_dir,
            epoch=self.epoch + 1,
            batch=getattr(self, "batch_idx", -1) + 1,
            message=str(error),
        )

    def before_epoch(self):
        if self.cfg.SEED >= 0:  # every epoch starts from a seed of its own: exact resume
            set_random_seed(epoch_seed(self.cfg.SEED, self.epoch) + 1)
        sampler = getattr(self.train_loader_x, "sampler", None)
        shards = getattr(self.train_loader_x, "batch_sampler", None)  # data-parallel (#29)
        sampler = shards if hasattr(shards, "set_epoch") else sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        self.optim_step.begin_epoch(self.epoch, self._models)

    def after_epoch(self):
        last_epoch = (self.epoch + 1) == self.max_epoch
        do_test = not self.cfg.TEST.NO_TEST
        freq = self.cfg.TRAIN.CHECKPOINT_FREQ
        meet_checkpoint_freq = (self.epoch + 1) % freq == 0 if freq > 0 else False
        if do_test and self.cfg.TEST.FINAL_MODEL == "best_val" and self.val_loader is not None:
            curr_result = self.test(split="val")
            if curr_result > self.best_result:
                self.best_result = curr_result
                if distributed.is_main_process():  # data-parallel (#29): one writer
                    self.save_model(
                        self.epoch, self.output_dir, val_result=curr_result, is_best=True
                    )
        if not distributed.is_main_process():  # data-parallel (#29): one writer
            return
        if meet_checkpoint_freq or last_epoch:
            self.save_model(self.epoch, self.output_dir)  # also drops an older rolling one
        else:  # a kill loses at most this epoch (TRAIN.CHECKPOINT_FREQ keeps Dassl's meaning)
            self.save_rolling_checkpoint(self.epoch, self.output_dir)

    # -- evaluation: engine.evaluation.EvaluationMixin -----------------------------------------


class TrainerX(StepProtocol, SimpleTrainer):
    """A trainer over labelled data (``train_loader_x``) with the engine's step protocol."""

    # True: the engine steps the LR scheduler at the end of every epoch (and per batch with
    # OPTIM.LR_STEP_PER_BATCH). False: the trainer's own code steps it (Dassl's trainers call
    # update_lr() on the last batch inside forward_backward; the dassl compatibility layer)
    ENGINE_STEPS_LR = True

    _pass_outputs: PassOutputs | None = None  # what classification_loss recorded this pass

    # -- the step protocol ------------------------------------------------------------------
    def step_gives(self) -> frozenset[str]:
        """What this trainer's step gives the optimizer (:data:`optim.sharpness.STEP_NEEDS`):
        everything with the engine's step (:meth:`forward_backward`), nothing with a
        ``forward_backward`` or ``train_step`` of its own (one-pass optimizers only)."""
        own = type(self).forward_backward is not TrainerX.forward_backward
        own = own or type(self).train_step is not TrainerX.train_step
        return frozenset() if own else frozenset(STEP_NEEDS)

    def parse_batch_train(self, batch):
        dev = self.device
        return batch["img"].to(dev, non_blocking=True), batch["label"].to(dev, non_blocking=True)

    def model_outputs(self, image: torch.Tensor) -> ModelOutput:
        """Image features, text features and logits of ``image`` (a batch on the device) with
        the current parameters: the one way to read any trainer's model (evaluation code,
        tools and tests use it). Runs with gradients unless called under ``torch.no_grad()``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement model_outputs()")

    def model_inference(self, input):
        """Evaluation logits of a batch (default: ``model_outputs(input).logits``)."""
        return self.model_outputs(input).logits

    def train_step(self, batch) -> dict:
        """One training step as the epoch loop calls it (default: :meth:`forward_backward`)."""
        return self.forward_backward(batch)

    def forward_backward(self, batch) -> dict:
        """One training step: prepare (no grad) -> loss -> the optimizer step (backward, update)."""
        size = batch_len(batch)
        full = distributed.shard_size(self.cfg.DATALOADER.TRAIN_X.BATCH_SIZE)  # #29: its share
        with self.compiled_batch(size, full):
            parsed = self.parse_batch_train(batch)
            with torch.no_grad(), self.autocast():
                inputs = self.prepare_step(parsed)
            index = batch.get("index") if isinstance(batch, dict) else None
            if index is not None:
                index = torch.as_tensor(index).to(self.device, non_blocking=True)
            step_batch = StepBatch(partial(self._pass, inputs, size=size), index)
            step_batch.count = size  # data-parallel (#29): this process's share of the step
            self.optim_step.begin_step(step_batch, self.epoch)
            self._pass_outputs = None
            loss, summary = self._loss(inputs)
            step_batch.first = self._pass_outputs
            stats = self.optim_step(
                loss, lambda: self._loss(inputs)[0], self.epoch, batch=step_batch
            )
        self.finite.record(self.epoch, self.batch_idx, loss, summary)
        out = {"loss": loss.detach(), **summary}
        out.update(stats)
        return out

    def _check_finite(self) -> None:
        """Raise on a non-finite loss or parameter since the last check (engine.finite)."""
        params = [
            (f"{name}.{pname}", p)
            for name in self.get_model_names()
            for pname, p in self._models[name].named_parameters()
            if p.requires_grad
        ]
        self.finite.check(params, self.max_epoch, self.num_batches)

    # -- the epoch --------------------------------------------------------------------------
    def epoch_batches(self):
        """The training batches of this epoch, a sized iterable (default: ``train_loader_x``;
        SkipTuning's batches of precomputed features, trainers/skiptuning.py)."""
        return self.train_loader_x

    def run_epoch(self):
        self.set_model_mode("train")
        losses = MetricMeter()
        batch_time = AverageMeter()
        data_time = AverageMeter()
        batches = self.epoch_batches()
        self.num_batches = len(batches)
        print_freq = self.cfg.TRAIN.PRINT_FREQ
        cost = getattr(self, "cost", None)
        if cost is not None:
            cost.start_epoch(self.epoch)
        end = time.time()
        for self.batch_idx, batch in enumerate(batches):  # noqa: B020
            data_time.update(time.time() - end)
            phases.enter("first step")  # start-up phases: no-ops after the run's first step
            loss_summary = self.train_step(batch)
            phases.first_step_done(cost, self.device)
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
            if self.ENGINE_STEPS_LR and self.optim_step.lr_step_per_batch(self.epoch):
                self.update_lr()  # the released SAMPLe trainers' per-batch step (besides below)
            end = time.time()
        if cost is not None:
            cost.end_epoch(self.epoch, self.num_batches)
        self._check_finite()
        self.flush_scalars()
        if self.ENGINE_STEPS_LR:
            self.update_lr()


__all__ = [
    "PRECISIONS",
    "ModelOutput",
    "SimpleTrainer",
    "TrainerBase",
    "TrainerX",
    "compute_dtype",
]
