"""A compatibility layer with OpenAI's ``clip`` package, backed by open_clip and this project's
CLIP loading, for trainer files written against it (``from clip import clip``,
``from clip.simple_tokenizer import SimpleTokenizer``): see docs/porting-trainers.md.

``clip.load``, ``clip.tokenize``, ``clip.build_model``, ``clip.available_models``,
``clip._MODELS`` and ``clip._download`` are in :mod:`clip.clip`; the model interface is
:mod:`clip.model`.
"""

from .clip import _MODELS, _download, available_models, build_model, load, tokenize

__all__ = ["_MODELS", "_download", "available_models", "build_model", "load", "tokenize"]
