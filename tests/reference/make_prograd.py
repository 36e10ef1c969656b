"""Reference numbers of ProGrad's own code (BeierZhu/Prompt-align) for tests/test_prograd.py.

Usage (outside the test suite; the authors' code is never part of this project)::

    git --git-dir=<mirror>/BeierZhu+Prompt-align/repo archive HEAD | tar -x -C /tmp/prograd
    python tests/reference/make_prograd.py /tmp/prograd [--out tests/reference/prograd.pt]

It builds the tiny deterministic CLIP of :data:`TINY_OPENAI_CLIP` (fp32, CPU; widths of 64 so
that OpenAI's ``build_model``, which infers ``heads = width // 64``, rebuilds it; every weight
rounded to fp16 and back, because the authors' ``build_model`` converts the weights to fp16
before their ``clip_model.float()``), then runs, in a separate process whose path holds only
the authors' ``Dassl.ProGrad.pytorch`` and ``ProGrad.public``, for every case of :data:`CASES`:
their ``CustomCLIP`` (prompt learner, text and image encoders) and zero-shot ``CLIP`` built from
that checkpoint, their ``ProGradLoss``, and their ``ProGrad.forward_backward`` (which calls their
Dassl's ``prograd_backward_and_update``: the KL backward, the cross-entropy backward, the
projection and their SGD step, built by their ``build_optimizer``). It records the initial
context, the learned and zero-shot logits, both losses, both gradients before the projection
(``torch.autograd.grad`` of their losses), the gradient after it and the context after one step.

The patches needed to run their code on a CPU without downloads, all outside their files:

1. ``clip._download`` returns the tiny checkpoint (their ``load_clip_to_cpu`` downloads the
   named OpenAI model);
2. their ``ProGrad.build_model`` is not called (it moves the zero-shot CLIP with ``.cuda()``):
   the driver builds the same parts in the same order on the CPU (their ``CustomCLIP``, their
   ``CLIP``, the frozen parameters, their ``build_optimizer`` over the prompt learner, their
   ``ProGradLoss``) and sets them on a trainer object created without ``__init__`` (which
   would build Dassl's data loaders);
3. ``sklearn`` (imported by their Dassl's evaluator, unused here) is an empty stub module.

Only the numbers are stored (``tests/reference/prograd.pt``, a few tens of KB).
"""

from __future__ import annotations

import argparse
import json
import os
import os.path as osp
import subprocess
import sys
import tempfile

import torch

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
OUT = osp.join(ROOT, "tests", "reference", "prograd.pt")
AUTHORS_COMMIT = "1b76203"  # BeierZhu/Prompt-align, the commit the numbers come from

# a tiny CLIP that OpenAI's build_model rebuilds (one head of 64 per block in both towers)
TINY_OPENAI_CLIP = {
    "embed_dim": 32,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 64},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 1, "layers": 2},
}
CLIP_SEED = 7
CLASSNAMES = ["abyssinian", "great_pyrenees", "yorkshire_terrier"]
BATCH = 4
INPUT_SEED = 11
# one step each; labels chosen so that two cases conflict (cos < 0) and one does not
CASES = {
    "template_end": {
        "dataset": "OxfordPets",  # "a type of pet, a photo of a": 8 words, 9 tokens
        "ctx_init": True,
        "n_ctx": 16,
        "csc": False,
        "position": "end",
        "lambda": 1.0,
        "T": 1.0,
        "labels": [1, 1, 1, 1],
        "seed": 1,
    },
    "random_csc_front": {
        "dataset": "DescribableTextures",
        "ctx_init": False,
        "n_ctx": 4,
        "csc": True,
        "position": "front",
        "lambda": 0.8,
        "T": 2.0,
        "labels": [2, 2, 1, 0],
        "seed": 2,
    },
    "template_lambda": {
        "dataset": "EuroSAT",
        "ctx_init": True,
        "n_ctx": 8,
        "csc": False,
        "position": "end",
        "lambda": 0.5,
        "T": 1.0,
        "labels": [0, 1, 0, 0],
        "seed": 3,
    },
}
LR = 0.002  # their configs' SGD (momentum 0.9, weight decay 5e-4: Dassl's defaults)


def tiny_clip_state(out_dir: str) -> tuple[str, str, dict]:
    """Write the tiny CLIP (open_clip config + checkpoint, weights rounded to fp16 values) and
    return ``(config path, checkpoint path, state dict)``; the test builds the same."""
    from engine.clip.model import build_clip, save_clip_checkpoint
    from engine.clip.toy import write_tiny_clip

    cfg_path, ckpt = write_tiny_clip(out_dir, TINY_OPENAI_CLIP, seed=CLIP_SEED)
    model = build_clip(TINY_OPENAI_CLIP)
    state = torch.load(ckpt, map_location="cpu")
    state = {k: v.half().float() if v.is_floating_point() else v for k, v in state.items()}
    model.load_state_dict(state)
    save_clip_checkpoint(model, ckpt)
    return cfg_path, ckpt, state


def inputs() -> torch.Tensor:
    """The images of every case ``[BATCH, 3, 32, 32]`` (normalised-like values)."""
    gen = torch.Generator().manual_seed(INPUT_SEED)
    return torch.randn(BATCH, 3, 32, 32, generator=gen)


def clip_checksum(state: dict) -> float:
    """A fingerprint of the tiny CLIP's weights (the test refuses a different CLIP)."""
    return float(sum(v.double().abs().sum() for v in state.values() if v.is_floating_point()))


DRIVER = r"""
import importlib.machinery, json, sys, types
from collections import OrderedDict

authors, ckpt, work = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path[:0] = [authors + "/Dassl.ProGrad.pytorch", authors + "/ProGrad.public"]
for name, attrs in (("sklearn", {}), ("sklearn.metrics", {"f1_score": None,
                                                          "confusion_matrix": None})):
    mod = types.ModuleType(name)  # patch 3
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod

import torch
from dassl.config import get_cfg_default
from dassl.optim import build_optimizer
from clip import clip
import trainers.prograd as P

clip._download = lambda url, root=None: ckpt  # patch 1

spec = json.load(open(work + "/cases.json"))
image = torch.load(work + "/inputs.pt")
out = {}
for name, case in spec["cases"].items():
    cfg = get_cfg_default()
    # their train.py's extend_cfg (keys and defaults)
    from yacs.config import CfgNode as CN
    import train as their_train
    their_train.extend_cfg(cfg)
    cfg.merge_from_list([
        "MODEL.BACKBONE.NAME", "ViT-B/16", "INPUT.SIZE", (32, 32),
        "DATASET.NAME", case["dataset"], "TRAINER.COOP.PREC", "fp32",
        "TRAINER.COOP.N_CTX", case["n_ctx"], "TRAINER.COOP.CTX_INIT", case["ctx_init"],
        "TRAINER.COOP.CSC", case["csc"], "TRAINER.COOP.CLASS_TOKEN_POSITION", case["position"],
        "LOSS.NAME", "prograd", "LOSS.T", case["T"], "LOSS.LAMBDA", case["lambda"],
        "OPTIM.NAME", "sgd", "OPTIM.LR", spec["lr"],
    ])
    torch.manual_seed(case["seed"])
    # patch 2: their build_model's parts, on the CPU
    clip_model = P.load_clip_to_cpu(cfg)
    clip_model.float()  # their fp32 mode
    zs_clip = P.CLIP(cfg, spec["classnames"])
    model = P.CustomCLIP(cfg, spec["classnames"], clip_model)
    for p in zs_clip.parameters():
        p.requires_grad_(False)
    for n, p in model.named_parameters():
        if "prompt_learner" not in n:
            p.requires_grad_(False)
    optim = build_optimizer(model.prompt_learner, cfg.OPTIM)
    trainer = P.ProGrad.__new__(P.ProGrad)
    trainer.cfg, trainer.device = cfg, torch.device("cpu")
    trainer.model, trainer.zs_clip = model, zs_clip
    trainer.optim = optim
    trainer._models = OrderedDict(prompt_learner=model.prompt_learner)
    trainer._optims = OrderedDict(prompt_learner=optim)
    trainer._scheds = OrderedDict(prompt_learner=None)
    trainer.criterion = P.ProGradLoss(T=cfg.LOSS.T)
    trainer.batch_idx, trainer.num_batches = 0, 2  # not the epoch's last batch: no update_lr
    ctx = model.prompt_learner.ctx
    label = torch.tensor(case["labels"])
    rec = {"ctx0": ctx.detach().clone()}
    # their forward and losses, and both gradients before the projection
    logits = model(image)
    with torch.no_grad():
        zs_logits = zs_clip(image)
    xe, kl = trainer.criterion(logits, zs_logits.detach(), label)
    rec["grad_ce"] = torch.autograd.grad(xe, ctx, retain_graph=True)[0]
    rec["grad_kl"] = torch.autograd.grad(kl, ctx)[0]
    rec.update(logits=logits.detach(), zs_logits=zs_logits, xe_loss=xe.detach(),
               kl_loss=kl.detach())
    # their step: forward_backward -> prograd_backward_and_update -> SGD
    summary = trainer.forward_backward({"img": image, "label": label})
    rec["summary"] = summary
    rec["grad_prograd"] = ctx.grad.detach().clone()
    rec["ctx1"] = ctx.detach().clone()
    rec["prompt_prefix_tokens"] = model.prompt_learner.tokenized_prompts
    out[name] = rec
torch.save(out, work + "/authors.pt")
"""


def run_authors(authors: str, ckpt: str, work: str) -> dict:
    """Run :data:`DRIVER` with the authors' code (cwd: their ProGrad.public)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, authors, ckpt, work],
        cwd=osp.join(authors, "ProGrad.public"),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        raise SystemExit(f"the authors' code failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return torch.load(osp.join(work, "authors.pt"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("authors", help="an extracted copy of BeierZhu/Prompt-align")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    with tempfile.TemporaryDirectory() as work:
        _, ckpt, state = tiny_clip_state(work)
        torch.save(inputs(), osp.join(work, "inputs.pt"))
        with open(osp.join(work, "cases.json"), "w") as f:
            json.dump({"cases": CASES, "classnames": CLASSNAMES, "lr": LR}, f)
        results = run_authors(osp.abspath(args.authors), ckpt, work)
    for name, rec in results.items():
        cos = torch.nn.functional.cosine_similarity(
            rec["grad_ce"].flatten(), rec["grad_kl"].flatten(), dim=0
        )
        rec["conflict"] = bool(cos < 0)
        print(
            f"{name}: cos(g_ce, g_kl) {cos:.4f}, xe {rec['xe_loss']:.6f}, kl {rec['kl_loss']:.6f}"
        )
    torch.save(
        {
            "authors_commit": AUTHORS_COMMIT,
            "clip_checksum": clip_checksum(state),
            "cases": results,
        },
        args.out,
    )
    print(f"wrote {args.out} ({osp.getsize(args.out)} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
