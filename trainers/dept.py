"""DePT: decoupled prompt tuning (Zhang et al., CVPR 2024), a plug-in over CoOp, CoCoOp, KgCoOp
and MaPLe.

DePT keeps the base learner (its prompts, its features, its loss) and adds a channel-adjusted
transfer (CAT) head on the base classes. With ``f`` the image feature and ``t_c`` the text
feature of class ``c`` as the base learner's encoders give them (NOT L2-normalised), the head is
a channel-wise transform (cwT: a learnable scale and shift per channel, one for each tower,
starting at 1 and 0) followed by a linear classifier ``W`` over the base classes::

    head(x) = W (s * x + b) + w_0                                  (TRAINER.DEPT.TYPE linear)

trained on the image features AND on the text features of the batch's labels, as if they were
more images (the ``2 B`` rows ``[t_label; f]`` with the labels twice). With ``lambda =
TRAINER.DEPT.WEIGHT`` (0.7) and the base learner's similarity logits ``s`` (CLIP's
``logit_scale * cos``)::

    loss = (1 - lambda) CE(s, y) + lambda CE(head([t_y; f]), [y; y])  (+ KgCoOp's W * L_kg)

At inference on the classes the head was trained on (base classes; ImageNet's classes in the
cross-dataset and domain-generalisation protocols), the logits are fused,
``(1 - lambda) s + lambda head(f)`` (``TEST_TIME_FUSION``; without it ``head(f)`` alone); on any
other classes (new classes, the other datasets) only ``s``. ``TYPE similarity`` replaces the
linear classifier by CLIP's scaled cosine between the transformed image and text features. The
head trains with its own learning rate, ``OPTIM.LR * TRAINER.DEPT.HEAD_LR_MULT`` (6.5: DePT's
``OPTIM.LR_EXP``), through a second param group, so every optimizer, sharpness-aware or not,
steps it with the prompts.

The four composed trainers are ``DePT_CoOp``, ``DePT_CoCoOp``, ``DePT_KgCoOp`` and
``DePT_MaPLe``; the DePT authors' names ``ExtrasLinearProbeCoOp`` (and ``...CoCoOp``,
``...KgCoOp``, ``...MaPLe``) are aliases that also read their keys
(:meth:`ExtrasLinearProbe.translate_key`): ``TRAINER.LINEAR_PROBE.{TYPE,WEIGHT,
TEST_TIME_FUSION}`` -> ``TRAINER.DEPT.*``, ``TRAINER.FILM.LINEAR_PROBE`` -> ``TRAINER.DEPT.FILM``,
``OPTIM.LR_EXP`` -> ``TRAINER.DEPT.HEAD_LR_MULT``; their ``OPTIM.STAGED_LR``,
``OPTIM.NEW_LAYERS``, ``OPTIM.BASE_LR_MULT`` and ``TRAINER.NAMES_TO_UPDATE`` are accepted with
the authors' values (which is what the param groups do) and refused otherwise.

Differences from the DePT code base (Koorye/DePT, d4ff416), all deliberate:

- the head's parameters are fp32 master weights in every precision mode (DePT's fp16 mode
  trained a half-precision linear layer); in fp16 mode the features enter the head in fp32;
- the head is built for the classes the model is built for and saved with their names' keys
  (``head_classes``): a model of other classes (new classes, another dataset) loads the
  checkpoint with the head off, one of a subset of them (ImageNet-A/-R) with the head's rows of
  its classes. DePT decided by ``DATASET.SUBSAMPLE_CLASSES`` and the dataset's name (base
  classes, or ImageNet's); that rule gives the same heads in the base-to-new, cross-dataset and
  domain-generalisation protocols, is kept for checkpoints without the keys (DePT's own), and
  training on all the classes of any dataset (few-shot runs, which DePT did not publish) works;
- ``TYPE similarity`` works with CoCoOp (DePT's CoCoOp variant returned no labels and failed);
- the base learners are this project's (trainers/coop.py, cocoop.py, kgcoop.py, maple.py) with
  their own documented differences; the features the head sees are theirs before the L2
  normalisation, as in DePT;
- checkpoints hold the prompt learner and the head only (DePT saved all of CLIP);
- ``OPTIM.SAM.NAME esam`` with ``SELECT_PASS masked`` is refused (it replaces one cross-entropy
  of the loss; DePT's has two): ``subset`` runs.
"""

from __future__ import annotations

import hashlib
import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.clip import load_clip
from engine.errors import ConfigError
from engine.registry import TRAINER_REGISTRY
from engine.trainer import ModelOutput
from engine.utils import compute_accuracy
from optim import build_lr_scheduler, build_optimizer

from .cocoop import CoCoOp
from .common import l2_normalize, load_init_weights
from .coop import CoOp
from .kgcoop import KgCoOp
from .maple import MaPLe

logger = logging.getLogger(__name__)

HEAD_TYPES = ("linear", "similarity")
HEAD_PREFIXES = ("film_lp_img.", "film_lp_text.", "linear_probe_proj.")


def add_dept_config(cfg) -> None:
    """TRAINER.DEPT keys (DePT's published values)."""
    from yacs.config import CfgNode as CN

    if "DEPT" in cfg.TRAINER:
        return
    cfg.TRAINER.DEPT = CN()
    cfg.TRAINER.DEPT.TYPE = "linear"  # linear | similarity: the CAT head's classifier
    cfg.TRAINER.DEPT.WEIGHT = 0.7  # lambda: the head's share of the loss and of the fused logits
    cfg.TRAINER.DEPT.TEST_TIME_FUSION = True  # base classes: (1 - lambda) s + lambda head (or head)
    cfg.TRAINER.DEPT.FILM = True  # the channel-wise transform (cwT) before the classifier
    cfg.TRAINER.DEPT.HEAD_LR_MULT = 6.5  # the head's LR: OPTIM.LR * this (DePT's OPTIM.LR_EXP)


def authors_rule(cfg) -> bool:
    """DePT's rule for the head: base classes, or all the classes of an ImageNet dataset (used
    here only for checkpoints that do not name the head's classes, i.e. DePT's own)."""
    subsample = cfg.DATASET.SUBSAMPLE_CLASSES
    return subsample == "base" or (subsample == "all" and "ImageNet" in cfg.DATASET.NAME)


def class_keys(classnames: list[str]) -> torch.Tensor:
    """A 64-bit key per class name (``[n_cls]`` int64), saved with the head: a model built for
    other classes finds the head's rows of its classes by name."""
    keys = []
    for name in classnames:
        digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
        keys.append(int.from_bytes(digest, "little", signed=True))
    return torch.tensor(keys, dtype=torch.long)


def rows_of(saved: torch.Tensor, own: torch.Tensor) -> torch.Tensor | None:
    """For each class key of ``own``, its row in ``saved`` (a repeated name takes the rows in
    order, as ImageNet's two "crane"s); None when a class is not among ``saved``."""
    where: dict[int, list[int]] = {}
    for i, k in enumerate(saved.tolist()):
        where.setdefault(k, []).append(i)
    rows = []
    for k in own.tolist():
        free = where.get(k)
        if not free:
            return None
        rows.append(free.pop(0))
    return torch.tensor(rows, dtype=torch.long)


class ChannelTransform(nn.Module):
    """DePT's cwT: ``x * scale + bias`` per channel (scale 1, bias 0 at the start)."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.to(x.dtype) + self.bias.to(x.dtype)


class DePTLearner(nn.Module):
    """What a DePT trainer trains and checkpoints: the base learner's prompt learner and the CAT
    head, under DePT's names (``prompt_learner.*``, ``film_lp_img.*``, ``film_lp_text.*``,
    ``linear_probe_proj.*``).

    Args:
        prompt_learner: the base learner's module (shared with its model).
        dim: the feature dimension (CLIP's embedding).
        n_cls: classes of the linear classifier.
        cfg: the config (TRAINER.DEPT, the dataset for :func:`head_enabled`).
        device: where the head lives.
    """

    def __init__(
        self, prompt_learner: nn.Module, dim: int, classnames: list[str], cfg, device=None
    ):
        super().__init__()
        node = cfg.TRAINER.DEPT
        self.prompt_learner = prompt_learner
        self.film = bool(node.FILM)
        self.film_lp_img = ChannelTransform(dim).to(device)
        self.film_lp_text = ChannelTransform(dim).to(device)
        self.kind = node.TYPE
        self.weight = float(node.WEIGHT)
        self.fusion = bool(node.TEST_TIME_FUSION)
        if self.kind == "linear":  # fp32 master weights
            self.linear_probe_proj = nn.Linear(dim, len(classnames)).to(device)
        else:
            self.linear_probe_proj = None
        # the classes the head is trained on (saved): a checkpoint of other classes turns it off
        self.register_buffer("head_classes", class_keys(classnames).to(device))
        self.has_head = True

    def head_parameters(self) -> list[nn.Parameter]:
        """The parameters with the head's learning rate (cwT and classifier)."""
        return [p for n, p in self.named_parameters() if n.startswith(HEAD_PREFIXES)]

    def transform(self, features: torch.Tensor, text: bool) -> torch.Tensor:
        """The cwT of the image (or ``text``) features, in fp32 at least (the head's dtype)."""
        x = features.to(torch.promote_types(features.dtype, torch.float32))
        if not self.film:
            return x
        return (self.film_lp_text if text else self.film_lp_img)(x)


class DePTMixin:
    """The DePT plug-in over a base trainer (mixed in before it).

    A composed trainer states how its base learner gives the features before normalisation:
    :meth:`dept_features` ``(text, image, label)`` of a training pass (text ``[n_cls, dim]``, or
    ``[batch, n_cls, dim]`` for CoCoOp), :meth:`similarity` (the base learner's logits from
    them) and, for inference, :meth:`eval_text` / :meth:`eval_image`.
    """

    CONFIG_NODE = ""  # the base learner's TRAINER.<node> (its PREC and prompt keys)
    model_name = "PromptLearner"  # checkpoint folder, as in DePT's code base

    @classmethod
    def add_config(cls, cfg) -> None:
        if cls.CONFIG_NODE not in cfg.TRAINER:
            super().add_config(cfg)
        add_dept_config(cfg)

    def check_cfg(self, cfg) -> None:
        super().check_cfg(cfg)
        node = cfg.TRAINER.DEPT
        key = "TRAINER.DEPT."
        if node.TYPE not in HEAD_TYPES:
            raise ConfigError(f"{key}TYPE must be linear or similarity, got {node.TYPE!r}")
        if not 0.0 <= node.WEIGHT <= 1.0:
            raise ConfigError(f"{key}WEIGHT (lambda) must be in [0, 1], got {node.WEIGHT}")
        if node.HEAD_LR_MULT <= 0:
            raise ConfigError(f"{key}HEAD_LR_MULT must be positive, got {node.HEAD_LR_MULT}")
        sam = cfg.OPTIM.SAM
        if sam.NAME == "esam" and sam.get("SELECT_PASS") == "masked" and sam.GAMMA < 1:
            raise ConfigError(
                "OPTIM.SAM.SELECT_PASS masked replaces the loss's cross-entropy by the selected "
                "items' mean, and DePT's loss holds it with the weight 1 - TRAINER.DEPT.WEIGHT "
                "next to the head's loss on text and image rows: set OPTIM.SAM.SELECT_PASS subset "
                "(configs/optim/DePT_*/esam.yaml)"
            )

    # -- building ---------------------------------------------------------------------------
    def build_base_model(self, clip_model) -> nn.Module:
        raise NotImplementedError

    def build_model(self):
        cfg = self.cfg
        clip_model = load_clip(cfg, precision=self.prec, device=self.device)
        self.model = self.build_base_model(clip_model).to(self.device)
        dim = clip_model.text_projection.shape[1]
        self.dept = DePTLearner(self.model.prompt_learner, dim, self.classnames, cfg, self.device)
        self.model.dept = self.dept  # moved, put in eval/train mode and configured with the model
        self.setup_dept_optimizer()

    def setup_dept_optimizer(self) -> None:
        """Train the prompt learner (``OPTIM.LR``) and the head (``OPTIM.LR * HEAD_LR_MULT``) as two
        param groups of the run's optimizer (DePT's staged LR)."""
        cfg = self.cfg
        self.model.requires_grad_(False)
        self.dept.requires_grad_(True)
        logger.info(
            "Parameters to be updated: %s",
            ", ".join(f"{self.model_name}.{n}" for n, _ in self.dept.named_parameters()),
        )
        load_init_weights(self.dept, cfg.MODEL.INIT_WEIGHTS)
        head = self.dept.head_parameters()
        ids = {id(p) for p in head}
        prompts = [p for p in self.dept.parameters() if id(p) not in ids]
        groups = [
            {"params": prompts, "lr": cfg.OPTIM.LR},
            {"params": head, "lr": cfg.OPTIM.LR * cfg.TRAINER.DEPT.HEAD_LR_MULT},
        ]
        self.optim = build_optimizer(cfg, groups)
        self.sched = build_lr_scheduler(self.optim, cfg.OPTIM)
        self.register_model(self.model_name, self.dept, self.optim, self.sched)

    # -- the base learner's features (per composed trainer) ---------------------------------
    def dept_features(self, inputs):
        raise NotImplementedError

    def similarity(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        """The base learner's logits from unnormalised features."""
        return self.model.logits(l2_normalize(image), l2_normalize(text))

    def extra_loss(self, text: torch.Tensor) -> tuple[torch.Tensor | None, dict]:
        """A term of the base learner's loss besides its cross-entropy (KgCoOp's), or None."""
        return None, {}

    # -- the head ---------------------------------------------------------------------------
    def head_train_logits(self, text, image, label):
        """The head's logits and labels of a training pass: linear on ``[t_y; f]``
        (``[y; y]``), or the similarity of the transformed features (``y``)."""
        d = self.dept
        t, f = d.transform(text, text=True), d.transform(image, text=False)
        if d.kind == "similarity":
            return self.similarity(t, f), label
        if t.dim() == 3:  # CoCoOp: each image's own class features
            t_y = t[torch.arange(len(label), device=t.device), label]
        else:
            t_y = t[label]
        rows = torch.cat([t_y, f])
        return d.linear_probe_proj(rows), torch.cat([label, label])

    def head_logits(self, text, image):
        d = self.dept
        f = d.transform(image, text=False)
        if d.kind == "similarity":
            return self.similarity(d.transform(text, text=True), f)
        return d.linear_probe_proj(f)

    def fused_logits(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        """Inference: similarity logits, fused with the head's on the head's classes."""
        sim = self.similarity(text, image)
        d = self.dept
        if not d.has_head:
            return sim
        head = self.head_logits(text, image)
        if not d.fusion:
            return head
        return (1 - d.weight) * sim.to(head.dtype) + d.weight * head

    # -- the step protocol ------------------------------------------------------------------
    def compute_loss(self, inputs):
        d = self.dept
        if not d.has_head:
            raise ConfigError(
                "DePT's CAT head was loaded from a checkpoint of other classes (it is off for "
                "these): train from scratch on these classes, or evaluate (--eval-only)"
            )
        text, image, label = self.dept_features(inputs)
        logits = self.similarity(text, image)
        ce = self.classification_loss(logits, label)
        head_logits, head_label = self.head_train_logits(text, image, label)
        ce_head = F.cross_entropy(head_logits.float(), head_label)
        loss = (1 - d.weight) * ce + d.weight * ce_head
        extra, summary = self.extra_loss(text)
        if extra is not None:
            loss = loss + extra
        summary = {
            "acc": compute_accuracy(logits, label)[0],
            "ce": ce.detach(),
            "ce_head": ce_head.detach(),
            **summary,
        }
        return loss, summary

    def model_outputs(self, image):
        text, image_features = self.eval_text(), self.eval_image(image)
        logits = self.fused_logits(text, image_features)
        return ModelOutput(l2_normalize(image_features), l2_normalize(text), logits)

    # -- checkpoints ------------------------------------------------------------------------
    def _load_module_state(self, name, checkpoint, path):
        """A checkpoint of other classes (new classes, another dataset) turns the head off
        (similarity logits only); one whose classes include these (ImageNet -> ImageNet-A/-R)
        gives the head their rows. A checkpoint without the head's class keys (DePT's own) has
        a head where DePT's rule puts one (:func:`authors_rule`) and its rows fit. DePT's files
        also hold its KgCoOp's unused modules, ignored here."""
        state = dict(checkpoint.get("state_dict", checkpoint))
        state = {(k[7:] if k.startswith("module.") else k): v for k, v in state.items()}
        d = self.dept
        own = d.state_dict()
        for key in [k for k in state if k.startswith(KGCOOP_UNUSED) and k not in own]:
            del state[key]
        saved_keys = state.get("head_classes")
        if saved_keys is not None:
            rows = rows_of(saved_keys, d.head_classes)
        else:
            saved = state.get("linear_probe_proj.weight")
            n = len(self.classnames)
            fits = saved is None or saved.shape[0] == n
            rows = torch.arange(n) if fits and authors_rule(self.cfg) else None
        head_keys = [k for k in own if k.startswith("linear_probe_proj.")]
        if rows is None:
            logger.info(
                "%s: the CAT head was trained on other classes: similarity logits only", path
            )
            for k in head_keys:
                state[k] = own[k]
        else:
            for k in head_keys:
                if k in state:
                    state[k] = state[k][rows.to(state[k].device)]
        state["head_classes"] = own["head_classes"]
        super()._load_module_state(name, {**checkpoint, "state_dict": state}, path)
        d.has_head = rows is not None


# DePT's KgCoOp builds modules it never uses (saved in its checkpoints)
KGCOOP_UNUSED = ("prompt_learner.bias_vectors", "prompt_learner.meta_net.", "meta_net.", "adapter.")


class _FrozenImageDePT(DePTMixin):
    """DePT over a base learner with a frozen image encoder: raw image features once per step
    (and once per evaluation set through the feature cache), text features once per evaluation."""

    def prepare_step(self, batch_inputs):
        image, label = batch_inputs
        return self.model.image_encoder(image.to(self.model.dtype)), label

    def text_raw(self) -> torch.Tensor:
        pl = self.model.prompt_learner
        return self.model.text_encoder(pl(), pl.eot_idx)

    def dept_features(self, inputs):
        image, label = inputs
        return self.text_raw(), image, label

    def eval_text(self):
        return self.text_raw()

    def eval_image(self, image):
        return self.model.image_encoder(image.to(self.model.dtype))

    def before_test(self):
        self._text_features = self.text_raw()

    def after_test(self):
        self._text_features = None

    def model_inference(self, image):
        return self.fused_logits(self._text_features, self.eval_image(image))

    def frozen_image_encoder(self):
        return self.model.image_encoder

    def model_inference_features(self, features):
        return self.fused_logits(self._text_features, features)


@TRAINER_REGISTRY.register()
class DePT_CoOp(_FrozenImageDePT, CoOp):
    """DePT over CoOp (DePT's ``ExtrasLinearProbeCoOp``)."""

    CONFIG_NODE = "COOP"
    PROTOCOL_CFGS = {
        "base2new": "vit_b16_ep10_bs4_lr35",  # configs/trainers/DePT_CoOp/
        "transfer": "vit_b16_ep10_bs4_lr35",
    }

    def build_base_model(self, clip_model):
        from .coop import CustomCLIP

        return CustomCLIP.from_config(self.cfg, self.classnames, clip_model)


@TRAINER_REGISTRY.register()
class DePT_KgCoOp(_FrozenImageDePT, KgCoOp):
    """DePT over KgCoOp (DePT's ``ExtrasLinearProbeKgCoOp``): KgCoOp's ``W * L_kg`` is added."""

    CONFIG_NODE = "KGCOOP"
    PROTOCOL_CFGS = {
        "base2new": "vit_b16_ep10_ctxv1_bs4_lr35",  # configs/trainers/DePT_KgCoOp/
        "transfer": "vit_b16_ep10_ctxv1_bs4_lr35",
    }

    def build_base_model(self, clip_model):
        from .kgcoop import KgCoOpCLIP

        return KgCoOpCLIP.from_config(self.cfg, self.classnames, clip_model)

    def extra_loss(self, text):
        from .common import kg_loss

        kg = kg_loss(l2_normalize(text), self.model.t_clip)
        return self.cfg.TRAINER.KGCOOP.W * kg, {"kg": kg.detach()}


@TRAINER_REGISTRY.register()
class DePT_CoCoOp(DePTMixin, CoCoOp):
    """DePT over CoCoOp (DePT's ``ExtrasLinearProbeCoCoOp``): per-image text features, the head
    sees each image's features of its own label's prompt."""

    CONFIG_NODE = "COCOOP"
    PROTOCOL_CFGS = {
        "base2new": "vit_b16_c4_ep10_batch1_ctxv1",  # configs/trainers/DePT_CoCoOp/
        "transfer": "vit_b16_c4_ep10_batch1_ctxv1",
    }

    def build_base_model(self, clip_model):
        from .cocoop import CoCoOpCLIP

        return CoCoOpCLIP.from_config(self.cfg, self.classnames, clip_model)

    def prepare_step(self, batch_inputs):
        image, label = batch_inputs
        return self.model.image_encoder(image.to(self.model.dtype)), label

    def dept_features(self, inputs):
        image, label = inputs
        return self.model.raw_text(l2_normalize(image)), image, label

    def model_outputs(self, image):
        f = self.model.image_encoder(image.to(self.model.dtype))
        text = self.model.raw_text(l2_normalize(f))
        return ModelOutput(l2_normalize(f), l2_normalize(text), self.fused_logits(text, f))

    def model_inference(self, image):
        return self.model_outputs(image).logits

    def frozen_image_encoder(self):
        return self.model.image_encoder

    def model_inference_features(self, features):
        return self.fused_logits(self.model.raw_text(l2_normalize(features)), features)


@TRAINER_REGISTRY.register()
class DePT_MaPLe(DePTMixin, MaPLe):
    """DePT over MaPLe (DePT's ``ExtrasLinearProbeMaPLe``): the prompted image encoder runs in
    every pass."""

    CONFIG_NODE = "MAPLE"
    model_name = "MultiModalPromptLearner"
    PROTOCOL_CFGS = {
        "base2new": "vit_b16_c2_ep10_batch4_2ctx",  # configs/trainers/DePT_MaPLe/
        "transfer": "vit_b16_c2_ep10_batch4_2ctx",
    }

    def build_base_model(self, clip_model):
        return self.MODEL_CLASS.from_config(self.cfg, self.classnames, clip_model)

    def prepare_step(self, batch_inputs):
        return batch_inputs

    def dept_features(self, inputs):
        image, label = inputs
        prompts = self.model.prompt_learner()
        text = self.model.text_features(prompts)
        return text, self.model.image_features(image, prompts), label

    def eval_text(self):
        return self.model.text_features(self.model.prompt_learner())

    def eval_image(self, image):
        return self.model.image_features(image, self.model.prompt_learner())

    def before_test(self):
        self._prompts = self.model.prompt_learner()
        self._text_features = self.model.text_features(self._prompts)

    def model_inference(self, image):
        image_features = self.model.image_features(image, self._prompts)
        return self.fused_logits(self._text_features, image_features)


# -- the DePT authors' trainer names and keys ------------------------------------------------

# DePT's train.py keys -> this project's (their config files set none of them; their scripts may)
AUTHORS_KEYS = {
    "TRAINER.LINEAR_PROBE.TYPE": "TRAINER.DEPT.TYPE",
    "TRAINER.LINEAR_PROBE.WEIGHT": "TRAINER.DEPT.WEIGHT",
    "TRAINER.LINEAR_PROBE.TEST_TIME_FUSION": "TRAINER.DEPT.TEST_TIME_FUSION",
    "TRAINER.FILM.LINEAR_PROBE": "TRAINER.DEPT.FILM",
    "OPTIM.LR_EXP": "TRAINER.DEPT.HEAD_LR_MULT",
}
# accepted with DePT's values only: the param groups are what they select
AUTHORS_FIXED = {
    "OPTIM.STAGED_LR": (True,),
    "OPTIM.NEW_LAYERS": (["linear_probe", "film"], ("linear_probe", "film")),
    "OPTIM.BASE_LR_MULT": (1.0, 1),
    "TRAINER.NAMES_TO_UPDATE": (
        ["prompt_learner", "linear_probe", "film"],
        ("prompt_learner", "linear_probe", "film"),
    ),
}


def _parsed(value):
    if isinstance(value, str):
        import ast

        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value
    return value


class ExtrasLinearProbe:
    """Mixin of the DePT authors' names: their keys (:data:`AUTHORS_KEYS`) read as
    ``TRAINER.DEPT.*``."""

    @classmethod
    def translate_key(cls, key, value, source):
        if key in AUTHORS_KEYS:
            return [(AUTHORS_KEYS[key], _parsed(value))]
        if key in AUTHORS_FIXED:
            if _parsed(value) not in AUTHORS_FIXED[key]:
                raise ConfigError(
                    f"{key} {value!r} in {source}: DePT's trainers here train the prompt learner "
                    "with OPTIM.LR and the CAT head (linear_probe, film) with OPTIM.LR x "
                    "TRAINER.DEPT.HEAD_LR_MULT, DePT's staged LR with its values; other values "
                    "are not implemented (set OPTIM.LR_EXP or TRAINER.DEPT.HEAD_LR_MULT for the "
                    "head's LR)"
                )
            return []
        return super().translate_key(key, value, source)


@TRAINER_REGISTRY.register()
class ExtrasLinearProbeCoOp(ExtrasLinearProbe, DePT_CoOp):
    """DePT's name of :class:`DePT_CoOp`."""

    ALIAS_OF = "DePT_CoOp"


@TRAINER_REGISTRY.register()
class ExtrasLinearProbeKgCoOp(ExtrasLinearProbe, DePT_KgCoOp):
    """DePT's name of :class:`DePT_KgCoOp` (KgCoOp's ``TRAINER.COOP.*`` keys, as KgCoOp's)."""

    ALIAS_OF = "DePT_KgCoOp"


@TRAINER_REGISTRY.register()
class ExtrasLinearProbeCoCoOp(ExtrasLinearProbe, DePT_CoCoOp):
    """DePT's name of :class:`DePT_CoCoOp`."""

    ALIAS_OF = "DePT_CoCoOp"


@TRAINER_REGISTRY.register()
class ExtrasLinearProbeMaPLe(ExtrasLinearProbe, DePT_MaPLe):
    """DePT's name of :class:`DePT_MaPLe`."""

    ALIAS_OF = "DePT_MaPLe"
