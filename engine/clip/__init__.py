"""CLIP backbone on open_clip_torch: local weight loading, tokenisation, text encoder,
prompted vision encoder."""

from .model import (
    OPENAI_MODELS,
    BackboneError,
    build_clip,
    clip_dtype,
    find_weights,
    load_clip,
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
    "PromptedVisionEncoder",
    "TextEncoder",
    "build_clip",
    "clip_dtype",
    "encode_texts",
    "eot_indices",
    "find_weights",
    "load_clip",
    "require_vit",
    "save_clip_checkpoint",
    "token_ids",
    "tokenize",
    "truncate_tokens",
]
