"""OpenAI's ``clip.simple_tokenizer``: the CLIP byte-pair tokenizer (open_clip's, the same
vocabulary and cleaning)."""

from __future__ import annotations

import open_clip
from open_clip.tokenizer import default_bpe

__all__ = ["SimpleTokenizer", "default_bpe"]


class SimpleTokenizer(open_clip.SimpleTokenizer):
    """``SimpleTokenizer(bpe_path=default_bpe())`` with ``encode(text) -> list[int]``,
    ``decode(ids) -> str``, ``encoder`` and ``decoder``, as OpenAI's (whose special tokens are
    spelt ``<|startoftext|>`` / ``<|endoftext|>``; open_clip's ``<start_of_text>`` too)."""

    def __init__(self, bpe_path: str = default_bpe()):
        super().__init__(bpe_path)
        for name, token_id in (
            ("<|startoftext|>", self.sot_token_id),
            ("<|endoftext|>", self.eot_token_id),
        ):
            self.encoder[name] = token_id
            self.decoder[token_id] = name
