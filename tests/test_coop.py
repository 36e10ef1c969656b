"""CoOp's prompt learner and trainer on the tiny CLIP."""

from __future__ import annotations

import pytest
import torch
from conftest import make_cfg

from engine import build_trainer
from engine.clip import TextEncoder, load_clip, tokenize
from trainers.coop import PromptLearner

CLASSES = ["red circle", "blue_square", "a very long class name with words"]


@pytest.fixture(scope="module")
def clip_model(tiny_clip):
    cfg_path, ckpt = tiny_clip
    cfg = make_cfg(
        ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", cfg_path, "MODEL.BACKBONE.PATH", ckpt]
    )
    return load_clip(cfg)


def _full_length_features(clip_model, pl):
    """Reference: CoOp's construction on the full 77-token prompts."""
    names = [c.replace("_", " ") for c in CLASSES]
    tokens = tokenize([f"{pl.prompt_prefix} {n}." for n in names])
    emb = clip_model.token_embedding(tokens)
    ctx = pl.ctx if pl.ctx.dim() == 3 else pl.ctx.unsqueeze(0).expand(len(names), -1, -1)
    prompts = torch.cat([emb[:, :1], ctx, emb[:, 1 + pl.n_ctx :]], dim=1)
    return TextEncoder(clip_model)(prompts, tokens.argmax(-1))


def test_truncated_prompts_equal_full_length(clip_model):
    torch.manual_seed(0)
    pl = PromptLearner(CLASSES, clip_model, n_ctx=4)
    enc = TextEncoder(clip_model)
    with torch.no_grad():
        short = enc(pl(), pl.eot_idx)
        full = _full_length_features(clip_model, pl)
    assert pl().shape[1] < 77
    assert (short - full).abs().max().item() == 0.0


def test_ctx_init_and_csc(clip_model):
    pl = PromptLearner(CLASSES, clip_model, ctx_init="a photo of a")
    assert pl.n_ctx == 4 and pl.ctx.shape == (4, 32) and pl.ctx.dtype == torch.float32
    emb = clip_model.token_embedding(tokenize("a photo of a"))[0, 1:5]
    assert torch.equal(pl.ctx.data, emb)
    csc = PromptLearner(CLASSES, clip_model, n_ctx=2, csc=True)
    assert csc.ctx.shape == (3, 2, 32)
    csc_init = PromptLearner(CLASSES, clip_model, ctx_init="a photo of a", csc=True)
    assert csc_init.ctx.shape == (3, 4, 32) and torch.equal(csc_init.ctx[2].data, emb)


@pytest.mark.parametrize("position", ["middle", "front"])
def test_class_token_positions_match_coop(clip_model, position):
    torch.manual_seed(0)
    pl = PromptLearner(CLASSES, clip_model, n_ctx=4, class_token_position=position)
    end = PromptLearner(CLASSES, clip_model, n_ctx=4)
    end.ctx.data.copy_(pl.ctx.data)
    base = end()  # [SOS][ctx][class][. EOS ...]
    got = pl()
    for i, name_len in enumerate(pl.name_lens):
        sos, ctx = base[i, :1], base[i, 1:5]
        cls, rest = base[i, 5 : 5 + name_len], base[i, 5 + name_len :]
        if position == "front":
            want = torch.cat([sos, cls, ctx, rest])
        else:
            want = torch.cat([sos, ctx[:2], cls, ctx[2:], rest])
        assert torch.equal(got[i], want)


def test_checkpoint_state_is_only_the_context(clip_model):
    pl = PromptLearner(CLASSES, clip_model, n_ctx=4)
    assert list(pl.state_dict()) == ["ctx"]


def _trainer(tmp_path, dtd_root, tiny_clip_opts, *extra, trainer="CoOp"):
    cfg = make_cfg(
        [
            "--root",
            dtd_root,
            "--seed",
            "1",
            "--output-dir",
            str(tmp_path / "out"),
            *tiny_clip_opts,
            "TRAINER.COOP.PREC",
            "fp32",
            "TRAINER.COOP.N_CTX",
            "4",
            "OPTIM.NAME",
            "sgd",
            "OPTIM.LR",
            "0.01",
            "OPTIM.MAX_EPOCH",
            "1",
            "DATASET.NUM_SHOTS",
            "2",
            *extra,
        ],
        trainer=trainer,
    )
    return build_trainer(cfg)


def test_only_context_trains_and_frozen_work_runs_once(tmp_path, dtd_root, tiny_clip_opts):
    tr = _trainer(tmp_path, dtd_root, tiny_clip_opts)
    trainable = [n for n, p in tr.model.named_parameters() if p.requires_grad]
    assert trainable == ["prompt_learner.ctx"]
    calls = {"image": 0, "text": 0}
    enc_img, enc_txt = tr.model.encode_image, tr.model.encode_text

    def count(kind, fn):
        def wrapped(*a):
            calls[kind] += 1
            return fn(*a)

        return wrapped

    tr.model.encode_image = count("image", enc_img)
    tr.model.encode_text = count("text", enc_txt)
    tr.train()
    n_steps = len(tr.train_loader_x)
    n_test_batches = len(tr.test_loader)
    # one image encoding per step (the test set goes through the frozen-feature path);
    # one text encoding per step and one per evaluation
    assert calls["image"] == n_steps and n_test_batches > 0
    assert calls["text"] == n_steps + 1


def test_zero_shot_clip(tmp_path, dtd_root, tiny_clip_opts):
    cfg = make_cfg(
        [
            "--root",
            dtd_root,
            "--output-dir",
            str(tmp_path / "zs"),
            *tiny_clip_opts,
            "TRAINER.ZEROSHOTCLIP.PREC",
            "fp32",
        ],
        trainer="ZeroshotCLIP",
    )
    tr = build_trainer(cfg)
    assert tr.model.text_features.shape == (7, 32)
    acc = tr.test()
    assert 0.0 <= acc <= 100.0
