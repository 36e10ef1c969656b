"""MMRL: multi-modal representation learning (Guo and Gu, CVPR 2025; yunncheng/MMRL).

A learnable shared representation space ``R`` (``N_REP_TOKENS`` tokens of ``REP_DIM``) is
projected into the higher blocks of both CLIP towers. For each layer ``l`` of ``REP_LAYERS``
(1-based block numbers, increasing), one linear map per tower turns ``R`` into that block's
representation tokens ``R_l^v = W_l^v R + b_l^v`` (vision width) and ``R_l^t = W_l^t R + b_l^t``
(text width); all maps of a tower start from one copy of the same random initialisation, as in
MMRL's code. Before block ``l``:

- vision: the tokens sit right after the class token, ``[CLS][R_l^v][patches]``; the first layer
  of ``REP_LAYERS`` inserts them, each later one replaces them (blocks in between propagate them);
- text: the same after the start token, ``[SOS][R_l^t][prompt tokens]``; from the first layer of
  ``REP_LAYERS`` on the causal mask covers the longer sequence (the representation tokens see
  the start token and each other causally; every prompt token sees them all), and the text
  feature is read at the EOT token, shifted by ``N_REP_TOKENS``.

The text prompt is the dataset's hand-crafted template (CoOp's per-dataset templates,
trainers/zsclip.py) with no learnable context. The image gives two features: the class token's
(``ln_post`` then CLIP's projection, frozen) and the representation tokens' (``ln_post`` of the
``N_REP_TOKENS`` output tokens, averaged, then the learnable ``proj_rep`` ``[vision width,
embed dim]``, N(0, width^-1/2)). With L2-normalised features ``f`` (class token), ``f_r``
(representation tokens), ``g`` (classes) and the frozen CLIP's ``f0`` (image) and ``g0``
(template text), ``z = 100 f g^T`` and ``z_r = 100 f_r g^T``::

    loss = ALPHA CE(z) + (1 - ALPHA) CE(z_r) + REG_WEIGHT (1 - mean cos(f, f0))
           + REG_WEIGHT (1 - mean cos(g, g0))

The logit scale is MMRL's constant 100, not CLIP's ``logit_scale``. Decoupled inference
(``TRAINER.MMRL.TASK``, MMRL's top-level ``TASK``): the fused logits ``ALPHA z + (1 - ALPHA) z_r``
on the classes the representation tokens were trained on, the class-token logits ``z`` elsewhere:
``B2N``: fused on ``SUBSAMPLE_CLASSES base``, ``z`` otherwise; ``FS``: fused; ``CD``: fused on
ImageNet, ``z`` on any other dataset.

Learnable: ``R``, the per-layer maps and ``proj_rep`` (the module :class:`RepresentationLearner`,
checkpoint folder ``MultiModalRepresentationLearner`` as in MMRL's code). CLIP is frozen; ``f0``
is computed once per step (``prepare_step``) by the same image tower without representation
tokens, ``g0`` once when the model is built.

MMRL's per-dataset values (its trainers/config.py: ``REG_WEIGHT`` per dataset, ``REP_DIM`` 2048
on EuroSAT) apply over the config files when ``TRAINER.MMRL.DATASET_VALUES`` is True (default)
and ``TASK`` is ``B2N`` or ``FS``; ``KEY VALUE`` options on the command line win, as in MMRL's
train.py. (With ``TASK CD`` they are not applied: in MMRL's code their only effects there are
overridden by its cross-dataset scripts, which pass ``REG_WEIGHT 0.2`` and ``REP_DIM 512``.)

Differences from MMRL's code, all deliberate:

- the learnable parameters are fp32 master weights in every precision mode, cast to CLIP's
  precision where they enter the towers (MMRL's ``fp16`` mode keeps them in half precision);
- ``f0`` and ``g0`` come from the one frozen CLIP (MMRL loads a second copy of the same weights);
- checkpoints hold only the learnable module (MMRL saved all of CLIP); MMRL's checkpoints load
  (``representation_learner.*`` and ``image_encoder.proj_rep`` are read, the rest ignored);
- text prompts are cut after the longest EOT (engine/clip/text.py; identical features up to
  fp32 rounding); class text features are computed once per evaluation;
- with a pooling other than the class token (non-OpenAI open_clip ViTs) the class path pools
  the image tokens without the representation tokens.
- the optimizers that read a pass's logits (ESAM's per-item losses, SAF, MESA) get the
  class-token logits ``z`` (the pass's classification loss); the text-memory options
  (``MODEL.TEXT_CHUNK``, ``CHECKPOINT_TEXT``, ``SHARED_PREFIX``) are refused: MMRL's text pass
  runs its own loop over the blocks;
- without ``--load-epoch`` and without ``model-best.pth.tar`` an evaluation loads the newest
  numbered checkpoint, as MMRL's ``load_model`` does (the engine would ask for one).

The differential test against MMRL's code is tests/test_mmrl.py (reference numbers from
tests/reference/make_mmrl.py).
"""

from __future__ import annotations

import copy
import logging
import os
import os.path as osp
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.clip import (
    PromptedVisionEncoder,
    TextEncoder,
    encode_texts,
    keeps_full_length,
    load_clip,
    require_vit,
    tokenize,
    truncate_tokens,
)
from engine.clip.model import BackboneError
from engine.errors import ConfigError
from engine.registry import TRAINER_REGISTRY
from engine.trainer import ModelOutput, TrainerX
from engine.utils import compute_accuracy

from .common import kg_loss, l2_normalize, setup_learnable
from .maple import check_vit_backbone
from .zsclip import dataset_template

logger = logging.getLogger(__name__)

LOGIT_SCALE = 100.0  # MMRL's fixed logit scale
TASKS = ("B2N", "FS", "CD")
DEFAULT_REP_LAYERS = [6, 7, 8, 9, 10, 11, 12]

# MMRL's per-dataset values (its trainers/config.py), Dassl dataset name -> {key: value}
DATASET_VALUES = {
    "StanfordCars": {"REG_WEIGHT": 7.0},
    "FGVCAircraft": {"REG_WEIGHT": 6.0},
    "SUN397": {"REG_WEIGHT": 6.0},
    "DescribableTextures": {"REG_WEIGHT": 6.0},
    "Food101": {"REG_WEIGHT": 5.0},
    "OxfordFlowers": {"REG_WEIGHT": 4.0},
    "UCF101": {"REG_WEIGHT": 3.0},
    "ImageNet": {"REG_WEIGHT": 0.5},
    "Caltech101": {"REG_WEIGHT": 0.5},
    "OxfordPets": {"REG_WEIGHT": 0.2},
    "EuroSAT": {"REP_DIM": 2048, "REG_WEIGHT": 0.01},
}


def add_mmrl_config(cfg) -> None:
    """TRAINER.MMRL keys (MMRL's names; its base-to-new values)."""
    from yacs.config import CfgNode as CN

    cfg.TRAINER.MMRL = CN()
    node = cfg.TRAINER.MMRL
    node.ALPHA = 0.7  # weight of the class-token logits (loss and fused inference)
    node.REG_WEIGHT = 1.0  # weight of each of the two cosine terms to the frozen CLIP
    node.N_REP_TOKENS = 5  # representation tokens per tower and layer
    node.REP_LAYERS = list(DEFAULT_REP_LAYERS)  # 1-based blocks that get the tokens, increasing
    node.REP_DIM = 512  # width of the shared representation space
    node.PREC = "fp16"  # fp32 | fp16 (half CLIP, fp32 learnables) | amp | bf16
    node.TASK = "B2N"  # B2N | FS | CD: which logits an evaluation reports (module docstring)
    node.DATASET_VALUES = True  # apply MMRL's per-dataset REG_WEIGHT/REP_DIM (B2N and FS)


class RepresentationTokens(NamedTuple):
    """The learner's output for one pass: one tensor per layer of REP_LAYERS."""

    text: list[torch.Tensor]  # each [n_tokens, text width]
    vision: list[torch.Tensor]  # each [n_tokens, vision width]


class RepresentationLearner(nn.Module):
    """MMRL's learnable parts: the shared tokens, the per-layer maps into each tower and the
    projection of the representation tokens' image feature.

    Args:
        n_tokens, rep_dim: the shared space ``[n_tokens, rep_dim]`` (N(0, 0.02)).
        n_layers: number of layers that get representation tokens.
        text_width, vision_width: the towers' widths.
        embed_dim: CLIP's joint embedding width (``proj_rep``'s output).
    """

    def __init__(
        self,
        n_tokens: int,
        rep_dim: int,
        n_layers: int,
        text_width: int,
        vision_width: int,
        embed_dim: int,
    ):
        super().__init__()
        tokens = torch.empty(n_tokens, rep_dim)
        nn.init.normal_(tokens, std=0.02)
        self.compound_rep_tokens = nn.Parameter(tokens)
        to_vision = nn.Linear(rep_dim, vision_width)
        to_text = nn.Linear(rep_dim, text_width)
        # MMRL's code: every layer's map starts from one copy of the same initialisation
        self.compound_rep_tokens_r2vproj = nn.ModuleList(
            [copy.deepcopy(to_vision) for _ in range(n_layers)]
        )
        self.compound_rep_tokens_r2tproj = nn.ModuleList(
            [copy.deepcopy(to_text) for _ in range(n_layers)]
        )
        self.proj_rep = nn.Parameter(vision_width**-0.5 * torch.randn(vision_width, embed_dim))
        self.n_tokens = n_tokens

    def forward(self) -> RepresentationTokens:
        r = self.compound_rep_tokens
        text = [layer(r) for layer in self.compound_rep_tokens_r2tproj]
        vision = [layer(r) for layer in self.compound_rep_tokens_r2vproj]
        return RepresentationTokens(text, vision)


def _causal_mask(width: int, like: torch.Tensor) -> torch.Tensor:
    """CLIP's additive causal mask ``[width, width]`` in ``like``'s dtype and device."""
    mask = torch.full((width, width), float("-inf"), dtype=like.dtype, device=like.device)
    return mask.triu_(1)


def _with_tokens(x: torch.Tensor, tokens: torch.Tensor, n: int, first: bool) -> torch.Tensor:
    """``x`` ``[batch, seq, width]`` with ``tokens`` ``[n, width]`` at positions ``1 .. n``:
    inserted (``first``) or replacing the tokens there."""
    t = tokens.to(x.dtype).expand(x.shape[0], -1, -1)
    return torch.cat([x[:, :1], t, x[:, (1 if first else 1 + n) :]], dim=1)


class MMRLCLIP(nn.Module):
    """The frozen CLIP with MMRL's representation tokens.

    Attributes: ``learner`` (:class:`RepresentationLearner`, trained), ``text_encoder`` and
    ``image_encoder`` (CLIP's towers), the non-persistent buffers ``prompt_embeddings``
    ``[n_cls, L, text width]`` and ``eot_idx`` of the template prompts, and ``zs_text_features``
    (``g0``, ``[n_cls, embed dim]``, normalised, fp32).
    """

    def __init__(
        self, learner: RepresentationLearner, clip_model, classnames, template, rep_layers
    ):
        super().__init__()
        self.learner = learner
        self.text_encoder = TextEncoder(clip_model)
        self.image_encoder = PromptedVisionEncoder(clip_model)
        if self.image_encoder.visual.proj is None:
            raise BackboneError(
                "MMRL needs a ViT image tower with an output projection (visual.proj); this "
                "backbone has none"
            )
        self.rep_layers = [int(v) for v in rep_layers]
        names = [c.replace("_", " ") for c in classnames]
        prompts = [template.format(n) for n in names]
        tokens, eot = truncate_tokens(tokenize(prompts), keeps_full_length(clip_model))
        embedding = clip_model.token_embedding
        with torch.no_grad():
            emb = embedding(tokens.to(embedding.weight.device))
        self.register_buffer("prompt_embeddings", emb, persistent=False)
        self.register_buffer("eot_idx", eot.to(emb.device), persistent=False)
        g0 = encode_texts(self.text_encoder, prompts)  # the frozen CLIP, normalised, fp32
        self.register_buffer("zs_text_features", g0, persistent=False)
        self.template = template

    @classmethod
    def from_config(cls, cfg, classnames, clip_model):
        """The model of ``cfg`` (TRAINER.MMRL, the dataset's template) for ``classnames``."""
        node = cfg.TRAINER.MMRL
        visual = require_vit(clip_model, "MMRL's representation tokens")
        layers = list(node.REP_LAYERS)
        depth = min(len(clip_model.transformer.resblocks), len(visual.transformer.resblocks))
        if not layers or layers[-1] > depth:
            raise ConfigError(
                f"TRAINER.MMRL.REP_LAYERS {layers} must name blocks 1 .. {depth} (this CLIP's "
                "towers have that many blocks)"
            )
        learner = RepresentationLearner(
            node.N_REP_TOKENS,
            node.REP_DIM,
            len(layers),
            clip_model.ln_final.weight.shape[0],
            visual.conv1.out_channels,
            visual.proj.shape[1],
        )
        template = dataset_template(cfg.DATASET.NAME, cfg.DATASET.TEMPLATE)
        return cls(learner, clip_model, classnames, template, layers)

    @property
    def learnable(self) -> nn.Module:
        return self.learner

    @property
    def n_tokens(self) -> int:
        return self.learner.n_tokens

    def text_features(self, tokens: list[torch.Tensor]) -> torch.Tensor:
        """Class text features ``[n_cls, embed dim]`` with the text representation tokens of
        each layer of REP_LAYERS (not normalised)."""
        enc, n = self.text_encoder, self.n_tokens
        x = self.prompt_embeddings
        seq = x.shape[1]
        x = x.to(enc.dtype) + enc.positional_embedding[:seq].to(enc.dtype)
        mask = enc.attn_mask[:seq, :seq]
        layers, k = self.rep_layers, 0
        for i, block in enumerate(enc.transformer.resblocks):
            if i + 1 in layers:
                x = _with_tokens(x, tokens[k], n, first=k == 0)
                k += 1
                if mask.shape[0] != x.shape[1]:
                    mask = _causal_mask(x.shape[1], enc.attn_mask)
            x = block(x, attn_mask=mask)
        rows = torch.arange(x.shape[0], device=x.device)
        return enc.project(x[rows, self.eot_idx + n])

    def image_features(
        self, image: torch.Tensor, tokens: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The class token's and the representation tokens' image features, each
        ``[batch, embed dim]`` (not normalised)."""
        visual, n = self.image_encoder.visual, self.n_tokens
        x = self.image_encoder.embed(image)  # [batch, 1 + patches, width] after ln_pre
        k = 0
        for i, block in enumerate(visual.transformer.resblocks):
            if i + 1 in self.rep_layers:
                x = _with_tokens(x, tokens[k], n, first=k == 0)
                k += 1
            x = block(x)
        pooled, _ = visual._pool(torch.cat([x[:, :1], x[:, 1 + n :]], dim=1))
        image_features = pooled @ visual.proj
        rep = visual.ln_post(x[:, 1 : 1 + n]).mean(dim=1)  # [batch, width]
        return image_features, rep @ self.learner.proj_rep.to(rep.dtype)

    @torch.no_grad()
    def zero_shot_image(self, image: torch.Tensor) -> torch.Tensor:
        """The frozen CLIP's normalised image features ``f0`` ``[batch, embed dim]``."""
        return l2_normalize(self.image_encoder.visual(image.to(self.image_encoder.dtype)))

    def encode(self, image: torch.Tensor, tokens: RepresentationTokens, text=None):
        """Normalised ``(f, f_r, g)``; ``text``: precomputed normalised ``g``."""
        f, f_r = self.image_features(image, tokens.vision)
        g = l2_normalize(self.text_features(tokens.text)) if text is None else text
        return l2_normalize(f), l2_normalize(f_r), g

    @staticmethod
    def logits(image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
        return LOGIT_SCALE * image_features @ text_features.t().to(image_features.dtype)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """The class-token logits ``z`` ``[batch, n_cls]``."""
        f, _, g = self.encode(image, self.learner())
        return self.logits(f, g)


def mmrl_loss(
    logits, logits_rep, label, image, zs_image, text, zs_text, alpha, reg_weight, ce=None
):
    """MMRL's objective and its terms (fp32): ``(loss, {"ce", "ce_rep", "reg_image",
    "reg_text"})``; ``ce``: the class-token cross-entropy if already computed."""
    ce = F.cross_entropy(logits.float(), label) if ce is None else ce
    ce_rep = F.cross_entropy(logits_rep.float(), label)
    reg_image = kg_loss(image, zs_image)  # 1 - mean cos
    reg_text = kg_loss(text, zs_text)
    loss = alpha * ce + (1 - alpha) * ce_rep + reg_weight * reg_image + reg_weight * reg_text
    return loss, {"ce": ce, "ce_rep": ce_rep, "reg_image": reg_image, "reg_text": reg_text}


@TRAINER_REGISTRY.register()
class MMRL(TrainerX):
    """Multi-Modal Representation Learning (see the module docstring)."""

    # the grid's default configs (configs/trainers/MMRL/<cfg>.yaml; experiments/protocols.py)
    PROTOCOL_CFGS = {
        "base2new": "vit_b16",
        "base2new/imagenet": "vit_b16_imagenet",
        "transfer": "vit_b16_cross_datasets",
        "few_shot": "vit_b16_few_shot",  # MMRL's few_shot.sh: ImageNet's config with TASK FS
        "few_shot/imagenet": "vit_b16_imagenet",
    }
    PROTOCOL_OPTS = {"few_shot": ("TRAINER.MMRL.TASK", "FS")}

    add_config = staticmethod(add_mmrl_config)
    model_name = "MultiModalRepresentationLearner"  # checkpoint folder, as in MMRL's code

    @classmethod
    def translate_key(cls, key, value, source):
        """MMRL's train.py declares ``TASK`` at the top level: here ``TRAINER.MMRL.TASK``."""
        if key == "TASK":
            return [("TRAINER.MMRL.TASK", value)]
        return [(key, value)]

    @classmethod
    def translate_cfg(cls, cfg):
        """MMRL's per-dataset values over the config files (module docstring); the command
        line's ``KEY VALUE`` options are merged again afterwards and win."""
        node = cfg.TRAINER.MMRL
        if not node.DATASET_VALUES or node.TASK not in ("B2N", "FS"):
            return None
        lines = []
        for key, value in DATASET_VALUES.get(cfg.DATASET.NAME, {}).items():
            if node[key] != value:
                lines.append(
                    f"TRAINER.MMRL.{key} {node[key]} -> {value} (MMRL's value for "
                    f"{cfg.DATASET.NAME}; TRAINER.MMRL.DATASET_VALUES False keeps the file's)"
                )
            node[key] = type(node[key])(value)
        return lines

    def check_cfg(self, cfg):
        check_vit_backbone("MMRL", cfg)
        node = self.trainer_cfg(cfg)
        if not 0.0 <= node.ALPHA <= 1.0:
            raise ConfigError(f"{self.cfg_key('ALPHA')} must be in [0, 1], got {node.ALPHA}")
        if node.REG_WEIGHT < 0:
            raise ConfigError(f"{self.cfg_key('REG_WEIGHT')} must be >= 0, got {node.REG_WEIGHT}")
        for key in ("N_REP_TOKENS", "REP_DIM"):
            if node[key] < 1:
                raise ConfigError(f"{self.cfg_key(key)} must be >= 1, got {node[key]}")
        layers = list(node.REP_LAYERS)
        if not layers or layers[0] < 1 or any(b <= a for a, b in zip(layers, layers[1:])):
            raise ConfigError(
                f"{self.cfg_key('REP_LAYERS')} must list 1-based block numbers in increasing "
                f"order (e.g. [6, 7, 8, 9, 10, 11, 12]), got {layers}"
            )
        if node.TASK not in TASKS:
            raise ConfigError(
                f"{self.cfg_key('TASK')} (MMRL's TASK) must be one of {TASKS}, got {node.TASK!r}"
            )
        m = cfg.MODEL
        if m.TEXT_CHUNK or m.CHECKPOINT_TEXT or m.SHARED_PREFIX:
            raise ConfigError(
                "MMRL's text pass inserts representation tokens and widens the causal mask in "
                "its own loop, which MODEL.TEXT_CHUNK, MODEL.CHECKPOINT_TEXT and "
                "MODEL.SHARED_PREFIX do not reach: set them to 0 / False for MMRL"
            )

    def build_model(self):
        clip_model = load_clip(self.cfg, precision=self.prec, device=self.device)
        model = MMRLCLIP.from_config(self.cfg, self.classnames, clip_model)
        self.model = model.to(self.device)
        setup_learnable(self, self.model.learnable, self.model_name)

    # -- the step ---------------------------------------------------------------------------
    def prepare_step(self, batch_inputs):
        image, label = batch_inputs
        return image, label, self.model.zero_shot_image(image)

    def compute_loss(self, inputs):
        image, label, zs_image = inputs
        node = self.trainer_cfg()
        model = self.model
        f, f_r, g = model.encode(image, model.learner())
        logits, logits_rep = model.logits(f, g), model.logits(f_r, g)
        ce = self.classification_loss(logits, label)
        loss, terms = mmrl_loss(
            logits, logits_rep, label, f, zs_image, g, model.zs_text_features,
            node.ALPHA, node.REG_WEIGHT, ce=ce,
        )  # fmt: skip
        fused = node.ALPHA * logits + (1 - node.ALPHA) * logits_rep
        summary = {"acc": compute_accuracy(fused, label)[0]}
        summary.update({k: v.detach() for k, v in terms.items()})
        return loss, summary

    def load_model(self, directory, epoch=None):
        """As the engine's, except that without ``epoch`` and without ``model-best.pth.tar``
        the newest numbered checkpoint is loaded, as MMRL's own ``load_model`` does (its test
        scripts pass ``--model-dir`` without ``--load-epoch``)."""
        folder = osp.join(directory or "", self.model_name)
        if epoch is None and directory and not osp.exists(osp.join(folder, "model-best.pth.tar")):
            prefix = "model.pth.tar-"
            names = os.listdir(folder) if osp.isdir(folder) else []
            epochs = [int(n[len(prefix) :]) for n in names
                      if n.startswith(prefix) and n[len(prefix) :].isdigit()]  # fmt: skip
            if epochs:
                epoch = max(epochs)
                logger.info("No model-best.pth.tar in %s: loading epoch %d, as MMRL does", folder,
                            epoch)  # fmt: skip
        super().load_model(directory, epoch)

    # -- evaluation: decoupled inference ----------------------------------------------------
    def uses_fused_logits(self) -> bool:
        """Whether evaluations report the fused logits (MMRL's test(); module docstring)."""
        task = self.trainer_cfg().TASK
        if task == "FS":
            return True
        if task == "CD":
            return self.cfg.DATASET.NAME == "ImageNet"
        return self.cfg.DATASET.SUBSAMPLE_CLASSES == "base"

    def inference_logits(self, image, tokens, text) -> torch.Tensor:
        f, f_r, _ = self.model.encode(image, tokens, text)
        logits = self.model.logits(f, text)
        if not self.uses_fused_logits():
            return logits
        alpha = self.trainer_cfg().ALPHA
        return alpha * logits + (1 - alpha) * self.model.logits(f_r, text)

    def before_test(self):
        self._tokens = self.model.learner()
        self._text_features = l2_normalize(self.model.text_features(self._tokens.text))

    def after_test(self):
        self._tokens = self._text_features = None

    def model_inference(self, image):
        return self.inference_logits(image, self._tokens, self._text_features)

    def model_outputs(self, image):
        tokens = self.model.learner()
        f, f_r, g = self.model.encode(image, tokens)
        return ModelOutput(f, g, self.inference_logits(image, tokens, g))
