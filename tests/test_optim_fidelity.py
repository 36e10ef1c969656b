"""Fidelity of the sharpness-aware optimizers to the equations and to the released code.

- Every registered sharpness-aware optimizer, in every variant it accepts and with every
  update rule, runs 3 steps in float64 on three tensors of different shapes (2-D, 3-D, 1-D)
  and is compared with a float64 computation written here from the equations (paper
  variants) or from the released code's order of operations (reference variants: the SAMPLe
  authors' loop that updates the averages tensor by tensor while it computes ``||m||``).
- The reference variants round as the released code in fp32 (the perturbed point and the update
  bit for bit, restoring from a copy).
- The update gradient: hand-derived numbers for ``g + g_p`` and ``0.5 g + 0.5 g_p``, the config
  key, and every ``configs/optim`` file of SAGM/SAMPLe setting it explicitly.
"""

from __future__ import annotations

import glob
import os.path as osp

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from engine.config import get_base_cfg_default
from optim import SAGM, SAM, SAMPLe
from optim.build import OPTIMIZER_REGISTRY, build_optimizer, list_optimizers

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
# the cheaper members (``efficient``: second pass skipped or none) have their own suite,
# tests/test_optim_efficient.py
SPECS = [s for s in list_optimizers("sharpness") if not s.efficient]
SHAPES = [(3, 4), (2, 3, 2), (5,)]  # a prompt-like matrix, a 3-D tensor, a vector
RHO, ALPHA, LAM, SIGMA, LR = 0.3, 0.08, 0.4, 0.7, 0.05
HP = {"rho": RHO, "alpha": ALPHA, "lam": LAM, "sigma": SIGMA}
STEPS = 3


# ------------------------------------------------------------------------- the problem
class Problem:
    """``L = 0.5 * theta^T H theta + b^T theta + 0.1 * sum(theta^3)`` over the concatenation of
    three tensors: every tensor's gradient depends on the others."""

    def __init__(self, dtype=torch.float64, seed=0):
        gen = torch.Generator().manual_seed(seed)
        n = sum(torch.Size(s).numel() for s in SHAPES)
        a = torch.randn(n, n, generator=gen, dtype=torch.float64)
        self.h = (a @ a.T / n + 0.5 * torch.eye(n, dtype=torch.float64)).to(dtype)
        self.b = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
        self.init = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in SHAPES]

    def loss(self, params):
        th = torch.cat([p.flatten() for p in params])
        return 0.5 * th @ self.h @ th + self.b @ th + 0.1 * (th**3).sum()

    def grads(self, params):
        """The gradient by hand: H theta + b + 0.3 theta^2, split into the tensors."""
        th = torch.cat([p.flatten() for p in params])
        flat = self.h @ th + self.b + 0.3 * th**2
        pieces = torch.split(flat, [p.numel() for p in params])
        return [piece.reshape(p.shape) for piece, p in zip(pieces, params)]


def norm(ts):
    return torch.sqrt(sum((t * t).sum() for t in ts))


def dot(a, b):
    return sum((x * y).sum() for x, y in zip(a, b))


# ------------------------------------------------------------- the hand computations
# Each takes the state (a dict kept across steps), theta and g (lists of tensors) and returns
# the perturbation e and the update rule's default; the driver forms g_p and the SGD step.
def hand_sam(state, th, g, variant, adaptive=False):
    if adaptive:
        n = norm([t.abs() * gi for t, gi in zip(th, g)])
        return [(t * t * gi) * (RHO / (n + 1e-12)) for t, gi in zip(th, g)], "perturbed"
    return [gi * (RHO / (norm(g) + 1e-12)) for gi in g], "perturbed"


def hand_fsam(state, th, g, variant):
    if variant == "paper":  # m_t = lam m + (1 - lam) g from m_0 = 0; d = g - sigma m_t
        m = [LAM * mi + (1 - LAM) * gi for mi, gi in zip(state.get("m", [0.0] * len(g)), g)]
        d = [gi - SIGMA * mi for gi, mi in zip(g, m)]
    elif "m" not in state:  # reference, first step: m = g, d = g
        m, d = [gi.clone() for gi in g], g
    else:  # reference: d with the old average (in place on the gradient), then update it
        d = [gi - mi * SIGMA for gi, mi in zip(g, state["m"])]
        m = [mi * LAM + gi * (1 - LAM) for mi, gi in zip(state["m"], g)]
    state["m"] = m
    return [di * (RHO / (norm(d) + 1e-12)) for di in d], "perturbed"


def hand_sagm(state, th, g, variant):
    return [gi * (RHO / (norm(g) + 1e-12) - ALPHA) for gi in g], {
        "paper": "sum",
        "reference": "mean",
    }[variant]


def released_row_cosine(m, g):
    """``F.cosine_similarity(m, g, dim=1)[:, None]`` as in the released code; a 1-D tensor (on
    which the released code crashes) is one row."""
    if g.dim() < 2:
        return F.cosine_similarity(m.reshape(1, -1), g.reshape(1, -1), dim=1).reshape(())
    return F.cosine_similarity(m, g, dim=1)[:, None]


def released_sample_perturbation(state, g, rho=RHO, alpha=ALPHA, lam=LAM, mixed=True):
    """The released SAMPLe optimizer's first pass, loop for loop: for each tensor (in parameter
    order) with a gradient, update its average in place and only then compute ||m|| from the
    averages as they are now. ``state`` maps tensor index -> average; ``g`` holds None for a
    tensor without a gradient. ``mixed=False``: the norm of the new averages (the old rule)."""
    have = [k for k, gi in enumerate(g) if gi is not None]
    grad_norm_raw = norm([g[k] for k in have])
    e = {}
    new = {k: (state[k] * lam + (1 - lam) * g[k]) if k in state else g[k] for k in have}
    for k in have:
        if k not in state:  # first branch: full_grad = g, SAM_pert = rho / ||g|| * g
            state[k] = g[k].clone()
            e[k] = rho / grad_norm_raw * g[k]
            continue
        state[k] = state[k].mul(lam).add((1 - lam) * g[k])  # in place in the released loop
        n = grad_norm_raw + 1e-10
        averages = [state[j] for j in have] if mixed else [new[j] for j in have]
        n_m = norm(averages) + 1e-10  # the averages as they are at this point of the loop
        non_sam = alpha * (g[k] - released_row_cosine(state[k], g[k]) * (n / n_m) * state[k])
        e[k] = rho / n * g[k] - non_sam
    return e


def hand_sample(state, th, g, variant):
    if variant == "reference":
        e = released_sample_perturbation(state, g)
        return [e[k] for k in range(len(g))], "mean"
    if variant == "reference-cocoop":  # released CoCoOp copy: no average, no exploration
        return [RHO / norm(g) * gi - ALPHA * gi for gi in g], "mean"
    m = [LAM * mi + (1 - LAM) * gi for mi, gi in zip(state.get("m", [0.0] * len(g)), g)]
    state["m"] = m
    n, n_m = norm(g), norm(m)
    xi, sigma = dot(m, g) / (n * n_m), n / n_m
    g_b = [gi - xi * sigma * mi for gi, mi in zip(g, m)]
    return [RHO * gi / (n + 1e-12) - ALPHA * gbi for gi, gbi in zip(g, g_b)], "sum"


HAND = {"sam": hand_sam, "fsam": hand_fsam, "sagm": hand_sagm, "sample": hand_sample}
KEYS = {"sam": ("rho",), "fsam": ("rho", "lam", "sigma"), "sagm": ("rho", "alpha")}


def hand_trajectory(name, variant, update, prob, steps=STEPS, **extra):
    """Theta after each step: the hand perturbation, g_p at theta + e, plain SGD with lr LR."""
    th, state, out = [t.clone() for t in prob.init], {}, []
    for _ in range(steps):
        g = prob.grads(th)
        e, rule = HAND[name](state, th, g, variant, **extra)
        g_p = prob.grads([t + ei for t, ei in zip(th, e)])
        rule = update or rule
        if rule == "sum":
            u = [gi + gpi for gi, gpi in zip(g, g_p)]
        elif rule == "mean":
            u = [0.5 * gi + 0.5 * gpi for gi, gpi in zip(g, g_p)]
        else:
            u = g_p
        th = [t - LR * ui for t, ui in zip(th, u)]
        out.append(th)
    return out


def run_trajectory(name, variant, update, prob, steps=STEPS, **extra):
    params = [nn.Parameter(t.clone()) for t in prob.init]
    cls = OPTIMIZER_REGISTRY.get(name).cls
    hp = {k: HP[k] for k in KEYS.get(name, ("rho", "alpha", "lam"))}
    kwargs = {"update": update} if update else {}
    opt = cls(params, lr=LR, variant=variant, **hp, **kwargs, **extra)

    def closure():
        loss = prob.loss(params)
        loss.backward()
        return loss

    out = []
    for _ in range(steps):
        opt.zero_grad()
        closure()
        opt.step(closure)
        out.append([p.detach().clone() for p in params])
    return opt, params, out


def _cases():
    cases = []
    for spec in SPECS:
        updates = [""]
        if any(h.key == "UPDATE" for h in spec.hparams):
            updates += ["sum", "mean"]
        for variant in spec.cls.VARIANTS:
            for update in updates:
                cases.append(
                    pytest.param(
                        spec.name,
                        variant,
                        update,
                        {},
                        id=f"{spec.name}-{variant}-{update or 'own'}",
                    )
                )
                if any(h.key == "ADAPTIVE" for h in spec.hparams):
                    cases.append(
                        pytest.param(
                            spec.name,
                            variant,
                            update,
                            {"adaptive": True},
                            id=f"a{spec.name}-{variant}",
                        )
                    )
    return cases


# ---------------------------------------------------------------------------- float64
@pytest.mark.parametrize("name,variant,update,extra", _cases())
def test_float64_matches_hand_computation(name, variant, update, extra):
    """Every registered optimizer x variant x update rule: 3 steps in float64 on 3 tensors."""
    assert name in HAND, f"add a float64 hand computation of {name!r} to {__file__}"
    prob = Problem()
    expected = hand_trajectory(name, variant, update, prob, **extra)
    opt, params, got = run_trajectory(name, variant, update, prob, **extra)
    for step, (e_step, g_step) in enumerate(zip(expected, got), 1):
        for e, g in zip(e_step, g_step):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-13, msg=f"step {step}")
    assert all(p.dtype == torch.float64 for p in params)
    for p in params:  # the state is float64 too (no silent narrowing)
        assert all(v.dtype == torch.float64 for v in opt.state[p].values() if torch.is_tensor(v))
    assert all(v.dtype == torch.float64 for v in opt.last_stats.values())


def test_mixed_norm_matters():
    """The released ||m|| mixing changes the reference SAMPLe step (so the test above pins it):
    3 tensors, the second step, against the norm of the new averages."""
    prob = Problem()
    g1, g2 = prob.grads(prob.init), prob.grads([t * 0.5 for t in prob.init])
    mixed, plain = {}, {}
    for state, flag in ((mixed, True), (plain, False)):
        released_sample_perturbation(state, g1, mixed=flag)
    e_mixed = released_sample_perturbation(mixed, g2, mixed=True)
    e_plain = released_sample_perturbation(plain, g2, mixed=False)
    assert not torch.allclose(e_mixed[0], e_plain[0], rtol=1e-6)
    torch.testing.assert_close(e_mixed[2], e_plain[2])  # the last tensor sees the new norm


def test_sample_reference_tensor_without_gradient_at_first():
    """A tensor that first gets a gradient at step 2 takes the first-step rule (m = g, plain
    SAM), as in the released loop; the others follow the mixed-norm rule."""
    prob = Problem()
    params = [nn.Parameter(t.clone()) for t in prob.init]
    opt = SAMPLe(params, lr=LR, rho=RHO, alpha=ALPHA, lam=LAM, variant="reference")
    state = {}
    for step in range(3):
        grads = prob.grads([p.detach() for p in params])
        if step == 0:  # the first tensor has no gradient at step 1
            grads[0] = None
        before = [p.detach().clone() for p in params]
        e = released_sample_perturbation(state, grads)
        for p, gi in zip(params, grads):
            p.grad = None if gi is None else gi.clone()
        opt.first_step()
        for k, (p, b) in enumerate(zip(params, before)):
            expected = b + e[k] if k in e else b
            torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-13)
        opt.restore()
        opt.first_step()  # commit the step (g_p = g)
        opt.second_step()
        for k, p in enumerate(params):
            if grads[k] is not None:
                torch.testing.assert_close(opt.state[p]["ema"], state[k], rtol=1e-12, atol=0)
            else:
                assert "ema" not in opt.state[p]


# --------------------------------------------------------- fp32: rounds as the release
def _released_step_fp32(name, params, prob, state):
    """One step of the released code in fp32, restoring from a copy: (theta + e, new theta)."""
    with torch.enable_grad():
        loss = prob.loss(params)
        g = list(torch.autograd.grad(loss, params))
    grad_norm = torch.norm(torch.stack([gi.norm(p=2) for gi in g]), p=2)
    if name == "sagm":  # Wang-pengfei/SAGM: scale = rho / (||g|| + eps) - alpha; e = g * scale
        e = [gi * (RHO / (grad_norm + 1e-12) - ALPHA) for gi in g]
    elif name == "sam":  # davda54/sam
        e = [gi * (RHO / (grad_norm + 1e-12)) for gi in g]
    elif name == "fsam":  # nblt/F-SAM
        d = []
        for k, gi in enumerate(g):
            if k not in state:
                state[k] = gi.clone()
                d.append(gi.clone())
            else:
                d.append(gi - state[k] * SIGMA)
                state[k] = state[k] * LAM + gi * (1 - LAM)
        d_norm = torch.norm(torch.stack([di.norm(p=2) for di in d]), p=2)
        e = [di * (RHO / (d_norm + 1e-12)) for di in d]
    else:  # the released SAMPLe loop, in place, with torch.norm as it computes norms
        e = []
        for k, gi in enumerate(g):
            if k not in state:
                state[k] = gi.clone()
                e.append(RHO / grad_norm * gi)
                continue
            state[k].mul_(LAM).add_((1 - LAM) * gi)
            n = grad_norm + 1e-10
            n_m = torch.norm(torch.stack([state[j].norm(p=2) for j in sorted(state)]), p=2) + 1e-10
            cos = released_row_cosine(state[k], gi)
            e.append(RHO / n * gi - ALPHA * (gi - cos * (n / n_m) * state[k]))
    with torch.no_grad():
        backup = [p.detach().clone() for p in params]
        for p, ei in zip(params, e):
            p.add_(ei)
        perturbed = [p.detach().clone() for p in params]
    with torch.enable_grad():
        g_p = list(torch.autograd.grad(prob.loss(params), params))
    with torch.no_grad():
        for p, b, gi, gpi in zip(params, backup, g, g_p):
            p.copy_(b)
            u = gpi + (gi * 0.5 - gpi * 0.5) if name in ("sagm", "sample") else gpi
            p.add_(u, alpha=-LR)  # torch.optim.SGD without momentum
    return perturbed, [p.detach().clone() for p in params]


@pytest.mark.parametrize("name", ["sam", "fsam", "sagm", "sample"])
def test_reference_variant_rounds_as_the_released_code_in_fp32(name):
    prob = Problem(dtype=torch.float32)
    ref_params = [nn.Parameter(t.clone()) for t in prob.init]
    params = [nn.Parameter(t.clone()) for t in prob.init]
    hp = {k: HP[k] for k in KEYS.get(name, ("rho", "alpha", "lam"))}
    opt = OPTIMIZER_REGISTRY.get(name).cls(params, lr=LR, variant="reference", **hp)
    state = {}
    for _ in range(STEPS):
        perturbed, updated = _released_step_fp32(name, ref_params, prob, state)
        opt.zero_grad()
        prob.loss(params).backward()
        opt.first_step(zero_grad=True)
        assert all(torch.equal(p.detach(), q) for p, q in zip(params, perturbed))
        prob.loss(params).backward()
        opt.second_step()
        for p, q in zip(params, updated):
            torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)


# ------------------------------------------------------------------ the update gradient
# L = 0.5 ||x||^2 at x = (3, 4): g = x, ||g|| = 5; rho 1, alpha 0.1, SGD lr 0.1.
# SAGM: e = g (1/5 - 0.1) = (0.3, 0.4), g_p = x + e = (3.3, 4.4);
#   sum:  u = (6.3, 8.4)  -> x = (2.37, 3.16);   mean: u = (3.15, 4.2) -> x = (2.685, 3.58).
# SAMPLe, first step (paper: g_B = 0; reference: m = g, plain SAM): e = g / 5 = (0.6, 0.8),
#   g_p = (3.6, 4.8); sum: u = (6.6, 8.8) -> x = (2.34, 3.12); mean: u = (3.3, 4.4) ->
#   x = (2.67, 3.56). The released CoCoOp copy: e = g / 5 - 0.1 g = SAGM's (no epsilon).
UPDATE_CASES = [
    (SAGM, "paper", "", (2.37, 3.16)),
    (SAGM, "paper", "mean", (2.685, 3.58)),
    (SAGM, "reference", "", (2.685, 3.58)),
    (SAGM, "reference", "sum", (2.37, 3.16)),
    (SAMPLe, "paper", "", (2.34, 3.12)),
    (SAMPLe, "paper", "mean", (2.67, 3.56)),
    (SAMPLe, "reference", "", (2.67, 3.56)),
    (SAMPLe, "reference", "sum", (2.34, 3.12)),
    (SAMPLe, "reference-cocoop", "", (2.685, 3.58)),
    (SAMPLe, "reference-cocoop", "sum", (2.37, 3.16)),
]


@pytest.mark.parametrize("cls,variant,update,expected", UPDATE_CASES)
def test_update_rule_hand_derived(cls, variant, update, expected):
    x = nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    opt = cls([x], lr=0.1, rho=1.0, alpha=0.1, variant=variant, update=update)
    assert opt.update_rule == (update or cls.UPDATE[variant])

    def closure():
        loss = 0.5 * (x * x).sum()
        loss.backward()
        return loss

    closure()
    opt.step(closure)
    assert x.tolist() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("update", ["", "sum", "mean"])
@pytest.mark.parametrize("name", ["sagm", "sample"])
def test_update_key_reaches_the_optimizer(name, update):
    cfg = get_base_cfg_default()
    cfg.OPTIM.NAME, cfg.OPTIM.LR = "sgd", 0.01
    cfg.OPTIM.SAM.NAME, cfg.OPTIM.SAM.VARIANT, cfg.OPTIM.SAM.UPDATE = name, "paper", update
    opt = build_optimizer(cfg, [nn.Parameter(torch.zeros(2))])
    assert opt.update_rule == (update or "sum")


def test_invalid_update_and_variant_raise():
    p = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="update"):
        SAGM(p, lr=0.1, update="avg")
    with pytest.raises(ValueError, match="update"):
        SAM(p, lr=0.1, update="mean")  # SAM updates with g_p only
    for cls in (SAM, SAGM):
        with pytest.raises(ValueError, match="variant"):
            cls(p, lr=0.1, variant="reference-cocoop")  # only SAMPLe has a CoCoOp copy
    opt = SAMPLe(p, lr=0.1, variant="reference-cocoop")
    p[0].grad = torch.ones(2)
    opt.first_step()
    opt.second_step()
    assert "ema" not in opt.state[p[0]]  # the CoCoOp copy keeps no moving average


def test_every_sagm_and_sample_config_sets_the_update_rule():
    """No table rests on a silent default: each configs/optim file of SAGM or SAMPLe (top level
    and per trainer) sets OPTIM.SAM.UPDATE explicitly (and the name in the file matches)."""
    files = sorted(
        glob.glob(osp.join(ROOT, "configs", "optim", "**", "sagm.yaml"), recursive=True)
        + glob.glob(osp.join(ROOT, "configs", "optim", "**", "sample.yaml"), recursive=True)
    )
    assert len(files) >= 2 + 2 * 8, files
    for path in files:
        with open(path) as f:
            sam = yaml.safe_load(f)["OPTIM"]["SAM"]
        assert sam["NAME"] == osp.splitext(osp.basename(path))[0], path
        assert sam.get("UPDATE") in ("sum", "mean"), f"{path}: set OPTIM.SAM.UPDATE sum|mean"


@pytest.mark.parametrize(
    "cls,kwargs",
    [(SAMPLe, {"variant": "reference-cocoop"}), (SAMPLe, {"variant": "paper", "update": "mean"})],
)
def test_state_dict_round_trip_keeps_variant_and_update(cls, kwargs):
    prob = Problem()
    runs = []
    for _ in range(2):
        params = [nn.Parameter(t.clone()) for t in prob.init]
        runs.append((params, cls(params, lr=LR, rho=RHO, alpha=ALPHA, lam=LAM, **kwargs)))

    def step(params, opt):
        opt.zero_grad()
        prob.loss(params).backward()
        opt.step(lambda: prob.loss(params).backward())

    (p1, o1), (p2, o2) = runs
    for _ in range(2):
        step(p1, o1)
    sd = o1.state_dict()
    assert sd["sharpness"]["update"] == o1.update_rule == (kwargs.get("update") or "mean")
    with torch.no_grad():
        for a, b in zip(p2, p1):
            a.copy_(b)
    o2.load_state_dict(sd)
    for _ in range(2):
        step(p1, o1)
        step(p2, o2)
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))
