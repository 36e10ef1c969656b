"""MaPLe: multi-modal prompt learning (Khattak et al., CVPR 2023).

Coupled text and vision prompts in the first ``PROMPT_DEPTH`` blocks of both CLIP towers:

- text, block 0: the tokenized prompt ``"{CTX_INIT} {class}."`` with token positions
  ``1 .. N_CTX`` replaced by the learnable context ``ctx`` ``[n_ctx, text width]``. As in MaPLe's
  code, ``ctx`` starts from the embeddings of the FIRST ``N_CTX`` words of CTX_INIT and the other
  words stay in the prompt as fixed tokens: with "a photo of a" and N_CTX 2 the sequence is
  ``[SOS][ctx_1 = "a"][ctx_2 = "photo"][of][a][class tokens][.][EOS]`` (positions 1, 2 learnable);
  without CTX_INIT, ``ctx`` is N(0, 0.02) and the prompt is ``"X X {class}."``;
- vision, block 0: ``proj(ctx)`` (Linear text width -> vision width) appended after the patch
  tokens, after the positional embedding and before ``ln_pre`` (engine/clip/vision.py);
- blocks ``i = 1 .. PROMPT_DEPTH-1``: the text tokens ``1 .. N_CTX`` are replaced by the deep
  text prompt ``compound_prompts_text[i-1]`` (N(0, 0.02)) and the LAST ``N_CTX`` vision tokens by
  ``compound_prompt_projections[i-1](compound_prompts_text[i-1])``; deeper blocks keep the
  propagated tokens.

Everything in the prompt learner is trained (context, deep prompts, projections); CLIP is frozen.
Differences from MaPLe's code base, all deliberate:

- the prompts and projections are fp32 master parameters in every precision mode (MaPLe's fp32
  mode broke on a hard-coded ``half()``); in "fp16" mode they are cast to CLIP's half precision
  where they enter the towers;
- checkpoints hold only the prompt learner's parameters (MaPLe saved all of CLIP); the
  class-dependent token embeddings are non-persistent buffers rebuilt for any set of classes;
- CTX_INIT with fewer than N_CTX words is an error (MaPLe silently put EOS/padding embeddings into
  the context and overwrote the class name);
- text prompts are cut to the longest EOT (identical features, see engine/clip/text.py); the
  class text features are computed once per evaluation, not per test batch;
- the deep prompts are a ParameterList/ModuleList that replicate correctly.
As in MaPLe's code, all deep projections start from one copy of the same random initialisation.

Staged training with SAMPLe (the SAMPLe paper; optim/staging.py):
configs/optim/MaPLe/sample.yaml trains everything over the published schedule, then freezes
``proj.*`` and ``compound_prompt_projections.*`` for ``OPTIM.SAM.STAGE2_EPOCHS`` added epochs.
"""

from __future__ import annotations

import copy
import logging
from typing import NamedTuple

import torch
from torch import nn

from engine.clip import (
    PromptedVisionEncoder,
    TextEncoder,
    keeps_full_length,
    load_clip,
    require_vit,
)
from engine.clip.model import BackboneRefused, backbone_label, vision_tower_kind
from engine.registry import TRAINER_REGISTRY
from engine.trainer import ModelOutput, TrainerX
from engine.utils import compute_accuracy

from .common import (
    clip_logits,
    init_context,
    l2_normalize,
    register_class_prompts,
    setup_learnable,
)

logger = logging.getLogger(__name__)


def add_maple_config(cfg) -> None:
    """TRAINER.MAPLE keys (MaPLe's names and base-to-new defaults)."""
    from yacs.config import CfgNode as CN

    cfg.TRAINER.MAPLE = CN()
    add_multimodal_prompt_keys(cfg.TRAINER.MAPLE)


def add_multimodal_prompt_keys(node) -> None:
    """The prompt keys shared by MaPLe and CoPrompt, added to ``node``."""
    node.N_CTX = 2  # number of learnable context tokens (text and vision, every prompted block)
    node.CTX_INIT = "a photo of a"  # prompt words; the first N_CTX initialise ctx ("": random)
    node.PREC = "fp16"  # fp32 | fp16 (half CLIP, fp32 prompts) | amp | bf16
    node.PROMPT_DEPTH = 9  # number of blocks (from the first) with prompts in both towers


class MaPLePrompts(NamedTuple):
    """The prompt learner's output for one forward pass."""

    text: torch.Tensor  # [n_cls, L, text width]: the block-0 text prompts
    vision: torch.Tensor  # [n_ctx, vision width]: the block-0 vision prompts
    deep_text: list[torch.Tensor]  # depth-1 x [n_ctx, text width]: blocks 1..depth-1
    deep_vision: list[torch.Tensor]  # depth-1 x [n_ctx, vision width]: blocks 1..depth-1


class MultiModalPromptLearner(nn.Module):
    """MaPLe's coupled text and vision prompts plus the fixed token embeddings of each class.

    Args:
        classnames: class names ("_" becomes " ").
        clip_model: the frozen CLIP (ViT image tower); its token embedding is read once.
        n_ctx: context tokens per prompted block.
        ctx_init: prompt words whose first ``n_ctx`` initialise the context ("" = random).
        depth: number of prompted blocks (1 = block 0 only).
    """

    def __init__(
        self,
        classnames: list[str],
        clip_model,
        n_ctx: int = 2,
        ctx_init: str = "a photo of a",
        depth: int = 9,
    ):
        super().__init__()
        visual = require_vit(clip_model, "MaPLe's vision prompts")
        text_layers = len(clip_model.transformer.resblocks)
        vision_layers = len(visual.transformer.resblocks)
        if n_ctx < 1:
            raise ValueError(f"N_CTX must be >= 1, got {n_ctx}")
        if not 1 <= depth <= min(text_layers, vision_layers):
            raise ValueError(
                f"PROMPT_DEPTH must be between 1 and the number of blocks of the smaller tower "
                f"({min(text_layers, vision_layers)}), got {depth}"
            )
        ctx_dim = clip_model.ln_final.weight.shape[0]
        vis_dim = visual.conv1.out_channels
        embedding = clip_model.token_embedding
        device = embedding.weight.device

        ctx_vectors, prompt_prefix = init_context(embedding, ctx_init, n_ctx)  # [n_ctx, ctx_dim]
        self.ctx = nn.Parameter(ctx_vectors.to(device))  # fp32 master weights
        self.proj = nn.Linear(ctx_dim, vis_dim).to(device)
        deep = []
        for _ in range(depth - 1):
            p = torch.empty(n_ctx, ctx_dim, device=device)
            nn.init.normal_(p, std=0.02)
            deep.append(nn.Parameter(p))
        self.compound_prompts_text = nn.ParameterList(deep)
        single = nn.Linear(ctx_dim, vis_dim).to(device)
        self.compound_prompt_projections = nn.ModuleList(
            [copy.deepcopy(single) for _ in range(depth - 1)]
        )

        names = [name.replace("_", " ") for name in classnames]
        prompts = [f"{prompt_prefix} {name}." for name in names]
        register_class_prompts(self, embedding, prompts, n_ctx, keeps_full_length(clip_model))
        self.n_cls, self.n_ctx, self.depth = len(names), n_ctx, depth
        self.prompt_prefix = prompt_prefix

    def forward(self) -> MaPLePrompts:
        ctx = self.ctx.unsqueeze(0).expand(self.n_cls, -1, -1)  # [n_cls, n_ctx, ctx_dim]
        prefix, suffix = self.token_prefix, self.token_suffix
        text = torch.cat([prefix, ctx.to(prefix.dtype), suffix], dim=1)  # [n_cls, L, ctx_dim]
        deep_text = list(self.compound_prompts_text)
        deep_vision = [
            layer(p) for layer, p in zip(self.compound_prompt_projections, deep_text)
        ]  # each [n_ctx, vis_dim]
        return MaPLePrompts(text, self.proj(self.ctx), deep_text, deep_vision)


def text_prompt_hook(deep_text: list[torch.Tensor], n_ctx: int):
    """``hook(i, x)`` replacing text tokens ``1 .. n_ctx`` by ``deep_text[i-1]`` in blocks
    ``1 .. len(deep_text)``."""

    def hook(i: int, x: torch.Tensor) -> torch.Tensor:
        if not 1 <= i <= len(deep_text):
            return x
        p = deep_text[i - 1].to(x.dtype).expand(x.shape[0], -1, -1)  # [n, n_ctx, width]
        return torch.cat([x[:, :1], p, x[:, 1 + n_ctx :]], dim=1)

    return hook


def vision_prompt_hook(deep_vision: list[torch.Tensor], n_ctx: int):
    """``hook(i, x)`` replacing the last ``n_ctx`` vision tokens by ``deep_vision[i-1]`` in
    blocks ``1 .. len(deep_vision)``."""

    def hook(i: int, x: torch.Tensor) -> torch.Tensor:
        if not 1 <= i <= len(deep_vision):
            return x
        p = deep_vision[i - 1].to(x.dtype).expand(x.shape[0], -1, -1)  # [batch, n_ctx, width]
        return torch.cat([x[:, : x.shape[1] - n_ctx], p], dim=1)

    return hook


class MaPLeCLIP(nn.Module):
    """Frozen CLIP with MaPLe's prompt learner.

    The trainer uses the parts: ``prompt_learner()`` once per pass, then :meth:`encode_image`
    and :meth:`encode_text` (L2-normalised) on its output, and :meth:`logits`.
    ``learnable`` is the module that is trained and checkpointed.
    """

    CONFIG_NODE = "MAPLE"  # TRAINER.<node> that from_config reads

    @classmethod
    def build_prompt_learner(cls, cfg, classnames, clip_model) -> MultiModalPromptLearner:
        node = cfg.TRAINER[cls.CONFIG_NODE]
        return MultiModalPromptLearner(
            classnames,
            clip_model,
            n_ctx=node.N_CTX,
            ctx_init=node.CTX_INIT,
            depth=node.PROMPT_DEPTH,
        )

    @classmethod
    def from_config(cls, cfg, classnames, clip_model):
        """The model of ``cfg`` (TRAINER.MAPLE) for ``classnames``."""
        return cls(cls.build_prompt_learner(cfg, classnames, clip_model), clip_model)

    def __init__(self, prompt_learner: MultiModalPromptLearner, clip_model):
        super().__init__()
        self.prompt_learner = prompt_learner
        self.text_encoder = TextEncoder(clip_model)
        self.image_encoder = PromptedVisionEncoder(clip_model)
        self.logit_scale = clip_model.logit_scale

    @property
    def learnable(self) -> nn.Module:
        return self.prompt_learner

    def text_features(self, prompts: MaPLePrompts) -> torch.Tensor:
        """Class text features ``[n_cls, embed_dim]`` (not normalised)."""
        hook = text_prompt_hook(prompts.deep_text, self.prompt_learner.n_ctx)
        return self.text_encoder(prompts.text, self.prompt_learner.eot_idx, layer_hook=hook)

    def image_features(self, image: torch.Tensor, prompts: MaPLePrompts) -> torch.Tensor:
        """Prompted image features ``[batch, embed_dim]`` (not normalised)."""
        hook = vision_prompt_hook(prompts.deep_vision, self.prompt_learner.n_ctx)
        return self.image_encoder(image, prompts.vision, layer_hook=hook)

    def encode_text(self, prompts: MaPLePrompts) -> torch.Tensor:
        return l2_normalize(self.text_features(prompts))

    def encode_image(self, image: torch.Tensor, prompts: MaPLePrompts) -> torch.Tensor:
        return l2_normalize(self.image_features(image, prompts))

    def logits(self, image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
        return clip_logits(self.logit_scale, image_features, text_features)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        prompts = self.prompt_learner()
        return self.logits(self.encode_image(image, prompts), self.encode_text(prompts))


VIT_BACKBONES = (
    "ViT-B/32, ViT-B/16, ViT-L/14, ViT-L/14@336px, or an open_clip ViT as arch:tag (e.g. "
    "ViT-H-14:laion2b_s32b_b79k)"
)


def check_vit_backbone(trainer: str, cfg) -> None:
    """Refuse a ResNet backbone before CLIP is loaded (vision prompts need a ViT)."""
    if vision_tower_kind(cfg) == "resnet":
        raise BackboneRefused(
            f"{trainer} cannot use the backbone {backbone_label(cfg)}: its vision prompts need a "
            "ViT image encoder (a token sequence to insert prompts into), and this backbone's "
            "image encoder is a ResNet (ModifiedResNet). Set MODEL.BACKBONE.NAME ViT-B/16 or "
            f"another ViT: {VIT_BACKBONES}. (CoOp, CoCoOp, KgCoOp, TCP and zero-shot CLIP work "
            "with the ResNets.)"
        )


@TRAINER_REGISTRY.register()
class MaPLe(TrainerX):
    """Multi-modal Prompt Learning (MaPLe).

    The image encoder carries prompts, so nothing is precomputed per step (``prepare_step``
    passes the batch through); the class text features are computed once per evaluation.
    """

    # the grid's default configs (configs/trainers/MaPLe/<cfg>.yaml; experiments/protocols.py)
    PROTOCOL_CFGS = {
        "base2new": "vit_b16_c2_ep5_batch4_2ctx",
        "transfer": "vit_b16_c2_ep5_batch4_2ctx_cross_datasets",
    }

    add_config = staticmethod(add_maple_config)
    model_name = "MultiModalPromptLearner"  # checkpoint folder, as in MaPLe's code base

    MODEL_CLASS = MaPLeCLIP  # CoPrompt: its CLIP with adapters and teacher

    def check_cfg(self, cfg):
        check_vit_backbone(TRAINER_REGISTRY.name_of(type(self)) or type(self).__name__, cfg)

    def build_model(self):
        clip_model = load_clip(self.cfg, precision=self.prec, device=self.device)
        require_vit(clip_model, f"{type(self).__name__}'s prompts")
        model = self.MODEL_CLASS.from_config(self.cfg, self.classnames, clip_model)
        self.model = model.to(self.device)
        setup_learnable(self, self.model.learnable, self.model_name)

    def compute_loss(self, inputs):
        image, label = inputs
        prompts = self.model.prompt_learner()
        image_features = self.model.encode_image(image, prompts)
        logits = self.model.logits(image_features, self.model.encode_text(prompts))
        loss = self.classification_loss(logits, label)
        return loss, {"acc": compute_accuracy(logits, label)[0]}

    def before_test(self):
        self._prompts = self.model.prompt_learner()
        self._text_features = self.model.encode_text(self._prompts)

    def after_test(self):
        self._prompts = self._text_features = None

    def model_inference(self, image):
        image_features = self.model.encode_image(image, self._prompts)
        return self.model.logits(image_features, self._text_features)

    def model_outputs(self, image):
        prompts = self.model.prompt_learner()
        image_features = self.model.encode_image(image, prompts)
        text_features = self.model.encode_text(prompts)
        return ModelOutput(
            image_features, text_features, self.model.logits(image_features, text_features)
        )
