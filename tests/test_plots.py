"""The analysis plots show every curve and readable panels: a curve identical to another is drawn
dashed and named so in the legend; no two panels' labels or tick labels overlap; methods are
named as in the tables (experiments/plotting.py, tools/loss_landscape.py,
tools/plot_alignment.py)."""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pytest

from experiments.plotting import mark_identical, pyplot, run_label
from tools import loss_landscape, plot_alignment

LABELS = ["CoOp", "CoOp+SAM", "CoOp+SAGM", "CoOp+SAMPLe"]
OPTIMS = ["sgd", "sam", "sagm", "sample"]


def landscape_result() -> dict:
    """Four runs; SAMPLe's landscape equals SAGM's (as on the demo's small world)."""
    a = np.linspace(-1, 1, 9)
    x, y = np.meshgrid(a, a, indexing="ij")
    runs = []
    for k, (label, optim) in enumerate(zip(LABELS, OPTIMS)):
        width = 1.0 + 0.5 * min(k, 2)  # sagm (k=2) and sample (k=3): the same
        runs.append(
            {
                "label": label,
                "optim": optim,
                "loss_1d": list(1.0 + width * a**2),
                "loss_2d": (1.0 + width * (x**2 + 0.5 * y**2)).tolist(),
            }
        )
    return {"alphas_1d": list(a), "alphas_2d": list(a), "runs": runs}


def overlapping_panels(fig) -> list[tuple[int, int]]:
    """Pairs of visible axes (panels, colorbars) whose tight bounding boxes - tick labels, axis
    labels and titles included - overlap."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    axes = [ax for ax in fig.axes if ax.get_visible()]
    boxes = [ax.get_tightbbox(renderer) for ax in axes]
    return [(i, j) for i, j in combinations(range(len(boxes)), 2) if boxes[i].overlaps(boxes[j])]


def hidden_legend_entries(ax) -> list[str]:
    """Legend entries whose curve lies under a later identical curve drawn the same way, or
    whose later twin does not say that it is identical."""
    lines = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [ln.get_label() for ln in lines]
    bad = []
    for i, a in enumerate(lines):
        for b in lines[i + 1 :]:
            if a.get_xydata().shape == b.get_xydata().shape and np.allclose(
                a.get_xydata(), b.get_xydata()
            ):
                marked = f"(identical to {a.get_label()})" in b.get_label()
                if not marked or a.get_linestyle() == b.get_linestyle():
                    bad.append(a.get_label())
    return bad


def test_mark_identical():
    labels, styles = mark_identical(["a", "b", "c"], [[1, 2], [1, 2.0000000001], [1, 3]])
    assert labels == ["a", "b (identical to a)", "c"] and styles == ["-", "--", "-"]


def test_loss_1d_shows_every_curve_and_names_the_methods_as_the_tables():
    fig = loss_landscape.figure_1d(landscape_result())
    (ax,) = fig.axes
    assert not hidden_legend_entries(ax)
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert texts == [*LABELS[:3], "CoOp+SAMPLe (identical to CoOp+SAGM)"]
    pyplot().close(fig)
    # without the mark, the check finds the hidden curve
    fig, ax = pyplot().subplots()
    for label in ("CoOp+SAGM", "CoOp+SAMPLe"):
        ax.plot([0, 1], [1, 2], label=label)
    ax.legend()
    assert hidden_legend_entries(ax) == ["CoOp+SAGM"]
    pyplot().close(fig)


@pytest.mark.parametrize("n_runs", [2, 4])
def test_loss_2d_panels_do_not_overlap(n_runs):
    result = landscape_result()
    result["runs"] = result["runs"][:n_runs]
    fig = loss_landscape.figure_2d(result)
    assert not overlapping_panels(fig)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible() and ax.get_title()]
    assert titles[:2] == LABELS[:2]
    pyplot().close(fig)


def test_the_overlap_check_finds_overlapping_labels():
    fig, axes = pyplot().subplots(1, 2, figsize=(3, 2))
    for ax in axes:
        ax.set_yticks([0, 1], ["a very long tick label", "another long one"])
        ax.set_ylabel("direction 2")
    assert overlapping_panels(fig)
    pyplot().close(fig)


def test_alignment_shows_every_curve(monkeypatch, tmp_path):
    figures = []

    def keep(fig, path, dpi=150):
        figures.append(fig)
        return path

    monkeypatch.setattr(plot_alignment, "save_figure", keep)
    steps = range(1, 61)
    rng = np.random.default_rng(0)
    shared = {s: {"align/cos": float(v)} for s, v in zip(steps, rng.normal(size=60))}
    other = {s: {"align/cos": float(v)} for s, v in zip(steps, rng.normal(size=60))}
    runs = [
        {"label": "CoOp+SAM", "optim": "sam", "scalars": other},
        {"label": "CoOp+SAGM", "optim": "sagm", "scalars": shared},
        {"label": "CoOp+SAMPLe", "optim": "sample", "scalars": dict(shared)},
    ]
    plot_alignment.plot_alignment(runs, ["align/cos"], str(tmp_path / "a.png"))
    (fig,) = figures
    curve_ax = fig.axes[0]
    assert not hidden_legend_entries(curve_ax)
    assert "CoOp+SAMPLe (identical to CoOp+SAGM)" in [
        t.get_text() for t in curve_ax.get_legend().get_texts()
    ]
    assert not overlapping_panels(fig)
    pyplot().close(fig)


def test_run_labels_are_the_tables_names():
    cfg = {"TRAINER": {"NAME": "CoOp"}, "OPTIM": {"SAM": {"NAME": "sample"}}}
    assert run_label(cfg) == "CoOp+SAMPLe"
    assert run_label({"TRAINER": {"NAME": "CoOp"}, "OPTIM": {"SAM": {"NAME": ""}}}) == "CoOp"
