"""Dassl's ``TrainerX`` for trainer files written against Dassl, on this project's engine.

A Dassl trainer file (CoOp's ``trainers/coop.py`` and its relatives) defines ``build_model``
(loading CLIP with ``clip``, registering its learnable module with ``register_model``) and
``forward_backward(batch)``, which computes the loss, calls ``model_backward_and_update(loss)``
and, on the last batch of the epoch, ``update_lr()``. :class:`TrainerX` runs such a file with
the engine's loop, data, evaluation, checkpoints and optimizer step:

- Dassl's attributes and methods: ``cfg``, ``device``, ``dm`` (``dm.dataset.classnames``),
  ``epoch``, ``max_epoch``, ``batch_idx``, ``num_batches``, ``_models``/``_optims``/
  ``_scheds``, ``register_model``, ``get_model_names``, ``set_model_mode``, ``update_lr``,
  ``get_current_lr``, ``parse_batch_train``, ``model_inference`` (``self.model(input)``),
  ``save_model``/``load_model``, ``model_zero_grad``/``model_backward``/``model_update``;
- the LR scheduler is stepped by the trainer's own ``update_lr()`` calls, never by the engine
  (no double step);
- ``model_backward_and_update(loss)`` goes through the engine's optimizer step, so the file
  gets every optimizer, precision-independent. With a sharpness-aware optimizer
  (``OPTIM.SAM.NAME``) the second pass is a **replay**: while the optimizer evaluates the loss
  at the perturbed weights, the engine calls ``forward_backward`` again on the same batch, and
  that call ends inside its ``model_backward_and_update(loss)``, which hands the perturbed loss
  to the optimizer instead of returning. So everything the file does *after* that call
  (``update_lr`` on the last batch, the loss summary, counters) happens once, in the first
  pass; everything *before* it runs twice and must depend only on the batch and the weights.
  A file that calls the optimizer's ``step()`` itself after its own backward (CoCoOp) gets the
  same replay, ended at the replayed ``step()``.
  The replay refuses (:class:`ReplayError`) a ``forward_backward`` that changes the trainer's
  attributes, a scheduler or a learnable parameter before that call, that calls it twice in a
  step or not at all, or that steps its optimizers itself (``model_backward``/``model_update``)
  while the sharpness-aware optimizer is active. A trainer whose side effects cannot be kept
  after the call states the engine's two-step protocol instead (``prepare_step(batch)`` and
  ``compute_loss(inputs)``, no ``forward_backward``), which this class accepts too.

Its ``CLIP`` loading (``clip._download`` / ``clip.build_model`` in ``build_model``) resolves the
weights with this trainer's ``MODEL.BACKBONE`` (engine.clip.active_backbone).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F

from engine.clip import active_backbone
from engine.errors import ConfigError
from engine.registry import TRAINER_REGISTRY as _ENGINE_TRAINERS
from engine.trainer import SimpleTrainer, TrainerBase
from engine.trainer import TrainerX as _EngineTrainerX
from engine.utils import AverageMeter, MetricMeter
from optim.build import get_optimizer_spec
from optim.errors import UserError
from optim.sharpness import STEP_NEEDS
from optim.step import PassOutputs, StepBatch

from .file_errors import TrainerFileError, trainer_file_error

logger = logging.getLogger(__name__)

__all__ = [
    "AverageMeter",
    "MetricMeter",
    "ReplayError",
    "SimpleTrainer",
    "TrainerBase",
    "TrainerFileError",
    "TrainerX",
]

_DOCS = "docs/porting-trainers.md, 'Sharpness-aware optimizers'"


class ReplayError(UserError, RuntimeError):
    """A Dassl trainer's ``forward_backward`` cannot be replayed for a second pass."""


class _SecondPass(BaseException):  # noqa: N818  (control flow, not an error)
    """Ends the replayed ``forward_backward`` inside ``model_backward_and_update`` (a
    BaseException, so that a trainer's ``except Exception`` does not swallow it)."""

    def __init__(self, loss: torch.Tensor):
        super().__init__()
        self.loss = loss


class _Step:
    """The state of one training step of a Dassl trainer."""

    def __init__(self, batch):
        self.batch = batch
        self.updates = 0  # model_backward_and_update calls in the first pass
        self.replaying = False
        self.stats: dict = {}  # the optimizer's diagnostics of the step (logged with the loss)
        self.view: StepBatch | None = None  # the step as the sharpness-aware optimizer sees it
        self.in_file = False  # the file's forward_backward runs (the recorder acts)
        self.outputs: PassOutputs | None = None  # the cross-entropy recorded in this pass
        self.loss: torch.Tensor | None = None  # the loss the file backpropagated itself


def _recorded_ce(args, kwargs, out) -> PassOutputs | None:
    """``F.cross_entropy(logits [B, C], label [B])`` (mean, no weights) as the step's outputs."""
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
    bound = {**dict(zip(names, args)), **kwargs}
    logits, label = bound.get("input"), bound.get("target")
    plain = bound.get("weight") is None and bound.get("reduction", "mean") == "mean"
    plain = plain and bound.get("size_average") is None and bound.get("reduce") is None
    if not (plain and isinstance(logits, torch.Tensor) and isinstance(label, torch.Tensor)):
        return None
    if logits.dim() != 2 or label.dim() != 1 or label.dtype != torch.long:
        return None
    if len(label) != len(logits) or bool((label == bound.get("ignore_index", -100)).any()):
        return None
    smoothing = args[7] if len(args) > 7 else kwargs.get("label_smoothing", 0.0)
    return PassOutputs(logits, label, out, float(smoothing))


@contextmanager
def _recording(step: _Step):
    """While a Dassl file's ``forward_backward`` takes a sharpness-aware step: records the
    pass's ``F.cross_entropy`` (logits and labels: ESAM's per-item losses, SAF/MESA's outputs)
    and takes over the file's own ``loss.backward()`` (CoCoOp's step): the optimizer step
    backpropagates that loss itself, and in a replayed pass the call ends the pass. Only while
    ``step.in_file`` (the engine's own calls pass through). The two functions are swapped in
    for the step, not wrapped in a torch function mode, which would change the kernels of
    attention (its fast path is off under any mode) and so the results."""
    cross_entropy, backward = F.cross_entropy, torch.Tensor.backward

    def recorded_cross_entropy(*args, **kwargs):
        out = cross_entropy(*args, **kwargs)
        if step.in_file and step.outputs is None:
            step.outputs = _recorded_ce(args, kwargs, out)
        return out

    def taken_backward(self, *args, **kwargs):
        if not (step.in_file and self.dim() == 0):
            return backward(self, *args, **kwargs)
        if step.replaying:
            raise _SecondPass(self)
        step.loss = self  # backpropagated by the optimizer step (the file's optim.step())
        return None

    F.cross_entropy, torch.Tensor.backward = recorded_cross_entropy, taken_backward
    try:
        yield
    finally:
        F.cross_entropy, torch.Tensor.backward = cross_entropy, backward


def _batch_part(batch, subset: torch.Tensor):
    """The items ``subset`` of a loader batch (tensors and lists of the batch's length)."""
    size = len(batch["label"])
    idx = subset.tolist()
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == size:
            out[k] = v[subset.to(v.device)]
        elif isinstance(v, (list, tuple)) and len(v) == size:
            out[k] = type(v)(v[i] for i in idx)
        else:
            out[k] = v
    return out


def _raise_file_error(cls, e: Exception, stage: str) -> None:
    """Raise the one-paragraph :class:`TrainerFileError` of a trainer file's failure (not the
    engine's own errors, which say what to do already); return when ``e`` is not one."""
    if isinstance(e, (UserError, FloatingPointError)):
        return
    error = trainer_file_error(cls, e, stage)
    if error is not None:
        raise error from e


def _is_dassl_trainer(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, TrainerX)


class TrainerX(_EngineTrainerX):
    """Dassl's ``TrainerX`` (see the module docstring). Subclass it in a trainer file as with
    Dassl; register it with ``dassl.engine.TRAINER_REGISTRY``."""

    ENGINE_STEPS_LR = True  # set per subclass below
    _replaces = None  # the project's trainer of the same name this one replaced, if any

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # a file's forward_backward steps the LR itself (update_lr() on the last batch); with
        # the two-step protocol (no forward_backward) the engine does, as for its own trainers
        cls.ENGINE_STEPS_LR = cls.forward_backward is _EngineTrainerX.forward_backward

    @classmethod
    def add_config(cls, cfg) -> None:
        """The keys of the project's trainer of the same name, when this class replaced one
        (e.g. CoOp's file reads ``TRAINER.COOP``), and those that the ``train.py`` of a known
        neighbour declares for a file of this name (``FILE_KEYS`` of engine/neighbour_keys.py,
        e.g. ``TRAINER.COOP.W`` for KgCoOp's file); keys the config has are kept."""
        from engine.neighbour_keys import add_file_keys

        replaced = cls.__dict__.get("_replaces")
        if replaced is not None:
            replaced.add_config(cfg)
        add_file_keys(cfg, cls.__name__)

    @classmethod
    def translate_key(cls, key: str, value, source: str) -> list[tuple[str, object]]:
        """The neighbours' ``CTX_INIT True``/``False`` (a bool in their ``train.py``; their
        files then use "a photo of a" or a random context) as the words this project's string
        key holds; other keys unchanged (the file reads its own nodes)."""
        from engine.neighbour_keys import ctx_init_words

        return ctx_init_words(key, value)

    @classmethod
    def translate_cfg(cls, cfg) -> None:
        replaced = cls.__dict__.get("_replaces")
        if replaced is not None:
            replaced.translate_cfg(cfg)

    def __init__(self, cfg, classnames: list[str] | None = None):
        self._step = None
        self._file_scaler = None
        try:
            with active_backbone(cfg):  # clip._download / clip.build_model use MODEL.BACKBONE
                super().__init__(cfg, classnames=classnames)
        except Exception as e:
            _raise_file_error(type(self), e, "while building its model (build_model)")
            raise
        for opt in self._optims.values():  # files that call self.optim.step() themselves
            if opt is not None and get_optimizer_spec(opt).kind == "sharpness":
                opt.step = partial(self._file_optimizer_step, opt)

    # -- what the file manages itself -----------------------------------------------------
    def _precision(self, cfg) -> str:
        """The file casts its model and keeps its own GradScaler: the engine's step runs in fp32
        mode (no autocast, no scaler of its own)."""
        return "fp32"

    @property
    def scaler(self):
        """The file's own GradScaler (``self.scaler = GradScaler()`` in ``build_model``)."""
        return self._file_scaler

    @scaler.setter
    def scaler(self, scaler) -> None:
        self._file_scaler = scaler

    def compile_model(self) -> list[str]:
        """Not compiled: engine.compile knows the project's models only."""
        return []

    def model_inference(self, input):
        return self.model(input)

    def before_train(self):
        if not self.ENGINE_STEPS_LR and self.cfg.OPTIM.get("LR_STEP_PER_BATCH", False):
            raise ConfigError(
                "OPTIM.LR_STEP_PER_BATCH is True, but a Dassl trainer file steps its LR scheduler "
                "itself (update_lr() in forward_backward): set OPTIM.LR_STEP_PER_BATCH False"
            )
        if self._file_scaler is not None and self.optim_step.sharp:
            raise ConfigError(
                f"{type(self).__name__} steps its own GradScaler (its PREC amp branch), which "
                f"cannot drive the sharpness-aware optimizer {self.cfg.OPTIM.SAM.NAME!r} (its "
                "step takes the loss, not scaled gradients): use PREC fp32 or fp16 with "
                "OPTIM.SAM.NAME"
            )
        super().before_train()

    # -- the step ---------------------------------------------------------------------------
    def step_gives(self) -> frozenset[str]:
        """Everything the optimizer step may need (the replay gives the passes, the recorder
        the logits): a Dassl file runs with every optimizer."""
        return frozenset(STEP_NEEDS)

    def train_step(self, batch) -> dict:
        if self.ENGINE_STEPS_LR:  # the two-step protocol: the engine's forward_backward
            return super().train_step(batch)
        self._step = step = _Step(batch)
        sharp = self.optim_step.sharpness_active(self.epoch)
        try:
            if sharp:  # the step's contract: opened before the first forward, passes replayed
                index = batch.get("index") if isinstance(batch, dict) else None
                if index is not None:
                    index = torch.as_tensor(index).to(self.device)
                step.view = StepBatch(partial(self._file_pass, step), index)
                with _recording(step):
                    self.optim_step.begin_step(step.view, self.epoch)
                    step.in_file = True
                    summary = self.forward_backward(batch)
            else:
                summary = self.forward_backward(batch)
        except BaseException as e:
            if sharp and step.updates == 0:
                self.optim_step.abort_step(self.epoch)  # e.g. RWP's perturbed weights back
            if isinstance(e, Exception):
                where = f"epoch {self.epoch + 1}, batch {self.batch_idx + 1}"
                _raise_file_error(type(self), e, f"in a training step (forward_backward, {where})")
            raise
        finally:
            self._step = None
        if step.updates == 0 and sharp:
            raise ReplayError(
                f"{type(self).__name__}.forward_backward did not call "
                f"model_backward_and_update(loss), but the sharpness-aware optimizer "
                f"{self.cfg.OPTIM.SAM.NAME!r} needs it for its second pass (a step taken "
                f"another way): call it with the step's loss, or state the two-step protocol "
                f"({_DOCS})"
            )
        if isinstance(summary, dict):
            summary = {**summary, **step.stats}
        return summary

    def _update(self, step: _Step, loss: torch.Tensor) -> None:
        """The first pass's update: the optimizer step with the replay as its passes."""
        step.updates += 1
        step.view.first, step.outputs = step.outputs, None
        step.in_file = False
        try:
            step.stats = self.optim_step(loss, step.view.loss, self.epoch, batch=step.view)
        finally:
            step.in_file = True

    def model_backward_and_update(self, loss: torch.Tensor, names=None) -> None:
        """Backward and update through the engine's optimizer step (see the module docstring);
        in the replayed pass, hands ``loss`` to the sharpness-aware optimizer."""
        step = self._step
        if step is not None and step.replaying:
            raise _SecondPass(loss)
        two_pass = self.optim_step.sharpness_active(self.epoch)
        all_names = self.get_model_names()
        if names is not None and sorted(self.get_model_names(names)) != sorted(all_names):
            if two_pass:
                raise ReplayError(
                    f"model_backward_and_update(names={names!r}) updates some of the models "
                    f"({all_names}); a sharpness-aware optimizer updates them all in one step"
                )
            self.model_zero_grad(names)
            self.model_backward(loss)
            self.model_update(names)
            return
        self.detect_anomaly(loss)
        if two_pass and step is None:
            raise ReplayError(
                "model_backward_and_update(loss) was called outside the training loop: the "
                "sharpness-aware second pass replays forward_backward(batch), so call it from "
                "forward_backward"
            )
        if two_pass and step.updates:
            raise ReplayError(
                f"{type(self).__name__}.forward_backward calls model_backward_and_update more "
                "than once per step: a sharpness-aware optimizer takes one loss per step. Sum "
                f"the losses into one call, or state the two-step protocol ({_DOCS})"
            )
        if two_pass:
            self._update(step, loss)
            return
        stats = self.optim_step(loss, None, self.epoch)  # a one-pass optimizer
        if step is not None:
            step.updates += 1
            step.stats = stats

    def _file_optimizer_step(self, opt, closure=None, **kwargs):
        """``step()`` of a sharpness-aware optimizer that the file calls itself after its own
        ``loss.backward()`` (CoCoOp's ``optim.zero_grad(); loss.backward(); optim.step()``):
        the recorder took that backward over, so the step is the engine's, with that loss and
        the replay (ended at the replayed ``loss.backward()``) as its passes. The engine's own
        calls pass a closure."""
        if closure is not None or kwargs:
            return type(opt).step(opt, closure, **kwargs)
        if not self.optim_step.sharpness_active(self.epoch):
            return opt.base_optimizer.step()  # before its stage: the base optimizer
        step = self._step
        if step is None:
            raise ReplayError(
                "A sharpness-aware optimizer's step() was called outside forward_backward: its "
                "second pass replays forward_backward(batch)"
            )
        if step.replaying or step.loss is None:
            raise ReplayError(
                f"{type(self).__name__}.forward_backward calls its optimizer's step() without a "
                "loss.backward() before it (on the step's loss, a 0-d tensor): the sharpness-"
                f"aware optimizer needs that loss. Call model_backward_and_update(loss) ({_DOCS})"
            )
        if step.updates:
            raise ReplayError(
                f"{type(self).__name__}.forward_backward steps its optimizer more than once per "
                f"step: a sharpness-aware optimizer takes one loss per step ({_DOCS})"
            )
        loss, step.loss = step.loss, None
        self._update(step, loss)

    def _file_pass(self, step: _Step, subset: torch.Tensor | None):
        """A pass at the current weights, for the optimizer (:class:`optim.step.StepBatch`):
        ``forward_backward`` replayed on the batch (or its items ``subset``), ended inside its
        ``model_backward_and_update`` (or its ``loss.backward()``); ``(loss, recorded
        cross-entropy)``."""
        batch = step.batch if subset is None else _batch_part(step.batch, subset)
        before = self._snapshot()
        in_file, step.in_file, step.replaying, step.outputs = step.in_file, True, True, None
        try:
            self.forward_backward(batch)
        except _SecondPass as done:
            loss = done.loss
        else:
            raise ReplayError(
                f"The replayed {type(self).__name__}.forward_backward (a sharpness-aware "
                "optimizer's pass, same batch) returned without calling model_backward_and_update"
                "(loss) or loss.backward(): its path must not depend on state that the "
                f"first pass changed ({_DOCS})"
            )
        finally:
            step.replaying, step.in_file = False, in_file
        outputs, step.outputs = step.outputs, None
        changed = self._changes(before)
        if changed:
            raise ReplayError(
                f"The replayed {type(self).__name__}.forward_backward (the sharpness-aware "
                f"second pass) changed {', '.join(changed)} before model_backward_and_update("
                "loss): everything before that call runs twice. Move such side effects after "
                f"the call, or state the two-step protocol ({_DOCS})"
            )
        return loss, outputs

    def _snapshot(self) -> dict:
        attrs = {k: (id(v), v if isinstance(v, (int, float, str, bool)) else None)
                 for k, v in vars(self).items() if k != "_step"}  # fmt: skip
        params = {
            id(p): p._version
            for opt in self._optims.values()
            if opt is not None
            for group in opt.param_groups
            for p in group["params"]
        }
        scheds = {n: getattr(s, "last_epoch", None) for n, s in self._scheds.items()}
        return {"attrs": attrs, "params": params, "scheds": scheds}

    def _changes(self, before: dict) -> list[str]:
        after = self._snapshot()
        changed = [
            f"self.{k}"
            for k in sorted(set(before["attrs"]) | set(after["attrs"]))
            if before["attrs"].get(k) != after["attrs"].get(k)
        ]
        changed += [
            f"the LR scheduler of {n!r} (update_lr)"
            for n in before["scheds"]
            if before["scheds"][n] != after["scheds"].get(n)
        ]
        if any(after["params"].get(i) != v for i, v in before["params"].items()):
            changed.append("a learnable parameter (an optimizer step or an in-place update)")
        return changed

    # -- Dassl's separate steps (one-pass optimizers) ---------------------------------------
    def _refuse_two_pass(self, what: str) -> None:
        if self.optim_step.sharpness_active(self.epoch):
            raise ReplayError(
                f"{what} with the sharpness-aware optimizer {self.cfg.OPTIM.SAM.NAME!r}: it "
                "needs the loss of both passes, so call model_backward_and_update(loss) once "
                f"per step, or state the two-step protocol ({_DOCS})"
            )

    def model_backward(self, loss: torch.Tensor) -> None:
        """Dassl's ``model_backward``: anomaly check and ``loss.backward()``."""
        self._refuse_two_pass(f"{type(self).__name__} calls model_backward(loss)")
        self.detect_anomaly(loss)
        loss.backward()

    def model_update(self, names=None) -> None:
        """Dassl's ``model_update``: step the optimizers of ``names`` (default all)."""
        self._refuse_two_pass(f"{type(self).__name__} calls model_update()")
        for name in self.get_model_names(names):
            opt = self._optims[name]
            if opt is not None:  # before its stage, a sharpness-aware wrapper steps its base
                getattr(opt, "base_optimizer", opt).step()

    def prograd_backward_and_update(self, loss_a, loss_b, lambda_=1.0, names=None) -> None:
        """ProGrad's step (the Dassl fork of ProGrad, Zhu et al. ICCV 2023): update along the
        gradient of ``loss_a``, with its component against the gradient of ``loss_b`` removed
        (times ``lambda_``) per parameter where the two conflict (negative cosine).

        One-pass optimizers only: a sharpness-aware optimizer is refused (ReplayError).
        """
        self._refuse_two_pass(f"{type(self).__name__} calls prograd_backward_and_update()")
        names = self.get_model_names(names)
        params = [p for n in names for p in self._models[n].parameters() if p.requires_grad]
        self.model_zero_grad(names)
        self.detect_anomaly(loss_b)
        guide = torch.autograd.grad(loss_b, params, retain_graph=True, allow_unused=True)
        self.detect_anomaly(loss_a)
        loss_a.backward()
        with torch.no_grad():
            for p, g_b in zip(params, guide):
                if p.grad is None or g_b is None:
                    continue
                unit_b = (g_b / torch.linalg.norm(g_b)).flatten()
                along = torch.dot(p.grad.flatten(), unit_b)  # the projection of g_a on g_b
                if along < 0:  # conflicting: remove lambda_ x the component against g_b
                    p.grad -= lambda_ * along * unit_b.view_as(p.grad)
        self.model_update(names)


class _DasslTrainerRegistry:
    """Dassl's ``TRAINER_REGISTRY``: registers into the project's trainer registry.

    A Dassl trainer named like one of the project's (CoOp's file registers ``CoOp``) replaces
    it for this process, keeping its config keys (the file reads the same ``TRAINER.<NODE>``);
    a warning says so.
    """

    def register(self, obj=None, force: bool = False):
        if obj is None:
            return partial(self._register, force=force)
        return self._register(obj, force=force)

    def _register(self, obj, force: bool = False):
        name = obj.__name__
        existing = _ENGINE_TRAINERS.get(name) if name in _ENGINE_TRAINERS else None
        if existing is not None and existing is not obj and not _is_dassl_trainer(existing):
            if _is_dassl_trainer(obj):
                obj._replaces = existing
            logger.warning(
                "The trainer %s of %s replaces this project's trainer of that name (%s.%s) in "
                "this process",
                name,
                obj.__module__,
                existing.__module__,
                existing.__qualname__,
            )
            force = True
        _ENGINE_TRAINERS.register(obj, force=force)
        return obj

    def get(self, name: str):
        return _ENGINE_TRAINERS.get(name)

    def registered_names(self) -> list[str]:
        return _ENGINE_TRAINERS.registered_names()

    def __contains__(self, name) -> bool:
        return name in _ENGINE_TRAINERS

    def __iter__(self):
        return iter(_ENGINE_TRAINERS)

    def __len__(self) -> int:
        return len(_ENGINE_TRAINERS)


TRAINER_REGISTRY = _DasslTrainerRegistry()


def __getattr__(name: str):
    """``SummaryWriter`` (DePT's trainers import it from here), from tensorboard on demand."""
    if name == "SummaryWriter":
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
