"""Zero-shot CLIP with CoOp's hand-crafted template per dataset (and a prompt ensemble).

Text features are computed once when the model is built; evaluation only encodes images.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.clip import TextEncoder, clip_dtype, encode_texts, load_clip
from engine.registry import TRAINER_REGISTRY
from engine.trainer import ModelOutput, TrainerX

from .common import l2_normalize

# CoOp's per-dataset templates (the ImageNet family uses "a photo of a {}.")
CUSTOM_TEMPLATES = {
    "OxfordPets": "a photo of a {}, a type of pet.",
    "OxfordFlowers": "a photo of a {}, a type of flower.",
    "FGVCAircraft": "a photo of a {}, a type of aircraft.",
    "DescribableTextures": "{} texture.",
    "EuroSAT": "a centered satellite photo of {}.",
    "StanfordCars": "a photo of a {}.",
    "Food101": "a photo of {}, a type of food.",
    "SUN397": "a photo of a {}.",
    "Caltech101": "a photo of a {}.",
    "UCF101": "a photo of a person doing {}.",
    "ImageNet": "a photo of a {}.",
    "ImageNetSketch": "a photo of a {}.",
    "ImageNetV2": "a photo of a {}.",
    "ImageNetA": "a photo of a {}.",
    "ImageNetR": "a photo of a {}.",
}
DEFAULT_TEMPLATE = "a photo of a {}."

# The subset of OpenAI's ImageNet templates used by CoOp's prompt-ensembling baseline
IMAGENET_TEMPLATES_SELECT = [
    "itap of a {}.",
    "a bad photo of the {}.",
    "a origami {}.",
    "a photo of the large {}.",
    "a {} in a video game.",
    "art of the {}.",
    "a photo of the small {}.",
]


def dataset_template(dataset_name: str, template: str = "") -> str:
    """The hand-crafted template of a dataset: ``template`` (``DATASET.TEMPLATE``) when set,
    else CoOp's template of ``dataset_name``, else "a photo of a {}." (e.g. a Folder dataset)."""
    return template or CUSTOM_TEMPLATES.get(dataset_name, DEFAULT_TEMPLATE)


def add_zsclip_config(cfg) -> None:
    from yacs.config import CfgNode as CN

    cfg.TRAINER.ZEROSHOTCLIP = CN()
    cfg.TRAINER.ZEROSHOTCLIP.PREC = "fp16"  # fp32 | fp16 | amp | bf16


class ZeroshotModel(nn.Module):
    """Frozen CLIP (both towers) with the fixed, L2-normalised class text features of a
    template ensemble (the mean of the per-template features, renormalised)."""

    def __init__(self, clip_model, templates: list[str], classnames: list[str]):
        super().__init__()
        self.text_encoder = TextEncoder(clip_model)  # kept: encode_text() of any prompts
        self.image_encoder = clip_model.visual
        self.logit_scale = clip_model.logit_scale
        self.dtype = clip_dtype(clip_model)
        names = [c.replace("_", " ") for c in classnames]
        feats = [encode_texts(self.text_encoder, [t.format(c) for c in names]) for t in templates]
        text = torch.stack(feats).mean(0)  # [n_cls, dim]: the template ensemble
        self.register_buffer("text_features", l2_normalize(text), persistent=False)

    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        f = self.image_encoder(image.to(self.dtype)).float()
        return f / f.norm(dim=-1, keepdim=True)

    def encode_text(self, prompts: list[str]) -> torch.Tensor:
        """L2-normalised features of ``prompts`` ``[n, dim]`` from the frozen text tower."""
        return l2_normalize(encode_texts(self.text_encoder, prompts).float())

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.logit_scale.exp() * self.encode_image(image) @ self.text_features.t()


@TRAINER_REGISTRY.register()
class ZeroshotCLIP(TrainerX):
    """CLIP with one hand-crafted template per dataset (evaluation only)."""

    add_config = staticmethod(add_zsclip_config)
    CONFIG_NODE = "ZEROSHOTCLIP"  # shared by ZeroshotCLIP2
    EVAL_ONLY = True
    templates_per_class = None  # set by the ensemble variant

    def templates(self) -> list[str]:
        return [dataset_template(self.cfg.DATASET.NAME, self.cfg.DATASET.TEMPLATE)]

    def build_model(self):
        clip_model = load_clip(self.cfg, precision=self.prec, device=self.device)
        self.model = ZeroshotModel(clip_model, self.templates(), self.classnames).to(self.device)

    def model_outputs(self, image):
        image_features = self.model.encode_image(image)
        text = self.model.text_features
        return ModelOutput(
            image_features, text, self.model.logit_scale.exp() * image_features @ text.t()
        )

    def frozen_image_encoder(self):
        return self.model.image_encoder

    def model_inference_features(self, features):
        features = features.float()
        features = features / features.norm(dim=-1, keepdim=True)
        return self.model.logit_scale.exp() * features @ self.model.text_features.t()

    def train(self):
        raise RuntimeError(f"{type(self).__name__} has nothing to train: use --eval-only")


@TRAINER_REGISTRY.register()
class ZeroshotCLIP2(ZeroshotCLIP):
    """Prompt ensembling as CoOp's ZeroshotCLIP2: its 7 selected ImageNet templates, plus the
    dataset template for every dataset but ImageNet (whose template is already among them)."""

    add_config = staticmethod(lambda cfg: None)  # shares TRAINER.ZEROSHOTCLIP

    def templates(self) -> list[str]:
        d = self.cfg.DATASET
        if d.NAME == "ImageNet" and not d.TEMPLATE:
            return list(IMAGENET_TEMPLATES_SELECT)
        return IMAGENET_TEMPLATES_SELECT + [dataset_template(d.NAME, d.TEMPLATE)]
