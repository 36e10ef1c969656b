"""Helpers shared by the trainers."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.clip import clip_dtype, tokenize, truncate_tokens
from engine.trainer import ModelOutput, TrainerX
from engine.utils import compute_accuracy
from optim import build_lr_scheduler, build_optimizer

logger = logging.getLogger(__name__)


def load_init_weights(module: nn.Module, path: str) -> None:
    """Load ``MODEL.INIT_WEIGHTS`` into ``module``: tensors whose names and shapes match
    (Dassl's ``load_pretrained_weights``); the rest is reported."""
    if not path:
        return
    from engine.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(path)
    state = checkpoint.get("state_dict", checkpoint)
    state = {(k[7:] if k.startswith("module.") else k): v for k, v in state.items()}
    own = module.state_dict()
    matched = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    if not matched:
        raise ValueError(f"MODEL.INIT_WEIGHTS {path}: no tensor matches the model by name/shape")
    module.load_state_dict(matched, strict=False)
    skipped = sorted(set(own) - set(matched))
    logger.info("Initialised %d tensors from %s; not in the file: %s", len(matched), path, skipped)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def register_class_prompts(
    module: nn.Module,
    token_embedding: nn.Embedding,
    prompts: list[str],
    n_ctx: int,
    full_length: bool = False,
) -> torch.Tensor:
    """Register the frozen token embeddings of ``prompts`` around ``n_ctx`` context tokens.

    Each prompt must start with ``n_ctx`` placeholder words ("X X X X ...") that the learnable
    context replaces. The prompts are cut to the longest EOT (exact, see engine.clip.text), or
    keep all 77 tokens with ``full_length`` (``keeps_full_length(clip_model)``: the model's
    ``MODEL.TEXT_FULL_LENGTH``).
    Registers the NON-persistent buffers ``token_prefix`` ``[n_cls, 1, width]`` (SOS),
    ``token_suffix`` ``[n_cls, L - 1 - n_ctx, width]`` and ``eot_idx`` ``[n_cls]``, so
    checkpoints never hold them and a model built for other classes rebuilds them.

    Returns:
        The truncated token ids ``[n_cls, L]``.
    """
    tokens, eot = truncate_tokens(tokenize(prompts), full_length)  # [n_cls, L], L: longest EOT
    device = token_embedding.weight.device
    with torch.no_grad():
        emb = token_embedding(tokens.to(device))  # [n_cls, L, width]
    module.register_buffer("token_prefix", emb[:, :1, :], persistent=False)
    module.register_buffer("token_suffix", emb[:, 1 + n_ctx :, :], persistent=False)
    module.register_buffer("eot_idx", eot.to(device), persistent=False)
    return tokens


def init_context(
    embedding: nn.Embedding, ctx_init: str, n_ctx: int, key: str = "N_CTX"
) -> tuple[torch.Tensor, str]:
    """The initial fp32 context ``[n_ctx, width]`` and the prompt prefix of a deep prompt learner.

    With ``ctx_init`` words: the embeddings of its first ``n_ctx`` tokens and the words as
    prefix; without: N(0, 0.02) drawn on the CPU (as MaPLe's code) and ``n_ctx`` "X"
    placeholders. ``key`` names the count in errors (e.g. "N_CTX_TEXT").
    """
    width = embedding.weight.shape[1]
    ctx_init = ctx_init.replace("_", " ").strip()
    if not ctx_init:
        ctx = torch.empty(n_ctx, width)
        nn.init.normal_(ctx, std=0.02)
        return ctx, " ".join(["X"] * n_ctx)
    n_words = len(ctx_init.split())
    if n_ctx > n_words:
        raise ValueError(
            f"{key} {n_ctx} is larger than the {n_words} words of CTX_INIT {ctx_init!r}: give "
            f"at least {key} words, or CTX_INIT '' for a random context"
        )
    with torch.no_grad():
        init = embedding(tokenize(ctx_init).to(embedding.weight.device))  # [1, 77, width]
    return init[0, 1 : 1 + n_ctx, :].float(), ctx_init


def setup_learnable(trainer, module: nn.Module, name: str) -> list[str]:
    """Train only ``module`` (a part of ``trainer.model``): freeze the rest, load
    ``MODEL.INIT_WEIGHTS``, build the optimizer and LR scheduler over it and register it under
    ``name`` (its checkpoint folder; checkpoints hold its state dict only).

    Returns:
        The names of the trainable parameters (logged), relative to ``module``.
    """
    trainer.model.requires_grad_(False)
    module.requires_grad_(True)
    trainable = [n for n, _ in module.named_parameters()]
    logger.info("Parameters to be updated: %s", ", ".join(f"{name}.{n}" for n in trainable))
    load_init_weights(module, trainer.cfg.MODEL.INIT_WEIGHTS)
    trainer.optim = build_optimizer(trainer.cfg, module)
    trainer.sched = build_lr_scheduler(trainer.optim, trainer.cfg.OPTIM)
    trainer.register_model(name, module, trainer.optim, trainer.sched)
    return trainable


def setup_prompt_learner(trainer, name: str = "prompt_learner") -> list[str]:
    """:func:`setup_learnable` for ``trainer.model.<name>`` registered as ``name``."""
    return setup_learnable(trainer, getattr(trainer.model, name), name)


def kg_loss(text_features: torch.Tensor, t_clip: torch.Tensor) -> torch.Tensor:
    """KgCoOp's regulariser ``1 - mean cos(text_features, t_clip)`` (rows are classes)."""
    return 1.0 - F.cosine_similarity(text_features.float(), t_clip.float(), dim=-1).mean()


def clip_logits(logit_scale: torch.Tensor, image: torch.Tensor, text: torch.Tensor):
    """CLIP's ``logit_scale.exp() * image @ text^T``: ``[batch, n_cls]``."""
    return logit_scale.exp() * image @ text.t().to(image.dtype)


class FrozenImageCLIP(nn.Module):
    """Base of a prompt learner's CLIP wrapper: the frozen image encoder and CoOp's logits.

    Subclasses add a ``prompt_learner`` and an ``encode_text``.
    """

    def __init__(self, clip_model):
        super().__init__()
        self.image_encoder = clip_model.visual
        self.logit_scale = clip_model.logit_scale
        self.dtype = clip_dtype(clip_model)

    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        """L2-normalised image features ``[batch, embed_dim]``."""
        return l2_normalize(self.image_encoder(image.to(self.dtype)))

    def logits(self, image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
        """``logit_scale.exp() * image @ text^T``: ``[batch, n_cls]``."""
        return clip_logits(self.logit_scale, image_features, text_features)


class TextOnceEvaluation:
    """Evaluation of a model with ``encode_image`` / ``encode_text`` / ``logits``: the class
    text features once per evaluation (mixed in before TrainerX: PromptTrainer, SkipTuning)."""

    def before_test(self):
        self._text_features = self.model.encode_text()

    def after_test(self):
        self._text_features = None

    def model_outputs(self, image):
        image_features = self.model.encode_image(image)
        text_features = self.model.encode_text()
        return ModelOutput(
            image_features, text_features, self.model.logits(image_features, text_features)
        )

    def model_inference(self, image):
        return self.model.logits(self.model.encode_image(image), self._text_features)


class PromptTrainer(TextOnceEvaluation, TrainerX):
    """Shared by text-prompt trainers with a frozen image encoder (CoOp, TCP, ...):
    image features once per step, text features once per evaluation."""

    def prepare_step(self, batch_inputs):
        image, label = batch_inputs
        return self.model.encode_image(image), label

    def compute_loss(self, inputs):
        image_features, label = inputs
        logits = self.model.logits(image_features, self.model.encode_text())
        loss = self.classification_loss(logits, label)
        return loss, {"acc": compute_accuracy(logits, label)[0]}

    def kg_regularised_loss(self, inputs, t_clip: torch.Tensor, weight: float):
        """KgCoOp's objective (KgCoOp, TCP): CE + ``weight`` * :func:`kg_loss` to ``t_clip``."""
        image_features, label = inputs
        text_features = self.model.encode_text()
        logits = self.model.logits(image_features, text_features)
        ce = self.classification_loss(logits, label)
        kg = kg_loss(text_features, t_clip)
        loss = ce + weight * kg
        summary = {"acc": compute_accuracy(logits, label)[0], "ce": ce.detach(), "kg": kg.detach()}
        return loss, summary

    def frozen_image_encoder(self):
        return self.model.image_encoder

    def model_inference_features(self, features):
        return self.model.logits(l2_normalize(features), self._text_features)
