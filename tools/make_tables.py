"""The paper's result tables from run folders, each number beside the paper's and the difference.

Tables (``--tables``; default: every table that has runs):

- ``base2new``: one panel per dataset and the average over the grid's datasets; rows trainer x
  optimizer, columns Base, New, HM = 2BN/(B+N), each seed-averaged. The average's HM is the HM
  of the averaged Base and New (``--avg-hm mean-of-hms`` averages the per-dataset HMs instead).
- ``cross_dataset`` and ``domain_gen``: source ImageNet, the targets and their average.
- ``ablation``: the paper's term-wise ablation (CoPrompt averages for sgd/sam/sagm/sample).
- ``few_shot``: CoOp's few-shot setting (``--protocols few_shot``): one panel per dataset and the
  average over the grid's datasets; rows trainer x optimizer, columns the shots (``1 shot`` ...
  ``16 shots``), each the seed mean of the training runs' final test (all classes). No published
  few-shot numbers are compared (there is no paper column).

The runs are those of a grid given as to ``tools/grid.py`` (default ``--preset paper``; rows
without any run folder are left out unless ``--show-empty``). A mean over fewer seeds than the
grid asks for is marked ``*`` and every missing or failed run is listed under the table; an
average over datasets is left empty until every dataset has a result. Seed folders beyond the
grid's ``--seeds`` are used too (every seed found counts); each table's heading says how many
seeds its cells have. The paper's numbers come from ``experiments/paper_results.csv``; they are
compared only where the grid's datasets/targets are the paper's.

Paired comparisons (``experiments/stats.py``): under each base-to-new, cross-dataset, domain
generalisation and few-shot table, the difference a - b of two methods per column, over the seeds
both have (same seed, same few-shot draw), with a 95% Student-t interval; the average row/column has
a 95% bootstrap interval over dataset x seed and the p-value of a Wilcoxon signed-rank test over
datasets. A difference whose interval contains 0 is marked ``†`` (not resolved by the seeds).
Default pairs: each sharpness-aware row against its trainer's base-optimizer (``sgd``) row;
``--compare A B`` (repeatable) picks any two methods; ``--seeds-needed [DELTA]`` adds how many seeds
would resolve the observed difference (or DELTA points). ``--report DIR`` writes an HTML report
(``experiments/report.py``). ``--zeroshot DIR`` adds the zero-shot CLIP row (the baseline) to the
base-to-new tables from ``--eval-only`` runs of the ``ZeroshotCLIP`` trainer in
``DIR/{base,new}/seed<N>`` (one dataset; ``DIR/<dataset>/{base,new}/seed<N>`` for several), the
layout ``scripts/demo.sh`` writes.

``±`` (``--std``) is the population standard deviation of the seeds' values (divided by n, not
n - 1; ``statistics.pstdev``), printed under every table that shows it.

Reproduction modes (docs/reproducing.md): ``--repro paper``, ``--repro released`` or
both (the default: every mode that has run folders). When runs of the ``released`` mode are in
the tables, every row carries its mode (``CoOp+SAMPLe [paper]``, ``CoOp+SAMPLe [released]``; the
folders are kept apart by their ``released`` tag) and each mode's row is compared with the
paper's number;
``--compare`` names such rows as ``CoOp+SAMPLe@released``.

Examples::

    python tools/make_tables.py --output output                       # terminal tables
    python tools/make_tables.py --format markdown --trainers CoOp --optims sgd sample
    python tools/make_tables.py --save tables/                       # .txt .md .csv .tex
    python tools/make_tables.py --compare CoOp+SAMPLe CoOp+SAM --seeds-needed 0.5
    python tools/make_tables.py --report report/                     # report/index.html
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import os.path as osp
import statistics
import sys
from dataclasses import replace

import numpy as np

if __package__ in (None, ""):  # run as a script
    import _repo  # noqa: F401

from experiments.cost_table import cost_table  # noqa: E402
from experiments.few_shot import shots_metric, shots_title  # noqa: E402
from experiments.grid_plan import expand_modes  # noqa: E402
from experiments.paper_results import (  # noqa: E402
    BASE2NEW_DATASETS,
    OPTIMIZER_TITLES,
    OPTIMIZERS,
    TARGETS_BY_TABLE,
    TRAINERS,
    ZERO_SHOT,
    paper_value,
    row_title,
    split_mode,
    with_mode,
)
from experiments.protocols import (  # noqa: E402
    SOURCE_DATASET,
    Chain,
    ProtocolError,
    dataset_title,
)
from experiments.results import SeedStats, collect_seeds, group_seeds  # noqa: E402
from experiments.stats import (  # noqa: E402
    Diff,
    across_datasets,
    describe_methods,
    hm_of_means,
    mean_of,
    mean_of_hms,
    paired_diff,
    per_seed_hm,
    seeds_needed,
)
from experiments.tables_model import (  # noqa: E402
    MARK,
    RECORD_FIELDS,
    Cell,
    DiffCell,
    Pair,
    Results,
    Table,
    diff_record,
    empty_paper_columns,
    legend,
    render_rows,
)
from tools.grid import GridError, add_grid_args, grids_from_args, setup_from_args  # noqa: E402

TABLE_NAMES = ("base2new", "cross_dataset", "domain_gen", "ablation", "few_shot")
FORMATS = ("terminal", "markdown", "csv", "latex")
ABLATION_ROWS = (
    ("sgd", "L"),
    ("sam", "L_p"),
    ("sagm", "L + L_p - a(gL . gL_p)"),
    ("sample", "L + L_p - a(gL . gL_p) + a xi s(gL_p . gF)"),
)


# -- collecting -------------------------------------------------------------------------------
def collect(chains: list[Chain]) -> dict[tuple, SeedStats]:
    """``{(table, trainer, optim, dataset, metric): SeedStats}`` over the chains' runs.

    Every seed folder found beside the grid's runs counts (e.g. ``seed4`` of a grid of seeds
    1-3). Groups without any run folder (every seed missing) are left out.
    """
    groups, kinds = run_folders(chains)
    stats = {k: collect_seeds(v, kinds[k]) for k, v in groups.items()}
    return {k: s for k, s in stats.items() if s.expected > len(s.missing)}


def run_folders(
    chains: list[Chain], modes: bool = False
) -> tuple[dict[tuple, dict[int, str]], dict[tuple, str]]:
    """``({key: {seed: run folder}}, {key: stage})``: the grid's runs and the extra seeds found.

    ``modes``: key the optimizer with the run's reproduction mode (``sample@released``).
    """
    groups: dict[tuple, dict[int, str]] = {}
    kinds: dict[tuple, str] = {}
    for chain in chains:
        for run in chain.runs:
            if run.protocol == "base2new":
                keys = [("base2new", run.dataset, "base" if run.stage == "train" else "new")]
            elif run.stage == "train":
                tables = {r.protocol for r in chain.evals}
                keys = [(t, SOURCE_DATASET, "acc") for t in sorted(tables)]
                if run.protocol == "few_shot":  # ImageNet's may be the transfer training too
                    keys.append(("few_shot", run.dataset, shots_metric(run.shots)))
                elif not keys:
                    keys = [(run.protocol, SOURCE_DATASET, "acc")]
            else:
                keys = [(run.protocol, run.dataset, "acc")]
            for table, dataset, metric in keys:
                optim = with_mode(run.optim, run.repro if modes else None)
                key = (table, run.trainer, optim, dataset, metric)
                groups.setdefault(key, {})[run.seed] = run.out_dir
                kinds[key] = run.stage
    for seeds in groups.values():
        parents = {osp.dirname(d) for d in seeds.values()}
        if len(parents) == 1 and osp.isdir(parent := parents.pop()):
            for seed, folder in group_seeds(parent, None).items():
                seeds.setdefault(seed, folder)
    return groups, kinds


def _hm(b: float | None, n: float | None) -> float | None:
    return None if b is None or n is None or b + n == 0 else 2 * b * n / (b + n)


def _average(cells: list[Cell], what: str) -> Cell:
    """Mean of ``cells`` if every one has a value; else an empty cell with a note."""
    have = [c.value for c in cells if c.value is not None]
    if len(have) < len(cells):
        return Cell(complete=False, notes=[f"{what}: {len(have)}/{len(cells)} datasets, no mean"])
    n = min(c.n for c in cells)
    return Cell(statistics.fmean(have), complete=all(c.complete for c in cells), n=n)


def _has_runs(stats, table: str, row: tuple[str, str], datasets) -> bool:
    return any(k[:3] == (table, *row) and k[3] in datasets for k in stats)


# -- tables -----------------------------------------------------------------------------------
B2N_HEADERS = ["Method"] + [
    f"{m} {c}".strip() for m in ("Base", "New", "HM") for c in ("", "paper", "diff")
]
METRICS = ("base", "new", "hm")


def base2new_cells(stats, trainer: str, optim: str, dataset: str) -> list[Cell]:
    """Base, New (seed means) and HM of one dataset."""
    cells = []
    for metric in ("base", "new"):
        st = stats.get(("base2new", trainer, optim, dataset, metric))
        paper = paper_value("base2new", trainer, optim, dataset, metric)
        cells.append(Cell.of(st, paper, f"{dataset_title(dataset)} {metric}"))
    base, new = cells
    hm = Cell(_hm(base.value, new.value), paper_value("base2new", trainer, optim, dataset, "hm"))
    hm.complete = base.complete and new.complete
    hm.n = min(base.n, new.n)
    return [base, new, hm]


def base2new_tables(stats, rows, datasets, avg_hm: str = "hm-of-means") -> list[Table]:
    """The average panel, then one panel per dataset that has runs."""
    n = len(datasets)
    average = Table("base2new", f"Base-to-new: average over {n} datasets", B2N_HEADERS)
    panels = []
    per_row = {row: {d: base2new_cells(stats, *row, d) for d in datasets} for row in rows}
    for d in datasets:
        panel = Table("base2new", f"Base-to-new: {dataset_title(d)}", B2N_HEADERS)
        for row in rows:
            if _has_runs(stats, "base2new", row, [d]):
                panel.add(row_title(*row), *row, list(zip([d] * 3, METRICS, per_row[row][d])))
        panels += [panel] if panel.rows else []
    if n == 1:
        return panels
    for row in rows:
        cells = per_row[row].values()
        base = _average([c[0] for c in cells], "average Base")
        new = _average([c[1] for c in cells], "average New")
        if avg_hm == "mean-of-hms":
            hm = _average([c[2] for c in cells], "average HM")
            hm.notes = []
        else:
            hm = Cell(_hm(base.value, new.value), complete=base.complete and new.complete)
            hm.n = min(base.n, new.n)
        if tuple(datasets) == BASE2NEW_DATASETS:
            for cell, metric in zip((base, new, hm), METRICS):
                cell.paper = paper_value("base2new", *row, "average", metric)
        average.add(row_title(*row), *row, list(zip(["average"] * 3, METRICS, (base, new, hm))))
    return [average, *panels]


def transfer_table(stats, rows, table: str, targets: list[str]) -> Table:
    """Cross-dataset or domain generalization: source, targets and their average."""
    cols = [SOURCE_DATASET, *targets]
    title = {"cross_dataset": "Cross-dataset", "domain_gen": "Domain generalization"}[table]
    out = Table(table, title, ["Method", *[dataset_title(c) for c in cols], "Avg"])
    for row in rows:
        cells = [
            Cell.of(stats.get((table, *row, d, "acc")), paper_value(table, *row, d), d)
            for d in cols
        ]
        avg = _average(cells[1:], "Avg")
        if tuple(targets) == TARGETS_BY_TABLE[table]:
            avg.paper = paper_value(table, *row, "average")
        out.add(
            row_title(*row),
            *row,
            [(d, "acc", c) for d, c in zip([*cols, "average"], [*cells, avg])],
        )
    return out


def ablation_table(average: Table, compare: bool) -> Table | None:
    """The term-wise ablation: CoPrompt's rows of the base-to-new average panel."""
    by_title = {row[0]: row[1:] for row in average.rows}
    out = Table(
        "ablation", "Term-wise ablation (CoPrompt, average)", ["Objective", *B2N_HEADERS[1:]]
    )
    for optim, label in ABLATION_ROWS:
        cells = by_title.get(row_title("CoPrompt", optim))
        if cells is None:
            continue
        cells = [
            Cell(
                c.value,
                paper_value("ablation", "CoPrompt", optim, "average", m) if compare else None,
                c.std,
                c.complete,
                n=c.n,
            )
            for c, m in zip(cells, METRICS)
        ]
        out.add(label, "CoPrompt", optim, list(zip(["average"] * 3, METRICS, cells)))
    return out if out.rows else None


# -- paired comparisons -----------------------------------------------------------------------
def parse_method(text: str) -> tuple[str, str]:
    """``CoOp+SAMPLe``, ``CoOp+sample`` -> ``(CoOp, sample)``; ``CoOp``, ``CoOp+sgd`` -> sgd;
    a row title (``CoOp+SAMPLe-k5``, ``CoOp+m-RWP``) -> its optimizer name."""
    trainer, _, optim = text.partition("+")
    by_title = {title.lower(): name for name, title in OPTIMIZER_TITLES.items() if title}
    return trainer, by_title.get(f"+{optim}".lower(), optim.lower()) or "sgd"


def comparison_pairs(rows: list[tuple[str, str]], compare: list[list[str]] | None) -> list[Pair]:
    """``--compare`` pairs, or each sharpness-aware row against its trainer's ``sgd`` row."""
    if not compare:

        def base(r):  # the trainer's sgd row of the same reproduction mode
            return (r[0], with_mode("sgd", split_mode(r[1])[1]))

        return [Pair(r, base(r)) for r in rows if split_mode(r[1])[0] != "sgd" and base(r) in rows]
    pairs = []
    for a, b in compare:
        pair = Pair(parse_method(a), parse_method(b))
        for text, method in ((a, pair.a), (b, pair.b)):
            if method not in rows:
                have = ", ".join(row_title(*r) for r in rows)
                raise GridError(f"--compare {text}: no such row in this grid (rows: {have})")
        pairs.append(pair)
    return pairs


def _values(stats, key) -> dict[int, float]:
    st = stats.get(key)
    return dict(st.values) if st is not None else {}


def _needed(diff: Diff | None, delta) -> int | None:
    """Seeds that would resolve ``delta`` (``observed``: the difference itself), t-cells only."""
    if delta is None or diff is None or diff.method != "t":
        return None
    return seeds_needed(diff.sd, diff.mean if delta == "observed" else float(delta))


def _diff_table(values: Table, pairs: list[Pair], cells_of, columns: list[str]) -> Table | None:
    """The comparisons of ``values``'s rows: ``cells_of(pair)`` gives ``[(col, metric, cell)]``."""
    titles = {row[0] for row in values.rows}
    out = Table(values.name, f"{values.title}: paired differences", ["a - b", *columns])
    for pair in pairs:
        if {row_title(*pair.a), row_title(*pair.b)} <= titles:
            cells = cells_of(pair)
            out.rows.append([pair.label, *(c for _, _, c in cells)])
            out.records += [diff_record(values.name, pair, *c) for c in cells]
    return out if out.rows else None


def base2new_diffs(stats, pair: Pair, dataset: str, delta=None) -> list[tuple]:
    """Paired Base, New and per-seed HM differences of one dataset."""
    out = []
    per_seed = {}
    for side in (pair.a, pair.b):
        base = _values(stats, ("base2new", *side, dataset, "base"))
        new = _values(stats, ("base2new", *side, dataset, "new"))
        per_seed[side] = (base, new, per_seed_hm(base, new))
    for i, metric in enumerate(METRICS):
        diff = paired_diff(per_seed[pair.a][i], per_seed[pair.b][i])
        out.append((dataset, metric, DiffCell(diff, _needed(diff, delta))))
    return out


def _units(stats, side, table: str, datasets, metrics, seeds_of) -> list[np.ndarray]:
    """Per dataset ``[seeds, metrics]`` arrays of ``side`` over ``seeds_of(dataset)``."""
    out = []
    for d in datasets:
        vals = [_values(stats, (table, *side, d, m)) for m in metrics]
        out.append(np.array([[v[s] for v in vals] for s in seeds_of(d)], dtype=float))
    return out


def _common_seeds(stats, pair: Pair, table: str, metrics):
    """``seeds_of(dataset)``: the seeds every metric of both methods has there."""

    def seeds_of(d):
        sets = [set(_values(stats, (table, *s, d, m))) for s in (pair.a, pair.b) for m in metrics]
        return sorted(set.intersection(*sets))

    return seeds_of


def average_diffs(
    stats, pair: Pair, table: str, datasets, statistics_: list, metrics=None
) -> list[DiffCell]:
    """Across-dataset differences (bootstrap over dataset x seed, Wilcoxon over datasets) of
    ``metrics`` (default: base and new in base-to-new, else acc)."""
    metrics = metrics or (("base", "new") if table == "base2new" else ("acc",))
    seeds_of = _common_seeds(stats, pair, table, metrics)
    if any(not seeds_of(d) for d in datasets):
        return [DiffCell(None) for _ in statistics_]
    a = _units(stats, pair.a, table, datasets, metrics, seeds_of)
    b = _units(stats, pair.b, table, datasets, metrics, seeds_of)
    seeds = tuple(sorted(set().union(*(seeds_of(d) for d in datasets))))
    return [DiffCell(replace(across_datasets(a, b, st), seeds=seeds)) for st in statistics_]


def add_base2new_diffs(panels, stats, pairs, datasets, avg_hm, delta) -> None:
    """Attach the paired comparisons to the base-to-new panels (average panel first if any)."""
    by_title = {f"Base-to-new: {dataset_title(d)}": d for d in datasets}
    for panel in panels:
        if panel.title not in by_title:  # the average panel
            hm_stat = mean_of_hms if avg_hm == "mean-of-hms" else hm_of_means
            stats_ = [mean_of(0), mean_of(1), hm_stat]

            def cells_of(pair, stats_=stats_):
                diffs = average_diffs(stats, pair, "base2new", datasets, stats_)
                return list(zip(["average"] * 3, METRICS, diffs))
        else:

            def cells_of(pair, dataset=by_title[panel.title]):
                return base2new_diffs(stats, pair, dataset, delta)

        panel.diffs = _diff_table(panel, pairs, cells_of, ["Base", "New", "HM"])


def add_transfer_diffs(table: Table, stats, pairs, targets, delta) -> None:
    """Attach the paired comparisons to a cross-dataset or domain generalization table."""

    def cells_of(pair):
        out = []
        for d in [SOURCE_DATASET, *targets]:
            a = _values(stats, (table.name, *pair.a, d, "acc"))
            b = _values(stats, (table.name, *pair.b, d, "acc"))
            diff = paired_diff(a, b)
            out.append((d, "acc", DiffCell(diff, _needed(diff, delta))))
        (avg,) = average_diffs(stats, pair, table.name, targets, [mean_of(0)])
        return out + [("average", "acc", avg)]

    table.diffs = _diff_table(table, pairs, cells_of, table.headers[1:])


# -- few-shot ---------------------------------------------------------------------------------
def few_shot_tables(stats, rows, datasets, shots) -> list[Table]:
    """The average panel (several datasets), then one panel per dataset that has runs: rows
    trainer x optimizer, one column per shots value."""
    headers = ["Method", *(shots_title(s) for s in shots)]
    metrics = [shots_metric(s) for s in shots]
    panels = []
    per_row = {}
    for d in datasets:
        title = dataset_title(d)
        panel = Table("few_shot", f"Few-shot: {title}", headers)
        for row in rows:
            cells = [
                Cell.of(stats.get(("few_shot", *row, d, m)), None, f"{title} {shots_title(s)}")
                for s, m in zip(shots, metrics)
            ]
            per_row.setdefault(row, []).append(cells)
            if _has_runs(stats, "few_shot", row, [d]):
                panel.add(row_title(*row), *row, list(zip([d] * len(shots), metrics, cells)))
        panels += [panel] if panel.rows else []
    if len(datasets) == 1:
        return panels
    average = Table("few_shot", f"Few-shot: average over {len(datasets)} datasets", headers)
    for row in rows:
        if not _has_runs(stats, "few_shot", row, datasets):
            continue
        cells = [
            _average([c[i] for c in per_row[row]], f"average {shots_title(s)}")
            for i, s in enumerate(shots)
        ]
        average.add(row_title(*row), *row, list(zip(["average"] * len(shots), metrics, cells)))
    return ([average] if average.rows else []) + panels


def add_few_shot_diffs(panels, stats, pairs, datasets, shots, delta) -> None:
    """Attach the paired comparisons to the few-shot panels: per dataset a t-interval over the
    seeds both methods have per shots value; the average panel bootstrap and Wilcoxon over
    the datasets (as the other tables' average rows)."""
    by_title = {f"Few-shot: {dataset_title(d)}": d for d in datasets}
    metrics = [shots_metric(s) for s in shots]
    for panel in panels:
        dataset = by_title.get(panel.title)

        def cells_of(pair, dataset=dataset):
            out = []
            for m in metrics:
                if dataset is None:  # the average panel
                    (cell,) = average_diffs(stats, pair, "few_shot", datasets, [mean_of(0)], (m,))
                    out.append(("average", m, cell))
                    continue
                a = _values(stats, ("few_shot", *pair.a, dataset, m))
                b = _values(stats, ("few_shot", *pair.b, dataset, m))
                diff = paired_diff(a, b)
                out.append((dataset, m, DiffCell(diff, _needed(diff, delta))))
            return out

        panel.diffs = _diff_table(panel, pairs, cells_of, panel.headers[1:])


def few_shot_axes(grids) -> tuple[list[str], list[int]]:
    """``(datasets, shots)`` of the grid's ``few_shot`` sub-grids, in order."""
    datasets, shots = [], []
    for g in grids:
        if "few_shot" in g.protocols:
            datasets += [d for d in g.datasets if d not in datasets]
            shots += [s for s in g.shots if s not in shots]
    return datasets, shots


# -- rendering --------------------------------------------------------------------------------
LATEX_MARK = "$^{\\dagger}$"


def latex_footnote() -> str:
    """The LaTeX footnote under a table of differences: the mark and the methods."""
    text = describe_methods().replace("%", "\\%")
    return (
        "\\par\\smallskip{\\footnotesize " + LATEX_MARK + " The 95\\% interval of the "
        "difference contains 0: the seeds do not resolve it. Methods: " + text + ".}"
    )


def _block(t: Table, fmt: str, std: bool, tablefmt: str) -> str:
    from tabulate import tabulate

    placeholder = "DAGGERMARK" if fmt == "latex" else MARK
    rows, headers = render_rows(t, std, placeholder), t.headers
    empty = empty_paper_columns(t)  # no published numbers (e.g. KgCoOp, IVLP, a new dataset)
    if empty:
        keep = [i for i in range(len(headers)) if i not in empty]
        headers, rows = [headers[i] for i in keep], [[r[i] for i in keep] for r in rows]
    body = tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)
    if fmt == "markdown":
        return f"### {t.heading}\n\n{body}\n" + "".join(f"\n- {n}" for n in t.notes)
    if fmt == "latex":
        if placeholder in body:
            body = body.replace(placeholder, LATEX_MARK) + "\n" + latex_footnote()
        return f"% {t.heading}\n{body}" + "".join(f"\n% {n}" for n in t.notes)
    return f"{t.heading}\n{body}" + "".join(f"\n  {n}" for n in t.notes)


def render(tables: list[Table], fmt: str, std: bool = False) -> str:
    """All tables (each followed by its paired differences) in one format.

    ``fmt``: terminal, markdown, latex (marks as footnotes under the table) or csv.
    """
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=RECORD_FIELDS, lineterminator="\n")
        writer.writeheader()
        for t in tables:
            writer.writerows(t.records + (t.diffs.records if t.diffs else []))
        return buf.getvalue()
    tablefmt = {"terminal": "simple", "markdown": "github", "latex": "latex_booktabs"}[fmt]
    parts = []
    for t in tables:
        parts.append(_block(t, fmt, std, tablefmt))
        if t.diffs is not None:
            parts.append(_block(t.diffs, fmt, std, tablefmt))
    prefix, mark = ("% ", LATEX_MARK) if fmt == "latex" else ("", MARK)
    lines = legend(tables, mark, std)
    return "\n\n".join(parts) + "\n\n" + "".join(f"{prefix}{x}\n" for x in lines)


# -- command line -----------------------------------------------------------------------------
def grid_axes(
    grids, modes=(None,)
) -> tuple[list[tuple[str, str]], list[str], dict[str, list[str]]]:
    """``(trainer x optimizer rows in the paper's order, base-to-new datasets, targets)``;
    ``modes``: the reproduction modes of the rows (None: rows without a mode label)."""
    rows, datasets, targets = [], [], {"cross_dataset": [], "domain_gen": []}
    for g in grids:
        for m in modes:
            keys = [(t, with_mode(o, m)) for t in g.trainers for o in g.optims]
            rows += [k for k in keys if k not in rows]
        if "base2new" in g.protocols:
            datasets += [d for d in g.datasets if d not in datasets]
        for table, have in (("cross_dataset", g.xd_targets), ("domain_gen", g.dg_targets)):
            if table in g.protocols:
                targets[table] += [d for d in have if d not in targets[table]]
    rows.sort(
        key=lambda r: (
            _order(r[0], TRAINERS),
            _order(split_mode(r[1])[0], OPTIMIZERS),
            split_mode(r[1])[1] or "",
        )
    )
    return rows, datasets, targets


def build_tables(args) -> list[Table]:
    """Parse the grid's run folders and build the requested tables."""
    return build(args).tables


def build(args) -> Results:
    """Parse the grid's run folders, build the requested tables and their comparisons."""
    if not args.preset and not args.trainers:
        args.preset = "paper"
    grids = grids_from_args(args)
    if any(v for g in grids for v in g.variants):
        raise GridError(
            "The tables have one cell per trainer x optimizer x dataset and would merge the "
            "values of a sweep: plot sweeps with tools/plot_sweep.py"
        )
    modes = list(dict.fromkeys(getattr(args, "repro", None) or ["paper", "released"]))
    chains = expand_modes(grids, setup_from_args(args), modes)
    found = [
        m for m in modes if any(osp.isdir(c.train.out_dir) for c in chains if c.train.repro == m)
    ]
    modes = found or modes  # modes without any run folder are left out
    chains = [c for c in chains if c.train.repro in modes]
    labelled = modes != ["paper"]  # a released mode in the tables: every row says its mode
    folders, kinds = run_folders(chains, labelled)
    stats = {k: collect_seeds(v, kinds[k]) for k, v in folders.items()}
    stats = {k: s for k, s in stats.items() if s.expected > len(s.missing)}
    grid_rows, datasets, targets = grid_axes(grids, modes if labelled else (None,))
    wanted = args.tables or TABLE_NAMES
    pairs = comparison_pairs(grid_rows, getattr(args, "compare", None))
    delta = getattr(args, "seeds_needed", None)

    def rows_of(table, names):
        return [r for r in grid_rows if args.show_empty or _has_runs(stats, table, r, names)]

    tables = []
    b2n_rows = rows_of("base2new", datasets)
    zeroshot = zeroshot_runs(getattr(args, "zeroshot", None), datasets)
    if zeroshot and b2n_rows:
        for (dataset, half), seed_dirs in zeroshot.items():
            key = ("base2new", *ZERO_SHOT, dataset, half)
            folders[key], kinds[key] = seed_dirs, "eval"
            stats[key] = collect_seeds(seed_dirs, "eval")
        b2n_rows = [ZERO_SHOT, *b2n_rows]  # the baseline first; never in a paired difference
    if datasets and b2n_rows and {"base2new", "ablation"} & set(wanted):
        panels = base2new_tables(stats, b2n_rows, datasets, args.avg_hm)
        add_base2new_diffs(panels, stats, pairs, datasets, args.avg_hm, delta)
        tables += panels if "base2new" in wanted else []
        if "ablation" in wanted and len(datasets) > 1 and panels:  # panels[0]: the average
            ablation = ablation_table(panels[0], tuple(datasets) == BASE2NEW_DATASETS)
            tables += [ablation] if ablation else []
    for table in ("cross_dataset", "domain_gen"):
        rows = rows_of(table, [SOURCE_DATASET, *targets[table]])
        if table in wanted and targets[table] and rows:
            tables.append(transfer_table(stats, rows, table, targets[table]))
            add_transfer_diffs(tables[-1], stats, pairs, targets[table], delta)
    fs_datasets, shots = few_shot_axes(grids)
    fs_rows = rows_of("few_shot", fs_datasets)
    if "few_shot" in wanted and fs_datasets and fs_rows:
        panels = few_shot_tables(stats, fs_rows, fs_datasets, shots)
        add_few_shot_diffs(panels, stats, pairs, fs_datasets, shots, delta)
        tables += panels
    if getattr(args, "cost", False) or getattr(args, "report", None):  # the report always has it
        cost = cost_table(folders, kinds, [r for r in grid_rows if any(k[1:3] == r for k in stats)])
        tables += [cost] if cost else []
    rows = [ZERO_SHOT, *grid_rows] if ZERO_SHOT in b2n_rows else grid_rows  # the report's
    few_shot = (fs_datasets, shots) if fs_rows else ((), ())
    return Results(tables, stats, folders, rows, datasets, targets, pairs, few_shot)


def zeroshot_runs(folder: str | None, datasets: list[str]) -> dict[tuple[str, str], dict]:
    """``{(dataset, "base" | "new"): {seed: run folder}}`` of the zero-shot CLIP runs in
    ``folder`` (``--zeroshot``): ``folder/<dataset>/{base,new}/seed<N>``, or with one dataset
    ``folder/{base,new}/seed<N>``.

    Raises:
        GridError: the folder holds no such runs (naming the layout it looked for).
    """
    if not folder:
        return {}
    out = {}
    for dataset in datasets:
        group = osp.join(folder, dataset)
        if not osp.isdir(group) and len(datasets) == 1:
            group = folder
        for half in ("base", "new"):
            path = osp.join(group, half)
            seeds = group_seeds(path, None) if osp.isdir(path) else {}
            if seeds:
                out[(dataset, half)] = seeds
    if not out:
        raise GridError(
            f"--zeroshot {folder}: no zero-shot runs found; expected run folders "
            f"{folder}/<dataset>/{{base,new}}/seed<N> (or {folder}/{{base,new}}/seed<N> for "
            "one dataset) written by train.py --trainer ZeroshotCLIP --eval-only"
        )
    return out


def _order(name: str, known: tuple) -> tuple:
    return (known.index(name), "") if name in known else (len(known), name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_grid_args(parser)
    parser.add_argument("--tables", nargs="+", choices=TABLE_NAMES, help="default: all")
    parser.add_argument("--format", choices=FORMATS, default="terminal", help="stdout format")
    parser.add_argument("--save", metavar="DIR", help="also write DIR/tables.{txt,md,csv,tex}")
    parser.add_argument("--std", action="store_true", help="show the std over seeds")
    parser.add_argument("--show-empty", action="store_true", help="keep rows without runs")
    parser.add_argument(
        "--avg-hm",
        choices=("hm-of-means", "mean-of-hms"),
        default="hm-of-means",
        help="HM of the base-to-new average (default: HM of the averaged Base and New)",
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        action="append",
        metavar=("A", "B"),
        help="paired differences A - B of two methods (repeatable), e.g. --compare "
        "CoOp+SAMPLe CoOp+SAM (default: each sharpness-aware row - its trainer's sgd row)",
    )
    parser.add_argument(
        "--seeds-needed",
        nargs="?",
        const="observed",
        metavar="DELTA",
        help="add the seeds that would resolve each difference (the observed one, or DELTA "
        "points) with a paired t-test: 95%% interval, 80%% power, the observed seed spread",
    )
    parser.add_argument(
        "--cost",
        action="store_true",
        help="add the training cost per method (time per run, relative to its trainer's SGD "
        "runs, step time, peak memory; from each run's cost.json); always in --report",
    )
    parser.add_argument("--report", metavar="DIR", help="write the HTML report DIR/index.html")
    parser.add_argument(
        "--zeroshot",
        metavar="DIR",
        help="add the zero-shot CLIP row to the base-to-new tables: eval-only ZeroshotCLIP runs "
        "in DIR/{base,new}/seed<N> (one dataset) or DIR/<dataset>/{base,new}/seed<N>",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.seeds_needed not in (None, "observed"):
        try:
            args.seeds_needed = float(args.seeds_needed)
        except ValueError:
            print(
                f"Error: --seeds-needed {args.seeds_needed}: give a number of points",
                file=sys.stderr,
            )
            return 2
    try:
        results = build(args)
        tables = results.tables
    except (GridError, ProtocolError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    if not args.cost:  # the cost table goes to the report only
        tables = [t for t in tables if t.name != "cost"]
    if not tables:
        print(f"No run folders of this grid under {args.output}.", file=sys.stderr)
        return 1
    print(render(tables, args.format, args.std), end="")
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        for fmt, ext in (("terminal", "txt"), ("markdown", "md"), ("csv", "csv"), ("latex", "tex")):
            with open(osp.join(args.save, f"tables.{ext}"), "w") as f:
                f.write(render(tables, fmt, args.std))
        print(f"Saved tables.txt/.md/.csv/.tex in {args.save}")
    if args.report:
        from experiments.report import write_report

        path = write_report(results, args.report, std=args.std)
        print(f"Report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
