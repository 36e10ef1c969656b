"""Dassl's RandAugment (``randaugment``): the op set, each op at magnitude 10, seeding."""

from __future__ import annotations

import math
import os.path as osp
import random

import numpy as np
import pytest
import torch
import torchvision.transforms.v2 as T
from PIL import Image, ImageEnhance, ImageOps
from torchvision import tv_tensors

import datasets  # noqa: F401  (registers the readers)
import trainers  # noqa: F401  (registers the trainers)
from engine.data import DataManager, build_transform
from engine.data.randaugment import CUTOUT_FILL, RANDAUGMENT_OPS, RandAugment

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
COPROMPT_CFG = "configs/trainers/CoPrompt/vit_b16_c2_ep8_batch4_2ctx.yaml"

# Dassl's randaugment_list(): name -> (low, high)
DASSL_LIST = {
    "AutoContrast": (0, 1),
    "Equalize": (0, 1),
    "Invert": (0, 1),
    "Rotate": (0, 30),
    "Posterize": (4, 8),
    "Solarize": (0, 256),
    "SolarizeAdd": (0, 110),
    "Color": (0.1, 1.9),
    "Contrast": (0.1, 1.9),
    "Brightness": (0.1, 1.9),
    "Sharpness": (0.1, 1.9),
    "ShearX": (0.0, 0.3),
    "ShearY": (0.0, 0.3),
    "CutoutAbs": (0, 40),
    "TranslateXabs": (0.0, 100),
    "TranslateYabs": (0.0, 100),
}
AT_M10 = {  # the values at m = 10, by hand: 10 / 30 * (high - low) + low
    "Rotate": 10.0,
    "Posterize": 4 + 4 / 3,
    "Solarize": 256 / 3,
    "SolarizeAdd": 110 / 3,
    "Color": 0.7,
    "Contrast": 0.7,
    "Brightness": 0.7,
    "Sharpness": 0.7,
    "ShearX": 0.1,
    "ShearY": 0.1,
    "CutoutAbs": 40 / 3,
    "TranslateXabs": 100 / 3,
    "TranslateYabs": 100 / 3,
}
OPS = {op.name: op for op in RANDAUGMENT_OPS}


def apply(name: str, img: Image.Image, seed: int = 0, m: float = 10) -> Image.Image:
    """Op ``name`` at magnitude ``m`` under a seeded torch generator."""
    op = OPS[name]
    torch.manual_seed(seed)
    return op.fn(img, op.value(m))


def photo(w: int = 48, h: int = 40, seed: int = 0) -> Image.Image:
    """A fixed, noisy RGB image with some structure."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 // w, yy * 255 // h, (xx + yy) * 255 // (w + h)], -1)
    noise = rng.integers(-30, 31, size=(h, w, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def ramp() -> Image.Image:
    """All 256 values, once per column, in each channel."""
    row = np.arange(256, dtype=np.uint8)
    return Image.fromarray(np.repeat(np.stack([row] * 3, -1)[None], 4, 0))


def line(w: int, h: int, vertical: bool) -> Image.Image:
    """Black image with a one-pixel white line through the middle."""
    a = np.zeros((h, w, 3), np.uint8)
    if vertical:
        a[:, w // 2] = 255
    else:
        a[h // 2, :] = 255
    return Image.fromarray(a)


def white_pixels(img: Image.Image) -> tuple[np.ndarray, np.ndarray]:
    ys, xs = np.nonzero(np.asarray(img)[..., 0] > 127)
    return ys, xs


def arr(img: Image.Image) -> np.ndarray:
    return np.asarray(img).astype(np.int64)


# ----------------------------------------------------------------------------------------------
# The list
# ----------------------------------------------------------------------------------------------
def test_op_set_is_dassls_sixteen():
    assert [op.name for op in RANDAUGMENT_OPS] == list(DASSL_LIST)
    assert {op.name: (op.low, op.high) for op in RANDAUGMENT_OPS} == DASSL_LIST
    names = set(OPS)
    assert "Identity" not in names and "Cutout" not in names  # absolute cutout only
    for name, value in AT_M10.items():
        assert OPS[name].value(10) == pytest.approx(value), name
    assert OPS["Posterize"].value(30) == 8 and OPS["Rotate"].value(0) == 0


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="magnitude"):
        RandAugment(2, 31)
    with pytest.raises(ValueError, match="n >= 0"):
        RandAugment(-1, 10)
    with pytest.raises(TypeError, match="before the conversion to float"):
        RandAugment()(torch.rand(3, 8, 8))
    assert "n=2, m=10" in repr(RandAugment())


# ----------------------------------------------------------------------------------------------
# Each op at magnitude 10
# ----------------------------------------------------------------------------------------------
def test_invert_autocontrast_equalize():
    img = photo()
    assert np.array_equal(arr(apply("Invert", img)), 255 - arr(img))
    assert np.array_equal(arr(apply("AutoContrast", img)), arr(ImageOps.autocontrast(img)))
    assert np.array_equal(arr(apply("Equalize", img)), arr(ImageOps.equalize(img)))
    dull = Image.fromarray((arr(img) // 4 + 60).astype(np.uint8))  # values 60..123
    stretched = arr(apply("AutoContrast", dull))
    assert stretched.min() == 0 and stretched.max() == 255


def test_solarize_threshold_85():
    x = np.arange(256)
    out = arr(apply("Solarize", ramp()))[0, :, 0]
    assert np.array_equal(out, np.where(x <= 85, x, 255 - x))


def test_solarize_add():
    x = np.arange(256)
    out = arr(apply("SolarizeAdd", ramp()))[0, :, 0]
    y = np.minimum(255, np.floor(x + 110 / 3)).astype(np.int64)
    assert np.array_equal(out, np.where(y < 128, y, 255 - y))
    # spot values: +36.67 truncated, then values >= 128 inverted
    assert [out[i] for i in (0, 91, 92, 218, 219, 255)] == [36, 127, 127, 1, 0, 0]


def test_posterize_keeps_5_bits():
    x = np.arange(256)
    out = arr(apply("Posterize", ramp()))[0, :, 0]
    assert np.array_equal(out, x & 0b11111000)


@pytest.mark.parametrize("name", ["Color", "Contrast", "Brightness", "Sharpness"])
def test_enhance_factor_0_7(name):
    img = photo()
    expected = getattr(ImageEnhance, name)(img).enhance(0.7)
    out = apply(name, img)
    assert np.array_equal(arr(out), arr(expected))
    assert not np.array_equal(arr(out), arr(img))
    if name == "Brightness":
        assert np.abs(arr(out) - 0.7 * arr(img)).max() <= 1


def _signs(name: str, img: Image.Image, plus: Image.Image, minus: Image.Image) -> set[int]:
    """The signs the op took over 16 seeds; each output must be one of the two."""
    signs = set()
    for seed in range(16):
        out = arr(apply(name, img, seed))
        if np.array_equal(out, arr(plus)):
            signs.add(1)
        elif np.array_equal(out, arr(minus)):
            signs.add(-1)
        else:
            raise AssertionError(f"{name}: seed {seed} gave neither sign")
    return signs


@pytest.mark.parametrize(
    "name, vertical, axis", [("TranslateXabs", True, 1), ("TranslateYabs", False, 0)]
)
@pytest.mark.parametrize("size", [72, 160])
def test_translate_33_pixels_absolute(name, vertical, axis, size):
    img = line(size, size, vertical)
    before = white_pixels(img)[axis][0]
    shifts = set()
    for seed in range(16):
        after = white_pixels(apply(name, img, seed))[axis]
        assert len(set(after)) == 1 and len(after) == size  # still a full straight line
        shifts.add(int(after[0]) - int(before))
    assert shifts == {-33, 33}  # the same 33 px whatever the image size, both directions
    # outside the shifted image: black (no wrap-around)
    out = arr(apply(name, photo(64, 64), 0))
    edge = out[:, -33:] if axis == 1 else out[-33:]
    edge2 = out[:, :33] if axis == 1 else out[:33]
    assert edge.max() == 0 or edge2.max() == 0


def test_rotate_10_degrees_both_signs():
    img = line(101, 101, vertical=False)
    angles = set()
    for seed in range(16):
        ys, xs = white_pixels(apply("Rotate", img, seed))
        slope = np.polyfit(xs, ys, 1)[0]
        angles.add(round(math.degrees(math.atan(-slope))))  # image y points down
    assert angles == {-10, 10}
    assert _signs("Rotate", photo(), photo().rotate(10), photo().rotate(-10)) == {1, -1}


@pytest.mark.parametrize("name, vertical", [("ShearX", True), ("ShearY", False)])
def test_shear_0_1_both_signs(name, vertical):
    img = line(81, 81, vertical)
    slopes = set()
    for seed in range(16):
        ys, xs = white_pixels(apply(name, img, seed))
        # ShearX: x = c - s * y (a line leaning by s); ShearY: y = c - s * x
        slope = np.polyfit(ys, xs, 1)[0] if vertical else np.polyfit(xs, ys, 1)[0]
        slopes.add(round(float(slope), 2))
    assert slopes == {-0.1, 0.1}
    coeffs = {"ShearX": (1, 0.1, 0, 0, 1, 0), "ShearY": (1, 0, 0, 0.1, 1, 0)}[name]
    neg = tuple(-c if c == 0.1 else c for c in coeffs)
    p = photo()
    plus = p.transform(p.size, Image.Transform.AFFINE, coeffs)
    minus = p.transform(p.size, Image.Transform.AFFINE, neg)
    assert _signs(name, p, plus, minus) == {1, -1}


def test_cutout_paints_a_13px_gray_square():
    img = Image.new("RGB", (64, 64), (200, 10, 50))
    sides = set()
    for seed in range(40):
        out = arr(apply("CutoutAbs", img, seed))
        gray = (out == CUTOUT_FILL).all(-1)
        ys, xs = np.nonzero(gray)
        assert len(ys) > 0
        h, w = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
        assert gray.sum() == h * w  # one filled rectangle
        assert (out[~gray] == (200, 10, 50)).all()  # nothing else changed
        assert h <= 14 and w <= 14
        inside = ys.min() > 0 and xs.min() > 0 and ys.max() < 63 and xs.max() < 63
        if inside:
            sides.add((int(h), int(w)))
    assert sides == {(14, 14)}  # 13.33 px: corner truncated, far edge inclusive


# ----------------------------------------------------------------------------------------------
# The transform
# ----------------------------------------------------------------------------------------------
def test_ops_drawn_uniformly_with_replacement():
    ra = RandAugment(2, 10)
    torch.manual_seed(0)
    draws = [ra.sample_ops() for _ in range(3200)]
    assert all(len(d) == 2 for d in draws)
    counts = {name: 0 for name in DASSL_LIST}
    for d in draws:
        for op in d:
            counts[op.name] += 1
    assert min(counts.values()) > 300 and max(counts.values()) < 500  # 400 expected
    repeats = sum(a.name == b.name for a, b in draws)
    assert 130 < repeats < 270  # 200 expected (1/16): with replacement, as random.choices


def test_reproducible_under_torch_seed_only():
    img = photo(64, 64)
    ra = RandAugment(2, 10)

    def run(seed, py_seed):
        random.seed(py_seed)  # Python's and numpy's global states must not matter
        np.random.seed(py_seed)
        torch.manual_seed(seed)
        return [arr(ra(img)) for _ in range(8)]

    a, b, c = run(1, 0), run(1, 99), run(2, 0)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    assert not all(np.array_equal(a[0], x) for x in a[1:])  # fresh draws per call


def test_tensor_and_pil_inputs_agree():
    img = photo(64, 64)
    ra = RandAugment(2, 10)
    tensor = tv_tensors.Image(torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1))
    for seed in range(6):
        torch.manual_seed(seed)
        out_pil = ra(img)
        torch.manual_seed(seed)
        out_t = ra(tensor)
        assert isinstance(out_pil, Image.Image) and isinstance(out_t, tv_tensors.Image)
        assert out_t.dtype == torch.uint8 and out_t.shape == (3, 64, 64)
        assert np.array_equal(out_t.permute(1, 2, 0).numpy(), np.asarray(out_pil))
    plain = ra(tensor.as_subclass(torch.Tensor))
    assert type(plain) is torch.Tensor
    gray = ra(torch.full((1, 16, 16), 90, dtype=torch.uint8))
    assert gray.shape == (1, 16, 16)


# ----------------------------------------------------------------------------------------------
# Pipelines built from a config
# ----------------------------------------------------------------------------------------------
def cfg_from(opts=(), config_file=None, trainer="CoOp"):
    from engine.cli import build_parser, setup_cfg

    args = [
        "--trainer",
        trainer,
        "--dataset-config-file",
        osp.join(ROOT, "configs/datasets/dtd.yaml"),
    ]
    if config_file:
        args += ["--config-file", osp.join(ROOT, config_file)]
    return setup_cfg(build_parser().parse_args(args + list(opts)))


def _kinds(tfm) -> list[type]:
    return [type(t) for t in tfm.transforms]


def test_transform_names():
    dassl = build_transform(cfg_from(["INPUT.TRANSFORMS", "['randaugment', 'normalize']"]))
    assert RandAugment in _kinds(dassl) and T.RandAugment not in _kinds(dassl)
    ra = next(t for t in dassl.transforms if isinstance(t, RandAugment))
    assert (ra.n, ra.m) == (2, 10)
    tv = build_transform(
        cfg_from(["INPUT.TRANSFORMS", "['randaugment_tv']", "INPUT.RANDAUGMENT_M", "7"])
    )
    assert T.RandAugment in _kinds(tv) and RandAugment not in _kinds(tv)
    assert next(t for t in tv.transforms if isinstance(t, T.RandAugment)).magnitude == 7
    out = dassl(photo(300, 260))
    assert out.dtype == torch.float32 and out.shape == (3, 224, 224)


def test_coprompt_views_use_dassls_randaugment(dtd_root):
    opts = ["--root", dtd_root, "--seed", "5", "INPUT.SIZE", "(32, 32)"]
    opts += ["DATALOADER.TRAIN_X.BATCH_SIZE", "4"]

    def first_batch(workers):
        cfg = cfg_from(
            [*opts, "DATALOADER.NUM_WORKERS", str(workers)], COPROMPT_CFG, trainer="CoPrompt"
        )
        assert cfg.DATALOADER.K_TRANSFORMS == 2
        assert tuple(cfg.INPUT.TRANSFORMS) == ("randaugment", "normalize")
        dm = DataManager(cfg)
        assert RandAugment in _kinds(dm.train_loader_x.dataset.transform)
        return next(iter(dm.train_loader_x))

    a, b = first_batch(0), first_batch(1)
    assert isinstance(a["img"], list) and len(a["img"]) == 2
    assert a["img"][0].shape == (4, 3, 32, 32)
    assert not torch.equal(a["img"][0], a["img"][1])  # two different views
    # the same views whatever the number of workers (per-sample seeding)
    assert torch.equal(a["index"], b["index"])
    assert all(torch.equal(x, y) for x, y in zip(a["img"], b["img"]))
