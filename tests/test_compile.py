"""MODEL.COMPILE: compiled encoders give the results of the eager ones.

CPU: the ``aot_eager`` backend traces with dynamo and AOT autograd as the GPU modes do, without
code generation; one test also runs inductor's CPU code generation (skipped without a C++
compiler). The GPU default (``auto`` -> reduce-overhead) is resolved by device and checked at its
first call against eager by the same code that these tests drive (engine/compile.py).
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from conftest import make_cfg
from helpers import DEPTH, coop_args, tiny_options

import engine.compile as ec
import engine.compile_cache as compile_cache
import engine.trainer as et
from engine import build_trainer
from engine.registry import TRAINER_REGISTRY

TRAINABLE = sorted(
    n
    for n, cls in ((n, TRAINER_REGISTRY.get(n)) for n in TRAINER_REGISTRY)
    if not cls.EVAL_ONLY and not getattr(cls, "ALIAS_OF", "")
)
STEPS = 3  # full batches of 4 (7 classes x 2 shots = 14 images: 3 full + 1 partial)


def trainer_cfg(trainer, tmp_path, root, deep_opts, mode, sam="sample", *extra):
    node = TRAINER_REGISTRY.get(trainer).config_node()
    opts = ["--root", root, "--seed", "1", "--output-dir", str(tmp_path / f"out_{mode}_{sam}")]
    opts += [*deep_opts, *tiny_options(trainer, tmp_path, DEPTH), f"TRAINER.{node}.PREC", "fp32"]
    opts += ["OPTIM.SAM.NAME", sam, "OPTIM.SAM.START_EPOCH", "0", "OPTIM.MAX_EPOCH", "1"]
    opts += ["DATASET.NUM_SHOTS", "2", "DATALOADER.TRAIN_X.BATCH_SIZE", "4"]
    opts += ["DATALOADER.TEST.BATCH_SIZE", "8", "TEST.FEATURE_CACHE", "False"]
    opts += ["MODEL.COMPILE", mode, *extra]
    return make_cfg(opts, trainer=trainer)


def train_steps(tr, steps: int = STEPS) -> list[float]:
    """``steps`` training steps; compiled, only the first one compiles (a new graph per step,
    e.g. from a guard on a per-step object, would be silently slow)."""
    tr.set_model_mode("train")
    losses, graphs = [], []
    for i, batch in zip(range(steps), tr.train_loader_x):
        tr.batch_idx = i
        losses.append(float(tr.forward_backward(batch)["loss"]))
        graphs.append(ec.graph_count())
    if ec.compiled_forwards(tr.model):  # the last, partial batch runs eagerly
        assert len(set(graphs)) == 1, graphs
    return losses


def learnable(tr) -> list[torch.Tensor]:
    return [p.detach().clone() for p in tr.model.parameters() if p.requires_grad]


def assert_compiled_and_used(tr) -> None:
    """The compiled path really ran: no fallback, at least one compiled signature."""
    forwards = ec.compiled_forwards(tr.model)
    assert forwards, "no encoder was compiled"
    for name, fwd in forwards.items():
        assert not fwd.fallback, (name, fwd.fallback)
    assert any(f.first_calls for f in forwards.values())


@pytest.mark.slow
@pytest.mark.parametrize("sam", ["", "sample"], ids=["base", "sample"])
@pytest.mark.parametrize("trainer", TRAINABLE)
def test_compiled_steps_and_evaluation_match_eager(trainer, sam, tmp_path, dtd_root, deep_opts):
    """Every registered trainer x {its base optimizer, SAMPLe}: losses and parameters after
    three steps and the test accuracy, compiled (aot_eager) vs eager."""
    results = {}
    compiles = getattr(TRAINER_REGISTRY.get(trainer), "COMPILES", True)  # ProGrad: eager
    for mode in ("off", "aot_eager"):
        tr = build_trainer(trainer_cfg(trainer, tmp_path, dtd_root, deep_opts, mode, sam))
        assert bool(tr.compile_model()) == (mode != "off" and compiles)
        losses = train_steps(tr)
        params = learnable(tr)
        acc = tr.test()
        if mode != "off" and compiles:
            assert_compiled_and_used(tr)
        results[mode] = (losses, params, acc)
        tr.close_writer()
    (l1, p1, a1), (l2, p2, a2) = results["off"], results["aot_eager"]
    # fp32 rounding: AOT autograd's decompositions (layer norm, GELU) round differently
    assert l1 == pytest.approx(l2, rel=1e-5, abs=1e-6)
    assert a1 == a2
    for x, y in zip(p1, p2, strict=True):
        # each tensor within 1e-4 of its norm: SAMPLe's normalised directions can carry the
        # rounding of a thread-dependent reduction into one element near 0 (MMRL: one of 32,768
        # moves by 2e-4 with two threads, 4e-5 with one), while a wrong graph moves the whole
        bound = 1e-4 * float(y.norm()) + 1e-5 * y.numel() ** 0.5  # (1e-5: per element)
        assert float((x - y).norm()) <= bound, (float((x - y).norm()), bound)


@pytest.mark.slow
@pytest.mark.parametrize("prec", ["fp16", "amp", "bf16"])
@pytest.mark.parametrize("trainer", ["CoOp", "MaPLe"])
def test_compiled_steps_match_eager_in_half_precision(trainer, prec, tmp_path, dtd_root, deep_opts):
    """The GPU precisions: fp16 weights (fp32 prompts), amp (GradScaler, one scale for both
    passes) and bf16 autocast, with SAMPLe. Compiled and eager differ by half-precision rounding
    (AOT autograd's decompositions compute some backward ops in fp32), so the criterion is that
    rounding's own size in this run, the eager half-precision run's distance from fp32: the
    compiled losses and parameters after three steps stay within 3x that distance of eager.
    SGD (the papers' base optimizer): Adam's first steps move every element by +-lr whatever
    its gradient's size, so rounding that flips a near-zero gradient's sign moves it by 2 lr."""
    node = TRAINER_REGISTRY.get(trainer).config_node()
    results = {}
    sgd = ("OPTIM.NAME", "sgd", "OPTIM.LR", "0.002")
    for mode, p in (("off", "fp32"), ("off", prec), ("aot_eager", prec)):
        cfg = trainer_cfg(trainer, tmp_path, dtd_root, deep_opts, mode, "sample", *sgd)
        cfg.defrost()
        cfg.TRAINER[node].PREC = p
        tr = build_trainer(cfg)
        if p == "amp":  # the default 2**16 overflows the tiny fp16 model's first steps
            tr.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        tr.compile_model()
        results[mode, p] = (train_steps(tr), learnable(tr))
        if mode != "off":
            assert_compiled_and_used(tr)
    (l32, p32), (le, pe), (lc, pc) = results.values()
    rounding = max(abs(b - a) for a, b in zip(l32, le, strict=True))
    for b, c in zip(le, lc, strict=True):
        assert abs(c - b) <= 3 * rounding + 1e-5, (lc, le, l32)
    for a, b, c in zip(p32, pe, pc, strict=True):
        assert (c - b).norm() <= 3 * (b - a).norm() + 1e-6, ((c - b).norm(), (b - a).norm())


@pytest.mark.slow
@pytest.mark.parametrize("trainer", TRAINABLE)
def test_every_encoder_is_captured_whole(trainer, tmp_path, dtd_root, deep_opts):
    """Each compiled encoder's forward, with the inputs its trainer's training step gives it,
    is one graph without breaks (a break splits a CUDA graph and brings back the launches)."""
    import torch._dynamo

    tr = build_trainer(trainer_cfg(trainer, tmp_path, dtd_root, deep_opts, "off", "sample"))
    modules = {n: m for n, m in tr.model.named_modules() if isinstance(m, ec._encoder_types())}
    inputs = {}
    for name, module in modules.items():

        def record(*args, _name=name, _forward=module.forward, **kwargs):
            inputs.setdefault(_name, (args, kwargs))
            return _forward(*args, **kwargs)

        module.forward = record
    tr.set_model_mode("train")
    tr.batch_idx = 0
    tr.forward_backward(next(iter(tr.train_loader_x)))
    assert inputs, "the step called no encoder"
    for name, (args, kwargs) in inputs.items():
        del modules[name].forward  # the class's forward again
        explained = torch._dynamo.explain(modules[name].forward)(*args, **kwargs)
        reasons = [str(b.reason) for b in explained.break_reasons]
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), (name, reasons)


def test_partial_batches_run_eagerly(tmp_path, dtd_root, deep_opts):
    """The last, smaller batch of an epoch and of the test set never gets a graph of its own:
    every compiled signature of MaPLe's image encoder has the full batch."""
    tr = build_trainer(trainer_cfg("MaPLe", tmp_path, dtd_root, deep_opts, "aot_eager"))
    train_steps(tr, steps=len(tr.train_loader_x))  # 3 full batches + 1 of 2 images
    tr.test()
    forwards = ec.compiled_forwards(tr.model)
    image = forwards["image_encoder"]
    batches = {sig[0][0][0][0] for sig in image.first_calls}  # first input's leading dim
    assert batches == {4, 8}, batches  # the training batch and the test batch, nothing else
    assert not image.fallback


def test_auto_is_off_on_cpu_and_compiles_when_training_starts(
    tmp_path, dtd_root, deep_opts, monkeypatch
):
    assert ec.resolve_compile("auto", "cpu") == ""
    assert ec.resolve_compile("auto", "cuda") == ec.GPU_MODE == "reduce-overhead"
    assert ec.resolve_compile("off", "cuda") == ec.resolve_compile("", "cuda") == ""
    assert ec.resolve_compile("aot_eager", "cpu") == "aot_eager"
    assert make_cfg([]).MODEL.COMPILE == "auto"
    tr = build_trainer(trainer_cfg("CoOp", tmp_path, dtd_root, deep_opts, "auto"))
    assert tr.compile_mode == "" and tr.compile_model() == []
    # on a GPU ``auto`` resolves to a mode; here a CPU backend stands in for it: nothing is
    # compiled when the trainer is built (an evaluation-only run stays eager), training compiles
    resolve = ec.resolve_compile
    monkeypatch.setattr(et, "resolve_compile", lambda v, d: "aot_eager" if v == "auto" else "")
    # auto's decision (engine/compile_cache.py, tests/test_compile_cache.py): here it pays
    monkeypatch.setattr(compile_cache, "decide", lambda *a, **k: (True, "stand-in: it pays"))
    marks = []
    monkeypatch.setattr(et, "mark_step", lambda: marks.append(1))
    no_test = ("TEST.NO_TEST", "True")
    cfg = trainer_cfg("CoOp", tmp_path, dtd_root, deep_opts, "auto", "sample", *no_test)
    tr = build_trainer(cfg)
    assert tr.compile_mode == "aot_eager" and not ec.compiled_forwards(tr.model)
    tr.train()  # one epoch
    assert_compiled_and_used(tr)
    forwards = ec.compiled_forwards(tr.model)
    assert set(forwards) == {"text_encoder", "image_encoder"}  # CLIP's image tower too
    trained = {name: dict(f.first_calls) for name, f in forwards.items()}
    tr.test()
    assert {name: f.first_calls for name, f in forwards.items()} == trained  # evaluation: eager
    assert len(marks) >= len(tr.train_loader_x)  # a CUDA-graph step mark per training step
    monkeypatch.setattr(et, "resolve_compile", resolve)


def test_graphs_are_reused_by_the_next_run_in_the_process(tmp_path, dtd_root, deep_opts):
    """A second trainer (a packed grid worker's next run) with the same shapes compiles
    nothing: dynamo caches per code object, with the parameters as graph inputs."""
    import torch._dynamo

    torch._dynamo.reset()
    counts = []
    for seed in ("1", "2"):
        cfg = trainer_cfg("CoOp", tmp_path / seed, dtd_root, deep_opts, "aot_eager", "sample")
        cfg.defrost()
        cfg.SEED = int(seed)
        tr = build_trainer(cfg)
        before = ec.graph_count()
        train_steps(tr)
        assert_compiled_and_used(tr)
        counts.append(ec.graph_count() - before)
    assert counts[0] > 0 and counts[1] == 0, counts


def test_a_packed_worker_compiles_once_for_its_runs(
    tmp_path, dtd_root, tiny_clip_opts, monkeypatch
):
    """Two train.py runs in one process (a tools/grid.py worker): the second run's log shows
    its compiled calls checked against eager and no new graph; CUDA graphs (recorded for a
    run's parameters) are freed after each run without losing the compiled code."""
    import re

    import torch._dynamo
    import torch._inductor.cudagraph_trees as trees

    from engine.runner import run_in_process

    torch._dynamo.reset()
    resets = []
    reset = trees.reset_cudagraph_trees
    monkeypatch.setattr(trees, "reset_cudagraph_trees", lambda: resets.append(1) or reset())
    new_graphs = []
    for seed in ("1", "2"):
        out = tmp_path / f"seed{seed}"
        opts = ["MODEL.COMPILE", "aot_eager", "OPTIM.MAX_EPOCH", "1", "DATALOADER.NUM_WORKERS", "0"]
        assert run_in_process(coop_args(dtd_root, str(out), tiny_clip_opts, *opts, seed=seed)) == 0
        log = (out / "log.txt").read_text()
        found = re.findall(r"torch\.compile \(aot_eager\) .*: first call .* \((\d+) new graph", log)
        assert found and "output equal to eager" in log, log[-2000:]
        new_graphs.append(sum(map(int, found)))
    assert new_graphs[0] > 0 and new_graphs[1] == 0, new_graphs
    assert len(resets) == 2  # after each run


def test_a_failing_or_wrong_compiled_forward_falls_back_to_eager(caplog):
    lin = torch.nn.Linear(3, 2)
    x = torch.randn(5, 3)

    def wrong(*args):
        return lin(*args) + 1.0

    def broken(*args):
        raise RuntimeError("backend exploded")

    for fake, reason in ((wrong, "differs from eager"), (broken, "compilation failed")):
        fwd = ec.CompiledForward("toy", lin.forward, "aot_eager")
        fwd.compiled = fake
        with caplog.at_level(logging.WARNING, logger="engine.compile"):
            out = fwd(x)
        torch.testing.assert_close(out, lin(x))  # the eager result, with its graph
        assert out.requires_grad
        assert reason in fwd.fallback and reason in caplog.text
        assert fwd(x).equal(lin(x))  # eager from now on
    # a wrong replay (e.g. a CUDA graph reading a stale buffer) within the checked calls
    fwd = ec.CompiledForward("toy", lin.forward, "aot_eager")
    replies = iter([lin(x), lin(x) * 0])
    fwd.compiled = lambda *a: next(replies)
    assert fwd(x).equal(lin(x)) and fwd(x).equal(lin(x))
    assert "differs from eager" in fwd.fallback
    # a later failure (after the checked calls) also ends in eager
    fwd = ec.CompiledForward("toy", lin.forward, "aot_eager")
    for _ in range(ec.CHECKED_CALLS + 1):
        assert fwd(x).equal(lin(x)) and not fwd.fallback
    assert fwd.checks_left == {ec.signature((x,), {}): 0}
    fwd.compiled = broken
    assert fwd(x).equal(lin(x)) and "raised RuntimeError" in fwd.fallback


def test_outputs_disagree():
    y = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    assert ec.outputs_disagree(y + 1e-5, y) == ""
    assert "max |compiled - eager|" in ec.outputs_disagree(y + 0.1, y)
    assert "shape" in ec.outputs_disagree(y[:1], y)
    assert "non-finite" in ec.outputs_disagree(y.clone().fill_(float("nan")), y)
    assert "outputs" in ec.outputs_disagree((y, y), (y,))
    half = y.half()
    assert ec.outputs_disagree(half + 0.05, half) == ""  # fp16 rounding scale
    assert ec.outputs_disagree(half + 0.5, half) != ""


def test_eager_context_and_signature():
    calls = []
    fwd = ec.CompiledForward("toy", lambda x: x * 2, "aot_eager")
    fwd.compiled = lambda x: calls.append(x.shape) or x * 2
    fwd(torch.ones(4))
    with ec.eager():
        fwd(torch.ones(3))
    assert calls == [torch.Size([4])] and len(fwd.first_calls) == 1
    a = ec.signature((torch.ones(2, 3),), {})
    with torch.no_grad():
        assert ec.signature((torch.ones(2, 3),), {}) != a
    assert ec.signature((torch.ones(2, 4),), {}) != a


def test_bad_compile_value():
    with pytest.raises(ValueError, match="MODEL.COMPILE must be one of"):
        ec.check_compile_option("fast")
    cfg = make_cfg(["MODEL.COMPILE", "fast"])
    with pytest.raises(ValueError, match="MODEL.COMPILE must be one of"):
        ec.resolve_compile(cfg.MODEL.COMPILE, "cpu")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU code needs a C++ compiler")
def test_inductor_code_generation_matches_eager(tmp_path, dtd_root, deep_opts):
    """The GPU modes' compiler (inductor, generated kernels) on CPU: CoOp + SAMPLe."""
    results = {}
    for mode in ("off", "default"):
        tr = build_trainer(trainer_cfg("CoOp", tmp_path, dtd_root, deep_opts, mode, "sample"))
        losses = train_steps(tr)
        if mode != "off":
            assert_compiled_and_used(tr)
        results[mode] = (losses, learnable(tr))
    (l1, p1), (l2, p2) = results["off"], results["default"]
    assert l1 == pytest.approx(l2, rel=1e-4, abs=1e-5)
    for x, y in zip(p1, p2, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
