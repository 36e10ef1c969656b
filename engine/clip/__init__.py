"""CLIP backbone on open_clip_torch: weight loading and download (weights.py), tokenisation,
text encoder, prompted vision encoder."""

from .model import (
    OPENAI_MODELS,
    BackboneError,
    UnusableWeightsError,
    build_clip,
    clip_dtype,
    ensure_weights,
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
from .weights import DownloadError

__all__ = [
    "OPENAI_MODELS",
    "BackboneError",
    "DownloadError",
    "PromptedVisionEncoder",
    "TextEncoder",
    "UnusableWeightsError",
    "build_clip",
    "clip_dtype",
    "encode_texts",
    "eot_indices",
    "ensure_weights",
    "find_weights",
    "load_clip",
    "require_vit",
    "save_clip_checkpoint",
    "token_ids",
    "tokenize",
    "truncate_tokens",
]
