"""Tests of the sharpness-aware optimizers (optim/sharpness.py, sam, fsam, sagm, sample).

One parametrized suite runs every registered sharpness-aware optimizer (and ASAM) in both
variants through the same checks; hand-derived cases pin each optimizer's equations with
values computed here in plain Python floats. CPU only, a few seconds in all.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.config import get_base_cfg_default
from optim import FSAM, SAGM, SAM, SAMPLe, SharpnessAwareOptimizer
from optim.build import OPTIMIZER_REGISTRY, build_optimizer, list_optimizers

# The registry drives the suite: every registered sharpness-aware optimizer runs every shared
# check with the small-problem hyper-parameters of its registry entry (``test_kwargs``).
# the cheaper members (``efficient``: second pass skipped or none) have their own suite,
# tests/test_optim_efficient.py
SPECS = [s for s in list_optimizers("sharpness") if not s.efficient]
NAMES = tuple(s.name for s in SPECS)
VARIANTS = ("paper", "reference")
HPARAMS = {s.name: dict(s.test_kwargs) for s in SPECS}
ADAPTIVE = [s.name for s in SPECS if any(h.key == "ADAPTIVE" for h in s.hparams)]
CASES = [(n, v, {}) for n in NAMES for v in VARIANTS] + [
    (n, v, {"adaptive": True}) for n in ADAPTIVE for v in VARIANTS
]
CASE_IDS = [f"{'a' + n if kw else n}-{v}" for n, v, kw in CASES]


def _keeps_average(name: str) -> bool:
    """Whether the optimizer keeps a moving average of the gradient (found by one step)."""
    p = nn.Parameter(torch.ones(2))
    opt = OPTIMIZER_REGISTRY.get(name).cls([p], lr=0.1, **HPARAMS[name])
    p.grad = torch.ones(2)
    opt.first_step(zero_grad=True)
    p.grad = torch.ones(2)
    opt.second_step()
    return "ema" in opt.state[p]


EMA_NAMES = tuple(n for n in NAMES if _keeps_average(n))

every_case = pytest.mark.parametrize("name,variant,extra", CASES, ids=CASE_IDS)


def make(name, params, variant="paper", base=torch.optim.SGD, **kwargs):
    """A registered sharpness-aware optimizer with the test hyper-parameters (lr 0.1)."""
    cls = OPTIMIZER_REGISTRY.get(name).cls
    kwargs = {**HPARAMS[name], "lr": 0.1, **kwargs}
    return cls(params, base_optimizer=base, variant=variant, **kwargs)


class Quadratic:
    """``0.5 * sum(c * p^2)`` over a 2-D, a 1-D and a 0-d parameter."""

    def __init__(self, dtype=torch.float32, seed=0):
        gen = torch.Generator().manual_seed(seed)
        shapes = [(3, 4), (5,), ()]
        self.params = [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
        self.scales = [torch.rand(s, generator=gen) + 0.5 for s in shapes]

    def loss(self):
        return sum(0.5 * (c * p.float() ** 2).sum() for p, c in zip(self.params, self.scales))

    def closure(self):
        loss = self.loss()
        loss.backward()
        return loss


def mlp_problem(init_seed=0):
    """A 2-layer MLP on 64 fixed random points of 3 (learnable) classes, and its closure."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(init_seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    x = torch.randn(64, 8, generator=gen)
    y = (x @ torch.randn(8, 3, generator=gen)).argmax(1)  # labels of a linear teacher

    def closure():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return model, closure


def train(opt, closure, steps):
    """The engine's loop: first pass by the caller, then step(closure)."""
    for _ in range(steps):
        opt.zero_grad()
        loss = closure()
        opt.step(closure, loss=loss.detach())


def clones(params):
    return [p.detach().clone() for p in params]


# --------------------------------------------------------------------- the common suite
@every_case
def test_loss_falls_on_quadratic(name, variant, extra):
    prob = Quadratic()
    opt = make(name, prob.params, variant, **extra)
    start = prob.loss().item()
    train(opt, prob.closure, 50)
    assert prob.loss().item() < 0.1 * start


@every_case
def test_loss_falls_on_mlp(name, variant, extra):
    model, closure = mlp_problem()
    opt = make(name, model.parameters(), variant, momentum=0.9, **{**extra, "lr": 0.05})
    start = closure().item()
    train(opt, closure, 50)
    assert closure().item() < 0.5 * start


@every_case
def test_state_dict_round_trip_reproduces_trajectory(name, variant, extra):
    def build(model):
        return make(
            name,
            model.parameters(),
            variant,
            momentum=0.9,
            weight_decay=1e-3,
            schedule="inv_sqrt",
            **extra,
        )

    model, closure = mlp_problem()
    opt = build(model)
    train(opt, closure, 3)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    ckpt = torch.load(buffer, weights_only=True)
    assert ckpt["optim"]["state"], "the base optimizer's momentum must be saved"
    assert ckpt["optim"]["sharpness"]["num_steps"] == 3
    if name in EMA_NAMES:
        assert len(ckpt["optim"]["sharpness"]["state"]) == 4
    train(opt, closure, 3)

    model2, closure2 = mlp_problem(init_seed=1)  # different init, overwritten by the checkpoint
    model2.load_state_dict(ckpt["model"])
    opt2 = build(model2)
    opt2.load_state_dict(ckpt["optim"])
    assert opt2.param_groups is opt2.base_optimizer.param_groups
    assert opt2.num_steps == 3
    train(opt2, closure2, 3)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


@every_case
def test_per_group_learning_rates(name, variant, extra):
    prob = Quadratic()
    groups = [{"params": prob.params[:2]}, {"params": prob.params[2:], "lr": 0.05}]
    opt = make(name, groups, variant, **extra)
    assert opt.param_groups is opt.base_optimizer.param_groups
    opt.param_groups[0]["lr"] = 0.2  # a scheduler acting on the wrapper reaches the base
    assert opt.base_optimizer.param_groups[0]["lr"] == 0.2
    before = clones(prob.params)
    opt.zero_grad()
    prob.closure()
    opt.step(prob.closure)
    for p, p0, lr in zip(prob.params, before, (0.2, 0.2, 0.05)):
        # plain SGD: the step is -lr times the update gradient left in .grad
        assert torch.equal(p, p0.add(p.grad, alpha=-lr))


@every_case
def test_per_group_rho_zero_group_is_not_perturbed(name, variant, extra):
    prob = Quadratic()
    off = {"rho": 0.0, "alpha": 0.0} if name in ("sagm", "sample") else {"rho": 0.0}
    opt = make(name, [{"params": prob.params[:1]}, {"params": prob.params[1:], **off}], variant)
    before = clones(prob.params)
    prob.closure()
    opt.first_step()
    assert not torch.equal(prob.params[0], before[0])
    assert all(torch.equal(p, q) for p, q in zip(prob.params[1:], before[1:]))
    opt.restore()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "name,extra",
    [("sam", {}), ("sam", {"adaptive": True}), ("fsam", {})],
    ids=["sam", "asam", "fsam"],
)
def test_rho_zero_is_the_base_optimizer(name, variant, extra):
    model, closure = mlp_problem()
    opt = make(name, model.parameters(), variant, momentum=0.9, weight_decay=5e-4, rho=0.0, **extra)
    model_ref, closure_ref = mlp_problem()
    sgd = torch.optim.SGD(model_ref.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    train(opt, closure, 5)
    for _ in range(5):
        sgd.zero_grad()
        closure_ref()
        sgd.step()
    for p, q in zip(model.parameters(), model_ref.parameters()):
        assert torch.equal(p, q)


@every_case
def test_zero_gradient_gives_no_nan(name, variant, extra):
    prob = Quadratic()
    opt = make(name, prob.params, variant, **extra)
    before = clones(prob.params)

    def closure():
        loss = 0.0 * prob.loss()
        loss.backward()
        return loss

    train(opt, closure, 3)
    for p, p0 in zip(prob.params, before):
        assert torch.equal(p, p0)
    assert all(torch.isfinite(v) for v in opt.last_stats.values())


@every_case
def test_fp16_parameters(name, variant, extra):
    prob = Quadratic(dtype=torch.float16)
    opt = make(name, prob.params, variant, momentum=0.9, **extra)
    start = prob.loss().item()
    train(opt, prob.closure, 5)
    assert all(torch.isfinite(p).all() for p in prob.params)
    assert prob.loss().item() < start
    before = clones(prob.params)
    opt.zero_grad()
    prob.closure()
    opt.first_step()
    assert any(not torch.equal(p, q) for p, q in zip(prob.params, before))
    opt.restore()
    for p, p0 in zip(prob.params, before):
        assert p.dtype == torch.float16 and torch.equal(p, p0)
    if name in EMA_NAMES:
        assert all(opt.state[p]["ema"].dtype == torch.float32 for p in prob.params)


@every_case
def test_parameters_without_gradient_are_not_moved(name, variant, extra):
    prob = Quadratic()
    unused = nn.Parameter(torch.ones(4))
    late = nn.Parameter(torch.ones(2))  # no gradient in the first pass, one in the second
    opt = make(name, [*prob.params, unused, late], variant, momentum=0.9, weight_decay=0.1)
    for _ in range(3):
        opt.zero_grad()
        prob.closure()
        opt.first_step(zero_grad=True)
        assert torch.equal(unused, torch.ones(4)) and torch.equal(late, torch.ones(2))
        loss = prob.loss() + (late**2).sum()
        loss.backward()
        opt.second_step()
    assert torch.equal(unused, torch.ones(4)) and torch.equal(late, torch.ones(2))
    assert unused not in opt.base_optimizer.state and late not in opt.base_optimizer.state


@every_case
def test_restore_leaves_params_and_state_unchanged(name, variant, extra):
    def build(prob):
        return make(name, prob.params, variant, momentum=0.9, schedule="inv_sqrt", **extra)

    prob, prob_ref = Quadratic(), Quadratic()
    opt, opt_ref = build(prob), build(prob_ref)
    train(opt, prob.closure, 2)
    train(opt_ref, prob_ref.closure, 2)
    before = clones(prob.params)
    ema = [opt.state[p]["ema"].clone() for p in prob.params] if name in EMA_NAMES else []
    opt.zero_grad()
    prob.closure()
    opt.first_step(zero_grad=True)
    prob.closure()  # the second pass, whose step is then skipped
    opt.restore()
    assert opt.num_steps == 2
    for p, p0 in zip(prob.params, before):
        assert torch.equal(p, p0)
    for p, m in zip(prob.params, ema):
        assert torch.equal(opt.state[p]["ema"], m)
    train(opt, prob.closure, 2)  # as if the skipped step had never happened
    train(opt_ref, prob_ref.closure, 2)
    for p, q in zip(prob.params, prob_ref.params):
        assert torch.equal(p, q)


@every_case
def test_last_stats(name, variant, extra):
    prob = Quadratic()
    opt = make(name, prob.params, variant, **extra)
    train(opt, prob.closure, 2)
    keys = {"grad_norm", "grad_p_norm", "cos_g_gp"}
    if name in EMA_NAMES:
        keys |= {"ema_norm", "xi", "gb_norm", "cos_gp_m"}
    assert keys <= set(opt.last_stats)
    for value in opt.last_stats.values():
        assert isinstance(value, torch.Tensor) and value.dim() == 0
        assert value.dtype == torch.float32 and torch.isfinite(value)
    assert opt.last_stats["grad_norm"] > 0 and opt.last_stats["grad_p_norm"] > 0


@every_case
def test_step_closure_contract(name, variant, extra):
    prob = Quadratic()
    opt = make(name, prob.params, variant, **extra)
    calls = []

    def closure():
        calls.append(1)
        return prob.closure()

    loss = opt.step(closure)  # no .grad yet: the closure computes g first
    assert len(calls) == 2 and loss is not None
    opt.zero_grad()
    first = prob.closure()
    assert opt.step(closure, loss=first) is first and len(calls) == 3
    with pytest.raises(RuntimeError):
        opt.step()


@every_case
def test_add_param_group(name, variant, extra):
    prob = Quadratic()
    opt = make(name, prob.params[:2], variant, **extra)
    opt.add_param_group({"params": prob.params[2:], "rho": 0.2})
    assert len(opt.base_optimizer.param_groups) == 2
    assert opt.param_groups[1]["rho"] == 0.2 and opt.param_groups[1]["lr"] == 0.1
    train(opt, prob.closure, 2)


# --------------------------------------------------------------- hand-derived values
# L(x, y) = A x^2 + B y^2 + C x y, SGD lr 0.1 without momentum; x and y are separate
# one-element tensors (so the reference SAMPLe's per-row cosine is one per tensor: +-1).
A, B, C, LR = 1.0, 2.0, 0.5, 0.1
X0, Y0 = 1.0, -1.5
RHO, ALPHA, LAM, SIGMA = 0.1, 0.05, 0.5, 0.8


def _grad(th):
    x, y = th
    return [2 * A * x + C * y, 2 * B * y + C * x]


def _norm(v):
    return math.sqrt(sum(t * t for t in v))


def _dot(a, b):
    return sum(s * t for s, t in zip(a, b))


def _axpy(a, b, s=1.0):  # a + s * b
    return [x + s * y for x, y in zip(a, b)]


def _scale(a, s):
    return [s * x for x in a]


HAND_DERIVED = ("sam", "fsam", "sagm", "sample")  # the optimizers hand() derives


def test_every_registered_optimizer_has_a_hand_derivation():
    missing = sorted(set(NAMES) - set(HAND_DERIVED))
    assert not missing, f"write a hand derivation of {missing} in hand() ({__file__})"


def hand(name, variant, steps=2, adaptive=False):
    """The trajectory (x, y) after each step, from the equations, in Python floats."""
    th, m, out = [X0, Y0], None, []
    for _ in range(steps):
        g = _grad(th)
        n = _norm(g)
        if name == "sam" and adaptive:
            na = _norm([abs(p) * gi for p, gi in zip(th, g)])
            e = [RHO * p * p * gi / na for p, gi in zip(th, g)]
        elif name == "sam":
            e = _scale(g, RHO / n)
        elif name == "fsam":
            if variant == "paper":  # m_t first, then d = g - sigma m_t
                m = _axpy(_scale(m or [0.0, 0.0], LAM), g, 1 - LAM)
                d = _axpy(g, m, -SIGMA)
            elif m is None:  # reference first step: m = g, d = g
                d, m = g, g
            else:  # reference: d with the old average, then update it
                d = _axpy(g, m, -SIGMA)
                m = _axpy(_scale(m, LAM), g, 1 - LAM)
            e = _scale(d, RHO / _norm(d))
        elif name == "sagm":
            e = _scale(g, RHO / n - ALPHA)
        elif variant == "paper":  # SAMPLe
            m = _axpy(_scale(m or [0.0, 0.0], LAM), g, 1 - LAM)
            nm = _norm(m)
            xi, sigma = _dot(m, g) / (n * nm), n / nm
            g_b = _axpy(g, m, -xi * sigma)
            e = _axpy(_scale(g, RHO / n), g_b, -ALPHA)
        elif m is None:  # SAMPLe reference, first step
            m, e = g, _scale(g, RHO / n)
        else:  # SAMPLe reference, later steps: one cosine per row (= per 1-element tensor)
            old, m = m, _axpy(_scale(m, LAM), g, 1 - LAM)
            n_ = n + 1e-10
            # ||m|| as the released loop sees it: x sees (new m_x, old m_y), y sees both new
            nms = [_norm([m[0], old[1]]) + 1e-10, _norm(m) + 1e-10]
            xi = [math.copysign(1.0, gi * mi) for gi, mi in zip(g, m)]
            g_b = [gi - x * (n_ / nm) * mi for gi, x, mi, nm in zip(g, xi, m, nms)]
            e = [RHO * gi / n_ - ALPHA * gb for gi, gb in zip(g, g_b)]
        g_p = _grad(_axpy(th, e))
        if name in ("sagm", "sample"):
            u = _axpy(g, g_p) if variant == "paper" else _scale(_axpy(g, g_p), 0.5)
        else:
            u = g_p
        th = _axpy(th, u, -LR)
        out.append(th)
    return out


def run_xy(name, variant, steps=2, **kwargs):
    x, y = nn.Parameter(torch.tensor([X0])), nn.Parameter(torch.tensor([Y0]))
    hp = {"rho": RHO, "alpha": ALPHA, "lam": LAM, "sigma": SIGMA}
    keys = {"sam": ("rho",), "fsam": ("rho", "lam", "sigma"), "sagm": ("rho", "alpha")}
    hp = {k: hp[k] for k in keys.get(name, ("rho", "alpha", "lam"))}
    opt = OPTIMIZER_REGISTRY.get(name).cls([x, y], lr=LR, variant=variant, **hp, **kwargs)

    def closure():
        loss = (A * x**2 + B * y**2 + C * x * y).sum()
        loss.backward()
        return loss

    out = []
    for _ in range(steps):
        opt.zero_grad()
        closure()
        opt.step(closure)
        out.append([x.item(), y.item()])
    return out


def test_hand_derivation_anchor():
    # g = (1.25, -5.5), e = 0.1 g / ||g||, g_p at (1.022162, -1.597514), theta - 0.1 g_p
    assert hand("sam", "paper", 1)[0] == pytest.approx([0.8754432, -0.9121028], abs=1e-7)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "name,extra",
    [(n, {}) for n in HAND_DERIVED] + [("sam", {"adaptive": True})],
    ids=[*HAND_DERIVED, "asam"],
)
def test_hand_derived_two_steps(name, variant, extra):
    expected = hand(name, variant, 2, **extra)
    got = run_xy(name, variant, 2, **extra)
    for e, g in zip(expected, got):
        assert g == pytest.approx(e, rel=1e-5, abs=1e-6)


def test_variants_differ_where_documented():
    for name in ("fsam", "sagm", "sample"):
        assert hand(name, "paper")[1] != pytest.approx(hand(name, "reference")[1], abs=1e-4)
    assert run_xy("sam", "paper") == run_xy("sam", "reference")


def test_sample_reference_per_row_cosine():
    """Reference SAMPLe's second step on a (2, 3) matrix (a cosine per row) and a 1-D vector
    (one row), against the formula in Python floats."""
    g1 = [[1.0, -2.0, 0.5], [0.3, 0.2, -1.0], [0.7, -0.1, 0.4]]  # rows: W[0], W[1], v
    g2 = [[-0.5, 1.0, 2.0], [0.1, 0.9, 0.3], [0.2, 0.2, -0.6]]
    w, v = nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(3))
    opt = SAMPLe([w, v], lr=0.1, rho=RHO, alpha=ALPHA, lam=LAM, variant="reference")

    def set_grads(rows):
        w.grad, v.grad = torch.tensor(rows[:2]), torch.tensor(rows[2])

    set_grads(g1)
    opt.first_step()
    set_grads(g1)  # g_p: its value does not matter here
    opt.second_step()
    start = clones([w, v])
    set_grads(g2)
    opt.first_step()
    e = torch.cat([(w - start[0]).flatten(), v - start[1]]).tolist()
    opt.restore()

    m = [[LAM * a + (1 - LAM) * b for a, b in zip(r1, r2)] for r1, r2 in zip(g1, g2)]
    n = _norm(sum(g2, [])) + 1e-10
    # ||m|| as the released loop sees it: W with its new average and v's old one (g1 of v),
    # v with both new
    nms = [_norm(sum(m[:2], []) + g1[2]) + 1e-10] * 2 + [_norm(sum(m, [])) + 1e-10]
    expected = []
    for gr, mr, nm in zip(g2, m, nms):
        xi = _dot(gr, mr) / (_norm(gr) * _norm(mr))
        expected += [RHO * a / n - ALPHA * (a - xi * (n / nm) * b) for a, b in zip(gr, mr)]
    assert e == pytest.approx(expected, rel=1e-5, abs=1e-7)


# ------------------------------------------------------------------ SAMPLe invariants
def test_sample_batch_gradient_is_orthogonal_to_average():
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 6), (6,), (2, 3, 2)]
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = SAMPLe(params, lr=0.0, rho=0.0, alpha=1.0, lam=0.6)  # e = -g_B; params stay 0
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        old = [opt.state[p].get("ema", torch.zeros(p.shape)) for p in params]
        grads = [p.grad.clone() for p in params]
        opt.first_step()
        g_b = [-p.detach().clone() for p in params]  # the params were zero
        opt.restore()
        m = [0.6 * a + 0.4 * g for a, g in zip(old, grads)]
        dot = sum(float((a * b).sum()) for a, b in zip(g_b, m))
        norm_gb = math.sqrt(sum(float((a * a).sum()) for a in g_b))
        norm_m = math.sqrt(sum(float((a * a).sum()) for a in m))
        if opt.num_steps > 0:  # at the first step g_B = 0
            assert norm_gb > 0.1
        assert abs(dot) <= 1e-5 * max(norm_gb * norm_m, 1.0)
        opt.first_step()  # now commit the step
        opt.second_step()


@pytest.mark.parametrize("lam", [0.0, 0.15, 0.9])
def test_sample_first_paper_step_is_sam(lam):
    prob, prob_sam = Quadratic(), Quadratic()
    opt = SAMPLe(prob.params, lr=0.1, rho=0.05, alpha=0.1, lam=lam)
    sam = SAM(prob_sam.params, lr=0.1, rho=0.05)
    prob.closure()
    prob_sam.closure()
    opt.first_step()
    sam.first_step()
    for p, q in zip(prob.params, prob_sam.params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_sample_without_exploration_is_sagm():
    prob, prob_sagm = Quadratic(), Quadratic()
    opt = SAMPLe(prob.params, lr=0.1, rho=0.05, alpha=0.02, lam=0.3, exploration=False)
    sagm = SAGM(prob_sagm.params, lr=0.1, rho=0.05, alpha=0.02)
    for _ in range(4):
        for o, pr in ((opt, prob), (sagm, prob_sagm)):
            o.zero_grad()
            pr.closure()
            o.first_step(zero_grad=True)
        assert all(torch.equal(p, q) for p, q in zip(prob.params, prob_sagm.params))
        for o, pr in ((opt, prob), (sagm, prob_sagm)):
            pr.closure()
            o.second_step()
        assert all(torch.equal(p, q) for p, q in zip(prob.params, prob_sagm.params))


# ----------------------------------------------------------------- schedule, errors
def test_inv_sqrt_schedule_halves_rho_at_step_four():
    prob = Quadratic()
    opt = SAM(prob.params, lr=0.1, rho=0.2, schedule="inv_sqrt")
    train(opt, prob.closure, 3)
    before = clones(prob.params)
    opt.zero_grad()
    prob.closure()
    opt.first_step()
    shift = math.sqrt(
        sum(float(((p.detach() - q) ** 2).sum()) for p, q in zip(prob.params, before))
    )
    assert shift == pytest.approx(0.1, rel=1e-5)
    opt.restore()


@pytest.mark.parametrize(
    "cls,kwargs,word",
    [
        (SAM, {"rho": -0.1}, "rho"),
        (SAM, {"adaptive": "yes"}, "adaptive"),
        (FSAM, {"rho": -1.0}, "rho"),
        (FSAM, {"lam": 1.0}, "lam"),
        (FSAM, {"lam": -0.1}, "lam"),
        (FSAM, {"sigma": -1.0}, "sigma"),
        (SAGM, {"alpha": -0.001}, "alpha"),
        (SAMPLe, {"alpha": -0.001}, "alpha"),
        (SAMPLe, {"lam": 1.5}, "lam"),
        (SAMPLe, {"rho": float("nan")}, "rho"),
        (SAM, {"variant": "official"}, "variant"),
        (SAMPLe, {"variant": "code"}, "variant"),
        (SAGM, {"schedule": "cosine"}, "schedule"),
    ],
)
def test_invalid_values_raise(cls, kwargs, word):
    with pytest.raises(ValueError, match=word):
        cls([nn.Parameter(torch.zeros(2))], lr=0.1, **kwargs)


def test_invalid_group_value_raises():
    p = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="rho"):
        SAM([{"params": [p], "rho": -1.0}], lr=0.1)
    opt = SAMPLe([p], lr=0.1)
    with pytest.raises(ValueError, match="lam"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))], "lam": 1.0})


# ------------------------------------------------------------------------- registry
def test_registry_lists_the_sharpness_aware_optimizers():
    specs = {s.name: s for s in list_optimizers()}
    classes = {"sam": SAM, "fsam": FSAM, "sagm": SAGM, "sample": SAMPLe}
    for name, cls in classes.items():
        spec = specs[name]
        assert spec.cls is cls and issubclass(cls, SharpnessAwareOptimizer)
        assert spec.kind == "sharpness" and spec.needs_closure


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", NAMES)
def test_build_optimizer_from_config(name, variant):
    cfg = get_base_cfg_default()
    cfg.OPTIM.NAME = "sgd"
    cfg.OPTIM.LR = 0.01
    cfg.OPTIM.SAM.NAME = name
    cfg.OPTIM.SAM.VARIANT = variant
    cfg.OPTIM.SAM.SCHEDULE = "inv_sqrt"
    model, closure = mlp_problem()
    opt = build_optimizer(cfg, model)
    assert isinstance(opt, OPTIMIZER_REGISTRY.get(name).cls)
    assert isinstance(opt.base_optimizer, torch.optim.SGD)
    assert opt.variant == variant and opt.schedule == "inv_sqrt"
    group = opt.param_groups[0]
    assert group["rho"] == cfg.OPTIM.SAM.RHO and group["momentum"] == cfg.OPTIM.MOMENTUM
    if name in ("sagm", "sample"):
        assert group["alpha"] == cfg.OPTIM.SAM.ALPHA
    if name in EMA_NAMES:
        assert group["lam"] == cfg.OPTIM.SAM.LAMBDA
    train(opt, closure, 1)
