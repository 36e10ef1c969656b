"""SmallWorld: a procedurally generated image-text world for demos and fast optimizer research.

Each 32x32 image shows one shape (circle, square, triangle, star, cross, ring, diamond, heart)
in one colour (red, green, blue, yellow, purple, orange, pink, brown) with a random size,
position and rotation, on a dark or light tinted background with a gradient, pixel noise and
occasional grey clutter strokes. The 64 classes are "<colour> <shape>".

Two renderings of the same world exist:

- the *canonical* world (true colours), which ``tools/pretrain_small_clip.py`` renders on the
  fly to pretrain a small CLIP on captions;
- the *downstream* dataset written to disk (the reader below), photographed "by another camera":
  the hue of every image is rotated by :data:`HUE_SHIFT` degrees. The shift is colour-specific,
  so prompts learned on some colours do not transfer to others, which gives the base-to-new
  behaviour of real CLIP (base accuracy rises, new accuracy stays or drops).

Labels are colour-major in the order of :data:`COLOURS`, so the base half (the first 32 labels)
holds the shapes of red, green, blue and yellow and the new half those of purple, orange, pink
and brown: base and new classes share no colour word.

Layout (CoOp style): ``ROOT/small_world/images/<colour>_<shape>/<colour>_<shape>_<i>.png``,
``ROOT/small_world/split_small_world.json`` and ``ROOT/small_world/world.json`` (the generation
settings). The reader generates the folder with the default settings on first use (about 5 s);
``tools/make_small_world.py`` generates it explicitly with other settings. Generation is
deterministic: the same seed and settings give byte-identical files.
"""

from __future__ import annotations

import json
import logging
import os
import os.path as osp
import shutil
import tempfile
from dataclasses import dataclass

import numpy as np
from PIL import Image

from engine.registry import DATASET_REGISTRY

from .common import CoOpDataset, Layout

logger = logging.getLogger(__name__)

# colour name -> RGB; the order defines the labels (base colours first)
COLOURS = {
    "red": (215, 35, 35),
    "green": (45, 165, 55),
    "blue": (40, 75, 215),
    "yellow": (235, 215, 40),
    "purple": (125, 50, 175),
    "orange": (240, 135, 25),
    "pink": (240, 135, 185),
    "brown": (125, 78, 38),
}
SHAPES = ("circle", "square", "triangle", "star", "cross", "ring", "diamond", "heart")
CLASSNAMES = [f"{c} {s}" for c in COLOURS for s in SHAPES]  # index = label

IMAGE_SIZE = 32  # pixels
SUPERSAMPLE = 4  # shapes are drawn at 4x and averaged down (anti-aliasing)
RADIUS_RANGE = (4.5, 12.5)  # shape radius in pixels
HUE_SHIFT = 30.0  # degrees of hue rotation of the downstream dataset
DEFAULT_SEED = 0
DEFAULT_COUNTS = {"train": 32, "val": 8, "test": 100}  # images per class and split
WORLD_VERSION = 1  # bump when the renderer changes (world.json records it)
# random stream of the dataset files: SeedSequence([seed, DATASET_STREAM + WORLD_VERSION]);
# tools/pretrain_small_clip.py draws its images and captions from streams 1 and 2
DATASET_STREAM = 1000

DATASET_FOLDER = "small_world"
SPLIT_FILE = "split_small_world.json"
META_FILE = "world.json"


@dataclass(frozen=True)
class Scene:
    """The attributes of one image (what a caption may mention).

    Attributes:
        colour, shape: indices into COLOURS and SHAPES.
        radius: shape radius in pixels.
        cx, cy: centre in pixels (x to the right, y down).
        angle: rotation in radians.
        dark: dark (True) or light background.
    """

    colour: int
    shape: int
    radius: float
    cx: float
    cy: float
    angle: float
    dark: bool

    @property
    def label(self) -> int:
        return self.colour * len(SHAPES) + self.shape


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------
_N = IMAGE_SIZE * SUPERSAMPLE
_GRID = (np.arange(_N, dtype=np.float32) + 0.5) / SUPERSAMPLE  # sub-pixel centres in pixels
_STAR_INNER = 0.45  # inner/outer radius of the star
# the star's edge from the outer vertex (0, 1) to the next inner vertex, as a half-plane
_STAR_A = np.array([0.0, 1.0])
_STAR_B = _STAR_INNER * np.array([np.sin(np.pi / 5), np.cos(np.pi / 5)])
_STAR_N = np.array([_STAR_B[1] - _STAR_A[1], _STAR_A[0] - _STAR_B[0]])  # normal of A->B


def _shape_mask(shape: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Inside test in unit coordinates (radius 1, y up) -> bool array."""
    if shape == "circle":
        return x * x + y * y <= 1.0
    if shape == "ring":
        r2 = x * x + y * y
        return (r2 <= 1.0) & (r2 >= 0.55**2)
    if shape == "square":
        return np.maximum(np.abs(x), np.abs(y)) <= 0.8
    if shape == "diamond":
        return np.abs(x) + np.abs(y) <= 1.0
    if shape == "cross":
        ax, ay = np.abs(x), np.abs(y)
        return ((ax <= 0.3) & (ay <= 0.95)) | ((ay <= 0.3) & (ax <= 0.95))
    if shape == "triangle":  # equilateral, inscribed in the unit circle, pointing up
        inside = -y <= 0.5
        for deg in (30.0, 150.0):
            t = np.deg2rad(deg)
            inside &= x * np.cos(t) + y * np.sin(t) <= 0.5
        return inside
    if shape == "star":  # fold the angle into one tip's half-sector, test one edge
        sector = 2 * np.pi / 5
        theta = np.mod(np.arctan2(x, y), sector)  # angle from "up", clockwise
        theta = np.minimum(theta, sector - theta)  # mirror into [0, sector / 2]
        r = np.hypot(x, y)
        px, py = r * np.sin(theta), r * np.cos(theta)
        return (px - _STAR_A[0]) * _STAR_N[0] + (py - _STAR_A[1]) * _STAR_N[1] >= 0.0
    if shape == "heart":  # (x^2 + y^2 - 1)^3 - x^2 y^3 <= 0, scaled into the unit circle
        hx, hy = 1.25 * x, 1.25 * y + 0.15
        return (hx * hx + hy * hy - 1.0) ** 3 - hx * hx * hy**3 <= 0.0
    raise ValueError(f"Unknown shape {shape!r}; shapes: {', '.join(SHAPES)}")


def _downsample(mask: np.ndarray) -> np.ndarray:
    """``[h * k, w * k]`` supersampled mask -> ``[h, w]`` coverage in [0, 1]."""
    k = SUPERSAMPLE
    h, w = mask.shape[0] // k, mask.shape[1] // k
    return mask.reshape(h, k, w, k).mean(axis=(1, 3), dtype=np.float32)  # [h, w]


def sample_scene(rng: np.random.Generator, label: int) -> Scene:
    """Random size, position, rotation and background for a class label."""
    colour, shape = divmod(int(label), len(SHAPES))
    radius = float(rng.uniform(*RADIUS_RANGE))
    margin = radius * 0.8
    cx, cy = (float(v) for v in rng.uniform(margin, IMAGE_SIZE - margin, size=2))
    angle = float(rng.uniform(-0.35, 0.35))
    return Scene(colour, shape, radius, cx, cy, angle, bool(rng.random() < 0.5))


def _background(rng: np.random.Generator, dark: bool) -> np.ndarray:
    """A tinted two-colour linear gradient ``[S, S, 3]`` in float RGB (0-255)."""
    level = rng.uniform(15, 70) if dark else rng.uniform(175, 240)
    c1 = level + rng.normal(0, 10, size=3)
    c2 = c1 + rng.uniform(-35, 35) + rng.normal(0, 6, size=3)
    t = rng.uniform(0, 2 * np.pi)
    coords = (np.arange(IMAGE_SIZE, dtype=np.float32) + 0.5) / IMAGE_SIZE - 0.5
    ramp = np.cos(t) * coords[None, :] + np.sin(t) * coords[:, None] + 0.5  # [S, S]
    return c1 + (c2 - c1) * ramp[..., None]  # [S, S, 3]


def _clutter(rng: np.random.Generator) -> np.ndarray:
    """Coverage ``[S, S]`` of 1-2 thin random strokes."""
    mask = np.zeros((_N, _N), dtype=bool)
    for _ in range(int(rng.integers(1, 3))):
        p, q = rng.uniform(0, IMAGE_SIZE, size=(2, 2))
        d = q - p
        gx, gy = _GRID[None, :] - p[0], _GRID[:, None] - p[1]  # [1, N], [N, 1]
        t = np.clip((gx * d[0] + gy * d[1]) / max(float(d @ d), 1e-6), 0.0, 1.0)
        mask |= np.hypot(gx - t * d[0], gy - t * d[1]) <= rng.uniform(0.3, 0.7)
    return _downsample(mask)


def _shape_coverage(scene: Scene) -> np.ndarray:
    """Anti-aliased coverage ``[S, S]`` of the scene's shape (drawn in its bounding box only)."""
    k, half = SUPERSAMPLE, 1.25 * scene.radius + 1.0
    x0, x1 = max(0, int(scene.cx - half)), min(IMAGE_SIZE, int(np.ceil(scene.cx + half)))
    y0, y1 = max(0, int(scene.cy - half)), min(IMAGE_SIZE, int(np.ceil(scene.cy + half)))
    c, s = np.cos(scene.angle), np.sin(scene.angle)
    gx = (_GRID[None, x0 * k : x1 * k] - scene.cx) / scene.radius  # [1, w * k]
    gy = (scene.cy - _GRID[y0 * k : y1 * k, None]) / scene.radius  # [h * k, 1], y up
    x, y = c * gx + s * gy, c * gy - s * gx  # rotated unit coordinates, [h * k, w * k]
    coverage = np.zeros((IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    coverage[y0:y1, x0:x1] = _downsample(_shape_mask(SHAPES[scene.shape], x, y))
    return coverage


def render(scene: Scene, rng: np.random.Generator) -> np.ndarray:
    """Render one scene: uint8 RGB ``[S, S, 3]`` in the canonical (true-colour) world."""
    img = _background(rng, scene.dark)
    if rng.random() < 0.3:
        grey = rng.uniform(60, 200) + rng.normal(0, 8, size=3)
        alpha = _clutter(rng)[..., None] * rng.uniform(0.3, 0.7)
        img = img * (1 - alpha) + grey * alpha
    alpha = _shape_coverage(scene)[..., None]  # [S, S, 1]
    rgb = np.array(list(COLOURS.values())[scene.colour], dtype=np.float32)
    rgb = rgb * rng.uniform(0.85, 1.1) + rng.normal(0, 8, size=3)
    img = img * (1 - alpha) + rgb * alpha
    img = img + rng.normal(0, rng.uniform(2, 8), size=img.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def rotate_hue(images: np.ndarray, degrees: float) -> np.ndarray:
    """Rotate the HSV hue of uint8 RGB images ``[..., 3]`` by ``degrees`` (exact HSV round trip).

    Saturation and value are unchanged; greys stay grey.
    """
    if degrees % 360 == 0:
        return images
    rgb = images.astype(np.float32) / 255.0
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    vmax, vmin = rgb.max(-1), rgb.min(-1)
    delta = vmax - vmin
    safe = np.where(delta > 0, delta, 1.0)
    hue = np.where(
        vmax == r, (g - b) / safe, np.where(vmax == g, 2.0 + (b - r) / safe, 4.0 + (r - g) / safe)
    )
    hue = np.mod(hue + degrees / 60.0, 6.0)  # sextants
    # HSV -> RGB: channel k = v - delta * clip(min(m, 4 - m), 0, 1), m = (k' + h) mod 6
    out = np.empty_like(rgb)
    for i, k in enumerate((5.0, 3.0, 1.0)):
        m = np.mod(k + hue, 6.0)
        out[..., i] = vmax - delta * np.clip(np.minimum(m, 4.0 - m), 0.0, 1.0)
    return np.clip(np.rint(out * 255.0), 0, 255).astype(np.uint8)


def render_batch(
    labels, rng: np.random.Generator, hue_shift: float = 0.0
) -> tuple[np.ndarray, list[Scene]]:
    """Render one image per label: uint8 ``[n, S, S, 3]`` and the scenes (for captions)."""
    scenes = [sample_scene(rng, label) for label in labels]  # all scenes first, then pixels
    images = np.zeros((len(scenes), IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    for i, scene in enumerate(scenes):
        images[i] = render(scene, rng)
    return rotate_hue(images, hue_shift), scenes


# ----------------------------------------------------------------------------------------------
# The dataset folder
# ----------------------------------------------------------------------------------------------
def folder_name(label: int) -> str:
    return CLASSNAMES[label].replace(" ", "_")


def generate_small_world(
    root: str,
    seed: int = DEFAULT_SEED,
    counts: dict[str, int] | None = None,
    hue_shift: float = HUE_SHIFT,
    overwrite: bool = False,
) -> str:
    """Write the downstream dataset to ``root/small_world`` and return that folder.

    Args:
        root: the dataset root (DATASET.ROOT).
        seed: generation seed; the same seed and settings give byte-identical files.
        counts: images per class for "train", "val" and "test" (default DEFAULT_COUNTS).
        hue_shift: hue rotation (degrees) of every image (the downstream "camera").
        overwrite: replace an existing folder (otherwise an existing folder raises).

    The folder is written under a temporary name and renamed when complete, so readers never
    see a half-written dataset.
    """
    counts = {**DEFAULT_COUNTS, **(counts or {})}
    for split, n in counts.items():
        if split not in DEFAULT_COUNTS or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"counts must map train/val/test to positive ints (images per class); "
                f"got {split}={n!r}"
            )
    root = osp.abspath(osp.expanduser(root))
    target = osp.join(root, DATASET_FOLDER)
    if osp.exists(target) and not overwrite:
        raise FileExistsError(
            f"{target} exists; pass overwrite=True (--force) to regenerate it or choose another "
            "root"
        )
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{DATASET_FOLDER}-", dir=root)
    try:
        _write_dataset(tmp, seed, counts, hue_shift)
        if overwrite and osp.exists(target):
            shutil.rmtree(target)
        try:
            os.replace(tmp, target)
        except OSError:
            if overwrite or not osp.isdir(target):
                raise
            # another process generated the same folder meanwhile: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("Generated SmallWorld (seed %d, %s per class) in %s", seed, counts, target)
    return target


def _write_dataset(folder: str, seed: int, counts: dict[str, int], hue_shift: float) -> None:
    rng = np.random.default_rng([seed, DATASET_STREAM + WORLD_VERSION])
    image_dir = osp.join(folder, "images")
    split = {name: [] for name in DEFAULT_COUNTS}
    n_per_class = sum(counts.values())
    for label, classname in enumerate(CLASSNAMES):
        cls_dir = osp.join(image_dir, folder_name(label))
        os.makedirs(cls_dir)
        images, _ = render_batch([label] * n_per_class, rng, hue_shift)
        index = 0
        for name in DEFAULT_COUNTS:  # train, val, test
            for _ in range(counts[name]):
                relpath = f"{folder_name(label)}/{folder_name(label)}_{index:04d}.png"
                Image.fromarray(images[index]).save(osp.join(image_dir, relpath))
                split[name].append([relpath, label, classname])
                index += 1
    meta = {
        "version": WORLD_VERSION,
        "seed": seed,
        "counts": counts,
        "hue_shift": hue_shift,
        "classnames": CLASSNAMES,
    }
    with open(osp.join(folder, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    with open(osp.join(folder, SPLIT_FILE), "w") as f:
        json.dump(split, f)


LAYOUT = Layout(
    name="SmallWorld",
    folder=DATASET_FOLDER,
    required=("images/", SPLIT_FILE),
    split_file=SPLIT_FILE,
    class_dirs=("images",),
    num_classes=len(CLASSNAMES),
    how=(
        "SmallWorld is generated, not downloaded: `python tools/make_small_world.py --root "
        "DATA` writes it (about 5 s), and a reader run on a DATASET.ROOT without a small_world/ "
        "folder generates it with the default settings. A folder without its split file is "
        "incomplete: delete it or regenerate it with --force."
    ),
)


@DATASET_REGISTRY.register()
class SmallWorld(CoOpDataset):
    """The SmallWorld downstream dataset (64 classes; base = red/green/blue/yellow shapes).

    Generated with the default settings into ``DATASET.ROOT/small_world`` when that folder does
    not exist; an existing folder is read as it is (see ``tools/make_small_world.py``).
    """

    layout = LAYOUT
    image_subdir = "images"

    @classmethod
    def layout_for(cls, cfg):
        """None: a missing folder is generated at start-up, not an error."""
        return None

    def __init__(self, cfg):
        if not cfg.DATASET.ROOT:
            raise ValueError(
                "SmallWorld: DATASET.ROOT is empty; pass --root FOLDER (the dataset is generated "
                f"into FOLDER/{DATASET_FOLDER} on first use)"
            )
        if not osp.exists(LAYOUT.dir(cfg.DATASET.ROOT)):
            logger.info("SmallWorld not found in %s: generating it", cfg.DATASET.ROOT)
            generate_small_world(cfg.DATASET.ROOT)
        super().__init__(cfg)
