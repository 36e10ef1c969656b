"""ProGrad (trainers/prograd.py, optim/prograd.py): equal to the authors' code, the projection
by hand, its composition with the optimizers, the authors' keys and train.py end to end.

The reference numbers (``tests/reference/prograd.pt``) come from BeierZhu/Prompt-align at
commit 1b76203, run by ``tests/reference/make_prograd.py`` (its docstring lists the patches that
ran their code on a CPU) on the same tiny CLIP and inputs: one step of three cases (ProGrad's
template initialisation with a conflicting gradient, a random class-specific front context with
an aligned one, lambda 0.5 with a conflicting one).
"""

from __future__ import annotations

import math
import os.path as osp

import pytest
import torch
from conftest import ROOT, make_cfg
from helpers import train_in_process
from reference import make_prograd as ref

from engine import build_trainer
from engine.errors import ConfigError
from optim import SAM, build_optimizer
from optim.errors import OptimConfigError
from optim.prograd import ProGradProjection, guide_of, guided, project_conflicting
from optim.step import OptimizerStep, StepBatch

REFERENCE = osp.join(ROOT, "tests", "reference", "prograd.pt")
RTOL = 1e-5


def rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """``max |ours - theirs| / max |theirs|``."""
    theirs = torch.as_tensor(theirs).double()
    ours = torch.as_tensor(ours).double()
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return float((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The stored numbers and the tiny CLIP they were made with (rebuilt here, fingerprinted)."""
    data = torch.load(REFERENCE)
    cfg_path, ckpt, state = ref.tiny_clip_state(str(tmp_path_factory.mktemp("prograd_clip")))
    assert ref.clip_checksum(state) == pytest.approx(data["clip_checksum"], rel=1e-12), (
        "the tiny CLIP differs from the one of tests/reference/prograd.pt: regenerate it "
        "(tests/reference/make_prograd.py)"
    )
    return data, cfg_path, ckpt


def authors_options(case: dict) -> list[str]:
    """The case in the authors' keys (TRAINER.COOP.*, LOSS.*), read by the built-in trainer."""
    return [
        "DATASET.NAME", case["dataset"],
        "TRAINER.COOP.PREC", "fp32",
        "TRAINER.COOP.N_CTX", str(case["n_ctx"]),
        "TRAINER.COOP.CTX_INIT", str(case["ctx_init"]),
        "TRAINER.COOP.CSC", str(case["csc"]),
        "TRAINER.COOP.CLASS_TOKEN_POSITION", case["position"],
        "LOSS.NAME", "prograd", "LOSS.T", str(case["T"]), "LOSS.LAMBDA", str(case["lambda"]),
        "OPTIM.NAME", "sgd", "OPTIM.LR", str(ref.LR), "OPTIM.LR_SCHEDULER", "cosine",
    ]  # fmt: skip


def measure(name: str, data, cfg_path: str, ckpt: str) -> dict[str, float]:
    """One step of the project's ProGrad on the case ``name``: the relative difference of every
    recorded quantity to the authors'."""
    case, theirs = ref.CASES[name], data["cases"][name]
    opts = ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", cfg_path]
    opts += ["MODEL.BACKBONE.PATH", ckpt, "INPUT.SIZE", "(32, 32)", "MODEL.COMPILE", "off"]
    cfg = make_cfg([*opts, *authors_options(case)], trainer="ProGrad")
    trainer = build_trainer(cfg, classnames=ref.CLASSNAMES)
    model = trainer.model
    ctx = model.prompt_learner.ctx
    diffs = {}
    if case["ctx_init"]:  # ProGrad's template initialisation, not copied
        diffs["ctx0"] = rel_diff(ctx.detach(), theirs["ctx0"])
    with torch.no_grad():
        ctx.copy_(theirs["ctx0"])
    image, label = ref.inputs(), torch.tensor(case["labels"])
    with torch.no_grad():
        inputs = trainer.prepare_step((image, label))
    loss, summary = trainer.compute_loss(inputs)
    logits = trainer._pass_outputs.logits
    grad_ce = torch.autograd.grad(loss, ctx, retain_graph=True)[0]
    grad_kl = torch.autograd.grad(loss._prograd_guide, ctx)[0]
    diffs.update(
        logits=rel_diff(logits.detach(), theirs["logits"]),
        zs_logits=rel_diff(inputs[1], theirs["zs_logits"]),
        xe_loss=rel_diff(summary["xe_loss"], theirs["xe_loss"]),
        kl_loss=rel_diff(summary["kl_loss"], theirs["kl_loss"]),
        grad_ce=rel_diff(grad_ce, theirs["grad_ce"]),
        grad_kl=rel_diff(grad_kl, theirs["grad_kl"]),
    )
    trainer.batch_idx = 0
    out = trainer.forward_backward({"img": image, "label": label})  # the engine's real step
    assert float(out["loss"]) == pytest.approx(float(theirs["summary"]["xe_loss"]), rel=RTOL)
    diffs["grad_prograd"] = rel_diff(ctx.grad, theirs["grad_prograd"])
    diffs["ctx1"] = rel_diff(ctx.detach(), theirs["ctx1"])
    diffs["update"] = rel_diff(ctx.detach() - theirs["ctx0"], theirs["ctx1"] - theirs["ctx0"])
    assert trainer.optim_step.projection.conflicts == int(theirs["conflict"])
    return diffs


@pytest.mark.parametrize("name", list(ref.CASES))
def test_one_step_equals_the_authors_code(name, reference):
    data, cfg_path, ckpt = reference
    assert data["authors_commit"] == ref.AUTHORS_COMMIT
    diffs = measure(name, data, cfg_path, ckpt)
    assert all(d <= RTOL for d in diffs.values()), diffs


def test_the_reference_covers_both_branches():
    cases = torch.load(REFERENCE)["cases"]
    conflicts = {name: rec["conflict"] for name, rec in cases.items()}
    assert conflicts == {"template_end": True, "random_csc_front": False, "template_lambda": True}
    for name, rec in cases.items():  # the recorded step really projected (or did not)
        changed = not torch.allclose(rec["grad_prograd"], rec["grad_ce"])
        assert changed == rec["conflict"], name


# -- the projection by hand ---------------------------------------------------------------------
def test_conflicting_gradient_loses_its_component_against_the_guide():
    g, g_kl = torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 1.0])  # cos = -1/sqrt(2)
    out, conflicting = project_conflicting(g, g_kl, 1.0)
    assert conflicting and torch.allclose(out, torch.tensor([0.5, 0.5]))
    assert float(out @ g_kl) == pytest.approx(0.0, abs=1e-7)  # orthogonal to the guide
    half, _ = project_conflicting(g, g_kl, 0.5)  # half of the component -1/sqrt(2) u removed
    assert torch.allclose(half, torch.tensor([0.75, 0.25]))
    zero, _ = project_conflicting(g, g_kl, 0.0)
    assert torch.equal(zero, g)


def test_aligned_or_zero_guides_leave_the_gradient_unchanged():
    g = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    for guide in (torch.tensor([[1.0, 0.0], [0.0, 0.0]]), g * 3, torch.zeros(2, 2)):
        out, conflicting = project_conflicting(g, guide, 1.0)
        assert not conflicting and torch.equal(out, g)
    orthogonal = torch.tensor([[2.0, -1.0], [0.0, 0.0]])  # cos = 0: not a conflict
    assert not project_conflicting(g, orthogonal, 1.0)[1]


def test_projection_is_per_tensor_and_fills_grad():
    a = torch.zeros(2, requires_grad=True)
    b = torch.zeros(3, requires_grad=True)
    ce = a @ torch.tensor([1.0, 0.0]) + b @ torch.tensor([1.0, 1.0, 0.0])
    kl = a @ torch.tensor([-1.0, 1.0]) + b @ torch.tensor([0.0, 1.0, 5.0])  # a conflicts, b not
    rule = ProGradProjection(1.0)
    rule.backward(guided(ce, kl), [a, b])
    assert torch.allclose(a.grad, torch.tensor([0.5, 0.5]))
    assert torch.equal(b.grad, torch.tensor([1.0, 1.0, 0.0]))  # the CE gradient only
    assert rule.conflicts == 1
    with pytest.raises(OptimConfigError, match="needs the guide term"):
        rule.backward(ce.detach().requires_grad_(), [a])
    with pytest.raises(OptimConfigError, match="LAMBDA must be >= 0"):
        ProGradProjection(-0.1)


# -- composition with the optimizers -------------------------------------------------------------
def _quadratic(w, target, guide_dir):
    """CE stand-in ``0.5 ||w - target||^2`` guided by the linear ``guide_dir . w``."""
    return guided(0.5 * ((w - target) ** 2).sum(), guide_dir @ w)


def test_sam_projects_both_passes():
    """SAM with ProGrad: the ascent follows the projected gradient at w, the update the
    projected gradient at the perturbed point (docs/optimizers.md)."""
    target, guide_dir = torch.tensor([1.0, -2.0]), torch.tensor([1.0, -0.5])
    w0 = torch.tensor([0.3, 0.4])
    w = torch.nn.Parameter(w0.clone())
    rho, lr = 0.5, 0.1
    opt = SAM([w], base_optimizer=torch.optim.SGD, rho=rho, lr=lr)
    step = OptimizerStep([opt])
    step.set_projection(ProGradProjection(1.0))
    batch = StepBatch(lambda subset: (_quadratic(w, target, guide_dir), None))
    step.begin_step(batch, 0)
    step(_quadratic(w, target, guide_dir), lambda: _quadratic(w, target, guide_dir), 0, batch=batch)

    def projected(at):
        return project_conflicting(at - target, guide_dir, 1.0)[0]

    g = projected(w0)
    assert float(g @ guide_dir) == pytest.approx(0.0, abs=1e-6)  # it conflicted at w0
    e = rho * g / (g.norm() + 1e-12)
    expected = w0 - lr * projected(w0 + e)
    assert torch.allclose(w.detach(), expected, atol=1e-6)


@pytest.mark.parametrize("name", ["saf", "mesa"])
def test_optimizers_with_a_loss_term_of_their_own_are_refused(name):
    cfg = make_cfg(["OPTIM.NAME", "sgd", "OPTIM.SAM.NAME", name], trainer="ProGrad")
    opt = build_optimizer(cfg, torch.nn.Linear(2, 2))
    step = OptimizerStep([opt])
    with pytest.raises(OptimConfigError, match="adds a loss term of its own"):
        step.set_projection(ProGradProjection(1.0))


def test_esam_masked_is_refused_and_subset_accepted():
    for select, ok in (("masked", False), ("subset", True)):
        opts = ["OPTIM.NAME", "sgd", "OPTIM.SAM.NAME", "esam", "OPTIM.SAM.SELECT_PASS", select]
        opt = build_optimizer(make_cfg(opts, trainer="ProGrad"), torch.nn.Linear(2, 2))
        step = OptimizerStep([opt])
        if ok:
            step.set_projection(ProGradProjection(1.0))
        else:
            with pytest.raises(OptimConfigError, match="OPTIM.SAM.SELECT_PASS subset"):
                step.set_projection(ProGradProjection(1.0))


# -- the authors' keys and the release defaults --------------------------------------------------
def test_authors_keys_are_read_and_the_release_defaults_kept():
    cfg = make_cfg(
        ["TRAINER.COOP.CTX_INIT", "True", "LOSS.NAME", "prograd", "LOSS.LAMBDA", "0.8",
         "LOSS.GM", "False", "LOSS.ALPHA", "0.", "TRAINER.COOP.ALPHA", "1.0"],
        trainer="ProGrad",
    )  # fmt: skip
    node = cfg.TRAINER.PROGRAD
    assert (node.CTX_INIT, node.LAMBDA, node.T, node.LOSS, node.N_CTX) == (
        "template",
        0.8,
        1.0,
        "prograd",
        16,
    )
    assert make_cfg([], trainer="ProGrad").TRAINER.PROGRAD.LAMBDA == 1.0
    with pytest.raises(ConfigError, match="LOSS.LAMBDA.*ProGrad's layout.*--trainer ProGrad"):
        make_cfg(["LOSS.LAMBDA", "1.0"], trainer="CoOp")
    with pytest.raises(ConfigError, match="must be one of"):
        build_trainer(make_cfg(["LOSS.NAME", "other"], trainer="ProGrad"), classnames=["a"])


def test_published_configs_exist_for_every_protocol():
    from trainers.prograd import ProGrad

    for protocol, name in ProGrad.PROTOCOL_CFGS.items():
        path = osp.join(ROOT, "configs", "trainers", "ProGrad", f"{name}.yaml")
        assert osp.isfile(path), (protocol, path)
        cfg = make_cfg([], trainer="ProGrad", config_file=osp.relpath(path, ROOT))
        assert cfg.OPTIM.NAME == "sgd" and cfg.OPTIM.LR == 0.002
        assert cfg.TRAINER.PROGRAD.CTX_INIT == "template"
    few_shot = "configs/trainers/ProGrad/vit_b16_ctxv1.yaml"  # 8 and 16 shots
    assert make_cfg([], trainer="ProGrad", config_file=few_shot).OPTIM.MAX_EPOCH == 200


# -- train.py end to end ---------------------------------------------------------------------------
@pytest.mark.slow
def test_train_py_base_then_new_with_sample(tmp_path, dtd_root, tiny_clip_opts):
    out = tmp_path / "run"
    common = ["--root", dtd_root, "--trainer", "ProGrad", "--seed", "1"]
    common += ["--dataset-config-file", osp.join(ROOT, "configs/datasets/dtd.yaml")]
    opts = [*tiny_clip_opts, "TRAINER.PROGRAD.PREC", "fp32", "TRAINER.PROGRAD.N_CTX", "4"]
    opts += ["DATASET.NUM_SHOTS", "2", "OPTIM.MAX_EPOCH", "1", "OPTIM.NAME", "sgd"]
    train_in_process(
        [*common, "--output-dir", str(out), *opts, "OPTIM.SAM.NAME", "sample",
         "DATASET.SUBSAMPLE_CLASSES", "base"]
    )  # fmt: skip
    log = (out / "log.txt").read_text()
    assert "xe_loss" in log and "kl_loss" in log and "Finished training" in log
    new = tmp_path / "new"
    train_in_process(
        [*common, "--output-dir", str(new), "--model-dir", str(out), "--load-epoch", "1",
         "--eval-only", *opts, "DATASET.SUBSAMPLE_CLASSES", "new"]
    )  # fmt: skip
    accuracy = [line for line in (new / "log.txt").read_text().splitlines() if "accuracy" in line]
    assert accuracy and not math.isnan(float(accuracy[-1].split()[-1].rstrip("%")))


def test_the_authors_checkpoints_load_for_evaluation(reference, tmp_path):
    """Dassl's checkpoint of their prompt learner (``ctx`` with the class-dependent
    ``token_prefix``/``token_suffix`` of the training classes) loads for other classes."""
    _, cfg_path, ckpt = reference
    opts = ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", cfg_path, "MODEL.BACKBONE.PATH"]
    opts += [ckpt, "INPUT.SIZE", "(32, 32)", "TRAINER.PROGRAD.PREC", "fp32"]
    trainer = build_trainer(make_cfg(opts, trainer="ProGrad"), classnames=["a", "b"])
    ctx = torch.randn_like(trainer.model.prompt_learner.ctx)
    state = {
        "ctx": ctx,
        "token_prefix": torch.zeros(5, 1, 64),
        "token_suffix": torch.zeros(5, 60, 64),
    }
    folder = tmp_path / "model" / "prompt_learner"
    folder.mkdir(parents=True)
    torch.save({"state_dict": state, "epoch": 100}, folder / "model.pth.tar-100")
    trainer.load_model(str(tmp_path / "model"), epoch=100)
    assert torch.equal(trainer.model.prompt_learner.ctx.detach(), ctx)
    assert trainer.model.prompt_learner.token_prefix.shape[0] == 2  # this run's classes


def test_amp_scale_passes_through_and_data_parallel_is_refused():
    a = torch.zeros(2, requires_grad=True)
    ce = a @ torch.tensor([1.0, 0.0])
    kl = a @ torch.tensor([-1.0, 1.0])
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    ProGradProjection(1.0).backward(guided(ce, kl), [a], scaler)
    assert torch.allclose(a.grad, 8.0 * torch.tensor([0.5, 0.5]))  # scale x ProGrad's gradient
    step = OptimizerStep([torch.optim.SGD([a], lr=0.1)])
    step.grad_sync = object()  # as engine.distributed.attach sets it in a data-parallel run
    with pytest.raises(OptimConfigError, match="does not run data-parallel"):
        step.set_projection(ProGradProjection(1.0))


@pytest.mark.parametrize("mode", ["reduce-overhead", "aot_eager"])
def test_compile_modes_run_eagerly(reference, caplog, mode):
    _, cfg_path, ckpt = reference
    opts = ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", cfg_path, "MODEL.BACKBONE.PATH"]
    opts += [ckpt, "INPUT.SIZE", "(32, 32)", "TRAINER.PROGRAD.PREC", "fp32"]
    with caplog.at_level("INFO", logger="trainers.prograd"):
        cfg = make_cfg([*opts, "MODEL.COMPILE", mode], trainer="ProGrad")
        trainer = build_trainer(cfg, classnames=["a", "b"])
        assert trainer.compile_model() == []
    assert trainer.compiled_modules == [] and "encoders run eagerly" in caplog.text


# -- the small world (docs/trainers.md, "ProGrad on the small world") ---------------------------
SMALL_WORLD_CFG = "configs/trainers/ProGrad/small_world.yaml"


def _small_world_drift(opts: list[str], steps: int = 8) -> tuple[float, float, torch.Tensor]:
    """``steps`` SGD steps of ProGrad (``SMALL_WORLD_CFG`` and ``opts``; the shipped small CLIP)
    on rendered SmallWorld base images at the config's full learning rate: ``(context drift,
    largest |learned - zero-shot| initial logit, the first step's KL gradient)``."""
    import numpy as np

    import datasets.small_world as sw

    cfg = make_cfg(
        ["MODEL.COMPILE", "off", *opts],
        trainer="ProGrad",
        dataset_cfg="configs/datasets/small_world.yaml",
        config_file=SMALL_WORLD_CFG,
    )
    labels = np.repeat(np.arange(32), 2)  # two images of each base class
    images, _ = sw.render_batch(labels, np.random.default_rng(0), sw.HUE_SHIFT)
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    mean, std = (
        torch.tensor(v).view(1, 3, 1, 1) for v in (cfg.INPUT.PIXEL_MEAN, cfg.INPUT.PIXEL_STD)
    )
    x, y = (x - mean) / std, torch.from_numpy(labels)
    torch.manual_seed(0)
    trainer = build_trainer(cfg, classnames=sw.CLASSNAMES[:32])
    for group in trainer.optim.param_groups:  # past the warm-up epoch
        group["lr"] = cfg.OPTIM.LR
    ctx = trainer.model.prompt_learner.ctx
    start = ctx.detach().clone()
    with torch.no_grad():
        feats, zs_logits, _ = trainer.prepare_step((x, y))
        gap = float(
            (trainer.model.logits(feats, trainer.model.encode_text()) - zs_logits).abs().max()
        )
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1))
    trainer.epoch = 1
    for trainer.batch_idx in range(steps):
        i = order[(trainer.batch_idx * 32) % len(y) :][:32]
        if trainer.batch_idx == 0:
            inputs = trainer.prepare_step((x[i], y[i]))
            loss, _ = trainer.compute_loss(inputs)
            kl_grad = torch.autograd.grad(guide_of(loss), ctx)[0]
        trainer.forward_backward({"img": x[i], "label": y[i]})
    return float((ctx.detach() - start).norm()), gap, kl_grad


def test_small_world_config_moves_away_from_the_zero_shot_prompt():
    """The small world's ProGrad starts off the zero-shot prompt (N_CTX 16: 12 zero vectors
    before the template's 4 words), so the KL term has a gradient from the first step, and its
    projected steps move the context about as far as the same steps without the projection
    (LAMBDA 0: CoOp's step): 0.146 vs 0.151 here. With N_CTX 4 (the words filling every context
    vector) the learned logits were the zero-shot ones (difference 0, KL gradient 1e-8) and the
    projection held the context to 0.0033 (0.0095 without it); over 20 epochs ProGrad stayed at
    zero-shot accuracy (docs/trainers.md, "ProGrad on the small world")."""
    drift, gap, kl_grad = _small_world_drift([])
    assert gap > 0.1 and float(kl_grad.norm()) > 0.1, (gap, float(kl_grad.norm()))
    free, _, _ = _small_world_drift(["TRAINER.PROGRAD.LAMBDA", "0.0"])
    assert drift > 0.05 and drift > 0.5 * free, (drift, free)


def test_a_start_at_the_zero_shot_prompt_is_warned(reference, caplog):
    _, cfg_path, ckpt = reference
    opts = ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", cfg_path, "MODEL.BACKBONE.PATH"]
    opts += [ckpt, "INPUT.SIZE", "(32, 32)", "TRAINER.PROGRAD.PREC", "fp32"]
    opts += ["DATASET.NAME", "SmallWorld"]  # "a photo of a {}.": 4 words
    for n_ctx, warned in ((4, True), (16, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="trainers.prograd"):
            cfg = make_cfg([*opts, "TRAINER.PROGRAD.N_CTX", str(n_ctx)], trainer="ProGrad")
            build_trainer(cfg, classnames=["red circle", "blue square"])
        assert ("is the zero-shot prompt itself" in caplog.text) == warned, n_ctx
