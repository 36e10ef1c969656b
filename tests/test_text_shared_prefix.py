"""engine.clip.text.shared_prefix_text(model): a pass without gradients encodes the class prompts'
common prefix once (the causal tower's states of shared leading tokens are shared) and gives the
plain path's features - to float64 rounding in float64, fp32 rounding in fp32 - for every
trainer's text encoder, with deep prompts and class-aware tokens injected by layer hooks; the
engine uses it for an optimizer's look at the outputs (MESA's EMA model), never for a pass with
gradients."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import make_cfg
from helpers import DEPTH, DTD_CLASSES, loss_and_grads_of, tiny_options

import engine.clip.text as text_mod
import engine.compile as ec
from engine import build_trainer
from engine.clip.text import (
    TextEncoder,
    _neighbour_prefixes,
    plan_shared_prefix,
    shared_prefix_text,
)
from engine.registry import TRAINER_REGISTRY
from optim.step import StepBatch

# CoOp-style prompts (one context: [SOS][ctx] shared), TCP (class tokens injected inside the
# tower: the prefix shrinks at that block), CoCoOp (per-image prompts), deep prompts replaced by
# hooks in every block (MaPLe, IVLP, PromptSRC), CoPrompt
N_CLS = 7
TRAINERS = ("CoOp", "KgCoOp", "TCP", "CoCoOp", "MaPLe", "IVLP", "PromptSRC", "CoPrompt")


def build(trainer, deep_opts, tmp_path, n_cls=N_CLS, *extra):
    node = TRAINER_REGISTRY.get(trainer).config_node()
    opts = ["--seed", "1", "--output-dir", str(tmp_path / "out"), *deep_opts]
    opts += [*tiny_options(trainer, tmp_path, DEPTH), f"TRAINER.{node}.PREC", "fp32", *extra]
    tr = build_trainer(make_cfg(opts, trainer=trainer), classnames=list(DTD_CLASSES[:n_cls]))
    tr.set_model_mode("train")
    return tr


class Spy:
    """Records TextEncoder.encode_shared_prefix calls: (prefix length, groups, rows)."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = TextEncoder.encode_shared_prefix
        spy = self

        def wrapped(enc, x, eot_idx, plan, layer_hook, row_args):
            spy.calls.append((plan.length, len(plan.first), x.shape[0]))
            return real(enc, x, eot_idx, plan, layer_hook, row_args)

        monkeypatch.setattr(TextEncoder, "encode_shared_prefix", wrapped)


def step_inputs(tr, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    size = tr.cfg.INPUT.SIZE[0]
    views = [torch.randn(4, 3, size, size, generator=g, dtype=dtype) for _ in range(2)]
    k = tr.cfg.DATALOADER.K_TRANSFORMS
    batch = {"img": views[0] if k == 1 else views[:k], "label": torch.arange(4) % 3}
    with torch.no_grad():
        return tr.prepare_step(tr.parse_batch_train(batch))


def pass_logits(tr, inputs):
    tr._pass_outputs = None
    tr._loss(inputs)
    return tr._pass_outputs.logits


# CoPrompt's adapters compute in fp32 whatever the model's dtype: fp32 only (MaPLe's text path)
CASES = [
    (t, d)
    for t in TRAINERS
    for d in (torch.float64, torch.float32)
    if (t, d) != ("CoPrompt", torch.float64)
]


@pytest.mark.parametrize("trainer,dtype", CASES)
def test_shared_prefix_gives_the_plain_logits(trainer, dtype, deep_opts, tmp_path, monkeypatch):
    tr = build(trainer, deep_opts, tmp_path)
    if hasattr(tr, "load_descriptions"):  # CoPrompt's description features, before the cast
        tr.load_descriptions()
    tr.model.to(dtype)
    for m in tr.model.modules():  # the models' recorded compute dtype
        if isinstance(m.__dict__.get("dtype"), torch.dtype):
            m.dtype = dtype
    inputs = step_inputs(tr, dtype=dtype)
    with torch.no_grad():
        plain = pass_logits(tr, inputs)
    spy = Spy(monkeypatch)
    with torch.no_grad(), shared_prefix_text(tr.model):
        shared = pass_logits(tr, inputs)
    assert spy.calls, "the shared-prefix path was not taken"
    for length, groups, rows in spy.calls:
        assert length >= text_mod.SHARED_PREFIX_MIN
        # one group of class prompts per image for CoCoOp, one for all classes otherwise
        # (two CoCoOp images with equal contexts share one group)
        assert 1 <= groups <= rows // N_CLS if trainer == "CoCoOp" else groups == 1
    if dtype == torch.float64:
        torch.testing.assert_close(shared, plain, rtol=1e-12, atol=1e-12)
    else:  # smaller matrix products sum in another order: fp32 rounding
        assert (shared - plain).abs().max() <= 2e-5 * plain.abs().max()


def test_gradients_and_outside_the_block_keep_the_plain_path(deep_opts, tmp_path, monkeypatch):
    tr = build("CoOp", deep_opts, tmp_path)
    inputs = step_inputs(tr)
    spy = Spy(monkeypatch)
    with torch.no_grad():
        plain = pass_logits(tr, inputs)
    with shared_prefix_text(tr.model):  # with gradients: the plain path, bit for bit
        with_grad = pass_logits(tr, inputs)
    assert spy.calls == []
    assert torch.equal(with_grad.detach(), plain)
    with torch.no_grad(), shared_prefix_text(tr.model):
        pass_logits(tr, inputs)
    assert len(spy.calls) == 1 and not tr.model.text_encoder._prefix_pass


def tower_and_prompts(deep_opts, tmp_path, n_cls=6):  # (3 + 3 rows below)
    tr = build("CoOp", deep_opts, tmp_path, n_cls)
    tr.model.double()
    enc = tr.model.text_encoder
    with torch.no_grad():
        prompts = tr.model.prompt_learner()
    return enc, prompts, tr.model.prompt_learner.eot_idx


def test_rows_equal_up_to_their_eot_and_a_single_row(deep_opts, tmp_path):
    enc, prompts, eot = tower_and_prompts(deep_opts, tmp_path)
    twins = torch.cat([prompts[:3], prompts[:3]])  # duplicate classes: the prefix stops at EOT
    eot2 = torch.cat([eot[:3], eot[:3]])
    with torch.no_grad():
        plain, single = enc(twins, eot2), enc(prompts[:1], eot[:1])
        with enc.sharing_prefix():
            plan = enc.prefix_plan(twins + enc.positional_embedding[: twins.shape[1]], eot2)
            assert plan is not None and len(plan.first) == 1
            shared = enc(twins, eot2)
            one = enc(prompts[:1], eot[:1])  # one prompt: nothing to share, the plain path
    torch.testing.assert_close(shared, plain, rtol=1e-12, atol=1e-12)
    assert torch.equal(one, single)


def test_blocks_it_cannot_reproduce_keep_the_plain_path(deep_opts, tmp_path, monkeypatch):
    enc, prompts, eot = tower_and_prompts(deep_opts, tmp_path)
    spy = Spy(monkeypatch)
    enc.transformer.resblocks[1].attn.dropout = 0.1  # attention dropout while training
    enc.train()
    with torch.no_grad(), enc.sharing_prefix():
        enc(prompts, eot)
    assert spy.calls == []
    enc.eval()  # dropout is off in eval mode: shared again
    with torch.no_grad(), enc.sharing_prefix():
        enc(prompts, eot)
    assert len(spy.calls) == 1


def test_neighbour_prefixes():
    x = torch.zeros(3, 5, 2)
    assert _neighbour_prefixes(x).tolist() == [5, 5]
    x[1, 2, 0] = 1.0
    assert _neighbour_prefixes(x).tolist() == [2, 2]
    x[2, 0, 1] = 1.0
    assert _neighbour_prefixes(x).tolist() == [2, 0]


def test_plan_groups_consecutive_rows_and_weighs_the_cost():
    # two "images" x three classes: rows share 6 tokens within an image, 1 across images
    x = torch.zeros(6, 10, 1)
    x[3:, 1:6] = 1.0  # the second image's context
    for r in range(6):
        x[r, 6:] = 10.0 + r  # each class's own tokens
    eot = torch.full((6,), 8)
    plan = plan_shared_prefix(x, eot, plain_len=16)
    assert plan.length == 6
    assert plan.group.tolist() == [0, 0, 0, 1, 1, 1] and plan.first.tolist() == [0, 3]
    eot[4] = 5  # a prefix never reaches an EOT: at most 5 tokens shared
    assert plan_shared_prefix(x, eot, plain_len=16).length == 5
    assert plan_shared_prefix(x, eot, plain_len=3) is None  # the plain path is cheaper
    assert plan_shared_prefix(x[:1], eot[:1], plain_len=16) is None  # one row
    x[:, 1] = torch.arange(6.0)[:, None]  # rows differ after SOS: nothing worth sharing
    assert plan_shared_prefix(x, torch.full((6,), 8), plain_len=16) is None


def test_mesa_teacher_pass_shares_the_prefix(deep_opts, tmp_path, monkeypatch):
    """The engine encodes MESA's EMA-model pass (no gradients) with the shared prefix and the
    training pass plainly; the teacher logits equal a plain forward at the EMA weights."""
    # TRAJ_START -1: the EMA pass from the first (0-based) epoch on
    opts = ("OPTIM.SAM.NAME", "mesa", "OPTIM.SAM.EMA_DECAY", "0.5", "OPTIM.SAM.TRAJ_START", "-1")
    tr = build("CoOp", deep_opts, tmp_path, N_CLS, *opts)
    size = tr.cfg.INPUT.SIZE[0]
    g = torch.Generator().manual_seed(0)
    batch = {"img": torch.randn(4, 3, size, size, generator=g), "label": torch.arange(4)}
    tr.batch_idx, tr.num_batches = 0, 2
    tr.forward_backward(batch)  # one step: the EMA now differs from the weights
    mesa = tr.optim_step.sharp[0]
    params, ema = mesa._trainable(), mesa._ema_weights()
    assert not all(torch.equal(p, w) for p, w in zip(params, ema))
    inputs = step_inputs(tr)
    with torch.no_grad():
        saved = [p.clone() for p in params]
        for p, w in zip(params, ema):
            p.copy_(w)
        plain = pass_logits(tr, inputs)
        for p, w in zip(params, saved):
            p.copy_(w)
    spy = Spy(monkeypatch)
    mesa.before_forward(StepBatch(partial(tr._pass, inputs, size=4)), tr.epoch)
    assert len(spy.calls) == 1  # the teacher pass
    assert (mesa._teacher - plain).abs().max() <= 2e-5 * plain.abs().max()
    assert all(torch.equal(p, w) for p, w in zip(params, saved))  # the weights are back
    tr.forward_backward(batch)  # a whole step: the teacher pass shared, the training pass plain
    assert len(spy.calls) == 2


@pytest.mark.parametrize("prec", ["fp16", "amp", "bf16"])
def test_shared_prefix_in_half_precision(prec, deep_opts, tmp_path, monkeypatch):
    """fp16 weights (CoOp's fp16), autocast (amp, bf16): the shared pass stays within the
    half-precision rounding of the plain one."""
    tr = build("CoOp", deep_opts, tmp_path, N_CLS, "TRAINER.COOP.PREC", prec)
    want = torch.float16 if prec == "fp16" else torch.float32
    assert tr.model.text_encoder.dtype == want
    inputs = step_inputs(tr)
    spy = Spy(monkeypatch)
    with torch.no_grad(), tr.autocast():
        plain = pass_logits(tr, inputs).float()
        with shared_prefix_text(tr.model):
            shared = pass_logits(tr, inputs).float()
    assert len(spy.calls) == 1 and torch.isfinite(shared).all()
    assert (shared - plain).abs().max() <= 2e-2 * plain.abs().max()


@pytest.mark.parametrize("trainer,dtype", CASES)
def test_shared_prefix_option_gives_the_plain_gradients(trainer, dtype, deep_opts, tmp_path):
    """MODEL.SHARED_PREFIX: every pass, training included, shares the prefix; the loss and every
    learnable tensor's gradient equal the plain path's (float64 rounding / fp32 rounding)."""
    got = []
    for shared in (False, True):
        torch.manual_seed(0)  # CoPrompt draws a description per pass
        tr = build(trainer, deep_opts, tmp_path, N_CLS, "MODEL.SHARED_PREFIX", str(shared))
        if hasattr(tr, "load_descriptions"):
            tr.load_descriptions()
        tr.model.to(dtype)
        for m in tr.model.modules():
            if isinstance(m.__dict__.get("dtype"), torch.dtype):
                m.dtype = dtype
        assert all(e.shared_prefix == shared for e in text_encoders(tr.model))
        torch.manual_seed(1)
        got.append(loss_and_grads_of(tr, step_inputs(tr, dtype=dtype)))
    (loss, grads), (s_loss, s_grads) = got
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert abs(float(s_loss - loss)) <= tol * abs(float(loss))
    for a, b in zip(s_grads, grads, strict=True):
        assert (a - b).abs().max() <= tol * b.abs().max(), trainer


def text_encoders(model):
    return [m for m in model.modules() if isinstance(m, TextEncoder)]


def test_shared_prefix_option_trains_and_is_left_eager(deep_opts, tmp_path, monkeypatch):
    """A real step with the option: the training pass is prefix-shared; a compiled model leaves
    such a text encoder eager (its shapes depend on the prompts)."""
    tr = build("CoOp", deep_opts, tmp_path, N_CLS, "MODEL.SHARED_PREFIX", "True")
    size = tr.cfg.INPUT.SIZE[0]
    batch = {"img": torch.randn(4, 3, size, size), "label": torch.arange(4)}
    tr.batch_idx, tr.num_batches = 0, 2
    spy = Spy(monkeypatch)
    before = tr.model.prompt_learner.ctx.detach().clone()
    tr.forward_backward(batch)
    assert len(spy.calls) == 1 and not torch.equal(before, tr.model.prompt_learner.ctx)
    opts = ("MODEL.SHARED_PREFIX", "True", "MODEL.COMPILE", "eager")
    compiled = build("CoOp", deep_opts, tmp_path, N_CLS, *opts)
    assert compiled.compiled_modules == ["image_encoder"]  # the frozen ViT; not text_encoder
    assert "text_encoder" not in ec.compiled_forwards(compiled.model)


@pytest.mark.parametrize("trainer", ["CoOp", "MaPLe", "TCP"])
def test_shared_prefix_in_checkpointed_chunks(trainer, deep_opts, tmp_path, monkeypatch):
    """With MODEL.TEXT_CHUNK + MODEL.CHECKPOINT_TEXT the backward recomputes each chunk through
    the prefix-shared path: the same loss and gradients as the plain step (fp32 rounding)."""
    spy = Spy(monkeypatch)
    got = []
    for opts in ((), ("MODEL.SHARED_PREFIX", "True", "MODEL.TEXT_CHUNK", "3")):
        if opts:
            opts += ("MODEL.CHECKPOINT_TEXT", "True")
        tr = build(trainer, deep_opts, tmp_path, N_CLS, *opts)
        got.append(loss_and_grads_of(tr, step_inputs(tr)))
    # 7 classes in chunks of 3, 3, 1 (one row: nothing to share): 2 chunks, forward + recompute
    assert [rows for _, _, rows in spy.calls] == [3, 3, 3, 3]
    (loss, grads), (s_loss, s_grads) = got
    assert abs(float(s_loss - loss)) <= 2e-5 * abs(float(loss))
    for a, b in zip(s_grads, grads, strict=True):
        assert (a - b).abs().max() <= 2e-5 * b.abs().max()
