"""CoOp: learnable context vectors for CLIP's text prompts (Zhou et al., IJCV 2022).

Prompt = [SOS][ctx x n_ctx][class-name tokens][.][EOS]; only the context is learned. Differences
from the CoOp code base, all deliberate:

- the context is an fp32 parameter in every precision mode (CoOp's fp16 mode updated an fp16
  parameter with no master copy); in "fp16" mode CLIP's weights are half precision as before;
- the text transformer runs on the prompts cut to the longest EOT position (identical features);
- image features are computed once per step without gradients, text features once per
  evaluation (not per batch);
- the class-dependent ``token_prefix``/``token_suffix``/``eot_idx`` tensors are non-persistent
  buffers, so checkpoints hold only the context and load for any set of classes;
- with CSC and CTX_INIT the class-specific contexts all start from the init words (CoOp silently
  fell back to one shared context).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.clip import TextEncoder, keeps_full_length, load_clip, token_ids, tokenize
from engine.errors import ConfigError
from engine.registry import TRAINER_REGISTRY

from .common import (
    FrozenImageCLIP,
    PromptTrainer,
    l2_normalize,
    register_class_prompts,
    setup_prompt_learner,
)


def add_coop_config(cfg) -> None:
    """TRAINER.COOP keys (CoOp's names and defaults)."""
    from yacs.config import CfgNode as CN

    cfg.TRAINER.COOP = CN()
    cfg.TRAINER.COOP.N_CTX = 16  # number of context vectors (ignored when CTX_INIT is set)
    cfg.TRAINER.COOP.CSC = False  # class-specific context (one context per class)
    cfg.TRAINER.COOP.CTX_INIT = ""  # initialise the context from these words, e.g. "a photo of a"
    cfg.TRAINER.COOP.PREC = "fp16"  # fp32 | fp16 (half CLIP, fp32 context) | amp | bf16
    cfg.TRAINER.COOP.CLASS_TOKEN_POSITION = "end"  # end | middle | front


CLASS_TOKEN_POSITIONS = ("end", "middle", "front")


def check_class_token_position(position: str, prefix: str = "") -> None:
    """Raise ConfigError for a CLASS_TOKEN_POSITION that is not end, middle or front."""
    if position not in CLASS_TOKEN_POSITIONS:
        raise ConfigError(
            f"{prefix}CLASS_TOKEN_POSITION must be end, middle or front; got {position!r}"
        )


class PromptLearner(nn.Module):
    """CoOp's learnable context plus the fixed token embeddings of each class prompt.

    Args:
        classnames: class names ("_" becomes " ").
        clip_model: the frozen CLIP (its token embedding is read once).
        n_ctx: number of context tokens (overridden by the words of ``ctx_init``).
        ctx_init: initial context words ("" = random N(0, 0.02)).
        csc: class-specific contexts.
        class_token_position: "end" | "middle" | "front".
    """

    def __init__(
        self,
        classnames: list[str],
        clip_model,
        n_ctx: int = 16,
        ctx_init: str = "",
        csc: bool = False,
        class_token_position: str = "end",
    ):
        super().__init__()
        check_class_token_position(class_token_position)
        n_cls = len(classnames)
        ctx_dim = clip_model.ln_final.weight.shape[0]
        embedding = clip_model.token_embedding
        if ctx_init:
            ctx_init = ctx_init.replace("_", " ")
            n_ctx = len(ctx_init.split(" "))
            with torch.no_grad():
                init = embedding(tokenize(ctx_init).to(embedding.weight.device))
            ctx_vectors = init[0, 1 : 1 + n_ctx, :].float()  # [n_ctx, width]
            if csc:
                ctx_vectors = ctx_vectors.unsqueeze(0).repeat(n_cls, 1, 1)
            prompt_prefix = ctx_init
        else:
            if n_ctx < 1:
                raise ValueError(f"N_CTX must be >= 1, got {n_ctx}")
            shape = (n_cls, n_ctx, ctx_dim) if csc else (n_ctx, ctx_dim)
            ctx_vectors = torch.empty(shape, dtype=torch.float32)
            nn.init.normal_(ctx_vectors, std=0.02)
            prompt_prefix = " ".join(["X"] * n_ctx)
        self.ctx = nn.Parameter(ctx_vectors.to(embedding.weight.device))  # fp32 master weights

        names = [name.replace("_", " ") for name in classnames]
        self.name_lens = [len(token_ids(name)) for name in names]
        prompts = [f"{prompt_prefix} {name}." for name in names]
        full = keeps_full_length(clip_model)
        tokens = register_class_prompts(self, embedding, prompts, n_ctx, full)  # [n_cls, L]
        self.register_buffer(
            "order",
            self._token_order(n_ctx, class_token_position, tokens.shape[1]),
            persistent=False,
        )
        self.n_cls, self.n_ctx = n_cls, n_ctx
        self.class_token_position = class_token_position
        self.prompt_prefix = prompt_prefix

    @classmethod
    def from_node(cls, classnames: list[str], clip_model, node) -> PromptLearner:
        """Built from a config node with CoOp's keys (N_CTX, CTX_INIT, CSC,
        CLASS_TOKEN_POSITION), e.g. TRAINER.COOP or TRAINER.KGCOOP."""
        return cls(
            classnames,
            clip_model,
            n_ctx=node.N_CTX,
            ctx_init=node.CTX_INIT,
            csc=node.CSC,
            class_token_position=node.CLASS_TOKEN_POSITION,
        )

    def _token_order(self, n_ctx: int, position: str, seq_len: int) -> torch.Tensor:
        """For each class, the source index of every prompt position in the "end" layout
        [SOS, ctx, class, suffix] (an identity for "end")."""
        rows = []
        for name_len in self.name_lens:
            sos, ctx = [0], list(range(1, 1 + n_ctx))
            cls = list(range(1 + n_ctx, 1 + n_ctx + name_len))
            rest = list(range(1 + n_ctx + name_len, seq_len))
            if position == "middle":
                half = n_ctx // 2
                rows.append(sos + ctx[:half] + cls + ctx[half:] + rest)
            elif position == "front":
                rows.append(sos + cls + ctx + rest)
            else:
                rows.append(sos + ctx + cls + rest)
        return torch.tensor(rows, dtype=torch.long)  # [n_cls, L]

    def forward(self) -> torch.Tensor:
        """Prompt embeddings ``[n_cls, L, width]``."""
        ctx = self.ctx
        if ctx.dim() == 2:
            ctx = ctx.unsqueeze(0).expand(self.n_cls, -1, -1)  # [n_cls, n_ctx, width]
        prefix, suffix = self.token_prefix, self.token_suffix
        prompts = torch.cat([prefix, ctx.to(prefix.dtype), suffix], dim=1)
        if self.class_token_position != "end":
            index = self.order.unsqueeze(-1).expand(-1, -1, prompts.shape[-1])
            prompts = prompts.gather(1, index)
        return prompts


class CustomCLIP(FrozenImageCLIP):
    """CLIP with CoOp's prompt learner; ``forward(image)`` returns logits as in CoOp.

    The trainer uses the parts: :meth:`encode_image` (frozen), :meth:`encode_text` (learnable)
    and :meth:`logits`.
    """

    @classmethod
    def from_config(cls, cfg, classnames, clip_model):
        """The model of ``cfg`` for ``classnames`` (every trainer's model has this factory)."""
        return cls(cfg, classnames, clip_model)

    def __init__(self, cfg, classnames, clip_model):
        super().__init__(clip_model)
        self.prompt_learner = PromptLearner.from_node(classnames, clip_model, cfg.TRAINER.COOP)
        self.text_encoder = TextEncoder(clip_model)

    def encode_text(self) -> torch.Tensor:
        return l2_normalize(self.text_encoder(self.prompt_learner(), self.prompt_learner.eot_idx))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.logits(self.encode_image(image), self.encode_text())


@TRAINER_REGISTRY.register()
class CoOp(PromptTrainer):
    """Context Optimization (CoOp)."""

    # the grid's default configs (configs/trainers/CoOp/<cfg>.yaml; experiments/protocols.py)
    PROTOCOL_CFGS = {
        "base2new": "vit_b16_ctxv1",
        "base2new/imagenet": "vit_b16_ep50_ctxv1",
        # CoOp's few-shot setting (its COOP.md): 16 context vectors, class token at the end;
        # 50 epochs for 1 shot, 100 for 2 and 4, 200 for 8 and 16; ImageNet 50 for all
        "few_shot": "vit_b16",
        "few_shot/1shots": "vit_b16_ep50",
        "few_shot/2shots": "vit_b16_ep100",
        "few_shot/4shots": "vit_b16_ep100",
        "few_shot/imagenet": "vit_b16_ep50",
    }

    add_config = staticmethod(add_coop_config)

    def check_cfg(self, cfg):  # before CLIP is loaded
        check_class_token_position(cfg.TRAINER.COOP.CLASS_TOKEN_POSITION, "TRAINER.COOP.")

    def build_model(self):
        cfg = self.cfg
        classnames = self.classnames
        clip_model = load_clip(cfg, precision=self.prec, device=self.device)
        self.model = CustomCLIP.from_config(cfg, classnames, clip_model).to(self.device)
        setup_prompt_learner(self)
