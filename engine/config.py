"""Configuration: Dassl's yacs key tree and defaults, plus this project's keys.

Every key is declared once below with a comment. Trainers add their own ``TRAINER.<NAME>``
node through an ``add_config(cfg)`` function next to the trainer (see ``trainers/coop.py``).

Merging is strict: an unknown key or a value of the wrong type raises :class:`ConfigError`
naming the key, the value, where it came from and the fix (the closest known key, the
expected type). Integers are accepted for float keys and lists for tuple keys.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import os
from collections.abc import Callable

import yaml
from yacs.config import CfgNode as CN

from .errors import ConfigError
from .yaml_files import read_yaml

_C = CN()
_C.VERSION = 1  # config format version (Dassl compatibility)
_C.OUTPUT_DIR = "./output"  # run folder: log.txt, config.yaml, checkpoints, tensorboard/
_C.RESUME = ""  # folder to resume from; empty means OUTPUT_DIR (re-running a run resumes it)
_C.SEED = -1  # random seed for random/numpy/torch; any value >= 0 (0 included) fixes it
_C.USE_CUDA = True  # use the GPU when one is available
_C.VERBOSE = True  # print the dataset summary table and other details
# Reproduction mode (docs/reproducing.md): "paper" trains the method as the paper
# writes it (the config files as they are); "released" emulates the training of the SAMPLe
# authors' released code, behaviour for behaviour (the overlay configs/repro/released.yaml and
# configs/repro/released/<TRAINER>.yaml, merged after the config files; command-line KEY VALUE
# options still win). Set it with train.py --repro MODE or REPRODUCTION MODE.
_C.REPRODUCTION = "paper"
# Modules registering a user's own trainers, dataset readers or optimizers, imported before the
# config is built: .py paths or module names (also train.py --plugin, $SAMPLE_PL_PLUGINS;
# engine/plugins.py). Recorded here so that config.yaml names every plugin a run used.
_C.PLUGINS = []

###########################
# Input
###########################
_C.INPUT = CN()
_C.INPUT.SIZE = (224, 224)  # (height, width) of network inputs
_C.INPUT.INTERPOLATION = "bilinear"  # resize interpolation: bilinear | bicubic | nearest
# train transform names, e.g. (random_resized_crop, random_flip, normalize); all names in
# engine/data/transforms.py (randaugment: Dassl's RandAugment, randaugment_tv: torchvision's)
_C.INPUT.TRANSFORMS = ()
# Where the augmentation runs (engine/data/transforms.py, docs/performance.md#the-input-pipeline):
# "tensor": torchvision's uint8 tensor kernels in the loader workers, which send uint8 images
# that the device converts and normalises (resizes within a few grey levels of PIL's); "pil":
# Dassl's PIL operations and normalisation in the workers, bit for bit (the "released" mode's)
# "tensor_device" (opt-in): tensor with the random resized crop's resize and the flip on the
# device (engine/data/device_crop.py; INPUT.TRANSFORMS random_resized_crop/random_flip/normalize)
_C.INPUT.PIPELINE = "tensor"
_C.INPUT.NO_TRANSFORM = False  # if True, images are only resized/converted (no augmentation)
_C.INPUT.PIXEL_MEAN = [0.485, 0.456, 0.406]  # per-channel mean for "normalize"
_C.INPUT.PIXEL_STD = [0.229, 0.224, 0.225]  # per-channel std for "normalize"
_C.INPUT.CROP_PADDING = 4  # zero padding (pixels) before "random_crop"
_C.INPUT.RRCROP_SCALE = (0.08, 1.0)  # area range of "random_resized_crop"
_C.INPUT.CUTOUT_N = 1  # number of "cutout" holes
_C.INPUT.CUTOUT_LEN = 16  # side (pixels) of each cutout hole
_C.INPUT.GN_MEAN = 0.0  # "gaussian_noise" mean
_C.INPUT.GN_STD = 0.15  # "gaussian_noise" standard deviation
_C.INPUT.RANDAUGMENT_N = 2  # "randaugment"/"randaugment_tv": number of operations
_C.INPUT.RANDAUGMENT_M = 10  # "randaugment"/"randaugment_tv": magnitude (0-30)
_C.INPUT.COLORJITTER_B = 0.4  # "colorjitter" brightness
_C.INPUT.COLORJITTER_C = 0.4  # "colorjitter" contrast
_C.INPUT.COLORJITTER_S = 0.4  # "colorjitter" saturation
_C.INPUT.COLORJITTER_H = 0.1  # "colorjitter" hue
_C.INPUT.RGS_P = 0.2  # "random_gray_scale" probability
_C.INPUT.GB_P = 0.5  # "gaussian_blur" probability
_C.INPUT.GB_K = 21  # "gaussian_blur" kernel size

###########################
# Dataset
###########################
_C.DATASET = CN()
_C.DATASET.ROOT = ""  # folder that holds one sub-folder per dataset (CoOp layout)
_C.DATASET.NAME = ""  # registered dataset name, e.g. DescribableTextures
# DATASET.NAME Folder (your own images, datasets/folder.py, docs/own-dataset.md): the dataset's
# folder under DATASET.ROOT, holding images/<class>/* or train/val/test lists (.csv or .json)
_C.DATASET.FOLDER = ""
# The dataset's hand-crafted prompt template, with one "{}" for the class name (used by zero-shot
# CLIP, KgCoOp, TCP and CoPrompt's fallback teacher). Empty: CoOp's template of the dataset
# (trainers/zsclip.py: CUSTOM_TEMPLATES), "a photo of a {}." for datasets without one (Folder)
_C.DATASET.TEMPLATE = ""
_C.DATASET.SOURCE_DOMAINS = ()  # domain-generalisation sources (unused by prompt learners)
_C.DATASET.TARGET_DOMAINS = ()  # domain-generalisation targets (unused by prompt learners)
_C.DATASET.NUM_LABELED = -1  # semi-supervised: number of labelled images (-1: all)
_C.DATASET.NUM_SHOTS = -1  # few-shot: images per class for train (val gets min(shots, 4)); -1: all
_C.DATASET.VAL_PERCENT = 0.1  # Dassl key, accepted but unused: split files fix the val set
_C.DATASET.SUBSAMPLE_CLASSES = "all"  # base-to-new: all | base (first ceil(n/2)) | new (the rest)
# Unreadable images (truncated, zero-byte, not an image) stop the run before the first step with a
# list of all of them; True leaves them out instead (a warning gives their count and paths)
_C.DATASET.SKIP_UNREADABLE = False

###########################
# Dataloader
###########################
_C.DATALOADER = CN()
_C.DATALOADER.NUM_WORKERS = 4  # worker processes per loader (0: load in the main process)
_C.DATALOADER.K_TRANSFORMS = 1  # number of augmented views returned per training image
_C.DATALOADER.RETURN_IMG0 = False  # also return the un-augmented image as "img0"
# Decode the training images once and keep them in memory as uint8 tensors (augmentation still
# runs every epoch; the batches are identical to decoding every epoch, only faster)
_C.DATALOADER.CACHE_DECODED = True
_C.DATALOADER.CACHE_DECODED_MB = 4096  # memory budget (MB); images beyond it are decoded each time
_C.DATALOADER.TRAIN_X = CN()
_C.DATALOADER.TRAIN_X.SAMPLER = "RandomSampler"  # RandomSampler | SequentialSampler
_C.DATALOADER.TRAIN_X.BATCH_SIZE = 32  # training batch size
# Dassl's drop_last: drop the last partial batch when the training set is larger than the batch
# size (set by the protocols of experiments/protocols.py for the paper grid). False keeps every
# sample
_C.DATALOADER.TRAIN_X.DROP_LAST = False
_C.DATALOADER.TEST = CN()
_C.DATALOADER.TEST.SAMPLER = "SequentialSampler"  # sampler of val/test loaders
_C.DATALOADER.TEST.BATCH_SIZE = 32  # evaluation batch size

###########################
# Model
###########################
_C.MODEL = CN()
_C.MODEL.INIT_WEIGHTS = ""  # optional checkpoint to initialise the learnable modules from
_C.MODEL.BACKBONE = CN()
_C.MODEL.BACKBONE.NAME = ""  # CLIP architecture: CoOp names (ViT-B/16, RN50, ...) or open_clip
_C.MODEL.BACKBONE.PRETRAINED = True  # False: random weights (tests and debugging only)
# CLIP weights file: OpenAI checkpoint (TorchScript or state dict) or open_clip checkpoint. Empty:
# ~/.cache/clip/<name>.pt (OpenAI's names; downloaded from OpenAI's address, or
# $SAMPLE_PL_CLIP_MIRROR, on first use and checked against its SHA256), else open_clip's cache
# (downloaded through open_clip). HF_HUB_OFFLINE=1 or SAMPLE_PL_OFFLINE=1: no download. See
# docs/weights.md
_C.MODEL.BACKBONE.PATH = ""
# Download the weights from this address instead (an internal mirror, a file server; http(s):// or
# file://), once, into ~/.cache/clip/sha256-<first 16 digits of SHA256>/<file name>; needs SHA256
_C.MODEL.BACKBONE.URL = ""
# SHA256 of the file at MODEL.BACKBONE.URL (64 hex digits, as `sha256sum FILE` prints): checked
# after the download and before each use; a mismatch is an error and keeps nothing
_C.MODEL.BACKBONE.SHA256 = ""
_C.MODEL.BACKBONE.CONFIG = ""  # path to an open_clip model-config JSON (custom/tiny architectures)
# torch.compile the prompt-dependent encoders: auto (reduce-overhead when training on a GPU,
# off on CPU and for evaluation-only runs) | "" or off | default | reduce-overhead |
# max-autotune | max-autotune-no-cudagraphs | eager | aot_eager (see engine/compile.py)
_C.MODEL.COMPILE = "auto"
# Memory of the class-prompt text encoding (engine/clip/text.py; docs/backbones.md has the table).
# TEXT_CHUNK: class prompts per pass through the text tower (0: all at once). CHECKPOINT_TEXT:
# each chunk is an activation checkpoint while training (its activations are recomputed in the
# backward instead of kept). Both together (e.g. 100 and True) bound the text side of a
# training step by about one chunk's activations (1,000 ImageNet classes on a small GPU); a
# chunk alone lowers only the peak of no-grad encoding, checkpointing alone only frees the
# activations between forward and backward. Results are unchanged up to fp32 rounding. A text
# encoder with either option on runs eagerly (MODEL.COMPILE still compiles the image encoders)
_C.MODEL.TEXT_CHUNK = 0  # class prompts per pass through the text tower (0: all at once)
_C.MODEL.CHECKPOINT_TEXT = False  # recompute each text chunk's activations in the backward
# SHARED_PREFIX: the class prompts' common prefix (CoOp's [SOS][ctx], the same in every prompt)
# goes through the causal text tower once in every pass, training included, instead of once per
# class; the last block runs at the EOT token only. Same outputs and gradients up to fp32
# rounding, a fraction of the text encoder's work and activations (engine/clip/text.py). Off:
# only an optimizer's no-gradient look at the outputs (MESA, ESAM) shares the prefix. Runs the
# text encoder eagerly, as the options above
_C.MODEL.SHARED_PREFIX = False
# "auto": the three keys above chosen at build for the model's class prompts and the free memory
# (GPU or host): the fastest variant whose estimated text activations fit (engine/clip/
# text_memory.py; docs/backbones.md). TEXT_CHUNK then sets the chunk size (0: 100); leave
# CHECKPOINT_TEXT and SHARED_PREFIX False. "": the keys as set
_C.MODEL.TEXT_MEMORY = ""
# TEXT_FULL_LENGTH: class prompts and frozen texts keep all 77 tokens instead of being cut after
# the longest EOT: the same features and steps, bit for bit, at the reference code bases' cost
# (tools/benchmark.py's reference rows; read where the model is built, engine/clip/text.py)
_C.MODEL.TEXT_FULL_LENGTH = False
_C.MODEL.HEAD = CN()
_C.MODEL.HEAD.NAME = ""  # Dassl compatibility (unused by prompt learners)
_C.MODEL.HEAD.HIDDEN_LAYERS = ()  # Dassl compatibility
_C.MODEL.HEAD.ACTIVATION = "relu"  # Dassl compatibility
_C.MODEL.HEAD.BN = True  # Dassl compatibility
_C.MODEL.HEAD.DROPOUT = 0.0  # Dassl compatibility

###########################
# Optimization
###########################
_C.OPTIM = CN()
_C.OPTIM.NAME = "adam"  # base optimizer: sgd | adam | adamw | amsgrad | rmsprop | radam
_C.OPTIM.LR = 0.0003  # base learning rate
_C.OPTIM.WEIGHT_DECAY = 5e-4  # L2 weight decay (part of the base optimizer's step)
_C.OPTIM.MOMENTUM = 0.9  # SGD momentum
_C.OPTIM.SGD_DAMPNING = 0  # SGD dampening (Dassl's spelling, kept for config compatibility)
_C.OPTIM.SGD_NESTEROV = False  # SGD Nesterov momentum
_C.OPTIM.RMSPROP_ALPHA = 0.99  # RMSprop smoothing constant
_C.OPTIM.ADAM_BETA1 = 0.9  # Adam beta1
_C.OPTIM.ADAM_BETA2 = 0.999  # Adam beta2
_C.OPTIM.ADAM_EPS = 1e-8  # Adam epsilon (TCP uses 1e-3)
_C.OPTIM.STAGED_LR = False  # different LRs for NEW_LAYERS and the rest
_C.OPTIM.NEW_LAYERS = ()  # with STAGED_LR: child-module names trained at the full LR
_C.OPTIM.BASE_LR_MULT = 0.1  # with STAGED_LR: LR multiplier of the other layers
_C.OPTIM.LR_SCHEDULER = "single_step"  # single_step | multi_step | cosine
_C.OPTIM.STEPSIZE = (-1,)  # single_step: (step,) ; multi_step: milestones (epochs)
_C.OPTIM.GAMMA = 0.1  # decay factor of step schedulers
_C.OPTIM.MAX_EPOCH = 10  # number of training epochs
_C.OPTIM.WARMUP_EPOCH = -1  # warmup epochs (<= 0: no warmup)
_C.OPTIM.WARMUP_TYPE = "linear"  # constant | linear
_C.OPTIM.WARMUP_CONS_LR = 1e-5  # LR during constant warmup
_C.OPTIM.WARMUP_MIN_LR = 1e-5  # start LR of linear warmup
_C.OPTIM.WARMUP_RECOUNT = True  # restart the main schedule's epoch count after warmup
# The released SAMPLe trainers' LR stepping: while the sharpness-aware optimizer steps, the LR
# scheduler also steps after every batch (on top of the step at the end of each epoch), so the
# epoch-based schedule advances batches + 1 times per epoch (the `released` reproduction mode)
_C.OPTIM.LR_STEP_PER_BATCH = False
# Sharpness-aware wrapper around the base optimizer (see optim/ and docs/optimizers.md).
_C.OPTIM.SAM = CN()
# "" (plain base optimizer) | sam | fsam | sagm | sample | looksam | esam | rwp | mrwp | saf | mesa
_C.OPTIM.SAM.NAME = ""
# The optimizers' hyper-parameters (RHO, ALPHA, LAMBDA, ..., VARIANT, SCHEDULE: one key per
# HParam) are declared next to each optimizer in optim/ (its HParam: key, default, help, range)
# and added to this node by get_base_cfg_default() (listed in docs/optimizers.md)
# Staged training (optim/staging.py). The paper's two stages: with STAGE2_EPOCHS > 0, stage 1 is
# the trainer's whole published schedule (OPTIM.MAX_EPOCH epochs, warmup and LR schedule
# included) with the base optimizer on all learnable parameters; stage 2 ADDS STAGE2_EPOCHS
# epochs after MAX_EPOCH (a run trains MAX_EPOCH + STAGE2_EPOCHS epochs and saves
# model.pth.tar-<MAX_EPOCH + STAGE2_EPOCHS>) in which the sharpness-aware optimizer steps, the
# parameters matching a FREEZE pattern (fnmatch, e.g. "*proj*") stop training, and the LR
# follows a cosine from STAGE2_LR to 0 over the stage-2 epochs (no warmup).
# Alternatively START_EPOCH > 0 switches inside the published schedule (no added epochs).
# Parameters are only ever frozen after at least one full-LR epoch (refused otherwise).
_C.OPTIM.SAM.START_EPOCH = 0  # first epoch (0-based) of the sharpness-aware stage (no stage 2)
_C.OPTIM.SAM.FREEZE = ()  # parameter-name patterns frozen when the sharpness-aware stage starts
_C.OPTIM.SAM.STAGE2_EPOCHS = 0  # epochs of stage 2, added after MAX_EPOCH (0: no stage 2)
_C.OPTIM.SAM.STAGE2_LR = 0.0  # stage 2's initial LR (cosine to 0); 0: OPTIM.LR

###########################
# Train
###########################
_C.TRAIN = CN()
_C.TRAIN.CHECKPOINT_FREQ = 0  # save a checkpoint every N epochs (0: only the last epoch)
_C.TRAIN.PRINT_FREQ = 10  # print the progress line every N batches
_C.TRAIN.COUNT_ITER = "train_x"  # Dassl compatibility: which loader defines an epoch

###########################
# Test
###########################
_C.TEST = CN()
_C.TEST.EVALUATOR = "Classification"  # registered evaluator name
_C.TEST.PER_CLASS_RESULT = False  # also print per-class accuracies
_C.TEST.COMPUTE_CMAT = False  # also save the confusion matrix (cmat.pt)
_C.TEST.NO_TEST = False  # skip the final test after training
_C.TEST.SPLIT = "test"  # split for the final evaluation: test | val
_C.TEST.FINAL_MODEL = "last_step"  # model to test after training: last_step | best_val
# Trainers with a frozen image encoder (zero-shot CLIP, CoOp, CoCoOp, TCP) reuse the evaluation
# images' features from an on-disk cache keyed by the CLIP weights' hash, precision, dataset,
# split, image list and test transform; a changed key never reuses a stale cache.
_C.TEST.FEATURE_CACHE = True
_C.TEST.FEATURE_CACHE_DIR = ""  # empty: $SAMPLE_PL_CACHE/eval_features (~/.cache/sample-pl/...)

###########################
# Data-parallel runs (torchrun / srun; docs/distributed.md)
###########################
_C.DISTRIBUTED = CN()
# m-sharpness: the first pass of a two-pass (sharpness-aware) step is not all-reduced, so each
# process climbs along its own shard's gradient (another method; default: the 1-process ascent)
_C.DISTRIBUTED.LOCAL_ASCENT = False
_C.DISTRIBUTED.TIMEOUT = 300  # seconds a collective waits for a silent process before failing
_C.DISTRIBUTED.BACKEND = ""  # "": nccl on GPUs, gloo on CPU; or "gloo" / "nccl"

###########################
# Trainer
###########################
_C.TRAINER = CN()
_C.TRAINER.NAME = ""  # registered trainer name (set by --trainer)


def get_base_cfg_default() -> CN:
    """Dassl's defaults plus this project's engine keys (and the OPTIM.SAM keys registered
    optimizers declare), without any trainer's node."""
    from optim import add_optimizer_keys

    cfg = _C.clone()
    add_optimizer_keys(cfg)
    return cfg


def get_cfg_default() -> CN:
    """The full default config: engine keys plus every registered trainer's ``TRAINER.<X>`` node.

    Like Dassl's ``get_cfg_default``, but already extended with the registered trainers' keys so
    that any trainer config file merges into it. Trainers register when their package is imported
    (``import trainers``; train.py and the tools do it); the engine never imports them itself.
    """
    from .registry import TRAINER_REGISTRY

    cfg = get_base_cfg_default()
    for name in TRAINER_REGISTRY:
        TRAINER_REGISTRY.get(name).add_config(cfg)
    return cfg


# ----------------------------------------------------------------------------------------------
# Strict merging
# ----------------------------------------------------------------------------------------------
def _all_keys(cfg: CN, prefix: str = "") -> list[str]:
    keys = []
    for k, v in cfg.items():
        full = f"{prefix}{k}"
        keys.append(full)
        if isinstance(v, CN):
            keys.extend(_all_keys(v, full + "."))
    return keys


def _unknown_key(cfg: CN, full_key: str, source: str) -> ConfigError:
    from .neighbour_keys import close_key, foreign_key_error, neighbour_layout_error

    foreign = foreign_key_error(full_key, source) or neighbour_layout_error(full_key, source)
    if foreign is not None:
        return foreign
    known = _all_keys(cfg)
    if full_key.startswith("TRAINER."):
        close = close_key(known, full_key)  # never another trainer's node
    else:
        engine_keys = [k for k in known if not k.startswith("TRAINER.")]
        found = difflib.get_close_matches(full_key, engine_keys, n=1, cutoff=0.6)
        close = found[0] if found else None
    hint = f" (do you mean {close}?)" if close else ""
    node = full_key.rsplit(".", 1)[0] if "." in full_key else ""
    if node.startswith("TRAINER.") and node not in known:
        hint += " Trainer keys exist once the trainer is registered; check --trainer."
    return ConfigError(f"Unknown config key '{full_key}' in {source}{hint}")


_TYPE_NAMES = {bool: "a bool", int: "an int", float: "a float", str: "a string"}


def _coerce(value, default, full_key: str, source: str):
    """Return ``value`` converted to the type of ``default``, or raise ConfigError."""
    if default is None or value is None:
        return value
    dtype = type(default)
    if isinstance(value, str) and dtype is not str:
        # values from the command line arrive as strings: parse them as Python literals
        low = value.strip().lower()
        if dtype is bool and low in ("true", "false"):
            value = low == "true"
        else:
            with contextlib.suppress(ValueError, SyntaxError):
                value = ast.literal_eval(value)
    if dtype is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if dtype in (tuple, list) and isinstance(value, (tuple, list)):
        return dtype(value)
    if dtype in (tuple, list) and isinstance(value, str | int | float):
        return dtype([value])  # a single value for a sequence key
    if isinstance(value, dtype) and not (dtype is int and isinstance(value, bool)):
        return value
    expected = _TYPE_NAMES.get(dtype, f"a {dtype.__name__}")
    raise ConfigError(
        f"Config key {full_key} expects {expected} (default {default!r}), got {value!r} "
        f"({type(value).__name__}) from {source}"
    )


def _set_key(cfg: CN, full_key: str, value, source: str) -> None:
    node = cfg
    parts = full_key.split(".")
    for part in parts[:-1]:
        if part not in node or not isinstance(node[part], CN):
            raise _unknown_key(cfg, full_key, source)
        node = node[part]
    leaf = parts[-1]
    if leaf not in node:
        raise _unknown_key(cfg, full_key, source)
    if isinstance(node[leaf], CN):
        if not isinstance(value, dict):
            raise ConfigError(f"Config key {full_key} is a group of keys; set its sub-keys")
        for k, v in value.items():
            _set_key(cfg, f"{full_key}.{k}", v, source)
        return
    node[leaf] = _coerce(value, node[leaf], full_key, source)


# A key translation (see TrainerBase.translate_key): ``(full key, value, source)`` -> the
# ``(key, value)`` pairs to merge instead (none: the key is dropped).
Translate = Callable[[str, object, str], list]


def _leaves(values: dict, prefix: str = ""):
    """``(full key, value)`` of every non-mapping value of a nested dict."""
    for k, v in values.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _leaves(v, key + ".")
        else:
            yield key, v


def _merge_pairs(cfg: CN, pairs, source: str, translate: Translate | None, notes) -> None:
    for key, value in pairs:
        if translate is None:
            _set_key(cfg, key, value, source)
            continue
        moved = list(translate(key, value, source))
        for new_key, new_value in moved:
            _set_key(cfg, new_key, new_value, source)
        if notes is not None and moved != [(key, value)]:
            to = ", ".join(f"{k} {_shown(v)}" for k, v in moved) or "dropped (unused)"
            notes.append(f"{key} {_shown(value)} ({source}) -> {to}")


def _shown(value) -> str:
    """A value as a log line shows it: words quoted, the rest as written."""
    return repr(value) if isinstance(value, str) and (" " in value or not value) else str(value)


def merge_from_dict(
    cfg: CN,
    values: dict,
    source: str = "a dict",
    translate: Translate | None = None,
    notes: list | None = None,
) -> None:
    """Merge a nested dict into ``cfg`` with the strict checks.

    Args:
        translate: maps each leaf ``(key, value, source)`` to the pairs merged instead (another
            code base's keys, :meth:`engine.trainer.TrainerBase.translate_key`).
        notes: receives one line per translated key (``old -> new``), for the run's log.
    """
    if translate is None:
        for k, v in values.items():
            _set_key(cfg, str(k), v, source)
        return
    _merge_pairs(cfg, _leaves(values), source, translate, notes)


def merge_from_file(
    cfg: CN, path: str, translate: Translate | None = None, notes: list | None = None
) -> None:
    """Merge a YAML file into ``cfg``; a missing file or bad key/type raises ConfigError.
    ``translate``/``notes``: see :func:`merge_from_dict`."""
    if not os.path.isfile(path):
        raise ConfigError(f"Config file not found: {path}")
    try:
        values = read_yaml(path) or {}  # parsed once per unchanged file in a packed worker
    except yaml.YAMLError as e:
        raise ConfigError(f"Config file {path} is not valid YAML: {e}") from e
    if not isinstance(values, dict):
        raise ConfigError(f"Config file {path} must hold a mapping of keys, not {type(values)}")
    merge_from_dict(cfg, values, f"config file {path}", translate, notes)


def merge_from_list(
    cfg: CN,
    opts: list[str],
    source: str = "the command line",
    translate: Translate | None = None,
    notes: list | None = None,
) -> None:
    """Merge ``[KEY, VALUE, KEY, VALUE, ...]`` (train.py's trailing options) into ``cfg``.
    ``translate``/``notes``: see :func:`merge_from_dict`."""
    if len(opts) % 2 != 0:
        raise ConfigError(
            f"Options from {source} must come in KEY VALUE pairs; got an odd number: {opts}"
        )
    _merge_pairs(cfg, zip(opts[0::2], opts[1::2]), source, translate, notes)


def _printable_ascii(value) -> bool:
    """Whether every string in ``value`` (nested dicts, lists, tuples) is printable ASCII."""
    if isinstance(value, str):
        return value.isascii() and value.isprintable()
    if isinstance(value, dict):
        return all(_printable_ascii(k) and _printable_ascii(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_printable_ascii(v) for v in value)
    return True


def cfg_yaml(cfg: CN) -> str:
    """The YAML text of ``cfg``: yacs' ``cfg.dump()``, written by libyaml's emitter when PyYAML
    has it and every string is printable ASCII (then the same text, about 5x faster: every run
    writes its config.yaml; tests/test_run_caches.py compares them). Other strings are escaped
    and folded otherwise by libyaml, so yacs' own dump writes those configs."""
    dumper = getattr(yaml, "CSafeDumper", None)

    def as_dict(node):
        return {k: as_dict(v) for k, v in node.items()} if isinstance(node, CN) else node

    values = as_dict(cfg)
    if dumper is None or not _printable_ascii(values):
        return cfg.dump()
    return yaml.dump(values, Dumper=dumper)


def dump_cfg(cfg: CN, path: str) -> None:
    """Write ``cfg`` as YAML to ``path`` atomically."""
    from .utils import atomic_write_text

    atomic_write_text(path, cfg_yaml(cfg))
