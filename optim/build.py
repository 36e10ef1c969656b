"""The optimizer registry and ``build_optimizer(cfg, params)``.

Registry entries are data (:class:`OptimizerSpec`): name, class, description, kind ("base" or
"sharpness"), whether ``step`` needs a closure, its ``OPTIM.SAM.*`` hyper-parameters
(:class:`HParam`: config key, constructor keyword, default, help) and small-problem values for
the shared tests. The step object (:mod:`optim.step`) reads ``needs_closure`` to decide how to
step; the config gains any new ``OPTIM.SAM`` key of a registered optimizer
(:func:`add_optimizer_keys`); the shared tests run every registered entry. So a new optimizer is
one file: its class and its ``register_optimizer`` call.

``OPTIM.NAME`` names the base optimizer (Dassl-compatible: sgd, adam, adamw, amsgrad, rmsprop,
radam); ``OPTIM.SAM.NAME`` optionally wraps it in a sharpness-aware optimizer (sam, fsam, sagm,
sample, and the cheaper looksam, esam, rwp, mrwp, saf, mesa: docs/efficient-sharpness.md)
whose hyper-parameters come from ``OPTIM.SAM.*``.

Adding an optimizer::

    register_optimizer("myopt", MyOpt, "one line on what it does", kind="sharpness",
                       needs_closure=True,
                       hparams=("RHO", HParam("BETA", "beta", 0.9, "my new knob")),
                       test_kwargs=dict(rho=0.05, beta=0.9))
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from .hparams import (  # noqa: F401  (re-exported: optimizers declare their keys with these)
    FP32_MAX,
    NONNEG,
    POS,
    SAM_HPARAMS,
    HParam,
    declare_hparam,
    nonneg,
    positive,
)
from .registry import Registry

logger = logging.getLogger(__name__)

OPTIMIZER_REGISTRY = Registry("optimizer")


@dataclass(frozen=True)
class OptimizerSpec:
    """What the engine needs to know about a registered optimizer.

    Attributes:
        name: registry name (the value of OPTIM.NAME or OPTIM.SAM.NAME).
        cls: the optimizer class.
        description: one line for listings and the README.
        kind: "base" (a torch optimizer) or "sharpness" (wraps a base optimizer).
        needs_closure: ``step`` must be given a closure that re-evaluates the loss.
        hparams: the OPTIM.SAM hyper-parameters passed to a sharpness-aware constructor.
        make_kwargs: base optimizers: ``optim_cfg -> constructor kwargs``.
        test_kwargs: constructor keywords of a small test problem (the shared tests use them).
        efficient: one of the cheaper sharpness-aware optimizers (docs/efficient-sharpness.md):
            it may skip the second pass or act before the forward through the hooks of
            :class:`optim.sharpness.SharpnessAwareOptimizer`; tests/test_optim_efficient.py runs
            their shared checks, tests/test_optim.py those of the second-pass-every-step family.
    """

    name: str
    cls: type
    description: str
    kind: str = "base"
    needs_closure: bool = False
    hparams: tuple[HParam, ...] = ()
    make_kwargs: Callable | None = field(default=None, compare=False)
    test_kwargs: dict = field(default_factory=dict, compare=False)
    efficient: bool = False


def register_optimizer(
    name: str,
    cls: type,
    description: str,
    kind: str = "base",
    needs_closure: bool = False,
    hparams: tuple[str | HParam, ...] = (),
    make_kwargs: Callable | None = None,
    test_kwargs: dict | None = None,
    efficient: bool = False,
) -> OptimizerSpec:
    """Register an optimizer (see the module docstring); ``hparams`` names built-in OPTIM.SAM
    keys (:data:`SAM_HPARAMS`) or gives new ones as :class:`HParam`."""
    if kind not in ("base", "sharpness"):
        raise ValueError(f"Optimizer kind must be 'base' or 'sharpness', got {kind!r}")
    resolved = []
    for h in hparams:
        if isinstance(h, str):
            if h not in SAM_HPARAMS:
                raise ValueError(
                    f"Unknown OPTIM.SAM key {h!r} for optimizer {name!r}: pass an HParam to "
                    f"declare a new one (known: {', '.join(SAM_HPARAMS)})"
                )
            h = SAM_HPARAMS[h]
        resolved.append(declare_hparam(h))
    spec = OptimizerSpec(
        name,
        cls,
        description,
        kind,
        needs_closure,
        tuple(resolved),
        make_kwargs,
        dict(test_kwargs or {}),
        efficient,
    )
    OPTIMIZER_REGISTRY.register(spec, name=name)
    return spec


def _sgd_kwargs(o):
    return dict(
        lr=o.LR,
        momentum=o.MOMENTUM,
        weight_decay=o.WEIGHT_DECAY,
        dampening=o.SGD_DAMPNING,
        nesterov=o.SGD_NESTEROV,
    )


def _adam_kwargs(o):
    return dict(
        lr=o.LR, weight_decay=o.WEIGHT_DECAY, betas=(o.ADAM_BETA1, o.ADAM_BETA2), eps=o.ADAM_EPS
    )


register_optimizer(
    "sgd", torch.optim.SGD, "SGD with momentum (Dassl defaults)", make_kwargs=_sgd_kwargs
)
register_optimizer("adam", torch.optim.Adam, "Adam", make_kwargs=_adam_kwargs)
register_optimizer(
    "amsgrad",
    torch.optim.Adam,
    "Adam with the AMSGrad variant",
    make_kwargs=lambda o: {**_adam_kwargs(o), "amsgrad": True},
)
register_optimizer(
    "adamw", torch.optim.AdamW, "AdamW (decoupled weight decay)", make_kwargs=_adam_kwargs
)
register_optimizer(
    "rmsprop",
    torch.optim.RMSprop,
    "RMSprop",
    make_kwargs=lambda o: dict(
        lr=o.LR, momentum=o.MOMENTUM, weight_decay=o.WEIGHT_DECAY, alpha=o.RMSPROP_ALPHA
    ),
)
register_optimizer(
    "radam",
    torch.optim.RAdam,
    "Rectified Adam",
    make_kwargs=lambda o: dict(
        lr=o.LR, weight_decay=o.WEIGHT_DECAY, betas=(o.ADAM_BETA1, o.ADAM_BETA2), eps=o.ADAM_EPS
    ),
)


def _get(name: str, kind: str, key: str) -> OptimizerSpec:
    spec = OPTIMIZER_REGISTRY.get(name)
    if spec.kind != kind:
        if kind == "base":
            raise ValueError(
                f"{key} '{name}' is a sharpness-aware wrapper, not a base optimizer: keep "
                f"OPTIM.NAME the base optimizer (e.g. sgd) and set OPTIM.SAM.NAME {name}"
            )
        wrappers = [n for n in OPTIMIZER_REGISTRY if OPTIMIZER_REGISTRY.get(n).kind != "base"]
        raise ValueError(
            f"{key} '{name}' is a base optimizer; OPTIM.SAM.NAME takes one of "
            f"{', '.join(wrappers)} (or empty for none)"
        )
    return spec


def get_optimizer_spec(optimizer: torch.optim.Optimizer) -> OptimizerSpec:
    """The spec of a built optimizer (set by build_optimizer, else looked up by class)."""
    spec = getattr(optimizer, "optim_spec", None)
    if spec is not None:
        return spec
    for name in OPTIMIZER_REGISTRY:
        spec = OPTIMIZER_REGISTRY.get(name)
        if type(optimizer) is spec.cls:
            return spec
    return OptimizerSpec(type(optimizer).__name__.lower(), type(optimizer), "unregistered")


def _param_groups(params, optim_cfg):
    """Trainable parameters as param groups; Dassl's STAGED_LR for modules."""
    if isinstance(params, nn.Module):
        module = params
        if optim_cfg.STAGED_LR:
            new_layers = optim_cfg.NEW_LAYERS
            if not new_layers:
                raise ValueError("OPTIM.STAGED_LR is True but OPTIM.NEW_LAYERS is empty")
            new_layers = [new_layers] if isinstance(new_layers, str) else list(new_layers)
            base, new = [], []
            for name, child in module.named_children():
                target = new if name in new_layers else base
                target.extend(p for p in child.parameters() if p.requires_grad)
            return [
                {"params": base, "lr": optim_cfg.LR * optim_cfg.BASE_LR_MULT},
                {"params": new},
            ]
        return [p for p in module.parameters() if p.requires_grad]
    params = list(params)
    if params and isinstance(params[0], dict):
        return params
    return [p for p in params if p.requires_grad]


def build_optimizer(cfg, params: nn.Module | Iterable) -> torch.optim.Optimizer:
    """Build the optimizer of ``cfg.OPTIM`` over ``params``.

    Args:
        cfg: the full config or its OPTIM node.
        params: a module (its trainable parameters, or STAGED_LR groups), an iterable of
            parameters, or a list of param-group dicts.

    Returns:
        A base optimizer, or a sharpness-aware wrapper (sharing the base's param groups) when
        ``OPTIM.SAM.NAME`` is set. ``optimizer.optim_spec`` holds the registry entry.
    """
    import optim  # noqa: F401  (registers the sharpness-aware optimizers)

    optim_cfg = cfg.OPTIM if hasattr(cfg, "OPTIM") else cfg
    groups = _param_groups(params, optim_cfg)
    n_params = sum(p.numel() for g in groups for p in (g["params"] if isinstance(g, dict) else [g]))
    if n_params == 0:
        raise ValueError("build_optimizer: no trainable parameters (all requires_grad=False)")
    if optim_cfg.LR <= 0:
        raise ValueError(f"OPTIM.LR must be positive, got {optim_cfg.LR}")
    base = _get(optim_cfg.NAME, "base", "OPTIM.NAME")
    base_kwargs = base.make_kwargs(optim_cfg)
    sam_name = optim_cfg.SAM.NAME if "SAM" in optim_cfg else ""
    if not sam_name:
        optimizer = base.cls(groups, **base_kwargs)
        optimizer.optim_spec = base
        logger.info("Optimizer: %s over %s parameters", base.name, f"{n_params:,}")
        return optimizer
    spec = _get(sam_name, "sharpness", "OPTIM.SAM.NAME")
    kwargs = {h.kwarg: optim_cfg.SAM[h.key] for h in spec.hparams}
    optimizer = spec.cls(groups, base_optimizer=base.cls, **kwargs, **base_kwargs)
    optimizer.optim_spec = spec
    logger.info(
        "Optimizer: %s(%s) over %s parameters, %s",
        spec.name,
        base.name,
        f"{n_params:,}",
        ", ".join(f"{k}={v}" for k, v in kwargs.items()),
    )
    return optimizer


def list_optimizers(kind: str | None = None) -> list[OptimizerSpec]:
    """The registered optimizers (of ``kind`` "base" or "sharpness" if given)."""
    import optim  # noqa: F401

    specs = [OPTIMIZER_REGISTRY.get(n) for n in OPTIMIZER_REGISTRY]
    return [s for s in specs if kind is None or s.kind == kind]


def sam_hparams() -> list[HParam]:
    """Every declared OPTIM.SAM hyper-parameter (the built-in optimizers' and plugins')."""
    import optim  # noqa: F401  (declares the built-in optimizers' keys)

    return list(SAM_HPARAMS.values())


def add_optimizer_keys(cfg) -> None:
    """Add every declared OPTIM.SAM hyper-parameter (its default) that the config lacks: the
    OPTIM.SAM node's hyper-parameter keys are declared in optim/, next to their optimizers."""
    for h in sam_hparams():
        if h.key not in cfg.OPTIM.SAM:
            cfg.OPTIM.SAM[h.key] = h.default
