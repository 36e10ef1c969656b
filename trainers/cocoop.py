"""CoCoOp: conditional prompt learning (Zhou et al., CVPR 2022).

CoOp's context plus a per-image bias: a meta-net Linear(vis_dim, vis_dim // 16) -> ReLU ->
Linear(vis_dim // 16, ctx_dim) maps the L2-normalised image feature to a vector added to every
context token, so each image gets its own prompts for all classes. Differences from the CoCoOp
code base, all deliberate:

- the text encoder runs as ONE batched call over all (image x class) prompts, cut into chunks
  of ``TRAINER.COCOOP.PROMPTS_PER_CALL`` prompts (or an automatic bound) instead of a Python loop
  over the images; each chunk's prompts are gathered from the frozen class embeddings only when
  needed, so memory grows with the chunk, not with images x classes (at evaluation; training
  keeps the graph of every chunk for backward, as CoCoOp's loop did);
- the context and the meta-net are fp32 master parameters in every precision mode (CoCoOp's fp16
  mode trained half-precision weights);
- prompts are cut to the longest EOT (identical features), the frozen image features are
  computed once per step, and the class-dependent buffers are non-persistent (checkpoints hold
  ``ctx`` and ``meta_net.*``, the same names as CoCoOp's, and load for any set of classes).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from engine.clip import TextEncoder, load_clip
from engine.errors import ConfigError
from engine.registry import TRAINER_REGISTRY
from engine.trainer import ModelOutput, TrainerX
from engine.utils import compute_accuracy

from .common import FrozenImageCLIP, l2_normalize, setup_prompt_learner
from .coop import PromptLearner

# Automatic chunk bound: about this many activation elements (prompts x tokens x width) per
# text-encoder call, e.g. 8,192 prompts of 16 tokens at width 512 (128 MiB per fp16 activation;
# ViT-B/16 in fp16 peaked at about 3 GiB when evaluating 100 images x 1000 classes on a GPU).
AUTO_CHUNK_ELEMENTS = 1 << 26


def add_cocoop_config(cfg) -> None:
    """TRAINER.COCOOP keys (CoCoOp's names and defaults, plus the chunk size)."""
    from yacs.config import CfgNode as CN

    cfg.TRAINER.COCOOP = CN()
    cfg.TRAINER.COCOOP.N_CTX = 16  # number of context vectors (ignored when CTX_INIT is set)
    cfg.TRAINER.COCOOP.CTX_INIT = ""  # initialise the context from these words, e.g. "a photo of a"
    cfg.TRAINER.COCOOP.PREC = "fp16"  # fp32 | fp16 (half CLIP, fp32 prompt learner) | amp | bf16
    # Prompts (image x class pairs) per text-encoder call; 0: automatic, about
    # AUTO_CHUNK_ELEMENTS activation elements per call. Only memory and speed depend on it.
    # (Formerly TEXT_CHUNK, still read and translated: MODEL.TEXT_CHUNK's 0 means "all at once")
    cfg.TRAINER.COCOOP.PROMPTS_PER_CALL = 0


class ConditionalPromptLearner(PromptLearner):
    """CoOp's shared context and frozen class-token buffers plus CoCoOp's meta-net.

    Args:
        classnames: class names ("_" becomes " ").
        clip_model: the frozen CLIP.
        n_ctx: number of context tokens (overridden by the words of ``ctx_init``).
        ctx_init: initial context words ("" = random N(0, 0.02)).
    """

    def __init__(self, classnames: list[str], clip_model, n_ctx: int = 16, ctx_init: str = ""):
        super().__init__(classnames, clip_model, n_ctx=n_ctx, ctx_init=ctx_init)
        vis_dim = clip_model.visual.output_dim
        ctx_dim = self.ctx.shape[-1]
        hidden = vis_dim // 16
        if hidden < 1:
            raise ValueError(f"CoCoOp's meta-net needs an image feature dim >= 16, got {vis_dim}")
        self.meta_net = nn.Sequential(
            OrderedDict(
                [
                    ("linear1", nn.Linear(vis_dim, hidden)),
                    ("relu", nn.ReLU(inplace=True)),
                    ("linear2", nn.Linear(hidden, ctx_dim)),
                ]
            )
        ).to(self.ctx.device)  # fp32 master weights

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        """Image-conditioned contexts ``[batch, n_ctx, width]`` from normalised image features
        ``[batch, vis_dim]``."""
        bias = self.meta_net(image_features.to(self.ctx.dtype))  # [batch, width]
        return self.ctx.unsqueeze(0) + bias.unsqueeze(1)  # [batch, n_ctx, width]

    def prompts(self, contexts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Prompt embeddings ``[len(rows), L, width]`` of the flat (image, class) indices
        ``rows`` (row r = image r // n_cls, class r % n_cls) for the contexts of
        :meth:`forward`."""
        image, cls = rows // self.n_cls, rows % self.n_cls
        prefix = self.token_prefix[cls]  # [rows, 1, width]
        suffix = self.token_suffix[cls]  # [rows, L - 1 - n_ctx, width]
        return torch.cat([prefix, contexts[image].to(prefix.dtype), suffix], dim=1)


class CoCoOpCLIP(FrozenImageCLIP):
    """Frozen CLIP with CoCoOp's prompt learner.

    The trainer uses the parts: :meth:`encode_image` (frozen), :meth:`encode_text` (per-image
    class features) and :meth:`logits`; ``forward(image)`` chains them.

    Args:
        classnames: class names.
        clip_model: the frozen CLIP.
        n_ctx, ctx_init: as in :class:`ConditionalPromptLearner`.
        text_chunk: prompts per text-encoder call (0: automatic).
    """

    @classmethod
    def from_config(cls, cfg, classnames, clip_model):
        """The model of ``cfg`` (TRAINER.COCOOP) for ``classnames``."""
        c = cfg.TRAINER.COCOOP
        chunk = c.PROMPTS_PER_CALL
        return cls(classnames, clip_model, n_ctx=c.N_CTX, ctx_init=c.CTX_INIT, text_chunk=chunk)

    def __init__(self, classnames, clip_model, n_ctx=16, ctx_init="", text_chunk=0):
        super().__init__(clip_model)
        if text_chunk < 0:
            raise ValueError(
                f"TRAINER.COCOOP.PROMPTS_PER_CALL must be >= 0 (0: auto), got {text_chunk}"
            )
        self.prompt_learner = ConditionalPromptLearner(classnames, clip_model, n_ctx, ctx_init)
        self.text_encoder = TextEncoder(clip_model)
        self.text_chunk = text_chunk

    def chunk_size(self) -> int:
        """Prompts per text-encoder call: PROMPTS_PER_CALL, or the automatic bound (about
        AUTO_CHUNK_ELEMENTS activation elements, rounded down to whole images when one fits)."""
        if self.text_chunk > 0:
            return self.text_chunk
        pl = self.prompt_learner
        _, suffix_len, width = pl.token_suffix.shape
        seq_len = 1 + pl.n_ctx + suffix_len
        rows = max(1, AUTO_CHUNK_ELEMENTS // (seq_len * width))
        return rows - rows % pl.n_cls if rows >= pl.n_cls else rows

    def encode_text(self, image_features: torch.Tensor) -> torch.Tensor:
        """Normalised text features ``[batch, n_cls, dim]`` of every (image, class) prompt."""
        return l2_normalize(self.raw_text(image_features))

    def raw_text(self, image_features: torch.Tensor) -> torch.Tensor:
        """Text features ``[batch, n_cls, dim]`` of every (image, class) prompt, not normalised
        (DePT's head reads them so).

        One batched text-encoder pass over the ``batch * n_cls`` prompts, in chunks of
        :meth:`chunk_size` prompts built on the fly.
        """
        pl = self.prompt_learner
        contexts = pl(image_features)  # [batch, n_ctx, width]
        total = contexts.shape[0] * pl.n_cls
        step = self.chunk_size()
        feats = []
        for start in range(0, total, step):
            rows = torch.arange(start, min(start + step, total), device=contexts.device)
            eot = pl.eot_idx[rows % pl.n_cls]
            feats.append(self.text_encoder(pl.prompts(contexts, rows), eot))  # [rows, dim]
        return torch.cat(feats).view(contexts.shape[0], pl.n_cls, -1)  # [batch, n_cls, dim]

    def logits(self, image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
        """``[batch, n_cls]`` logits of each image against its own class features."""
        # the scale multiplies the image features first, as in CoOp/CoCoOp: scaling the product
        # instead overflows the (loss-scaled) half-precision gradient under amp
        image = (self.logit_scale.exp() * image_features).unsqueeze(-1)  # [batch, dim, 1]
        return (text_features.to(image.dtype) @ image).squeeze(-1)  # [batch, n_cls]

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        image_features = self.encode_image(image)
        return self.logits(image_features, self.encode_text(image_features))


@TRAINER_REGISTRY.register()
class CoCoOp(TrainerX):
    """Conditional Context Optimization (CoCoOp)."""

    # the grid's default configs (configs/trainers/CoCoOp/<cfg>.yaml; experiments/protocols.py)
    PROTOCOL_CFGS = {
        "base2new": "vit_b16_c4_ep10_batch1_ctxv1",
    }

    add_config = staticmethod(add_cocoop_config)

    @classmethod
    def translate_key(cls, key, value, source):
        """KgCoOp's CoCoOp configs' ``CTX_INIT: True/False``: False is "" (random context); True
        is refused (its meaning there has no equivalent here). The former name of
        ``PROMPTS_PER_CALL``, ``TEXT_CHUNK`` (its 0 is "automatic", MODEL.TEXT_CHUNK's "all at
        once"), is read as the new key (the run's log names the translation)."""
        if key == "TRAINER.COCOOP.TEXT_CHUNK":
            return [("TRAINER.COCOOP.PROMPTS_PER_CALL", value)]
        flag = str(value).strip().lower()
        if key != "TRAINER.COCOOP.CTX_INIT" or flag not in ("true", "false"):
            return [(key, value)]
        if flag == "false":
            return [(key, "")]
        raise ConfigError(
            f"TRAINER.COCOOP.CTX_INIT True in {source} comes from KgCoOp's code base "
            "(htyao89/KgCoOp, configs/trainers/CoCoOp/), whose CoCoOp then builds N_CTX context "
            "vectors of which the last ones are the embeddings of the dataset's template words "
            "and the others random; this project's CoCoOp initialises the context from the "
            'words it is given: set TRAINER.COCOOP.CTX_INIT "a photo of a" (with N_CTX 4 the '
            'same prompt as KgCoOp\'s for the "a photo of a {}." datasets) or "" (random)'
        )

    def build_model(self):
        cfg = self.cfg
        clip_model = load_clip(cfg, precision=self.prec, device=self.device)
        self.model = CoCoOpCLIP.from_config(cfg, self.classnames, clip_model).to(self.device)
        setup_prompt_learner(self)

    def prepare_step(self, batch_inputs):
        image, label = batch_inputs
        return self.model.encode_image(image), label

    def compute_loss(self, inputs):
        image_features, label = inputs
        logits = self.model.logits(image_features, self.model.encode_text(image_features))
        loss = self.classification_loss(logits, label)
        return loss, {"acc": compute_accuracy(logits, label)[0]}

    def model_outputs(self, image):
        image_features = self.model.encode_image(image)
        text_features = self.model.encode_text(image_features)  # [batch, n_cls, dim]
        return ModelOutput(
            image_features, text_features, self.model.logits(image_features, text_features)
        )

    def frozen_image_encoder(self):
        return self.model.image_encoder

    def model_inference_features(self, features):
        f = l2_normalize(features)
        return self.model.logits(f, self.model.encode_text(f))
