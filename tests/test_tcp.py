"""TCP on a tiny CLIP with 10 text blocks: class-aware tokens, KgCoOp loss, training."""

from __future__ import annotations

import copy
import logging
import os.path as osp

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, make_cfg
from helpers import train_in_process

from engine import build_trainer
from engine.clip import encode_texts, tokenize
from engine.clip.toy import TINY_CLIP_CONFIG, TINY_OPTS, write_tiny_clip
from trainers.tcp import learnable_prompt, tcp_templates

CONFIG = "configs/trainers/TCP/vit_b16_ep100_ctxv1.yaml"
LEARNABLE = [
    "prompt_learner.ctx",
    "prompt_learner.meta_net.linear1.weight",
    "prompt_learner.meta_net.linear1.bias",
    "prompt_learner.meta_net.linear2.weight",
    "prompt_learner.meta_net.linear2.bias",
]


@pytest.fixture(scope="module")
def deep_clip_opts(tmp_path_factory):
    """Options for a tiny CLIP whose text tower has 10 blocks (TCP injects before block 8)."""
    config = copy.deepcopy(TINY_CLIP_CONFIG)
    config["text_cfg"]["layers"] = 10
    cfg_path, ckpt = write_tiny_clip(str(tmp_path_factory.mktemp("deep_clip")), config=config)
    backbone = ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", cfg_path]
    return [*backbone, "MODEL.BACKBONE.PATH", ckpt, *TINY_OPTS]


def _opts(out, dtd_root, clip_opts, *extra):
    return [
        "--root",
        dtd_root,
        "--seed",
        "1",
        "--output-dir",
        str(out),
        *clip_opts,
        "TRAINER.TCP.PREC",
        "fp32",
        "OPTIM.MAX_EPOCH",
        "1",
        "OPTIM.WARMUP_EPOCH",
        "0",
        "DATASET.NUM_SHOTS",
        "2",
        *extra,
    ]


def _trainer(tmp_path, dtd_root, clip_opts, *extra):
    cfg = make_cfg(
        _opts(tmp_path / "out", dtd_root, clip_opts, *extra), trainer="TCP", config_file=CONFIG
    )
    return build_trainer(cfg)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, dtd_root_shared, deep_clip_opts):
    tmp = tmp_path_factory.mktemp("tcp")
    tr = _trainer(tmp, dtd_root_shared, deep_clip_opts, "TRAINER.TCP.KG_WEIGHT", "3.0")
    with torch.no_grad():  # a non-trivial meta-net output
        for p in tr.model.prompt_learner.meta_net.parameters():
            p.normal_(std=0.5)
    return tr


def test_logits_shape_trainable_parameters_and_checkpoint(trainer):
    n_cls = trainer.num_classes
    with torch.no_grad():
        logits = trainer.model(torch.randn(3, 3, 32, 32, device=trainer.device))
    assert logits.shape == (3, n_cls)
    assert [n for n, p in trainer.model.named_parameters() if p.requires_grad] == LEARNABLE
    pl = trainer.model.prompt_learner
    assert list(pl.state_dict()) == [n.removeprefix("prompt_learner.") for n in LEARNABLE]
    assert pl.ctx.shape == (4, 32) and pl.ctx.dtype == torch.float32
    assert pl.meta_net.linear1.weight.shape == (8, 32)  # dim -> dim // 4
    assert pl.meta_net.linear2.weight.shape == (4 * 32, 8)  # -> n_ctx * width
    assert pl.class_tokens().shape == (n_cls, 4, 32)


def test_class_aware_tokens_replace_positions_in_block_8(trainer):
    model = trainer.model
    pl = model.prompt_learner
    blocks = model.text_encoder.transformer.resblocks
    seen = {}
    handles = [
        blocks[i].register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args[0]))
        for i in (0, 8)
    ]
    handles += [blocks[7].register_forward_hook(lambda m, a, out: seen.__setitem__("7out", out))]
    try:
        with torch.no_grad():
            model.encode_text()
            tokens = pl.class_tokens()
    finally:
        for h in handles:
            h.remove()
    n = pl.n_ctx
    assert torch.equal(seen[8][:, 1 : 1 + n], tokens)  # each class its own meta-net output
    assert not torch.equal(tokens[0], tokens[1])
    assert torch.equal(seen[8][:, :1], seen["7out"][:, :1])  # other positions flow through
    assert torch.equal(seen[8][:, 1 + n :], seen["7out"][:, 1 + n :])
    assert not torch.equal(seen["7out"][:, 1 : 1 + n], tokens)
    pos = model.text_encoder.positional_embedding[: seen[0].shape[1]]
    ctx = pl.ctx.unsqueeze(0).expand(pl.n_cls, -1, -1)
    assert torch.equal(seen[0][:, 1 : 1 + n], ctx + pos[1 : 1 + n])  # block 0: the context


def test_templates_and_truncated_prompts_equal_full_length(trainer):
    model = trainer.model
    pl = model.prompt_learner
    names = [c.replace("_", " ") for c in trainer.dm.dataset.classnames]
    assert pl.prompts_text == [f"X X X X {c} texture." for c in names]  # DTD's learnable template
    handcrafted = [f"a photo of a {c}, a type of texture." for c in names]
    want = encode_texts(model.text_encoder, handcrafted)
    assert torch.equal(pl.t_clip, want)  # hand-crafted ("ori") template, normalised
    tokens = tokenize(pl.prompts_text).to(trainer.device)  # [n_cls, 77]
    emb = model.text_encoder.token_embedding(tokens)
    ctx = pl.ctx.unsqueeze(0).expand(pl.n_cls, -1, -1)
    full_prompts = torch.cat([emb[:, :1], ctx, emb[:, 1 + pl.n_ctx :]], dim=1)
    class_tokens = pl.class_tokens()

    def inject(i, x):
        if i != 8:
            return x
        return torch.cat([x[:, :1], class_tokens, x[:, 1 + pl.n_ctx :]], dim=1)

    with torch.no_grad():
        full = model.text_encoder(full_prompts, tokens.argmax(-1), layer_hook=inject)
        short = model.encode_text()
    assert pl().shape[1] < 77
    assert torch.equal(short, full / full.norm(dim=-1, keepdim=True))


def test_learnable_template_table():
    assert learnable_prompt("X X X X {}, a type of pet.", 4) == "X X X X {}, a type of pet."
    assert learnable_prompt("a photo of a person doing {}.", 4) == "X X X X person doing {}."
    assert learnable_prompt("a photo of a {}.", 2) == "X X {}."
    assert tcp_templates("FGVCAircraft") == (
        "X X X X {}, a type of aircraft.",
        "a photo of an aircraft {}.",
    )
    assert tcp_templates("StanfordCars") == ("X X X X {}, a type of car", "a photo of a {}.")


def test_unknown_dataset_falls_back_with_a_notice(caplog):
    with caplog.at_level(logging.WARNING):
        assert tcp_templates("MyData") == ("X X X X {}.", "a photo of a {}.")
    assert "TCP has no templates for dataset 'MyData'" in caplog.text


def test_loss_is_cross_entropy_plus_weighted_kg_term(trainer):
    model = trainer.model
    batch = next(iter(trainer.train_loader_x))
    image, label = trainer.parse_batch_train(batch)
    with torch.no_grad():
        inputs = trainer.prepare_step((image, label))
        loss, summary = trainer.compute_loss(inputs)
        text = model.encode_text()
        t_clip = model.prompt_learner.t_clip
        logits = model.logit_scale.exp() * inputs[0] @ text.t()
        ce = F.cross_entropy(logits, label)
        cos = (text * t_clip).sum(-1) / (text.norm(dim=-1) * t_clip.norm(dim=-1))
        kg = 1 - cos.mean()
    assert kg > 1e-3 and trainer.cfg.TRAINER.TCP.KG_WEIGHT == 3.0
    torch.testing.assert_close(loss, ce + 3.0 * kg)
    torch.testing.assert_close(summary["kg"], kg)
    torch.testing.assert_close(summary["ce"], ce)


def test_too_shallow_text_tower_names_the_layer_key(tmp_path, dtd_root, tiny_clip_opts):
    with pytest.raises(
        ValueError,
        match=r"TRAINER.TCP.INJECT_LAYER is 8, but the CLIP text tower "
        r"has 2 blocks: set TRAINER.TCP.INJECT_LAYER to a block index in 0..1",
    ):
        _trainer(tmp_path, dtd_root, tiny_clip_opts)
    tr = _trainer(tmp_path, dtd_root, tiny_clip_opts, "TRAINER.TCP.INJECT_LAYER", "1")
    assert tr.model.inject_layer == 1


PRECISIONS = ("fp32", "fp16", "amp", "bf16")


# every precision with SGD and SGD + SAMPLe; Adam (TCP's optimizer) with each wrapper once
def test_configs_have_tcp_values():
    cfg = make_cfg([], trainer="TCP", config_file=CONFIG)
    c, o = cfg.TRAINER.TCP, cfg.OPTIM
    assert (c.N_CTX, c.PREC, c.KG_WEIGHT, c.INJECT_LAYER, c.W) == (4, "fp16", 8.0, 8, None)
    assert (o.NAME, o.LR, o.WEIGHT_DECAY, o.ADAM_EPS, o.MAX_EPOCH) == (
        "adam",
        0.002,
        5e-4,
        1e-3,
        50,
    )
    assert (o.LR_SCHEDULER, o.WARMUP_EPOCH, o.WARMUP_TYPE) == ("cosine", 1, "constant")
    assert cfg.DATALOADER.TRAIN_X.BATCH_SIZE == 32 and cfg.DATALOADER.TEST.BATCH_SIZE == 500
    ep25 = "configs/trainers/TCP/vit_b16_ep25_ctxv1.yaml"
    assert make_cfg([], trainer="TCP", config_file=ep25).OPTIM.MAX_EPOCH == 25
    ep50 = make_cfg(["--seed", "1", "OPTIM.MAX_EPOCH", "50"], trainer="TCP", config_file=ep25)
    assert ep50 == make_cfg(["--seed", "1"], trainer="TCP", config_file=CONFIG)


def test_the_old_weight_name_is_refused_with_a_pointer(tmp_path, dtd_root_shared, deep_clip_opts):
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="TRAINER.TCP.W 8.0: the KgCoOp loss weight is now "
                       "TRAINER.TCP.KG_WEIGHT"):  # fmt: skip
        _trainer(tmp_path, dtd_root_shared, deep_clip_opts, "TRAINER.TCP.W", "8.0")
    with pytest.raises(ConfigError, match="KG_WEIGHT .* must be >= 0"):
        _trainer(tmp_path, dtd_root_shared, deep_clip_opts, "TRAINER.TCP.KG_WEIGHT", "-1.0")
    # TCP's script's TRAINER.COOP.W 1.0 (unused by TCP's code) leaves the loss weight alone
    cfg = make_cfg(["TRAINER.COOP.W", "1.0"], trainer="TCP", config_file=CONFIG)
    assert cfg.TRAINER.TCP.KG_WEIGHT == 8.0 and "W" not in cfg.TRAINER.COOP


def _train_args(root, out, clip_opts, *extra, flags=()):
    return [
        "--trainer",
        "TCP",
        "--dataset-config-file",
        osp.join(ROOT, "configs/datasets/dtd.yaml"),
        "--config-file",
        osp.join(ROOT, CONFIG),
        *flags,
        *_opts(out, root, clip_opts, *extra),
    ]


@pytest.mark.slow
def test_train_py_sgd_and_sample_then_new_classes(tmp_path, dtd_root, deep_clip_opts):
    ckpts = {}
    sample = osp.join(ROOT, "configs/optim/TCP/sample.yaml")
    for name, extra, flags in (
        ("sgd", ("OPTIM.NAME", "sgd"), ()),
        ("sample", (), ("--optim-config-file", sample)),  # Adam + SAMPLe, the paper's values
    ):
        out = str(tmp_path / name)
        args = _train_args(
            dtd_root, out, deep_clip_opts, *extra, "DATASET.SUBSAMPLE_CLASSES", "base", flags=flags
        )
        train_in_process(args)
        log = open(osp.join(out, "log.txt")).read()
        assert "Finish training" in log and "* accuracy" in log and " kg " in log
        path = osp.join(out, "prompt_learner", "model.pth.tar-1")
        ckpts[name] = torch.load(path, weights_only=True)["state_dict"]
    assert list(ckpts["sample"]) == [n.removeprefix("prompt_learner.") for n in LEARNABLE]
    new = str(tmp_path / "new")
    flags = ["--eval-only", "--model-dir", str(tmp_path / "sample"), "--load-epoch", "1"]
    train_in_process(
        _train_args(dtd_root, new, deep_clip_opts, "DATASET.SUBSAMPLE_CLASSES", "new", flags=flags)
    )
    log = open(osp.join(new, "log.txt")).read()
    assert "# classes  3" in log and "=> result" in log and "* accuracy" in log
    assert "Loading weights to prompt_learner" in log
