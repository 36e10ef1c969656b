"""One self-contained HTML page of a grid's results (``tools/make_tables.py --report DIR``).

``DIR/index.html`` holds, without any network access (charts are PNGs embedded as base64):

- the paired differences of each table (a - b with their intervals, ``experiments/stats.py``) as a
  chart and as tables, intervals that contain 0 marked and drawn grey;
- per base-to-new dataset, a bar chart of Base / New / HM per method (the zero-shot CLIP row
  first with ``--zeroshot``): bars are seed means on a y-axis from 0, the black whiskers the seed
  range (min to max), dots the single seeds, white diamonds the paper's numbers
  (``experiments/paper_results.py``); the same for the cross-dataset and domain generalization
  columns, and per few-shot dataset one bar per method and shots value;
- the result tables (as ``make_tables.py`` prints them, paper columns only where the paper has
  numbers) with their notes; the legend explains only what the page holds;
- every run behind the numbers with a relative link to its log file.

A small script sets ``data-report="ok"`` on ``<body>`` once the page has loaded and every chart
decoded (``"error"`` and a console error otherwise): ``tests/test_report.py`` reads it from a
headless Chromium.
"""

from __future__ import annotations

import base64
import datetime
import html
import io
import os
import os.path as osp
import urllib.parse

from experiments.few_shot import shots_metric, shots_title
from experiments.paper_results import paper_value, row_title
from experiments.plotting import color_of, pyplot
from experiments.protocols import SOURCE_DATASET, dataset_title
from experiments.results import log_files, read_run
from experiments.stats import per_seed_hm
from experiments.tables_model import (
    MARK,
    DiffCell,
    Results,
    Table,
    empty_paper_columns,
    legend,
    render_rows,
)

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1150px; color: #222; }
h1 { font-size: 1.6em; } h2 { margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: .8em 0; font-size: .85em; }
th, td { border: 1px solid #ddd; padding: 3px 7px; text-align: right; white-space: nowrap; }
th:first-child, td:first-child { text-align: left; }
th { background: #f3f3f3; } caption { text-align: left; font-weight: bold; padding: 4px 0; }
td.unresolved { color: #888; } td.resolved { font-weight: bold; }
.notes { font-size: .8em; color: #555; } .legend { background: #f8f8f8; padding: .6em 1em; }
img.chart { max-width: 100%; display: block; margin: .5em 0 1.5em; }
"""

SCRIPT = """
(function () {
  var failed = false;
  window.addEventListener("error", function (e) {
    failed = true;
    document.body.setAttribute("data-report", "error");
  });
  window.addEventListener("load", function () {
    var charts = document.querySelectorAll("img.chart");
    var broken = [];
    for (var i = 0; i < charts.length; i++) {
      if (!charts[i].complete || charts[i].naturalWidth === 0) broken.push(charts[i].alt);
    }
    document.body.setAttribute("data-charts", String(charts.length - broken.length));
    if (broken.length) {
      console.error("report: charts that did not load: " + broken.join(", "));
    }
    document.body.setAttribute("data-report", failed || broken.length ? "error" : "ok");
  });
})();
"""


# -- charts -----------------------------------------------------------------------------------
def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    pyplot().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def chart(fig, alt: str) -> str:
    """``<img class="chart">`` of a matplotlib figure, embedded as a base64 PNG."""
    return f'<img class="chart" alt="{html.escape(alt)}" src="data:image/png;base64,{_png(fig)}">'


def _seed_values(results: Results, table: str, row, dataset: str, metric: str) -> list[float]:
    """Per-seed values of one cell (HM: per-seed HM of base and new)."""
    if metric == "hm":
        base, new = (results.stats.get((table, *row, dataset, m)) for m in ("base", "new"))
        if base is None or new is None:
            return []
        return list(per_seed_hm(base.values, new.values).values())
    st = results.stats.get((table, *row, dataset, metric))
    return list(st.values.values()) if st is not None else []


def bar_figure(results: Results, table: str, rows, groups, title: str):
    """The matplotlib figure of :func:`bar_chart` (None: no row has a value), and whether it
    draws a paper's number. The y-axis starts at 0, so bar heights compare as ratios."""
    plt = pyplot()
    rows = [r for r in rows if any(_seed_values(results, table, r, d, m) for _, d, m in groups)]
    if not rows:
        return None, False
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(groups) * max(1, len(rows) / 3)), 3.4))
    highs, paper_shown = [], False
    for i, row in enumerate(rows):
        color, label = color_of(row[1], i), row_title(*row)
        for j, (_, dataset, metric) in enumerate(groups):
            x = j - 0.4 + width * (i + 0.5)
            vals = _seed_values(results, table, row, dataset, metric)
            if vals:
                mean = sum(vals) / len(vals)
                ax.bar(x, mean, width * 0.9, color=color, alpha=0.75, label=label)
                label = None  # one legend entry per method
                ax.errorbar(
                    x, mean, [[mean - min(vals)], [max(vals) - mean]], color="black", capsize=2
                )
                ax.scatter([x] * len(vals), vals, s=7, color="black", zorder=3)
                highs.append(max(vals))
            paper = paper_value(table, *row, dataset, metric)
            if paper is not None:
                style = dict(marker="D", s=28, facecolor="white", edgecolor="black", zorder=4)
                ax.scatter(x, paper, label=None if paper_shown else "paper", **style)
                paper_shown = True
                highs.append(paper)
    ax.set_xticks(range(len(groups)), [g[0] for g in groups])
    ax.set_ylim(0.0, min(100.0, max(highs) + 5))
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return fig, paper_shown


def bar_chart(results: Results, table: str, rows, groups, title: str) -> str | None:
    """Grouped bars: one group per ``(label, dataset, metric)``, one bar per method row."""
    fig, _ = bar_figure(results, table, rows, groups, title)
    return None if fig is None else chart(fig, f"{title} bar chart")


def diff_chart(table: Table) -> str | None:
    """Forest plot of a table of differences: a - b with its interval, one line per cell."""
    plt = pyplot()
    entries = []  # (label, Diff)
    for label, *cells in table.rows:
        for head, cell in zip(table.headers[1:], cells):
            if cell.diff is not None:
                entries.append((f"{head}: {label}", cell.diff))
    if not entries:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 0.8 + 0.28 * len(entries)))
    for y, (_, d) in enumerate(reversed(entries)):
        color = "tab:gray" if d.contains_zero else "tab:blue"
        if d.lo is not None:
            ax.plot([d.lo, d.hi], [y, y], color=color, lw=2)
        ax.plot(d.mean, y, "o", color=color, ms=5)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(entries)), [e[0] for e in reversed(entries)], fontsize=7)
    ax.set_xlabel("difference a - b (accuracy points); grey: the interval contains 0")
    ax.set_title(table.heading, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return chart(fig, f"{table.title} chart")


# -- HTML -------------------------------------------------------------------------------------
def table_html(table: Table, std: bool) -> str:
    """A :class:`Table` as an HTML table (cells as ``make_tables.py`` prints them; the paper
    columns of a table without published numbers left out, as there)."""
    e = html.escape
    keep = [i for i in range(len(table.headers)) if i not in empty_paper_columns(table)]
    head = "".join(f"<th>{e(table.headers[i])}</th>" for i in keep)
    is_diff = any(isinstance(c, DiffCell) for row in table.rows for c in row[1:])
    body = []
    for full in render_rows(table, std):
        row = [full[i] for i in keep]
        cells = [f"<td>{e(row[0])}</td>"]
        for text in row[1:]:
            cls = ""
            if is_diff and text != "-":
                cls = ' class="unresolved"' if MARK in text else ' class="resolved"'
            cells.append(f"<td{cls}>{e(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    notes = "".join(f"<li>{e(n)}</li>" for n in table.notes)
    return (
        f"<table><caption>{e(table.heading)}</caption><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>"
        + (f'<ul class="notes">{notes}</ul>' if notes else "")
    )


def _run_log(folder: str) -> str | None:
    result = read_run(folder)
    if result.log:
        return result.log
    logs = log_files(folder)
    return logs[-1] if logs else None


def runs_html(results: Results, out_dir: str) -> str:
    """Every run folder behind the tables, with its result and a relative link to its log."""
    e = html.escape
    rows = []
    for key in sorted(results.folders):
        table, trainer, optim, dataset, metric = key
        for seed, folder in sorted(results.folders[key].items()):
            result = read_run(folder)
            log = _run_log(folder)
            if log:
                href = urllib.parse.quote(osp.relpath(log, out_dir).replace(os.sep, "/"))
                link = f'<a href="{href}">{e(osp.basename(log))}</a>'
            else:
                link = "no log"
            acc = "-" if result.accuracy is None else f"{result.accuracy:.2f}"
            cells = [
                table,
                row_title(trainer, optim),
                dataset_title(dataset),
                metric,
                f"seed{seed}",
                result.status,
                acc,
            ]
            rows.append("".join(f"<td>{e(c)}</td>" for c in cells) + f"<td>{link}</td>")
    head = "".join(
        f"<th>{h}</th>"
        for h in ("table", "method", "dataset", "metric", "seed", "status", "acc.", "log")
    )
    return (
        f"<details><summary>{len(rows)} runs</summary><table><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(f'<tr>{r}</tr>' for r in rows)}</tbody></table></details>"
    )


def _value_charts(results: Results) -> tuple[list[str], bool]:
    """Bar charts: each base-to-new dataset (and the average's datasets), each transfer table,
    each few-shot dataset (a group per shots value); and whether any of them draws a paper's
    number."""
    figures = []
    for d in results.datasets:
        groups = [("Base", d, "base"), ("New", d, "new"), ("HM", d, "hm")]
        title = f"Base-to-new: {dataset_title(d)}"
        figures.append((bar_figure(results, "base2new", results.rows, groups, title), title))
    for table, name in (
        ("cross_dataset", "Cross-dataset"),
        ("domain_gen", "Domain generalization"),
    ):
        cols = [SOURCE_DATASET, *results.targets.get(table, [])]
        if len(cols) > 1:
            groups_ = [(dataset_title(c), c, "acc") for c in cols]
            figures.append((bar_figure(results, table, results.rows, groups_, name), name))
    fs_datasets, shots = results.few_shot
    for d in fs_datasets:
        groups = [(shots_title(s), d, shots_metric(s)) for s in shots]
        title = f"Few-shot: {dataset_title(d)}"
        figures.append((bar_figure(results, "few_shot", results.rows, groups, title), title))
    parts = [chart(fig, f"{title} bar chart") for (fig, _), title in figures if fig is not None]
    return parts, any(paper for (_, paper), _ in figures)


def chart_legend(bars: bool, paper: bool, diffs: bool) -> str:
    """How to read the charts on the page: only what it draws."""
    parts = []
    if bars:
        parts.append(
            "bars = seed means (the y-axis starts at 0), whiskers = seed range (min to max), "
            "dots = single seeds" + (", white diamonds = the paper's numbers" if paper else "")
        )
    if diffs:
        parts.append(
            f"difference charts: a - b with its interval; grey = the interval contains 0 ({MARK})"
        )
    return f"Charts: {'; '.join(parts)}." if parts else ""


def render_report(results: Results, out_dir: str, std: bool = False, title: str = "") -> str:
    """The report page as one HTML string (links relative to ``out_dir``)."""
    e = html.escape
    title = title or "Results: paired comparisons over seeds"
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    n_runs = sum(len(v) for v in results.folders.values())
    with_diffs = [t for t in results.tables if t.diffs is not None]
    diff_parts = []
    for t in with_diffs:
        img = diff_chart(t.diffs)
        diff_parts += ([img] if img else []) + [table_html(t.diffs, std)]
    bars, paper = _value_charts(results)
    lines = [*legend(results.tables, std=std), chart_legend(bool(bars), paper, bool(diff_parts))]
    parts = [
        f"<h1>{e(title)}</h1>",
        f"<p>{len(results.rows)} methods: {e(', '.join(row_title(*r) for r in results.rows))}; "
        f"{n_runs} run results read on {stamp}.</p>",
        '<div class="legend"><ul>' + "".join(f"<li>{e(x)}</li>" for x in lines if x),
        "</ul></div>",
        "<h2>Paired differences</h2>",
    ]
    if not with_diffs:
        parts.append("<p>No pair of methods to compare in this grid (use --compare A B).</p>")
    parts += diff_parts
    parts += ["<h2>Accuracy per dataset</h2>", *bars, "<h2>Tables</h2>"]
    for t in results.tables:  # their paired differences are above, once
        parts.append(table_html(t, std))
    parts += ["<h2>Runs and logs</h2>", runs_html(results, out_dir)]

    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{e(title)}</title><style>{CSS}</style></head>\n"
        f'<body data-report="loading">\n' + "\n".join(parts) + f"\n<script>{SCRIPT}</script>\n"
        "</body></html>\n"
    )


def write_report(results: Results, out_dir: str, std: bool = False, title: str = "") -> str:
    """Write ``out_dir/index.html``; returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    page = render_report(results, out_dir, std, title)
    path = osp.join(out_dir, "index.html")
    with open(path, "w") as f:
        f.write(page)
    return path
