"""Dassl's image transforms, built from ``INPUT.TRANSFORMS`` with torchvision's v2 API.

Train order (Dassl's): resize (only without a random crop), random_translation, random_crop,
random_resized_crop, center_crop, random_flip, auto-augment policies / randaugment, colorjitter,
random_gray_scale, gaussian_blur, to float, cutout, normalize, gaussian_noise, instance_norm.
Test: resize the short side to max(INPUT.SIZE), center crop INPUT.SIZE, to float, normalize.

``randaugment`` is Dassl's RandAugment(RANDAUGMENT_N, RANDAUGMENT_M) (16 operations, see
:mod:`engine.data.randaugment`), the one the Dassl-based trainers (CoPrompt's views) use;
``randaugment_tv`` is torchvision's RandAugment with the same N and M (a different operation set).
``randaugment_fixmatch`` and ``randaugment2`` are torchvision approximations of Dassl's variants.

Training pipelines start by converting the image to a uint8 tensor, so a PIL image read from
disk and a decoded image kept in memory (``DATALOADER.CACHE_DECODED``) go through exactly the
same operations and give the same augmentation distribution.
"""

from __future__ import annotations

import torch
import torchvision.transforms.v2 as T
from torchvision.transforms.v2 import InterpolationMode

from .randaugment import RandAugment as DasslRandAugment

INTERPOLATION_MODES = {
    "bilinear": InterpolationMode.BILINEAR,
    "bicubic": InterpolationMode.BICUBIC,
    "nearest": InterpolationMode.NEAREST,
}

AVAILABLE_TRANSFORMS = (
    "random_flip",
    "random_resized_crop",
    "normalize",
    "instance_norm",
    "random_crop",
    "random_translation",
    "center_crop",
    "cutout",
    "imagenet_policy",
    "cifar10_policy",
    "svhn_policy",
    "randaugment",
    "randaugment_tv",
    "randaugment_fixmatch",
    "randaugment2",
    "gaussian_noise",
    "colorjitter",
    "randomgrayscale",
    "gaussian_blur",
)


class Cutout(torch.nn.Module):
    """Zero ``n_holes`` random squares of side ``length`` in a float image tensor."""

    def __init__(self, n_holes: int = 1, length: int = 16):
        super().__init__()
        self.n_holes = n_holes
        self.length = length

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        h, w = img.shape[-2:]
        mask = torch.ones(h, w, dtype=img.dtype)
        for _ in range(self.n_holes):
            y = int(torch.randint(h, ()))
            x = int(torch.randint(w, ()))
            y1, y2 = max(0, y - self.length // 2), min(h, y + self.length // 2)
            x1, x2 = max(0, x - self.length // 2), min(w, x + self.length // 2)
            mask[y1:y2, x1:x2] = 0
        return img * mask


class GaussianNoise(torch.nn.Module):
    def __init__(self, mean: float = 0.0, std: float = 0.15, p: float = 0.5):
        super().__init__()
        self.mean, self.std, self.p = mean, std, p

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        if torch.rand(()) > self.p:
            return img
        return img + torch.randn_like(img) * self.std + self.mean


class InstanceNormalization(torch.nn.Module):
    """Per-channel normalisation of each image by its own mean and std."""

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        mean = img.mean(dim=(-2, -1), keepdim=True)
        std = img.std(dim=(-2, -1), keepdim=True).clamp_min(1e-5)
        return (img - mean) / std


class Random2DTranslation(torch.nn.Module):
    """Dassl's random translation: with p=0.5 enlarge by 1/8 and random-crop back."""

    def __init__(self, height: int, width: int, p: float = 0.5, interpolation=None):
        super().__init__()
        self.height, self.width, self.p = height, width, p
        self.interpolation = interpolation or InterpolationMode.BILINEAR

    def forward(self, img):
        if torch.rand(()) > self.p:
            return T.functional.resize(img, [self.height, self.width], self.interpolation)
        nh, nw = round(self.height * 1.125), round(self.width * 1.125)
        img = T.functional.resize(img, [nh, nw], self.interpolation)
        y = int(torch.randint(nh - self.height + 1, ()))
        x = int(torch.randint(nw - self.width + 1, ()))
        return T.functional.crop(img, y, x, self.height, self.width)


def _check_choices(choices) -> None:
    for choice in choices:
        if choice not in AVAILABLE_TRANSFORMS:
            raise ValueError(
                f"Unknown transform '{choice}' in INPUT.TRANSFORMS; available: "
                f"{', '.join(AVAILABLE_TRANSFORMS)}"
            )


def build_transform(cfg, is_train: bool = True, choices=None):
    """Build the train or test transform from ``cfg.INPUT`` (Dassl's ``build_transform``).

    Args:
        cfg: the config.
        is_train: train (augmentation) or test pipeline.
        choices: transform names (default ``cfg.INPUT.TRANSFORMS``).
    """
    if cfg.INPUT.NO_TRANSFORM:
        return T.Compose([T.ToImage(), T.ToDtype(torch.float32, scale=True)])
    choices = list(cfg.INPUT.TRANSFORMS if choices is None else choices)
    _check_choices(choices)
    if cfg.INPUT.INTERPOLATION not in INTERPOLATION_MODES:
        raise ValueError(
            f"INPUT.INTERPOLATION must be one of {sorted(INTERPOLATION_MODES)}, "
            f"got {cfg.INPUT.INTERPOLATION!r}"
        )
    normalize = T.Normalize(mean=list(cfg.INPUT.PIXEL_MEAN), std=list(cfg.INPUT.PIXEL_STD))
    if is_train:
        return _build_transform_train(cfg, choices, normalize)
    return _build_transform_test(cfg, choices, normalize)


def _build_transform_train(cfg, choices, normalize):
    inp = cfg.INPUT
    interp = INTERPOLATION_MODES[inp.INTERPOLATION]
    input_size = list(inp.SIZE)
    tfm = [T.ToImage()]  # PIL image or cached uint8 tensor -> uint8 tensor
    if "random_crop" not in choices and "random_resized_crop" not in choices:
        tfm.append(T.Resize(input_size, interpolation=interp, antialias=True))
    if "random_translation" in choices:
        tfm.append(Random2DTranslation(input_size[0], input_size[1], interpolation=interp))
    if "random_crop" in choices:
        tfm.append(T.RandomCrop(input_size, padding=inp.CROP_PADDING))
    if "random_resized_crop" in choices:
        tfm.append(
            T.RandomResizedCrop(
                input_size, scale=tuple(inp.RRCROP_SCALE), interpolation=interp, antialias=True
            )
        )
    if "center_crop" in choices:
        tfm.append(T.CenterCrop(input_size))
    if "random_flip" in choices:
        tfm.append(T.RandomHorizontalFlip())
    policies = {
        "imagenet_policy": T.AutoAugmentPolicy.IMAGENET,
        "cifar10_policy": T.AutoAugmentPolicy.CIFAR10,
        "svhn_policy": T.AutoAugmentPolicy.SVHN,
    }
    for name, policy in policies.items():
        if name in choices:
            tfm.append(T.AutoAugment(policy))
    if "randaugment" in choices:  # Dassl's (PIL operations, on the uint8 image)
        tfm.append(DasslRandAugment(n=inp.RANDAUGMENT_N, m=inp.RANDAUGMENT_M))
    if "randaugment_tv" in choices:  # torchvision's
        tfm.append(T.RandAugment(num_ops=inp.RANDAUGMENT_N, magnitude=inp.RANDAUGMENT_M))
    if "randaugment_fixmatch" in choices:
        tfm.append(T.RandAugment(num_ops=inp.RANDAUGMENT_N, magnitude=10))
    if "randaugment2" in choices:
        tfm.append(T.RandAugment(num_ops=inp.RANDAUGMENT_N, magnitude=5))
    if "colorjitter" in choices:
        tfm.append(
            T.ColorJitter(
                brightness=inp.COLORJITTER_B,
                contrast=inp.COLORJITTER_C,
                saturation=inp.COLORJITTER_S,
                hue=inp.COLORJITTER_H,
            )
        )
    if "randomgrayscale" in choices:
        tfm.append(T.RandomGrayscale(p=inp.RGS_P))
    if "gaussian_blur" in choices:
        tfm.append(T.RandomApply([T.GaussianBlur(inp.GB_K)], p=inp.GB_P))
    tfm.append(T.ToDtype(torch.float32, scale=True))
    if "cutout" in choices:
        tfm.append(Cutout(inp.CUTOUT_N, inp.CUTOUT_LEN))
    if "normalize" in choices:
        tfm.append(normalize)
    if "gaussian_noise" in choices:
        tfm.append(GaussianNoise(inp.GN_MEAN, inp.GN_STD))
    if "instance_norm" in choices:
        tfm.append(InstanceNormalization())
    return T.Compose(tfm)


def _build_transform_test(cfg, choices, normalize):
    inp = cfg.INPUT
    interp = INTERPOLATION_MODES[inp.INTERPOLATION]
    input_size = list(inp.SIZE)
    tfm = [
        T.Resize(max(input_size), interpolation=interp, antialias=True),
        T.CenterCrop(input_size),
        T.ToImage(),
        T.ToDtype(torch.float32, scale=True),
    ]
    if "normalize" in choices:
        tfm.append(normalize)
    if "instance_norm" in choices:
        tfm.append(InstanceNormalization())
    return T.Compose(tfm)
