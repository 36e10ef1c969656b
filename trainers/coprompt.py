"""CoPrompt: consistency-guided prompt learning (Roy & Etemad, ICLR 2024).

MaPLe's coupled text/vision prompts (trainers/maple.py) plus

- two adapters ``Linear(d, d/4, bias=False) -> ReLU -> Linear(d/4, d, bias=False) -> ReLU`` on
  the encoded features, mixed residually before the L2 norm:
  ``image = 0.1 * A_img(image) + 0.9 * image`` and ``text = 0.2 * A_txt(text) + 0.8 * text``
  (IMAGE_ADAPTER_RATIO / TEXT_ADAPTER_RATIO);
- a frozen, unprompted teacher: the same CLIP weights through the plain forward. Text teacher:
  LLM-written class descriptions (``<DESCRIPTIONS_DIR>/<key>_prompt.json``, ``{class name:
  [sentences]}``), encoded once and L2-normalised; every step draws ONE description index for
  all classes. Image teacher: the plain CLIP features of a second augmented view
  (DATALOADER.K_TRANSFORMS 2);
- loss = CE + W * [(1 - mean cos(text, text teacher)) + (1 - mean cos(image view 1, image
  teacher view 2))] (DISTILL_LOSS "cos"; "mse" uses the mean squared error of the normalised
  features instead).

The teacher work (the second view's features, the description draw) runs once per step in
``prepare_step``, so both passes of a sharpness-aware optimizer see the same teacher targets.
The description features are built when training starts (evaluation does not need them, so
base-to-new and cross-dataset evaluation run without a description file).

Differences from CoPrompt's code base: one CLIP instance serves as student backbone and teacher
(its weights are frozen either way); adapters, prompts and projections are fp32 master
parameters in every precision mode; checkpoints hold only the learnable module (prompt learner
and adapters); a missing description file or class is an error unless FALLBACK_TEMPLATES is set.

Per-dataset values (PROMPT_DEPTH / N_CTX / W, Food101's 5 epochs) are config overlays,
configs/trainers/CoPrompt/per_dataset/<dataset>.yaml, merged after the main config
(configs/trainers/CoPrompt/vit_b16_c2_ep8_batch4_2ctx.yaml explains the convention).

CoPrompt's own config file and scripts run unchanged: :meth:`CoPrompt.translate_key` reads
their keys (``TRAINER.CoPrompt.*``, ``TRAINER.W``, ``TRAINER.DISTILL``; CoPrompt's ``train.py``
declares them) as ``TRAINER.COPROMPT.*`` and sets ``TRAINER.COPROMPT.TRAIN_PY_RULES``, with which
:meth:`CoPrompt.translate_cfg` does what CoPrompt's ``train.py`` does after the merge: the
dataset's per-dataset overlay is merged after the config files (CoPrompt's train.py merges it
over the command line too; here the ``KEY VALUE`` options still win), and the
description files are read from ``gpt_file/`` of the current folder (CoPrompt's place for them)
when ``DESCRIPTIONS_DIR`` is not set.
"""

from __future__ import annotations

import json
import logging
import os
import os.path as osp

import torch
import torch.nn.functional as F
from torch import nn

from engine.clip import encode_texts
from engine.registry import TRAINER_REGISTRY
from engine.utils import compute_accuracy

from .common import l2_normalize
from .maple import MaPLe, MaPLeCLIP, MaPLePrompts, add_multimodal_prompt_keys
from .zsclip import dataset_template

logger = logging.getLogger(__name__)

# DATASET.NAME -> file key of CoPrompt's description files (<key>_prompt.json)
DESCRIPTION_FILE_KEYS = {
    "Caltech101": "caltech",
    "DescribableTextures": "dtd",
    "EuroSAT": "eurosat",
    "FGVCAircraft": "fgvc",
    "Food101": "food101",
    "OxfordFlowers": "oxford_flowers",
    "OxfordPets": "oxford_pets",
    "StanfordCars": "stanford_cars",
    "SUN397": "sun397",
    "UCF101": "ucf101",
    "ImageNet": "imagenet",
    "ImageNetA": "imagenet_a",
    "ImageNetR": "imagenet_r",
    "ImageNetSketch": "imagenet_sketch",
    "ImageNetV2": "imagenetv2",
}
DISTILL_LOSSES = ("cos", "mse")


def add_coprompt_config(cfg) -> None:
    """TRAINER.COPROMPT keys (CoPrompt's base-to-new defaults)."""
    from yacs.config import CfgNode as CN

    node = cfg.TRAINER.COPROMPT = CN()
    add_multimodal_prompt_keys(node)
    node.W = 1.0  # weight of the two consistency (distillation) losses
    node.IMAGE_ADAPTER_RATIO = 0.1  # image = r * adapter(image) + (1 - r) * image
    node.TEXT_ADAPTER_RATIO = 0.2  # text = r * adapter(text) + (1 - r) * text
    node.ADAPTER_REDUCTION = 4  # adapter hidden width = feature dim / this (512 -> 128)
    node.DISTILL_LOSS = "cos"  # cos: 1 - mean cosine | mse: mean squared error (normalised)
    # folder with CoPrompt's description files <key>_prompt.json ({class name: [sentences]});
    # keys: DESCRIPTION_FILE_KEYS in trainers/coprompt.py (e.g. DescribableTextures -> dtd).
    # Empty: DATASET.ROOT/coprompt_descriptions (keep them next to the datasets)
    node.DESCRIPTIONS_DIR = ""
    # True: without a description file, use the dataset's hand-crafted CoOp template as the
    # only "description" of each class (otherwise a missing file is an error)
    node.FALLBACK_TEMPLATES = False
    # True: what CoPrompt's train.py does after the merge (module docstring); CoPrompt's own
    # config files and scripts set it (their TRAINER.CoPrompt keys, CoPrompt.translate_key)
    node.TRAIN_PY_RULES = False


COPROMPT_MARK = ("TRAINER.COPROMPT.TRAIN_PY_RULES", True)
COPROMPT_GPT_FOLDER = "gpt_file"  # CoPrompt's description files, relative to its repository


def translate_coprompt_key(key: str, value, source: str) -> list[tuple[str, object]]:
    """One key of CoPrompt's files as this trainer's (module docstring)."""
    if key.startswith("TRAINER.CoPrompt."):
        return [(f"TRAINER.COPROMPT.{key[len('TRAINER.CoPrompt.') :]}", value), COPROMPT_MARK]
    if key == "TRAINER.W":
        return [("TRAINER.COPROMPT.W", value), COPROMPT_MARK]
    if key == "TRAINER.DISTILL":  # CoPrompt: "cosine", anything else the squared error
        return [("TRAINER.COPROMPT.DISTILL_LOSS", "cos" if value == "cosine" else "mse")]
    return [(key, value)]


def _dataset_overlay(name: str) -> str | None:
    """configs/trainers/CoPrompt/per_dataset/<stem>.yaml of the dataset ``name``, or None."""
    import yaml

    configs = osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))), "configs")
    datasets = osp.join(configs, "datasets")
    for fname in sorted(os.listdir(datasets)):
        path = osp.join(datasets, fname)
        with open(path) as f:
            values = yaml.safe_load(f) or {}
        if (values.get("DATASET") or {}).get("NAME") == name:
            stem = osp.splitext(fname)[0]
            overlay = osp.join(configs, "trainers", "CoPrompt", "per_dataset", f"{stem}.yaml")
            return overlay if osp.isfile(overlay) else None
    return None


class Adapter(nn.Sequential):
    """CoPrompt's feature adapter: Linear -> ReLU -> Linear -> ReLU, no biases."""

    def __init__(self, dim: int, reduction: int = 4):
        hidden = dim // reduction
        if hidden < 1:
            raise ValueError(f"ADAPTER_REDUCTION {reduction} leaves no hidden unit for dim {dim}")
        super().__init__(
            nn.Linear(dim, hidden, bias=False),
            nn.ReLU(),
            nn.Linear(hidden, dim, bias=False),
            nn.ReLU(),
        )


class CoPromptLearner(nn.Module):
    """Everything CoPrompt learns: MaPLe's prompt learner and the two adapters (the registered,
    checkpointed module)."""

    def __init__(self, prompt_learner: nn.Module, dim: int, reduction: int = 4):
        super().__init__()
        self.prompt_learner = prompt_learner
        self.image_adapter = Adapter(dim, reduction)
        self.text_adapter = Adapter(dim, reduction)


class CoPromptCLIP(MaPLeCLIP):
    """MaPLe's prompted CLIP with CoPrompt's adapters and the frozen teacher.

    ``description_features`` ``[n_cls, n_desc, embed_dim]`` (non-persistent buffer) holds the
    teacher's L2-normalised description features once :meth:`set_descriptions` was called.
    """

    CONFIG_NODE = "COPROMPT"

    @classmethod
    def from_config(cls, cfg, classnames, clip_model):
        """The model of ``cfg`` (TRAINER.COPROMPT) for ``classnames``."""
        node = cfg.TRAINER.COPROMPT
        prompt_learner = cls.build_prompt_learner(cfg, classnames, clip_model)
        learner = CoPromptLearner(
            prompt_learner, clip_model.visual.output_dim, node.ADAPTER_REDUCTION
        )
        return cls(learner, clip_model, node.IMAGE_ADAPTER_RATIO, node.TEXT_ADAPTER_RATIO)

    def __init__(self, learner: CoPromptLearner, clip_model, image_ratio: float, text_ratio: float):
        super().__init__(learner.prompt_learner, clip_model)
        self.learner = learner
        self.image_ratio = image_ratio
        self.text_ratio = text_ratio
        self.register_buffer("description_features", None, persistent=False)

    @property
    def learnable(self) -> nn.Module:
        return self.learner

    @staticmethod
    def _mix(adapter: nn.Module, features: torch.Tensor, ratio: float) -> torch.Tensor:
        f = features.float()
        return ratio * adapter(f) + (1 - ratio) * f

    def pre_adapter_text_features(self, prompts: MaPLePrompts) -> torch.Tensor:
        """MaPLe's prompted class text features before the adapter ``[n_cls, dim]``."""
        return MaPLeCLIP.text_features(self, prompts)

    def pre_adapter_image_features(self, image: torch.Tensor, prompts: MaPLePrompts):
        """MaPLe's prompted image features before the adapter ``[batch, dim]``."""
        return MaPLeCLIP.image_features(self, image, prompts)

    def text_features(self, prompts: MaPLePrompts) -> torch.Tensor:
        f = self.pre_adapter_text_features(prompts)
        return self._mix(self.learner.text_adapter, f, self.text_ratio)

    def image_features(self, image: torch.Tensor, prompts: MaPLePrompts) -> torch.Tensor:
        f = self.pre_adapter_image_features(image, prompts)
        return self._mix(self.learner.image_adapter, f, self.image_ratio)

    @torch.no_grad()
    def teacher_image_features(self, image: torch.Tensor) -> torch.Tensor:
        """The frozen, unprompted CLIP's L2-normalised image features ``[batch, embed_dim]``."""
        visual = self.image_encoder.visual
        return l2_normalize(visual(image.to(self.image_encoder.dtype)).float())

    @torch.no_grad()
    def set_descriptions(self, descriptions: list[list[str]]) -> None:
        """Encode ``descriptions[c][k]`` (the same count k for every class c) with the frozen
        text tower into ``description_features`` ``[n_cls, n_desc, embed_dim]``."""
        n_cls, n_desc = len(descriptions), len(descriptions[0])
        flat = [text for per_class in descriptions for text in per_class]
        feats = encode_texts(self.text_encoder, flat)  # [n_cls * n_desc, embed_dim]
        self.description_features = feats.view(n_cls, n_desc, -1).to(self.logit_scale.device)


def description_file(cfg) -> str:
    """``<DESCRIPTIONS_DIR>/<key>_prompt.json`` for ``cfg.DATASET.NAME`` (a Folder dataset:
    the name of its folder)."""
    name = cfg.DATASET.NAME
    if name == "Folder" and cfg.DATASET.FOLDER:
        name = osp.basename(osp.normpath(cfg.DATASET.FOLDER))
    key = DESCRIPTION_FILE_KEYS.get(name, name.lower())
    folder = cfg.TRAINER.COPROMPT.DESCRIPTIONS_DIR or osp.join(
        cfg.DATASET.ROOT, "coprompt_descriptions"
    )
    return osp.join(osp.expanduser(folder), f"{key}_prompt.json")


def _find_class(table: dict, lowered: dict, name: str) -> str | None:
    for candidate in (name, name.replace("_", " ")):
        if candidate in table:
            return candidate
        if candidate.lower() in lowered:
            return lowered[candidate.lower()]
    return None


def read_descriptions(path: str, classnames: list[str]) -> list[list[str]]:
    """The sentences of each class from a ``{class name: [sentences]}`` JSON file.

    Class names match exactly, with "_" read as " ", or case-insensitively. Classes with
    different numbers of sentences are cut to the smallest number (logged).
    """
    with open(path) as f:
        table = json.load(f)
    if not isinstance(table, dict):
        raise ValueError(f"{path} must hold a JSON object {{class name: [sentences]}}")
    lowered = {k.lower(): k for k in table}
    out, missing = [], []
    for name in classnames:
        key = _find_class(table, lowered, name)
        if key is None:
            missing.append(name)
            continue
        sentences = table[key]
        if not isinstance(sentences, list) or not sentences:
            raise ValueError(f"{path}: class {key!r} needs a non-empty list of sentences")
        out.append([str(s) for s in sentences])
    if missing:
        shown = ", ".join(repr(m) for m in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        raise ValueError(
            f"{path} has no descriptions for {len(missing)} of {len(classnames)} classes: "
            f"{shown}{more}. Add them to the file (keys are the class names of the dataset "
            "reader, with spaces)."
        )
    counts = {len(s) for s in out}
    if len(counts) > 1:
        n = min(counts)
        logger.warning(
            "%s: classes have %s descriptions; using the first %d of each", path, sorted(counts), n
        )
        out = [s[:n] for s in out]
    return out


def class_descriptions(cfg, classnames: list[str]) -> list[list[str]]:
    """The teacher's texts per class: the description file, or (only with FALLBACK_TEMPLATES)
    the dataset's hand-crafted template when there is no file."""
    node = cfg.TRAINER.COPROMPT
    path = description_file(cfg)
    if osp.isfile(path):
        logger.info("CoPrompt text teacher: descriptions from %s", path)
        return read_descriptions(path, classnames)
    if node.FALLBACK_TEMPLATES:
        template = dataset_template(cfg.DATASET.NAME, cfg.DATASET.TEMPLATE)
        logger.warning(
            "No description file %s: the text teacher uses the template %r "
            "(TRAINER.COPROMPT.FALLBACK_TEMPLATES True)",
            path,
            template,
        )
        return [[template.format(name.replace("_", " "))] for name in classnames]
    raise FileNotFoundError(
        f"CoPrompt needs LLM-written class descriptions for {cfg.DATASET.NAME}: the expected "
        f"file {path} does not exist. Put CoPrompt's <key>_prompt.json files (its gpt_file "
        "folder) in DATA/coprompt_descriptions/ or set TRAINER.COPROMPT.DESCRIPTIONS_DIR to "
        "their folder; or set TRAINER.COPROMPT.FALLBACK_TEMPLATES True to use the dataset's "
        "hand-crafted template instead."
    )


@TRAINER_REGISTRY.register()
class CoPrompt(MaPLe):
    """Consistency-guided Prompt learning (CoPrompt) on MaPLe's prompts."""

    # the grid's default configs (configs/trainers/CoPrompt/<cfg>.yaml; experiments/protocols.py)
    PROTOCOL_CFGS = {
        "base2new": "vit_b16_c2_ep8_batch4_2ctx",
    }

    add_config = staticmethod(add_coprompt_config)

    @classmethod
    def translate_key(cls, key, value, source):
        """CoPrompt's files: ``TRAINER.CoPrompt.*``, ``TRAINER.W``, ``TRAINER.DISTILL``."""
        return translate_coprompt_key(key, value, source)

    @classmethod
    def translate_cfg(cls, cfg):
        """CoPrompt's ``train.py`` after the merge, with ``TRAIN_PY_RULES`` (module docstring)."""
        from engine.config import merge_from_file

        node = cfg.TRAINER.COPROMPT
        if not node.TRAIN_PY_RULES:
            return None
        notes = []
        overlay = _dataset_overlay(cfg.DATASET.NAME)
        if overlay is not None:
            before = {k: node[k] for k in ("PROMPT_DEPTH", "N_CTX", "W")}
            before["MAX_EPOCH"] = cfg.OPTIM.MAX_EPOCH
            merge_from_file(cfg, overlay)
            after = {k: node[k] for k in ("PROMPT_DEPTH", "N_CTX", "W")}
            after["MAX_EPOCH"] = cfg.OPTIM.MAX_EPOCH
            changed = [f"{k} {before[k]} -> {v}" for k, v in after.items() if before[k] != v]
            notes.append(
                f"CoPrompt's train.py values for {cfg.DATASET.NAME} ({overlay}): "
                + (", ".join(changed) or "no change")
                + " (the KEY VALUE options win over them)"
            )
        if not node.DESCRIPTIONS_DIR and osp.isdir(COPROMPT_GPT_FOLDER):
            node.DESCRIPTIONS_DIR = osp.abspath(COPROMPT_GPT_FOLDER)
            notes.append(f"description files: CoPrompt's {node.DESCRIPTIONS_DIR}")
        return notes

    def check_cfg(self, cfg):
        super().check_cfg(cfg)
        node = cfg.TRAINER.COPROMPT
        if cfg.DATALOADER.K_TRANSFORMS < 2:
            raise ValueError(
                "CoPrompt needs two augmented views per image (student and teacher): set "
                f"DATALOADER.K_TRANSFORMS 2 (got {cfg.DATALOADER.K_TRANSFORMS})"
            )
        if node.DISTILL_LOSS not in DISTILL_LOSSES:
            raise ValueError(
                f"TRAINER.COPROMPT.DISTILL_LOSS must be one of {DISTILL_LOSSES}, got "
                f"{node.DISTILL_LOSS!r}"
            )
        for key in ("IMAGE_ADAPTER_RATIO", "TEXT_ADAPTER_RATIO"):
            if not 0.0 <= node[key] <= 1.0:
                raise ValueError(f"TRAINER.COPROMPT.{key} must be in [0, 1], got {node[key]}")
        if node.W < 0:
            raise ValueError(f"TRAINER.COPROMPT.W must be >= 0, got {node.W}")

    MODEL_CLASS = CoPromptCLIP

    def load_descriptions(self) -> None:
        """Encode the classes' descriptions (the teacher's text side) once, when training first
        needs them; evaluation never reads the description files."""
        if self.model.description_features is None:
            self.model.set_descriptions(class_descriptions(self.cfg, self.classnames))

    def before_train(self):
        super().before_train()
        self.load_descriptions()  # a missing description file stops the run before step 1

    # -- the step ---------------------------------------------------------------------------
    def parse_batch_train(self, batch):
        views = batch["img"]
        image, image2 = views[0], views[1]  # K_TRANSFORMS >= 2 (check_cfg)
        dev = self.device
        return (
            image.to(dev, non_blocking=True),
            image2.to(dev, non_blocking=True),
            batch["label"].to(dev, non_blocking=True),
        )

    def draw_description_index(self) -> int:
        """One random description index for all classes (once per step)."""
        self.load_descriptions()
        n_desc = self.model.description_features.shape[1]
        return int(torch.randint(n_desc, ()).item())

    def prepare_step(self, batch_inputs):
        image, image2, label = batch_inputs
        index = self.draw_description_index()
        return {
            "image": image,
            "label": label,
            "image_teacher": self.model.teacher_image_features(image2),  # [batch, dim]
            "text_teacher": self.model.description_features[:, index],  # [n_cls, dim]
            "description_index": index,
        }

    def select_inputs(self, inputs, subset, size):
        """The per-item entries of the prepared inputs (the class-level teacher text features
        and the description index are the batch's, whatever the number of classes)."""
        per_item = ("image", "label", "image_teacher")
        return {k: v[subset] if k in per_item else v for k, v in inputs.items()}

    def distill(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        student, teacher = student.float(), teacher.float()
        if self.cfg.TRAINER.COPROMPT.DISTILL_LOSS == "mse":
            return F.mse_loss(student, teacher)
        return 1.0 - F.cosine_similarity(student, teacher, dim=-1).mean()

    def compute_loss(self, inputs):
        label = inputs["label"]
        prompts = self.model.prompt_learner()
        image_features = self.model.encode_image(inputs["image"], prompts)
        text_features = self.model.encode_text(prompts)
        logits = self.model.logits(image_features, text_features)
        ce = self.classification_loss(logits, label)
        distill = self.distill(text_features, inputs["text_teacher"]) + self.distill(
            image_features, inputs["image_teacher"]
        )
        loss = ce + self.cfg.TRAINER.COPROMPT.W * distill
        return loss, {
            "acc": compute_accuracy(logits, label)[0],
            "ce": ce.detach(),
            "distill": distill.detach(),
        }
