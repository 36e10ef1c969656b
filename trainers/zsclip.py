"""Zero-shot CLIP with CoOp's hand-crafted template per dataset (and a prompt ensemble).

Text features are computed once when the model is built; evaluation only encodes images.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.clip import TextEncoder, clip_dtype, encode_texts, load_clip
from engine.registry import TRAINER_REGISTRY
from engine.trainer import TrainerX

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


def dataset_template(dataset_name: str) -> str:
    return CUSTOM_TEMPLATES.get(dataset_name, DEFAULT_TEMPLATE)


def add_zsclip_config(cfg) -> None:
    from yacs.config import CfgNode as CN

    cfg.TRAINER.ZEROSHOTCLIP = CN()
    cfg.TRAINER.ZEROSHOTCLIP.PREC = "fp16"  # fp32 | fp16 | amp | bf16


class ZeroshotModel(nn.Module):
    """Frozen CLIP image encoder + fixed, L2-normalised class text features."""

    def __init__(self, clip_model, text_features: torch.Tensor):
        super().__init__()
        self.image_encoder = clip_model.visual
        self.logit_scale = clip_model.logit_scale
        self.dtype = clip_dtype(clip_model)
        self.register_buffer("text_features", text_features, persistent=False)

    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        f = self.image_encoder(image.to(self.dtype)).float()
        return f / f.norm(dim=-1, keepdim=True)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.logit_scale.exp() * self.encode_image(image) @ self.text_features.t()


@TRAINER_REGISTRY.register()
class ZeroshotCLIP(TrainerX):
    """CLIP with one hand-crafted template per dataset (evaluation only)."""

    add_config = staticmethod(add_zsclip_config)
    templates_per_class = None  # set by the ensemble variant

    def trainer_cfg(self, cfg=None):
        cfg = cfg or self.cfg
        return cfg.TRAINER.ZEROSHOTCLIP if "ZEROSHOTCLIP" in cfg.TRAINER else None

    def templates(self) -> list[str]:
        return [dataset_template(self.cfg.DATASET.NAME)]

    def build_model(self):
        clip_model = load_clip(self.cfg, precision=self.prec, device=self.device)
        encoder = TextEncoder(clip_model)
        names = [c.replace("_", " ") for c in self.dm.dataset.classnames]
        feats = []
        for template in self.templates():
            prompts = [template.format(c) for c in names]
            feats.append(encode_texts(encoder, prompts))
        text = torch.stack(feats).mean(0)  # [n_cls, dim]
        text = text / text.norm(dim=-1, keepdim=True)
        self.model = ZeroshotModel(clip_model, text).to(self.device)

    def model_inference(self, image):
        return self.model(image)

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
    """Prompt ensembling: CoOp's selected ImageNet templates plus the dataset template."""

    add_config = staticmethod(lambda cfg: None)  # shares TRAINER.ZEROSHOTCLIP

    def templates(self) -> list[str]:
        return IMAGENET_TEMPLATES_SELECT + [dataset_template(self.cfg.DATASET.NAME)]
