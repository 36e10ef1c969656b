"""Reference numbers of the SkipTuning authors' code for tests/test_skiptuning.py.

Usage (outside the test suite; writes tests/reference/skiptuning.pt)::

    git --git-dir=<mirror of Koorye/SkipTuning> archive 8c4636e | tar -x -C /tmp/skip
    python tests/reference/make_skiptuning.py /tmp/skip

It builds the tiny deterministic CLIP of :data:`TINY` (engine/clip/toy.py ``write_tiny_clip``,
fp32 weights rounded to fp16 values, :func:`half_representable`; widths of 64 so that OpenAI's
``build_model`` infers the heads as width // 64), loads its
state dict into the AUTHORS' ``clip.build_model`` and their ``SkipCustomCLIP``
(trainers/skip_tuning.py) for seven DTD class names, and records on fixed inputs: the frozen
lower-block features of the images and class prompts, the class prototypes, the exponential
keep probabilities, a training forward (the kept classes, logits, loss), the gradients of the
learnable tensors, the update of one step of their optimizer (their
trainers/_base_/optim.py ``build_optimizer``, SGD, staged LR), the evaluation logits after the
step, a training forward with token dropping, and their feature loader's batches. Only these
numbers are stored (large tensors as norms, sums and seeded random projections).

Patches needed to run the authors' code here (nothing of its arithmetic is changed):

- their ``trainers`` and ``trainers.baselines`` packages are registered without running their
  ``__init__`` (which imports every baseline), so only ``skip_tuning``, ``ft_clip``,
  ``feature_loader`` and ``_base_`` are imported;
- Dassl comes from this project's ``dassl/`` compatibility package; the modules it lacks and
  that the imported files only import (``dassl.optim.radam``, ``dassl.optim.lr_scheduler``,
  ``dassl.data.data_manager``) are empty stand-ins;
- ``torch.Tensor.cuda`` returns the tensor itself while their model is built (CPU only);
- the trainer's steps around the model are done by hand, as their code does them: the
  ``requires_grad`` switches of ``BaseTrainer.build_model``, the text/prototype features of
  ``SkipTuning.before_train``, and Dassl's ``model_backward_and_update`` (zero_grad, backward,
  step);
- recording only: ``F.cross_entropy`` of their module, ``select_classes`` and ``expon.pdf`` are
  wrapped to record their arguments and results; their ``reserve_mask`` is drawn by their code
  under ``torch.manual_seed``; for the token-drop case the kept positions are drawn with their
  calls (``random.uniform``, ``torch.randperm``) under the seeds their forward then uses.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import os
import os.path as osp
import random
import sys
import tempfile
import types

import torch

HERE = osp.dirname(osp.abspath(__file__))
ROOT = osp.dirname(osp.dirname(HERE))
OUT = osp.join(HERE, "skiptuning.pt")
AUTHORS_COMMIT = "8c4636e"

TINY = {
    "embed_dim": 32,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "layers": 3, "width": 64, "patch_size": 8, "head_width": 64},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 1, "layers": 3},
}
SEED = 7  # the tiny CLIP's weights
CLASSNAMES = ["banded", "blotchy", "braided", "bubbly", "bumpy", "chequered", "cobwebbed"]
DATASET = "DescribableTextures"
SKIP = {"START_LAYER": 1, "TOP_RATIO": 0.5, "MAX_TOP": 50, "LAMBDA": 0.3, "DROP_RATIO": 0.0}
OPTIM = {"LR": 0.05, "NEW_LR": 0.02, "WEIGHT_DECAY": 5e-4, "MOMENTUM": 0.9}
LABELS = [0, 3, 3, 5]
MASK_SEED = 11  # torch seed of their reserve-mask draw
DROP = {"RATIO": 0.6, "SEED": 5}  # the token-drop case: DROP_RATIO and the seed of its draws
LOADER_SEED = 3
LOADER_LABELS = [i % 5 for i in range(23)]  # 5 classes, 4-5 items each
N_PROJ = 8  # random projections stored per large tensor
FULL_MAX = 4096  # tensors up to this size are stored whole


def images() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(len(LABELS), 3, 32, 32, generator=g)


def weights_digest(state: dict) -> str:
    """SHA-1 of a state dict's tensors (names, shapes, fp32 bytes)."""
    h = hashlib.sha1()
    for k in sorted(state):
        t = state[k].detach().float().contiguous().cpu()
        h.update(f"{k}|{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def summary(t: torch.Tensor, name: str) -> dict:
    """A tensor, or for a large one its sum, norm and N_PROJ projections on seeded directions
    (the seed is derived from ``name``, so the test draws the same directions)."""
    t = t.detach().double().cpu()
    if t.numel() <= FULL_MAX:
        return {"full": t.float()}
    seed = int(hashlib.sha1(name.encode()).hexdigest()[:8], 16)
    dirs = torch.randn(N_PROJ, t.numel(), generator=torch.Generator().manual_seed(seed)).double()
    return {"sum": t.sum(), "norm": t.norm(), "proj": dirs @ t.flatten()}


def half_representable(ckpt: str) -> dict:
    """Round the checkpoint's weights to fp16 values (kept fp32) and save it back: OpenAI's
    ``build_model`` stores the weights in half precision (its ``convert_weights``), so a CLIP
    whose fp32 weights are fp16 values is the same for both code bases after ``.float()``."""
    state = torch.load(ckpt, map_location="cpu")
    state = {k: v.half().float() if v.is_floating_point() else v for k, v in state.items()}
    torch.save(state, ckpt)
    return state


def tiny_state() -> dict:
    from engine.clip.toy import write_tiny_clip

    folder = tempfile.mkdtemp()
    _, ckpt = write_tiny_clip(folder, config=TINY, seed=SEED)
    return half_representable(ckpt)


def import_authors(repo: str):
    """Their SkipTuning module and build_optimizer, with the patches of the module docstring."""
    sys.path[:0] = [repo, ROOT]  # theirs first: their clip and trainers packages
    for name, sub in (("trainers", "trainers"), ("trainers.baselines", "trainers/baselines")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [osp.join(repo, sub)]
        sys.modules[name] = pkg
    for name in ("dassl.optim.radam", "dassl.optim.lr_scheduler", "dassl.data.data_manager"):
        stub = types.ModuleType(name)
        for attr in ("RAdam", "ConstantWarmupScheduler", "LinearWarmupScheduler"):
            setattr(stub, attr, None)
        stub.build_data_loader = stub.build_transform = None
        sys.modules[name] = stub
    skip = importlib.import_module("trainers.skip_tuning")
    optim = importlib.import_module("trainers._base_.optim")
    loader = importlib.import_module("trainers.feature_loader")
    clip = importlib.import_module("clip")
    assert osp.dirname(clip.__file__).startswith(osp.abspath(repo)), clip.__file__
    return skip, optim, loader, clip


def config(drop_ratio: float):
    from yacs.config import CfgNode as CN

    cfg = CN()
    cfg.DATASET = CN({"NAME": DATASET, "NUM_SHOTS": 16})
    cfg.TRAINER = CN()
    cfg.TRAINER.SKIP = CN({**SKIP, "DROP_RATIO": drop_ratio, "QUICK_BATCH_SIZE": 128})
    cfg.TRAINER.FINETUNE = CN(
        {"LEARNABLE_TEXT": True, "LEARNABLE_IMAGE": True, "LEARNABLE_PREFIX_MODULES": ""}
    )
    cfg.TRAINER.FINETUNE.START_LAYER = 0
    cfg.OPTIM = CN(
        {
            "NAME": "sgd",
            "LR": OPTIM["LR"],
            "WEIGHT_DECAY": OPTIM["WEIGHT_DECAY"],
            "MOMENTUM": OPTIM["MOMENTUM"],
            "SGD_DAMPNING": 0,
            "SGD_NESTEROV": False,
            "RMSPROP_ALPHA": 0.99,
            "ADAM_BETA1": 0.9,
            "ADAM_BETA2": 0.999,
            "STAGED_LR": True,
            "NEW_LAYERS": ["image_encoder"],
            "BASE_LR_MULT": 0.1,
            "NEW_LR": OPTIM["NEW_LR"],
        }
    )
    return cfg


def build(skip, clip, state, drop_ratio: float):
    """Their model as their trainer builds it (fp32), with the before_train features."""
    clip_model = clip.model.build_model({k: v.clone() for k, v in state.items()})
    clip_model.float()
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        model = skip.SkipCustomCLIP(config(drop_ratio), CLASSNAMES, clip_model)
    finally:
        torch.Tensor.cuda = cuda
    model.requires_grad_(False)  # BaseTrainer.build_model
    model.learnable_params.requires_grad_(True)
    model.excluded_params.requires_grad_(False)
    with torch.no_grad():  # SkipTuning.before_train
        mid, out = model.forward_text_features()
        model.text_features = mid
        model.class_prototypes = out / out.norm(dim=-1, keepdim=True)
    return model


def record_forward(skip, model, x, labels):
    """Their training forward on frozen features ``x`` [tokens, batch, width]: the loss and
    what it recorded (logits, labels, kept classes)."""
    seen = {}
    ce, select = skip.F.cross_entropy, model.select_classes

    def cross_entropy(logits, target, *a, **k):
        seen["logits"], seen["target"] = logits.detach().clone(), target.clone()
        return ce(logits, target, *a, **k)

    def select_classes(image_features, tokenized_texts, text_features, labels):
        out = select(image_features, tokenized_texts, text_features, labels)
        seen["kept_tokens"] = out[0].clone()  # the kept classes' prompt tokens
        return out

    skip.F.cross_entropy, model.select_classes = cross_entropy, select_classes
    try:
        loss, _ = model(x, labels)
    finally:
        skip.F.cross_entropy = ce
        del model.select_classes
    return loss, seen


def main(repo: str) -> None:
    skip, optim, loader_mod, clip = import_authors(repo)
    state = tiny_state()
    ref = {"authors_commit": AUTHORS_COMMIT, "weights_sha1": weights_digest(state)}
    ref["config"] = {"tiny": TINY, "seed": SEED, "classnames": CLASSNAMES, "dataset": DATASET}
    ref["config"].update(skip=SKIP, optim=OPTIM, labels=LABELS, drop=DROP)
    ref["config"].update(loader_seed=LOADER_SEED, loader_labels=LOADER_LABELS)

    pdfs = []
    expon = skip.expon

    class Recording:
        @staticmethod
        def pdf(x, scale):
            y = expon.pdf(x, scale=scale)
            pdfs.append(torch.as_tensor(y).clone())
            return y

    skip.expon = Recording
    model = build(skip, clip, state, SKIP["DROP_RATIO"])
    imgs, labels = images(), torch.tensor(LABELS)
    with torch.no_grad():
        img_mid, _ = model.forward_image_features(imgs)  # [tokens, batch, width]
    ref["text_mid"] = summary(model.text_features.permute(1, 0, 2), "text_mid")  # [C, 77, w]
    ref["image_mid"] = summary(img_mid.permute(1, 0, 2), "image_mid")  # [batch, tokens, w]
    ref["prototypes"] = model.class_prototypes.detach().double().clone()

    # a training forward and backward (their reserve mask drawn at its first call)
    torch.manual_seed(MASK_SEED)
    random.seed(0)
    loss, seen = record_forward(skip, model, img_mid, labels)
    ref["pdf"] = pdfs[0].double()
    ref["reserve_mask"] = model.reserve_mask.clone()
    ref["train"] = {"loss": loss.detach().double(), "logits": seen["logits"].double()}
    ref["train"]["target"] = seen["target"]
    tokens = model.tokenized_texts
    kept = [int((tokens == row).all(1).nonzero()[0]) for row in seen["kept_tokens"]]
    ref["train"]["classes"] = torch.tensor(kept)
    params = dict(model.learnable_params.named_parameters())
    trained = {k: p for k, p in params.items() if p.requires_grad}
    opt = optim.build_optimizer(model.learnable_params, config(0.0).OPTIM)
    before = {k: p.detach().clone() for k, p in trained.items()}
    opt.zero_grad()  # Dassl's model_backward_and_update
    loss.backward()
    ref["grads"] = {k: summary(p.grad, "grad." + k) for k, p in trained.items()}
    ref["trained"] = sorted(trained)
    opt.step()
    ref["update"] = {k: summary(p.detach() - before[k], "update." + k) for k, p in trained.items()}
    ref["after"] = {k: summary(p.detach(), "after." + k) for k, p in trained.items()}
    with torch.no_grad():
        ref["eval_logits"] = model(imgs).double()  # both towers whole, every class

    # token dropping: their draws under a seed, then their forward under the same seed
    model = build(skip, clip, state, DROP["RATIO"])
    model.reserve_mask = ref["reserve_mask"].clone()
    random.seed(DROP["SEED"])
    torch.manual_seed(DROP["SEED"])
    share = random.uniform(0.0, DROP["RATIO"])
    n_drop = math.ceil(img_mid.shape[0] * share)
    dropped = torch.randperm(img_mid.shape[0])[:n_drop]
    keep = torch.ones(img_mid.shape[0], dtype=torch.bool)
    keep[dropped] = False
    random.seed(DROP["SEED"])
    torch.manual_seed(DROP["SEED"])
    loss, seen = record_forward(skip, model, img_mid, labels)
    ref["drop"] = {"share": share, "keep": keep, "loss": loss.detach().double()}
    ref["drop"]["logits"] = seen["logits"].double()

    # their feature loader's batches (Python's generator seeded as the test seeds its own)
    batches = {}
    for mode in ("batch_random", "random"):
        random.seed(LOADER_SEED)
        fl = loader_mod.FeatureLoader(batch_size=4, mode=mode)
        fl.set_features(torch.zeros(1, len(LOADER_LABELS), 1), torch.tensor(LOADER_LABELS))
        batches[mode] = [list(b) for b in fl.batch_idxs_all_epochs]
    ref["loader_batches"] = batches
    torch.save(ref, OUT)
    print(f"wrote {OUT} ({os.path.getsize(OUT) / 1024:.0f} KiB)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(osp.abspath(sys.argv[1]))
