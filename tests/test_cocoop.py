"""CoCoOp on the tiny CLIP: batched (image x class) text encoding, chunking, training."""

from __future__ import annotations

import os.path as osp

import pytest
import torch
from conftest import ROOT, make_cfg
from helpers import train_in_process

from engine import build_trainer
from engine.clip import load_clip, tokenize
from trainers.cocoop import CoCoOpCLIP

CLASSES = ["red circle", "blue_square", "a very long class name with words", "dot", "star"]
CONFIG = "configs/trainers/CoCoOp/vit_b16_c4_ep10_batch1_ctxv1.yaml"
LEARNABLE = [
    "prompt_learner.ctx",
    "prompt_learner.meta_net.linear1.weight",
    "prompt_learner.meta_net.linear1.bias",
    "prompt_learner.meta_net.linear2.weight",
    "prompt_learner.meta_net.linear2.bias",
]


@pytest.fixture(scope="module")
def clip_model(tiny_clip):
    cfg_path, ckpt = tiny_clip
    cfg = make_cfg(
        ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", cfg_path, "MODEL.BACKBONE.PATH", ckpt]
    )
    return load_clip(cfg)


@pytest.fixture(scope="module")
def model(clip_model):
    torch.manual_seed(0)
    m = CoCoOpCLIP(CLASSES, clip_model, ctx_init="a photo of a")
    with torch.no_grad():  # a non-trivial meta-net output
        for p in m.prompt_learner.meta_net.parameters():
            p.normal_(std=0.5)
    return m


@pytest.fixture(scope="module")
def image_features(model):
    torch.manual_seed(1)
    with torch.no_grad():
        return model.encode_image(torch.randn(6, 3, 32, 32))  # [6, embed]


def _per_image_loop(model, image_features, full_length=False):
    """CoCoOp's algorithm: for each image, its shifted context for all classes, one text
    encoder call, normalise, ``logit_scale * imf_i @ text_i^T``."""
    pl, enc = model.prompt_learner, model.text_encoder
    if full_length:  # the 77-token prompts of CoCoOp's code base
        names = [c.replace("_", " ") for c in CLASSES]
        tokens = tokenize([f"{pl.prompt_prefix} {n}." for n in names])
        emb = model.text_encoder.token_embedding(tokens)
        prefix, suffix, eot = emb[:, :1], emb[:, 1 + pl.n_ctx :], tokens.argmax(-1)
    else:
        prefix, suffix, eot = pl.token_prefix, pl.token_suffix, pl.eot_idx
    bias = pl.meta_net(image_features)  # [batch, width]
    ctx_shifted = pl.ctx.unsqueeze(0) + bias.unsqueeze(1)  # [batch, n_ctx, width]
    texts, logits = [], []
    for ctx_i, imf_i in zip(ctx_shifted, image_features, strict=True):
        ctx_i = ctx_i.unsqueeze(0).expand(pl.n_cls, -1, -1)
        text = enc(torch.cat([prefix, ctx_i, suffix], dim=1), eot)
        text = text / text.norm(dim=-1, keepdim=True)
        texts.append(text)
        logits.append(model.logit_scale.exp() * imf_i @ text.t())
    return torch.stack(texts), torch.stack(logits)


def test_logits_shape_and_meta_net_shapes(model, image_features):
    with torch.no_grad():
        logits = model(torch.randn(3, 3, 32, 32))
    assert logits.shape == (3, len(CLASSES))
    pl = model.prompt_learner
    assert pl.ctx.shape == (4, 32) and pl.ctx.dtype == torch.float32
    assert pl.meta_net.linear1.weight.shape == (32 // 16, 32)  # vis_dim -> vis_dim // 16
    assert pl.meta_net.linear2.weight.shape == (32, 32 // 16)  # -> ctx_dim
    assert list(pl.state_dict()) == [n.removeprefix("prompt_learner.") for n in LEARNABLE]


def test_batched_encoding_equals_per_image_loop(model, image_features):
    with torch.no_grad():
        text = model.encode_text(image_features)
        logits = model.logits(image_features, text)
        ref_text, ref_logits = _per_image_loop(model, image_features)
    assert text.shape == (6, len(CLASSES), 32)
    torch.testing.assert_close(text, ref_text, rtol=0, atol=1e-6)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-6, atol=1e-5)
    # the meta-net sees the normalised image feature: a scaled input changes the prompts
    with torch.no_grad():
        scaled = model.encode_text(image_features * 3)
    assert (scaled - text).abs().max() > 1e-3


def test_truncated_prompts_equal_full_length(model, image_features):
    pl = model.prompt_learner
    assert pl.token_prefix.shape[1] + pl.n_ctx + pl.token_suffix.shape[1] < 77
    with torch.no_grad():
        short, _ = _per_image_loop(model, image_features)
        full, _ = _per_image_loop(model, image_features, full_length=True)
    assert torch.equal(short, full)


@pytest.mark.parametrize("chunk", [1, 7, len(CLASSES), 2 * len(CLASSES) + 3, 1000])
def test_chunking_gives_the_same_features_and_gradients(model, image_features, chunk):
    def run(text_chunk):
        model.text_chunk = text_chunk
        model.zero_grad(set_to_none=True)
        text = model.encode_text(image_features)
        (text * torch.linspace(-1, 1, text.numel()).view_as(text)).sum().backward()
        grads = [p.grad.clone() for p in model.prompt_learner.parameters()]
        return text.detach(), grads

    try:
        ref_text, ref_grads = run(0)
        text, grads = run(chunk)
    finally:
        model.text_chunk = 0
        model.zero_grad(set_to_none=True)
    torch.testing.assert_close(text, ref_text, rtol=0, atol=1e-6)
    for g, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-5)


def test_automatic_chunk_is_whole_images_within_the_bound(model, clip_model, monkeypatch):
    import trainers.cocoop as cocoop

    n_cls, seq_len = len(CLASSES), 16
    assert model.chunk_size() % n_cls == 0
    monkeypatch.setattr(cocoop, "AUTO_CHUNK_ELEMENTS", 13 * seq_len * 32)  # 13 prompts
    assert model.chunk_size() == 10  # two whole images
    monkeypatch.setattr(cocoop, "AUTO_CHUNK_ELEMENTS", 3 * seq_len * 32)  # fewer than n_cls
    assert model.chunk_size() == 3
    with pytest.raises(ValueError, match="PROMPTS_PER_CALL must be >= 0"):
        CoCoOpCLIP(CLASSES, clip_model, text_chunk=-1)


def _trainer(tmp_path, dtd_root, tiny_clip_opts, *extra):
    cfg = make_cfg(
        [
            "--root",
            dtd_root,
            "--seed",
            "1",
            "--output-dir",
            str(tmp_path / "out"),
            *tiny_clip_opts,
            "TRAINER.COCOOP.PREC",
            "fp32",
            "OPTIM.MAX_EPOCH",
            "1",
            "OPTIM.LR",
            "0.01",
            "OPTIM.WARMUP_EPOCH",
            "0",
            "DATASET.NUM_SHOTS",
            "2",
            "DATALOADER.TRAIN_X.BATCH_SIZE",
            "2",
            *extra,
        ],
        trainer="CoCoOp",
        config_file=CONFIG,
    )
    return build_trainer(cfg)


def test_only_prompt_learner_trains_and_frozen_work_runs_once(tmp_path, dtd_root, tiny_clip_opts):
    tr = _trainer(tmp_path, dtd_root, tiny_clip_opts, "OPTIM.SAM.NAME", "sample")
    assert [n for n, p in tr.model.named_parameters() if p.requires_grad] == LEARNABLE
    calls = {"image": 0, "embed": 0}
    encode_image = tr.model.encode_image

    def counted(image):
        calls["image"] += 1
        return encode_image(image)

    def embed(*args):
        calls["embed"] += 1
        raise AssertionError("class token embeddings must be built once, at construction")

    tr.model.encode_image = counted
    tr.model.text_encoder.token_embedding.forward = embed
    tr.train()  # two passes per step (SAMPLe), one test (from frozen features: no encode_image)
    assert calls == {"image": len(tr.train_loader_x), "embed": 0}


def test_config_has_cocoop_values():
    cfg = make_cfg([], trainer="CoCoOp", config_file=CONFIG)
    c, o = cfg.TRAINER.COCOOP, cfg.OPTIM
    assert (c.N_CTX, c.CTX_INIT, c.PREC, c.PROMPTS_PER_CALL) == (4, "a photo of a", "fp16", 0)
    assert (o.NAME, o.LR, o.MAX_EPOCH, o.LR_SCHEDULER) == ("sgd", 0.002, 10, "cosine")
    assert (o.WARMUP_EPOCH, o.WARMUP_TYPE, o.WARMUP_CONS_LR) == (1, "constant", 1e-5)
    assert cfg.DATALOADER.TRAIN_X.BATCH_SIZE == 1 and cfg.DATALOADER.TEST.BATCH_SIZE == 100
    assert cfg.INPUT.INTERPOLATION == "bicubic" and cfg.TRAIN.PRINT_FREQ == 20
    assert list(cfg.INPUT.TRANSFORMS) == ["random_resized_crop", "random_flip", "normalize"]


def _train_args(root, out, tiny_clip_opts, *extra, flags=()):
    return [
        "--root",
        root,
        "--seed",
        "1",
        "--trainer",
        "CoCoOp",
        "--dataset-config-file",
        osp.join(ROOT, "configs/datasets/dtd.yaml"),
        "--config-file",
        osp.join(ROOT, CONFIG),
        "--output-dir",
        out,
        *flags,
        *tiny_clip_opts,
        "TRAINER.COCOOP.PREC",
        "fp32",
        "DATASET.NUM_SHOTS",
        "2",
        "OPTIM.MAX_EPOCH",
        "1",
        *extra,
    ]


@pytest.mark.slow
def test_train_py_sgd_and_sample_then_new_classes(tmp_path, dtd_root, tiny_clip_opts):
    ckpts = {}
    for name, flags in (("sgd", ()), ("sample", ("--optim-config-file",))):
        out = str(tmp_path / name)
        if flags:
            flags = (*flags, osp.join(ROOT, "configs/optim/CoCoOp/sample.yaml"))
        train_in_process(
            _train_args(
                dtd_root, out, tiny_clip_opts, "DATASET.SUBSAMPLE_CLASSES", "base", flags=flags
            )
        )
        log = open(osp.join(out, "log.txt")).read()
        assert "Finish training" in log and "* accuracy" in log
        path = osp.join(out, "prompt_learner", "model.pth.tar-1")
        ckpts[name] = torch.load(path, weights_only=True)["state_dict"]
    assert list(ckpts["sample"]) == [n.removeprefix("prompt_learner.") for n in LEARNABLE]
    assert not torch.equal(ckpts["sgd"]["ctx"], ckpts["sample"]["ctx"])
    new = str(tmp_path / "new")
    flags = ["--eval-only", "--model-dir", str(tmp_path / "sample"), "--load-epoch", "1"]
    train_in_process(
        _train_args(dtd_root, new, tiny_clip_opts, "DATASET.SUBSAMPLE_CLASSES", "new", flags=flags)
    )
    log = open(osp.join(new, "log.txt")).read()
    assert "# classes  3" in log and "=> result" in log and "* accuracy" in log
    assert "Loading weights to prompt_learner" in log


def test_the_former_chunk_key_is_translated_with_a_note():
    """TRAINER.COCOOP.TEXT_CHUNK (0: automatic) was renamed PROMPTS_PER_CALL, so that it does not
    share MODEL.TEXT_CHUNK's name (0: all at once); old configs and options still work."""
    from engine.cli import build_parser, setup_cfg

    notes = []
    args = ["--trainer", "CoCoOp", "TRAINER.COCOOP.TEXT_CHUNK", "6"]
    cfg = setup_cfg(build_parser().parse_args(args), notes)
    assert cfg.TRAINER.COCOOP.PROMPTS_PER_CALL == 6 and "TEXT_CHUNK" not in cfg.TRAINER.COCOOP
    assert cfg.MODEL.TEXT_CHUNK == 0  # the engine's key is untouched
    assert notes == [
        "TRAINER.COCOOP.TEXT_CHUNK 6 (the command line) -> TRAINER.COCOOP.PROMPTS_PER_CALL 6"
    ]
