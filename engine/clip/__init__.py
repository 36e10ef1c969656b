"""CLIP backbone on open_clip_torch: local weight loading, tokenisation, text encoder,
prompted vision encoder."""

from .model import (
    OPENAI_MODELS,
    BackboneError,
    active_backbone,
    active_backbone_cfg,
    build_clip,
    clip_dtype,
    clip_from_state_dict,
    find_weights,
    is_torchscript,
    load_clip,
    read_state_dict,
    save_clip_checkpoint,
)
from .text import (
    TextEncoder,
    encode_texts,
    eot_indices,
    token_ids,
    tokenize,
    truncate_tokens,
)
from .vision import PromptedVisionEncoder, require_vit

__all__ = [
    "OPENAI_MODELS",
    "BackboneError",
    "active_backbone",
    "active_backbone_cfg",
    "PromptedVisionEncoder",
    "TextEncoder",
    "build_clip",
    "clip_from_state_dict",
    "clip_dtype",
    "encode_texts",
    "eot_indices",
    "find_weights",
    "is_torchscript",
    "load_clip",
    "read_state_dict",
    "require_vit",
    "save_clip_checkpoint",
    "token_ids",
    "tokenize",
    "truncate_tokens",
]
