"""Every trainer on every backbone family: tiny random-weight CLIPs shaped like each open_clip
architecture (engine.clip.toy.shrunk_config: the architecture's width ratios, head counts,
patch size, activation and ResNet stages at 1/16 of the width) build, train one step and
evaluate; the trainers with vision prompts refuse the ResNets before loading anything.

A trainer registered later (trainers/) is picked up without editing this file; its options for
the tiny towers come from its config keys (helpers.tiny_options).
"""

from __future__ import annotations

import pytest
from conftest import make_cfg
from helpers import DEPTH, assert_one_step_updates, tiny_options

from engine import build_trainer
from engine.clip.model import BackboneError
from engine.clip.toy import write_tiny_clip
from engine.errors import ConfigError
from engine.registry import TRAINER_REGISTRY

# backbone name (CoOp's, or the open_clip weights' family) -> (open_clip architecture, QuickGELU)
FAMILIES = {
    "ViT-B/32": ("ViT-B-32", True),  # vision/text width 768/512, patch 32
    "ViT-B/16": ("ViT-B-16", True),
    "ViT-L/14": ("ViT-L-14", True),  # 1024/768, 24 vision blocks
    "ViT-L/14@336px": ("ViT-L-14-336", True),  # a 3x3 grid: other positional embeddings
    "ViT-H-14:laion2b_s32b_b79k": ("ViT-H-14", None),  # 1280/1024, GELU (LAION)
    "ViT-bigG-14:laion2b_s39b_b160k": ("ViT-bigG-14", None),  # mlp_ratio 4.9231, 13 heads
    "RN50": ("RN50", True),  # embedding 2x the text width
    "RN101": ("RN101", True),
    "RN50x4": ("RN50x4", True),
}
RESNETS = ("RN50", "RN101", "RN50x4")
TRAINERS = sorted(
    n for n in TRAINER_REGISTRY if not getattr(TRAINER_REGISTRY.get(n), "ALIAS_OF", "")
)


def needs_vit(trainer: str) -> bool:
    from trainers.maple import MaPLe
    from trainers.mmrl import MMRL  # representation tokens in the vision tower

    cls = TRAINER_REGISTRY.get(trainer)
    return issubclass(cls, (MaPLe, MMRL)) or getattr(cls, "NEEDS_VIT", False)  # SkipTuning


@pytest.fixture(scope="module")
def family_opts(tmp_path_factory):
    """Backbone name -> the KEY VALUE options selecting its tiny CLIP (written once)."""
    from engine.clip.toy import shrunk_config

    out = {}
    for name, (arch, quick_gelu) in FAMILIES.items():
        config, size = shrunk_config(arch, quick_gelu)
        folder = str(tmp_path_factory.mktemp(arch))
        cfg_path, ckpt = write_tiny_clip(folder, config=config)
        out[name] = [
            "MODEL.BACKBONE.NAME", name, "MODEL.BACKBONE.CONFIG", cfg_path,
            "MODEL.BACKBONE.PATH", ckpt, "INPUT.SIZE", f"({size}, {size})",
            "DATALOADER.NUM_WORKERS", "0", "DATALOADER.TRAIN_X.BATCH_SIZE", "4",
            "DATALOADER.TEST.BATCH_SIZE", "32", "TEST.FEATURE_CACHE", "False",
        ]  # fmt: skip
    return out


def options(trainer, backbone, family_opts, root, tmp_path) -> list[str]:
    node = TRAINER_REGISTRY.get(trainer).config_node()
    opts = ["--root", root, "--seed", "1", "--output-dir", str(tmp_path / "out")]
    opts += family_opts[backbone] + tiny_options(trainer, tmp_path, DEPTH)
    opts += [f"TRAINER.{node}.PREC", "fp32", "OPTIM.MAX_EPOCH", "1", "DATASET.NUM_SHOTS", "2"]
    return opts


CASES = [(t, b) for t in TRAINERS for b in FAMILIES if not (needs_vit(t) and b in RESNETS)]


@pytest.mark.parametrize("trainer,backbone", CASES, ids=[f"{t}-{b}" for t, b in CASES])
def test_trainer_builds_trains_and_evaluates(trainer, backbone, family_opts, dtd_root_shared,
                                             tmp_path):  # fmt: skip
    cfg = make_cfg(options(trainer, backbone, family_opts, dtd_root_shared, tmp_path), trainer)
    tr = build_trainer(cfg)
    if not tr.EVAL_ONLY:
        tr.set_model_mode("train")
        assert_one_step_updates(tr)  # every learnable tensor moves, finite, fp32
    accuracy = tr.test()
    assert 0.0 <= accuracy <= 100.0


REFUSED = [(t, b) for t in TRAINERS for b in RESNETS if needs_vit(t)]


@pytest.mark.parametrize("trainer,backbone", REFUSED, ids=[f"{t}-{b}" for t, b in REFUSED])
def test_vision_prompt_trainers_refuse_resnets(trainer, backbone, family_opts, tmp_path):
    cfg = make_cfg(options(trainer, backbone, family_opts, "/nonexistent", tmp_path), trainer)
    with pytest.raises(ConfigError) as info:  # before any data or weights are read
        build_trainer(cfg)
    assert isinstance(info.value, BackboneError)  # as when the model itself is refused
    message = str(info.value)
    assert f"{trainer} cannot use the backbone {backbone}: its " in message
    assert "need a ViT" in message or "needs a ViT" in message  # prompts / SkipTuning's blocks
    assert "MODEL.BACKBONE.NAME ViT-B/16" in message and "ViT-L/14@336px" in message


@pytest.mark.parametrize(
    "backbone,size", [("ViT-L/14@336px", "(28, 28)"), ("RN50x4", "(32, 32)")], ids=["vit", "rn"]
)
def test_input_size_must_be_the_backbones(backbone, size, family_opts, tmp_path):
    opts = options("CoOp", backbone, family_opts, "/nonexistent", tmp_path) + ["INPUT.SIZE", size]
    want = f"INPUT.SIZE {size} differs from the CLIP image size .* of the backbone {backbone}"
    with pytest.raises(ConfigError, match=want.replace("(", r"\(").replace(")", r"\)")):
        build_trainer(make_cfg(opts, "CoOp"), classnames=["cat", "dog"])


@pytest.mark.parametrize("arch", ["ViT-L-14-CLIPA", "ViT-H-14-worldwide", "ViT-B-16-SigLIP"])
def test_text_towers_without_clip_prompts_are_refused(arch, tmp_path):
    """Other tokenizers, no causal mask, custom text towers: a BackboneError naming what works."""
    opts = ["--output-dir", str(tmp_path), "MODEL.BACKBONE.NAME", arch]
    opts += ["MODEL.BACKBONE.PRETRAINED", "False", "TRAINER.COOP.PREC", "fp32"]
    with pytest.raises(BackboneError, match="another tokenizer|standard text tower"):
        build_trainer(make_cfg(opts, "CoOp"), classnames=["cat", "dog"])


def test_published_vit_l14_setting():
    """PromptSRC's ViT-L/14 base-to-new setting (PromptKD's teacher config)."""
    name = "configs/trainers/PromptSRC/vit_l14_c2_ep20_batch8_4+4ctx.yaml"
    for config_file in (name, name.replace("4+4ctx", "4x4ctx")):
        cfg = make_cfg([], trainer="PromptSRC", config_file=config_file)
        node = cfg.TRAINER.PROMPTSRC
        assert cfg.MODEL.BACKBONE.NAME == "ViT-L/14" and cfg.DATALOADER.TRAIN_X.BATCH_SIZE == 8
        assert (cfg.OPTIM.NAME, cfg.OPTIM.LR, cfg.OPTIM.MAX_EPOCH) == ("sgd", 0.005, 20)
        assert (node.N_CTX_TEXT, node.N_CTX_VISION) == (4, 4)
        assert (node.PROMPT_DEPTH_TEXT, node.PROMPT_DEPTH_VISION) == (9, 9)
