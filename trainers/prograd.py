"""ProGrad: prompt-aligned gradient (Zhu et al., "Prompt-aligned Gradient for Prompt Tuning",
ICCV 2023; code BeierZhu/Prompt-align, compared at commit 1b76203).

CoOp's learnable context (trainers/coop.py) trained on the cross-entropy, with each update's
gradient stripped of its conflict with the "general direction": the gradient of the KL
divergence between the learned prompts' predictions and the zero-shot CLIP's (hand-crafted
template, frozen). With ``z`` the learned logits, ``z0`` the zero-shot logits (both
``logit_scale * cos``), ``T = TRAINER.PROGRAD.T`` and ``lambda = TRAINER.PROGRAD.LAMBDA``::

    L_ce = CE(z, y)
    L_kl = T^2 * mean_i sum_c -softmax(z0_i / T)_c * log_softmax(z_i / T)_c
    g    = grad L_ce, projected against grad L_kl (optim.prograd): where the two conflict
           (negative cosine) g - lambda * (g . u) u, u = grad L_kl / ||grad L_kl||

``L_kl`` is the authors' form: the cross-entropy to the zero-shot distribution (the KL without
its constant entropy term: the same gradient). Only the cross-entropy's gradient is followed;
the KL term only gives the direction. The projection is the optimizer step's
(:meth:`optim.step.OptimizerStep.set_projection`): the trainer returns the cross-entropy with
its guide attached (:func:`optim.prograd.guided`), and every backward of the step, both passes
of a sharpness-aware optimizer, is projected (docs/optimizers.md, "ProGrad").

The context initialisation is ProGrad's, not CoOp's: with ``CTX_INIT "template"`` (the authors'
``CTX_INIT True``) the words of the dataset's ProGrad template before its class slot
(:data:`PROGRAD_TEMPLATES`, e.g. "a type of pet, a photo of a" for OxfordPets) fill the last
of the ``N_CTX`` context vectors (their first token embeddings, one per space-separated word)
and the rest start at zero; the prompt is ``"X ... X <words> <class>."`` with the frozen tokens
after position ``N_CTX`` (so a word that tokenizes into two tokens, "pet,", leaves its last
token in the frozen part, as in the authors' code). Other words in ``CTX_INIT`` are used the
same way; ``""`` draws the context from N(0, 0.02).

Differences from the authors' code, all deliberate:

- the keys live in ``TRAINER.PROGRAD`` (the authors' ``TRAINER.COOP.*`` and ``LOSS.*``):
  :meth:`ProGrad.translate_key` reads their files' keys (``LOSS.T``, ``LOSS.LAMBDA``,
  ``LOSS.NAME`` -> ``TRAINER.PROGRAD.T``/``LAMBDA``/``LOSS``; ``TRAINER.COOP.CTX_INIT True`` ->
  ``"template"``; ``LOSS.GM``, ``LOSS.ALPHA`` and ``TRAINER.COOP.ALPHA``, declared by their
  train.py and read by no trainer, dropped), so their configs and scripts run unchanged;
- the zero-shot text features come from the same frozen CLIP, once, in a non-persistent buffer
  (the authors load a second CLIP in fp32): identical in fp32, the half CLIP's in fp16 mode;
  the zero-shot logits use the step's frozen image features (computed once per step);
- ``amp`` and ``bf16`` train with the projection (the authors' ``amp`` path scaled a tuple and
  stopped); ``CLASS_TOKEN_POSITION middle`` works (theirs raised a NameError);
- datasets without a ProGrad template fall back to "a photo of a {}." (theirs: KeyError);
  ``DATASET.TEMPLATE`` replaces the template when set;
- with ``CSC True`` and an initialisation the class-specific contexts all start from the words
  (the authors' code then silently trained one shared context, as CoOp's did);
- CoOp's deliberate differences (fp32 context, truncated prompts) apply.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.clip import (
    TextEncoder,
    encode_texts,
    keeps_full_length,
    load_clip,
    token_ids,
    tokenize,
)
from engine.errors import ConfigError
from engine.registry import TRAINER_REGISTRY
from engine.utils import compute_accuracy
from optim.prograd import ProGradProjection, guided

from .common import (
    FrozenImageCLIP,
    PromptTrainer,
    l2_normalize,
    register_class_prompts,
    setup_prompt_learner,
)
from .coop import PromptLearner, check_class_token_position
from .zsclip import DEFAULT_TEMPLATE

logger = logging.getLogger(__name__)

# ProGrad's hand-crafted templates (its trainers/prograd.py): the zero-shot prompts of the KL
# term, and the words of CTX_INIT "template"
PROGRAD_TEMPLATES = {
    "OxfordPets": "a type of pet, a photo of a {}.",
    "OxfordFlowers": "a type of flower, a photo of a {}.",
    "FGVCAircraft": "a type of aircraft, a photo of a {}.",
    "DescribableTextures": "a texture of {}.",
    "EuroSAT": "a centered satellite photo of {}.",
    "StanfordCars": "a photo of a {}.",
    "Food101": "a type of food, a photo of {}.",
    "SUN397": "a photo of a {}.",
    "Caltech101": "a photo of a {}.",
    "UCF101": "a photo of a person doing {}.",
    "ImageNet": "a photo of a {}.",
    "ImageNetSketch": "a photo of a {}.",
    "ImageNetV2": "a photo of a {}.",
    "ImageNetA": "a photo of a {}.",
    "ImageNetR": "a photo of a {}.",
}
TEMPLATE_INIT = "template"  # CTX_INIT: the words of the dataset's template (the authors' True)
LOSS_NAMES = ("prograd",)  # the authors' LOSS.NAME values (anything else: NotImplementedError)


def add_prograd_config(cfg) -> None:
    """TRAINER.PROGRAD keys (the authors' names and the values of their released scripts)."""
    from yacs.config import CfgNode as CN

    cfg.TRAINER.PROGRAD = CN()
    cfg.TRAINER.PROGRAD.N_CTX = 16  # context vectors (CTX_INIT's words fill the last ones)
    cfg.TRAINER.PROGRAD.CSC = False  # class-specific context
    # "template": the dataset's ProGrad template words (the authors' True); words; "": random
    cfg.TRAINER.PROGRAD.CTX_INIT = TEMPLATE_INIT
    cfg.TRAINER.PROGRAD.PREC = "fp16"  # fp32 | fp16 (half CLIP, fp32 context) | amp | bf16
    cfg.TRAINER.PROGRAD.CLASS_TOKEN_POSITION = "end"  # end | middle | front
    cfg.TRAINER.PROGRAD.LOSS = "prograd"  # the authors' LOSS.NAME (the only loss they have)
    cfg.TRAINER.PROGRAD.T = 1.0  # temperature of the KL term (LOSS.T)
    cfg.TRAINER.PROGRAD.LAMBDA = 1.0  # share of the conflicting component removed (LOSS.LAMBDA)


def prograd_template(dataset_name: str, template: str = "") -> str:
    """The zero-shot template of a dataset (Dassl name); ``template`` (``DATASET.TEMPLATE``)
    replaces it when set."""
    return template or PROGRAD_TEMPLATES.get(dataset_name, DEFAULT_TEMPLATE)


def init_words(ctx_init: str, template: str) -> str:
    """The words that initialise the context: ``ctx_init``, or the template before its class
    slot for ``"template"`` ("" for a random context)."""
    if ctx_init != TEMPLATE_INIT:
        return ctx_init.replace("_", " ")
    if not template.endswith(" {}."):
        raise ConfigError(
            f"TRAINER.PROGRAD.CTX_INIT {TEMPLATE_INIT!r} takes the words of the template "
            f"{template!r} before its class slot, and the template does not end with ' {{}}.': "
            "give the words in CTX_INIT instead"
        )
    return template[: -len(" {}.")].replace("_", " ")


def prograd_kl(logits: torch.Tensor, zs_logits: torch.Tensor, temperature: float):
    """``L_kl`` of the module docstring (fp32 at least): the zero-shot logits ``zs_logits``
    are the teacher."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    teacher = F.softmax(zs_logits.to(logits.dtype) / temperature, dim=-1)
    kl = -teacher * F.log_softmax(logits / temperature, dim=-1) * temperature * temperature
    return kl.sum(1).mean()


class ProGradPromptLearner(PromptLearner):
    """CoOp's prompt learner with ProGrad's initialisation (module docstring).

    Args:
        classnames: class names ("_" becomes " ").
        clip_model: the frozen CLIP (its token embedding is read once).
        n_ctx: number of context vectors.
        words: initial words ("" = random N(0, 0.02)); at most ``n_ctx`` of them.
        csc: class-specific contexts.
        class_token_position: "end" | "middle" | "front".
    """

    def __init__(
        self,
        classnames: list[str],
        clip_model,
        n_ctx: int = 16,
        words: str = "",
        csc: bool = False,
        class_token_position: str = "end",
    ):
        nn.Module.__init__(self)
        check_class_token_position(class_token_position)
        if n_ctx < 1:
            raise ConfigError(f"TRAINER.PROGRAD.N_CTX must be >= 1, got {n_ctx}")
        n_cls = len(classnames)
        embedding = clip_model.token_embedding
        width = embedding.weight.shape[1]
        device = embedding.weight.device
        if words:
            n_words = len(words.split(" "))
            if n_words > n_ctx:
                raise ConfigError(
                    f"TRAINER.PROGRAD.N_CTX {n_ctx} is smaller than the {n_words} words of the "
                    f"initial context {words!r}: raise N_CTX to at least {n_words}"
                )
            with torch.no_grad():
                init = embedding(tokenize(words).to(device))  # [1, 77, width]
            ctx = torch.zeros(n_ctx, width)
            ctx[n_ctx - n_words :] = init[0, 1 : 1 + n_words].float()  # the last n_words
            prefix = f"{' '.join(['X'] * (n_ctx - n_words))} {words}"
            if csc:
                ctx = ctx.unsqueeze(0).repeat(n_cls, 1, 1)  # [n_cls, n_ctx, width]
        else:
            ctx = torch.empty((n_cls, n_ctx, width) if csc else (n_ctx, width))
            nn.init.normal_(ctx, std=0.02)
            prefix = " ".join(["X"] * n_ctx)
        self.ctx = nn.Parameter(ctx.to(device))  # fp32 master weights

        names = [name.replace("_", " ") for name in classnames]
        self.name_lens = [len(token_ids(name)) for name in names]
        prompts = [f"{prefix} {name}." for name in names]
        tokens = register_class_prompts(
            self, embedding, prompts, n_ctx, keeps_full_length(clip_model)
        )  # [n_cls, L]
        self.register_buffer(
            "order",
            self._token_order(n_ctx, class_token_position, tokens.shape[1]),
            persistent=False,
        )
        self.n_cls, self.n_ctx = n_cls, n_ctx
        self.class_token_position = class_token_position
        self.prompt_prefix = prefix


class ProGradCLIP(FrozenImageCLIP):
    """CLIP with ProGrad's prompt learner and the frozen zero-shot text features ``t_zs``
    (``[n_cls, dim]``, L2-normalised, fp32) of the dataset's ProGrad template."""

    @classmethod
    def from_config(cls, cfg, classnames, clip_model):
        """The model of ``cfg`` (TRAINER.PROGRAD, the dataset's template) for ``classnames``."""
        node = cfg.TRAINER.PROGRAD
        template = prograd_template(cfg.DATASET.NAME, cfg.DATASET.TEMPLATE)
        prompt_learner = ProGradPromptLearner(
            classnames,
            clip_model,
            n_ctx=node.N_CTX,
            words=init_words(node.CTX_INIT, template),
            csc=node.CSC,
            class_token_position=node.CLASS_TOKEN_POSITION,
        )
        at_zero_shot = f"{prompt_learner.prompt_prefix.strip()} {{}}." == template
        if at_zero_shot and node.CLASS_TOKEN_POSITION == "end":
            logger.warning(
                "ProGrad: the initial prompt %r is the zero-shot prompt itself (TRAINER.PROGRAD."
                "N_CTX %d = the words of CTX_INIT): the KL term's gradient is zero at the start "
                "and the projection then removes most of every step (the context stays near its "
                "start; docs/trainers.md, 'ProGrad on the small world'). The authors use N_CTX "
                "16: raise N_CTX above the number of words",
                template,
                node.N_CTX,
            )
        return cls(classnames, prompt_learner, clip_model, template)

    def __init__(self, classnames, prompt_learner, clip_model, template: str):
        super().__init__(clip_model)
        self.prompt_learner = prompt_learner
        self.text_encoder = TextEncoder(clip_model)
        names = [name.replace("_", " ") for name in classnames]
        t_zs = encode_texts(self.text_encoder, [template.format(n) for n in names])
        self.register_buffer("t_zs", t_zs, persistent=False)  # [n_cls, dim], normalised
        self.template = template

    def encode_text(self) -> torch.Tensor:
        """Normalised learned class text features ``[n_cls, dim]``."""
        pl = self.prompt_learner
        return l2_normalize(self.text_encoder(pl(), pl.eot_idx))

    def zero_shot_logits(self, image_features: torch.Tensor) -> torch.Tensor:
        """The zero-shot CLIP's logits ``[batch, n_cls]`` of normalised image features."""
        return self.logits(image_features, self.t_zs)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.logits(self.encode_image(image), self.encode_text())


# ProGrad's files declare its keys in TRAINER.COOP and LOSS (their train.py's extend_cfg)
COOP_NODE = "TRAINER.COOP."
COOP_KEYS = ("N_CTX", "CSC", "CTX_INIT", "PREC", "CLASS_TOKEN_POSITION")
LOSS_KEYS = {"LOSS.NAME": "LOSS", "LOSS.T": "T", "LOSS.LAMBDA": "LAMBDA"}
UNUSED_KEYS = ("LOSS.GM", "LOSS.ALPHA", "TRAINER.COOP.ALPHA")  # declared there, read by none


def _ctx_init(value):
    """The authors' ``CTX_INIT`` (a bool in their configs) as this trainer's value."""
    text = value.strip().lower() if isinstance(value, str) else None
    if value is True or text == "true":
        return TEMPLATE_INIT
    if value is False or value is None or text in ("false", "none", ""):
        return ""
    return value


@TRAINER_REGISTRY.register()
class ProGrad(PromptTrainer):
    """Prompt-aligned Gradient (ProGrad): CoOp's context, the cross-entropy's gradient projected
    against the KL-to-zero-shot gradient by the optimizer step (module docstring)."""

    # the grid's default configs (configs/trainers/ProGrad/<cfg>.yaml; experiments/protocols.py)
    PROTOCOL_CFGS = {
        "base2new": "vit_b16_ep100_ctxv1",
        "base2new/imagenet": "vit_b16_ep50_ctxv1",
        "transfer": "vit_b16_ep50_ctxv1",
        # its README's few-shot schedule (CoOp's): 50 epochs for 1 shot, 100 for 2 and 4, 200
        # for 8 and 16 (LAMBDA 0.8 on DTD, EuroSAT, Flowers102: the vit_b16_ctxv1_<dataset>
        # overlays); ImageNet: CoOp's 50 epochs for all shots (the README names none)
        "few_shot": "vit_b16_ctxv1",
        "few_shot/1shots": "vit_b16_ep50_ctxv1",
        "few_shot/2shots": "vit_b16_ep100_ctxv1",
        "few_shot/4shots": "vit_b16_ep100_ctxv1",
        "few_shot/imagenet": "vit_b16_ep50_ctxv1",
    }  # RN50: rn50, rn50_ep100, rn50_ep50 as released (--cfg)

    # optimizers with a loss term of their own (SAF, MESA) and ESAM's masked pass are refused by
    # ProGradProjection.check_optimizer (optim/prograd.py), from what the optimizer does
    # one process: the projection needs both gradients all-reduced first (refused by
    # OptimizerStep.set_projection under data-parallel runs)
    DATA_PARALLEL = False
    COMPILES = False  # eager under every MODEL.COMPILE mode (compile_model)

    add_config = staticmethod(add_prograd_config)

    @classmethod
    def translate_key(cls, key, value, source):
        """The authors' files: ``TRAINER.COOP.<K>`` and ``LOSS.*`` (module docstring)."""
        if key in UNUSED_KEYS:
            return []
        if key in LOSS_KEYS:
            return [(f"TRAINER.PROGRAD.{LOSS_KEYS[key]}", value)]
        leaf = key[len(COOP_NODE) :] if key.startswith(COOP_NODE) else None
        if leaf not in COOP_KEYS:
            return [(key, value)]
        if leaf == "CTX_INIT":
            value = _ctx_init(value)
        return [(f"TRAINER.PROGRAD.{leaf}", value)]

    def check_cfg(self, cfg):
        c = self.trainer_cfg(cfg)
        check_class_token_position(c.CLASS_TOKEN_POSITION, "TRAINER.PROGRAD.")
        if c.LOSS not in LOSS_NAMES:
            raise ConfigError(
                f"{self.cfg_key('LOSS')} (the authors' LOSS.NAME) must be one of {LOSS_NAMES}, "
                f"got {c.LOSS!r}"
            )
        if c.T <= 0:
            raise ConfigError(f"{self.cfg_key('T')} (the KL temperature) must be > 0, got {c.T}")
        if c.LAMBDA < 0:
            raise ConfigError(f"{self.cfg_key('LAMBDA')} must be >= 0, got {c.LAMBDA}")
        if c.N_CTX < 1:
            raise ConfigError(f"{self.cfg_key('N_CTX')} must be >= 1, got {c.N_CTX}")

    def __init__(self, cfg, classnames=None):
        super().__init__(cfg, classnames=classnames)
        self.optim_step.set_projection(
            ProGradProjection(self.trainer_cfg().LAMBDA, who="ProGrad (TRAINER.PROGRAD.LAMBDA)")
        )

    def compile_model(self):
        """Eager encoders under every ``MODEL.COMPILE`` mode: the projection backpropagates twice
        through one forward (the first backward keeps the graph). CUDA-graph modes replay into
        static buffers that the second backward would overwrite, and AOT autograd's donated
        buffers refuse a retained graph; a graph compiled for another trainer's encoder in the
        same process (a packed worker) may have them, so ProGrad never uses compiled encoders."""
        if self.compile_mode and self.compiled_modules is None:
            logger.info(
                "ProGrad: MODEL.COMPILE %s: its two backward passes per forward do not combine "
                "with compiled encoders (CUDA graphs, donated buffers); the encoders run eagerly",
                self.cfg.MODEL.COMPILE,
            )
            self.compiled_modules = []
        return super().compile_model()

    def build_model(self):
        clip_model = load_clip(self.cfg, precision=self.prec, device=self.device)
        self.model = ProGradCLIP.from_config(self.cfg, self.classnames, clip_model).to(self.device)
        setup_prompt_learner(self)

    def prepare_step(self, batch_inputs):
        image, label = batch_inputs
        image_features = self.model.encode_image(image)
        return image_features, self.model.zero_shot_logits(image_features), label

    def compute_loss(self, inputs):
        image_features, zs_logits, label = inputs
        logits = self.model.logits(image_features, self.model.encode_text())
        ce = self.classification_loss(logits, label)  # L_ce; records the pass's outputs
        kl = prograd_kl(logits, zs_logits, self.trainer_cfg().T)
        summary = {
            "acc": compute_accuracy(logits, label)[0],
            "xe_loss": ce.detach(),
            "kl_loss": kl.detach(),
        }
        return guided(ce, kl), summary
