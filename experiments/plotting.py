"""Shared helpers of the analysis tools: matplotlib (Agg), run folders, labels and colours.

Used by ``tools/loss_landscape.py``, ``tools/plot_alignment.py`` and ``tools/plot_sweep.py``.
"""

from __future__ import annotations

import json
import os
import os.path as osp

import numpy as np
import yaml

# One colour per optimizer setting, the same in every plot (matplotlib's tab10 colours).
OPTIM_COLORS = {
    "sgd": "tab:gray",
    "sam": "tab:blue",
    "fsam": "tab:green",
    "sagm": "tab:orange",
    "sample": "tab:red",
}
_EXTRA_COLORS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, dpi: int = 150) -> str:
    """Save ``fig`` as ``path`` (folders created), close it and return the path."""
    folder = osp.dirname(osp.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    pyplot().close(fig)
    return path


def write_json(obj, path: str) -> str:
    """Write ``obj`` as indented JSON to ``path`` (folders created); returns the path."""
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    return path


def color_of(name: str, index: int = 0) -> str:
    """The colour of an optimizer name (``sample``), else one picked by ``index``."""
    return OPTIM_COLORS.get(name, _EXTRA_COLORS[index % len(_EXTRA_COLORS)])


def mark_identical(labels: list[str], series: list) -> tuple[list[str], list[str]]:
    """``(legend labels, line styles)`` of curves drawn in order: a curve whose values equal an
    earlier one's (to 1e-6 relative) would hide it, so it is drawn dashed and its label says
    ``"X (identical to Y)"``; the others keep their label and a solid line."""
    arrays = [np.asarray(v, dtype=float) for v in series]
    out_labels, styles = [], []
    for i, (label, values) in enumerate(zip(labels, arrays)):
        same = next(
            (
                labels[j]
                for j in range(i)
                if arrays[j].shape == values.shape
                and np.allclose(arrays[j], values, rtol=1e-6, atol=1e-9, equal_nan=True)
            ),
            None,
        )
        out_labels.append(label if same is None else f"{label} (identical to {same})")
        styles.append("-" if same is None else "--")
    return out_labels, styles


def run_colors(optims: list[str]) -> list[str]:
    """Colours of runs: by optimizer when each run has its own, else one per run (tab10)."""
    if len(set(optims)) == len(optims):
        return [color_of(o, i) for i, o in enumerate(optims)]
    return [f"C{i % 10}" for i in range(len(optims))]


def read_run_config(run_dir: str) -> dict:
    """The ``config.yaml`` that train.py wrote into a run folder, as a dict."""
    if not osp.isdir(run_dir):
        raise FileNotFoundError(f"Run folder not found: {run_dir}")
    path = osp.join(run_dir, "config.yaml")
    if not osp.isfile(path):
        raise FileNotFoundError(
            f"{run_dir} has no config.yaml: give a run folder written by train.py "
            "(e.g. output/base2new/train_base/dtd/shots_16/CoOp/vit_b16_ctxv1+sample/seed1)"
        )
    with open(path) as f:
        return yaml.safe_load(f) or {}


def optimizer_name(cfg: dict) -> str:
    """The optimizer setting of a run config: ``OPTIM.SAM.NAME``, else ``sgd`` (the base)."""
    optim = cfg.get("OPTIM") or {}
    return (optim.get("SAM") or {}).get("NAME") or "sgd"


def run_label(cfg: dict) -> str:
    """The tables' name of a run config's method, e.g. ``CoOp+SAMPLe`` (``CoOp`` for SGD)."""
    from experiments.paper_results import row_title

    trainer = (cfg.get("TRAINER") or {}).get("NAME") or "?"
    return row_title(trainer, optimizer_name(cfg))


def run_labels(run_dirs: list[str], labels: list[str] | None = None) -> list[str]:
    """Unique labels for run folders: ``labels`` if given, else the tables' method names
    (``CoOp+SAMPLe``, :func:`run_label`).

    Runs that share a label get their seed appended; runs that still share one are named by
    their folder path below the common parent.
    """
    if labels:
        if len(labels) != len(run_dirs):
            raise ValueError(f"--labels: {len(labels)} labels for {len(run_dirs)} runs")
        return list(labels)
    cfgs = [read_run_config(d) for d in run_dirs]
    names = [run_label(c) for c in cfgs]
    if len(set(names)) < len(names):
        names = [f"{n} seed{c.get('SEED', '?')}" for n, c in zip(names, cfgs)]
    if len(set(names)) < len(names):
        full = [osp.abspath(d) for d in run_dirs]
        common = osp.commonpath(full) if len(full) > 1 else osp.dirname(full[0])
        names = [osp.relpath(p, osp.dirname(common) if p == common else common) for p in full]
    return names
