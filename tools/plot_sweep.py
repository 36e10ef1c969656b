"""Accuracy and coefficient of variation across seeds against rho and lambda (the paper's Fig. 3).

The runs are those of a sweep grid, given as to ``tools/grid.py`` (default ``--preset sweep``:
``sweep-rho`` = CoOp, CoCoOp, MaPLe x SAM, F-SAM, SAGM, SAMPLe x ``OPTIM.SAM.RHO`` values, and
``sweep-lambda`` = the same trainers x F-SAM, SAMPLe x ``OPTIM.SAM.LAMBDA`` values, base-to-new
on ImageNet, seeds 1 2 3; ``--sweep KEY V1 V2 ...`` sets other values, ``--trainers/--optims/
--datasets/--seeds`` narrow the grid). Results are read with ``tools/parse_results.py``.

One column per swept key, dataset and trainer; lines per optimizer. Top row: the seed mean of
``--metric`` (``base``: the training run's accuracy on the base classes, ``new``: the evaluation on
the new classes, ``hm``: their harmonic mean per seed; default ``hm``) with the seed std as error
bars; bottom row: the coefficient of variation std / mean across seeds (population std, as in
``parse_results.py``), in percent. A point averaged over fewer seeds than the grid asks for is
drawn hollow and listed. The numbers are printed and saved as ``<out>.json``.

Examples::

    python tools/grid.py --preset sweep --data DATA             # run the sweep first
    python tools/plot_sweep.py --preset sweep --out plots/sweep.png
    python tools/plot_sweep.py --preset sweep-rho --trainers CoOp --metric new \\
        --sweep OPTIM.SAM.RHO 0.02 0.05 0.1 --output output
"""

from __future__ import annotations

import argparse
import os.path as osp
import statistics
import sys
from dataclasses import dataclass

if __package__ in (None, ""):  # run as a script
    import _repo  # noqa: F401

from experiments.grid_plan import expand  # noqa: E402
from experiments.plotting import color_of, pyplot, save_figure, write_json  # noqa: E402
from experiments.protocols import Chain, ProtocolError  # noqa: E402
from experiments.results import SeedStats, collect_seeds  # noqa: E402
from tools.grid import GridError, add_grid_args, grids_from_args, setup_from_args  # noqa: E402

METRICS = ("base", "new", "hm")


@dataclass
class Point:
    """One sweep point: the seed statistics of a metric at ``key = value``."""

    key: str
    value: float
    trainer: str
    optim: str
    dataset: str
    stats: SeedStats

    @property
    def cv(self) -> float | None:
        """Coefficient of variation std / mean in percent (None without a non-zero mean)."""
        if not self.stats.n or not self.stats.mean:
            return None
        return 100.0 * self.stats.std / self.stats.mean


def harmonic_stats(base: SeedStats, new: SeedStats) -> SeedStats:
    """Per-seed harmonic means of base and new accuracy (a seed missing in either is missing)."""
    hm = SeedStats()
    seeds = set()
    for stats in (base, new):
        seeds |= set(stats.values) | set(stats.missing) | set(stats.failed)
    for seed in sorted(seeds):
        b, n = base.values.get(seed), new.values.get(seed)
        if b is not None and n is not None:
            hm.values[seed] = 0.0 if b + n == 0 else 2 * b * n / (b + n)
        elif seed in base.missing or seed in new.missing:
            hm.missing.append(seed)
        else:
            hm.failed.append(seed)
    return hm


def chain_variant(chain: Chain) -> tuple[str, float] | None:
    """``(key, value)`` of a chain's one-key sweep variant, None for chains outside a sweep."""
    variant = chain.train.variant
    if len(variant) != 2:
        return None
    try:
        return variant[0], float(variant[1])
    except ValueError as e:
        raise GridError(f"Sweep value {variant[1]!r} of {variant[0]} is not a number") from e


def metric_stats(chains: dict[int, Chain], metric: str) -> SeedStats:
    """The seed statistics of ``metric`` over ``{seed: chain}`` (base-to-new chains)."""
    base = collect_seeds({s: c.train.out_dir for s, c in chains.items()}, "train")
    if metric == "base":
        return base
    evals = {s: c.evals[0].out_dir for s, c in chains.items() if c.evals}
    if any(c.train.protocol != "base2new" for c in chains.values()) or len(evals) < len(chains):
        raise GridError(f"--metric {metric} needs base-to-new runs; use --metric base")
    new = collect_seeds(evals, "eval")
    return new if metric == "new" else harmonic_stats(base, new)


def sweep_points(chains: list[Chain], metric: str) -> list[Point]:
    """The sweep points of ``chains`` (chains without a one-key variant are skipped)."""
    if metric not in METRICS:
        raise ValueError(f"Unknown metric {metric!r}: one of {', '.join(METRICS)}")
    groups: dict[tuple, dict[int, Chain]] = {}
    for chain in chains:
        kv = chain_variant(chain)
        if kv is None:
            continue
        run = chain.train
        groups.setdefault((kv[0], run.trainer, run.optim, run.dataset, kv[1]), {})[run.seed] = chain
    if not groups:
        raise GridError(
            "The grid has no sweep: use --preset sweep, sweep-rho or sweep-lambda, or "
            "--sweep KEY V1 V2 ..."
        )
    return [
        Point(key, value, trainer, optim, dataset, metric_stats(by_seed, metric))
        for (key, trainer, optim, dataset, value), by_seed in groups.items()
    ]


def panels(points: list[Point]) -> list[tuple[str, str, str]]:
    """``(key, dataset, trainer)`` of each figure column, in the grid's order."""
    return list(dict.fromkeys((p.key, p.dataset, p.trainer) for p in points))


def key_name(key: str) -> str:
    return {"RHO": "rho", "LAMBDA": "lambda", "ALPHA": "alpha"}.get(
        key.rsplit(".", 1)[-1], key.rsplit(".", 1)[-1].lower()
    )


def choose_xscale(values: list[float]) -> str:
    """``log`` for positive values spaced more evenly by ratio than by difference (0.01 0.02
    0.05 0.1 0.2), else ``linear`` (0.05 0.15 0.3 0.5 0.7 0.9)."""
    xs = sorted(set(values))
    if len(xs) < 3 or xs[0] <= 0:
        return "linear"

    def spread(steps: list[float]) -> float:
        return statistics.pstdev(steps) / statistics.fmean(steps)

    ratios = [b / a for a, b in zip(xs, xs[1:])]
    diffs = [b - a for a, b in zip(xs, xs[1:])]
    return "log" if spread(ratios) < spread(diffs) else "linear"


def plot_sweep(points: list[Point], out: str, metric: str, xscale: str = "auto") -> str:
    """Accuracy (top) and coefficient of variation (bottom) per column of :func:`panels`."""
    plt = pyplot()
    columns = panels(points)
    fig, axes = plt.subplots(
        2, len(columns), figsize=(4.2 * len(columns), 6.4), squeeze=False, sharex="col"
    )
    for col, (key, dataset, trainer) in enumerate(columns):
        acc_ax, cv_ax = axes[0][col], axes[1][col]
        mine = [p for p in points if (p.key, p.dataset, p.trainer) == (key, dataset, trainer)]
        optims = list(dict.fromkeys(p.optim for p in mine))
        for i, optim in enumerate(optims):
            line = sorted(
                (p for p in mine if p.optim == optim and p.stats.n), key=lambda p: p.value
            )
            if not line:
                continue
            color = color_of(optim, i)
            xs = [p.value for p in line]
            acc_ax.errorbar(
                xs,
                [p.stats.mean for p in line],
                yerr=[p.stats.std for p in line],
                color=color,
                marker="o",
                capsize=3,
                label=optim,
            )
            cv_ax.plot(xs, [p.cv for p in line], color=color, marker="o", label=optim)
            partial = [p for p in line if not p.stats.complete]
            for ax, ys in (
                (acc_ax, [p.stats.mean for p in partial]),
                (cv_ax, [p.cv for p in partial]),
            ):
                ax.plot([p.value for p in partial], ys, "o", color="w", mec=color, ms=5)
        xs = sorted({p.value for p in mine})
        cv_ax.set_xscale(choose_xscale(xs) if xscale == "auto" else xscale)
        cv_ax.set_xticks(xs, [f"{x:g}" for x in xs])
        cv_ax.minorticks_off()
        acc_ax.set_title(f"{trainer} on {dataset}: {key_name(key)}", fontsize=10)
        acc_ax.set_ylabel(f"{metric} accuracy (%)" if col == 0 else "")
        cv_ax.set_ylabel("coefficient of variation (%)" if col == 0 else "")
        cv_ax.set_xlabel(key_name(key))
        for ax in (acc_ax, cv_ax):
            ax.grid(alpha=0.3)
        acc_ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, out)


def point_rows(points: list[Point]) -> list[dict]:
    def r(v):
        return None if v is None else round(v, 4)

    return [
        {
            "key": p.key,
            "value": p.value,
            "trainer": p.trainer,
            "optimizer": p.optim,
            "dataset": p.dataset,
            "mean": r(p.stats.mean),
            "std": r(p.stats.std),
            "cv_percent": r(p.cv),
            "seeds": p.stats.describe(),
            "values": {str(s): v for s, v in p.stats.values.items()},
        }
        for p in sorted(points, key=lambda p: (p.key, p.dataset, p.trainer, p.optim, p.value))
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_grid_args(parser)
    parser.add_argument("--metric", choices=METRICS, default="hm", help="default: hm")
    parser.add_argument("--out", default="sweep.png", help="the PNG (default sweep.png)")
    parser.add_argument(
        "--xscale", choices=("auto", "linear", "log"), default="auto", help="default: auto"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.preset and not args.trainers:
        args.preset = "sweep"
    try:
        chains = expand(grids_from_args(args), setup_from_args(args))
        points = sweep_points(chains, args.metric)
        if not any(p.stats.n for p in points):
            raise GridError(
                f"No results yet in {args.output} for this sweep: run it first with "
                "tools/grid.py and the same grid options (--dry-run lists its folders)"
            )
        path = plot_sweep(points, args.out, args.metric, args.xscale)
    except (GridError, ProtocolError, ValueError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    from tabulate import tabulate

    rows = point_rows(points)
    heads = [
        "key",
        "value",
        "trainer",
        "optimizer",
        "dataset",
        "mean",
        "std",
        "cv_percent",
        "seeds",
    ]
    print(tabulate([[row[h] for h in heads] for row in rows], headers=heads))
    json_path = write_json(
        {"metric": args.metric, "points": rows}, osp.splitext(args.out)[0] + ".json"
    )
    print(f"wrote {path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
