"""KgCoOp: knowledge-guided context optimization (Yao et al., CVPR 2023).

CoOp's learnable context (trainers/coop.py, unchanged) plus a regulariser that keeps the learned
class text features close to the frozen CLIP's features of a hand-crafted prompt. With
``w_c`` the L2-normalised learned text feature of class ``c``, ``w_c^clip`` the L2-normalised
frozen CLIP feature of ``template.format(class c)`` (:data:`KGCOOP_TEMPLATES`), ``C`` classes
and ``W = TRAINER.KGCOOP.W`` (8.0)::

    loss = CE(logit_scale * image @ w^T, label) + W * L_kg
    L_kg = 1 - (1/C) sum_c cos(w_c, w_c^clip) = (1/(2C)) sum_c ||w_c - w_c^clip||^2

which is what KgCoOp's code computes (``1 - mean cos``; for unit vectors ``1 - cos`` is half the
squared Euclidean distance, so the paper's "mean squared distance" term with weight 8 is this
loss with weight 16: the code's form and its weight are the published behaviour). Only the
context is trained; CLIP is frozen. Differences from KgCoOp's code base, all deliberate:

- the keys live in ``TRAINER.KGCOOP`` (KgCoOp reads ``TRAINER.COOP`` plus ``COOP.W``);
  ``CTX_INIT`` is the initial text as in CoOp (KgCoOp's ``CTX_INIT True`` always meant
  "a photo of a"). KgCoOp's own files and scripts run unchanged: :meth:`KgCoOp.translate_key`
  reads their ``TRAINER.COOP.*`` keys as ``TRAINER.KGCOOP.*`` (``CTX_INIT True`` -> "a photo
  of a", ``False`` -> "" (random); ``ALPHA``, declared by KgCoOp's train.py and read by none of
  its trainers, is dropped), and the run's log lists each such key;
- the regulariser applies in every precision mode (KgCoOp's amp path dropped it) and with
  every optimizer (the engine's step);
- ``w^clip`` comes from the same frozen CLIP (KgCoOp loads a second copy), is computed once and
  kept in a non-persistent buffer, so checkpoints hold the context only; KgCoOp's unused
  ``meta_net``, ``bias_vectors`` and ``adapter`` are not built;
- datasets without a template fall back to "a photo of a {}." (KgCoOp raised a KeyError);
  ``DATASET.TEMPLATE`` replaces the dataset's template when set;
- CoOp's deliberate differences (fp32 context, truncated prompts, features computed once per
  step / evaluation) apply.
"""

from __future__ import annotations

import torch

from engine.clip import TextEncoder, encode_texts, load_clip
from engine.errors import ConfigError
from engine.registry import TRAINER_REGISTRY

from .common import FrozenImageCLIP, PromptTrainer, l2_normalize, setup_prompt_learner
from .coop import PromptLearner
from .zsclip import CUSTOM_TEMPLATES, DEFAULT_TEMPLATE

# KgCoOp's hand-crafted templates: CoOp's, except DescribableTextures
KGCOOP_TEMPLATES = {
    **CUSTOM_TEMPLATES,
    "DescribableTextures": "a photo of a {}, a type of texture.",
}


def add_kgcoop_config(cfg) -> None:
    """TRAINER.KGCOOP keys (CoOp's names and KgCoOp's published values)."""
    from yacs.config import CfgNode as CN

    cfg.TRAINER.KGCOOP = CN()
    cfg.TRAINER.KGCOOP.N_CTX = 4  # context vectors (ignored when CTX_INIT is set); KgCoOp's NCTX
    cfg.TRAINER.KGCOOP.CSC = False  # class-specific context
    cfg.TRAINER.KGCOOP.CTX_INIT = ""  # initial context words, e.g. "a photo of a" ("": random)
    cfg.TRAINER.KGCOOP.PREC = "fp16"  # fp32 | fp16 (half CLIP, fp32 context) | amp | bf16
    cfg.TRAINER.KGCOOP.CLASS_TOKEN_POSITION = "end"  # end | middle | front
    cfg.TRAINER.KGCOOP.W = 8.0  # weight of L_kg = 1 - mean cos(text, hand-crafted text)


# KgCoOp's code base declares its keys in TRAINER.COOP (its train.py's extend_cfg)
COOP_NODE = "TRAINER.COOP."
KGCOOP_KEYS = ("N_CTX", "CSC", "CTX_INIT", "PREC", "CLASS_TOKEN_POSITION", "W")
UNUSED_KEYS = ("ALPHA",)  # declared by KgCoOp's train.py, read by none of its trainers
KGCOOP_CTX_INIT = "a photo of a"  # what KgCoOp's PromptLearner uses whenever CTX_INIT is true


def kgcoop_ctx_init(value):
    """KgCoOp's ``CTX_INIT`` (a bool in its configs) as this project's initial words."""
    text = value.strip().lower() if isinstance(value, str) else None
    if value is True or text == "true":
        return KGCOOP_CTX_INIT
    if value is False or value is None or text in ("false", "none"):
        return ""
    return value  # words: used as given (KgCoOp's code used "a photo of a" for any)


def kgcoop_template(dataset_name: str, template: str = "") -> str:
    """The hand-crafted template of ``w^clip`` for a dataset (Dassl name); ``template``
    (``DATASET.TEMPLATE``) replaces it when set."""
    return template or KGCOOP_TEMPLATES.get(dataset_name, DEFAULT_TEMPLATE)


class KgCoOpCLIP(FrozenImageCLIP):
    """CLIP with CoOp's prompt learner and the frozen hand-crafted text features ``t_clip``.

    The CoOp ``CustomCLIP`` interface: :meth:`encode_image` (frozen), :meth:`encode_text`
    (learnable), :meth:`logits`; ``t_clip`` is ``[n_cls, dim]``, L2-normalised, fp32.
    """

    @classmethod
    def from_config(cls, cfg, classnames, clip_model):
        """The model of ``cfg`` (TRAINER.KGCOOP, the dataset's template) for ``classnames``."""
        prompt_learner = PromptLearner.from_node(classnames, clip_model, cfg.TRAINER.KGCOOP)
        template = kgcoop_template(cfg.DATASET.NAME, cfg.DATASET.TEMPLATE)
        return cls(classnames, prompt_learner, clip_model, template)

    def __init__(self, classnames, prompt_learner: PromptLearner, clip_model, template: str):
        super().__init__(clip_model)
        self.prompt_learner = prompt_learner
        self.text_encoder = TextEncoder(clip_model)
        names = [name.replace("_", " ") for name in classnames]
        t_clip = encode_texts(self.text_encoder, [template.format(n) for n in names])
        self.register_buffer("t_clip", t_clip, persistent=False)  # [n_cls, dim], normalised
        self.template = template

    def encode_text(self) -> torch.Tensor:
        """Normalised learned class text features ``[n_cls, dim]``."""
        pl = self.prompt_learner
        return l2_normalize(self.text_encoder(pl(), pl.eot_idx))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.logits(self.encode_image(image), self.encode_text())


@TRAINER_REGISTRY.register()
class KgCoOp(PromptTrainer):
    """Knowledge-guided Context Optimization (KgCoOp): CoOp + W * (1 - mean cos(text, t_clip)).

    Image features once per step (frozen encoder, ``prepare_step``), text features once per
    evaluation (:class:`trainers.common.PromptTrainer`).
    """

    # the grid's default configs (configs/trainers/KgCoOp/<cfg>.yaml; experiments/protocols.py)
    PROTOCOL_CFGS = {
        "base2new": "vit_b16_ep100_ctxv1",
    }

    add_config = staticmethod(add_kgcoop_config)

    @classmethod
    def translate_key(cls, key, value, source):
        """KgCoOp's files: ``TRAINER.COOP.<K>`` is ``TRAINER.KGCOOP.<K>`` (module docstring)."""
        leaf = key[len(COOP_NODE) :] if key.startswith(COOP_NODE) else None
        if leaf in UNUSED_KEYS:
            return []
        if leaf not in KGCOOP_KEYS:
            return [(key, value)]
        if leaf == "CTX_INIT":
            value = kgcoop_ctx_init(value)
        return [(f"TRAINER.KGCOOP.{leaf}", value)]

    def check_cfg(self, cfg):
        c = self.trainer_cfg(cfg)
        if c.CLASS_TOKEN_POSITION not in ("end", "middle", "front"):
            raise ConfigError(
                f"{self.cfg_key('CLASS_TOKEN_POSITION')} must be end, middle or front; got "
                f"{c.CLASS_TOKEN_POSITION!r}"
            )
        if c.W < 0:
            raise ConfigError(f"{self.cfg_key('W')} (the L_kg weight) must be >= 0, got {c.W}")
        if not c.CTX_INIT and c.N_CTX < 1:
            raise ConfigError(f"{self.cfg_key('N_CTX')} must be >= 1, got {c.N_CTX}")

    def build_model(self):
        clip_model = load_clip(self.cfg, precision=self.prec, device=self.device)
        self.model = KgCoOpCLIP.from_config(self.cfg, self.classnames, clip_model).to(self.device)
        setup_prompt_learner(self)

    def compute_loss(self, inputs):
        return self.kg_regularised_loss(inputs, self.model.t_clip, self.trainer_cfg().W)
