"""CLIP's ViT image tower with a prompt-insertion seam (MaPLe / CoPrompt vision prompts).

open_clip's ``VisionTransformer.forward`` is ``_embeds -> transformer -> _pool -> proj``. Prompt
tokens have to enter between the positional embedding and ``ln_pre``, which ``_embeds`` does in
one call, so only that embedding step is re-implemented here (:meth:`PromptedVisionEncoder.embed`).
The blocks are open_clip's own (``visual.transformer.resblocks``), run one by one so that a
``layer_hook(i, x)`` can replace tokens before block ``i`` (the same contract as
:class:`engine.clip.TextEncoder`); pooling and projection are open_clip's ``_pool`` and ``proj``.

Token layout of the sequence ``x`` (batch-first, ``[batch, 1 + n_patches + n_prompts, width]``)::

    [CLS][patch 1 .. patch n_patches][prompt 1 .. prompt n_prompts]

- prompts are appended after the positional embedding (they get none) and go through ``ln_pre``
  with the other tokens, as in MaPLe;
- patch dropout (open_clip; off for OpenAI's models and in eval mode) runs on the image tokens
  before the prompts are appended, so prompts are never dropped or reordered and always occupy
  the last ``n_prompts`` positions;
- the prompt tokens are removed before ``_pool``: with class-token pooling (every OpenAI ViT)
  this changes nothing, and average/attentional pooling see the image tokens only.

Only ViT image towers have a token sequence; a ResNet backbone raises :class:`BackboneError`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from open_clip.transformer import VisionTransformer
from torch import nn

from .model import BackboneError

LayerHook = Callable[[int, torch.Tensor], torch.Tensor]


def require_vit(clip_model, who: str = "Vision prompts") -> VisionTransformer:
    """``clip_model.visual`` if it is a batch-first open_clip ViT, else a clear error."""
    visual = clip_model.visual
    if not isinstance(visual, VisionTransformer):
        raise BackboneError(
            f"{who} need a ViT image encoder (a token sequence to insert prompts into); this "
            f"backbone's image encoder is {type(visual).__name__}. Use a ViT backbone, e.g. "
            "MODEL.BACKBONE.NAME ViT-B/16."
        )
    if not getattr(visual.transformer, "batch_first", True):
        raise BackboneError("Only batch-first open_clip vision transformers are supported")
    return visual


class PromptedVisionEncoder(nn.Module):
    """CLIP's ViT applied to images with optional prompt tokens and a per-layer hook.

    Args:
        clip_model: an open_clip ``CLIP`` with a ViT image tower; its modules are shared, not
            copied.

    ``forward(images, prompts=None, layer_hook=None)``:
        images: ``[batch, 3, H, W]``.
        prompts: ``[n_prompts, width]`` or ``[batch, n_prompts, width]`` tokens appended after
            the patch tokens (before ``ln_pre``); None for the plain forward.
        layer_hook: optional ``hook(i, x) -> x`` applied before block ``i`` (deep prompts).
    Returns ``[batch, embed_dim]`` features (not normalised); without prompts and hook they equal
    ``clip_model.visual(images)``.
    """

    def __init__(self, clip_model):
        super().__init__()
        self.visual = require_vit(clip_model)

    @property
    def dtype(self) -> torch.dtype:
        return self.visual.conv1.weight.dtype

    @property
    def width(self) -> int:
        return self.visual.conv1.out_channels

    @property
    def num_layers(self) -> int:
        return len(self.visual.transformer.resblocks)

    def embed(self, images: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """open_clip's ``_embeds`` with ``prompts`` appended before ``ln_pre``.

        Returns ``[batch, 1 + n_patches + n_prompts, width]``.
        """
        v = self.visual
        x = v.conv1(images.to(self.dtype))  # [batch, width, grid, grid]
        x = x.reshape(x.shape[0], x.shape[1], -1)  # [batch, width, n_patches]
        x = x.permute(0, 2, 1)  # [batch, n_patches, width]
        cls = v.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)  # [batch, 1, width]
        x = torch.cat([cls, x], dim=1)  # [batch, 1 + n_patches, width]
        x = x + v.positional_embedding.to(x.dtype)
        x = v.patch_dropout(x)
        if prompts is not None:
            prompts = prompts.to(x.dtype).expand(x.shape[0], -1, -1)  # [batch, n_prompts, width]
            x = torch.cat([x, prompts], dim=1)  # [batch, 1 + n_patches + n_prompts, width]
        return v.ln_pre(x)

    def forward(
        self,
        images: torch.Tensor,
        prompts: torch.Tensor | None = None,
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:
        x = self.embed(images, prompts)
        for i, block in enumerate(self.visual.transformer.resblocks):
            if layer_hook is not None:
                x = layer_hook(i, x)
            x = block(x)  # [batch, seq, width]
        n_prompts = 0 if prompts is None else prompts.shape[-2]
        x = x[:, : x.shape[1] - n_prompts]  # [batch, 1 + n_patches, width]
        pooled, _ = self.visual._pool(x)  # [batch, width]
        proj = self.visual.proj
        return pooled if proj is None else pooled @ proj
