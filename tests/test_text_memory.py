"""MODEL.TEXT_CHUNK / MODEL.CHECKPOINT_TEXT: the class-prompt text encoding in chunks, each an
activation checkpoint, gives the plain path's losses and gradients and lowers the training peak
(measured by engine.memory's tensor accounting, the CPU counterpart of CUDA's
max_memory_allocated); a compiled model leaves such a text encoder eager."""

from __future__ import annotations

import pytest
import torch
from conftest import make_cfg
from helpers import DEPTH, loss_and_grads_of, tiny_options

import engine.compile as ec
from engine import build_trainer
from engine.errors import ConfigError
from engine.memory import TensorMemory, peak_bytes
from engine.registry import TRAINER_REGISTRY
from tools.benchmark import class_names

# CoOp-style (one context for all classes), TCP (class-dependent tokens injected inside the
# tower: row arguments), CoCoOp (per-image prompts, chunked by TRAINER.COCOOP.PROMPTS_PER_CALL too),
# MaPLe and PromptSRC (deep prompts replaced in every chunk)
TRAINERS = ("CoOp", "KgCoOp", "TCP", "CoCoOp", "MaPLe", "PromptSRC")
# (TEXT_CHUNK, CHECKPOINT_TEXT) against the plain (0, False)
VARIANTS = ((0, True), (7, False), (7, True))


def build(trainer, deep_opts, tmp_path, n_cls, chunk=0, checkpoint=False, *extra):
    node = TRAINER_REGISTRY.get(trainer).config_node()
    opts = ["--seed", "1", "--output-dir", str(tmp_path / "out"), *deep_opts]
    opts += [*tiny_options(trainer, tmp_path, DEPTH), f"TRAINER.{node}.PREC", "fp32"]
    opts += ["MODEL.TEXT_CHUNK", str(chunk), "MODEL.CHECKPOINT_TEXT", str(checkpoint), *extra]
    tr = build_trainer(make_cfg(opts, trainer=trainer), classnames=class_names(n_cls))
    tr.set_model_mode("train")
    return tr


def loss_and_grads(tr, seed=0):
    g = torch.Generator().manual_seed(seed)
    size = tr.cfg.INPUT.SIZE[0]
    image, label = torch.randn(4, 3, size, size, generator=g), torch.arange(4)
    with torch.no_grad():
        inputs = tr.prepare_step((image, label))
    return loss_and_grads_of(tr, inputs)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_chunked_checkpointed_text_equals_the_plain_path(trainer, deep_opts, tmp_path):
    n_cls = 24  # chunks of 7: 7 + 7 + 7 + 3
    plain = build(trainer, deep_opts, tmp_path, n_cls)
    loss, grads = loss_and_grads(plain)
    with torch.no_grad():
        plain.before_test()
        text = getattr(plain, "_text_features", None)
    for chunk, checkpoint in VARIANTS:
        tr = build(trainer, deep_opts, tmp_path, n_cls, chunk, checkpoint)
        assert tr.model.text_encoder.saves_memory
        got_loss, got_grads = loss_and_grads(tr)
        if chunk == 0:  # checkpointing alone recomputes with the same kernels: bit-identical
            assert torch.equal(got_loss, loss)
            assert all(torch.equal(a, b) for a, b in zip(got_grads, grads, strict=True))
            continue
        # fewer rows per matrix product (another blocking) and per-chunk sums of the shared
        # prompts' gradients: fp32 rounding, nothing more
        torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0)
        for got, want in zip(got_grads, grads, strict=True):
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (chunk, checkpoint)
        if text is not None:  # evaluation (no grad): the same class features
            with torch.no_grad():
                tr.before_test()
            torch.testing.assert_close(tr._text_features, text, rtol=0, atol=1e-6)  # unit rows


def test_tensor_memory_counts_live_storages():
    x = torch.randn(1000, 250, requires_grad=True)  # 1 MB, created before: not counted
    with TensorMemory() as m:
        y = x.exp().exp()  # two 1 MB results, the first saved for the backward
        assert m.live == 2_000_000
        loss = y.sum()
        del y  # still saved by the graph
        assert m.live == 2_000_004
        loss.backward()  # the graph is freed, x.grad (1 MB) kept
        del loss
        assert m.live == 1_000_000
    assert m.peak >= 3_000_000  # two results + the incoming gradient of the backward
    x.grad = None
    assert m.live == 0


@pytest.mark.parametrize("trainer", ("CoOp", "MaPLe"))
def test_chunks_with_checkpointing_lower_the_training_peak(trainer, deep_opts, tmp_path):
    n_cls = 400

    def step_peak(chunk, checkpoint):
        tr = build(trainer, deep_opts, tmp_path, n_cls, chunk, checkpoint)
        return peak_bytes(lambda: loss_and_grads(tr), "cpu")

    plain, chunked, both = step_peak(0, False), step_peak(50, False), step_peak(50, True)
    assert both < 0.35 * plain  # about one chunk's activations (1/8 of the classes) + the rest
    assert chunked > 0.7 * plain  # chunks alone: the graph still keeps every chunk's activations


def test_compiled_model_leaves_a_chunked_text_encoder_eager(deep_opts, tmp_path):
    plain = build("CoOp", deep_opts, tmp_path, 12, 5, True)  # the same options, not compiled
    tr = build("CoOp", deep_opts, tmp_path, 12, 5, True, "MODEL.COMPILE", "eager")
    assert tr.compiled_modules == ["image_encoder"]  # the frozen ViT; not text_encoder
    assert "text_encoder" not in ec.compiled_forwards(tr.model)
    for seed in range(2):
        loss, grads = loss_and_grads(tr, seed)
        want_loss, want_grads = loss_and_grads(plain, seed)
        # traced, the attention takes another kernel than eager's fast path: fp32 rounding
        torch.testing.assert_close(loss, want_loss)
        torch.testing.assert_close(grads, want_grads)
    assert not ec.compiled_forwards(tr.model)["image_encoder"].fallback


def test_negative_text_chunk_is_refused(deep_opts, tmp_path):
    with pytest.raises(ConfigError, match=r"MODEL.TEXT_CHUNK must be an integer >= 0"):
        build("CoOp", deep_opts, tmp_path, 4, -1)


def test_benchmark_reports_the_peak_per_variant(tmp_path, monkeypatch):
    """tools/benchmark.py --memory: one row per trainer x classes x variant, the checkpointed
    chunks below the plain step (--small on an even narrower CLIP, for speed)."""
    import tools.benchmark as bench
    from tools.benchmark import build_parser, memory_report

    narrow = {**bench.SMALL_CLIP, "embed_dim": 32}
    narrow["vision_cfg"] = {**narrow["vision_cfg"], "width": 32, "layers": 2, "head_width": 16}
    narrow["text_cfg"] = {**narrow["text_cfg"], "width": 32, "layers": 2}
    monkeypatch.setattr(bench, "SMALL_CLIP", narrow)
    out = tmp_path / "memory.json"
    args = ["--memory", "--small", "--device", "cpu", "--trainers", "CoOp"]
    args += ["--memory-classes", "200", "--memory-chunk", "20", "--json", str(out)]
    result, failed = memory_report(build_parser().parse_args(args))
    assert not failed and out.exists()
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {
        "plain",
        "chunks",
        "checkpointed chunks",
        "shared prefix",
        "shared prefix + checkpointed chunks",
    }
    assert result["measure"].startswith("tensor accounting")
    for r in rows.values():
        assert r["classes"] == 200 and r["finite_loss"] and r["prec"] == "fp32"
        assert r["total_mb"] == pytest.approx(r["step_mb"] + r["resident_mb"])
    assert rows["checkpointed chunks"]["text_chunk"] == 20
    assert rows["checkpointed chunks"]["step_mb"] < 0.7 * rows["plain"]["step_mb"]
    # CoOp's 16 + 1 shared tokens kept once, not per class: activations and time fall
    assert rows["shared prefix"]["shared_prefix"] and not rows["plain"]["shared_prefix"]
    assert rows["shared prefix"]["step_mb"] < 0.7 * rows["plain"]["step_mb"]
    assert all(r["step_ms"] > 0 for r in rows.values())
