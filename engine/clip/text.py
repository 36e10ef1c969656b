"""Tokenisation and a CLIP text encoder that takes prompt embeddings.

The text transformer is causal and its output is read at the EOT token, so tokens after the
last EOT of a batch never influence any output: prompts are cut to ``max(eot_idx) + 1`` tokens,
rounded up to a multiple of 16 (:data:`SEQ_MULTIPLE`). Mathematically any cut after the last EOT
is exact; the rounding also makes it exact in floating point: attention kernels reduce over keys
in blocks of 8/16 lanes, and a ragged length changes their summation order (differences of
~1e-6 in fp32), while a multiple of 16 gives bit-identical features to the full 77-token
sequence on CPU (tests/test_clip.py), at a fraction of the cost.

:func:`full_length_prompts` switches the cut off inside a ``with`` block: models built there keep
the reference code bases' 77-token prompts (tools/benchmark.py measures the difference, and
tests/test_performance.py checks that every trainer's outputs are identical either way).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import open_clip
import torch
import torch.utils.checkpoint
from torch import nn

_TOKENIZER = None


def _tokenizer() -> open_clip.SimpleTokenizer:
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = open_clip.SimpleTokenizer()
    return _TOKENIZER


def token_ids(text: str) -> list[int]:
    """CLIP BPE ids of ``text`` without start/end tokens (e.g. a class name's length)."""
    return _tokenizer().encode(text)


def tokenize(texts: str | list[str], context_length: int = 77) -> torch.LongTensor:
    """CLIP BPE token ids ``[n, context_length]``; raises instead of silently truncating."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    tok = _tokenizer()
    for text in texts:
        n = len(tok.encode(text)) + 2  # + start and end tokens
        if n > context_length:
            raise ValueError(
                f"Prompt has {n} tokens, more than CLIP's context length {context_length}: "
                f"{text[:120]!r}"
            )
    return open_clip.tokenize(texts, context_length=context_length)


def eot_indices(tokens: torch.Tensor) -> torch.Tensor:
    """Position of the end-of-text token (the largest id) in each row."""
    return tokens.argmax(dim=-1)


SEQ_MULTIPLE = 16
_FULL_LENGTH = False  # set inside full_length_prompts()


@contextmanager
def full_length_prompts() -> Iterator[None]:
    """Inside this block :func:`truncate_tokens` keeps every ``context_length`` token.

    Prompt learners and frozen text features built inside it use the full 77-token sequences of
    the reference code bases: the same features, at the reference cost. For benchmarks and
    equivalence tests; training never needs it.
    """
    global _FULL_LENGTH
    previous, _FULL_LENGTH = _FULL_LENGTH, True
    try:
        yield
    finally:
        _FULL_LENGTH = previous


def truncated_length(eot_idx: torch.Tensor, context_length: int = 77) -> int:
    """``max(eot_idx) + 1`` rounded up to a multiple of SEQ_MULTIPLE (at most the context);
    the whole context inside :func:`full_length_prompts`."""
    if _FULL_LENGTH:
        return context_length
    n = int(eot_idx.max()) + 1
    return min(context_length, -(-n // SEQ_MULTIPLE) * SEQ_MULTIPLE)


def truncate_tokens(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens[:, :truncated_length], eot_idx)``."""
    eot = eot_indices(tokens)
    return tokens[:, : truncated_length(eot, tokens.shape[1])], eot


LayerHook = Callable[..., torch.Tensor]  # hook(i, x, *row_args) -> x


class TextEncoder(nn.Module):
    """CLIP's text tower applied to prompt embeddings (CoOp's ``TextEncoder``).

    Args:
        clip_model: an open_clip ``CLIP``; its modules are shared, not copied.

    ``forward(prompts, eot_idx, layer_hook=None, row_args=())``:
        prompts: ``[n, L, width]`` token embeddings with ``L <= context_length`` (any L up to
            the longest EOT + 1 gives the full-length result).
        eot_idx: ``[n]`` EOT positions.
        layer_hook: optional ``hook(i, x, *row_args) -> x`` applied before block ``i`` (deep
            prompts); ``x`` holds the rows of the current chunk.
        row_args: tensors with one row per prompt (``[n, ...]``) that the hook needs, e.g.
            TCP's class-aware tokens; each chunk's hook call gets the chunk's rows.
    Returns ``[n, embed_dim]`` features (not normalised).

    Memory options (:meth:`set_memory_options`, from ``MODEL.TEXT_CHUNK`` and
    ``MODEL.CHECKPOINT_TEXT``): the ``n`` prompts run through the tower in chunks of ``chunk``
    rows, and with ``checkpoint`` each chunk is an activation checkpoint
    (``torch.utils.checkpoint``, non-reentrant) while gradients are recorded: its block
    activations are freed after the forward and recomputed, one chunk at a time, in the
    backward. Chunks alone lower the peak of no-grad encoding only (a recorded graph keeps every
    chunk's activations until the backward); chunks with checkpointing lower the training peak
    to about one chunk's activations. Checkpointing alone is bit-identical to the plain pass;
    chunks agree with it up to fp32 rounding (fewer rows per matrix product change the kernels'
    blocking), as tests/test_text_memory.py checks.
    """

    def __init__(self, clip_model):
        super().__init__()
        self.transformer = clip_model.transformer
        self.positional_embedding = clip_model.positional_embedding
        self.ln_final = clip_model.ln_final
        self.text_projection = clip_model.text_projection
        self.token_embedding = clip_model.token_embedding
        mask = clip_model.attn_mask
        if not getattr(self.transformer, "batch_first", True):
            raise ValueError("Only batch-first open_clip text transformers are supported")
        if mask is None:
            raise ValueError("The text tower has no causal mask; prompt truncation needs one")
        self.register_buffer("attn_mask", mask, persistent=False)  # [ctx, ctx] additive
        self.chunk = 0  # prompts per pass through the tower (0: all at once)
        self.checkpoint = False  # activation checkpointing of each chunk (training only)

    def set_memory_options(self, chunk: int = 0, checkpoint: bool = False) -> None:
        """Encode ``chunk`` prompts at a time (0: all) and, with ``checkpoint``, recompute each
        chunk's activations in the backward instead of keeping them (see the class doc)."""
        if chunk < 0:
            raise ValueError(f"MODEL.TEXT_CHUNK must be >= 0 (0: all prompts at once), got {chunk}")
        self.chunk, self.checkpoint = int(chunk), bool(checkpoint)

    @property
    def saves_memory(self) -> bool:
        """Whether a memory option is on (the forward is then a Python loop of checkpointed
        chunks, which engine/compile.py leaves eager)."""
        return self.chunk > 0 or self.checkpoint

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.get_cast_dtype()

    @property
    def num_layers(self) -> int:
        return len(self.transformer.resblocks)

    def forward(
        self,
        prompts: torch.Tensor,
        eot_idx: torch.Tensor,
        layer_hook: LayerHook | None = None,
        row_args: tuple[torch.Tensor, ...] = (),
    ) -> torch.Tensor:
        n = prompts.shape[0]
        step = self.chunk if 0 < self.chunk < n else n
        checkpoint = self.checkpoint and torch.is_grad_enabled()
        if step == n and not checkpoint:  # the plain path
            return self.encode_rows(layer_hook, prompts, eot_idx, *row_args)
        feats = []
        for start in range(0, n, step):
            rows = slice(start, start + step)
            args = (prompts[rows], eot_idx[rows], *(t[rows] for t in row_args))
            if checkpoint:
                f = torch.utils.checkpoint.checkpoint(
                    self.encode_rows, layer_hook, *args, use_reentrant=False
                )
            else:
                f = self.encode_rows(layer_hook, *args)
            feats.append(f)  # [rows, embed_dim]
        return torch.cat(feats)

    def encode_rows(
        self,
        layer_hook: LayerHook | None,
        prompts: torch.Tensor,
        eot_idx: torch.Tensor,
        *row_args: torch.Tensor,
    ) -> torch.Tensor:
        """The tower on one chunk of prompts: ``[rows, L, width]`` -> ``[rows, embed_dim]``."""
        seq_len = prompts.shape[1]
        x = prompts.to(self.dtype) + self.positional_embedding[:seq_len].to(self.dtype)
        mask = self.attn_mask[:seq_len, :seq_len]
        for i, block in enumerate(self.transformer.resblocks):
            if layer_hook is not None:
                x = layer_hook(i, x, *row_args)
            x = block(x, attn_mask=mask)  # [rows, L, width]
        x = self.ln_final(x)
        x = x[torch.arange(x.shape[0], device=x.device), eot_idx]  # [rows, width]
        proj = self.text_projection
        return proj(x) if isinstance(proj, nn.Linear) else x @ proj

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[n, L, width]`` (in the embedding's dtype)."""
        return self.token_embedding(tokens)

    @torch.no_grad()
    def encode_tokens(self, tokens: torch.Tensor, truncate: bool = True) -> torch.Tensor:
        """Features of tokenised text (frozen CLIP), truncated to the longest EOT by default."""
        tokens = tokens.to(self.positional_embedding.device)
        if truncate:
            tokens, eot = truncate_tokens(tokens)
        else:
            eot = eot_indices(tokens)
        return self(self.embed_tokens(tokens), eot)


def set_text_memory(model: nn.Module, chunk: int, checkpoint: bool) -> list[str]:
    """:meth:`TextEncoder.set_memory_options` on every text encoder of ``model``; returns their
    names when an option is on (else an empty list)."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, TextEncoder):
            module.set_memory_options(chunk, checkpoint)
            if module.saves_memory:
                names.append(name or type(module).__name__)
    return names


def encode_texts(
    encoder: TextEncoder, texts: list[str], batch_size: int = 1000, normalize: bool = True
) -> torch.Tensor:
    """Frozen features of hand-written texts, in batches, L2-normalised by default."""
    feats = []
    for i in range(0, len(texts), batch_size):
        tokens = tokenize(texts[i : i + batch_size])
        f = encoder.encode_tokens(tokens).float()
        feats.append(f / f.norm(dim=-1, keepdim=True) if normalize else f)
    return torch.cat(feats)
