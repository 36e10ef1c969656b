"""OpenAI's CLIP model interface over an open_clip model (no weight copies).

Trainer files written for OpenAI's ``clip`` package read the model with OpenAI's attribute
names and call its parts with OpenAI's conventions. :class:`CLIP` presents an open_clip
``CLIP`` that way: its parts are the open_clip modules and parameters themselves, registered
under OpenAI's names (so ``state_dict()`` has OpenAI's keys, and ``.to()`` / ``.float()`` /
``requires_grad_`` act on the open_clip model), and its transformers take OpenAI's
sequence-first ``[L, N, D]`` input:

- ``token_embedding``, ``positional_embedding``, ``ln_final``, ``text_projection``,
  ``logit_scale``, ``dtype``, ``context_length``, ``vocab_size``, ``encode_image``,
  ``encode_text``, ``forward(image, text)``;
- ``transformer`` (:class:`Transformer`): ``forward(x)`` with ``x`` ``[L, N, D]`` and the
  causal mask built in, ``width``, ``layers``, ``heads``, ``resblocks`` (blocks taking
  ``[L, N, D]`` too);
- ``visual`` (:class:`VisionTransformer` or :class:`ModifiedResNet`): ``input_resolution``,
  ``output_dim`` and, for ViTs, ``conv1``, ``class_embedding``, ``positional_embedding``,
  ``ln_pre``, ``transformer``, ``ln_post``, ``proj``.

Outputs equal the project's own CLIP paths (the same modules run; tests/test_dassl_compat.py).

Precision: like OpenAI's ``build_model``, :func:`build_model` returns fp16 weights (layer norms
computed in fp32). OpenAI's round trip fp32 -> fp16 -> ``.float()`` rounds every weight; here
:meth:`CLIP.float` gives back the exact weights the model was built from (while they are
unchanged), so a trainer file's fp32 mode runs on the checkpoint's weights, as the project's
trainers do.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.clip import (
    BackboneError,
    active_backbone_cfg,
    clip_dtype,
    clip_from_state_dict,
    find_weights,
    is_torchscript,
)

__all__ = [
    "CLIP",
    "ModifiedResNet",
    "ResidualAttentionBlock",
    "Transformer",
    "VisionTransformer",
    "build_model",
]


def _adopt(view: nn.Module, source: nn.Module, names: list[str]) -> None:
    """Register ``source``'s children and parameters ``names`` on ``view`` (the same objects)."""
    for name in names:
        obj = getattr(source, name, None)
        if isinstance(obj, nn.Parameter):
            view.register_parameter(name, obj)
        elif isinstance(obj, nn.Module):
            view.add_module(name, obj)
        elif obj is not None:
            raise TypeError(f"{type(source).__name__}.{name} is neither a module nor a parameter")


class ResidualAttentionBlock(nn.Module):
    """An open_clip residual attention block taking OpenAI's ``[L, N, D]`` input.

    Its children are the block's own (``ln_1``, ``attn``, ``ln_2``, ``mlp`` with ``c_fc`` and
    ``c_proj``); ``attn_mask`` is the text tower's causal mask (None in the vision tower).
    """

    def __init__(self, block: nn.Module, attn_mask: torch.Tensor | None):
        super().__init__()
        object.__setattr__(self, "_block", block)  # not a child: its parts are registered below
        _adopt(self, block, [n for n, _ in block.named_children()])
        self.attn_mask = attn_mask  # a plain attribute: the owning Transformer moves the buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.attn_mask
        if mask is not None:
            mask = mask[: x.shape[0], : x.shape[0]].to(x.device)
        x = x.permute(1, 0, 2)  # LND -> NLD
        x = self._block(x, attn_mask=mask)
        return x.permute(1, 0, 2)  # NLD -> LND


class Transformer(nn.Module):
    """An open_clip transformer taking OpenAI's sequence-first ``[L, N, D]`` input.

    Args:
        transformer: an open_clip (batch-first) ``Transformer``.
        attn_mask: the text tower's additive causal mask ``[ctx, ctx]`` (None: no mask).
    """

    def __init__(self, transformer: nn.Module, attn_mask: torch.Tensor | None = None):
        super().__init__()
        if not getattr(transformer, "batch_first", True):
            raise ValueError("Only batch-first open_clip transformers are supported")
        self.width = transformer.width
        self.layers = transformer.layers
        first = transformer.resblocks[0]
        self.heads = getattr(getattr(first, "attn", None), "num_heads", None)
        if attn_mask is not None:
            self.register_buffer("attn_mask", attn_mask, persistent=False)
        else:
            self.attn_mask = None
        blocks = [ResidualAttentionBlock(b, None) for b in transformer.resblocks]
        self.resblocks = nn.Sequential(*blocks)
        self._sync_block_masks()

    def _sync_block_masks(self) -> None:
        for block in self.resblocks:
            block.attn_mask = self.attn_mask

    def _apply(self, fn, *args, **kwargs):  # .to()/.cuda(): the blocks see the moved mask
        out = super()._apply(fn, *args, **kwargs)
        self._sync_block_masks()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq_len = x.shape[0]
        mask = None if self.attn_mask is None else self.attn_mask[:seq_len, :seq_len]
        x = x.permute(1, 0, 2)  # LND -> NLD (open_clip is batch-first)
        for block in self.resblocks:
            x = block._block(x, attn_mask=mask)
        return x.permute(1, 0, 2)  # NLD -> LND


class VisionTransformer(nn.Module):
    """open_clip's ViT image tower with OpenAI's attribute names; ``transformer`` takes
    ``[L, N, D]``. ``forward`` is open_clip's (the same modules)."""

    def __init__(self, visual: nn.Module):
        super().__init__()
        object.__setattr__(self, "_visual", visual)
        _adopt(self, visual, ["conv1", "class_embedding", "positional_embedding", "ln_pre"])
        _adopt(self, visual, ["patch_dropout", "attn_pool", "ln_post", "proj"])
        self.transformer = Transformer(visual.transformer)
        self.input_resolution = _resolution(visual)
        self.output_dim = visual.output_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._visual(x)


class ModifiedResNet(nn.Module):
    """open_clip's ResNet image tower (OpenAI's names already) with ``input_resolution``."""

    def __init__(self, visual: nn.Module):
        super().__init__()
        object.__setattr__(self, "_visual", visual)
        _adopt(self, visual, [n for n, _ in visual.named_children()])
        self.input_resolution = _resolution(visual)
        self.output_dim = visual.output_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._visual(x)


def _resolution(visual: nn.Module) -> int:
    size = visual.image_size
    return int(size[0] if isinstance(size, (tuple, list)) else size)


class CLIP(nn.Module):
    """OpenAI's ``CLIP`` interface over an open_clip ``CLIP`` (see the module docstring).

    Args:
        model: an open_clip ``CLIP`` with the standard text tower.
        source_weights: the fp32 tensors the model was built from (by OpenAI name), which
            :meth:`float` restores exactly; None: ``float()`` only casts.
    """

    def __init__(self, model: nn.Module, source_weights: dict | None = None):
        super().__init__()
        if getattr(model, "attn_mask", None) is None or not hasattr(model, "token_embedding"):
            raise TypeError("clip.model.CLIP needs an open_clip CLIP with the standard text tower")
        object.__setattr__(self, "_model", model)
        _adopt(self, model, ["token_embedding", "positional_embedding", "ln_final"])
        _adopt(self, model, ["text_projection", "logit_scale"])
        self.transformer = Transformer(model.transformer, model.attn_mask)
        if hasattr(model.visual, "conv1") and hasattr(model.visual, "class_embedding"):
            self.visual = VisionTransformer(model.visual)
        else:
            self.visual = ModifiedResNet(model.visual)
        self.context_length = model.context_length
        self.vocab_size = model.vocab_size
        self._source_weights = source_weights

    @property
    def open_clip_model(self) -> nn.Module:
        """The open_clip ``CLIP`` this object presents."""
        return self._model

    @property
    def dtype(self) -> torch.dtype:
        return clip_dtype(self._model)

    def build_attention_mask(self) -> torch.Tensor:
        return self.transformer.attn_mask

    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        return self.visual(image.type(self.dtype))

    def encode_text(self, text: torch.Tensor) -> torch.Tensor:
        x = self.token_embedding(text).type(self.dtype)  # [N, L, D]
        x = x + self.positional_embedding[: x.shape[1]].type(self.dtype)
        x = x.permute(1, 0, 2)  # NLD -> LND
        x = self.transformer(x)
        x = x.permute(1, 0, 2)  # LND -> NLD
        x = self.ln_final(x).type(self.dtype)
        x = x[torch.arange(x.shape[0], device=x.device), text.argmax(dim=-1)]  # [N, D]
        proj = self.text_projection
        return proj(x) if isinstance(proj, nn.Linear) else x @ proj

    def forward(self, image: torch.Tensor, text: torch.Tensor):
        image_features = self.encode_image(image)
        text_features = self.encode_text(text)
        image_features = image_features / image_features.norm(dim=1, keepdim=True)
        text_features = text_features / text_features.norm(dim=1, keepdim=True)
        logits_per_image = self.logit_scale.exp() * image_features @ text_features.t()
        return logits_per_image, logits_per_image.t()

    def float(self):
        """Cast to fp32; weights still equal to the fp16 rounding of the fp32 weights the model
        was built from get those weights back exactly (OpenAI's cast would keep the rounding)."""
        restore = {}
        for name, p in self.named_parameters():
            src = (self._source_weights or {}).get(name)
            if src is None or p.dtype == torch.float32 or src.dtype != torch.float32:
                continue
            if src.shape == p.shape and torch.equal(p.data, src.to(p.device, p.dtype)):
                restore[name] = src
        super().float()
        for name, p in self.named_parameters():
            if name in restore:
                p.data = restore[name].to(p.device, torch.float32, copy=True)
        self._source_weights = None  # restored once; later casts are plain casts
        return self


def build_model(state_dict: dict, design_details: dict | None = None) -> CLIP:
    """OpenAI's ``clip.build_model``: the CLIP holding ``state_dict`` (fp16 weights, eval mode).

    The architecture comes from the config of the trainer being built (its
    ``MODEL.BACKBONE.NAME`` or ``MODEL.BACKBONE.CONFIG``), else it is inferred from the OpenAI
    state dict, as OpenAI's function does. ``design_details`` (the modified ``clip`` packages of
    MaPLe, IVLP and PromptSRC, whose transformer blocks insert deep prompts) is refused.
    """
    if design_details is not None:
        trainer = design_details.get("trainer", "?") if isinstance(design_details, dict) else "?"
        from engine.registry import TRAINER_REGISTRY

        ours = ["MaPLe", "IVLP", "PromptSRC"]
        if trainer in TRAINER_REGISTRY and trainer not in ours:  # e.g. CoPrompt (MaPLe's blocks)
            ours.insert(0, trainer)
        raise BackboneError(
            f"clip.build_model(state_dict, design_details) with trainer {trainer!r}: the modified "
            "CLIP of MaPLe/IVLP/PromptSRC's own clip package (deep prompts inside the transformer "
            "blocks) is not part of the clip compatibility layer. Use this project's trainer "
            f"instead (--trainer {', '.join(ours[:-1])} or {ours[-1]} read the same config keys "
            "and load those code bases' checkpoints), or files that use OpenAI's "
            "clip.build_model(sd)"
        )
    cfg = active_backbone_cfg()
    if cfg is None:
        from engine.config import get_base_cfg_default

        cfg = get_base_cfg_default()  # no NAME/CONFIG: the architecture is inferred
        path = None
    else:
        path = find_weights(cfg)[0] if cfg.MODEL.BACKBONE.PRETRAINED else None
    is_jit = path is not None and is_torchscript(path)  # QuickGELU as the project's loader
    sd = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    source = f"the state dict given to clip.build_model (the weights of {path or 'no file'})"
    model = clip_from_state_dict(cfg, sd, is_jit, source, "fp16")
    return CLIP(model, source_weights=sd).eval()
