"""OpenAI's ``clip.clip`` functions over this project's CLIP loading.

``_MODELS[name]`` and ``_download(url)`` are what CoOp-family trainer files use to find the
weights (``load_clip_to_cpu``): here ``_download`` resolves them with the project's weight
resolution (:func:`engine.clip.ensure_weights`: ``MODEL.BACKBONE.PATH``, ``~/.cache/clip``
downloaded and checked on first use, open_clip's cache) for the config of the trainer being
built, so ``MODEL.BACKBONE.PATH`` / ``MODEL.BACKBONE.CONFIG`` work as for the project's trainers.
``build_model`` and ``load`` return :class:`clip.model.CLIP`, OpenAI's model interface over an
open_clip model.
"""

from __future__ import annotations

import os.path as osp

import torch
from PIL import Image
from torchvision.transforms import (
    CenterCrop,
    Compose,
    InterpolationMode,
    Normalize,
    Resize,
    ToTensor,
)

from engine.clip import (
    OPENAI_MODELS,
    BackboneError,
    active_backbone_cfg,
    ensure_weights,
    read_state_dict,
)

from .model import build_model
from .simple_tokenizer import SimpleTokenizer as _Tokenizer

__all__ = ["available_models", "build_model", "load", "tokenize"]

_SCHEME = "local-clip:"  # what _MODELS maps a name to; _download resolves it to a local file
_tokenizer = _Tokenizer()


class _ModelNames(dict):
    """OpenAI's ``_MODELS`` (name -> download address) for the names the project resolves:
    CoOp's names, and the ``MODEL.BACKBONE.NAME`` of the trainer being built (whatever it is,
    e.g. "" with ``MODEL.BACKBONE.PATH`` / ``CONFIG`` for a custom CLIP)."""

    def __missing__(self, name):
        cfg = active_backbone_cfg()
        if cfg is not None and name == cfg.MODEL.BACKBONE.NAME:
            return _SCHEME + name
        raise KeyError(
            f"Unknown CLIP name {name!r} for clip._MODELS: OpenAI's names are "
            f"{', '.join(self)}; for other weights set MODEL.BACKBONE.PATH (and "
            "MODEL.BACKBONE.CONFIG for a custom architecture)"
        )

    def __contains__(self, name) -> bool:
        cfg = active_backbone_cfg()
        return super().__contains__(name) or (cfg is not None and name == cfg.MODEL.BACKBONE.NAME)


_MODELS = _ModelNames({name: _SCHEME + name for name in OPENAI_MODELS})


def available_models() -> list[str]:
    """The names ``load`` knows (OpenAI's)."""
    return list(OPENAI_MODELS)


def _name_of(url: str) -> str:
    if url.startswith(_SCHEME):
        return url[len(_SCHEME) :]
    fname = osp.basename(url)  # an OpenAI address: its file name (ViT-B-16.pt)
    for name, (_, file) in OPENAI_MODELS.items():
        if file == fname:
            return name
    raise BackboneError(f"clip._download: {url!r} names no CLIP this project knows")


def _download(url: str, root: str | None = None) -> str:
    """The local file of the weights behind ``url`` (a ``_MODELS`` value), downloaded on first
    use as OpenAI's package does.

    The file comes from the project's weight resolution (:func:`engine.clip.ensure_weights`:
    ``~/.cache/clip``, checked against its SHA256 and fetched when missing; mirrors and the
    offline switch as in docs/weights.md) for the config of the trainer being built when ``url``
    is that config's ``MODEL.BACKBONE.NAME`` (so ``MODEL.BACKBONE.PATH`` counts), else for the
    name alone; ``root`` (OpenAI's ``download_root``) is looked in first.
    """
    from engine.config import get_base_cfg_default

    name = _name_of(url)
    if root and name in OPENAI_MODELS:
        candidate = osp.join(osp.expanduser(root), OPENAI_MODELS[name][1])
        if osp.isfile(candidate):
            return candidate
    cfg = active_backbone_cfg()
    if cfg is None or cfg.MODEL.BACKBONE.NAME != name:
        cfg = get_base_cfg_default()
        cfg.MODEL.BACKBONE.NAME = name
    path = ensure_weights(cfg)
    if path is None:
        raise BackboneError(
            f"clip._download: no CLIP weights for {name!r}: set MODEL.BACKBONE.NAME, "
            "MODEL.BACKBONE.PATH or MODEL.BACKBONE.URL"
        )
    return path


def _transform(n_px: int) -> Compose:
    """OpenAI's preprocessing: bicubic resize, centre crop, RGB, tensor, CLIP normalisation."""
    return Compose(
        [
            Resize(n_px, interpolation=InterpolationMode.BICUBIC),
            CenterCrop(n_px),
            lambda image: image.convert("RGB") if isinstance(image, Image.Image) else image,
            ToTensor(),
            Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
        ]
    )


def load(name: str, device=None, jit: bool = False, download_root: str | None = None):
    """``(model, preprocess)`` as OpenAI's ``clip.load``: ``name`` is a ``_MODELS`` name or a
    checkpoint path; ``device`` defaults to the GPU when there is one; on the CPU the model is
    fp32, elsewhere fp16 (OpenAI's precision)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if jit:
        raise ValueError(
            "clip.load(jit=True) is not available here: the model is an open_clip model behind "
            "OpenAI's interface; call clip.load(name, jit=False)"
        )
    if name in _MODELS:
        path = _download(_MODELS[name], download_root)
    elif osp.isfile(name):
        path = name
    else:
        raise RuntimeError(f"Model {name} not found; available models = {available_models()}")
    state_dict, _ = read_state_dict(path)
    model = build_model(state_dict).to(device)
    if str(device) == "cpu":
        model.float()
    return model, _transform(model.visual.input_resolution)


def tokenize(texts: str | list[str], context_length: int = 77, truncate: bool = False):
    """Token ids ``[n, context_length]`` (int64) of ``texts`` with start and end tokens.

    A text longer than the context raises RuntimeError, or with ``truncate`` is cut (its last
    token then being the end token), as OpenAI's ``clip.tokenize``.
    """
    texts = [texts] if isinstance(texts, str) else list(texts)
    sot = _tokenizer.encoder["<|startoftext|>"]
    eot = _tokenizer.encoder["<|endoftext|>"]
    result = torch.zeros(len(texts), context_length, dtype=torch.long)
    for i, text in enumerate(texts):
        tokens = [sot, *_tokenizer.encode(text), eot]
        if len(tokens) > context_length:
            if not truncate:
                raise RuntimeError(f"Input {text} is too long for context length {context_length}")
            tokens = tokens[:context_length]
            tokens[-1] = eot
        result[i, : len(tokens)] = torch.tensor(tokens)
    return result
