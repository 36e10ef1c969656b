"""CLIP loading from local files, precision modes, truncated text encoding."""

from __future__ import annotations

import json
import os.path as osp

import open_clip
import pytest
import torch
from conftest import make_cfg

from engine.clip import BackboneError, TextEncoder, load_clip, tokenize, truncate_tokens
from engine.clip.model import build_clip, read_state_dict
from engine.clip.toy import TINY_CLIP_CONFIG


def _cfg(tiny_clip, *extra):
    cfg_path, ckpt = tiny_clip
    return make_cfg(
        [
            "MODEL.BACKBONE.NAME",
            "",
            "MODEL.BACKBONE.CONFIG",
            cfg_path,
            "MODEL.BACKBONE.PATH",
            ckpt,
            *extra,
        ]
    )


def test_load_open_clip_checkpoint_exactly(tiny_clip):
    model = load_clip(_cfg(tiny_clip))
    sd, _ = read_state_dict(tiny_clip[1])
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k]), k
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training


def test_load_openai_torchscript_checkpoint(tiny_clip, tmp_path):
    """OpenAI releases TorchScript archives; the architecture is inferred from the weights."""
    model = load_clip(_cfg(tiny_clip))
    img, txt = torch.randn(1, 3, 32, 32), open_clip.tokenize(["a dog"])
    traced = torch.jit.trace(model, (img, txt), strict=False, check_trace=False)
    path = str(tmp_path / "openai.pt")
    traced.save(path)
    cfg = make_cfg(["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.PATH", path])
    # head_width 32 != OpenAI's 64 for the vision tower, so give the config
    cfg.defrost()
    cfg.MODEL.BACKBONE.CONFIG = tiny_clip[0]
    loaded = load_clip(cfg)
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k


def test_missing_weights_error_names_address_cache_and_command(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("SAMPLE_PL_OFFLINE", "1")
    cfg = make_cfg(["--backbone", "ViT-B/16"])
    with pytest.raises(BackboneError) as e:
        load_clip(cfg)
    msg = str(e.value)
    assert ".cache/clip/ViT-B-16.pt" in msg and "offline" in msg and "\n" not in msg
    assert "https://openaipublic.azureedge.net/clip/models/5806e77c" in msg
    assert "curl -fL" in msg and "sha256sum" in msg and "tools/download_weights.py" in msg
    cfg = make_cfg(["MODEL.BACKBONE.PATH", str(tmp_path / "nope.pt")])
    with pytest.raises(BackboneError, match="does not exist"):
        load_clip(cfg)


def test_wrong_architecture_is_explained(tiny_clip, tmp_path):
    other = json.loads(json.dumps(TINY_CLIP_CONFIG))
    other["text_cfg"]["layers"] = 3
    p = tmp_path / "other.json"
    p.write_text(json.dumps(other))
    cfg = make_cfg(
        [
            "MODEL.BACKBONE.NAME",
            "",
            "MODEL.BACKBONE.CONFIG",
            str(p),
            "MODEL.BACKBONE.PATH",
            tiny_clip[1],
        ]
    )
    with pytest.raises(BackboneError, match="do not fit the architecture"):
        load_clip(cfg)


def test_fp16_mode_like_openai(tiny_clip):
    model = load_clip(_cfg(tiny_clip), precision="fp16")
    assert model.visual.conv1.weight.dtype == torch.float16
    assert model.transformer.resblocks[0].mlp.c_fc.weight.dtype == torch.float16
    assert model.ln_final.weight.dtype == torch.float32  # layer norms stay fp32
    out = model.encode_image(torch.randn(2, 3, 32, 32).half())
    assert out.dtype == torch.float16 and torch.isfinite(out).all()


def test_truncated_text_encoding_is_exact(tiny_clip):
    model = load_clip(_cfg(tiny_clip))
    enc = TextEncoder(model)
    for n_words in range(0, 30, 3):
        texts = ["a photo of a " + "very " * ((i * 7 + n_words) % 13) + "dog." for i in range(5)]
        tokens = tokenize(texts)
        full = enc.encode_tokens(tokens, truncate=False)
        short = enc.encode_tokens(tokens, truncate=True)
        assert truncate_tokens(tokens)[0].shape[1] < 77
        assert (full - short).abs().max().item() == 0.0
    ref = model.encode_text(tokens)  # open_clip's own full-length forward
    assert torch.allclose(ref, full, atol=1e-6)


def test_tokenize_refuses_to_truncate():
    with pytest.raises(ValueError, match="more than CLIP's context length"):
        tokenize("word " * 100)


def test_random_weights_need_explicit_flag(tiny_clip):
    cfg = make_cfg(
        [
            "MODEL.BACKBONE.NAME",
            "",
            "MODEL.BACKBONE.CONFIG",
            tiny_clip[0],
            "MODEL.BACKBONE.PRETRAINED",
            "False",
        ]
    )
    model = load_clip(cfg)
    assert isinstance(model, type(build_clip(TINY_CLIP_CONFIG)))


def test_weights_found_in_openai_cache(tmp_path, monkeypatch):
    from engine.clip import find_weights

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".cache" / "clip").mkdir(parents=True)
    (tmp_path / ".cache" / "clip" / "ViT-B-16.pt").write_bytes(b"x")
    path, searched = find_weights(make_cfg(["--backbone", "ViT-B/16"]))
    assert path == str(tmp_path / ".cache" / "clip" / "ViT-B-16.pt") and searched == [path]


def test_relative_backbone_paths_fall_back_to_the_repository(tmp_path, monkeypatch):
    from engine.clip.model import REPO_ROOT, resolve_path

    monkeypatch.chdir(tmp_path)
    assert resolve_path("configs/clip/small_world_clip.json") == osp.join(
        REPO_ROOT, "configs/clip/small_world_clip.json"
    )
    (tmp_path / "configs").mkdir()
    assert resolve_path("configs") == "configs"  # what exists from the current folder wins
