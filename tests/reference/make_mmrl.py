"""Write the reference numbers of MMRL's own code for tests/test_mmrl.py.

Usage (outside the test suite; the authors' code is never part of this repository)::

    git --git-dir=<mirror of yunncheng/MMRL> archive 27d8821 | tar -x -C /tmp/mmrl
    python tests/reference/make_mmrl.py /tmp/mmrl [tests/reference/mmrl_27d8821.pt]

What it runs: the tiny deterministic CLIP of :data:`CLIP_CONFIG` (open_clip, QuickGELU, fp32,
``engine.clip.toy.write_tiny_clip`` with seed 0, every weight rounded to fp16 as OpenAI's are:
:func:`write_reference_clip`; widths of 64 so that OpenAI's ``build_model``, which takes
``width // 64`` heads, rebuilds the same model) is loaded from its state dict into
MMRL's ``clip/model_mmrl.py`` (``build_model_MMRL``, once as "MMRL" and once as the frozen
"CLIP"), and MMRL's ``trainers/mmrl.py`` parts run as its ``MMRL.build_model`` and
``forward_backward`` (PREC fp32) do: ``CustomCLIP``, the frozen text features of
``_get_text_base_features_zero_shot``, ``MMRL_Loss``, the trainable parameters chosen by
``names_to_update``, then one plain SGD step (``torch.optim.SGD``, lr :data:`LR`, no momentum or
weight decay) and the evaluation-mode forward (its ``test()`` logits) on the same images.

Inputs: :data:`CLASSNAMES` with the DescribableTextures template, images ``torch.randn(4, 3,
32, 32)`` after ``torch.manual_seed(IMAGE_SEED)``, labels :data:`LABELS`; MMRL's settings
:data:`SETTINGS` (representation tokens in blocks 2 and 4 of the 4-block towers, so a block
between two of its layers propagates them). The learnable parameters start as MMRL's code draws
them after ``torch.manual_seed(INIT_SEED)``; they are stored, and the test loads them.

Minimal patches to run MMRL's code on a CPU, all in this process (its files are not edited):

1. ``torch.Tensor.cuda`` and ``torch.nn.Module.cuda`` return their object unchanged
   (``_get_text_base_features_zero_shot`` moves the text encoder and the embeddings to CUDA);
2. this project's ``dassl`` compatibility package stands in for Dassl (MMRL's trainers/mmrl.py
   imports ``dassl.engine``, ``dassl.metrics``, ``dassl.utils`` and ``dassl.optim``; none of
   their code runs here) and MMRL's repository comes first on ``sys.path`` (its ``clip`` and
   ``trainers`` packages, not this project's).

Stored (a .pt of CPU tensors, a few tens of KB): the initial learnable parameters, the
logits of both paths and the fused ones, the loss and its four terms, the gradients of the
learnable parameters, the parameters after the SGD step, the evaluation-mode logits, and a
checksum of the tiny CLIP's weights (the test checks it regenerates the same model).
"""

from __future__ import annotations

import os
import os.path as osp
import subprocess
import sys
import tempfile

import torch

HERE = osp.dirname(osp.abspath(__file__))
REPO = osp.dirname(osp.dirname(HERE))
OUT = osp.join(HERE, "mmrl_27d8821.pt")

CLIP_CONFIG = {
    "embed_dim": 32,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "layers": 4, "width": 64, "patch_size": 8, "head_width": 64},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 1, "layers": 4},
}
CLASSNAMES = ["red circle", "blue_square", "a very long class name with words"]
DATASET = "DescribableTextures"
LABELS = [0, 1, 2, 0]
IMAGE_SEED, INIT_SEED, CLIP_SEED = 1, 2, 0
LR = 0.5
SETTINGS = {
    "ALPHA": 0.7,
    "REG_WEIGHT": 2.0,
    "N_REP_TOKENS": 3,
    "REP_LAYERS": [2, 4],
    "REP_DIM": 16,
}
# MMRL's learnable tensors -> this project's names (trainers/mmrl.py, RepresentationLearner)
LEARNABLE = {
    "representation_learner.compound_rep_tokens": "compound_rep_tokens",
    "image_encoder.proj_rep": "proj_rep",
}
for _i in range(len(SETTINGS["REP_LAYERS"])):
    for _tower in ("r2v", "r2t"):
        for _p in ("weight", "bias"):
            _old = f"representation_learner.compound_rep_tokens_{_tower}proj.{_i}.{_p}"
            LEARNABLE[_old] = f"compound_rep_tokens_{_tower}proj.{_i}.{_p}"


def clip_checksum(state_dict: dict) -> float:
    """A fingerprint of the tiny CLIP's weights (sum of |w| over every tensor, float64)."""
    return float(sum(v.double().abs().sum() for v in state_dict.values() if v.is_floating_point()))


def write_reference_clip(folder: str) -> tuple[str, str]:
    """Write the tiny CLIP (write_tiny_clip, seed CLIP_SEED) with every weight rounded to fp16.

    MMRL's ``build_model_MMRL`` loads the state dict into half-precision layers before its fp32
    mode casts them back (OpenAI's weights are fp16 values): weights that fp16 represents
    exactly make that round trip lossless, so both code bases see the same model. Returns the
    config and checkpoint paths.
    """
    if REPO not in sys.path:
        sys.path.append(REPO)
    from engine.clip.toy import write_tiny_clip

    cfg_path, ckpt = write_tiny_clip(folder, config=CLIP_CONFIG, seed=CLIP_SEED)
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    state = saved.get("state_dict", saved)
    for k, v in state.items():
        if v.is_floating_point():
            state[k] = v.half().float()
    torch.save(saved, ckpt)
    return cfg_path, ckpt


def tiny_clip_state(folder: str) -> dict:
    """The state dict of :func:`write_reference_clip`."""
    _, ckpt = write_reference_clip(folder)
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    return saved.get("state_dict", saved)


def run(authors: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        state = tiny_clip_state(tmp)
    state = {k: v.float() for k, v in state.items()}
    checksum = clip_checksum(state)
    # patch 2: MMRL's packages first, this project's dassl package after them
    for name in [m for m in sys.modules if m.split(".")[0] in ("clip", "trainers", "dassl")]:
        del sys.modules[name]
    sys.path[:] = [authors] + [p for p in sys.path if p != REPO] + [REPO]
    # patch 1: no CUDA
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self

    from yacs.config import CfgNode as CN

    from clip import clip as mmrl_clip  # MMRL's clip package
    from trainers import mmrl as M  # MMRL's trainers/mmrl.py

    assert osp.dirname(osp.abspath(M.__file__)) == osp.join(authors, "trainers"), M.__file__
    cfg = CN()
    cfg.INPUT = CN({"SIZE": (32, 32)})
    cfg.DATASET = CN({"NAME": DATASET, "SUBSAMPLE_CLASSES": "base"})
    cfg.TRAINER = CN({"MMRL": CN({**SETTINGS, "PREC": "fp32"})})
    cfg.TASK = "B2N"

    def build(model_name: str):
        details = {
            "model": model_name,
            "rep_tokens_layers": SETTINGS["REP_LAYERS"],
            "n_rep_tokens": SETTINGS["N_REP_TOKENS"],
        }
        model = mmrl_clip.build_model_MMRL(dict(state), details).float()  # PREC fp32
        own = set(model.state_dict())
        missing = own - set(state)
        # MMRL's one new tensor (random; unused by the "CLIP" model)
        assert missing == {"visual.proj_rep"}, f"not loaded into MMRL's {model_name}: {missing}"
        assert not set(state) - own - {"attn_mask"}, set(state) - own
        return model

    torch.manual_seed(INIT_SEED)
    clip_model, clip_zs = build("MMRL"), build("CLIP")
    with torch.no_grad():
        text_encoder_clip = M.TextEncoder_CLIP(clip_zs)
        t_clip = M._get_text_base_features_zero_shot(cfg, CLASSNAMES, clip_zs, text_encoder_clip)
        t_clip = t_clip / t_clip.norm(dim=-1, keepdim=True)
    image_encoder_clip = clip_zs.visual
    model = M.CustomCLIP(cfg, CLASSNAMES, clip_model)
    names_to_update = ["representation_learner", "image_encoder.proj_rep"]
    for name, p in model.named_parameters():
        p.requires_grad_(any(n in name for n in names_to_update))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(trainable) == set(LEARNABLE), sorted(trainable)
    initial = {LEARNABLE[n]: p.detach().clone() for n, p in trainable.items()}
    criterion = M.MMRL_Loss(reg_weight=SETTINGS["REG_WEIGHT"], alpha=SETTINGS["ALPHA"])
    optim = torch.optim.SGD(list(trainable.values()), lr=LR)

    torch.manual_seed(IMAGE_SEED)
    image = torch.randn(4, 3, 32, 32)
    label = torch.tensor(LABELS)
    model.train()
    # MMRL.forward_backward, PREC fp32
    with torch.no_grad():
        f0 = image_encoder_clip(image)
        f0 = f0 / f0.norm(dim=-1, keepdim=True)
    logits, logits_rep, logits_fusion, image_features, text_features = model(image)
    loss = criterion(logits, logits_rep, image_features, text_features, f0, t_clip, label)
    terms = {
        "ce": torch.nn.functional.cross_entropy(logits, label),
        "ce_rep": torch.nn.functional.cross_entropy(logits_rep, label),
        "reg_image": 1 - torch.nn.functional.cosine_similarity(image_features, f0, dim=1).mean(),
        "reg_text": 1 - torch.nn.functional.cosine_similarity(text_features, t_clip, dim=1).mean(),
    }
    optim.zero_grad()
    loss.backward()
    grads = {LEARNABLE[n]: p.grad.detach().clone() for n, p in trainable.items()}
    optim.step()
    after = {LEARNABLE[n]: p.detach().clone() for n, p in trainable.items()}
    # MMRL.test(): evaluation mode, the updated parameters
    model.eval()
    with torch.no_grad():
        e_logits, _, e_fusion, _, _ = model(image)
    commit = subprocess.run(
        ["git", "-C", authors, "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "source": "yunncheng/MMRL",
        "commit": commit or "27d8821 (an archive: no git metadata)",
        "clip_checksum": checksum,
        "settings": SETTINGS,
        "lr": LR,
        "initial": initial,
        "zs_text_features": t_clip.detach(),
        "zs_image_features": f0.detach(),
        "logits": logits.detach(),
        "logits_rep": logits_rep.detach(),
        "logits_fusion": logits_fusion.detach(),
        "loss": loss.detach(),
        "terms": {k: v.detach() for k, v in terms.items()},
        "grads": grads,
        "after": after,
        "eval_logits": e_logits.detach(),
        "eval_fusion": e_fusion.detach(),
    }


def main(argv: list[str]) -> None:
    if not argv or not osp.isfile(osp.join(argv[0], "clip", "model_mmrl.py")):
        raise SystemExit("usage: make_mmrl.py <extracted copy of yunncheng/MMRL> [out.pt]")
    out = argv[1] if len(argv) > 1 else OUT
    torch.set_num_threads(1)
    ref = run(osp.abspath(argv[0]))
    torch.save(ref, out)
    print(f"wrote {out} ({os.path.getsize(out)} bytes); loss {float(ref['loss']):.6f}")


if __name__ == "__main__":
    main(sys.argv[1:])
