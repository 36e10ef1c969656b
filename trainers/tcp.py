"""TCP: textual-based class-aware prompt tuning (Yao et al., CVPR 2024).

A shared learnable context at token positions 1..N_CTX of a per-dataset template, plus
class-aware tokens: the frozen CLIP's L2-normalised features ``t_clip`` of hand-crafted prompts go
through a meta-net Linear(dim, dim // 4) -> QuickGELU -> Linear(dim // 4, N_CTX * width), and
the result replaces token positions 1..N_CTX inside the text transformer, before block
``TRAINER.TCP.INJECT_LAYER`` (8). Loss = cross-entropy + KG_WEIGHT * (1 - mean cos(text,
t_clip)), the KgCoOp regulariser (KG_WEIGHT = 8.0). Differences from the TCP code base, all
deliberate:

- the KgCoOp weight is the config key ``TRAINER.TCP.KG_WEIGHT`` (TCP hard-codes 8.0 in the loss;
  its script's ``TRAINER.COOP.W 1.0`` is another, unused knob, unknown here). The earlier name
  ``TRAINER.TCP.W`` is refused with a pointer, so a renamed script cannot silently train with
  another weight;
- ``t_clip`` comes from the same frozen CLIP (TCP loads a second copy) and is computed once;
  it and the class-token buffers are non-persistent, so checkpoints hold ``ctx`` and
  ``meta_net.*`` (TCP's names) and a base-class model evaluates on new classes;
- the context and meta-net are fp32 master parameters in every precision mode;
- prompts are cut to the longest EOT (identical features); text features are computed once
  per evaluation, not per test batch;
- N_CTX other than 4 replaces the four placeholder words of the template by N_CTX tokens (TCP
  only works with 4).

TCP's own config files and scripts run unchanged: :meth:`TCP.translate_key` reads their
``TRAINER.COOP.*`` keys (TCP's ``train.py`` declares them in CoOp's node) as this trainer's
(:data:`TCP_COOP_KEYS`), and sets ``TRAINER.TCP.TRAIN_PY_RULES``, with which
:meth:`TCP.translate_cfg` applies the rule of TCP's ``train.py`` after the merge: ImageNet and
SUN397 train 25 epochs (its script evaluates ``--load-epoch 25`` there; an ``OPTIM.MAX_EPOCH``
option of the command line still wins here).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from open_clip.transformer import QuickGELU
from torch import nn

from engine.clip import TextEncoder, encode_texts, keeps_full_length, load_clip
from engine.errors import ConfigError
from engine.registry import TRAINER_REGISTRY

from .common import (
    FrozenImageCLIP,
    PromptTrainer,
    l2_normalize,
    register_class_prompts,
    setup_prompt_learner,
)

logger = logging.getLogger(__name__)

# TCP's learnable templates; their first TEMPLATE_CTX_WORDS words are the context positions
# ("a photo of a" included: TCP overwrites those four tokens with the context too).
LEARNABLE_TEMPLATES = {
    "OxfordPets": "X X X X {}, a type of pet.",
    "OxfordFlowers": "X X X X {}, a type of flower.",
    "FGVCAircraft": "X X X X {}, a type of aircraft.",
    "DescribableTextures": "X X X X {} texture.",
    "EuroSAT": "X X X X {}.",
    "StanfordCars": "X X X X {}, a type of car",  # no final period, as in TCP
    "Food101": "X X X X {}, a type of food.",
    "SUN397": "X X X X {}.",
    "Caltech101": "X X X X {}.",
    "UCF101": "a photo of a person doing {}.",
    "ImageNet": "a photo of a {}.",
    "ImageNetSketch": "a photo of a {}.",
    "ImageNetV2": "a photo of a {}.",
    "ImageNetA": "a photo of a {}.",
    "ImageNetR": "a photo of a {}.",
}
TEMPLATE_CTX_WORDS = 4
DEFAULT_LEARNABLE_TEMPLATE = "X X X X {}."

# TCP's hand-crafted ("ori") templates for the frozen class features t_clip
HANDCRAFTED_TEMPLATES = {
    "OxfordPets": "a photo of a {}, a type of pet.",
    "OxfordFlowers": "a photo of a {}, a type of flower.",
    "FGVCAircraft": "a photo of an aircraft {}.",
    "DescribableTextures": "a photo of a {}, a type of texture.",
    "EuroSAT": "a centered satellite photo of {}.",
    "UCF101": "a photo of a person doing {}.",
    "Food101": "a photo of a {}, a type of food.",
}
DEFAULT_HANDCRAFTED_TEMPLATE = "a photo of a {}."  # every other dataset (TCP's table)


def tcp_templates(dataset_name: str, template: str = "") -> tuple[str, str]:
    """``(learnable, hand-crafted)`` templates of a dataset; unknown datasets fall back to
    "X X X X {}." / "a photo of a {}." with a logged notice.

    ``template`` (``DATASET.TEMPLATE``), when set, is the hand-crafted template and the
    learnable one: its first TEMPLATE_CTX_WORDS words are the context positions when it has
    that many words before "{}" ("a photo of a {}, a type of bird." -> "X X X X {}, a type of
    bird."), else the context positions go in front ("{} texture." -> "X X X X {} texture.").
    """
    if template:
        words = template.split(" ")  # as learnable_prompt splits it
        if next(i for i, w in enumerate(words) if "{}" in w) >= TEMPLATE_CTX_WORDS:
            return template, template
        return " ".join(["X"] * TEMPLATE_CTX_WORDS + [template]), template
    if dataset_name not in LEARNABLE_TEMPLATES:
        logger.warning(
            "TCP has no templates for dataset %r: using %r (learnable) and %r (hand-crafted)",
            dataset_name,
            DEFAULT_LEARNABLE_TEMPLATE,
            DEFAULT_HANDCRAFTED_TEMPLATE,
        )
        return DEFAULT_LEARNABLE_TEMPLATE, DEFAULT_HANDCRAFTED_TEMPLATE
    learnable = LEARNABLE_TEMPLATES[dataset_name]
    return learnable, HANDCRAFTED_TEMPLATES.get(dataset_name, DEFAULT_HANDCRAFTED_TEMPLATE)


def learnable_prompt(template: str, n_ctx: int) -> str:
    """The template with its context words replaced by ``n_ctx`` placeholders "X"."""
    rest = template.split(" ")[TEMPLATE_CTX_WORDS:]
    return " ".join(["X"] * n_ctx + rest)


def add_tcp_config(cfg) -> None:
    """TRAINER.TCP keys (TCP's defaults)."""
    from yacs.config import CfgNode as CN

    cfg.TRAINER.TCP = CN()
    cfg.TRAINER.TCP.N_CTX = 4  # context tokens = class-aware tokens per prompt
    cfg.TRAINER.TCP.PREC = "fp16"  # fp32 | fp16 (half CLIP, fp32 prompt learner) | amp | bf16
    cfg.TRAINER.TCP.KG_WEIGHT = 8.0  # weight of the KgCoOp loss 1 - mean cos(text, t_clip)
    cfg.TRAINER.TCP.W = None  # renamed KG_WEIGHT: any value is refused with a pointer
    # text block (0-based) before which the class-aware tokens replace positions 1..N_CTX
    cfg.TRAINER.TCP.INJECT_LAYER = 8
    # True: TCP's train.py's rule after the merge (ImageNet and SUN397: 25 epochs); TCP's own
    # config files and scripts set it (their TRAINER.COOP keys, TCP.translate_key)
    cfg.TRAINER.TCP.TRAIN_PY_RULES = False


# TCP's code base keeps its keys in CoOp's node (its train.py's extend_cfg): how each is read
COOP_NODE = "TRAINER.COOP."
TCP_MARK = ("TRAINER.TCP.TRAIN_PY_RULES", True)
TCP_EPOCH_RULE = {"ImageNet": 25, "SUN397": 25}  # TCP's train.py: MAX_EPOCH for these datasets


def _as_bool(value):
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return value


def translate_tcp_key(key: str, value, source: str) -> list[tuple[str, object]]:
    """One key of TCP's files as this trainer's (see the module docstring)."""
    leaf = key[len(COOP_NODE) :] if key.startswith(COOP_NODE) else None
    if leaf in ("N_CTX", "PREC"):
        return [(f"TRAINER.TCP.{leaf}", value), TCP_MARK]
    if leaf in ("W", "ALPHA"):  # W: TCP's text blocks use their own fixed weight 1.0
        return []
    refused = {
        "CTX_INIT": (False, "TCP's published configs start from a random context (False)"),
        "CSC": (False, "TCP's code has one shared context (False)"),
        "CLASS_TOKEN_POSITION": ("end", "TCP's templates place the class name (end)"),
    }
    if leaf not in refused:
        return [(key, value)]
    expected, why = refused[leaf]
    if _as_bool(value) == expected or (leaf == "CTX_INIT" and value in ("", None)):
        return [TCP_MARK] if leaf == "CTX_INIT" else []  # what this trainer does
    raise ConfigError(
        f"{key} {value!r} in {source}: --trainer TCP reads TCP's TRAINER.COOP keys, and "
        f"supports {leaf} {expected} only ({why}). Set {key} {expected}, or train --trainer "
        "KgCoOp or CoOp, which read that key."
    )


class TCPPromptLearner(nn.Module):
    """TCP's context, meta-net and frozen class tensors.

    Args:
        classnames: class names ("_" becomes " ").
        clip_model: the frozen CLIP.
        template: the learnable template (:data:`LEARNABLE_TEMPLATES` form).
        handcrafted: the hand-crafted template of ``t_clip``.
        n_ctx: number of context (and class-aware) tokens.
    """

    def __init__(self, classnames, clip_model, template: str, handcrafted: str, n_ctx: int = 4):
        super().__init__()
        if n_ctx < 1:
            raise ValueError(f"TRAINER.TCP.N_CTX must be >= 1, got {n_ctx}")
        names = [name.replace("_", " ") for name in classnames]
        embedding = clip_model.token_embedding
        width = clip_model.ln_final.weight.shape[0]
        ctx = torch.empty(n_ctx, width, dtype=torch.float32)
        nn.init.normal_(ctx, std=0.02)
        self.ctx = nn.Parameter(ctx.to(embedding.weight.device))  # fp32 master weights

        t_clip = encode_texts(TextEncoder(clip_model), [handcrafted.format(n) for n in names])
        self.register_buffer("t_clip", t_clip, persistent=False)  # [n_cls, dim], normalised
        dim = t_clip.shape[1]
        self.meta_net = nn.Sequential(
            OrderedDict(
                [
                    ("linear1", nn.Linear(dim, dim // 4)),
                    ("gelu", QuickGELU()),
                    ("linear2", nn.Linear(dim // 4, n_ctx * width)),
                ]
            )
        ).to(self.ctx.device)

        self.prompts_text = [learnable_prompt(template, n_ctx).format(n) for n in names]
        full = keeps_full_length(clip_model)
        register_class_prompts(self, embedding, self.prompts_text, n_ctx, full)
        self.n_cls, self.n_ctx = len(names), n_ctx

    def class_tokens(self) -> torch.Tensor:
        """The class-aware tokens ``[n_cls, n_ctx, width]``."""
        out = self.meta_net(self.t_clip)  # [n_cls, n_ctx * width]
        return out.view(self.n_cls, self.n_ctx, -1)  # [n_cls, n_ctx, width]

    def forward(self) -> torch.Tensor:
        """Prompt embeddings ``[n_cls, L, width]``."""
        prefix, suffix = self.token_prefix, self.token_suffix
        ctx = self.ctx.unsqueeze(0).expand(self.n_cls, -1, -1)  # [n_cls, n_ctx, width]
        return torch.cat([prefix, ctx.to(prefix.dtype), suffix], dim=1)


class TCPCLIP(FrozenImageCLIP):
    """Frozen CLIP with TCP's prompt learner (the CoOp ``CustomCLIP`` interface:
    :meth:`encode_image`, :meth:`encode_text`, :meth:`logits`)."""

    @classmethod
    def from_config(cls, cfg, classnames, clip_model):
        """The model of ``cfg`` (TRAINER.TCP, the dataset's templates) for ``classnames``."""
        c = cfg.TRAINER.TCP
        template, handcrafted = tcp_templates(cfg.DATASET.NAME, cfg.DATASET.TEMPLATE)
        return cls(
            classnames,
            clip_model,
            template,
            handcrafted,
            n_ctx=c.N_CTX,
            inject_layer=c.INJECT_LAYER,
        )

    def __init__(self, classnames, clip_model, template, handcrafted, n_ctx=4, inject_layer=8):
        super().__init__(clip_model)
        self.text_encoder = TextEncoder(clip_model)
        n_layers = self.text_encoder.num_layers
        if not 0 <= inject_layer < n_layers:
            raise ValueError(
                f"TRAINER.TCP.INJECT_LAYER is {inject_layer}, but the CLIP text tower has "
                f"{n_layers} blocks: set TRAINER.TCP.INJECT_LAYER to a block index in "
                f"0..{n_layers - 1}"
            )
        self.prompt_learner = TCPPromptLearner(
            classnames, clip_model, template, handcrafted, n_ctx=n_ctx
        )
        self.inject_layer = inject_layer

    def encode_text(self) -> torch.Tensor:
        """Normalised class text features ``[n_cls, dim]``."""
        pl = self.prompt_learner
        tokens = pl.class_tokens()  # [n_cls, n_ctx, width]

        def inject(i: int, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            if i != self.inject_layer:
                return x
            return torch.cat([x[:, :1], rows.to(x.dtype), x[:, 1 + pl.n_ctx :]], dim=1)

        # the class-aware tokens travel as row arguments: a chunked encoder hands each chunk
        # its own classes' tokens (MODEL.TEXT_CHUNK)
        text = self.text_encoder(pl(), pl.eot_idx, layer_hook=inject, row_args=(tokens,))
        return l2_normalize(text)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.logits(self.encode_image(image), self.encode_text())


@TRAINER_REGISTRY.register()
class TCP(PromptTrainer):
    """Textual-based Class-aware Prompt tuning (TCP); image features once per step, text
    features once per evaluation."""

    # the grid's default configs (configs/trainers/TCP/<cfg>.yaml; experiments/protocols.py)
    PROTOCOL_CFGS = {
        "base2new": "vit_b16_ep100_ctxv1",
        "base2new/imagenet": "vit_b16_ep25_ctxv1",
        "base2new/sun397": "vit_b16_ep25_ctxv1",
    }

    add_config = staticmethod(add_tcp_config)

    @classmethod
    def translate_key(cls, key, value, source):
        """TCP's files: ``TRAINER.COOP.<K>`` (module docstring)."""
        return translate_tcp_key(key, value, source)

    @classmethod
    def translate_cfg(cls, cfg):
        """TCP's ``train.py`` rule, with ``TRAINER.TCP.TRAIN_PY_RULES`` (module docstring)."""
        epochs = TCP_EPOCH_RULE.get(cfg.DATASET.NAME)
        if not cfg.TRAINER.TCP.TRAIN_PY_RULES or epochs is None:
            return None
        before, cfg.OPTIM.MAX_EPOCH = cfg.OPTIM.MAX_EPOCH, epochs
        return [
            f"TCP's train.py trains {cfg.DATASET.NAME} {epochs} epochs: OPTIM.MAX_EPOCH "
            f"{before} -> {epochs} (TRAINER.TCP.TRAIN_PY_RULES)"
        ]

    def check_cfg(self, cfg):
        c = cfg.TRAINER.TCP  # N_CTX and INJECT_LAYER are checked where they are used (the model)
        if c.W is not None:
            raise ConfigError(
                f"TRAINER.TCP.W {c.W}: the KgCoOp loss weight is now TRAINER.TCP.KG_WEIGHT "
                "(TCP's 8.0 by default), a name that cannot be taken for TRAINER.COOP.W (the "
                "unused knob TCP's script sets to 1.0); set TRAINER.TCP.KG_WEIGHT instead"
            )
        if c.KG_WEIGHT < 0:
            raise ConfigError(
                f"TRAINER.TCP.KG_WEIGHT (the KgCoOp loss weight) must be >= 0, got {c.KG_WEIGHT}"
            )

    def build_model(self):
        cfg = self.cfg
        clip_model = load_clip(cfg, precision=self.prec, device=self.device)
        self.model = TCPCLIP.from_config(cfg, self.classnames, clip_model).to(self.device)
        setup_prompt_learner(self)

    def compute_loss(self, inputs):
        t_clip = self.model.prompt_learner.t_clip
        return self.kg_regularised_loss(inputs, t_clip, self.cfg.TRAINER.TCP.KG_WEIGHT)
