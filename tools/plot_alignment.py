"""Per-step optimizer diagnostics over training, split into stages (the paper's Figure 2).

Reads ``scalars.jsonl`` of one or more run folders (the engine writes a row per step:
``train/loss``, ``train/lr`` and, for sharpness-aware optimizers, ``train/grad_norm`` ||g||,
``train/grad_p_norm`` ||g_p||, ``train/cos_g_gp`` cos(g, g_p); F-SAM and SAMPLe add
``train/ema_norm`` ||m||, ``train/xi`` cos(g, m), ``train/gb_norm`` ||g_B|| and
``train/cos_gp_m`` cos(g_p, m), the alignment with the moving average). One row per metric:

- left: the metric over the training steps, raw (faint) and smoothed by a moving average
  (``--smooth`` steps; default 1/25 of the run's steps);
- right: its distribution in the early, middle and late stage of training (box plots): the
  stages are thirds (``--stages N``: N equal parts) of the steps at which the run logged it, so a
  staged run (``OPTIM.SAM.STAGE2_EPOCHS`` or ``START_EPOCH``) is split over its sharpness-aware
  steps.

Runs of different optimizers can be compared: a metric that a run did not log (SAM logs no
``ema_norm``, SGD no diagnostics at all) is left out for that run; a metric that no run logged
is dropped. Resumed runs append to ``scalars.jsonl``: a later row for the same step replaces the
earlier one. A summary (mean, median and std per run, metric and stage) is printed and saved as
``<out>.json``.

Examples::

    python tools/plot_alignment.py RUN_SAM RUN_SAMPLE --out plots/alignment.png
    python tools/plot_alignment.py RUN --metrics cos_g_gp cos_gp_m xi --stages 4 --smooth 20
"""

from __future__ import annotations

import argparse
import json
import os.path as osp
import statistics
import sys

if __package__ in (None, ""):  # run as a script
    import _repo  # noqa: F401

import numpy as np  # noqa: E402

from experiments.plotting import (  # noqa: E402
    mark_identical,
    optimizer_name,
    pyplot,
    read_run_config,
    run_colors,
    run_labels,
    save_figure,
    write_json,
)

# metric (the key without "train/") -> axis title
METRICS = {
    "cos_g_gp": "cos(g, g_p): gradient vs perturbed gradient",
    "cos_gp_m": "cos(g_p, m): perturbed gradient vs moving average",
    "xi": "xi = cos(g, m): gradient vs moving average",
    "grad_norm": "||g||",
    "grad_p_norm": "||g_p||",
    "gb_norm": "||g_B||: batch-specific gradient",
    "ema_norm": "||m||: moving average",
    "loss": "training loss",
    "lr": "learning rate",
}
DEFAULT_METRICS = ("cos_g_gp", "cos_gp_m", "xi", "grad_norm", "grad_p_norm", "gb_norm")
STAGE_NAMES = {3: ("early", "middle", "late")}


def read_scalars(run_dir: str) -> dict[int, dict[str, float]]:
    """``{step: {metric: value}}`` of the ``train/`` scalars in ``run_dir/scalars.jsonl``.

    Rows are merged per step in file order, so a resumed run's later rows for a step replace
    the earlier ones; non-``train/`` scalars (evaluation results, logged per epoch) are skipped.
    """
    path = osp.join(run_dir, "scalars.jsonl")
    if not osp.isfile(path):
        raise FileNotFoundError(
            f"{run_dir} has no scalars.jsonl: give a run folder written by train.py (the engine "
            "writes scalars.jsonl while training)"
        )
    steps: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                step = int(row["step"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: not a scalars row ({e}): {line[:80]}") from e
            values = {k[len("train/") :]: v for k, v in row.items() if k.startswith("train/")}
            if values:
                steps.setdefault(step, {}).update(values)
    return steps


def series(scalars: dict[int, dict[str, float]], metric: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of one metric, sorted by step (empty if never logged)."""
    pairs = sorted((s, row[metric]) for s, row in scalars.items() if metric in row)
    steps = np.array([p[0] for p in pairs], dtype=np.int64)
    return steps, np.array([p[1] for p in pairs], dtype=np.float64)


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average over ``window`` values (shorter at the start)."""
    if window <= 1 or len(values) == 0:
        return values
    cumsum = np.cumsum(np.insert(values, 0, 0.0))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (cumsum[ends] - cumsum[starts]) / (ends - starts)


def stage_names(n: int) -> tuple[str, ...]:
    return STAGE_NAMES.get(n, tuple(f"stage {i + 1}" for i in range(n)))


def split_stages(values: np.ndarray, n: int) -> list[np.ndarray]:
    """``values`` cut into ``n`` consecutive parts of (nearly) equal length."""
    return list(np.array_split(values, n))


def stage_summary(parts: list[np.ndarray], names: tuple[str, ...]) -> dict:
    out = {}
    for name, part in zip(names, parts):
        finite = [float(v) for v in part if np.isfinite(v)]
        out[name] = {
            "steps": len(part),
            "mean": statistics.fmean(finite) if finite else None,
            "median": statistics.median(finite) if finite else None,
            "std": statistics.pstdev(finite) if finite else None,
        }
    return out


def plot_alignment(
    runs: list[dict], metrics: list[str], out: str, stages: int = 3, window: int | None = None
) -> tuple[str, dict]:
    """Draw the figure; ``runs`` are ``{"label", "optim", "scalars"}``. Returns (path, summary)."""
    plt = pyplot()
    names = stage_names(stages)
    fig, axes = plt.subplots(
        len(metrics), 2, figsize=(12, 2.8 * len(metrics)), squeeze=False, width_ratios=(3, 2)
    )
    summary: dict = {}
    colors = run_colors([r["optim"] for r in runs])
    for row, metric in enumerate(metrics):
        curve_ax, box_ax = axes[row]
        have = [(i, r, *series(r["scalars"], metric)) for i, r in enumerate(runs)]
        have = [h for h in have if len(h[2])]
        width = 0.8 / max(len(have), 1)
        # a run whose curve equals an earlier one's is dashed and named so (it would hide it)
        labels, styles = mark_identical(
            [h[1]["label"] for h in have], [np.stack([h[2], h[3]]) for h in have]
        )
        for k, (i, run, steps, values) in enumerate(have):
            color = colors[i]
            w = window or max(1, len(values) // 25)
            curve_ax.plot(steps, values, color=color, alpha=0.25, lw=0.8, ls=styles[k])
            curve_ax.plot(
                steps, smooth(values, w), color=color, lw=1.8, label=labels[k], ls=styles[k]
            )
            parts = split_stages(values, stages)
            summary.setdefault(run["label"], {})[metric] = stage_summary(parts, names)
            positions = np.arange(stages) + (k - (len(have) - 1) / 2) * width
            kept = [(p, v[np.isfinite(v)]) for p, v in zip(positions, parts)]
            kept = [(p, v) for p, v in kept if len(v)]
            if kept:
                box = box_ax.boxplot(
                    [v for _, v in kept],
                    positions=[p for p, _ in kept],
                    widths=width * 0.9,
                    patch_artist=True,
                    manage_ticks=False,
                    flierprops={"markersize": 2},
                )
                for patch in box["boxes"]:
                    patch.set(facecolor=color, alpha=0.6)
                for median in box["medians"]:
                    median.set(color="k")
        curve_ax.set_title(METRICS.get(metric, metric), fontsize=10)
        curve_ax.set_xlabel("step")
        curve_ax.grid(alpha=0.3)
        curve_ax.legend(fontsize=8)
        box_ax.set_xticks(range(stages), names)
        box_ax.set_xlim(-0.5, stages - 0.5)
        box_ax.set_title(f"{metric} by stage of training", fontsize=10)
        box_ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return save_figure(fig, out), summary


def load_runs(run_dirs: list[str], labels: list[str] | None = None) -> list[dict]:
    """``[{"run_dir", "label", "optim", "scalars"}]`` of the run folders."""
    names = run_labels(run_dirs, labels)
    runs = []
    for run_dir, label in zip(run_dirs, names):
        scalars = read_scalars(run_dir)
        if not scalars:
            raise ValueError(f"{run_dir}/scalars.jsonl holds no training scalars")
        optim = optimizer_name(read_run_config(run_dir))
        runs.append({"run_dir": run_dir, "label": label, "optim": optim, "scalars": scalars})
    return runs


def available_metrics(runs: list[dict], wanted: list[str]) -> list[str]:
    """The ``wanted`` metrics that at least one run logged (an error if none)."""
    logged = {k for r in runs for row in r["scalars"].values() for k in row}
    have = [m for m in wanted if m in logged]
    if not have:
        raise ValueError(
            f"None of the runs logged {', '.join(wanted)}: the diagnostics come from "
            "sharpness-aware optimizers (OPTIM.SAM.NAME sam/fsam/sagm/sample; plain SGD logs "
            f"none). Logged: {', '.join(sorted(logged))}"
        )
    missing = [m for m in wanted if m not in logged]
    if missing:
        print(f"note: no run logged {', '.join(missing)}: left out")
    return have


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("runs", nargs="+", help="train.py run folders (with scalars.jsonl)")
    parser.add_argument("--labels", nargs="+", help="legend labels (default: Trainer+optimizer)")
    parser.add_argument("--out", default="alignment.png", help="the PNG (default alignment.png)")
    parser.add_argument(
        "--metrics",
        nargs="+",
        default=list(DEFAULT_METRICS),
        help=f"metrics, of {', '.join(METRICS)} (default: {' '.join(DEFAULT_METRICS)})",
    )
    parser.add_argument("--stages", type=int, default=3, help="stages of training (default 3)")
    parser.add_argument("--smooth", type=int, help="moving-average window in steps")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.stages < 1:
            raise ValueError(f"--stages must be >= 1, got {args.stages}")
        runs = load_runs(args.runs, args.labels)
        metrics = available_metrics(runs, args.metrics)
        path, summary = plot_alignment(runs, metrics, args.out, args.stages, args.smooth)
    except (ValueError, FileNotFoundError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    from tabulate import tabulate

    rows = [
        (label, metric, stage, s["steps"], s["mean"], s["median"], s["std"])
        for label, per_metric in summary.items()
        for metric, per_stage in per_metric.items()
        for stage, s in per_stage.items()
    ]
    print(tabulate(rows, headers=["run", "metric", "stage", "steps", "mean", "median", "std"]))
    json_path = write_json(summary, osp.splitext(args.out)[0] + ".json")
    print(f"wrote {path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
