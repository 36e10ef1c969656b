"""Dassl's RandAugment: the ``randaugment`` transform of every Dassl-based prompt learner.

A re-implementation, from its documented behaviour, of ``RandAugment(n=2, m=10)`` in Dassl.pytorch
(``dassl/data/transforms/randaugment.py``), which CoPrompt uses for both of its views. It is not
torchvision's RandAugment (``randaugment_tv`` in this project): the operation list, the
magnitude ranges and the random signs differ.

Per image, ``n`` operations are drawn uniformly *with replacement* (the same one may come twice)
from the 16 below, and each is applied in turn at the value ``m / 30 * (high - low) + low``. There
is no per-operation probability, no Identity and no random magnitude. Values at ``m = 10``:

================  ===========  ==========================================================
operation         range        at m = 10
================  ===========  ==========================================================
AutoContrast      --           PIL ``ImageOps.autocontrast``
Equalize          --           PIL ``ImageOps.equalize``
Invert            --           255 - x
Rotate            (0, 30)      10 degrees, random sign, nearest, black corners
Posterize         (4, 8)       int(5.33) = 5 bits kept
Solarize          (0, 256)     threshold 85.33: values >= 86 inverted
SolarizeAdd       (0, 110)     x -> min(255, floor(x + 36.67)), then values >= 128 inverted
Color             (0.1, 1.9)   enhance factor 0.7
Contrast          (0.1, 1.9)   enhance factor 0.7
Brightness        (0.1, 1.9)   enhance factor 0.7
Sharpness         (0.1, 1.9)   enhance factor 0.7
ShearX            (0, 0.3)     shear 0.1, random sign, nearest, black fill
ShearY            (0, 0.3)     shear 0.1, random sign, nearest, black fill
CutoutAbs         (0, 40)      a 13.33 px square (14 x 14 pixels drawn) of gray (125, 123, 114)
TranslateXabs     (0, 100)     33.33 px (absolute, whatever the image size), random sign
TranslateYabs     (0, 100)     33.33 px, random sign
================  ===========  ==========================================================

"Random sign" means the value is negated with probability 1/2, as Dassl does for the geometric
operations; the enhance factors, thresholds and sizes are never negated.

Randomness comes only from torch's default CPU generator, which ``DatasetWrapper`` seeds per
sample, so a seeded run augments every image identically whatever the number of workers. (Dassl
draws from Python's ``random`` and numpy's global state instead; the distribution is the same.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from PIL import Image, ImageDraw, ImageEnhance, ImageOps
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

CUTOUT_FILL = (125, 123, 114)  # Dassl's CutoutAbs colour (about the ImageNet mean in 0-255)
SOLARIZE_ADD_THRESHOLD = 128
MAX_MAGNITUDE = 30


def _coin() -> bool:
    """True with probability 1/2 (Dassl negates a signed value when ``random() > 0.5``)."""
    return float(torch.rand(())) > 0.5


def _random_sign(v: float) -> float:
    return -v if _coin() else v


def _affine(img: Image.Image, coeffs: tuple) -> Image.Image:
    # PIL's inverse map: output pixel (x, y) takes input (a x + b y + c, d x + e y + f)
    return img.transform(img.size, Image.Transform.AFFINE, coeffs)


def auto_contrast(img: Image.Image, _: float) -> Image.Image:
    return ImageOps.autocontrast(img)


def equalize(img: Image.Image, _: float) -> Image.Image:
    return ImageOps.equalize(img)


def invert(img: Image.Image, _: float) -> Image.Image:
    return ImageOps.invert(img)


def rotate(img: Image.Image, degrees: float) -> Image.Image:
    """Rotate counter-clockwise by +-``degrees`` about the centre (same size, black corners)."""
    return img.rotate(_random_sign(degrees))


def posterize(img: Image.Image, bits: float) -> Image.Image:
    """Keep the ``int(bits)`` most significant bits of every channel."""
    return ImageOps.posterize(img, int(bits))


def solarize(img: Image.Image, threshold: float) -> Image.Image:
    """Invert every value >= ``threshold``."""
    return ImageOps.solarize(img, threshold)


def solarize_add(img: Image.Image, addition: float) -> Image.Image:
    """Add ``addition`` (clipped at 255, truncated to an integer), then solarize at 128."""
    lut = []
    for x in range(256):
        y = min(255, math.floor(x + addition))
        lut.append(y if y < SOLARIZE_ADD_THRESHOLD else 255 - y)
    return img.point(lut * len(img.getbands()))


def color(img: Image.Image, factor: float) -> Image.Image:
    return ImageEnhance.Color(img).enhance(factor)


def contrast(img: Image.Image, factor: float) -> Image.Image:
    return ImageEnhance.Contrast(img).enhance(factor)


def brightness(img: Image.Image, factor: float) -> Image.Image:
    return ImageEnhance.Brightness(img).enhance(factor)


def sharpness(img: Image.Image, factor: float) -> Image.Image:
    return ImageEnhance.Sharpness(img).enhance(factor)


def shear_x(img: Image.Image, shear: float) -> Image.Image:
    return _affine(img, (1, _random_sign(shear), 0, 0, 1, 0))


def shear_y(img: Image.Image, shear: float) -> Image.Image:
    return _affine(img, (1, 0, 0, _random_sign(shear), 1, 0))


def translate_x_abs(img: Image.Image, pixels: float) -> Image.Image:
    """Shift by +-``pixels`` horizontally (content moves left for a positive value)."""
    return _affine(img, (1, 0, _random_sign(pixels), 0, 1, 0))


def translate_y_abs(img: Image.Image, pixels: float) -> Image.Image:
    return _affine(img, (1, 0, 0, 0, 1, _random_sign(pixels)))


def cutout_abs(img: Image.Image, size: float) -> Image.Image:
    """Paint a gray square of side ``size`` px centred at a uniform random point.

    As in Dassl: the centre is uniform in (1, w] x (1, h], the corner is truncated to an integer
    and the far edge is inclusive, so a 13.33 px square paints 14 x 14 pixels away from the
    borders and is clipped at them.
    """
    if size < 0:
        return img
    w, h = img.size
    cx = w + (1 - w) * float(torch.rand(()))
    cy = h + (1 - h) * float(torch.rand(()))
    x0 = int(max(0.0, cx - size / 2.0))
    y0 = int(max(0.0, cy - size / 2.0))
    x1 = min(w, x0 + size)
    y1 = min(h, y0 + size)
    fill = CUTOUT_FILL if img.mode == "RGB" else CUTOUT_FILL[0]
    img = img.copy()
    ImageDraw.Draw(img).rectangle((x0, y0, int(x1), int(y1)), fill=fill)
    return img


class AugOp(NamedTuple):
    """One operation of the list: ``fn(img, value)`` with ``value`` mapped into [low, high]."""

    name: str
    fn: Callable[[Image.Image, float], Image.Image]
    low: float
    high: float

    def value(self, magnitude: float) -> float:
        """The operation's value at ``magnitude`` (0..30)."""
        return magnitude / MAX_MAGNITUDE * (self.high - self.low) + self.low


# Dassl's randaugment_list(), in its order
RANDAUGMENT_OPS: tuple[AugOp, ...] = (
    AugOp("AutoContrast", auto_contrast, 0, 1),
    AugOp("Equalize", equalize, 0, 1),
    AugOp("Invert", invert, 0, 1),
    AugOp("Rotate", rotate, 0, 30),
    AugOp("Posterize", posterize, 4, 8),
    AugOp("Solarize", solarize, 0, 256),
    AugOp("SolarizeAdd", solarize_add, 0, 110),
    AugOp("Color", color, 0.1, 1.9),
    AugOp("Contrast", contrast, 0.1, 1.9),
    AugOp("Brightness", brightness, 0.1, 1.9),
    AugOp("Sharpness", sharpness, 0.1, 1.9),
    AugOp("ShearX", shear_x, 0.0, 0.3),
    AugOp("ShearY", shear_y, 0.0, 0.3),
    AugOp("CutoutAbs", cutout_abs, 0, 40),
    AugOp("TranslateXabs", translate_x_abs, 0.0, 100),
    AugOp("TranslateYabs", translate_y_abs, 0.0, 100),
)


class RandAugment:
    """Dassl's ``RandAugment(n, m)`` on a PIL image or a uint8 ``[C, H, W]`` tensor (C = 1 or 3).

    Args:
        n: operations applied per image, drawn with replacement.
        m: magnitude, 0..30 (Dassl's scale; 10 in every Dassl-based trainer).

    Returns an image of the input's kind: PIL in, PIL out; a tensor (or ``tv_tensors.Image``) in,
    the same kind out.
    """

    def __init__(self, n: int = 2, m: float = 10):
        if n < 0:
            raise ValueError(f"RandAugment needs n >= 0 operations, got n={n}")
        if not 0 <= m <= MAX_MAGNITUDE:
            raise ValueError(f"RandAugment magnitude must be in [0, {MAX_MAGNITUDE}], got m={m}")
        self.n = n
        self.m = m
        self.ops = RANDAUGMENT_OPS

    def sample_ops(self) -> list[AugOp]:
        """The ``n`` operations for one image (uniform, with replacement)."""
        idx = torch.randint(len(self.ops), (self.n,)).tolist()
        return [self.ops[i] for i in idx]

    def __call__(self, img):
        if isinstance(img, Image.Image):
            return self._apply(img)
        if not isinstance(img, torch.Tensor):
            raise TypeError(f"RandAugment takes a PIL image or a tensor, got {type(img).__name__}")
        if img.dtype != torch.uint8 or img.ndim != 3 or img.shape[0] not in (1, 3):
            raise TypeError(
                "RandAugment takes a uint8 [C, H, W] tensor with C = 1 or 3, got "
                f"{img.dtype} {tuple(img.shape)}: place it before the conversion to float"
            )
        out = F.pil_to_tensor(self._apply(F.to_pil_image(img.as_subclass(torch.Tensor))))
        return tv_tensors.Image(out) if isinstance(img, tv_tensors.Image) else out

    def _apply(self, img: Image.Image) -> Image.Image:
        for op in self.sample_ops():
            img = op.fn(img, op.value(self.m))
        return img

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n={self.n}, m={self.m}, ops={len(self.ops)}, dassl)"
