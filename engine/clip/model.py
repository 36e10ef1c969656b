"""Building CLIP (open_clip_torch models) and reading its weights.

``MODEL.BACKBONE.NAME`` takes CoOp's names ("ViT-B/16", "ViT-B/32", "RN50", ...), open_clip
architecture names ("ViT-B-16"), ``arch:tag`` ("ViT-B-16:laion2b_s34b_b88k") or
``hf-hub:org/name``. Weights come from (:func:`ensure_weights`; docs/weights.md)

1. ``MODEL.BACKBONE.PATH``: an OpenAI checkpoint (TorchScript archive or plain state dict) or an
   open_clip checkpoint (state dict, optionally under "state_dict", with or without "module.");
2. ``MODEL.BACKBONE.URL`` (with ``MODEL.BACKBONE.SHA256``): downloaded once into ~/.cache/clip;
3. else ``~/.cache/clip/<name>.pt``, where OpenAI's clip package keeps its downloads (checked
   against its SHA256; downloaded from OpenAI's address, or ``$SAMPLE_PL_CLIP_MIRROR``, when
   missing or damaged);
4. else open_clip's Hugging Face cache for the architecture and tag (downloaded through
   open_clip/huggingface_hub when missing).

With ``HF_HUB_OFFLINE=1`` or ``SAMPLE_PL_OFFLINE=1`` nothing is downloaded (engine/clip/weights.py
does the downloads). ``MODEL.BACKBONE.CONFIG`` points to an open_clip model-config JSON for custom
or tiny architectures. OpenAI weights use QuickGELU, as they were trained with it.

Precision: "fp16" stores the weights in half precision the way OpenAI's clip package does
(linear/conv/attention weights fp16; layer norms computed in fp32); every other mode keeps fp32
weights (autocast does the rest).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import logging
import os
import os.path as osp
import sys
import warnings
import zipfile

import torch

from engine import phases
from engine.errors import ConfigError

from . import tower_cache, weights
from .weights import BackboneError

logger = logging.getLogger(__name__)

# Libraries that open_clip imports at its own import time for towers this project does not use:
# transformers (Hugging Face text towers, ~8 s on the H200 machine when installed) and timm (timm
# vision towers, ~0.4 s on CPU). They are hidden while open_clip is imported; open_clip's modules
# then keep ``transformers = None`` / ``timm = None`` until a model config asks for such a tower
# (:func:`_enable_towers` imports the library then).
_OPTIONAL_TOWER_LIBRARIES = ("transformers", "timm")
# huggingface_hub (and its HTTP client, ~0.15 s of every start-up) is hidden the same way: open_clip
# then keeps ``hf_hub_download = None``, which only its own Hugging Face downloads use; this
# project fetches Hugging Face files itself (engine.clip.weights.hf_hub_file imports it there).
_HIDDEN_AT_IMPORT = (*_OPTIONAL_TOWER_LIBRARIES, "huggingface_hub")


# the attribute of a CLIP built by load_clip that holds its config's MODEL.TEXT_FULL_LENGTH (read
# by engine.clip.text.keeps_full_length where prompts are built)
FULL_LENGTH_ATTR = "text_full_length"


def _import_open_clip():
    """``import open_clip`` without importing transformers, timm or huggingface_hub (unless
    already imported)."""
    if "open_clip" in sys.modules:
        return sys.modules["open_clip"]
    hidden = [m for m in _HIDDEN_AT_IMPORT if m not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # ``import name`` raises ImportError: open_clip's fallbacks
    try:
        import open_clip
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
    return open_clip


open_clip = _import_open_clip()
from open_clip.model import (  # noqa: E402
    CLIP,
    build_model_from_openai_state_dict,
    convert_weights_to_lp,
)


def _enable_towers(model_cfg: dict) -> None:
    """Import the library of a timm vision tower or Hugging Face text tower that ``model_cfg``
    asks for (re-executing the open_clip adapter module that was imported without it)."""
    wanted = {
        "timm": ("open_clip.timm_model", model_cfg.get("vision_cfg", {}).get("timm_model_name")),
        "transformers": ("open_clip.hf_model", model_cfg.get("text_cfg", {}).get("hf_model_name")),
    }
    for library, (module_name, asked) in wanted.items():
        module = sys.modules.get(module_name)
        if asked and module is not None and getattr(module, library, None) is None:
            importlib.reload(module)  # its classes read the library from the module's globals


# CoOp / OpenAI clip names -> (open_clip architecture, file name in ~/.cache/clip)
OPENAI_MODELS = {
    "RN50": ("RN50", "RN50.pt"),
    "RN101": ("RN101", "RN101.pt"),
    "RN50x4": ("RN50x4", "RN50x4.pt"),
    "RN50x16": ("RN50x16", "RN50x16.pt"),
    "RN50x64": ("RN50x64", "RN50x64.pt"),
    "ViT-B/32": ("ViT-B-32", "ViT-B-32.pt"),
    "ViT-B/16": ("ViT-B-16", "ViT-B-16.pt"),
    "ViT-L/14": ("ViT-L-14", "ViT-L-14.pt"),
    "ViT-L/14@336px": ("ViT-L-14-336", "ViT-L-14-336px.pt"),
}
_ARCH_TO_OPENAI_FILE = {arch: fname for arch, fname in OPENAI_MODELS.values()}
_CLIP_KWARGS = (
    "embed_dim",
    "vision_cfg",
    "text_cfg",
    "quick_gelu",
    "init_logit_scale",
    "init_logit_bias",
    "nonscalar_logit_scale",
)


REPO_ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))


def resolve_path(path: str) -> str:
    """``path`` with ``~`` expanded; a relative path that does not exist from the current folder
    is taken relative to the repository (so shipped assets work from any folder)."""
    path = osp.expanduser(path)
    if not osp.isabs(path) and not osp.exists(path):
        candidate = osp.join(REPO_ROOT, path)
        if osp.exists(candidate):
            return candidate
    return path


HF_HUB_PREFIX = "hf-hub:"
HF_WEIGHT_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")


class BackboneRefused(BackboneError, ConfigError):
    """A configured backbone that the trainer cannot use, refused before anything is loaded
    (both a :class:`BackboneError` and a :class:`~engine.errors.ConfigError`)."""


def resolve_name(name: str) -> tuple[str, str]:
    """``(open_clip architecture, pretrained tag)`` for a backbone name (``hf-hub:org/name``:
    ``("hf-hub:org/name", "")``)."""
    if name.startswith(HF_HUB_PREFIX):
        return name, ""
    if name in OPENAI_MODELS:
        return OPENAI_MODELS[name][0], "openai"
    if ":" in name:
        arch, tag = name.split(":", 1)
        return arch, tag
    return name, "openai"


def _model_config(cfg) -> tuple[dict, str]:
    path = cfg.MODEL.BACKBONE.CONFIG
    if path:
        path = resolve_path(path)
        if not osp.isfile(path):
            raise BackboneError(f"MODEL.BACKBONE.CONFIG file not found: {path}")
        with open(path) as f:
            model_cfg = json.load(f)
        return model_cfg, path
    name = cfg.MODEL.BACKBONE.NAME
    if not name:
        raise BackboneError(
            "MODEL.BACKBONE.NAME is empty: set it (e.g. ViT-B/16) or give MODEL.BACKBONE.CONFIG"
        )
    if name.startswith(HF_HUB_PREFIX):  # the repository's open_clip_config.json
        repo = name[len(HF_HUB_PREFIX) :]
        found = weights.hf_hub_file(repo, ("open_clip_config.json",), name, download=True)
        with open(found) as f:
            hub_cfg = json.load(f)
        return copy.deepcopy(hub_cfg.get("model_cfg", hub_cfg)), name
    arch, tag = resolve_name(name)
    model_cfg = open_clip.get_model_config(arch)
    if model_cfg is None:
        raise BackboneError(
            f"Unknown CLIP architecture '{name}'. CoOp names: {', '.join(OPENAI_MODELS)}; "
            f"open_clip names: see open_clip.list_models(); or give MODEL.BACKBONE.CONFIG"
        )
    model_cfg = copy.deepcopy(model_cfg)
    pcfg = open_clip.get_pretrained_cfg(arch, tag) or {}
    if pcfg.get("quick_gelu") or tag == "openai":
        model_cfg["quick_gelu"] = True
    return model_cfg, arch


def vision_tower_kind(cfg) -> str | None:
    """``"vit"`` or ``"resnet"``: the image tower that ``cfg.MODEL.BACKBONE`` (NAME or CONFIG)
    describes, read from its model config without building anything; None when it cannot be
    told before loading (only a weights file, or a timm tower)."""
    bb = cfg.MODEL.BACKBONE
    if not (bb.CONFIG or bb.NAME):
        return None
    try:
        model_cfg, _ = _model_config(cfg)
    except BackboneError:  # load_clip reports it with the places searched
        return None
    vision = model_cfg.get("vision_cfg", {})
    if vision.get("timm_model_name"):
        return None
    return "resnet" if isinstance(vision.get("layers"), (list, tuple)) else "vit"


def backbone_label(cfg) -> str:
    """How messages name the backbone: MODEL.BACKBONE.NAME, else its CONFIG or PATH file."""
    bb = cfg.MODEL.BACKBONE
    return bb.NAME or bb.CONFIG or bb.PATH or "(none)"


def check_input_size(cfg, model: torch.nn.Module) -> None:
    """Raise ConfigError when ``INPUT.SIZE`` differs from the image size of the first CLIP image
    tower in ``model``: a ViT's (and a ResNet's attention pool's) positional embeddings fit one
    size only."""
    from open_clip.modified_resnet import ModifiedResNet
    from open_clip.transformer import VisionTransformer

    for module in model.modules():
        if isinstance(module, VisionTransformer):
            size = tuple(module.image_size)
        elif isinstance(module, ModifiedResNet):
            size = (module.image_size, module.image_size)
        else:
            continue
        if tuple(cfg.INPUT.SIZE) != size:
            raise ConfigError(
                f"INPUT.SIZE {tuple(cfg.INPUT.SIZE)} differs from the CLIP image size {size} of "
                f"the backbone {backbone_label(cfg)}, whose positional embeddings fit that size "
                f"only: set INPUT.SIZE '{size}' (e.g. ViT-L/14@336px takes (336, 336), RN50x4 "
                "(288, 288), RN50x16 (384, 384), RN50x64 (448, 448))"
            )
        return


def find_weights(cfg) -> tuple[str | None, list[str]]:
    """The weights file to load and the list of places searched."""
    searched = []
    path = cfg.MODEL.BACKBONE.PATH
    if path:
        path = resolve_path(path)
        if osp.isfile(path):
            return path, [path]
        raise BackboneError(f"MODEL.BACKBONE.PATH does not exist: {path}")
    url = cfg.MODEL.BACKBONE.URL
    if url:
        cand = weights.url_cache_path(url, cfg.MODEL.BACKBONE.SHA256)
        return (cand if osp.isfile(cand) else None), [cand]
    name = cfg.MODEL.BACKBONE.NAME
    if not name:
        return None, searched
    if name.startswith(HF_HUB_PREFIX):
        repo = name[len(HF_HUB_PREFIX) :]
        searched.extend(f"Hugging Face cache: {repo}/{f}" for f in HF_WEIGHT_FILES)
        return weights.hf_hub_file(repo, HF_WEIGHT_FILES, name, download=False), searched
    arch, tag = resolve_name(name)
    if tag == "openai" and arch in _ARCH_TO_OPENAI_FILE:
        cand = osp.join(weights.clip_cache_dir(), _ARCH_TO_OPENAI_FILE[arch])
        searched.append(cand)
        if osp.isfile(cand):
            return cand, searched
    pcfg = open_clip.get_pretrained_cfg(arch, tag) or {}
    hub = pcfg.get("hf_hub", "")
    if hub:
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:  # pragma: no cover
            try_to_load_from_cache = None
        repo = hub.rstrip("/")
        for fname in ("open_clip_model.safetensors", "open_clip_pytorch_model.bin"):
            searched.append(f"Hugging Face cache: {repo}/{fname}")
            if try_to_load_from_cache is not None:
                found = try_to_load_from_cache(repo, fname)
                if isinstance(found, str) and osp.isfile(found):
                    return found, searched
    if pcfg.get("url"):
        cand = osp.join(weights.clip_cache_dir(), osp.basename(pcfg["url"]))
        if cand not in searched:
            searched.append(cand)
            if osp.isfile(cand):
                return cand, searched
    return None, searched


def ensure_weights(cfg) -> str | None:
    """The weights file of ``cfg.MODEL.BACKBONE``, downloaded when it is missing or damaged.

    ``MODEL.BACKBONE.PATH`` is taken as it is; ``MODEL.BACKBONE.URL`` is fetched into the cache;
    OpenAI's names are checked against their SHA256 in ``~/.cache/clip`` (open_clip's Hugging Face
    cache is used when it holds them and ``~/.cache/clip`` does not) and downloaded when missing;
    other open_clip tags come from open_clip's cache or through open_clip. Returns None only when
    there is nothing to fetch (no name, URL or path). Raises :class:`BackboneError` (a
    :class:`~engine.clip.weights.DownloadError` when a file cannot be fetched).
    """
    bb = cfg.MODEL.BACKBONE
    if bb.URL:
        if bb.PATH:
            raise BackboneError(
                f"MODEL.BACKBONE.PATH ({bb.PATH}) and MODEL.BACKBONE.URL ({bb.URL}) are both set: "
                "keep the one the weights should come from"
            )
        return weights.fetch_url(bb.URL, bb.SHA256)
    path, _ = find_weights(cfg)
    name = bb.NAME
    if bb.PATH or not name:
        return path
    if name.startswith(HF_HUB_PREFIX):  # the repository's model config and weights
        repo = name[len(HF_HUB_PREFIX) :]
        weights.hf_hub_file(repo, ("open_clip_config.json",), name, download=True)
        return path or weights.hf_hub_file(repo, HF_WEIGHT_FILES, name, download=True)
    arch, tag = resolve_name(name)
    openai_file = _ARCH_TO_OPENAI_FILE.get(arch) if tag == "openai" else None
    if openai_file and (path is None or path == osp.join(weights.clip_cache_dir(), openai_file)):
        return weights.fetch_openai(openai_file, name)  # checks (or fetches) the cached copy
    if path:
        return path
    pcfg = open_clip.get_pretrained_cfg(arch, tag)
    if not pcfg:
        tags = ", ".join(open_clip.list_pretrained_tags_by_model(arch)) or "none"
        raise BackboneError(
            f"open_clip has no pretrained weights {name!r} (tags of {arch}: {tags}). Give "
            "MODEL.BACKBONE.NAME as arch:tag, MODEL.BACKBONE.PATH or MODEL.BACKBONE.URL"
        )
    return weights.fetch_open_clip(pcfg, name)


class UnusableWeightsError(BackboneError):
    """A weights file that is not a usable checkpoint (empty, truncated, refused)."""

    def __init__(self, path: str, reason: str):
        super().__init__(
            f"The CLIP weights file {path} is not a usable checkpoint: {reason}. It may be cut "
            "short by an interrupted copy or download, damaged, or not a CLIP checkpoint at all. "
            "Delete it and fetch it again (`python tools/download_weights.py NAME` for a name in "
            "MODEL.BACKBONE.NAME; the download checks the file's SHA256), or point "
            "MODEL.BACKBONE.PATH to a good copy."
        )


def _first_line(error: Exception) -> str:
    """The first sentence of an error message (readers' messages run over several lines)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0].split(". ")[0].rstrip(":. ") if lines else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def read_state_dict(path: str) -> tuple[dict, bool]:
    """Read a CLIP checkpoint; returns ``(state_dict, is_torchscript)``.

    A file that cannot be read raises :class:`UnusableWeightsError` (one paragraph naming the file
    and the fix). TorchScript archives are read with the TorchScript reader, which refuses
    archives that refer to anything but TorchScript types and tensors (a crafted file).
    """
    if osp.getsize(path) == 0:
        raise UnusableWeightsError(path, "the file is empty (0 bytes)")
    try:
        return _read_state_dict(path)
    except BackboneError:
        raise
    except Exception as e:
        raise UnusableWeightsError(path, _first_line(e)) from None


def _read_state_dict(path: str) -> tuple[dict, bool]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path), False
    if is_torchscript(path):  # OpenAI's released checkpoints are TorchScript archives
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                jit = torch.jit.load(path, map_location="cpu")
            except RuntimeError as e:
                reason = f"the TorchScript reader refused it ({_first_line(e)}): damaged or crafted"
                raise UnusableWeightsError(path, reason) from None
        return {k: v for k, v in jit.state_dict().items()}, True
    # a zip-format file (torch.save's default) is mapped, not read: its tensors are the file's
    # pages, which load_state_dict copies once into the model (and the page cache shares them
    # between the processes that read the file)
    obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
    if not isinstance(obj, dict):
        raise BackboneError(f"{path} does not hold a state dict")
    sd = {(k[7:] if k.startswith("module.") else k): v for k, v in obj.items()}
    return sd, False


# Weights kept in memory between runs of one process (engine/runner.py turns it on): the
# checkpoint read is paid once per process, while every run still builds its own CLIP (the
# random initialisation draws from the seeded RNG exactly as in a fresh process).
_STATE_DICT_CACHE: dict = {}
_cache_enabled = False


def cache_weights(enabled: bool = True) -> None:
    """Keep the last CLIP checkpoint read in memory (keyed by its path, size and modification
    time), so later runs of this process skip the read. Off by default (a single run would only
    hold the memory); ``enabled=False`` also empties the cache."""
    global _cache_enabled
    _cache_enabled = enabled
    if not enabled:
        _STATE_DICT_CACHE.clear()


def _read_weights(path: str) -> tuple[dict, bool]:
    """:func:`read_state_dict`, from the cache when it is on (a shallow copy: callers may drop
    keys; the tensors are only read)."""
    if not _cache_enabled:
        return read_state_dict(path)
    st = os.stat(path)
    key = (osp.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _STATE_DICT_CACHE:
        _STATE_DICT_CACHE.clear()  # one checkpoint at a time: a grid chain uses one backbone
        _STATE_DICT_CACHE[key] = read_state_dict(path)
    sd, is_jit = _STATE_DICT_CACHE[key]
    return dict(sd), is_jit


def is_torchscript(path: str) -> bool:
    """Whether ``path`` is a TorchScript archive (OpenAI's released CLIP checkpoints are)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as zf:
        return any(n.split("/", 2)[1:2] == ["code"] for n in zf.namelist())


CLIP_VOCAB = 49408  # OpenAI's BPE vocabulary (engine.clip.text.tokenize)


def text_tower_problem(text_cfg: dict) -> str:
    """Why a text tower (an open_clip ``text_cfg``) cannot take CLIP prompts; "" when it can."""
    if text_cfg.get("hf_tokenizer_name") or text_cfg.get("vocab_size", CLIP_VOCAB) != CLIP_VOCAB:
        name = text_cfg.get("hf_tokenizer_name") or f"{text_cfg['vocab_size']} tokens"
        return f"uses another tokenizer ({name})"
    if text_cfg.get("no_causal_mask"):
        return "has no causal mask"
    if text_cfg.get("pool_type", "argmax") != "argmax" or text_cfg.get("embed_cls"):
        return f"pools its output otherwise ({text_cfg.get('pool_type', 'a class token')})"
    return ""


def build_clip(model_cfg: dict, precision: str = "fp32") -> CLIP:
    """An open_clip CLIP from a model-config dict, with fp16 weights in "fp16" mode."""
    if model_cfg.get("custom_text") or "hf_model_name" in model_cfg.get("text_cfg", {}):
        raise BackboneError("Only CLIP models with the standard text tower are supported")
    problem = text_tower_problem(model_cfg.get("text_cfg", {}))
    if problem:
        raise BackboneError(
            f"This CLIP's text tower {problem}; the prompt learners need CLIP's BPE tokenizer "
            f"({CLIP_VOCAB:,} tokens) and a causal text transformer read at the end-of-text token "
            "(prompts are token embeddings spliced at fixed positions). Use a CLIP ViT or ResNet "
            "with the standard text tower: OpenAI's, or open_clip's LAION, DataComp, MetaCLIP or "
            "DFN weights of ViT-B-32, ViT-B-16, ViT-L-14, ViT-H-14, ViT-bigG-14 (not SigLIP, "
            "CLIPA, CoCa or the multilingual 'worldwide' models)"
        )
    _enable_towers(model_cfg)
    kwargs = {k: v for k, v in model_cfg.items() if k in _CLIP_KWARGS}
    cast_dtype = torch.float16 if precision == "fp16" else None
    model = CLIP(**kwargs, cast_dtype=cast_dtype)
    return model


def load_clip(cfg, precision: str = "fp32", device="cpu") -> CLIP:
    """Build the frozen CLIP of ``cfg.MODEL.BACKBONE`` (weights: :func:`ensure_weights`).

    Args:
        cfg: the config.
        precision: "fp16" stores weights in half precision (OpenAI style); others fp32.
        device: where to put the model.

    Returns:
        An open_clip ``CLIP`` in eval mode with ``requires_grad=False`` everywhere, carrying
        ``MODEL.TEXT_FULL_LENGTH`` for the prompts built from it
        (:func:`engine.clip.text.keeps_full_length`).
    """
    with phases.phase("clip weights"):  # the start-up phases of the run (engine.phases)
        bb = cfg.MODEL.BACKBONE
        path = ensure_weights(cfg) if bb.PRETRAINED else None
        if bb.PRETRAINED and path is None:
            raise BackboneError(
                "No CLIP weights: MODEL.BACKBONE.NAME, PATH and URL are empty. Set "
                "MODEL.BACKBONE.NAME (e.g. ViT-B/16), MODEL.BACKBONE.PATH to a local OpenAI or "
                "open_clip checkpoint, or MODEL.BACKBONE.PRETRAINED False for random weights."
            )
        if path is None:
            model_cfg, source = _model_config(cfg)
            logger.warning("MODEL.BACKBONE.PRETRAINED is False: CLIP %s has RANDOM weights", source)
            key = ("random", json.dumps(model_cfg, sort_keys=True), precision)
            model = tower_cache.random_tower(key, lambda: _random_clip(model_cfg, precision))
        else:
            # a packed worker copies the tower it built for this checkpoint (tower_cache)
            copies = tower_cache.stats["copied"]
            model = tower_cache.checkpoint_tower(
                _tower_key(cfg, path, precision),
                lambda: clip_from_state_dict(cfg, *_read_weights(path), path, precision),
            )
            how = ""
            if tower_cache.stats["copied"] > copies:
                how = " (a copy of the tower built for an earlier run of this process)"
            logger.info("Loaded CLIP weights from %s%s", path, how)
        model.to(device)
        model.eval()
        model.requires_grad_(False)
        setattr(model, FULL_LENGTH_ATTR, bool(cfg.MODEL.TEXT_FULL_LENGTH))
    return model


def _random_clip(model_cfg: dict, precision: str) -> CLIP:
    model = build_clip(model_cfg, precision)
    if precision == "fp16":
        convert_weights_to_lp(model, dtype=torch.float16)
    return model


def _tower_key(cfg, path: str, precision: str) -> tuple | None:
    """What :func:`clip_from_state_dict` builds from: the checkpoint file, NAME, the CONFIG file
    and the precision (files by real path, size and modification time); None when towers are
    not kept or a file cannot be read (the build then reports it)."""
    if not tower_cache.towers_cached():
        return None
    bb = cfg.MODEL.BACKBONE
    try:
        model_config = tower_cache.file_key(resolve_path(bb.CONFIG)) if bb.CONFIG else None
        return ("checkpoint", tower_cache.file_key(path), bb.NAME, model_config, precision)
    except OSError:
        return None


def clip_from_state_dict(cfg, sd: dict, is_jit: bool, path: str, precision: str = "fp32") -> CLIP:
    """The open_clip CLIP of ``cfg.MODEL.BACKBONE`` (NAME / CONFIG, else the architecture
    inferred from an OpenAI-style state dict) holding the weights ``sd`` read from ``path``.

    ``sd`` is left unchanged. "fp16" stores the weights in half precision (OpenAI style); other
    modes keep fp32. The model is returned as built (train mode, gradients on).
    """
    bb = cfg.MODEL.BACKBONE
    sd = dict(sd)
    for key in ("input_resolution", "context_length", "vocab_size", "attn_mask"):
        sd.pop(key, None)
    if any(k.startswith("text.") for k in sd):
        raise BackboneError(f"{path} holds a CustomTextCLIP model, which is not supported")
    if bb.CONFIG or bb.NAME:
        model_cfg, source = _model_config(cfg)
        if is_jit or (bb.NAME in OPENAI_MODELS and not bb.CONFIG):
            model_cfg["quick_gelu"] = True

        def load(model):
            missing, unexpected = _compare_keys(model.state_dict(), sd)
            if missing or unexpected:
                raise BackboneError(
                    f"The weights in {path} do not fit the architecture {source}: "
                    f"{len(missing)} missing keys (e.g. {missing[:3]}), {len(unexpected)} "
                    f"unexpected keys (e.g. {unexpected[:3]}). Set MODEL.BACKBONE.NAME or "
                    "MODEL.BACKBONE.CONFIG to the checkpoint's architecture."
                )
            # a single run's model takes the mapped tensors themselves when they fit (dtype,
            # contiguous): no copy; a process that keeps the weights for later runs copies them
            own = model.state_dict()
            assign = not _cache_enabled and all(
                v.dtype == own[k].dtype and v.is_contiguous() for k, v in sd.items()
            )
            try:  # copy_ converts fp16 checkpoints exactly as .float() did, without a copy more
                model.load_state_dict(sd, strict=True, assign=assign)
            except RuntimeError as e:
                raise BackboneError(f"The weights in {path} do not fit {source}: {e}") from e

        # the random initialisation is skipped when its generator state is recorded (skip_init)
        from .skip_init import build_then_load

        model = build_then_load(
            lambda: build_clip(model_cfg, precision), load, [model_cfg, precision]
        )
    else:  # infer the architecture from an OpenAI-style state dict
        cast = torch.float16 if precision == "fp16" else None
        model = build_model_from_openai_state_dict(sd, quick_gelu=True, cast_dtype=cast)
        model.float()
    if precision == "fp16":
        convert_weights_to_lp(model, dtype=torch.float16)
    return model


# The config whose MODEL.BACKBONE the OpenAI-style ``clip`` package (the compatibility layer at
# the repository root) resolves names and weights with while a trainer is being built.
_ACTIVE_BACKBONE_CFG = None


@contextlib.contextmanager
def active_backbone(cfg):
    """Inside this block :func:`active_backbone_cfg` returns ``cfg`` (restored afterwards)."""
    global _ACTIVE_BACKBONE_CFG
    previous, _ACTIVE_BACKBONE_CFG = _ACTIVE_BACKBONE_CFG, cfg
    try:
        yield cfg
    finally:
        _ACTIVE_BACKBONE_CFG = previous


def active_backbone_cfg():
    """The config of the trainer being built inside :func:`active_backbone`, else None."""
    return _ACTIVE_BACKBONE_CFG


def _compare_keys(own: dict, sd: dict) -> tuple[list[str], list[str]]:
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    return missing, unexpected


def clip_dtype(clip_model) -> torch.dtype:
    """The dtype of the CLIP weights (open_clip has no ``dtype`` property)."""
    visual = clip_model.visual
    conv = getattr(visual, "conv1", None)
    if conv is not None:
        return conv.weight.dtype
    return next(visual.parameters()).dtype


def save_clip_checkpoint(model: CLIP, path: str) -> None:
    """Save a CLIP state dict (open_clip key names = OpenAI key names)."""
    from engine.utils import atomic_torch_save

    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    atomic_torch_save({k: v.detach().cpu() for k, v in model.state_dict().items()}, path)
