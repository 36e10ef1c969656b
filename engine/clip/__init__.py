"""CLIP backbone on open_clip_torch: weight loading and download (weights.py), tokenisation,
text encoder, prompted vision encoder."""

from .model import (
    OPENAI_MODELS,
    BackboneError,
    UnusableWeightsError,
    active_backbone,
    active_backbone_cfg,
    build_clip,
    clip_dtype,
    clip_from_state_dict,
    ensure_weights,
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
    keeps_full_length,
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
    "active_backbone",
    "active_backbone_cfg",
    "PromptedVisionEncoder",
    "TextEncoder",
    "UnusableWeightsError",
    "build_clip",
    "clip_from_state_dict",
    "clip_dtype",
    "encode_texts",
    "eot_indices",
    "ensure_weights",
    "find_weights",
    "is_torchscript",
    "keeps_full_length",
    "load_clip",
    "read_state_dict",
    "require_vit",
    "save_clip_checkpoint",
    "token_ids",
    "tokenize",
    "truncate_tokens",
]
