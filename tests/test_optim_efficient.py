"""Tests of the cheaper sharpness-aware optimizers (docs/efficient-sharpness.md): LookSAM,
SAMPLe-k (OPTIM.SAM.EVERY), ESAM, RWP, m-RWP, SAF, MESA.

The registry drives the shared checks: every optimizer registered with ``efficient=True`` must
have a float64 hand computation here (``HAND``), which is compared over several steps with the
optimizer driven through the engine's step object (:class:`optim.step.OptimizerStep` with a
:class:`optim.step.StepBatch`), and must resume bit-identically from its state dict. The hand
computations use the closed-form gradient of a softmax classifier (no autograd), the same
random draws as the optimizer where it draws (a generator with the same seed), and plain loops.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from helpers import train_interrupted
from torch import nn

from engine.config import get_base_cfg_default
from optim import SAMPLe, build_optimizer, list_optimizers
from optim.build import OPTIMIZER_REGISTRY
from optim.errors import StepContractError
from optim.step import OptimizerStep, PassOutputs, StepBatch

F64 = torch.float64
SPECS = [s for s in list_optimizers("sharpness") if s.efficient]
NAMES = [s.name for s in SPECS]
LR, SEED = 0.1, 1234
# the items of each step's batch (dataset indices); one step per epoch, so SAF's records from
# E epochs back exist for some items only (epoch 1 sees items 4, 5 for the first time)
ITEMS = [[0, 1, 2, 3], [2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [1, 3, 5, 0], [0, 1, 2, 3, 4, 5]]
HP = {  # hyper-parameters of the hand computations (LookSAM and SAMPLe-k with small k)
    "looksam": dict(rho=0.3, every=3, look_alpha=0.7),
    "sample-k": dict(rho=0.3, alpha=0.05, lam=0.5, every=2, look_alpha=0.6),
    "esam": dict(rho=0.3, beta=0.6, gamma=0.5),
    "esam-masked": dict(rho=0.3, beta=0.6, gamma=0.5, select_pass="masked"),
    "esam-reference": dict(rho=0.3, beta=0.6, gamma=0.5, variant="reference"),
    "rwp": dict(noise=0.2),
    "mrwp": dict(noise=0.2, mix=0.7),
    "saf": dict(weight=0.3, temperature=2.0, start_epoch=0, epochs_back=1),
    "mesa": dict(weight=0.8, temperature=2.0, start_epoch=0, ema_decay=0.5),
}


class Problem:
    """A softmax classifier ``x W^T + b`` (W [3, 4], b [3]) on 6 fixed items, float64."""

    def __init__(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(6, 4, generator=gen, dtype=F64)
        self.y = torch.tensor([0, 1, 2, 0, 1, 2])
        self.W = nn.Parameter(torch.randn(3, 4, generator=gen, dtype=F64) * 0.7)
        self.b = nn.Parameter(torch.randn(3, generator=gen, dtype=F64) * 0.2)
        self.items = torch.tensor(ITEMS[0])
        self.passes = []  # the items of every pass with gradients

    @property
    def params(self):
        return [self.W, self.b]

    def forward(self, subset=None):
        items = self.items if subset is None else self.items[subset]
        if torch.is_grad_enabled():
            self.passes.append(items.tolist())
        logits = self.x[items] @ self.W.T + self.b
        loss = F.cross_entropy(logits, self.y[items])
        return loss, PassOutputs(logits, self.y[items], loss)

    def step(self, step: OptimizerStep, t: int) -> dict:
        """Step ``t`` (= its epoch) as the engine takes it."""
        self.items = torch.tensor(ITEMS[t % len(ITEMS)])
        batch = StepBatch(self.forward, self.items.clone())
        step.begin_step(batch, t)
        loss, batch.first = self.forward()
        return step(loss, lambda: self.forward()[0], t, batch=batch)


def build(name: str, prob: Problem, momentum: float = 0.0):
    base = {"sample-k": "sample", "esam-masked": "esam", "esam-reference": "esam"}
    spec = OPTIMIZER_REGISTRY.get(base.get(name, name))
    return spec.cls(prob.params, lr=LR, momentum=momentum, **HP[name])


# ------------------------------------------------------------------ the hand computations
def softmax(z):
    e = (z - z.max(-1, keepdim=True).values).exp()
    return e / e.sum(-1, keepdim=True)


def logits(th, items):
    W, b = th
    return H.x[items] @ W.T + b


def ce_items(th, items):
    """Per-item cross-entropy."""
    z = logits(th, items)
    return -(softmax(z)[torch.arange(len(items)), H.y[items]]).log()


def grad(th, items, dz_extra=None):
    """Closed-form gradient of the mean cross-entropy (plus an extra d/dlogits)."""
    z = logits(th, items)
    onehot = F.one_hot(H.y[items], 3).to(F64)
    dz = (softmax(z) - onehot) / len(items)
    if dz_extra is not None:
        dz = dz + dz_extra
    return [dz.T @ H.x[items], dz.sum(0)]


def norm(v):
    return sum((t * t).sum() for t in v).sqrt()


def dot(a, b):
    return sum((s * t).sum() for s, t in zip(a, b))


def axpy(a, b, s=1.0):
    return [x + s * y for x, y in zip(a, b)]


def scale(a, s):
    return [s * x for x in a]


def kl_dz(z, target, tau, weight, valid):
    """d/dz of ``weight * tau^2 * mean_valid KL(softmax(target/tau) || softmax(z/tau))``."""
    q, p = softmax(z / tau), softmax(target / tau)
    n = max(int(valid.sum()), 1)
    return weight * tau * (q - p) * valid[:, None] / n


def filter_noise(w, noise, gen):
    if w.dim() >= 2:
        std = w.flatten(1).norm(dim=1).view(-1, 1)
    else:
        std = w.norm() + 1e-16
    return torch.randn(w.shape, generator=gen, dtype=F64) * (std * noise)


def hand(name: str, steps: int) -> list[list[torch.Tensor]]:
    """The parameters after each step, from the equations of each optimizer's docstring."""
    hp = HP[name]
    th = [H.W0.clone(), H.b0.clone()]
    gen = torch.Generator().manual_seed(SEED)
    g_v, m, ema, records, out = None, None, None, {}, []
    for t in range(steps):
        items = torch.tensor(ITEMS[t % len(ITEMS)])
        if name in ("looksam", "sample-k"):
            g = grad(th, items)
            n = norm(g)
            if t % hp["every"] == 0:
                if name == "looksam":
                    e = scale(g, hp["rho"] / (n + 1e-12))
                else:  # SAMPLe, paper variant: m, xi, sigma, g_B
                    m = axpy(scale(m or [0 * x for x in g], hp["lam"]), g, 1 - hp["lam"])
                    g_b = axpy(g, m, -dot(m, g) / dot(m, m))
                    e = axpy(scale(g, hp["rho"] / (n + 1e-12)), g_b, -hp["alpha"])
                g_p = grad(axpy(th, e), items)
                g_v = axpy(g_p, g, -dot(g_p, g) / (n * n))
            else:
                g_p = axpy(g, g_v, hp["look_alpha"] * n / norm(g_v))
            u = g_p if name == "looksam" else axpy(g, g_p)  # SAMPLe paper: g + g_p
        elif name in ("esam", "esam-masked", "esam-reference"):
            g = grad(th, items)
            masks = [torch.rand(x.shape, generator=gen) < hp["beta"] for x in th]
            g_s = [mk * gi for mk, gi in zip(masks, g)]  # the perturbed coordinates' gradient
            if name == "esam-reference":  # the authors' Esam.py: ||g_S||, guard 1e-7
                e = scale(g_s, hp["rho"] / hp["beta"] / (norm(g_s) + 1e-7))
            else:  # the paper: the full gradient's norm
                e = scale(g_s, hp["rho"] / hp["beta"] / (norm(g) + 1e-12))
            pert = axpy(th, e)
            rise = ce_items(pert, items) - ce_items(th, items)
            k = max(1, int(len(items) * hp["gamma"]))
            chosen = sorted(sorted(range(len(items)), key=lambda i: -float(rise[i]))[:k])
            u = grad(pert, items[chosen])
        elif name == "rwp":
            eps = [filter_noise(x, hp["noise"], gen) for x in th]
            u = grad(axpy(th, eps), items)
        elif name == "mrwp":
            g = grad(th, items)
            eps = [filter_noise(x, hp["noise"], gen) for x in th]
            u = axpy(scale(grad(axpy(th, eps), items), hp["mix"]), g, 1 - hp["mix"])
        elif name == "saf":
            z = logits(th, items)
            back = t - hp["epochs_back"]
            dz = None
            if t > hp["start_epoch"] and back >= 0:
                valid = torch.tensor(
                    [float(records.get((int(i), back)) is not None) for i in items]
                )
                target = torch.stack(
                    [records.get((int(i), back), torch.zeros(3, dtype=F64)) for i in items]
                )
                dz = kl_dz(z, target, hp["temperature"], hp["weight"], valid)
            for i, zi in zip(items, z):
                records[(int(i), t)] = zi.clone()
            u = grad(th, items, dz)
        else:  # mesa
            ema = ema or [x.clone() for x in th]
            dz = None
            if t > hp["start_epoch"]:
                z, z_ema = logits(th, items), logits(ema, items)
                dz = kl_dz(z, z_ema, hp["temperature"], hp["weight"], torch.ones(len(items)))
            u = grad(th, items, dz)
        th = axpy(th, u, -LR)
        if name == "mesa":
            ema = [hp["ema_decay"] * w + (1 - hp["ema_decay"]) * x for w, x in zip(ema, th)]
        out.append([x.clone() for x in th])
    return out


H = Problem()
H.W0, H.b0 = H.W.detach().clone(), H.b.detach().clone()


def run(name: str, steps: int, start: int = 0, prob=None, opt=None, momentum=0.0):
    torch.manual_seed(SEED)  # the optimizer's generator is seeded from torch.initial_seed()
    prob = prob or Problem()
    opt = opt or build(name, prob, momentum)
    step = OptimizerStep([opt])
    out, stats = [], []
    for t in range(start, start + steps):
        stats.append(prob.step(step, t))
        out.append([p.detach().clone() for p in prob.params])
    return prob, opt, out, stats


# ------------------------------------------------------------------------- shared checks
def test_every_efficient_optimizer_has_a_hand_derivation():
    assert {"looksam", "esam", "rwp", "mrwp", "saf", "mesa"} <= set(NAMES)
    missing = sorted(set(NAMES) - set(HP))
    assert not missing, f"write a hand computation of {missing} in hand() ({__file__})"
    for spec in SPECS:
        assert spec.kind == "sharpness" and spec.test_kwargs and spec.description


@pytest.mark.parametrize("name", [*NAMES, "sample-k", "esam-masked", "esam-reference"])
def test_float64_matches_hand_computation(name):
    steps = 5
    expected = hand(name, steps)
    prob, opt, got, stats = run(name, steps)
    for t, (e_step, g_step) in enumerate(zip(expected, got)):
        for e, g in zip(e_step, g_step):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-13, msg=f"{name} step {t}")
    assert opt.num_steps == steps
    assert all(p.dtype == F64 for p in prob.params)
    for s in opt.state.values():  # the state is float64 too (no silent narrowing)
        assert all(v.dtype == F64 for v in s.values() if torch.is_tensor(v))
    assert all("grad_norm" in s for s in stats)


@pytest.mark.parametrize("name", [*NAMES, "sample-k"])
def test_resume_is_bit_identical(name):
    _, _, full, _ = run(name, 5, momentum=0.9)
    prob, opt, _, _ = run(name, 2, momentum=0.9)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in prob.params], "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    ckpt = torch.load(buffer, weights_only=True)
    assert ckpt["optim"]["state"], "the base optimizer's momentum must be saved"
    torch.manual_seed(99)  # another global seed: the generator state must come from the dict
    prob2 = Problem()
    with torch.no_grad():
        for p, v in zip(prob2.params, ckpt["params"]):
            p.copy_(v)
    opt2 = build(name, prob2, 0.9)
    opt2.load_state_dict(ckpt["optim"])
    step = OptimizerStep([opt2])
    for t in range(2, 5):
        prob2.step(step, t)
    for p, q in zip(full[-1], prob2.params):
        assert torch.equal(p, q)


# ------------------------------------------------------------------ lookahead (LookSAM, SAMPLe)
def test_looksam_ascent_on_steps_t_mod_k_zero_the_first_included():
    prob, opt, _, stats = run("looksam", 7)
    second = ["gv_norm" in s and "grad_p_norm" in s for s in stats]
    assert second == [True, False, False, True, False, False, True]
    assert len(prob.passes) == 7 + 3  # one pass per step, a second one on the 3 ascents
    assert build_optimizer_every("looksam", 0) == 5 and build_optimizer_every("looksam", 2) == 2


def build_optimizer_every(name: str, every: int) -> int:
    cfg = get_base_cfg_default()
    cfg.OPTIM.SAM.NAME, cfg.OPTIM.SAM.EVERY = name, every
    return build_optimizer(cfg, [nn.Parameter(torch.zeros(2))]).every


def test_sample_every_one_is_sample_bit_for_bit():
    """SAMPLe-k with k = 1 (and the config default EVERY 0) is SAMPLe: parameters, moving
    averages and whole state dicts equal over several steps, both variants, with momentum."""
    assert build_optimizer_every("sample", 0) == 1 and build_optimizer_every("sample", 1) == 1
    for variant in ("paper", "reference"):
        runs = []
        for kw in ({}, {"every": 1}):
            prob = Problem()
            opt = SAMPLe(prob.params, lr=LR, momentum=0.9, variant=variant, rho=0.3, **kw)
            step = OptimizerStep([opt])
            for t in range(4):
                prob.step(step, t)
            runs.append((prob, opt, len(prob.passes)))
        (p1, o1, n1), (p2, o2, n2) = runs
        assert n1 == n2 == 8  # two passes every step
        for a, b in zip(p1.params, p2.params):
            assert torch.equal(a, b)
        s1, s2 = o1.state_dict(), o2.state_dict()
        assert s1["sharpness"]["num_steps"] == s2["sharpness"]["num_steps"] == 4
        for i, st in s1["sharpness"]["state"].items():
            assert set(st) == {"ema"} and torch.equal(st["ema"], s2["sharpness"]["state"][i]["ema"])
        for i, st in s1["state"].items():
            assert torch.equal(st["momentum_buffer"], s2["state"][i]["momentum_buffer"])


def test_steps_between_ascents_take_one_pass_through_the_step_object():
    prob, opt, _, _ = run("sample-k", 4)
    assert [len(p) for p in prob.passes] == [4, 4, 4, 6, 6, 4]  # steps 0 and 2: two passes


# ------------------------------------------------------------------------ ESAM, RWP, SAF
def test_esam_second_pass_on_the_selected_items_only():
    prob, opt, _, stats = run("esam", 3)
    # per step: the first pass on the batch, then the second on floor(0.5 * B) items
    assert [len(p) for p in prob.passes] == [4, 2, 4, 2, 6, 3]
    assert all(s["selected"] == 0.5 for s in stats)
    assert all(0 < s["perturbed"] < 1 for s in stats)
    prob, opt, _, stats = run("esam-masked", 3)  # one pass with gradients on the whole batch
    assert [len(p) for p in prob.passes] == [4, 4, 4, 4, 6, 6]
    assert all(s["selected"] == 0.5 for s in stats)


def test_esam_gamma_one_is_sam_with_masked_perturbation():
    prob = Problem()
    opt = OPTIMIZER_REGISTRY.get("esam").cls(prob.params, lr=LR, rho=0.3, beta=1.0, gamma=1.0)
    ref = Problem()
    sam = OPTIMIZER_REGISTRY.get("sam").cls(ref.params, lr=LR, rho=0.3)
    step, step_ref = OptimizerStep([opt]), OptimizerStep([sam])
    for t in range(3):
        prob.step(step, t)
        ref.step(step_ref, t)
    for a, b in zip(prob.params, ref.params):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-15)


def test_rwp_noise_is_per_filter_of_a_prompt():
    from optim.rwp import filter_noise as noise_of

    ctx = torch.zeros(4, 8, dtype=F64)
    ctx[1] = 10.0  # one context vector with a large norm, the others zero
    eps = noise_of(ctx, 0.1, torch.Generator().manual_seed(0))
    assert eps[0].abs().max() == 0 and eps[1].abs().max() > 0  # std 0.1 * ||row||
    assert noise_of(torch.zeros(3, dtype=F64), 0.1, torch.Generator()).abs().max() < 1e-15


def test_saf_records_are_keyed_by_item_and_saved():
    prob, opt, _, stats = run("saf", 3)
    assert "traj_loss" not in stats[0] and "traj_loss" in stats[1]  # after start_epoch 0
    assert opt.records.shape == (6, 2, 3)
    assert opt.record_epoch[:, 2 % 2].tolist() == [2] * 6  # epoch 2 saw every item
    sd = opt.state_dict()["sharpness"]["extra"]
    assert torch.equal(sd["records"], opt.records)


def test_trajectory_optimizers_need_the_trainers_logits():
    prob = Problem()
    opt = OPTIMIZER_REGISTRY.get("saf").cls(prob.params, lr=LR)
    step = OptimizerStep([opt])
    batch = StepBatch(lambda subset=None: (prob.forward(subset)[0], None), prob.items)
    step.begin_step(batch, 0)
    loss = prob.forward()[0]
    with pytest.raises(StepContractError, match="classification_loss"):
        step(loss, None, 0, batch=batch)


@pytest.mark.parametrize(
    "name,kwargs,word",
    [
        ("looksam", {"every": -1}, "every"),
        ("esam", {"beta": 0.0}, "beta"),
        ("esam", {"gamma": 1.5}, "gamma"),
        ("rwp", {"noise": -1.0}, "noise"),
        ("mrwp", {"mix": 2.0}, "mix"),
        ("saf", {"epochs_back": 0}, "epochs_back"),
        ("mesa", {"ema_decay": 1.0}, "ema_decay"),
        ("saf", {"temperature": 0.0}, "temperature"),
    ],
)
def test_invalid_values_raise(name, kwargs, word):
    with pytest.raises(ValueError, match=word):
        OPTIMIZER_REGISTRY.get(name).cls([nn.Parameter(torch.zeros(2))], lr=0.1, **kwargs)


# ---------------------------------------------------------------- through a trainer (the engine)
def _coop(tmp_path, dtd_root, tiny_clip_opts, name, *opts):
    from conftest import make_cfg

    from engine import build_trainer

    cfg = make_cfg(
        [
            "--root",
            dtd_root,
            "--seed",
            "1",
            "--output-dir",
            str(tmp_path),
            *tiny_clip_opts,
            "TRAINER.COOP.PREC",
            "fp32",
            "OPTIM.SAM.NAME",
            name,
            "DATASET.NUM_SHOTS",
            "2",
            "DATALOADER.TRAIN_X.BATCH_SIZE",
            "4",
            "TEST.NO_TEST",
            "True",
            *opts,
        ]
    )
    return build_trainer(cfg)


def test_esam_selects_items_of_a_trainers_batch(tmp_path, dtd_root, tiny_clip_opts):
    tr = _coop(tmp_path, dtd_root, tiny_clip_opts, "esam", "OPTIM.SAM.GAMMA", "0.5")
    calls = []
    compute_loss = tr.compute_loss

    def recording(inputs):
        calls.append((len(inputs[1]), torch.is_grad_enabled()))
        return compute_loss(inputs)

    tr.compute_loss = recording
    tr.set_model_mode("train")
    tr.batch_idx = 0
    out = tr.forward_backward(next(iter(tr.train_loader_x)))
    # first pass; the no-grad forward at theta + e; the second pass on the 2 sharpest items
    assert calls == [(4, True), (4, False), (2, True)]
    assert out["selected"] == 0.5
    tr.optim.select_pass = "masked"
    calls.clear()
    tr.forward_backward(next(iter(tr.train_loader_x)))
    assert calls == [(4, True), (4, True)]


def test_select_inputs_default_and_per_class_entries():
    from engine.registry import TRAINER_REGISTRY
    from engine.trainer import TrainerX

    feats, label, subset = torch.arange(8.0).view(4, 2), torch.arange(4), torch.tensor([1, 3])
    got = TrainerX.select_inputs(None, (feats, label, 7), subset, 4)
    assert torch.equal(got[0], feats[subset]) and torch.equal(got[1], label[subset])
    assert got[2] == 7
    per_class = torch.ones(4, 2)  # 4 classes in a batch of 4: not per item
    inputs = {"image": feats, "label": label, "image_teacher": feats, "text_teacher": per_class}
    got = TRAINER_REGISTRY.get("CoPrompt").select_inputs(None, inputs, subset, 4)
    assert got["text_teacher"] is per_class and torch.equal(got["image"], feats[subset])


@pytest.mark.parametrize("name", ["saf", "rwp"])
def test_trainer_resume_is_bit_identical(name, tmp_path, dtd_root, tiny_clip_opts):
    """The recorded outputs (SAF) and the generator (RWP) travel in the checkpoint."""
    opts = ("OPTIM.MAX_EPOCH", "3", "OPTIM.SAM.TRAJ_START", "0", "OPTIM.SAM.EPOCHS_BACK", "1")
    full = _coop(tmp_path / "a", dtd_root, tiny_clip_opts, name, *opts)
    full.train()
    part = _coop(tmp_path / "b", dtd_root, tiny_clip_opts, name, *opts)
    train_interrupted(part, epoch=2)  # the run stops when epoch 3 starts (epochs 1-2 saved)
    resumed = _coop(tmp_path / "b", dtd_root, tiny_clip_opts, name, *opts)
    resumed.train()
    assert resumed.start_epoch == 2
    a = full.model.prompt_learner.state_dict()
    b = resumed.model.prompt_learner.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    if name == "saf":
        assert torch.equal(full.optim.records, resumed.optim.records)
    # every run records its cost (engine.cost); a resumed one adds its segment
    from engine.cost import read_cost

    a, b = read_cost(full.output_dir), read_cost(resumed.output_dir)
    n = len(full.train_loader_x)
    assert a["optimizer"] == name and a["steps"] == 3 * n and a["device"] == "cpu"
    assert a["train_time_s"] > 0 and a["mean_step_s"] == a["train_time_s"] / a["steps"]
    assert a["peak_cpu_rss_mb"] > 10 and a["peak_cuda_mb"] is None
    assert [s["epochs"] for s in b["segments"]] == [[0, 1], [2, 2]] and b["steps"] == 3 * n
    assert b["train_time_s"] == sum(s["train_time_s"] for s in b["segments"])


def test_every_trainer_folder_has_a_config_of_each_efficient_optimizer():
    import glob
    import os.path as osp

    from conftest import ROOT, make_cfg

    folders = sorted(glob.glob(osp.join(ROOT, "configs", "optim", "*", "sam.yaml")))
    assert len(folders) >= 8
    for sam in folders:
        folder = osp.dirname(sam)
        rho = make_cfg(["--optim-config-file", sam]).OPTIM.SAM.RHO
        for name in [*NAMES, "sample_k5"]:
            cfg = make_cfg(["--optim-config-file", osp.join(folder, f"{name}.yaml")]).OPTIM.SAM
            assert cfg.NAME == ("sample" if name == "sample_k5" else name)
            if name in ("looksam", "esam"):  # the trainer's SAM radius
                assert cfg.RHO == rho
            if name == "esam":  # the cheaper schedule (CoCoOp: per-image text features)
                # DePT: its loss is not one cross-entropy (trainers/dept.py refuses "masked")
                own = osp.basename(folder)
                want = "subset" if own == "CoCoOp" or own.startswith("DePT_") else "masked"
                assert cfg.SELECT_PASS == want
            if name in ("looksam", "sample_k5"):
                assert (cfg.EVERY, cfg.LOOK_ALPHA) == (5, 0.7)
            if name == "saf":
                assert (cfg.TRAJ_WEIGHT, cfg.TEMPERATURE) == (0.3, 5.0)
                assert 1 <= cfg.EPOCHS_BACK <= cfg.TRAJ_START + 1  # records at the first KL epoch
            if name == "mesa":
                assert (cfg.TRAJ_WEIGHT, cfg.EMA_DECAY) == (0.8, 0.9998)


def test_grid_runs_every_efficient_optimizer(tmp_path):
    from experiments import grid_plan
    from experiments.protocols import Setup
    from tools import grid

    grids = grid_plan.select("efficient-base2new", trainers=["CoOp"], datasets=["dtd"], seeds=[1])
    chains = grid_plan.expand(grids, Setup(output=str(tmp_path)))
    files = {c.train.optim_file for c in chains}
    for name in [*NAMES, "sample_k5"]:
        assert f"configs/optim/CoOp/{name}.yaml" in files
    assert (
        grid.main(
            [
                "--trainers",
                "CoOp",
                "--optims",
                *NAMES,
                "--dry-run",
                "--datasets",
                "dtd",
                "--seeds",
                "1",
                "--output",
                str(tmp_path),
            ]
        )
        == 0
    )


@pytest.mark.parametrize(
    "key,value",
    [("EVERY", "-1"), ("BETA", "0.0"), ("GAMMA", "1.5"), ("MIX", "-0.1"), ("EPOCHS_BACK", "0")],
)
def test_bad_config_values_name_the_key(key, value):
    from conftest import make_cfg

    from engine.errors import ConfigError
    from engine.validate import validate_cfg

    with pytest.raises(ConfigError, match=f"OPTIM.SAM.{key} must be"):
        validate_cfg(make_cfg([f"OPTIM.SAM.{key}", value]))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["esam", "mesa", "rwp", "looksam"])
def test_compiled_steps_match_eager(name, tmp_path, dtd_root, deep_opts):
    """The optimizers' extra passes (a subset, a pass without gradients, weights perturbed
    before the forward) with compiled encoders (aot_eager): the same steps as eagerly, and no
    new graph after the first step."""
    from test_compile import assert_compiled_and_used, learnable, train_steps, trainer_cfg

    from engine import build_trainer

    results = {}
    for mode in ("off", "aot_eager"):
        cfg = trainer_cfg("MaPLe", tmp_path / mode, dtd_root, deep_opts, mode, name)
        tr = build_trainer(cfg)
        losses = train_steps(tr)
        if mode != "off":
            assert_compiled_and_used(tr)
        results[mode] = (losses, learnable(tr))
        tr.close_writer()
    (l1, p1), (l2, p2) = results["off"], results["aot_eager"]
    assert l1 == pytest.approx(l2, rel=1e-5, abs=1e-6)
    for x, y in zip(p1, p2, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_recorded_outputs_keep_the_trainers_label_smoothing():
    # a trainer whose cross-entropy is label-smoothed records it: the per-item losses the
    # optimizers read (ESAM's selection, its masked pass) are the items of that same loss
    import torch.nn.functional as F

    from optim.step import PassOutputs

    g = torch.Generator().manual_seed(0)
    logits, label = torch.randn(6, 4, generator=g), torch.tensor([0, 1, 2, 3, 0, 1])
    ce = F.cross_entropy(logits, label, label_smoothing=0.2)
    items = PassOutputs(logits, label, ce, 0.2).sample_loss()
    torch.testing.assert_close(items.mean(), ce)
    assert not torch.allclose(items, PassOutputs(logits, label, ce).sample_loss())
