"""IVLP: independent vision-language prompting (deep VPT + deep text prompts; the baseline of
MaPLe, Khattak et al., CVPR 2023, and the backbone of PromptSRC, ICCV 2023).

Learnable prompts in both CLIP towers with NO coupling between them (MaPLe couples them through
projections). Token positions, as in PromptSRC's ``IVLP`` design (and MaPLe's, whose prompted
towers are reused: :class:`trainers.maple.MaPLeCLIP`, engine/clip/vision.py):

- text, block 0: the tokenized prompt ``"{CTX_INIT} {class}."`` with token positions
  ``1 .. N_CTX_TEXT`` replaced by the learnable ``ctx`` ``[N_CTX_TEXT, text width]``, initialised
  from the embeddings of the first N_CTX_TEXT words of CTX_INIT (the other words stay fixed),
  or N(0, 0.02) with the prompt ``"X X X X {class}."`` when CTX_INIT is "";
- text, blocks ``i = 1 .. PROMPT_DEPTH_TEXT-1``: tokens ``1 .. N_CTX_TEXT`` replaced by
  ``deep_text[i-1]`` ``[N_CTX_TEXT, text width]`` (N(0, 0.02));
- vision, block 0 (if PROMPT_DEPTH_VISION >= 1): ``vpt`` ``[N_CTX_VISION, vision width]``
  (N(0, 0.02)) appended after the patch tokens, after the positional embedding, before ``ln_pre``;
- vision, blocks ``i = 1 .. PROMPT_DEPTH_VISION-1``: the LAST ``N_CTX_VISION`` tokens replaced by
  ``deep_vision[i-1]`` ``[N_CTX_VISION, vision width]`` (N(0, 0.02));
- deeper blocks keep the propagated tokens.

Cross-entropy on ``logit_scale * image @ text^T`` (both L2-normalised). Everything in the prompt
learner is trained; CLIP is frozen. Differences from PromptSRC's IVLP code, all deliberate:

- the prompts are fp32 master parameters in every precision mode, cast where they enter the
  towers (PromptSRC hard-codes ``half()``);
- checkpoints hold only the prompt learner (``ctx``, ``deep_text.*``, ``vpt``,
  ``deep_vision.*``; PromptSRC saved all of CLIP); class token buffers are non-persistent;
- CTX_INIT with fewer words than N_CTX_TEXT is an error (PromptSRC silently switched to a random
  init when N_CTX_TEXT > 4), as in trainers/maple.py;
- text prompts are cut to the longest EOT (identical features); class text features are
  computed once per evaluation.

Any optimizer: with no projections, the sharpness-aware configs in configs/optim/IVLP/ do not
stage (see those files).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.clip import keeps_full_length, require_vit
from engine.errors import ConfigError
from engine.registry import TRAINER_REGISTRY

from .common import init_context, register_class_prompts
from .maple import MaPLe, MaPLeCLIP, MaPLePrompts, text_prompt_hook, vision_prompt_hook

logger = logging.getLogger(__name__)


def add_ivlp_config(cfg) -> None:
    """TRAINER.IVLP keys (PromptSRC's names; its IVLP base-to-new values)."""
    from yacs.config import CfgNode as CN

    cfg.TRAINER.IVLP = CN()
    add_independent_prompt_keys(cfg.TRAINER.IVLP)


def add_independent_prompt_keys(node) -> None:
    """The prompt keys shared by IVLP and PromptSRC, added to ``node``."""
    node.N_CTX_TEXT = 4  # learnable text tokens per prompted text block
    node.N_CTX_VISION = 4  # learnable vision tokens per prompted vision block
    node.CTX_INIT = "a photo of a"  # prompt words; the first N_CTX_TEXT initialise ctx ("": random)
    node.PREC = "fp16"  # fp32 | fp16 (half CLIP, fp32 prompts) | amp | bf16
    node.PROMPT_DEPTH_TEXT = 9  # text blocks (from the first) with prompts; >= 1
    node.PROMPT_DEPTH_VISION = 9  # vision blocks (from the first) with prompts; 0 = none


def _normal(*shape, device=None) -> nn.Parameter:
    p = torch.empty(*shape, device=device)
    nn.init.normal_(p, std=0.02)
    return nn.Parameter(p)


class IndependentPromptLearner(nn.Module):
    """Independent deep text and vision prompts plus the fixed token embeddings of each class.

    Args:
        classnames: class names ("_" becomes " ").
        clip_model: the frozen CLIP (ViT image tower); its token embedding is read once.
        n_ctx_text, n_ctx_vision: prompt tokens per prompted block of each tower.
        ctx_init: prompt words whose first ``n_ctx_text`` initialise ``ctx`` ("" = random).
        depth_text: prompted text blocks (>= 1: block 0 always has ``ctx``).
        depth_vision: prompted vision blocks (0 = an unprompted image tower).
    """

    def __init__(
        self,
        classnames: list[str],
        clip_model,
        n_ctx_text: int = 4,
        n_ctx_vision: int = 4,
        ctx_init: str = "a photo of a",
        depth_text: int = 9,
        depth_vision: int = 9,
    ):
        super().__init__()
        visual = require_vit(clip_model, "IVLP's vision prompts")
        text_layers = len(clip_model.transformer.resblocks)
        vision_layers = len(visual.transformer.resblocks)
        if n_ctx_text < 1:
            raise ValueError(f"N_CTX_TEXT must be >= 1, got {n_ctx_text}")
        if depth_vision > 0 and n_ctx_vision < 1:
            raise ValueError(f"N_CTX_VISION must be >= 1 with vision prompts, got {n_ctx_vision}")
        if not 1 <= depth_text <= text_layers:
            raise ValueError(
                f"PROMPT_DEPTH_TEXT must be between 1 and the {text_layers} text blocks, got "
                f"{depth_text}"
            )
        if not 0 <= depth_vision <= vision_layers:
            raise ValueError(
                f"PROMPT_DEPTH_VISION must be between 0 and the {vision_layers} vision blocks, "
                f"got {depth_vision}"
            )
        ctx_dim = clip_model.ln_final.weight.shape[0]
        vis_dim = visual.conv1.out_channels
        embedding = clip_model.token_embedding
        device = embedding.weight.device

        ctx, prompt_prefix = init_context(embedding, ctx_init, n_ctx_text, "N_CTX_TEXT")
        self.ctx = nn.Parameter(ctx.to(device))  # fp32 master weights
        self.deep_text = nn.ParameterList(
            [_normal(n_ctx_text, ctx_dim, device=device) for _ in range(depth_text - 1)]
        )
        self.vpt = _normal(n_ctx_vision, vis_dim, device=device) if depth_vision > 0 else None
        self.deep_vision = nn.ParameterList(
            [_normal(n_ctx_vision, vis_dim, device=device) for _ in range(depth_vision - 1)]
        )

        names = [name.replace("_", " ") for name in classnames]
        prompts = [f"{prompt_prefix} {n}." for n in names]
        register_class_prompts(self, embedding, prompts, n_ctx_text, keeps_full_length(clip_model))
        self.n_cls, self.n_ctx_text, self.n_ctx_vision = len(names), n_ctx_text, n_ctx_vision
        self.depth_text, self.depth_vision = depth_text, depth_vision
        self.n_ctx = n_ctx_text  # the text context length, the name CoOp-family code reads
        self.prompt_prefix = prompt_prefix

    def forward(self) -> MaPLePrompts:
        ctx = self.ctx.unsqueeze(0).expand(self.n_cls, -1, -1)  # [n_cls, n_ctx_text, ctx_dim]
        prefix, suffix = self.token_prefix, self.token_suffix
        text = torch.cat([prefix, ctx.to(prefix.dtype), suffix], dim=1)  # [n_cls, L, ctx_dim]
        return MaPLePrompts(text, self.vpt, list(self.deep_text), list(self.deep_vision))


class IVLPCLIP(MaPLeCLIP):
    """Frozen CLIP with independent prompts: MaPLe's prompted towers, one token count per
    tower (the :class:`trainers.maple.MaPLeCLIP` interface)."""

    CONFIG_NODE = "IVLP"

    @classmethod
    def build_prompt_learner(cls, cfg, classnames, clip_model) -> IndependentPromptLearner:
        node = cfg.TRAINER[cls.CONFIG_NODE]
        return IndependentPromptLearner(
            classnames,
            clip_model,
            n_ctx_text=node.N_CTX_TEXT,
            n_ctx_vision=node.N_CTX_VISION,
            ctx_init=node.CTX_INIT,
            depth_text=node.PROMPT_DEPTH_TEXT,
            depth_vision=node.PROMPT_DEPTH_VISION,
        )

    def text_features(self, prompts: MaPLePrompts) -> torch.Tensor:
        """Class text features ``[n_cls, embed_dim]`` (not normalised)."""
        hook = text_prompt_hook(prompts.deep_text, self.prompt_learner.n_ctx_text)
        return self.text_encoder(prompts.text, self.prompt_learner.eot_idx, layer_hook=hook)

    def image_features(self, image: torch.Tensor, prompts: MaPLePrompts) -> torch.Tensor:
        """Prompted image features ``[batch, embed_dim]`` (not normalised)."""
        hook = vision_prompt_hook(prompts.deep_vision, self.prompt_learner.n_ctx_vision)
        return self.image_encoder(image, prompts.vision, layer_hook=hook)


@TRAINER_REGISTRY.register()
class IVLP(MaPLe):
    """Independent Vision-Language Prompting: MaPLe's trainer (cross-entropy, nothing frozen to
    precompute, class text features once per evaluation) on independent prompts."""

    # the grid's default configs (configs/trainers/IVLP/<cfg>.yaml; experiments/protocols.py)
    PROTOCOL_CFGS = {
        "base2new": "vit_b16_c2_ep20_batch4_4x4ctx",
    }

    add_config = staticmethod(add_ivlp_config)
    model_name = "VLPromptLearner"  # checkpoint folder, as in PromptSRC's code base
    MODEL_CLASS = IVLPCLIP

    def check_cfg(self, cfg):
        super().check_cfg(cfg)  # a ViT backbone
        node = self.trainer_cfg(cfg)
        for key, low in (
            ("N_CTX_TEXT", 1),
            ("N_CTX_VISION", 0),
            ("PROMPT_DEPTH_TEXT", 1),
            ("PROMPT_DEPTH_VISION", 0),
        ):
            if node[key] < low:
                raise ConfigError(f"{self.cfg_key(key)} must be >= {low}, got {node[key]}")
        if node.PROMPT_DEPTH_VISION > 0 and node.N_CTX_VISION < 1:
            raise ConfigError(
                f"{self.cfg_key('N_CTX_VISION')} must be >= 1 when "
                f"{self.cfg_key('PROMPT_DEPTH_VISION')} is {node.PROMPT_DEPTH_VISION} (or set "
                "PROMPT_DEPTH_VISION 0 for an unprompted image tower)"
            )
