"""Tokenisation and a CLIP text encoder that takes prompt embeddings.

The text transformer is causal and its output is read at the EOT token, so tokens after the
last EOT of a batch never influence any output: prompts are cut to ``max(eot_idx) + 1`` tokens,
rounded up to a multiple of 16 (:data:`SEQ_MULTIPLE`). Mathematically any cut after the last EOT
is exact; the rounding also makes it exact in floating point: attention kernels reduce over keys
in blocks of 8/16 lanes, and a ragged length changes their summation order (differences of
~1e-6 in fp32), while a multiple of 16 gives bit-identical features to the full 77-token
sequence on CPU (tests/test_clip.py), at a fraction of the cost.

``MODEL.TEXT_FULL_LENGTH True`` switches the cut off for one model, read where the model is
built: a CLIP loaded by :func:`engine.clip.load_clip` carries the key (:func:`keeps_full_length`)
and the prompt learners and text encoders built from it keep the reference code bases' 77-token
prompts (tools/benchmark.py measures the difference, and tests/test_performance.py checks that
every trainer's outputs are identical either way). No state outside the model is involved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

import open_clip
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from open_clip.transformer import ResidualAttentionBlock
from torch import nn

from engine.errors import ConfigError

from .model import FULL_LENGTH_ATTR


@cache
def _tokenizer() -> open_clip.SimpleTokenizer:
    return open_clip.SimpleTokenizer()


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


def keeps_full_length(clip_model) -> bool:
    """Whether prompts built for ``clip_model`` keep all ``context_length`` tokens: its config's
    ``MODEL.TEXT_FULL_LENGTH``, which :func:`engine.clip.load_clip` records on the model it
    builds (False for a model built otherwise). Prompt learners pass it to
    :func:`truncate_tokens` / ``register_class_prompts``; a :class:`TextEncoder` built from the
    model takes it into its :class:`TextOptions`."""
    return bool(getattr(clip_model, FULL_LENGTH_ATTR, False))


SHARED_PREFIX_MIN = 2  # shortest common prefix worth encoding once (SOS + one more token)


@dataclass(frozen=True)
class TextOptions:
    """How a :class:`TextEncoder` runs its prompts (see the class doc), from the config keys
    ``MODEL.TEXT_CHUNK`` (``chunk``), ``MODEL.CHECKPOINT_TEXT`` (``checkpoint``),
    ``MODEL.SHARED_PREFIX`` (``shared_prefix``) and ``MODEL.TEXT_FULL_LENGTH``
    (``full_length``) by :func:`text_options`."""

    chunk: int = 0  # prompts per pass through the tower (0: all at once)
    checkpoint: bool = False  # activation checkpointing of each chunk (training only)
    shared_prefix: bool = False  # common prompt prefixes encoded once in every pass
    # tokenised text keeps all 77 tokens (the reference cost; the same features): see the module
    full_length: bool = False

    def __post_init__(self):
        if self.chunk < 0:
            raise ValueError(
                f"MODEL.TEXT_CHUNK must be >= 0 (0: all prompts at once), got {self.chunk}"
            )


def text_options(cfg, model: nn.Module | None = None, device=None) -> TextOptions:
    """The text encoders' options of ``cfg``, read once where the model is built. With
    ``MODEL.TEXT_MEMORY auto`` and the built ``model`` (on ``device``): the variant that
    :mod:`engine.clip.text_memory` picks for its prompts and the free memory."""
    m = cfg.MODEL
    mode = m.get("TEXT_MEMORY", "")
    if mode not in ("", "auto"):
        raise ConfigError(
            f"MODEL.TEXT_MEMORY must be '' (the MODEL.TEXT_CHUNK / CHECKPOINT_TEXT / "
            f"SHARED_PREFIX keys as set) or 'auto', got {mode!r}"
        )
    if mode == "auto":
        if m.CHECKPOINT_TEXT or m.SHARED_PREFIX:
            raise ConfigError(
                "MODEL.TEXT_MEMORY auto chooses MODEL.CHECKPOINT_TEXT and MODEL.SHARED_PREFIX "
                "itself: leave them False (MODEL.TEXT_CHUNK sets its chunk size), or set "
                "MODEL.TEXT_MEMORY ''"
            )
        if model is not None:
            from .text_memory import auto_options

            chosen = auto_options(cfg, model, device or torch.device("cpu"))
            return dataclasses.replace(chosen, full_length=bool(m.TEXT_FULL_LENGTH))
    return TextOptions(
        int(m.TEXT_CHUNK),
        bool(m.CHECKPOINT_TEXT),
        bool(m.SHARED_PREFIX),
        bool(m.TEXT_FULL_LENGTH),
    )


@contextmanager
def shared_prefix_text(model: nn.Module) -> Iterator[None]:
    """Inside this block, a pass of ``model``'s text encoders without gradients encodes the
    prompts' common prefix once (:meth:`TextEncoder.sharing_prefix` on each of them).

    The text tower is causal: the states of the first ``p`` tokens depend on those tokens only,
    so when every prompt starts with the same ``p`` token embeddings (CoOp's ``[SOS][ctx]``, with
    the class name after it) those states are the same for every prompt. Inside this block
    :meth:`TextEncoder.encode_rows` computes them once and runs only each prompt's own tokens per
    prompt (attending to the shared keys and values), and in the last block only the EOT token:
    the same features in exact arithmetic, and within fp32 rounding (smaller matrix products
    block their sums differently; tests/test_text_shared_prefix.py). It applies to passes
    without gradients only (the engine turns it on for an optimizer's look at the outputs, e.g.
    MESA's EMA model and ESAM's data selection: engine/step_protocol.py); training passes and
    evaluation keep the plain path, whose outputs are unchanged. Only ``model``'s encoders are
    affected: other models in the process keep their own state.
    """
    with ExitStack() as stack:
        for module in model.modules():
            if isinstance(module, TextEncoder):
                stack.enter_context(module.sharing_prefix())
        yield


def _neighbour_prefixes(x: torch.Tensor) -> torch.Tensor:
    """``[n - 1]``: how many leading positions row ``r + 1`` of ``x`` shares with row ``r``."""
    same = (x[1:] == x[:-1]).flatten(2).all(dim=2)  # [n - 1, L]
    return same.to(torch.int32).cumprod(1).sum(1)


class PrefixPlan(NamedTuple):
    """Rows of consecutive prompts sharing their first ``length`` tokens: ``group`` ``[n]`` is
    each row's group (non-decreasing), ``first`` ``[groups]`` each group's first row."""

    length: int
    group: torch.Tensor
    first: torch.Tensor


def plan_shared_prefix(x: torch.Tensor, eot_idx: torch.Tensor, plain_len: int) -> PrefixPlan | None:
    """The cheapest way to share prompt prefixes among consecutive rows of ``x`` (``[n, L,
    width]``; one group for CoOp's prompts, one per image for CoCoOp's), or None when sharing
    saves nothing against encoding ``n`` rows of ``plain_len`` tokens. A prefix never reaches a
    row's EOT. Cost counted in token rows: ``groups * length + n * (max EOT + 1 - length)``."""
    n = x.shape[0]
    if n < 2:
        return None
    shared = _neighbour_prefixes(x).clamp(max=int(eot_idx.min()))
    seq = int(eot_idx.max()) + 1
    best, best_cost = None, n * plain_len
    for length in sorted(set(shared.tolist())):
        if length < SHARED_PREFIX_MIN:
            continue
        cost = (1 + int((shared < length).sum())) * length + n * (seq - length)
        if cost < best_cost:
            best, best_cost = length, cost
    if best is None:
        return None
    starts = torch.cat([shared.new_ones(1, dtype=torch.bool), shared < best])  # new groups
    return PrefixPlan(best, starts.cumsum(0) - 1, starts.nonzero().flatten())


def _supports_shared_prefix(block: nn.Module) -> bool:
    """Whether :meth:`TextEncoder._shared_block` computes exactly what ``block`` does: open_clip's
    plain pre-norm block with a batch-first, packed-projection, dropout-free attention."""
    attn = getattr(block, "attn", None)
    return (
        type(block) is ResidualAttentionBlock
        and not hasattr(block, "ln_1_kv")
        and type(attn) is nn.MultiheadAttention
        and attn.batch_first
        and attn._qkv_same_embed_dim
        and attn.in_proj_bias is not None
        and attn.bias_k is None
        and not attn.add_zero_attn
        and (attn.dropout == 0 or not attn.training)
    )


def truncated_length(
    eot_idx: torch.Tensor, context_length: int = 77, full_length: bool = False
) -> int:
    """``max(eot_idx) + 1`` rounded up to a multiple of SEQ_MULTIPLE (at most the context);
    the whole context with ``full_length`` (``MODEL.TEXT_FULL_LENGTH``)."""
    if full_length:
        return context_length
    n = int(eot_idx.max()) + 1
    return min(context_length, -(-n // SEQ_MULTIPLE) * SEQ_MULTIPLE)


def truncate_tokens(
    tokens: torch.Tensor, full_length: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens[:, :truncated_length], eot_idx)``; ``full_length``: every token kept (the
    prompts' :func:`keeps_full_length`)."""
    eot = eot_indices(tokens)
    return tokens[:, : truncated_length(eot, tokens.shape[1], full_length)], eot


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

    Options (a :class:`TextOptions`, given as ``options`` or by :meth:`configure` where the
    model is built, from ``MODEL.TEXT_CHUNK`` and ``MODEL.CHECKPOINT_TEXT``): the ``n`` prompts
    run through the tower in chunks of ``chunk`` rows, and with ``checkpoint`` each chunk is an
    activation checkpoint (``torch.utils.checkpoint``, non-reentrant) while gradients are
    recorded: its block activations are freed after the forward and recomputed, one chunk at a
    time, in the backward. Chunks alone lower the peak of no-grad encoding only (a recorded graph
    keeps every chunk's activations until the backward); chunks with checkpointing lower the
    training peak to about one chunk's activations. Checkpointing alone is bit-identical to the
    plain pass; chunks agree with it up to fp32 rounding (fewer rows per matrix product change
    the kernels' blocking), as tests/test_text_memory.py checks.

    ``shared_prefix`` (``MODEL.SHARED_PREFIX``): every pass, training included, encodes each
    group of prompts' common prefix once (:meth:`encode_shared_prefix`; without the option only
    passes inside :func:`shared_prefix_text` without gradients do): the same features and
    gradients up to fp32 rounding, the prefix's work and activations paid once instead of per
    class (tests/test_text_shared_prefix.py).
    """

    def __init__(self, clip_model, options: TextOptions | None = None):
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
        # the options until configure(): the model's full-length prompts (read at build)
        self.options = options or TextOptions(full_length=keeps_full_length(clip_model))
        self._prefix_pass = False  # inside sharing_prefix(): passes without gradients share

    def configure(self, options: TextOptions) -> None:
        """Use ``options`` (:func:`text_options` of the config, applied where the model is
        built): this encoder's own state, no other encoder's."""
        if not isinstance(options, TextOptions):
            raise TypeError(f"TextEncoder.configure takes a TextOptions, got {type(options)}")
        self.options = options

    @property
    def chunk(self) -> int:
        return self.options.chunk

    @property
    def checkpoint(self) -> bool:
        return self.options.checkpoint

    @property
    def shared_prefix(self) -> bool:
        return self.options.shared_prefix

    @contextmanager
    def sharing_prefix(self) -> Iterator[None]:
        """Inside this block this encoder's passes without gradients encode the prompts' common
        prefix once (see :func:`shared_prefix_text`)."""
        previous, self._prefix_pass = self._prefix_pass, True
        try:
            yield
        finally:
            self._prefix_pass = previous

    @property
    def saves_memory(self) -> bool:
        """Whether a memory option is on (the forward is then a Python loop of checkpointed
        chunks or a prefix-shared pass with data-dependent shapes, which engine/compile.py
        leaves eager)."""
        return self.chunk > 0 or self.checkpoint or self.shared_prefix

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
        plan = self.prefix_plan(x, eot_idx)
        if plan is not None:
            return self.project(self.encode_shared_prefix(x, eot_idx, plan, layer_hook, row_args))
        mask = self.attn_mask[:seq_len, :seq_len]
        for i, block in enumerate(self.transformer.resblocks):
            if layer_hook is not None:
                x = layer_hook(i, x, *row_args)
            x = block(x, attn_mask=mask)  # [rows, L, width]
        return self.project(x[torch.arange(x.shape[0], device=x.device), eot_idx])

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the projection of the EOT states ``[rows, width]``."""
        x = self.ln_final(x)
        proj = self.text_projection
        return proj(x) if isinstance(proj, nn.Linear) else x @ proj

    def prefix_plan(self, x: torch.Tensor, eot_idx: torch.Tensor) -> PrefixPlan | None:
        """How :meth:`encode_shared_prefix` shares ``x``'s prefixes, or None for the plain path
        (without ``shared_prefix``: outside :func:`shared_prefix_text` or with gradients; for
        blocks it cannot reproduce; when no prefix of at least SHARED_PREFIX_MIN tokens saves
        work)."""
        if not self.shared_prefix and (not self._prefix_pass or torch.is_grad_enabled()):
            return None
        if not all(_supports_shared_prefix(b) for b in self.transformer.resblocks):
            return None
        return plan_shared_prefix(x, eot_idx, x.shape[1])

    def encode_shared_prefix(
        self,
        x: torch.Tensor,
        eot_idx: torch.Tensor,
        plan: PrefixPlan,
        layer_hook: LayerHook | None,
        row_args: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        """The EOT states ``[rows, width]`` of ``x`` (positions added), each group's common
        prefix encoded once: ``h_p`` ``[groups, p, width]`` holds the shared states, ``h_s``
        ``[rows, L - p, width]`` each prompt's own. A layer hook sees the whole
        ``[rows, L, width]`` input of its block; where it makes a group's rows differ inside the
        prefix, the prefix shrinks from that block on."""
        x = x[:, : int(eot_idx.max()) + 1]  # nothing after the last EOT reaches an output
        p, group, first = plan
        h_p, h_s = x[first, :p], x[:, p:]
        blocks = self.transformer.resblocks
        within = group[1:] == group[:-1]  # rows in their predecessor's group
        for i, block in enumerate(blocks):
            if layer_hook is not None:
                full = layer_hook(i, torch.cat([h_p[group], h_s], 1), *row_args)
                if bool(within.any()):
                    p = min(p, int(_neighbour_prefixes(full)[within].min()))
                h_p, h_s = full[first, :p], full[:, p:]
            last = i == len(blocks) - 1
            h_p, h_s = self._shared_block(block, h_p, h_s, group, eot_idx if last else None)
        return h_s[:, 0]  # the last block kept the EOT token only

    @staticmethod
    def _shared_block(
        block: nn.Module,
        h_p: torch.Tensor,
        h_s: torch.Tensor,
        group: torch.Tensor,
        eot_idx: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One open_clip ``ResidualAttentionBlock`` on the split states: each group's prefix as
        its own causal sequence, each prompt's tokens attending to its group's prefix and to its
        own earlier tokens. With ``eot_idx`` (the last block) only each prompt's EOT query is
        computed and ``h_s`` comes back as ``[rows, 1, width]``; the prefix is not updated."""
        attn = block.attn
        n, s, width = h_s.shape
        p = h_p.shape[1]
        heads = attn.num_heads

        def split(t: torch.Tensor) -> torch.Tensor:  # [b, l, width] -> [b, heads, l, head_dim]
            return t.unflatten(-1, (heads, width // heads)).transpose(1, 2)

        w_q, w_kv = attn.in_proj_weight[:width], attn.in_proj_weight[width:]
        b_q, b_kv = attn.in_proj_bias[:width], attn.in_proj_bias[width:]
        a_p, a_s = block.ln_1(h_p), block.ln_1(h_s)
        k_p, v_p = F.linear(a_p, w_kv, b_kv).chunk(2, -1)
        k_s, v_s = F.linear(a_s, w_kv, b_kv).chunk(2, -1)
        k = torch.cat([split(k_p)[group], split(k_s)], 2)  # [n, heads, p+s, head_dim]
        v = torch.cat([split(v_p)[group], split(v_s)], 2)
        key_pos = torch.arange(p + s, device=h_s.device)
        if eot_idx is None:
            rows, q_in = h_s, a_s
            mask = key_pos <= (p + torch.arange(s, device=h_s.device))[:, None]  # [s, p+s]
        else:
            pick = (torch.arange(n, device=h_s.device), eot_idx - p)
            rows, q_in = h_s[pick][:, None], a_s[pick][:, None]  # [n, 1, width]
            mask = (key_pos <= eot_idx[:, None])[:, None, None]  # [n, 1, 1, p+s]
        o = F.scaled_dot_product_attention(split(F.linear(q_in, w_q, b_q)), k, v, attn_mask=mask)
        o = F.linear(o.transpose(1, 2).flatten(2), attn.out_proj.weight, attn.out_proj.bias)
        h_s = rows + block.ls_1(o)
        h_s = h_s + block.ls_2(block.mlp(block.ln_2(h_s)))
        if eot_idx is None and p > 0:
            q_p = split(F.linear(a_p, w_q, b_q))
            o = F.scaled_dot_product_attention(q_p, split(k_p), split(v_p), is_causal=True)
            o = F.linear(o.transpose(1, 2).flatten(2), attn.out_proj.weight, attn.out_proj.bias)
            h_p = h_p + block.ls_1(o)
            h_p = h_p + block.ls_2(block.mlp(block.ln_2(h_p)))
        return h_p, h_s

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[n, L, width]`` (in the embedding's dtype)."""
        return self.token_embedding(tokens)

    @torch.no_grad()
    def encode_tokens(self, tokens: torch.Tensor, truncate: bool = True) -> torch.Tensor:
        """Features of tokenised text (frozen CLIP), truncated to the longest EOT by default
        (cut at the whole context with the ``full_length`` option)."""
        tokens = tokens.to(self.positional_embedding.device)
        if truncate:
            tokens, eot = truncate_tokens(tokens, self.options.full_length)
        else:
            eot = eot_indices(tokens)
        return self(self.embed_tokens(tokens), eot)


def configure_text_encoders(model: nn.Module, options: TextOptions) -> list[str]:
    """:meth:`TextEncoder.configure` on every text encoder of ``model``; returns their names
    when an option is on (else an empty list)."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, TextEncoder):
            module.configure(options)
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
