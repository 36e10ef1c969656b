"""KgCoOp, IVLP and PromptSRC (trainers/kgcoop.py, ivlp.py, promptsrc.py) on a tiny CLIP with 4
text and 4 vision blocks: documented structure (token positions per block, losses against
hand-computed values, GPA weights and aggregate), prompt-only checkpoints, every precision with
SGD and SAMPLe, published configs, and train.py base -> new runs."""

from __future__ import annotations

import math
import os.path as osp
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, make_cfg
from helpers import train_in_process, train_interrupted

from engine import build_trainer
from engine.clip import TextEncoder, load_clip, tokenize
from engine.clip.toy import TINY_OPTS, write_tiny_clip
from engine.registry import TRAINER_REGISTRY
from tools.benchmark import reference_style
from trainers.ivlp import IVLPCLIP, IndependentPromptLearner
from trainers.promptsrc import IMAGENET_TEMPLATES, gpa_weights, promptsrc_losses

DEEP_CLIP = {
    "embed_dim": 32,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "layers": 4, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 4},
}
CLASSES = ["red circle", "blue_square", "a very long class name with words"]
NEW_TRAINERS = ("KgCoOp", "IVLP", "PromptSRC")
# IVLP/PromptSRC on the 4-block CLIP: different token counts and depths per tower, so a mix-up
# of the two shows
N_TEXT, N_VISION, DEPTH_TEXT, DEPTH_VISION = 2, 3, 3, 2
IVLP_STATE = {"ctx", "vpt", "deep_text.0", "deep_text.1", "deep_vision.0"}
CONFIGS = {
    "KgCoOp": "configs/trainers/KgCoOp/vit_b16_ep100_ctxv1.yaml",
    "IVLP": "configs/trainers/IVLP/vit_b16_c2_ep20_batch4_4+4ctx.yaml",
    "PromptSRC": "configs/trainers/PromptSRC/vit_b16_c2_ep20_batch4_4+4ctx.yaml",
}
CHECKPOINT_FOLDER = {"KgCoOp": "prompt_learner", "IVLP": "VLPromptLearner"}
CHECKPOINT_FOLDER["PromptSRC"] = "VLPromptLearner"
STATE = {"KgCoOp": {"ctx"}, "IVLP": IVLP_STATE, "PromptSRC": IVLP_STATE}


@pytest.fixture(scope="module")
def deep_opts(tmp_path_factory):
    cfg_path, ckpt = write_tiny_clip(str(tmp_path_factory.mktemp("deep_clip")), config=DEEP_CLIP)
    backbone = ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", cfg_path]
    return [*backbone, "MODEL.BACKBONE.PATH", ckpt, *TINY_OPTS]


@pytest.fixture(scope="module")
def clip_model(deep_opts):
    return load_clip(make_cfg(deep_opts[:6]))


def trainer_opts(trainer: str, prec: str = "fp32") -> list[str]:
    """The trainer's keys for the 4-block CLIP (CTX_INIT "a photo of a")."""
    key = f"TRAINER.{trainer.upper()}"
    opts = [f"{key}.PREC", prec, f"{key}.CTX_INIT", "a photo of a"]
    if trainer != "KgCoOp":
        opts += [f"{key}.N_CTX_TEXT", str(N_TEXT), f"{key}.N_CTX_VISION", str(N_VISION)]
        opts += [f"{key}.PROMPT_DEPTH_TEXT", str(DEPTH_TEXT)]
        opts += [f"{key}.PROMPT_DEPTH_VISION", str(DEPTH_VISION)]
    if trainer == "PromptSRC":
        opts += [f"{key}.GPA_MEAN", "2", f"{key}.GPA_STD", "1.5"]
    return opts


def config(trainer, tmp_path, root, deep_opts, *extra, prec="fp32", optim=""):
    """The config of an in-process run on the generated DTD (2 shots, lr 0.01, no warm-up)."""
    flags = ["--optim-config-file", osp.join(ROOT, f"configs/optim/{trainer}/{optim}.yaml")]
    opts = flags if optim else []
    opts += ["--root", root, "--seed", "1", "--output-dir", str(tmp_path / f"out_{prec}")]
    opts += [*deep_opts, *trainer_opts(trainer, prec), "DATASET.NUM_SHOTS", "2"]
    opts += ["OPTIM.NAME", "sgd", "OPTIM.LR", "0.01", "OPTIM.MAX_EPOCH", "1"]
    opts += ["OPTIM.WARMUP_EPOCH", "0", "TEST.NO_TEST", "True", *extra]
    return make_cfg(opts, trainer=trainer)


def build(trainer, tmp_path, root, deep_opts, *extra, prec="fp32", optim=""):
    """An in-process trainer of :func:`config`."""
    return build_trainer(config(trainer, tmp_path, root, deep_opts, *extra, prec=prec, optim=optim))


def record_blocks(blocks):
    """Inputs and outputs of every block (forward hooks), and the hook handles."""
    inputs, outputs, handles = [None] * len(blocks), [None] * len(blocks), []
    for i, block in enumerate(blocks):

        def pre(_, args, i=i):
            inputs[i] = args[0].detach().clone()

        def post(_, args, out, i=i):
            outputs[i] = out.detach().clone()

        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    return inputs, outputs, handles


def normalize(x):
    return x / x.norm(dim=-1, keepdim=True)


# ----------------------------------------------------------------------------------------------
# KgCoOp
# ----------------------------------------------------------------------------------------------
def test_kgcoop_prompt_and_frozen_features(tmp_path, dtd_root, deep_opts, clip_model):
    tr = build("KgCoOp", tmp_path, dtd_root, deep_opts)
    pl, names = tr.model.prompt_learner, [c.replace("_", " ") for c in tr.classnames]
    # CoOp's prompt: [SOS]["a photo of a" = ctx, learnable][class][.][EOS]
    tokens = tokenize([f"a photo of a {n}." for n in names])
    emb = clip_model.token_embedding(tokens).detach()
    prompts = pl().detach()
    assert torch.equal(pl.ctx.data, emb[0, 1:5]) and torch.equal(
        prompts, emb[:, : prompts.shape[1]]
    )
    # t_clip: KgCoOp's DTD template through the frozen text tower, normalised
    hand = tokenize([f"a photo of a {n}, a type of texture." for n in names])
    with torch.no_grad():
        want = TextEncoder(clip_model)(clip_model.token_embedding(hand), hand.argmax(-1))
    torch.testing.assert_close(tr.model.t_clip, normalize(want), atol=1e-5, rtol=1e-5)
    assert tr.model.template == "a photo of a {}, a type of texture."


def test_kgcoop_loss_is_ce_plus_w_times_one_minus_mean_cos(tmp_path, dtd_root, deep_opts):
    tr = build("KgCoOp", tmp_path, dtd_root, deep_opts, "TRAINER.KGCOOP.W", "3.0")
    with torch.no_grad():
        tr.model.prompt_learner.ctx.add_(torch.randn_like(tr.model.prompt_learner.ctx))
    image, label = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    inputs = tr.prepare_step((image, label))
    loss, terms = tr.compute_loss(inputs)
    with torch.no_grad():
        pl = tr.model.prompt_learner
        img = normalize(tr.model.image_encoder(image))  # CLIP's frozen image tower
        text = normalize(tr.model.text_encoder(pl(), pl.eot_idx))
        logits = tr.model.logit_scale.exp() * img @ text.t()
        t_clip = tr.model.t_clip
        cos = (text * t_clip).sum(-1)  # unit vectors
        kg = 1 - cos.mean()
        want = F.cross_entropy(logits, label) + 3.0 * kg
    torch.testing.assert_close(loss.detach(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(terms["kg"], kg, atol=1e-6, rtol=1e-5)
    # the docstring's identity: 1 - mean cos = mean squared distance / 2
    sq = ((text - t_clip) ** 2).sum(-1).mean() / 2
    torch.testing.assert_close(terms["kg"], sq, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# IVLP / PromptSRC prompts
# ----------------------------------------------------------------------------------------------
def test_independent_prompts_enter_the_right_blocks_at_the_right_positions(clip_model):
    torch.manual_seed(0)
    pl = IndependentPromptLearner(CLASSES, clip_model, N_TEXT, N_VISION, "a photo of a",
                                  DEPTH_TEXT, DEPTH_VISION)  # fmt: skip
    assert set(pl.state_dict()) == IVLP_STATE  # prompts only: no buffers, no CLIP weights
    assert pl.ctx.shape == (N_TEXT, 32) and pl.vpt.shape == (N_VISION, 64)
    names = [c.replace("_", " ") for c in CLASSES]
    emb = clip_model.token_embedding(tokenize([f"a photo of a {n}." for n in names])).detach()
    assert torch.equal(pl.ctx.data, emb[0, 1 : 1 + N_TEXT])  # "a", "photo"
    with torch.no_grad():
        for p in pl.parameters():
            p.add_(torch.randn_like(p))
    model = IVLPCLIP(pl, clip_model)
    t_in, t_out, h1 = record_blocks(clip_model.transformer.resblocks)
    v_in, v_out, h2 = record_blocks(clip_model.visual.transformer.resblocks)
    with torch.no_grad():
        logits = model(torch.randn(2, 3, 32, 32))
        block0_vision = clip_model.visual.ln_pre(pl.vpt)
    for h in h1 + h2:
        h.remove()
    assert logits.shape == (2, len(CLASSES))
    n, m = N_TEXT, N_VISION
    # text: block 0 = [SOS][ctx (+ pos)]["of a" class . EOS]; blocks 1..DEPTH_TEXT-1 deep prompts
    pos = clip_model.positional_embedding
    seq = t_in[0].shape[1]
    assert torch.allclose(t_in[0][:, 1 : 1 + n], pl.ctx.detach() + pos[1 : 1 + n], atol=1e-6)
    assert torch.allclose(t_in[0][:, 1 + n :], emb[:, 1 + n : seq] + pos[1 + n : seq], atol=1e-6)
    for i in range(1, DEPTH_TEXT):
        deep = pl.deep_text[i - 1].detach().expand(len(CLASSES), -1, -1)
        assert torch.equal(t_in[i][:, 1 : 1 + n], deep)
        assert torch.equal(t_in[i][:, :1], t_out[i - 1][:, :1])
        assert torch.equal(t_in[i][:, 1 + n :], t_out[i - 1][:, 1 + n :])
    for i in range(DEPTH_TEXT, 4):
        assert torch.equal(t_in[i], t_out[i - 1])
    # vision: [CLS][16 patches][vpt]; blocks 1..DEPTH_VISION-1 replace the last m tokens
    assert v_in[0].shape == (2, 1 + 16 + m, 64)
    assert torch.allclose(v_in[0][:, -m:], block0_vision.expand(2, -1, -1), atol=1e-5)
    for i in range(1, DEPTH_VISION):
        assert torch.equal(v_in[i][:, -m:], pl.deep_vision[i - 1].detach().expand(2, -1, -1))
        assert torch.equal(v_in[i][:, :-m], v_out[i - 1][:, :-m])
    for i in range(DEPTH_VISION, 4):
        assert torch.equal(v_in[i], v_out[i - 1])  # propagated, not replaced


def test_independent_prompts_settings(clip_model):
    no_vision = IndependentPromptLearner(CLASSES, clip_model, 2, 2, "", 1, 0)
    assert set(no_vision.state_dict()) == {"ctx"} and no_vision.prompt_prefix == "X X"
    model = IVLPCLIP(no_vision, clip_model)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():  # no vision prompts: the frozen image tower
        assert torch.equal(model.image_features(images, no_vision()), clip_model.visual(images))
    with pytest.raises(ValueError, match="N_CTX_TEXT 5 is larger than the 4 words"):
        IndependentPromptLearner(CLASSES, clip_model, 5, 2, "a photo of a", 1, 1)
    with pytest.raises(ValueError, match="PROMPT_DEPTH_VISION must be between 0 and the 4"):
        IndependentPromptLearner(CLASSES, clip_model, 2, 2, "a photo of a", 1, 5)
    with pytest.raises(ValueError, match="PROMPT_DEPTH_TEXT must be between 1 and the 4"):
        IndependentPromptLearner(CLASSES, clip_model, 2, 2, "a photo of a", 0, 1)


# ----------------------------------------------------------------------------------------------
# PromptSRC: frozen features, losses, GPA
# ----------------------------------------------------------------------------------------------
def test_promptsrc_frozen_features_and_losses(tmp_path, dtd_root, deep_opts, clip_model):
    tr = build("PromptSRC", tmp_path, dtd_root, deep_opts, "TRAINER.PROMPTSRC.TEXT_LOSS_WEIGHT",
               "3.0", "TRAINER.PROMPTSRC.IMAGE_LOSS_WEIGHT", "2.0")  # fmt: skip
    names = [c.replace("_", " ") for c in tr.classnames]
    assert len(IMAGENET_TEMPLATES) == 60 and IMAGENET_TEMPLATES[0] == "a photo of a {}."
    # g0: mean of the UNnormalised features of the 60 templates, then normalised
    enc = TextEncoder(clip_model)
    with torch.no_grad():
        feats = []
        for t in IMAGENET_TEMPLATES:
            tokens = tokenize([t.format(n) for n in names])
            feats.append(enc(clip_model.token_embedding(tokens), tokens.argmax(-1)))
        g0 = normalize(torch.stack(feats).mean(0))
    torch.testing.assert_close(tr.model.zs_text_features, g0, atol=1e-5, rtol=1e-5)
    # one step's terms against the formulas of the docstring
    with torch.no_grad():
        for p in tr.model.learnable.parameters():
            p.add_(0.5 * torch.randn_like(p))
    image, label = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    f0, z0 = tr.model.zero_shot(image)
    with torch.no_grad():
        want_f0 = normalize(clip_model.visual(image))
    torch.testing.assert_close(f0, want_f0, atol=1e-5, rtol=1e-5)
    loss, terms = tr.compute_loss(tr.prepare_step((image, label)))
    with torch.no_grad():
        prompts = tr.model.prompt_learner()
        f, g = tr.model.encode_image(image, prompts), tr.model.encode_text(prompts)
        s = tr.model.logit_scale.exp()
        z, z0 = s * f @ g.t(), s * want_f0 @ g0.t()
        p, p0 = z.softmax(1), z0.softmax(1)
        kl = (p0 * (p0.log() - p.log())).sum() / z.numel()
        text = 3.0 * (g - g0).abs().mean()
        img = 2.0 * (f - want_f0).abs().mean()
        want = F.cross_entropy(z, label) + text + img + kl
    torch.testing.assert_close(terms["scl_text"], text, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(terms["scl_image"], img, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(terms["scl_logits"], kl, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(loss.detach(), want, atol=1e-5, rtol=1e-4)
    assert kl > 0 and text > 0 and img > 0
    # the frozen model regulates nothing: every term vanishes when f = f0, g = g0
    zero = promptsrc_losses(z0, z0, g0, g0, want_f0, want_f0, 3.0, 2.0)
    assert all(abs(float(v)) < 1e-6 for v in zero.values())


def test_promptsrc_frozen_work_runs_once_per_two_pass_step(tmp_path, dtd_root, deep_opts):
    tr = build("PromptSRC", tmp_path, dtd_root, deep_opts, optim="sample")
    calls = []
    zero_shot = tr.model.zero_shot
    tr.model.zero_shot = lambda image: calls.append(1) or zero_shot(image)
    tr.before_train()
    tr.before_epoch()
    tr.batch_idx = 0
    out = tr.forward_backward(next(iter(tr.train_loader_x)))
    tr.close_writer()
    assert "grad_norm" in out and len(calls) == 1  # two passes, one frozen forward


def test_gpa_weights_are_a_normalised_gaussian():
    w = gpa_weights(20, 15, 1)
    gauss = [math.exp(-0.5 * (e - 15) ** 2) / math.sqrt(2 * math.pi) for e in range(1, 21)]
    want = [g / sum(gauss) for g in gauss]
    assert math.isclose(sum(w), 1.0, rel_tol=1e-12) and max(w) == w[14]
    assert all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-300) for a, b in zip(w, want))
    far = gpa_weights(5, 15, 1)  # every Gaussian density underflows next to 0: still defined
    assert math.isclose(sum(far), 1.0) and far[-1] > 0.99
    with pytest.raises(ValueError, match="GPA_STD must be > 0"):
        gpa_weights(5, 1, 0)


def test_gpa_saves_and_evaluates_the_weighted_average_of_epochs(tmp_path, dtd_root, deep_opts):
    tr = build("PromptSRC", tmp_path, dtd_root, deep_opts, "OPTIM.MAX_EPOCH", "3")
    snaps = []
    accumulate = tr.accumulate_gpa

    def record(epoch):
        snaps.append({k: v.detach().clone() for k, v in tr.model.learnable.state_dict().items()})
        accumulate(epoch)

    tr.accumulate_gpa = record
    tr.train()
    w = gpa_weights(3, 2, 1.5)
    assert len(snaps) == 3 and math.isclose(sum(w), 1.0)
    final = tr.model.learnable.state_dict()
    saved = torch.load(
        osp.join(tr.output_dir, "VLPromptLearner", "model.pth.tar-3"), weights_only=True
    )["state_dict"]
    assert set(saved) == IVLP_STATE
    for k in IVLP_STATE:
        want = sum(wi * s[k] for wi, s in zip(w, snaps))
        torch.testing.assert_close(final[k], want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(saved[k], want, atol=1e-6, rtol=1e-6)
        assert not torch.equal(snaps[0][k], snaps[2][k])  # the epochs differ


@pytest.mark.slow
def test_gpa_resumes_with_the_aggregate_of_earlier_epochs(tmp_path, dtd_root, deep_opts):
    opts = ("OPTIM.MAX_EPOCH", "3", "TRAIN.CHECKPOINT_FREQ", "1")
    full = build("PromptSRC", tmp_path / "a", dtd_root, deep_opts, *opts)
    full.train()
    part = build("PromptSRC", tmp_path / "b", dtd_root, deep_opts, *opts)
    train_interrupted(part, epoch=2)  # the run stops when epoch 3 starts (epochs 1-2 saved)
    assert osp.exists(osp.join(part.output_dir, "VLPromptLearner", "gpa_state.pth"))
    resumed = build("PromptSRC", tmp_path / "b", dtd_root, deep_opts, *opts)
    resumed.train()
    assert resumed.start_epoch == 2
    a, b = full.model.learnable.state_dict(), resumed.model.learnable.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# Every new trainer: optimizers, precisions, checkpoints, configs
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optim", ["", "sample"])
@pytest.mark.parametrize(
    "prec", ["fp32", *(pytest.param(p, marks=pytest.mark.slow) for p in ("fp16", "amp", "bf16"))]
)
@pytest.mark.parametrize("trainer", NEW_TRAINERS)
def test_one_step_trains_every_prompt(trainer, prec, optim, tmp_path, dtd_root_shared, deep_opts):
    tr = build(trainer, tmp_path, dtd_root_shared, deep_opts, prec=prec, optim=optim)
    learnable = tr.model.learnable if trainer != "KgCoOp" else tr.model.prompt_learner
    assert set(learnable.state_dict()) == STATE[trainer]
    trainable = {n for n, p in tr.model.named_parameters() if p.requires_grad}
    assert trainable == {f"prompt_learner.{n}" for n in STATE[trainer]}
    tr.before_train()
    tr.before_epoch()
    params = [p for p in learnable.parameters()]
    before = [p.detach().clone() for p in params]
    batch = next(iter(tr.train_loader_x))
    for i in range(6 if prec == "amp" else 1):  # amp: the GradScaler may skip the first steps
        tr.batch_idx = i
        out = tr.forward_backward(batch)
        assert torch.isfinite(out["loss"])
        if not torch.equal(before[0], params[0]):
            break
    tr.close_writer()
    for b, p in zip(before, params, strict=True):
        assert p.dtype == torch.float32 and torch.isfinite(p).all() and not torch.equal(b, p)
    if optim:
        assert "grad_norm" in out  # the two-pass step ran
    tr.save_model(0, str(tmp_path / "ckpt"))
    path = osp.join(tmp_path, "ckpt", CHECKPOINT_FOLDER[trainer], "model.pth.tar-1")
    assert set(torch.load(path, weights_only=True)["state_dict"]) == STATE[trainer]


def _learnable(tr) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tr.model.prompt_learner.state_dict().items()}


def _start(tr):
    tr.before_train()
    tr.before_epoch()
    tr.batch_idx = 0
    return tr


@pytest.mark.slow
@pytest.mark.parametrize("trainer", NEW_TRAINERS)
def test_steps_equal_the_reference_style(trainer, tmp_path, dtd_root_shared, deep_opts):
    """Truncated prompts and frozen work once per step give the steps of the reference code
    bases (77-token prompts, frozen work in both passes of SAMPLe), bit for bit."""
    cfg = config(trainer, tmp_path, dtd_root_shared, deep_opts, optim="sample")
    ours = _start(build_trainer(cfg))
    full_length = ("MODEL.TEXT_FULL_LENGTH", "True")  # the reference code bases' 77 tokens
    full = config(trainer, tmp_path, dtd_root_shared, deep_opts, *full_length, optim="sample")
    ref = _start(reference_style(TRAINER_REGISTRY.get(trainer))(full))
    assert (
        ref.model.prompt_learner.token_suffix.shape[1]
        > ours.model.prompt_learner.token_suffix.shape[1]
    )
    batch = next(iter(ours.train_loader_x))
    for _ in range(2):  # the second step also uses SAMPLe's moving average
        out_a, out_b = ours.forward_backward(batch), ref.forward_backward(batch)
        assert "grad_norm" in out_a and torch.equal(out_a["loss"], out_b["loss"])
        a, b = _learnable(ours), _learnable(ref)
        assert all(torch.equal(a[k], b[k]) for k in a)
    images, _ = ours.parse_batch_test(next(iter(ours.test_loader)))
    logits = []
    with torch.no_grad():
        for tr in (ours, ref):
            tr.set_model_mode("eval")
            tr.before_test()
            logits.append(tr.model_inference(images))
            tr.close_writer()
    assert torch.equal(*logits)


def test_configs_hold_the_published_values():
    k = make_cfg([], trainer="KgCoOp", config_file=CONFIGS["KgCoOp"])
    o, n = k.OPTIM, k.TRAINER.KGCOOP
    assert (k.DATALOADER.TRAIN_X.BATCH_SIZE, o.NAME, o.LR, o.MAX_EPOCH) == (128, "sgd", 0.002, 100)
    assert (n.N_CTX, n.CTX_INIT, n.W, n.CSC, n.PREC) == (4, "a photo of a", 8.0, False, "fp16")
    for trainer, epochs in (("IVLP", 20), ("PromptSRC", 20)):
        c = make_cfg([], trainer=trainer, config_file=CONFIGS[trainer])
        o, n = c.OPTIM, c.TRAINER[trainer.upper()]
        assert (c.DATALOADER.TRAIN_X.BATCH_SIZE, o.NAME, o.LR, o.MAX_EPOCH) == (
            4,
            "sgd",
            0.0025,
            epochs,
        )
        assert (n.N_CTX_TEXT, n.N_CTX_VISION, n.PROMPT_DEPTH_TEXT, n.PROMPT_DEPTH_VISION) == (
            4,
            4,
            9,
            9,
        )
        assert (n.CTX_INIT, n.PREC) == ("a photo of a", "fp16")
    n = make_cfg([], trainer="PromptSRC", config_file=CONFIGS["PromptSRC"]).TRAINER.PROMPTSRC
    assert (n.TEXT_LOSS_WEIGHT, n.IMAGE_LOSS_WEIGHT, n.GPA_MEAN, n.GPA_STD) == (25, 10, 15, 1)
    xd = "configs/trainers/PromptSRC/vit_b16_c2_ep5_batch4_4x4ctx_cross_datasets.yaml"
    c = make_cfg([], trainer="PromptSRC", config_file=xd)
    n = c.TRAINER.PROMPTSRC
    # the epochs xd_test.sh loads (PromptSRC's scripts/promptsrc/xd_test.sh: --load-epoch 20)
    assert (c.OPTIM.MAX_EPOCH, n.PROMPT_DEPTH_TEXT, n.GPA_MEAN, n.GPA_STD) == (20, 3, 6, 10)
    # the sharpness-aware defaults (MaPLe's values for IVLP/PromptSRC, CoOp's for KgCoOp)
    for trainer, rho in (("KgCoOp", 0.05), ("IVLP", 0.1), ("PromptSRC", 0.1)):
        sam = make_cfg(
            ["--optim-config-file", osp.join(ROOT, f"configs/optim/{trainer}/sample.yaml")],
            trainer=trainer,
        ).OPTIM.SAM
        assert (sam.NAME, sam.RHO, sam.LAMBDA, sam.START_EPOCH, tuple(sam.FREEZE)) == (
            "sample",
            rho,
            0.15,
            0,
            (),
        )


def test_bad_settings_name_the_key(tmp_path, dtd_root_shared, deep_opts):
    cases = [
        ("KgCoOp", "TRAINER.KGCOOP.W", "-1.0", "TRAINER.KGCOOP.W"),
        ("IVLP", "TRAINER.IVLP.PROMPT_DEPTH_TEXT", "0", "TRAINER.IVLP.PROMPT_DEPTH_TEXT"),
        ("PromptSRC", "TRAINER.PROMPTSRC.GPA_STD", "0.0", "TRAINER.PROMPTSRC.GPA_STD"),
    ]
    for trainer, key, value, message in cases:
        with pytest.raises(ValueError, match=message):
            build(trainer, tmp_path, dtd_root_shared, deep_opts, key, value)


# ----------------------------------------------------------------------------------------------
# train.py: base classes with SGD (fp32) and SAMPLe (amp), then the new classes
# ----------------------------------------------------------------------------------------------
def train_py_args(trainer, root, out, deep_opts, prec, *extra):
    return [
        "--root", root, "--seed", "1", "--trainer", trainer,
        "--dataset-config-file", osp.join(ROOT, "configs/datasets/dtd.yaml"),
        "--config-file", osp.join(ROOT, CONFIGS[trainer]), "--output-dir", out, *deep_opts,
        *trainer_opts(trainer, prec), "DATASET.NUM_SHOTS", "2", "OPTIM.MAX_EPOCH", "2", *extra,
    ]  # fmt: skip


def accuracy(log: str) -> float:
    return float(re.findall(r"\* accuracy: ([\d.]+)%", log)[-1])


@pytest.mark.slow
@pytest.mark.parametrize("trainer", NEW_TRAINERS)
def test_train_py_base_to_new(trainer, tmp_path, dtd_root, deep_opts):
    folder = CHECKPOINT_FOLDER[trainer]
    base = ("DATASET.SUBSAMPLE_CLASSES", "base")
    sgd_out, sam_out, new_out = (str(tmp_path / d) for d in ("sgd", "sample", "new"))
    train_in_process(train_py_args(trainer, dtd_root, sgd_out, deep_opts, "fp32", *base))
    log = open(osp.join(sgd_out, "log.txt")).read()
    assert "Optimizer: sgd over" in log and 0 <= accuracy(log) <= 100
    assert re.search(r"# classes\s+4\n", log)  # DTD's 7 classes: 4 base
    optim_file = osp.join(ROOT, f"configs/optim/{trainer}/sample.yaml")
    sam_args = train_py_args(trainer, dtd_root, sam_out, deep_opts, "amp", *base)
    train_in_process(["--optim-config-file", optim_file, *sam_args])
    log = open(osp.join(sam_out, "log.txt")).read()
    assert "Optimizer: sample(sgd)" in log and "cos_g_gp" in log
    if trainer == "PromptSRC":
        assert "Using the Gaussian-aggregated prompts (GPA)" in log and "scl_logits" in log
    if trainer == "KgCoOp":
        assert re.search(r"\bkg [\d.]+", log)
    ckpt = torch.load(osp.join(sam_out, folder, "model.pth.tar-2"), weights_only=True)
    assert set(ckpt["state_dict"]) == STATE[trainer]
    eval_flags = ["--eval-only", "--model-dir", sam_out, "--load-epoch", "2"]
    new = ("DATASET.SUBSAMPLE_CLASSES", "new")
    train_in_process(eval_flags + train_py_args(trainer, dtd_root, new_out, deep_opts, "amp", *new))
    log = open(osp.join(new_out, "log.txt")).read()
    assert f'Loading weights to {folder} from "' in log
    assert re.search(r"# classes\s+3\n", log) and 0 <= accuracy(log) <= 100  # 3 new classes
