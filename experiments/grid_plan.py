"""A grid's plan: the paper's presets, sub-grids (trainers x optimizers x datasets x seeds x
protocols) and their expansion into chains of runs, in each reproduction mode (the library of
``tools/grid.py``, which executes the plan)."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, replace

from experiments.few_shot import FEW_SHOTS, check_shots, few_shot_chain, merge_training
from experiments.grid_exec import GridError
from experiments.paper_results import (
    BASE2NEW_DATASETS,
    EFFICIENT_OPTIMIZERS,
    EXTRA_TRAINERS,
    OPTIMIZERS,
    TRAINERS,
)
from experiments.protocols import (
    PROTOCOLS,
    REPRO_MODES,
    TARGETS,
    Chain,
    ProtocolError,
    Setup,
    base2new_chain,
    transfer_chain,
)


@dataclass(frozen=True)
class SubGrid:
    """One rectangular block of a grid (defaults: the paper's datasets, targets and seeds).

    ``variants``: the points of a sweep, each a tuple of KEY VALUE options given to every run of
    a chain and named in its folder tag (``experiments/protocols.py``); ``((),)``: no sweep.
    ``shots``: the shots of the ``few_shot`` protocol (the others take ``Setup.shots``).
    """

    protocols: tuple[str, ...]
    trainers: tuple[str, ...]
    optims: tuple[str, ...]
    datasets: tuple[str, ...] = BASE2NEW_DATASETS
    seeds: tuple[int, ...] = (1, 2, 3)
    xd_targets: tuple[str, ...] = TARGETS["cross_dataset"]
    dg_targets: tuple[str, ...] = TARGETS["domain_gen"]
    variants: tuple[tuple[str, ...], ...] = ((),)
    shots: tuple[int, ...] = FEW_SHOTS


def sweep_variants(key: str, values) -> tuple[tuple[str, ...], ...]:
    """One variant per value of config ``key``: ``((key, v1), (key, v2), ...)``."""
    return tuple((key, str(v)) for v in values)


_TRANSFER = ("cross_dataset", "domain_gen")
# The sweeps of the paper's Figure 3 (ImageNet; CoOp, CoCoOp, MaPLe). The paper does not list
# its values: these span its deployed rho (0.05/0.10) and lambda (0.15) on both sides.
SWEEP_RHO = (0.01, 0.02, 0.05, 0.1, 0.2)
SWEEP_LAMBDA = (0.05, 0.15, 0.3, 0.5, 0.7, 0.9)
_SWEEP = {
    "protocols": ("base2new",),
    "trainers": ("CoOp", "CoCoOp", "MaPLe"),
    "datasets": ("imagenet",),
}
PRESETS = {
    "paper-base2new": (SubGrid(("base2new",), TRAINERS, OPTIMIZERS),),
    "paper-transfer": (SubGrid(_TRANSFER, TRAINERS, ("sgd", "sample")),),
    "paper-ablation": (SubGrid(("base2new",), ("CoPrompt",), ("sgd", "sam", "sagm", "sample")),),
    # the paper's protocols for the trainers it has no numbers for (KgCoOp, IVLP, PromptSRC,
    # SkipTuning)
    "extra-base2new": (SubGrid(("base2new",), EXTRA_TRAINERS, OPTIMIZERS),),
    "extra-transfer": (SubGrid(_TRANSFER, EXTRA_TRAINERS, ("sgd", "sample")),),
    "sweep-rho": (
        SubGrid(
            optims=("sam", "fsam", "sagm", "sample"),
            variants=sweep_variants("OPTIM.SAM.RHO", SWEEP_RHO),
            **_SWEEP,
        ),
    ),
    "sweep-lambda": (
        SubGrid(
            optims=("fsam", "sample"),
            variants=sweep_variants("OPTIM.SAM.LAMBDA", SWEEP_LAMBDA),
            **_SWEEP,
        ),
    ),
}
PRESETS["efficient-base2new"] = (SubGrid(("base2new",), TRAINERS, EFFICIENT_OPTIMIZERS),)
PRESETS["efficient-transfer"] = (SubGrid(_TRANSFER, TRAINERS, EFFICIENT_OPTIMIZERS),)
PRESETS["efficient"] = PRESETS["efficient-base2new"] + PRESETS["efficient-transfer"]
PRESETS["paper"] = PRESETS["paper-base2new"] + PRESETS["paper-transfer"]
PRESETS["extra"] = PRESETS["extra-base2new"] + PRESETS["extra-transfer"]
PRESETS["sweep"] = PRESETS["sweep-rho"] + PRESETS["sweep-lambda"]
# DePT over its four base learners (trainers/dept.py; published numbers in experiments/published/)
DEPT_TRAINERS = ("DePT_CoOp", "DePT_CoCoOp", "DePT_KgCoOp", "DePT_MaPLe")
PRESETS["dept-base2new"] = (SubGrid(("base2new",), DEPT_TRAINERS, OPTIMIZERS),)
PRESETS["dept-transfer"] = (SubGrid(_TRANSFER, DEPT_TRAINERS, ("sgd", "sample")),)
PRESETS["dept"] = PRESETS["dept-base2new"] + PRESETS["dept-transfer"]
# CoOp's few-shot setting for the trainers with a published few-shot schedule (their
# PROTOCOL_CFGS few_shot*; docs/running.md): 11 datasets x 1/2/4/8/16 shots x 3 seeds
FEW_SHOT_TRAINERS = ("CoOp", "ProGrad", "PromptSRC", "MMRL", "SkipTuning")
PRESETS["few-shot"] = (SubGrid(("few_shot",), FEW_SHOT_TRAINERS, ("sgd", "sample")),)
AXES = ("protocols", "trainers", "optims", "datasets", "seeds", "xd_targets", "dg_targets")
AXES += ("shots",)


# -- grid expansion ---------------------------------------------------------------------------
def check_seeds(seeds) -> tuple[int, ...]:
    """Any list of seeds >= 0, in the given order without repeats."""
    bad = [s for s in seeds if s < 0]
    if bad:
        raise GridError(
            f"--seeds {' '.join(map(str, bad))}: seeds must be >= 0 (a negative SEED leaves the "
            "run unseeded and not reproducible)"
        )
    return tuple(dict.fromkeys(seeds))


def select(preset: str | None, **axes) -> list[SubGrid]:
    """The sub-grids of ``preset`` restricted to the given axes, or one grid built from them.

    Args:
        preset: a key of :data:`PRESETS` or None.
        **axes: values for the fields of :class:`SubGrid` (None = not given).
    """
    given = {k: tuple(v) for k, v in axes.items() if v}
    if "seeds" in given:
        given["seeds"] = check_seeds(given["seeds"])
    if "shots" in given:
        try:
            given["shots"] = check_shots(given["shots"])
        except ProtocolError as e:
            raise GridError(str(e)) from None
    if preset is None:
        if "trainers" not in given:
            raise GridError("Choose a --preset or give --trainers (e.g. --trainers CoOp)")
        defaults = {"protocols": ("base2new",), "optims": ("sample",)}
        return [SubGrid(**{**defaults, **given})]
    if preset not in PRESETS:
        raise GridError(f"Unknown preset {preset!r}: one of {', '.join(PRESETS)}")
    grids = []
    for grid in PRESETS[preset]:
        sub = {k: tuple(x for x in getattr(grid, k) if x in given[k]) for k in given}
        for axis in ("seeds", "shots"):  # any seeds and shots, not only the preset's
            if axis in given:
                sub[axis] = given[axis]
        grids.append(replace(grid, **sub))
    kept = [g for g in grids if all(getattr(g, k) for k in ("protocols", "trainers", "optims"))]
    kept = [g for g in kept if g.datasets or not {"base2new", "few_shot"} & set(g.protocols)]
    if not kept:
        offered = {
            k: sorted({x for g in PRESETS[preset] for x in getattr(g, k)}, key=str) for k in given
        }
        raise GridError(
            f"Narrowing preset {preset!r} to {given} leaves no runs; the preset offers "
            f"{offered}. Without --preset, give the axes explicitly (e.g. --trainers CoOp "
            "--optims sample --datasets small_world)"
        )
    return kept


def expand(grids: list[SubGrid], setup: Setup) -> list[Chain]:
    """Chains of runs, one per training run (shared ImageNet trainings are merged)."""
    chains: dict[str, Chain] = {}

    def add(chain: Chain) -> None:
        have = chains.setdefault(chain.train.out_dir, Chain(chain.train))
        merge_training(have, chain)  # ImageNet: a few-shot run and the transfer training
        known = {r.out_dir for r in have.evals}
        have.evals += [r for r in chain.evals if r.out_dir not in known]

    for grid in grids:
        for protocol in grid.protocols:
            if protocol not in PROTOCOLS:
                raise GridError(f"Unknown protocol {protocol!r}: one of {', '.join(PROTOCOLS)}")
        targets = [
            ("cross_dataset", t) for t in grid.xd_targets if "cross_dataset" in grid.protocols
        ]
        targets += [("domain_gen", t) for t in grid.dg_targets if "domain_gen" in grid.protocols]
        for trainer, optim, variant in itertools.product(grid.trainers, grid.optims, grid.variants):
            if "base2new" in grid.protocols:
                for dataset in grid.datasets:
                    for seed in grid.seeds:
                        add(base2new_chain(setup, trainer, optim, dataset, seed, variant))
            if targets:
                for seed in grid.seeds:
                    add(transfer_chain(setup, trainer, optim, seed, targets, variant))
            if "few_shot" in grid.protocols:
                for dataset, shots, seed in itertools.product(
                    grid.datasets, grid.shots, grid.seeds
                ):
                    add(few_shot_chain(setup, trainer, optim, dataset, seed, shots, variant))
    return list(chains.values())


def repro_modes(args) -> list[str]:
    """The reproduction modes of a grid: ``--repro``, else ``$REPRO``, else ``paper`` (the
    default of train.py, the scripts and the demo alike)."""
    given = getattr(args, "repro", None) or os.environ.get("REPRO", "").split()
    if given:
        bad = [m for m in given if m not in REPRO_MODES]
        if bad:
            raise GridError(f"Reproduction mode {bad[0]!r} ($REPRO): one of {REPRO_MODES}")
        return list(dict.fromkeys(given))
    return ["paper"]


def expand_modes(grids: list[SubGrid], setup: Setup, modes) -> list[Chain]:
    """The chains of ``grids`` in each reproduction mode of ``modes`` (in that order)."""
    chains = []
    for mode in dict.fromkeys(modes or [setup.repro]):
        chains += expand(grids, replace(setup, repro=mode))
    return chains
