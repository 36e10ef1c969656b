"""Write tests/reference/dept.pt: what the DePT authors' code computes on a tiny CLIP.

Usage (outside the project's tree: an extracted copy of Koorye/DePT, commit d4ff416)::

    git --git-dir=<mirror> archive d4ff416 | tar -x -C /tmp/dept-authors
    DEPT_COMMIT=d4ff416... python tests/reference/make_dept.py /tmp/dept-authors \
        [tests/reference/dept.pt]

For DePT over CoOp, KgCoOp, CoCoOp and MaPLe (the authors' ``CustomCLIP`` of
``trainers/elp_coop.py``, ``elp_kgcoop.py``, ``elp_cocoop.py``, ``elp_maple.py``), in fp32 on
the CPU, on fixed images and labels of three base classes, it records: the initial learnable
tensors (the project's test copies them into its model), the evaluation logits on the base
classes (similarity and CAT-head logits fused), the training loss, the gradient of every
learnable tensor, the tensors after one SGD step of the authors' ``build_optimizer``
(``trainers/optim.py``: the prompts at ``OPTIM.LR``, the head at ``OPTIM.LR * OPTIM.LR_EXP``) and
the evaluation logits on two new classes of a model built for them that loads the stepped
tensors as the authors' ``load_model`` does (``strict=False``, the class-dependent buffers
dropped). The config is the authors' train.py ``extend_cfg`` defaults and their published
DePT files, with smaller context counts; the tiny CLIP is the project's
``engine.clip.toy.write_tiny_clip`` (``DEPT_CLIP``, seed 0) with its weights rounded to half
precision (:func:`fp16_representable`), whose open_clip state dict loads
into the authors' ``clip.model.build_model`` / ``clip_maple.model.build_model`` (the same key
names; the text and vision widths are multiples of 64, as OpenAI's ``build_model`` infers the
heads as width // 64; MaPLe's code hard-codes the text width 512 and the vision width 768).

Patches to run it (the only changes to the authors' code, all at run time):

- Dassl and plotnine are replaced by import-time placeholders (``TRAINER_REGISTRY.register``,
  ``TrainerX``, ``build_lr_scheduler``, ``RAdam`` ... are imported by the trainer modules but
  none of them runs here: the models are built and stepped directly);
- ``load_clip_to_cpu`` of each trainer module returns the tiny CLIP (no download), cast to fp32
  as the authors' ``build_model`` does for ``PREC fp32`` (``clip_model.float()``); this also
  makes fp32 the frozen second copy of KgCoOp's ``PromptLearner`` (the hand-crafted text
  features), which their code leaves in half precision whatever PREC;
- ``torch.Tensor.cuda`` / ``nn.Module.cuda`` (KgCoOp's frozen copy) are no-ops (CPU only);
- ``torch.Tensor.half`` is the identity: MaPLe's code (``trainers/maple.py``,
  ``clip_maple/model.py``) hard-codes ``half()`` on its projection and on the prompts where they
  enter the towers, which in fp32 mode rounds them (and their gradients) to half precision and
  fails on the half projection of an fp32 context; their fp16 mode, where these casts do
  nothing, is what it was written for. (``convert_weights`` of ``build_model`` then keeps the
  weights as they are: the tiny CLIP's are half-precision values already.)

The trainer-side steps the script does itself, as the authors' ``build_model`` and
``forward_backward`` do: ``requires_grad`` by ``TRAINER.NAMES_TO_UPDATE``, ``model.train()``,
``loss = model(image, label)``, ``zero_grad``, ``backward``, ``step``.
"""

from __future__ import annotations

import hashlib
import os
import os.path as osp
import subprocess
import sys
import tempfile
import types

import torch

HERE = osp.dirname(osp.abspath(__file__))
ROOT = osp.dirname(osp.dirname(HERE))

# widths: multiples of 64 (OpenAI's build_model: heads = width // 64); MaPLe's code needs 512/768
DEPT_CLIP = {
    "embed_dim": 48,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 768, "patch_size": 16, "head_width": 64},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 512, "heads": 8, "layers": 2},
}
SEED = 0
BASE = ["red circle", "blue_square", "a very long class name with words"]
NEW = ["green triangle", "yellow_star"]
LABELS = [0, 2, 1, 2]
LR, LR_EXP, WEIGHT, KG_W = 0.0035, 6.5, 0.7, 2.0
VARIANTS = ("CoOp", "KgCoOp", "CoCoOp", "MaPLe")
MODULES = {"CoOp": "elp_coop", "KgCoOp": "elp_kgcoop", "CoCoOp": "elp_cocoop", "MaPLe": "elp_maple"}


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed images ``[4, 3, 32, 32]`` and labels (the test draws the same)."""
    g = torch.Generator().manual_seed(1234)
    return torch.randn(len(LABELS), 3, 32, 32, generator=g), torch.tensor(LABELS)


def init_values(shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The learnable tensors both sides start from (by DePT's names): cwT scales 1 + 0.1 N(0, 1),
    everything else 0.02 N(0, 1) (0.1 for the cwT shifts), from one generator in name order, so
    the reference need not store them and no initialisation scheme is assumed."""
    g = torch.Generator().manual_seed(99)
    values = {}
    for name in sorted(shapes):
        noise = torch.randn(shapes[name], generator=g)
        if ".film_lp_" in f".{name}" and name.endswith(".scale"):
            values[name] = 1 + 0.1 * noise
        elif ".film_lp_" in f".{name}":
            values[name] = 0.1 * noise
        else:
            values[name] = 0.02 * noise
    return values


FULL = 20000  # tensors up to this size are stored whole; larger ones by a digest


def digest(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"all": t}`` for a small tensor; for a large one (MaPLe's 512 x 768 projections) 4,096
    fixed entries (the same positions for every tensor of that size), the sum and the sum of
    squares (float64)."""
    t = t.detach().float()
    if t.numel() <= FULL:
        return {"all": t.clone()}
    g = torch.Generator().manual_seed(7)
    idx = torch.randperm(t.numel(), generator=g)[:4096]
    flat = t.flatten()
    return {
        "val": flat[idx].clone(),
        "sum": flat.double().sum(),
        "sq": flat.double().square().sum(),
    }


def fp16_representable(state: dict) -> dict:
    """The CLIP state dict with every float tensor rounded to half precision and back: the
    authors' ``build_model`` loads the weights into half-precision layers (``convert_weights``)
    before their fp32 mode casts them back, so both sides use these values."""
    return {k: v.half().float() if v.is_floating_point() else v for k, v in state.items()}


def clip_checksum(state: dict) -> float:
    """A fingerprint of the tiny CLIP's weights (the test checks it: another open_clip or torch
    that draws other weights fails with a clear message, not a numeric difference)."""
    return float(sum(v.double().sum() for v in state.values() if v.is_floating_point()))


def write_clip(folder: str) -> str:
    """The tiny CLIP checkpoint (in a subprocess: the project's packages stay out of this one,
    whose ``clip`` and ``trainers`` are the authors')."""
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]);"
        "from engine.clip.toy import write_tiny_clip;"
        "print(write_tiny_clip(sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]))[1])"
    )
    import json

    out = subprocess.run(
        [sys.executable, "-c", code, ROOT, folder, json.dumps(DEPT_CLIP), str(SEED)],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip().splitlines()[-1]


def install_placeholders() -> None:
    """Dassl and plotnine: import-time placeholders (see the module docstring)."""

    class Registry:
        def register(self, *args, **kwargs):
            return lambda cls: cls

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    never = object
    module("plotnine")
    module("dassl")
    module("dassl.engine", TRAINER_REGISTRY=Registry(), TrainerX=never)
    module(
        "dassl.engine.trainer",
        MetricMeter=never,
        AverageMeter=never,
        SummaryWriter=never,
        TrainerX=never,
    )
    module("dassl.utils", load_pretrained_weights=None, load_checkpoint=None)
    module("dassl.utils.tools", mkdir_if_missing=None)
    module("dassl.optim", build_lr_scheduler=None)
    module("dassl.optim.radam", RAdam=never)
    module("dassl.metrics", compute_accuracy=None)


def authors_cfg(variant: str, subsample: str):
    """The authors' train.py extend_cfg defaults, their DePT config values (smaller contexts),
    fp32, a 32-pixel input."""
    from yacs.config import CfgNode as CN

    cfg = CN()
    cfg.DATASET = CN({"NAME": "DescribableTextures", "SUBSAMPLE_CLASSES": subsample})
    cfg.INPUT = CN({"SIZE": (32, 32)})
    cfg.MODEL = CN({"BACKBONE": CN({"NAME": "ViT-B/16"}), "INIT_WEIGHTS": ""})
    cfg.OPTIM = CN(
        {
            "NAME": "sgd",
            "LR": LR,
            "WEIGHT_DECAY": 5e-4,
            "MOMENTUM": 0.9,
            "SGD_DAMPNING": 0,
            "SGD_NESTEROV": False,
            "RMSPROP_ALPHA": 0.99,
            "ADAM_BETA1": 0.9,
            "ADAM_BETA2": 0.999,
            "STAGED_LR": True,
            "NEW_LAYERS": ["linear_probe", "film"],
            "BASE_LR_MULT": 1.0,
            "LR_EXP": LR_EXP,
        }
    )
    t = cfg.TRAINER = CN()
    t.NAMES_TO_UPDATE = ["prompt_learner", "linear_probe", "film"]
    t.LINEAR_PROBE = CN({"TYPE": "linear", "WEIGHT": WEIGHT, "TEST_TIME_FUSION": True})
    t.FILM = CN({"LINEAR_PROBE": True})
    kg = variant == "KgCoOp"
    t.COOP = CN(
        {
            "N_CTX": 4,
            "CSC": False,
            "CTX_INIT": "a photo of a" if kg else "",
            "PREC": "fp32",
            "CLASS_TOKEN_POSITION": "end",
            "ALPHA": 1.0,
            "W": KG_W,
        }
    )
    t.COCOOP = CN({"N_CTX": 4, "CTX_INIT": "a photo of a", "PREC": "fp32"})
    t.MAPLE = CN({"N_CTX": 2, "CTX_INIT": "a photo of a", "PREC": "fp32", "PROMPT_DEPTH": 2})
    return cfg


def build(variant: str, subsample: str, classnames, state_dict):
    """The authors' DePT model of ``variant`` with their requires_grad rule (their build_model)."""
    import importlib

    mod = importlib.import_module(f"trainers.{MODULES[variant]}")
    cfg = authors_cfg(variant, subsample)
    model = mod.CustomCLIP(cfg, classnames, mod.load_clip_to_cpu(cfg))
    for name, param in model.named_parameters():
        param.requires_grad_(any(n in name for n in cfg.TRAINER.NAMES_TO_UPDATE))
    return model, cfg


def learnable(model, variant: str) -> dict[str, torch.Tensor]:
    """The learnable tensors that DePT uses (KgCoOp's unused meta_net/bias_vectors left out:
    they get no gradient and the optimizer skips them; CoCoOp's meta-net is used)."""
    unused = ("prompt_learner.meta_net.", "prompt_learner.bias_vectors")
    unused = unused if variant == "KgCoOp" else ("-",)
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad and not n.startswith(unused)
    }


def run_variant(variant: str, clip_state: dict) -> dict:
    from trainers.optim import build_optimizer

    torch.manual_seed(SEED)
    model, cfg = build(variant, "base", BASE, clip_state)
    image, label = inputs()
    start = init_values({n: t.shape for n, t in learnable(model, variant).items()})
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in start:
                p.copy_(start[n])
    out = {"names": sorted(start)}
    model.eval()
    with torch.no_grad():
        out["logits_base"] = model(image).detach().clone()
    model.train()
    optim, infos = build_optimizer(model, cfg.OPTIM)
    out["group_lrs"] = [g["lr"] for g in optim.param_groups]
    loss = model(image, label)
    optim.zero_grad()
    loss.backward()
    out["loss"] = loss.detach().clone()
    out["grad"] = {
        n: digest(p.grad) for n, p in model.named_parameters() if n in start and p.grad is not None
    }
    optim.step()
    out["after_step"] = {n: digest(t) for n, t in learnable(model, variant).items()}
    # new classes: a model built for them loads the stepped tensors as the authors' load_model
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(("_prefix", "_suffix"))}
    new_model, _ = build(variant, "new", NEW, clip_state)
    new_model.load_state_dict(state, strict=False)
    new_model.eval()
    with torch.no_grad():
        out["logits_new"] = new_model(image).detach().clone()
    return out


def main(authors: str, dest: str) -> None:
    commit = (
        os.environ.get("DEPT_COMMIT")
        or subprocess.run(
            ["git", "-C", authors, "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    if not commit:
        raise SystemExit("name the authors' commit: DEPT_COMMIT=<sha> (an archive has no .git)")
    with tempfile.TemporaryDirectory() as tmp:
        clip_path = write_clip(tmp)
        clip_state = fp16_representable(torch.load(clip_path, map_location="cpu"))
    sys.path.insert(0, authors)
    install_placeholders()
    trainers = types.ModuleType("trainers")  # the package without its __init__ (every trainer)
    trainers.__path__ = [osp.join(authors, "trainers")]
    sys.modules["trainers"] = trainers
    torch.Tensor.cuda = lambda self, *a, **k: self  # patch: CPU only
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.half = lambda self, *a, **k: self  # patch: fp32 (MaPLe's hard-coded half())

    import importlib

    def tiny_clip(cfg, _package="clip"):
        package = importlib.import_module(f"{_package}.model")
        state = {k: v.clone() for k, v in clip_state.items()}
        if _package == "clip_maple":
            details = {
                "trainer": "MaPLe",
                "vision_depth": 0,
                "language_depth": 0,
                "vision_ctx": 0,
                "language_ctx": 0,
                "maple_length": cfg.TRAINER.MAPLE.N_CTX,
            }
            return package.build_model(state, details).float()
        return package.build_model(state).float()  # PREC fp32: clip_model.float()

    for variant in VARIANTS:
        base = {"CoOp": "coop", "KgCoOp": "kgcoop", "CoCoOp": "cocoop", "MaPLe": "maple"}[variant]
        mod = importlib.import_module(f"trainers.{base}")
        package = "clip_maple" if variant == "MaPLe" else "clip"
        mod.load_clip_to_cpu = lambda cfg, p=package: tiny_clip(cfg, p)  # patch: no download
    results = {variant: run_variant(variant, clip_state) for variant in VARIANTS}
    torch.save(
        {
            "authors_commit": commit,
            "clip_config": DEPT_CLIP,
            "clip_seed": SEED,
            "clip_checksum": clip_checksum(clip_state),
            "base": BASE,
            "new": NEW,
            "labels": LABELS,
            "lr": LR,
            "lr_exp": LR_EXP,
            "weight": WEIGHT,
            "kg_w": KG_W,
            "variants": results,
        },
        dest,
    )
    digest = hashlib.sha256(open(dest, "rb").read()).hexdigest()[:12]
    print(
        f"wrote {dest} ({os.path.getsize(dest)} bytes, sha256 {digest}); authors' commit {commit}"
    )


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__.split("\n\n")[1])
    main(osp.abspath(sys.argv[1]), sys.argv[2] if len(sys.argv) == 3 else osp.join(HERE, "dept.pt"))
