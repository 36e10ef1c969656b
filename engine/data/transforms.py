"""Dassl's image transforms, built from ``INPUT.TRANSFORMS`` with torchvision's v2 API.

Train order (Dassl's): resize (only without a random crop), random_translation, random_crop,
random_resized_crop, center_crop, random_flip, auto-augment policies / randaugment, colorjitter,
random_gray_scale, gaussian_blur, to float, cutout, normalize, gaussian_noise, instance_norm.
Test: resize the short side to max(INPUT.SIZE), center crop INPUT.SIZE, to float, normalize.

``randaugment`` is Dassl's RandAugment(RANDAUGMENT_N, RANDAUGMENT_M) (16 operations, see
:mod:`engine.data.randaugment`), the one the Dassl-based trainers (CoPrompt's views) use;
``randaugment_tv`` is torchvision's RandAugment with the same N and M (a different operation set).
``randaugment_fixmatch`` and ``randaugment2`` are torchvision approximations of Dassl's variants.

Two implementations of these operations (``INPUT.PIPELINE``; both draw the same random numbers
in the same order, so the same seed gives the same crops and flips):

- ``pil`` (Dassl's, the ``released`` reproduction's): the operations run on PIL images (a
  decoded image kept in memory, ``DATALOADER.CACHE_DECODED``, is turned back into one), then
  ``ToTensor``'s division by 255 and the normalisation, in the loader worker. Bit for bit what
  Dassl's torchvision pipeline gives.
- ``tensor`` (the default): the operations run on uint8 tensors (torchvision's tensor kernels,
  ``antialias=True``) and, when the float stage is only "normalize", the worker sends the uint8
  image: the loader converts and normalises whole batches on the device
  (:mod:`engine.data.device_finish`). Its resizes differ from PIL's by a few grey levels on a
  few percent of the pixels (bicubic; bilinear by at most one level): docs/performance.md has
  the measured difference and its effect on accuracy. Test pipelines are the same in both
  (PIL's resize and crop); with ``tensor`` they also send uint8.
- ``tensor_device`` (opt-in): ``tensor`` with the random resized crop's resize and the flip on
  the device, batched (:mod:`engine.data.device_crop`): the worker draws the same crop boxes and
  flips and sends the uint8 crop regions. Only the training transforms random_resized_crop,
  random_flip and normalize qualify.
"""

from __future__ import annotations

import torch
import torchvision.transforms.v2 as T
from PIL import Image
from torchvision.transforms.v2 import InterpolationMode

from .device_crop import DeviceCropFinish, FlipFlag, RandomCropBox, check_device_crop_choices
from .device_finish import DeviceFinish, ToFloat
from .randaugment import RandAugment as DasslRandAugment
from .validate import PIPELINES, PIPELINES_HELP  # INPUT.PIPELINE values (module docstring)

INTERPOLATION_MODES = {
    "bilinear": InterpolationMode.BILINEAR,
    "bicubic": InterpolationMode.BICUBIC,
    "nearest": InterpolationMode.NEAREST,
}


# float-stage transforms that a worker must run itself (random, or per image); without them the
# tensor pipeline's worker sends uint8 and the device normalises
_WORKER_FLOAT_OPS = ("cutout", "gaussian_noise", "instance_norm")

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


class ToPILImage(torch.nn.Module):
    """A PIL image, or a decoded uint8 ``[C, H, W]`` tensor (the decoded-image cache), as a PIL
    image (RGB or L): the ``pil`` pipeline's first step."""

    def forward(self, img):
        if isinstance(img, Image.Image):
            return img
        array = img.permute(1, 2, 0).numpy()
        return Image.fromarray(array[..., 0] if array.shape[2] == 1 else array)


class UInt8Pipeline(T.Compose):
    """The ``tensor`` pipeline's transforms when they end at uint8: its loader finishes the
    batches on the device with :attr:`device_finish`."""

    def __init__(self, transforms, device_finish: DeviceFinish):
        super().__init__(transforms)
        self.device_finish = device_finish


def _check_choices(choices) -> None:
    for choice in choices:
        if choice not in AVAILABLE_TRANSFORMS:
            raise ValueError(
                f"Unknown transform '{choice}' in INPUT.TRANSFORMS; available: "
                f"{', '.join(AVAILABLE_TRANSFORMS)}"
            )


def pipeline_of(cfg) -> str:
    """``cfg.INPUT.PIPELINE``, checked: one of :data:`PIPELINES`."""
    pipeline = cfg.INPUT.get("PIPELINE", "pil")
    if pipeline not in PIPELINES:
        raise ValueError(
            f"INPUT.PIPELINE must be one of {', '.join(PIPELINES)}, got {pipeline!r} "
            f"({PIPELINES_HELP})"
        )
    return pipeline


def build_transform(cfg, is_train: bool = True, choices=None, on_device: bool = False):
    """Build the train or test transform from ``cfg.INPUT`` (Dassl's ``build_transform``).

    Args:
        cfg: the config.
        is_train: train (augmentation) or test pipeline.
        choices: transform names (default ``cfg.INPUT.TRANSFORMS``).
        on_device: with ``INPUT.PIPELINE tensor``, let the transform end at uint8 when the rest
            is the normalisation (a :class:`UInt8Pipeline`, whose loader finishes the batches on
            the device: what the DataManager builds); with ``tensor_device`` the training
            transform ends at the uint8 crop region (:mod:`engine.data.device_crop`). Without
            it ``tensor_device`` builds ``tensor``'s transforms (the same crops). False (the
            default, Dassl's contract): float images, normalised in the transform.
    """
    if cfg.INPUT.NO_TRANSFORM:
        return T.Compose([T.ToImage(), T.ToDtype(torch.float32, scale=True)])
    choices = list(cfg.INPUT.TRANSFORMS if choices is None else choices)
    _check_choices(choices)
    pipeline = pipeline_of(cfg)
    if cfg.INPUT.INTERPOLATION not in INTERPOLATION_MODES:
        raise ValueError(
            f"INPUT.INTERPOLATION must be one of {sorted(INTERPOLATION_MODES)}, "
            f"got {cfg.INPUT.INTERPOLATION!r}"
        )
    normalize = T.Normalize(mean=list(cfg.INPUT.PIXEL_MEAN), std=list(cfg.INPUT.PIXEL_STD))
    if is_train:
        tfm = _build_transform_train(cfg, choices, pipeline)
    else:
        tfm = _build_transform_test(cfg)
    if pipeline == "tensor_device" and is_train and on_device:
        check_device_crop_choices(choices)
        return _device_crop_transform(cfg, choices)
    worker_ops = _WORKER_FLOAT_OPS if is_train else ("instance_norm",)
    if pipeline in ("tensor", "tensor_device") and on_device and not set(worker_ops) & set(choices):
        finish = DeviceFinish(cfg.INPUT.PIXEL_MEAN, cfg.INPUT.PIXEL_STD, "normalize" in choices)
        return UInt8Pipeline(tfm, finish)
    return T.Compose(tfm + _float_stage(cfg, choices, normalize, is_train))


def _device_crop_transform(cfg, choices) -> UInt8Pipeline:
    """``tensor_device``'s training transform: the crop box and the flip drawn as ``tensor``'s
    RandomResizedCrop and RandomHorizontalFlip draw them; the device resizes and flips."""
    inp = cfg.INPUT
    interp = INTERPOLATION_MODES[inp.INTERPOLATION]
    size = list(inp.SIZE)
    tfm = [
        T.ToImage(),
        RandomCropBox(size, scale=tuple(inp.RRCROP_SCALE), interpolation=interp, antialias=True),
        FlipFlag(0.5 if "random_flip" in choices else None),
    ]
    finish = DeviceCropFinish(inp.PIXEL_MEAN, inp.PIXEL_STD, "normalize" in choices, size, interp)
    return UInt8Pipeline(tfm, finish)


def _float_stage(cfg, choices, normalize, is_train: bool) -> list:
    """uint8 -> float (Dassl's ToTensor arithmetic), then the float transforms, in a worker."""
    inp = cfg.INPUT
    tfm = [ToFloat()]
    if is_train and "cutout" in choices:
        tfm.append(Cutout(inp.CUTOUT_N, inp.CUTOUT_LEN))
    if "normalize" in choices:
        tfm.append(normalize)
    if is_train and "gaussian_noise" in choices:
        tfm.append(GaussianNoise(inp.GN_MEAN, inp.GN_STD))
    if "instance_norm" in choices:
        tfm.append(InstanceNormalization())
    return tfm


def _build_transform_train(cfg, choices, pipeline: str) -> list:
    """The training transforms up to the uint8 image (a tensor; PIL operations with ``pil``)."""
    inp = cfg.INPUT
    interp = INTERPOLATION_MODES[inp.INTERPOLATION]
    input_size = list(inp.SIZE)
    # a PIL image or a cached uint8 tensor -> what the pipeline's operations take
    tfm = [ToPILImage()] if pipeline == "pil" else [T.ToImage()]
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
    tfm += [T.ToImage(), T.ToPureTensor()]  # PIL (or uint8 tensor) -> a plain uint8 tensor
    return tfm


def _build_transform_test(cfg) -> list:
    """Resize the short side, centre crop (PIL's operations on a PIL image, also for a decoded
    uint8 image: RETURN_IMG0's), to a plain uint8 tensor."""
    inp = cfg.INPUT
    interp = INTERPOLATION_MODES[inp.INTERPOLATION]
    input_size = list(inp.SIZE)
    return [
        ToPILImage(),
        T.Resize(max(input_size), interpolation=interp, antialias=True),
        T.CenterCrop(input_size),
        T.ToImage(),
        T.ToPureTensor(),
    ]
