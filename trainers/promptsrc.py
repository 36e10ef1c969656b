"""PromptSRC: prompting with self-regulating constraints (Khattak et al., ICCV 2023).

IVLP's independent deep prompts in both towers (trainers/ivlp.py: token positions per block)
regulated towards the frozen CLIP. Per batch of ``B`` images, ``C`` classes, feature dim ``D``,
with L2-normalised prompted features ``f`` (image, ``[B, D]``) and ``g`` (text, ``[C, D]``),
frozen features ``f0`` (the unprompted image tower, ``[B, D]``) and ``g0`` (text, ``[C, D]``),
``s = logit_scale.exp()``, ``z = s f g^T`` and ``z0 = s f0 g0^T``::

    loss = CE(z, label) + L_text + L_image + L_logits
    L_text   = TEXT_LOSS_WEIGHT  * mean |g - g0|     (L1 over C x D elements; weight 25)
    L_image  = IMAGE_LOSS_WEIGHT * mean |f - f0|     (L1 over B x D elements; weight 10)
    L_logits = KL(softmax(z0) || softmax(z)) summed over the batch / (B * C)   (temperature 1)

(PromptSRC's ``F.kl_div(log_softmax(z), log_softmax(z0), reduction="sum", log_target=True) *
T^2 / z.numel()`` with T = 1). ``g0`` is the prompt ensemble of PromptSRC's code: the mean of the
UNnormalised frozen text features of the 60 ImageNet templates of :data:`IMAGENET_TEMPLATES`
(OpenAI's list as PromptSRC ships it; no per-dataset template), then L2-normalised.

Gaussian prompt aggregation (GPA): epoch ``e = 1 .. MAX_EPOCH`` gets the weight
``w_e = N(e; GPA_MEAN, GPA_STD) / sum_k N(k; GPA_MEAN, GPA_STD)`` (the weights sum to 1); after
each epoch the learnable state is added to a running ``sum_e w_e * state_e``, and after the last
epoch that aggregate replaces the prompts, so the saved checkpoint and the final evaluation use
it, as in PromptSRC. The running aggregate is written next to the checkpoints
(``<OUTPUT_DIR>/<model name>/gpa_state.pth``) so a resumed run aggregates every epoch.

The frozen work (``f0`` and ``z0``) runs in ``prepare_step``, once per step: a sharpness-aware
optimizer's second pass reuses it. Differences from PromptSRC's code base, all deliberate:

- ``f0`` comes from the same frozen image tower without prompts (PromptSRC kept a second CLIP
  copy) and ``g0`` is computed once from the same text tower, in CLIP's precision mode
  (PromptSRC: a separate fp32 copy);
- all the losses apply in every precision mode (PromptSRC's amp path trained with CE only);
- GPA aggregates the learnable prompts only (PromptSRC averaged the whole CLIP state dict,
  whose frozen weights stay unchanged as the weights sum to 1), and checkpoints hold only the
  prompts;
- IVLP's differences (trainers/ivlp.py) apply.
"""

from __future__ import annotations

import logging
import math
import os
import os.path as osp

import torch
import torch.nn.functional as F

from engine.checkpoint import load_checkpoint
from engine.clip import encode_texts
from engine.errors import ConfigError
from engine.registry import TRAINER_REGISTRY
from engine.utils import atomic_torch_save, compute_accuracy

from .common import l2_normalize
from .ivlp import IVLP, IVLPCLIP, add_independent_prompt_keys

logger = logging.getLogger(__name__)

# OpenAI's ImageNet prompt templates in PromptSRC's order (its trainers/imagenet_templates.py)
IMAGENET_TEMPLATES = [
    "a photo of a {}.",
    "a bad photo of a {}.",
    "a photo of many {}.",
    "a sculpture of a {}.",
    "a photo of the hard to see {}.",
    "a low resolution photo of the {}.",
    "a rendering of a {}.",
    "graffiti of a {}.",
    "a bad photo of the {}.",
    "a cropped photo of the {}.",
    "a tattoo of a {}.",
    "the embroidered {}.",
    "a photo of a hard to see {}.",
    "a bright photo of a {}.",
    "a photo of a clean {}.",
    "a photo of a dirty {}.",
    "a dark photo of the {}.",
    "a drawing of a {}.",
    "a photo of my {}.",
    "the plastic {}.",
    "a photo of the cool {}.",
    "a close-up photo of a {}.",
    "a black and white photo of the {}.",
    "a painting of the {}.",
    "a painting of a {}.",
    "a pixelated photo of the {}.",
    "a sculpture of the {}.",
    "a bright photo of the {}.",
    "a cropped photo of a {}.",
    "a plastic {}.",
    "a photo of the dirty {}.",
    "a jpeg corrupted photo of a {}.",
    "a blurry photo of the {}.",
    "a photo of the {}.",
    "a good photo of the {}.",
    "a rendering of the {}.",
    "a {} in a video game.",
    "a photo of one {}.",
    "a doodle of a {}.",
    "a close-up photo of the {}.",
    "the origami {}.",
    "the {} in a video game.",
    "a sketch of a {}.",
    "a doodle of the {}.",
    "a origami {}.",
    "a low resolution photo of a {}.",
    "the toy {}.",
    "a rendition of the {}.",
    "a photo of the clean {}.",
    "a photo of a large {}.",
    "a rendition of a {}.",
    "a photo of a nice {}.",
    "a photo of a weird {}.",
    "a blurry photo of a {}.",
    "a cartoon {}.",
    "art of a {}.",
    "a sketch of the {}.",
    "a embroidered {}.",
    "a pixelated photo of a {}.",
    "itap of the {}.",
]


def add_promptsrc_config(cfg) -> None:
    """TRAINER.PROMPTSRC keys (PromptSRC's names and base-to-new values)."""
    from yacs.config import CfgNode as CN

    cfg.TRAINER.PROMPTSRC = CN()
    add_independent_prompt_keys(cfg.TRAINER.PROMPTSRC)
    cfg.TRAINER.PROMPTSRC.TEXT_LOSS_WEIGHT = 25.0  # weight of the L1 text-feature loss
    cfg.TRAINER.PROMPTSRC.IMAGE_LOSS_WEIGHT = 10.0  # weight of the L1 image-feature loss
    cfg.TRAINER.PROMPTSRC.GPA_MEAN = 15.0  # mean (1-based epoch) of the GPA epoch weights
    cfg.TRAINER.PROMPTSRC.GPA_STD = 1.0  # standard deviation (epochs) of the GPA weights; > 0


def gpa_weights(max_epoch: int, mean: float, std: float) -> list[float]:
    """GPA's weights of epochs ``1 .. max_epoch``: ``N(e; mean, std)`` normalised to sum 1.

    Computed as a softmax of ``-(e - mean)^2 / (2 std^2)`` (the Gaussian's constant cancels), so
    epochs far from ``mean`` never make every weight underflow to 0.
    """
    if std <= 0:
        raise ValueError(f"GPA_STD must be > 0, got {std}")
    logs = [-0.5 * ((e - mean) / std) ** 2 for e in range(1, max_epoch + 1)]
    top = max(logs)
    w = [math.exp(v - top) for v in logs]
    total = sum(w)
    return [v / total for v in w]


def ensemble_text_features(text_encoder, classnames: list[str], templates: list[str]):
    """PromptSRC's frozen ``g0`` ``[n_cls, dim]``: the mean over ``templates`` of the
    unnormalised frozen text features, L2-normalised (fp32)."""
    names = [c.replace("_", " ") for c in classnames]
    feats = [
        encode_texts(text_encoder, [t.format(n) for n in names], normalize=False) for t in templates
    ]
    return l2_normalize(torch.stack(feats).mean(0))  # [n_cls, dim]


class PromptSRCCLIP(IVLPCLIP):
    """IVLP's CLIP plus the frozen ensemble text features ``zs_text_features`` (``g0``,
    non-persistent) and the frozen image features / zero-shot logits of :meth:`zero_shot`."""

    CONFIG_NODE = "PROMPTSRC"

    def __init__(self, prompt_learner, clip_model, classnames: list[str]):
        super().__init__(prompt_learner, clip_model)
        g0 = ensemble_text_features(self.text_encoder, classnames, IMAGENET_TEMPLATES)
        self.register_buffer("zs_text_features", g0, persistent=False)  # [n_cls, dim], fp32

    @classmethod
    def from_config(cls, cfg, classnames, clip_model):
        """The model of ``cfg`` (TRAINER.PROMPTSRC) for ``classnames``."""
        return cls(cls.build_prompt_learner(cfg, classnames, clip_model), clip_model, classnames)

    @torch.no_grad()
    def zero_shot(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The frozen CLIP's normalised image features ``f0`` ``[B, D]`` and zero-shot logits
        ``z0 = s f0 g0^T`` ``[B, n_cls]``."""
        f0 = l2_normalize(self.image_encoder(image))  # the tower without prompts or hooks
        return f0, self.logits(f0, self.zs_text_features)


def promptsrc_losses(
    logits: torch.Tensor,
    zs_logits: torch.Tensor,
    text_features: torch.Tensor,
    zs_text_features: torch.Tensor,
    image_features: torch.Tensor,
    zs_image_features: torch.Tensor,
    text_weight: float,
    image_weight: float,
) -> dict[str, torch.Tensor]:
    """PromptSRC's self-regulating terms (fp32): ``{"text", "image", "logits"}``, weighted."""
    text = F.l1_loss(text_features.float(), zs_text_features.float()) * text_weight
    image = F.l1_loss(image_features.float(), zs_image_features.float()) * image_weight
    kl = (
        F.kl_div(
            F.log_softmax(logits.float(), dim=1),
            F.log_softmax(zs_logits.float(), dim=1),
            reduction="sum",
            log_target=True,
        )
        / logits.numel()
    )  # KL(zero-shot || prompted), temperature 1
    return {"text": text, "image": image, "logits": kl}


@TRAINER_REGISTRY.register()
class PromptSRC(IVLP):
    """PromptSRC: IVLP's prompts, CE plus the self-regulating losses, and Gaussian prompt
    aggregation over epochs."""

    # the grid's default configs (configs/trainers/PromptSRC/<cfg>.yaml; experiments/protocols.py)
    PROTOCOL_CFGS = {
        "base2new": "vit_b16_c2_ep20_batch4_4x4ctx",
        "transfer": "vit_b16_c2_ep5_batch4_4x4ctx_cross_datasets",
        "few_shot": "vit_b16_c2_ep50_batch4_4x4ctx_few_shot",  # GPA N(45, 5): per-dataset files
    }

    add_config = staticmethod(add_promptsrc_config)
    MODEL_CLASS = PromptSRCCLIP
    GPA_FILE = "gpa_state.pth"

    def check_cfg(self, cfg):
        super().check_cfg(cfg)
        node = self.trainer_cfg(cfg)
        for key in ("TEXT_LOSS_WEIGHT", "IMAGE_LOSS_WEIGHT"):
            if node[key] < 0:
                raise ConfigError(f"{self.cfg_key(key)} must be >= 0, got {node[key]}")
        if node.GPA_STD <= 0:
            raise ConfigError(
                f"{self.cfg_key('GPA_STD')} must be > 0 (the width, in epochs, of the Gaussian "
                f"epoch weights), got {node.GPA_STD}"
            )

    def build_model(self):
        super().build_model()
        node = self.trainer_cfg()
        self.gpa_weights = gpa_weights(self.max_epoch, node.GPA_MEAN, node.GPA_STD)
        self.gpa_state: dict[str, torch.Tensor] | None = None

    # -- the step ---------------------------------------------------------------------------
    def prepare_step(self, batch_inputs):
        image, label = batch_inputs
        zs_image_features, zs_logits = self.model.zero_shot(image)
        return image, label, zs_image_features, zs_logits

    def compute_loss(self, inputs):
        image, label, zs_image_features, zs_logits = inputs
        node = self.trainer_cfg()
        prompts = self.model.prompt_learner()
        image_features = self.model.encode_image(image, prompts)
        text_features = self.model.encode_text(prompts)
        logits = self.model.logits(image_features, text_features)
        ce = self.classification_loss(logits, label)
        terms = promptsrc_losses(
            logits,
            zs_logits,
            text_features,
            self.model.zs_text_features,
            image_features,
            zs_image_features,
            node.TEXT_LOSS_WEIGHT,
            node.IMAGE_LOSS_WEIGHT,
        )
        loss = ce + terms["text"] + terms["image"] + terms["logits"]
        summary = {"acc": compute_accuracy(logits, label)[0], "ce": ce.detach()}
        summary.update({f"scl_{k}": v.detach() for k, v in terms.items()})
        return loss, summary

    # -- Gaussian prompt aggregation --------------------------------------------------------
    def _gpa_path(self) -> str:
        return osp.join(self.output_dir, self.model_name, self.GPA_FILE)

    def before_train(self):
        super().before_train()  # resumes: self.start_epoch
        self.gpa_state = None
        if self.start_epoch == 0:
            return
        path = self._gpa_path()
        # weights only (engine.checkpoint's safe loader): tensors and numbers, nothing else
        saved = load_checkpoint(path) if osp.exists(path) else None
        if saved is not None and saved["epoch"] == self.start_epoch:
            self.gpa_state = {k: v.to(self.device) for k, v in saved["state"].items()}
        else:
            logger.warning(
                "PromptSRC resumes at epoch %d without the GPA aggregate of the epochs before "
                "it (%s): the aggregate covers epochs %d..%d only",
                self.start_epoch + 1,
                path,
                self.start_epoch + 1,
                self.max_epoch,
            )

    def accumulate_gpa(self, epoch: int) -> None:
        """Add ``w_{epoch+1} * state`` of the learnable prompts to the aggregate."""
        weight = self.gpa_weights[epoch]
        state = self.model.learnable.state_dict()
        if self.gpa_state is None:
            self.gpa_state = {k: v.detach().float() * weight for k, v in state.items()}
        else:
            for k, v in state.items():
                self.gpa_state[k] += v.detach().float() * weight

    def after_epoch(self):
        self.accumulate_gpa(self.epoch)
        if self.epoch + 1 == self.max_epoch:
            logger.info("Using the Gaussian-aggregated prompts (GPA) for the final model")
            self.model.learnable.load_state_dict(self.gpa_state)
        elif self.output_dir:
            path = self._gpa_path()
            os.makedirs(osp.dirname(path), exist_ok=True)
            state = {k: v.cpu() for k, v in self.gpa_state.items()}
            atomic_torch_save({"epoch": self.epoch + 1, "state": state}, path)
        super().after_epoch()  # saves the checkpoint (the aggregate after the last epoch)
