"""MaPLe (trainers/maple.py) and the prompted vision encoder (engine/clip/vision.py) on a tiny
CLIP with 4 text and 4 vision blocks (prompts in the first 3)."""

from __future__ import annotations

import fnmatch
import os.path as osp

import pytest
import torch
from conftest import ROOT, make_cfg
from helpers import (
    DEEP_CLIP,
    DEPTH,
    MAPLE_CFG,
    N_CTX,
    PROJECTIONS,
    PROMPTS,
    SAMPLE_FILE,
    build,
    check_base_to_new,
    check_staged,
    staged_run,
    trainer_opts,
)

from engine import build_trainer
from engine.clip import BackboneError, PromptedVisionEncoder, TextEncoder, load_clip, tokenize
from engine.clip.model import build_clip
from trainers.maple import MaPLeCLIP, MultiModalPromptLearner, text_prompt_hook

CLASSES = ["red circle", "blue_square", "a very long class name with words"]


@pytest.fixture(scope="module")
def clip_model(deep_opts):
    return load_clip(make_cfg(deep_opts[:6]))


def record_blocks(blocks) -> tuple[list, list]:
    """Inputs and outputs of every block in ``blocks`` (forward hooks), and the handles."""
    inputs, outputs = [None] * len(blocks), [None] * len(blocks)
    handles = []
    for i, block in enumerate(blocks):

        def pre(_, args, i=i):
            inputs[i] = args[0].detach().clone()

        def post(_, args, out, i=i):
            outputs[i] = out.detach().clone()

        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    return inputs, outputs, handles


# ----------------------------------------------------------------------------------------------
# The vision seam
# ----------------------------------------------------------------------------------------------
def test_vision_encoder_without_prompts_is_open_clips_forward(clip_model):
    images = torch.randn(3, 3, 32, 32)
    enc = PromptedVisionEncoder(clip_model)
    with torch.no_grad():
        assert torch.equal(enc(images), clip_model.visual(images))
    # appended tokens never reach the pooled output directly (class-token pooling)
    x = enc.embed(images, torch.randn(N_CTX, enc.width))
    assert x.shape == (3, 1 + 16 + N_CTX, 64)


def test_resnet_backbone_is_a_clear_error():
    cfg = {**DEEP_CLIP, "vision_cfg": {"image_size": 64, "layers": [1, 1, 1, 1], "width": 16}}
    resnet_clip = build_clip(cfg)
    with pytest.raises(BackboneError, match="need a ViT image encoder.*ModifiedResNet"):
        MultiModalPromptLearner(CLASSES, resnet_clip)


# ----------------------------------------------------------------------------------------------
# The prompt learner
# ----------------------------------------------------------------------------------------------
def test_token_positions_follow_maple(clip_model):
    """ "a photo of a {class}." with positions 1..N_CTX learnable, initialised from the first
    N_CTX words; the other words stay as fixed tokens."""
    pl = MultiModalPromptLearner(CLASSES, clip_model, n_ctx=N_CTX, depth=DEPTH)
    names = [c.replace("_", " ") for c in CLASSES]
    tokens = tokenize([f"a photo of a {n}." for n in names])
    emb = clip_model.token_embedding(tokens).detach()  # [n_cls, 77, width]
    out = pl()
    seq = out.text.shape[1]
    assert seq < 77 and torch.equal(pl.eot_idx, tokens.argmax(-1))
    assert torch.equal(pl.ctx.data, emb[0, 1 : 1 + N_CTX])  # "a", "photo"
    assert torch.equal(out.text.detach(), emb[:, :seq])  # ctx == its init: the whole sentence
    with torch.no_grad():
        pl.ctx.add_(1.0)
    text = pl().text.detach()
    assert torch.equal(text[:, 1 : 1 + N_CTX], (emb[0, 1 : 1 + N_CTX] + 1).expand(3, -1, -1))
    assert torch.equal(text[:, :1], emb[:, :1]) and torch.equal(
        text[:, 1 + N_CTX :], emb[:, 1 + N_CTX : seq]
    )
    # shapes and dtypes of the learnable part; every deep projection starts from one init
    assert pl.ctx.dtype == torch.float32 and pl.proj.weight.shape == (64, 32)
    assert [tuple(p.shape) for p in pl.compound_prompts_text] == [(N_CTX, 32)] * (DEPTH - 1)
    w = [layer.weight for layer in pl.compound_prompt_projections]
    assert len(w) == DEPTH - 1 and torch.equal(w[0], w[1]) and w[0] is not w[1]
    assert out.vision.shape == (N_CTX, 64) and len(out.deep_vision) == DEPTH - 1


def test_prompt_learner_rejects_bad_settings(clip_model):
    with pytest.raises(ValueError, match="N_CTX 5 is larger than the 4 words"):
        MultiModalPromptLearner(CLASSES, clip_model, n_ctx=5, depth=DEPTH)
    with pytest.raises(ValueError, match="PROMPT_DEPTH must be between 1 and .* \\(4\\), got 5"):
        MultiModalPromptLearner(CLASSES, clip_model, depth=5)
    rand = MultiModalPromptLearner(CLASSES, clip_model, n_ctx=3, ctx_init="", depth=1)
    assert rand.prompt_prefix == "X X X" and len(rand.compound_prompts_text) == 0


def test_checkpoint_state_is_only_learnable(clip_model):
    pl = MultiModalPromptLearner(CLASSES, clip_model, n_ctx=N_CTX, depth=DEPTH)
    assert set(pl.state_dict()) == PROMPTS | PROJECTIONS  # no token buffers, no CLIP weights


def test_deep_prompts_enter_the_right_blocks_at_the_right_positions(clip_model):
    torch.manual_seed(0)
    pl = MultiModalPromptLearner(CLASSES, clip_model, n_ctx=N_CTX, depth=DEPTH)
    with torch.no_grad():
        for p in pl.parameters():
            p.add_(torch.randn_like(p))
    model = MaPLeCLIP(pl, clip_model)
    t_in, t_out, h1 = record_blocks(clip_model.transformer.resblocks)
    v_in, v_out, h2 = record_blocks(clip_model.visual.transformer.resblocks)
    with torch.no_grad():
        logits = model(torch.randn(2, 3, 32, 32))
        deep_vision = [
            layer(p) for layer, p in zip(pl.compound_prompt_projections, pl.compound_prompts_text)
        ]
        block0_vision = clip_model.visual.ln_pre(pl.proj(pl.ctx))
    for h in h1 + h2:
        h.remove()
    assert logits.shape == (2, len(CLASSES))
    n = N_CTX
    # text: block 0 gets ctx (+ positional embedding); blocks 1..DEPTH-1 the deep prompts
    pos = clip_model.positional_embedding[1 : 1 + n]
    assert torch.allclose(t_in[0][:, 1 : 1 + n], pl.ctx.detach() + pos, atol=1e-6)
    for i in range(1, DEPTH):
        deep = pl.compound_prompts_text[i - 1].detach().expand(len(CLASSES), -1, -1)
        assert torch.equal(t_in[i][:, 1 : 1 + n], deep)
        assert torch.equal(t_in[i][:, :1], t_out[i - 1][:, :1])
        assert torch.equal(t_in[i][:, 1 + n :], t_out[i - 1][:, 1 + n :])
    for i in range(DEPTH, 4):
        assert torch.equal(t_in[i], t_out[i - 1])  # propagated, not replaced
    # vision: 1 class + 16 patch tokens + n prompts; prompts are the last n tokens
    assert v_in[0].shape == (2, 1 + 16 + n, 64)
    assert torch.allclose(v_in[0][:, -n:], block0_vision.expand(2, -1, -1), atol=1e-5)
    for i in range(1, DEPTH):
        assert torch.equal(v_in[i][:, -n:], deep_vision[i - 1].expand(2, -1, -1))
        assert torch.equal(v_in[i][:, :-n], v_out[i - 1][:, :-n])
    for i in range(DEPTH, 4):
        assert torch.equal(v_in[i], v_out[i - 1])


def test_truncated_text_equals_full_length(clip_model):
    torch.manual_seed(0)
    pl = MultiModalPromptLearner(CLASSES, clip_model, n_ctx=N_CTX, depth=DEPTH)
    with torch.no_grad():
        pl.ctx.add_(torch.randn_like(pl.ctx))
    model = MaPLeCLIP(pl, clip_model)
    names = [c.replace("_", " ") for c in CLASSES]
    tokens = tokenize([f"a photo of a {n}." for n in names])  # [n_cls, 77]
    with torch.no_grad():
        prompts = pl()
        emb = clip_model.token_embedding(tokens)
        ctx = pl.ctx.expand(len(names), -1, -1)
        full = torch.cat([emb[:, :1], ctx, emb[:, 1 + N_CTX :]], dim=1)  # [n_cls, 77, width]
        hook = text_prompt_hook(prompts.deep_text, N_CTX)
        want = TextEncoder(clip_model)(full, tokens.argmax(-1), layer_hook=hook)
        got = model.text_features(prompts)
    assert prompts.text.shape[1] < 77
    assert (got - want).abs().max().item() == 0.0


# ----------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------
def test_trainer_trains_only_the_prompt_learner(tmp_path, dtd_root, deep_opts):
    tr = build(tmp_path, dtd_root, deep_opts)
    trainable = {n for n, p in tr.model.named_parameters() if p.requires_grad}
    assert trainable == {f"prompt_learner.{n}" for n in PROMPTS | PROJECTIONS}
    images = next(iter(tr.test_loader))["img"]
    with torch.no_grad():
        assert tr.model(images).shape == (images.shape[0], tr.num_classes)
    tr.save_model(0, str(tmp_path / "ckpt"))
    path = osp.join(tmp_path, "ckpt", "MultiModalPromptLearner", "model.pth.tar-1")
    state = torch.load(path, weights_only=True)["state_dict"]
    assert set(state) == PROMPTS | PROJECTIONS


def _paper_freeze_patterns(trainer: str) -> dict:
    values = {}
    for name in ("sam", "fsam", "sagm", "sample"):
        cfg = make_cfg(
            ["--optim-config-file", osp.join(ROOT, f"configs/optim/{trainer}/{name}.yaml")]
        )
        values[name] = cfg.OPTIM.SAM
    return values


def test_configs_hold_the_published_values():
    cfg = make_cfg([], trainer="MaPLe", config_file=MAPLE_CFG)
    o, m = cfg.OPTIM, cfg.TRAINER.MAPLE
    assert (cfg.DATALOADER.TRAIN_X.BATCH_SIZE, cfg.DATALOADER.TEST.BATCH_SIZE) == (4, 100)
    assert (o.NAME, o.LR, o.MAX_EPOCH, o.LR_SCHEDULER) == ("sgd", 0.0035, 5, "cosine")
    assert (o.WARMUP_EPOCH, o.WARMUP_TYPE, o.WARMUP_CONS_LR) == (1, "constant", 1e-5)
    assert (m.N_CTX, m.CTX_INIT, m.PREC, m.PROMPT_DEPTH) == (2, "a photo of a", "fp16", 9)
    assert cfg.INPUT.INTERPOLATION == "bicubic" and cfg.TRAIN.PRINT_FREQ == 20
    assert cfg.INPUT.TRANSFORMS == ("random_resized_crop", "random_flip", "normalize")
    cross = make_cfg(
        [], trainer="MaPLe", config_file=MAPLE_CFG.replace(".yaml", "_cross_datasets.yaml")
    )
    assert (cross.OPTIM.LR, cross.OPTIM.MAX_EPOCH, cross.TRAINER.MAPLE.PROMPT_DEPTH) == (
        0.0026,
        2,
        3,
    )
    # the paper's MaPLe values; the stage switch freezes exactly the projections
    paper = {
        "sam": (0.05,),
        "sagm": (0.10, 0.001),
        "fsam": (0.05, 0.15),
        "sample": (0.10, 0.0015, 0.15),
    }
    names = PROMPTS | PROJECTIONS
    for name, sam in _paper_freeze_patterns("MaPLe").items():
        got = (
            (sam.RHO, sam.ALPHA, sam.LAMBDA)[: len(paper[name])]
            if name != "fsam"
            else (sam.RHO, sam.LAMBDA)
        )
        assert sam.NAME == name and got == paper[name] and sam.START_EPOCH == 0
        frozen = {n for n in names if any(fnmatch.fnmatch(n, p) for p in sam.FREEZE)}
        if name == "sample":  # the paper stages SAMPLe: stage 2 after the published schedule
            assert sam.STAGE2_EPOCHS == 2 and frozen == PROJECTIONS
        else:  # SAM/F-SAM/SAGM are not staged
            assert sam.STAGE2_EPOCHS == 0 and not frozen


def test_input_size_must_be_the_clip_image_size(tmp_path, dtd_root, deep_opts):
    with pytest.raises(ValueError, match=r"INPUT.SIZE \(64, 64\) differs from the CLIP image size"):
        build(tmp_path, dtd_root, deep_opts, "INPUT.SIZE", "(64, 64)")


def test_stage_that_never_starts_is_an_error(tmp_path, dtd_root, deep_opts):
    tr = build(tmp_path, dtd_root, deep_opts, "OPTIM.MAX_EPOCH", "2", "OPTIM.SAM.START_EPOCH", "3",
               "OPTIM.SAM.STAGE2_EPOCHS", "0", optim_file=SAMPLE_FILE)  # fmt: skip
    with pytest.raises(ValueError, match="START_EPOCH 3 >= OPTIM.MAX_EPOCH 2"):
        tr.train()


def test_staged_training_freezes_the_projections(tmp_path, dtd_root, deep_opts):
    tr = build(tmp_path, dtd_root, deep_opts, "OPTIM.MAX_EPOCH", "1",
               "OPTIM.SAM.STAGE2_EPOCHS", "1", optim_file=SAMPLE_FILE)  # fmt: skip
    check_staged(tr, staged_run(tr), frozen=PROJECTIONS, trained=PROMPTS)


XD_CFG = "configs/trainers/MaPLe/vit_b16_c2_ep5_batch4_2ctx_cross_datasets.yaml"


@pytest.mark.parametrize("config", [MAPLE_CFG, XD_CFG], ids=["base2new", "cross_dataset"])
def test_projections_train_at_the_full_lr_before_they_are_frozen(
    config, tmp_path, dtd_root, deep_opts
):
    """The published configs' own schedules (5 and 2 epochs, 1 warmup epoch at 1e-5) with the
    paper's staged SAMPLe: the projections leave their init at the config's full LR in stage 1
    (MaPLe's cross-dataset config included), then stay frozen through stage 2."""
    cfg0 = make_cfg([], trainer="MaPLe", config_file=config)
    opts = trainer_opts(dtd_root, str(tmp_path / "out"), deep_opts)
    opts += ["OPTIM.MAX_EPOCH", str(cfg0.OPTIM.MAX_EPOCH), "OPTIM.LR", str(cfg0.OPTIM.LR)]
    cfg = make_cfg(["--optim-config-file", osp.join(ROOT, SAMPLE_FILE), *opts], trainer="MaPLe",
                   config_file=config)  # fmt: skip
    tr = build_trainer(cfg)
    max_epoch, full_lr = cfg0.OPTIM.MAX_EPOCH, cfg0.OPTIM.LR
    assert tr.max_epoch == max_epoch + 2 and tr.optim_step.staging.start_epoch == max_epoch
    lrs, two_pass = {}, {}
    step = tr.forward_backward

    def recording(batch):
        out = step(batch)
        lrs.setdefault(tr.epoch, tr.get_current_lr())
        two_pass.setdefault(tr.epoch, set()).add("grad_norm" in out)
        return out

    tr.forward_backward = recording
    snaps = staged_run(tr)
    assert lrs[0] == 1e-5 and lrs[1] == pytest.approx(full_lr)  # warmup, then the full LR
    assert lrs[max_epoch] == pytest.approx(full_lr)  # stage 2: a new cosine from OPTIM.LR
    assert lrs[max_epoch + 1] == pytest.approx(full_lr / 2)
    assert all(two_pass[e] == {e >= max_epoch} for e in lrs)  # SAMPLe in stage 2 only
    for name in PROJECTIONS:  # moved in the full-LR epoch (epoch 1), then frozen
        assert not torch.equal(snaps[1][name], snaps[2][name]), name
        assert torch.equal(snaps[max_epoch][name], snaps["end"][name]), name
    check_staged(tr, snaps, frozen=PROJECTIONS, trained=PROMPTS)


# ----------------------------------------------------------------------------------------------
# train.py: base classes with SGD and with SAMPLe (staged), then the new classes
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_train_py_base_to_new(tmp_path, dtd_root, deep_opts):
    check_base_to_new(tmp_path, dtd_root, deep_opts, "MaPLe", MAPLE_CFG, PROMPTS | PROJECTIONS)
