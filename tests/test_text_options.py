"""The text encoder is configured one way: its options (MODEL.TEXT_CHUNK, MODEL.CHECKPOINT_TEXT,
MODEL.SHARED_PREFIX, MODEL.TEXT_FULL_LENGTH) are read from the config where the model is built and
kept on each model, and the shared-prefix pass is switched on one model's encoders, never
process-wide: two models in one process do not affect each other."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch
from conftest import make_cfg
from helpers import DEPTH, DTD_CLASSES, tiny_options

import engine.clip.text as text_mod
from engine import build_trainer
from engine.clip import tokenize
from engine.clip.text import TextEncoder, TextOptions, shared_prefix_text, text_options

N_CLS = 5


def build(deep_opts, tmp_path, *extra):
    opts = ["--seed", "1", "--output-dir", str(tmp_path / "out"), *deep_opts]
    opts += [*tiny_options("CoOp", tmp_path, DEPTH), "TRAINER.COOP.PREC", "fp32", *extra]
    cfg = make_cfg(opts, trainer="CoOp")
    tr = build_trainer(cfg, classnames=list(DTD_CLASSES[:N_CLS]))
    tr.set_model_mode("eval")
    return tr


def encoders(model):
    return [m for m in model.modules() if isinstance(m, TextEncoder)]


def text_features(tr):
    with torch.no_grad():
        return tr.model.encode_text()


def test_two_models_in_one_process_keep_their_own_text_options(deep_opts, tmp_path, monkeypatch):
    memory = ("MODEL.TEXT_CHUNK", "2", "MODEL.CHECKPOINT_TEXT", "True")
    shared = build(deep_opts, tmp_path / "a", *memory, "MODEL.SHARED_PREFIX", "True")
    plain = build(deep_opts, tmp_path / "b")  # built after: must not change the first model
    assert text_options(shared.cfg) == TextOptions(2, True, True)
    assert text_options(plain.cfg) == TextOptions()
    assert [e.options for e in encoders(shared.model)] == [TextOptions(2, True, True)]
    assert [e.options for e in encoders(plain.model)] == [TextOptions()]
    assert shared.model.text_encoder.saves_memory and not plain.model.text_encoder.saves_memory

    calls = []  # the encoders that took the shared-prefix path
    real = TextEncoder.encode_shared_prefix

    def spy(enc, *args):
        calls.append(enc)
        return real(enc, *args)

    monkeypatch.setattr(TextEncoder, "encode_shared_prefix", spy)
    before = text_features(plain)
    assert calls == []
    # The shared-prefix pass of one model (MESA's EMA pass, ESAM's selection) leaves the other
    # model's passes on the plain path, bit for bit (a process-wide flag switched both).
    with shared_prefix_text(shared.model):
        assert shared.model.text_encoder._prefix_pass
        assert not plain.model.text_encoder._prefix_pass
        during = text_features(plain)
        text_features(shared)
    assert torch.equal(during, before)
    assert calls and all(enc is shared.model.text_encoder for enc in calls)
    assert not shared.model.text_encoder._prefix_pass  # the block restores the state
    n_shared = len(calls)
    with plain.model.text_encoder.sharing_prefix():  # the switch on the instance: no other
        text_features(plain)
        assert not shared.model.text_encoder._prefix_pass
    assert len(calls) > n_shared and calls[-1] is plain.model.text_encoder


def test_options_are_checked_and_configure_takes_options_only(deep_opts, tmp_path):
    with pytest.raises(ValueError, match="MODEL.TEXT_CHUNK must be >= 0"):
        TextOptions(chunk=-1)
    enc = build(deep_opts, tmp_path).model.text_encoder
    with pytest.raises(TypeError, match="TextOptions"):
        enc.configure({"chunk": 2})
    enc.configure(TextOptions(chunk=3))
    assert (enc.chunk, enc.checkpoint, enc.shared_prefix) == (3, False, False)


def test_full_length_prompts_are_one_models_option_read_at_build(deep_opts, tmp_path):
    """MODEL.TEXT_FULL_LENGTH keeps one model's prompts and frozen texts at 77 tokens; a model
    built after it in the same process cuts its own (and the other way round)."""
    short_a = build(deep_opts, tmp_path / "a")
    full = build(deep_opts, tmp_path / "b", "MODEL.TEXT_FULL_LENGTH", "True")
    short_b = build(deep_opts, tmp_path / "c")
    assert text_options(full.cfg) == TextOptions(full_length=True)
    lengths = {}
    for name, tr in (("short_a", short_a), ("full", full), ("short_b", short_b)):
        pl, enc = tr.model.prompt_learner, tr.model.text_encoder
        assert enc.options == text_options(tr.cfg)
        seen = []  # the token count of the frozen texts' pass (encode_tokens)
        hook = enc.register_forward_pre_hook(
            lambda m, args, seen=seen: seen.append(args[0].shape[1])
        )
        with torch.no_grad():
            enc.encode_tokens(tokenize(["a photo of a dog."]))
        hook.remove()
        lengths[name] = (pl.token_prefix.shape[1] + pl.n_ctx + pl.token_suffix.shape[1], *seen)
    # CoOp: SOS, 16 context tokens, the class name, "." and EOT, cut at 32 (frozen texts: 16)
    assert lengths == {"short_a": (32, 16), "full": (77, 77), "short_b": (32, 16)}
    assert not any(isinstance(v, bool) and k.startswith("_") for k, v in vars(text_mod).items())


def test_no_process_wide_text_switch_is_left():
    """engine/clip/text.py sets no module-level state at run time: no ``global`` statement (the
    full-length prompts are MODEL.TEXT_FULL_LENGTH, read at build) and no module-level
    shared-prefix switch."""
    tree = ast.parse(inspect.getsource(text_mod))
    names = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
    assert names == set()
    assert not hasattr(text_mod, "_FULL_LENGTH") and not hasattr(text_mod, "full_length_prompts")
    assert not hasattr(text_mod, "_SHARED_PREFIX")
    assert not hasattr(text_mod, "set_text_memory")
    assert "self._prefix_pass" in inspect.getsource(TextEncoder.prefix_plan)
