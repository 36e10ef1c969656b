"""SkipTuning: layer-wise and class-wise skipping of CLIP's full fine-tune (Wu et al., CVPR 2025).

"Skip Tuning: Pre-trained Vision-Language Models are Effective and Efficient Adapters
Themselves"; the authors' code is Koorye/SkipTuning (compared against at commit 8c4636e,
tests/test_skiptuning.py). Nothing is added to CLIP: the last ``L - s`` blocks of both towers
and their heads are fine-tuned, with ``s = TRAINER.SKIP.START_LAYER`` (6 of ViT-B/16's 12):

- **layer-wise skipping (LSkip)**: the first ``s`` blocks, the embeddings (token, positional,
  class), the patch convolution and ``ln_pre`` stay frozen, so their outputs are computed
  without gradients once per epoch: every training image (with a fresh augmentation each epoch)
  and every class prompt go through them in ``QUICK_BATCH_SIZE`` batches, and the steps train
  the upper blocks on these features. Trained: image blocks ``s..L-1``, ``ln_post``, ``proj``;
  text blocks ``s..L-1``, ``ln_final``, ``text_projection``. ``logit_scale`` stays frozen.
- **class-wise skipping (CSkip)**: a step's text tower runs only for ``K'`` of the ``C``
  classes. With ``K = min(ceil(TOP_RATIO * C), MAX_TOP)`` (``TOP_RATIO > 1``: ``ceil(min(TOP_RATIO,
  C))``), classes are ranked by their largest cosine over the batch between the step's image
  features and the class prototypes (the initial CLIP's normalised text features), the batch's
  labels first; the top ``K`` ranks are kept, and rank ``K + j`` with the probability
  ``p_j = (f(x_j) - f_min) / (f_max - f_min)``, ``f`` the exponential density with scale
  ``LAMBDA`` at ``x_j = linspace(0, 5, C - K)_j``. The mask over ranks is drawn once per run;
  the kept classes are used in class-index order and the labels are re-indexed among them
  (``one_hot(label)[:, kept].argmax``). ``TOP_RATIO 1`` or ``K = C`` keeps every class.
- the loss is the cross-entropy of ``logit_scale.exp() * cos(image, text)`` over the kept
  classes; evaluation runs both towers whole on every class (base and new classes alike: the
  tuned text tower encodes the new classes' prompts, the dataset's hand-crafted template
  :data:`SKIP_TEMPLATES`).
- the step's batches are those of the authors' feature loader: with ``DATASET.NUM_SHOTS >= 4``
  every batch holds ``BATCH_SIZE`` images of one class (a random class, then a random sample of
  its remaining images, until no class has a full batch left); otherwise random disjoint
  batches of any classes (the remainder dropped). ``DROP_RATIO > 0`` drops a uniform
  ``[0, DROP_RATIO)`` share of the image tokens (any position) before the upper blocks.
- ImageNet, SUN397 and Food101 train ``MAX_EPOCH / EPOCH_DIVISOR`` (4) epochs
  (``LARGE_DATASETS``), as the authors' trainer does to every config it runs; the run's log
  says so.
- ``OPTIM.STAGED_LR True``: the image tower's layers train at ``TRAINER.SKIP.NEW_LR`` and the
  text tower's at ``OPTIM.LR`` (the authors' ``OPTIM.NEW_LR`` with ``NEW_LAYERS
  ['image_encoder']``; their files' ``OPTIM.NEW_LR`` is read as ``TRAINER.SKIP.NEW_LR``).

Differences from the authors' code, all deliberate:

- precision ``fp16`` keeps the frozen part in half precision and the tuned layers in fp32 (the
  project's rule: learnable parameters and optimizer arithmetic in fp32; the authors' fp16 mode
  updated half-precision weights in place); ``amp``/``bf16`` autocast fp32 weights;
- the class prompts are cut after their last EOT (exact; engine/clip/text.py) and their frozen
  lower-block states are computed once (the authors recomputed them every epoch: the same
  numbers);
- the random draws come from generators seeded by the run seed (Python's ``random.Random`` for
  the batches and the drop share, a torch generator for the dropped tokens and the rank mask);
  the class prototypes are those of the CLIP as loaded, so a resumed run chooses as the
  uninterrupted one (the authors' resume took them from the resumed weights);
- the step's class choice is made by its first pass and kept for the step's other passes (a
  sharpness-aware optimizer's second pass, ESAM's subsets, MESA's teacher, which runs first), so
  every pass of a step evaluates the same objective. SAF is refused while classes are skipped:
  its trajectory term compares an item's logits over the same classes across epochs, and a
  step's logits cover a per-step subset;
- one process only (data-parallel runs are refused: the class choice ranks classes over the
  whole batch);
- checkpoints hold the tuned tensors only (the authors' held both encoders whole), under the
  authors' key names (``learnable_params/``: ``text_encoder.transformer.resblocks.<i>...``), so
  an authors' checkpoint loads for evaluation.
"""

from __future__ import annotations

import logging
import math
import random
from typing import NamedTuple

import torch
from torch import nn

from engine import distributed
from engine.clip import BackboneError, TextEncoder, clip_dtype, load_clip, require_vit, tokenize
from engine.clip.model import BackboneRefused, backbone_label, vision_tower_kind
from engine.clip.text import keeps_full_length, truncate_tokens
from engine.clip.vision import PromptedVisionEncoder
from engine.data.manager import DatasetWrapper, EpochSampler
from engine.errors import CheckpointError, ConfigError
from engine.registry import TRAINER_REGISTRY
from engine.trainer import TrainerX
from engine.utils import compute_accuracy, epoch_seed
from optim import build_lr_scheduler, build_optimizer

from .common import TextOnceEvaluation, l2_normalize, load_init_weights
from .maple import VIT_BACKBONES
from .zsclip import DEFAULT_TEMPLATE

logger = logging.getLogger(__name__)

# The authors' hand-crafted templates (their fine-tuning baseline's, which SkipTuning inherits)
SKIP_TEMPLATES = {
    "ImageNet": "a photo of a {}.",
    "ImageNetV2": "a photo of a {}.",
    "ImageNetSketch": "a sketch of a {}.",
    "ImageNetA": "a bad photo of a {}.",
    "ImageNetR": "a rendition of a {}.",
    "Caltech101": "itap of a {}.",
    "DescribableTextures": "itap of a {}.",
    "EuroSAT": "a centered satellite photo of {}.",
    "FGVCAircraft": "a bright photo of a {}, a type of aircraft.",
    "Food101": "a photo of the nice {}.",
    "OxfordFlowers": "a close-up photo of a {}.",
    "OxfordPets": "a bad photo of a {}, a type of pet.",
    "SUN397": "a photo of a {}.",
    "StanfordCars": "a photo of the {}, a type of car.",
    "UCF101": "a photo of a {}, a type of sport.",
}
LABEL_FIRST = 1e4  # the similarity that ranks a batch label's class first (the authors' value)
RANK_SPAN = 5.0  # the exponential density is read on linspace(0, RANK_SPAN, C - K)


def add_skiptuning_config(cfg) -> None:
    """TRAINER.SKIP keys (the authors' names and defaults)."""
    from yacs.config import CfgNode as CN

    cfg.TRAINER.SKIP = CN()
    cfg.TRAINER.SKIP.START_LAYER = 6  # blocks 0..START_LAYER-1 of both towers are frozen
    cfg.TRAINER.SKIP.TOP_RATIO = 0.5  # K = ceil(TOP_RATIO * C) classes always kept (>1: a count)
    cfg.TRAINER.SKIP.MAX_TOP = 50  # at most this many always-kept classes
    cfg.TRAINER.SKIP.LAMBDA = 0.3  # scale of the exponential keep probability of ranks > K
    cfg.TRAINER.SKIP.DROP_RATIO = 0.0  # drop a uniform [0, DROP_RATIO) share of image tokens
    cfg.TRAINER.SKIP.QUICK_BATCH_SIZE = 128  # images per batch of the per-epoch feature pass
    cfg.TRAINER.SKIP.NEW_LR = 0.0003  # with OPTIM.STAGED_LR: the image tower's LR
    cfg.TRAINER.SKIP.EPOCH_DIVISOR = 4  # LARGE_DATASETS train MAX_EPOCH / EPOCH_DIVISOR epochs
    cfg.TRAINER.SKIP.LARGE_DATASETS = ["ImageNet", "SUN397", "Food101"]
    cfg.TRAINER.SKIP.PREC = "fp16"  # fp32 | fp16 (frozen part half, tuned fp32) | amp | bf16


def skip_template(dataset_name: str, template: str = "") -> str:
    """The hand-crafted template of a dataset (``DATASET.TEMPLATE`` when set)."""
    return template or SKIP_TEMPLATES.get(dataset_name, DEFAULT_TEMPLATE)


def num_top_classes(n_cls: int, top_ratio: float, max_top: int) -> int:
    """``K``: the number of always-kept classes of ``n_cls``."""
    k = math.ceil(top_ratio * n_cls) if top_ratio <= 1.0 else math.ceil(min(top_ratio, n_cls))
    return min(k, max_top)


def keep_probabilities(n_cls: int, n_top: int, lam: float) -> torch.Tensor:
    """``[n_cls]`` fp32 keep probability of each rank: 1 for the first ``n_top``, then the
    min-max normalised exponential density (scale ``lam``) on ``linspace(0, 5, n_cls - n_top)``
    (evaluated in float64, as scipy's ``expon.pdf``)."""
    x = torch.linspace(0.0, RANK_SPAN, steps=n_cls - n_top).double()
    pdf = torch.exp(-(x / lam)) / lam
    pdf = (pdf - pdf.min()) / (pdf.max() - pdf.min())
    return torch.cat([torch.ones(n_top, dtype=torch.float64), pdf]).float()


def select_classes(
    image_features: torch.Tensor,
    label: torch.Tensor,
    prototypes: torch.Tensor,
    rank_mask: torch.Tensor,
) -> torch.Tensor:
    """The kept classes of a step, in class-index order (``[K']``).

    Args:
        image_features: ``[batch, dim]`` (any scale; normalised here).
        label: ``[batch]``.
        prototypes: ``[n_cls, dim]`` normalised class prototypes.
        rank_mask: ``[n_cls]`` bool, which ranks are kept.
    """
    sim = l2_normalize(image_features.float()) @ prototypes.float().t()  # [batch, n_cls]
    sim[torch.arange(sim.shape[0], device=sim.device), label] = LABEL_FIRST
    best, _ = sim.max(dim=0)  # [n_cls]
    _, order = best.sort(descending=True)
    kept, _ = order[rank_mask.to(order.device)].sort()
    return kept


def relabel(label: torch.Tensor, classes: torch.Tensor, n_cls: int) -> torch.Tensor:
    """Labels as indices into ``classes`` (the authors' ``one_hot(label)[:, classes].argmax``:
    a label whose class was not kept becomes 0)."""
    onehot = torch.nn.functional.one_hot(label, n_cls)  # [batch, n_cls]
    return onehot[:, classes].argmax(dim=1)


def feature_batches(labels: list[int], batch_size: int, by_class: bool, rng: random.Random):
    """The authors' feature-loader batches of one epoch: lists of item indices.

    ``by_class``: a random class, then a random sample of ``batch_size`` of its remaining items,
    until no class has ``batch_size`` items left (a class is dropped once it has fewer); else
    random disjoint batches of any items until fewer than ``batch_size`` remain. The draws
    (``rng.choice``, ``rng.sample``) are the authors' calls on Python's generator, in order.
    """
    if by_class:
        groups: dict[int, list[int]] = {}
        for i, y in enumerate(labels):
            groups.setdefault(int(y), []).append(i)
        small = {y: len(v) for y, v in groups.items() if len(v) < batch_size}
        if small:
            raise ConfigError(
                f"SkipTuning batches hold DATALOADER.TRAIN_X.BATCH_SIZE {batch_size} images of "
                f"one class (DATASET.NUM_SHOTS >= 4), but classes {sorted(small)[:5]} have "
                f"fewer ({min(small.values())}): lower the batch size to at most the shots"
            )
        batches = []
        while groups:
            y = rng.choice(list(groups.keys()))
            picked = rng.sample(groups[y], batch_size)
            batches.append(picked)
            for i in picked:
                groups[y].remove(i)
            if len(groups[y]) < batch_size:
                del groups[y]
        return batches
    items = list(range(len(labels)))
    if len(items) < batch_size:
        raise ConfigError(
            f"SkipTuning needs at least DATALOADER.TRAIN_X.BATCH_SIZE ({batch_size}) training "
            f"images, the dataset has {len(items)}"
        )
    batches = []
    while True:
        picked = rng.sample(items, batch_size)
        batches.append(picked)
        for i in picked:
            items.remove(i)
        if len(items) < batch_size:
            return batches


class TunedText(nn.Module):
    """The tuned part of the text tower, under the authors' key names."""

    def __init__(self, clip_model, start: int):
        super().__init__()
        blocks = clip_model.transformer.resblocks
        self.transformer = nn.Module()
        self.transformer.resblocks = nn.ModuleDict(
            {str(i): blocks[i] for i in range(start, len(blocks))}
        )
        self.ln_final = clip_model.ln_final
        self.text_projection = clip_model.text_projection  # Parameter (OpenAI) or Linear


class TunedImage(nn.Module):
    """The tuned part of the image tower, under the authors' key names."""

    def __init__(self, visual, start: int):
        super().__init__()
        blocks = visual.transformer.resblocks
        self.transformer = nn.Module()
        self.transformer.resblocks = nn.ModuleDict(
            {str(i): blocks[i] for i in range(start, len(blocks))}
        )
        self.ln_post = visual.ln_post
        self.proj = visual.proj


class SkipImageTower(PromptedVisionEncoder):
    """CLIP's ViT split at block ``start``: :meth:`lower` (frozen: embedding, ``ln_pre``, the
    first blocks) and ``forward`` (the tuned blocks, ``ln_post`` on the class token, ``proj``;
    the part the engine compiles, engine/compile.py)."""

    def __init__(self, clip_model, start: int):
        super().__init__(clip_model)
        self.start = start

    def lower(self, images: torch.Tensor) -> torch.Tensor:
        """``[batch, 3, H, W]`` -> ``[batch, tokens, width]``."""
        x = self.embed(images)
        for block in self.visual.transformer.resblocks[: self.start]:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[batch, tokens, width]`` -> ``[batch, dim]``; the class token is the first
        remaining token (the authors' token drop may have removed it)."""
        x = x.float()
        for block in self.visual.transformer.resblocks[self.start :]:
            x = block(x)
        pooled, _ = self.visual._pool(x)  # ln_post on the first token: [batch, width]
        proj = self.visual.proj
        return pooled if proj is None else pooled @ proj


class SkipTextTower(TextEncoder):
    """CLIP's text tower split at block ``start``: :meth:`lower` (frozen: token and positional
    embedding, the first blocks) and ``forward(states, eot_idx)`` (the tuned blocks,
    ``ln_final`` at the EOT, the projection), which runs through :class:`TextEncoder`'s chunks
    and activation checkpoints (``MODEL.TEXT_CHUNK`` / ``CHECKPOINT_TEXT``); its prompts are
    states, so ``MODEL.SHARED_PREFIX`` does not apply."""

    def __init__(self, clip_model, start: int):
        super().__init__(clip_model)
        self.start = start
        self.cast = clip_dtype(clip_model)  # the frozen part's dtype (fp16 in PREC fp16)

    def lower(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[n, L]`` token ids -> ``[n, L, width]``."""
        seq = tokens.shape[1]
        dtype = self.cast
        x = self.token_embedding(tokens).to(dtype) + self.positional_embedding[:seq].to(dtype)
        mask = self.attn_mask[:seq, :seq]
        for block in self.transformer.resblocks[: self.start]:
            x = block(x, attn_mask=mask)
        return x

    def encode_rows(self, layer_hook, prompts, eot_idx, *row_args):
        """The tuned part on one chunk of states ``[rows, L, width]`` -> ``[rows, dim]``."""
        seq = prompts.shape[1]
        x = prompts.float()
        mask = self.attn_mask[:seq, :seq]
        for block in self.transformer.resblocks[self.start :]:
            x = block(x, attn_mask=mask)
        return self.project(x[torch.arange(x.shape[0], device=x.device), eot_idx])


class SkipInputs(NamedTuple):
    """A step's prepared inputs: the frozen image features ``[batch, tokens, width]`` (after
    the token drop), the labels, and ``choice`` (the step's kept classes, set by its first
    pass and shared by every pass and subset of the step)."""

    features: torch.Tensor
    label: torch.Tensor
    choice: dict


class SkipTuningCLIP(nn.Module):
    """CLIP split at block ``start`` of both towers (module docstring).

    Buffers (non-persistent, rebuilt for any classes): ``tokens``/``eot_idx`` of the class
    prompts, ``text_mid`` ``[n_cls, L, width]`` (the prompts after the frozen blocks) and
    ``prototypes`` ``[n_cls, dim]`` (the initial CLIP's normalised text features).
    """

    @classmethod
    def from_config(cls, cfg, classnames, clip_model):
        template = skip_template(cfg.DATASET.NAME, cfg.DATASET.TEMPLATE)
        return cls(classnames, clip_model, cfg.TRAINER.SKIP.START_LAYER, template)

    def __init__(self, classnames, clip_model, start: int, template: str):
        super().__init__()
        visual = require_vit(clip_model, "SkipTuning's layer-wise skipping")
        if getattr(visual, "attn_pool", None) is not None:
            raise BackboneError(
                "SkipTuning tunes the image tower's blocks and ln_post/proj after its class "
                "token; this ViT pools with attention (attn_pool). Use a class-token ViT, e.g. "
                "MODEL.BACKBONE.NAME ViT-B/16"
            )
        n_text = len(clip_model.transformer.resblocks)
        n_image = len(visual.transformer.resblocks)
        if not 0 <= start <= min(n_text, n_image):
            raise ConfigError(
                f"TRAINER.SKIP.START_LAYER {start} is outside this CLIP's blocks (text "
                f"{n_text}, image {n_image}): give 0..{min(n_text, n_image)}"
            )
        self.start = start
        self.n_cls = len(classnames)
        self.dtype = clip_dtype(clip_model)
        self.image = SkipImageTower(clip_model, start)
        self.text = SkipTextTower(clip_model, start)
        self.logit_scale = clip_model.logit_scale
        text, image = TunedText(clip_model, start), TunedImage(visual, start)
        self.learnable = nn.ModuleDict({"text_encoder": text, "image_encoder": image})
        self._to_fp32(clip_model, visual)
        names = [name.replace("_", " ") for name in classnames]
        prompts = tokenize([template.format(n) for n in names])
        tokens, eot = truncate_tokens(prompts, keeps_full_length(clip_model))
        device = clip_model.positional_embedding.device
        self.register_buffer("tokens", tokens.to(device), persistent=False)  # [n_cls, L]
        self.register_buffer("eot_idx", eot.to(device), persistent=False)  # [n_cls]
        with torch.no_grad():
            mid = self.text_lower(self.tokens)  # [n_cls, L, width]
            protos = l2_normalize(self.text_upper(mid, self.eot_idx).float())  # [n_cls, dim]
        self.register_buffer("text_mid", mid, persistent=False)
        self.register_buffer("prototypes", protos, persistent=False)
        self.template = template

    def _to_fp32(self, clip_model, visual) -> None:
        """The tuned layers in fp32 (a half-precision CLIP keeps its frozen part in fp16)."""
        self.learnable.float()
        for owner, name in ((clip_model, "text_projection"), (visual, "proj")):
            p = getattr(owner, name)
            if isinstance(p, nn.Parameter):
                p.data = p.data.float()

    # -- the two parts of each tower ------------------------------------------------------
    def image_lower(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[batch, 3, H, W]`` through the frozen part: ``[batch, tokens, width]``."""
        return self.image.lower(images)

    def image_upper(self, x: torch.Tensor) -> torch.Tensor:
        """Frozen features through the tuned part: ``[batch, dim]`` (not normalised)."""
        return self.image(x)

    def text_lower(self, tokens: torch.Tensor) -> torch.Tensor:
        """Prompt tokens ``[n, L]`` through the frozen part: ``[n, L, width]``."""
        return self.text.lower(tokens)

    def text_upper(self, x: torch.Tensor, eot_idx: torch.Tensor) -> torch.Tensor:
        """Frozen prompt states ``[n, L, width]`` through the tuned part: ``[n, dim]``."""
        return self.text(x, eot_idx)

    # -- whole towers (evaluation) ----------------------------------------------------------
    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return l2_normalize(self.image_upper(self.image_lower(images)))

    def encode_text(self) -> torch.Tensor:
        return l2_normalize(self.text_upper(self.text_mid, self.eot_idx))

    def logits(self, image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
        return self.logit_scale.exp() * image_features @ text_features.t().to(image_features.dtype)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.logits(self.encode_image(images), self.encode_text())


def per_item_record_optimizers() -> set[str]:
    """The sharpness-aware optimizers that keep records per dataset item across epochs (they
    need the items' indices: SAF), from what each declares (optim.sharpness.STEP_NEEDS)."""
    from optim.build import list_optimizers
    from optim.sharpness import INDEX

    return {s.name for s in list_optimizers("sharpness") if INDEX in s.cls.STEP_NEEDS}


@TRAINER_REGISTRY.register()
class SkipTuning(TextOnceEvaluation, TrainerX):
    """Skip Tuning: the upper blocks of both CLIP towers fine-tuned on features of the frozen
    lower blocks computed once per epoch, over a per-step subset of the classes."""

    CONFIG_NODE = "SKIP"
    # the grid's default configs (configs/trainers/SkipTuning/<cfg>.yaml; experiments/protocols.py)
    PROTOCOL_CFGS = {
        "base2new": "vit_b16_bs4",
        "transfer": "vit_b16_bs4_cross_datasets",
        "few_shot": "vit_b16_bs4_few_shot",
    }

    add_config = staticmethod(add_skiptuning_config)
    NEEDS_VIT = True  # a ResNet backbone is refused before anything is loaded (check_cfg)
    DATA_PARALLEL = False  # one process: a step's class choice reads the whole batch

    @classmethod
    def translate_key(cls, key, value, source):
        """The authors' files: ``OPTIM.NEW_LR`` is ``TRAINER.SKIP.NEW_LR`` (their image tower's
        LR with ``STAGED_LR``); their ``TRAINER.PREC`` is ``TRAINER.SKIP.PREC``."""
        if key == "OPTIM.NEW_LR":
            return [("TRAINER.SKIP.NEW_LR", value)]
        if key == "TRAINER.PREC":
            return [("TRAINER.SKIP.PREC", value)]
        return [(key, value)]

    def __init__(self, cfg, classnames=None):
        node = cfg.TRAINER.SKIP
        if cfg.DATASET.NAME in list(node.LARGE_DATASETS) and node.EPOCH_DIVISOR > 1:
            epochs = int(cfg.OPTIM.MAX_EPOCH / node.EPOCH_DIVISOR)
            logger.info(
                "SkipTuning on %s: OPTIM.MAX_EPOCH %d / TRAINER.SKIP.EPOCH_DIVISOR %d = %d epochs",
                cfg.DATASET.NAME,
                cfg.OPTIM.MAX_EPOCH,
                node.EPOCH_DIVISOR,
                epochs,
            )
            cfg = cfg.clone()
            cfg.defrost()
            cfg.OPTIM.MAX_EPOCH = epochs
            cfg.freeze()
        self._batches = None
        self._extract_loader = None
        super().__init__(cfg, classnames=classnames)

    def check_cfg(self, cfg):
        if vision_tower_kind(cfg) == "resnet":
            raise BackboneRefused(
                f"SkipTuning cannot use the backbone {backbone_label(cfg)}: its layer-wise "
                "skipping needs a ViT image encoder (transformer blocks whose token sequence is "
                "split at START_LAYER), and this backbone's image encoder is a ResNet "
                f"(ModifiedResNet). Set MODEL.BACKBONE.NAME ViT-B/16 or another ViT: "
                f"{VIT_BACKBONES}."
            )
        c = cfg.TRAINER.SKIP
        if c.START_LAYER < 0:
            raise ConfigError(f"TRAINER.SKIP.START_LAYER must be >= 0, got {c.START_LAYER}")
        if c.TOP_RATIO <= 0:
            raise ConfigError(f"TRAINER.SKIP.TOP_RATIO must be > 0, got {c.TOP_RATIO}")
        if c.MAX_TOP < 1:
            raise ConfigError(f"TRAINER.SKIP.MAX_TOP must be >= 1, got {c.MAX_TOP}")
        if c.LAMBDA <= 0:
            raise ConfigError(f"TRAINER.SKIP.LAMBDA (a scale) must be > 0, got {c.LAMBDA}")
        if not 0.0 <= c.DROP_RATIO < 1.0:
            raise ConfigError(f"TRAINER.SKIP.DROP_RATIO must be in [0, 1), got {c.DROP_RATIO}")
        if c.QUICK_BATCH_SIZE < 1:
            raise ConfigError(f"TRAINER.SKIP.QUICK_BATCH_SIZE must be >= 1: {c.QUICK_BATCH_SIZE}")
        if c.EPOCH_DIVISOR < 1:
            raise ConfigError(f"TRAINER.SKIP.EPOCH_DIVISOR must be >= 1, got {c.EPOCH_DIVISOR}")
        if cfg.OPTIM.STAGED_LR and c.NEW_LR <= 0:
            raise ConfigError(f"TRAINER.SKIP.NEW_LR must be > 0 with STAGED_LR, got {c.NEW_LR}")

    # -- the model -------------------------------------------------------------------------
    def build_model(self):
        cfg = self.cfg
        clip_model = load_clip(cfg, precision=self.prec, device=self.device)
        self.model = SkipTuningCLIP.from_config(cfg, self.classnames, clip_model).to(self.device)
        c = cfg.TRAINER.SKIP
        self.n_top = num_top_classes(self.model.n_cls, c.TOP_RATIO, c.MAX_TOP)
        self.skips_classes = not (c.TOP_RATIO == 1.0 or self.n_top == self.model.n_cls)
        if self.skips_classes and cfg.OPTIM.SAM.NAME in per_item_record_optimizers():
            raise ConfigError(
                f"OPTIM.SAM.NAME {cfg.OPTIM.SAM.NAME} with SkipTuning's class-wise skipping: its "
                "per-item records (SAF's trajectory term) compare an item's logits over the "
                "same classes across epochs, and each "
                "SkipTuning step has logits over its own subset of classes. Set "
                "TRAINER.SKIP.TOP_RATIO 1.0 (every class in every step) or use another optimizer"
            )
        learnable = self.model.learnable
        self.model.requires_grad_(False)
        learnable.requires_grad_(True)
        names = [n for n, _ in learnable.named_parameters()]
        logger.info(
            "Parameters to be updated: %d tensors, %s ... %s", len(names), names[0], names[-1]
        )
        load_init_weights(learnable, cfg.MODEL.INIT_WEIGHTS)
        self.optim = build_optimizer(cfg, self.param_groups())
        self.sched = build_lr_scheduler(self.optim, cfg.OPTIM)
        self.register_model("learnable_params", learnable, self.optim, self.sched)
        self.model.rank_mask = None  # drawn at the first step (:meth:`rank_mask`)

    def param_groups(self) -> list[dict]:
        """One group (``OPTIM.LR``), or with ``OPTIM.STAGED_LR`` the text tower at ``OPTIM.LR``
        and the image tower at ``TRAINER.SKIP.NEW_LR`` (the authors' groups)."""
        learnable = self.model.learnable
        text = list(learnable["text_encoder"].parameters())
        image = list(learnable["image_encoder"].parameters())
        if not self.cfg.OPTIM.STAGED_LR:
            return [{"params": text + image}]
        return [{"params": text}, {"params": image, "lr": self.cfg.TRAINER.SKIP.NEW_LR}]

    def rank_mask(self) -> torch.Tensor:
        """``[n_cls]`` bool, the ranks kept by class-wise skipping: drawn once per run from a
        generator seeded by the run seed (the authors drew it at their first step)."""
        if self.model.rank_mask is None:
            c = self.cfg.TRAINER.SKIP
            probs = keep_probabilities(self.model.n_cls, self.n_top, c.LAMBDA)
            g = torch.Generator()
            g.manual_seed(self.cfg.SEED if self.cfg.SEED >= 0 else random.randrange(2**31))
            mask = torch.rand(self.model.n_cls, generator=g) < probs
            self.model.rank_mask = mask.to(self.device)
        return self.model.rank_mask

    # -- the epoch's batches (LSkip: the frozen part once per epoch) -----------------------
    def before_epoch(self):
        super().before_epoch()
        seed = epoch_seed(self.cfg.SEED, self.epoch) if self.cfg.SEED >= 0 else None
        self._rng = random.Random(seed)
        self._torch_rng = torch.Generator()
        self._torch_rng.manual_seed(seed if seed is not None else random.randrange(2**31))
        features, labels = self.extract_image_features()
        size = self.cfg.DATALOADER.TRAIN_X.BATCH_SIZE
        by_class = self.cfg.DATASET.NUM_SHOTS >= 4
        index = feature_batches(labels.tolist(), size, by_class, self._rng)
        self._batches = [
            {"features": features[i], "label": labels[i], "index": torch.tensor(i)} for i in index
        ]

    def epoch_batches(self):
        return self._batches

    def before_train(self):
        if distributed.world_size() > 1:
            raise ConfigError(
                "SkipTuning trains in one process: its epochs run over batches of precomputed "
                "features and a step's class-wise skipping ranks the classes over the whole "
                f"batch, which {distributed.world_size()} data-parallel processes would each "
                "see a part of. Run train.py without torchrun / srun tasks (one GPU)"
            )
        super().before_train()

    def _extraction_loader(self):
        """The training images in order, with the training transforms, QUICK_BATCH_SIZE per
        batch (a fresh augmentation each epoch, seeded by the run seed)."""
        if self._extract_loader is None:
            wrapper = self.train_loader_x.dataset
            cfg = self.cfg
            dataset = DatasetWrapper(
                cfg, wrapper.data_source, wrapper.transform, is_train=True, images=wrapper.images
            )
            sampler = EpochSampler(len(dataset), shuffle=False, seed=cfg.SEED)
            self._extract_loader = torch.utils.data.DataLoader(
                dataset,
                batch_size=cfg.TRAINER.SKIP.QUICK_BATCH_SIZE,
                sampler=sampler,
                num_workers=cfg.DATALOADER.NUM_WORKERS,
            )
        self._extract_loader.sampler.set_epoch(self.epoch)
        return self._extract_loader

    @torch.no_grad()
    def extract_image_features(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``([N, tokens, width], [N])``: every training image through the frozen part (kept
        on the CPU, as the authors' loader does; a batch moves to the device per step)."""
        feats, labels = [], []
        for batch in self._extraction_loader():
            images, label = TrainerX.parse_batch_train(self, batch)
            with self.autocast():
                feats.append(self.model.image_lower(images).cpu())
            labels.append(label.cpu())
        return torch.cat(feats), torch.cat(labels)

    # -- the step protocol -------------------------------------------------------------------
    def parse_batch_train(self, batch):
        """A batch of frozen features (the epoch's batches), or of images (any loader)."""
        if "features" in batch:
            dev = self.device
            return batch["features"].to(dev, non_blocking=True), batch["label"].to(dev)
        return super().parse_batch_train(batch)

    def drop_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The authors' token drop: a share ``uniform(0, DROP_RATIO)`` of the token positions
        ``[batch, tokens, width]`` (any position, the class token included) removed."""
        rng = getattr(self, "_rng", None) or random.Random()
        share = rng.uniform(0.0, self.cfg.TRAINER.SKIP.DROP_RATIO)
        n_drop = math.ceil(x.shape[1] * share)
        if n_drop == 0:
            return x
        gen = getattr(self, "_torch_rng", None)
        drop = torch.randperm(x.shape[1], generator=gen)[:n_drop]
        keep = torch.ones(x.shape[1], dtype=torch.bool)
        keep[drop] = False
        return x[:, keep.to(x.device)]

    def prepare_step(self, batch_inputs):
        x, label = batch_inputs
        if x.dim() == 4:  # images: the frozen part now
            x = self.model.image_lower(x)
        return SkipInputs(self.drop_tokens(x), label, {})

    def select_inputs(self, inputs, subset, size):
        return SkipInputs(inputs.features[subset], inputs.label[subset], inputs.choice)

    def compute_loss(self, inputs):
        model = self.model
        image = model.image_upper(inputs.features)  # [batch, dim]
        label = inputs.label
        if self.skips_classes:
            classes = inputs.choice.get("classes")
            if classes is None:  # the step's first pass chooses for all of them
                with torch.no_grad():
                    classes = select_classes(
                        image.detach(), label, model.prototypes, self.rank_mask()
                    )
                inputs.choice["classes"] = classes
            text = model.text_upper(model.text_mid[classes], model.eot_idx[classes])
            label = relabel(label, classes, model.n_cls)
        else:
            text = model.text_upper(model.text_mid, model.eot_idx)
        logits = model.logits(l2_normalize(image), l2_normalize(text))
        loss = self.classification_loss(logits, label)
        return loss, {"acc": compute_accuracy(logits, label)[0]}

    # -- the authors' checkpoints ----------------------------------------------------------
    def frozen_tensors(self) -> dict[str, torch.Tensor]:
        """The frozen CLIP tensors under the names the authors' checkpoints give them (their
        ``learnable_params`` held both encoders whole)."""
        clip, visual, start = self.model.text, self.model.image.visual, self.model.start
        out = {
            "text_encoder.token_embedding.weight": clip.token_embedding.weight,
            "text_encoder.positional_embedding": clip.positional_embedding,
            "image_encoder.conv1.weight": visual.conv1.weight,
            "image_encoder.class_embedding": visual.class_embedding,
            "image_encoder.positional_embedding": visual.positional_embedding,
            "image_encoder.ln_pre.weight": visual.ln_pre.weight,
            "image_encoder.ln_pre.bias": visual.ln_pre.bias,
        }
        for tower, blocks in (("text", clip.transformer.resblocks), ("image", visual.transformer)):
            blocks = blocks if tower == "text" else blocks.resblocks
            for i in range(start):
                for k, v in blocks[i].state_dict().items():
                    out[f"{tower}_encoder.transformer.resblocks.{i}.{k}"] = v
        return out

    def _load_module_state(self, name, checkpoint, path):
        """An authors' checkpoint holds the frozen tensors too: they must equal this CLIP's
        (else it was trained with another START_LAYER or CLIP) and are not loaded."""
        state = checkpoint.get("state_dict", checkpoint)
        own = self._models[name].state_dict()
        frozen = self.frozen_tensors()
        kept, differ = {}, []
        for key, value in state.items():
            bare = key[7:] if key.startswith("module.") else key
            if bare in own or bare not in frozen:
                kept[key] = value
            elif not torch.equal(value.cpu(), frozen[bare].detach().to(value.dtype).cpu()):
                differ.append(bare)
        if differ:
            raise CheckpointError(
                f"{path} holds tensors of CLIP's frozen part that differ from this CLIP's "
                f"({differ[:3]}{' ...' if len(differ) > 3 else ''}): it was trained with "
                f"another TRAINER.SKIP.START_LAYER (this run: {self.model.start}) or CLIP "
                "(MODEL.BACKBONE); evaluate it with the settings of the run that made it"
            )
        super()._load_module_state(name, {**checkpoint, "state_dict": kept}, path)
