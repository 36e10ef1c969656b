"""The paper's result tables from run folders, each number beside the paper's and the difference.

Tables (``--tables``; default: every table that has runs):

- ``base2new``: one panel per dataset and the average over the grid's datasets; rows trainer x
  optimizer, columns Base, New, HM = 2BN/(B+N), each seed-averaged. The average's HM is the HM
  of the averaged Base and New (``--avg-hm mean-of-hms`` averages the per-dataset HMs instead).
- ``cross_dataset`` and ``domain_gen``: source ImageNet, the targets and their average.
- ``ablation``: the paper's term-wise ablation (CoPrompt averages for sgd/sam/sagm/sample).

The runs are those of a grid given as to ``tools/grid.py`` (default ``--preset paper``; rows
without any run folder are left out unless ``--show-empty``). A mean over fewer seeds than the
grid asks for is marked ``*`` and every missing or failed run is listed under the table; an
average over datasets is left empty until every dataset has a result. The paper's numbers come
from ``tools/paper_results.csv``; they are compared only where the grid's datasets/targets are
the paper's.

Examples::

    python tools/make_tables.py --output output                       # terminal tables
    python tools/make_tables.py --format markdown --trainers CoOp --optims sgd sample
    python tools/make_tables.py --save tables/                       # .txt .md .csv .tex
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import os.path as osp
import statistics
import sys
from dataclasses import dataclass, field

if __package__ in (None, ""):  # run as a script
    import _repo  # noqa: F401

from tools.grid import GridError, add_grid_args, expand, grids_from_args, setup_from_args  # noqa: E402
from tools.paper_results import (  # noqa: E402
    BASE2NEW_DATASETS,
    DATASET_TITLES,
    OPTIMIZERS,
    TARGETS_BY_TABLE,
    TRAINERS,
    paper_value,
    row_title,
)
from tools.parse_results import SeedStats, collect_seeds  # noqa: E402
from tools.protocols import SOURCE_DATASET, Chain, ProtocolError  # noqa: E402

TABLE_NAMES = ("base2new", "cross_dataset", "domain_gen", "ablation")
FORMATS = ("terminal", "markdown", "csv", "latex")
ABLATION_ROWS = (
    ("sgd", "L"),
    ("sam", "L_p"),
    ("sagm", "L + L_p - a(gL . gL_p)"),
    ("sample", "L + L_p - a(gL . gL_p) + a xi s(gL_p . gF)"),
)


@dataclass
class Cell:
    """A measured number (seed mean or derived), the paper's number and how complete it is."""

    value: float | None = None
    paper: float | None = None
    std: float | None = None
    complete: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def diff(self) -> float | None:
        if self.value is None or self.paper is None:
            return None
        return self.value - self.paper

    @classmethod
    def of(cls, stats: SeedStats | None, paper: float | None, what: str) -> Cell:
        """The seed mean of ``stats`` (a note says which seeds are missing or failed)."""
        if stats is None:
            return cls(paper=paper, complete=False, notes=[f"{what}: no runs"])
        notes = [] if stats.complete else [f"{what}: {stats.describe()}"]
        return cls(stats.mean, paper, stats.std, stats.complete, notes)


@dataclass
class Table:
    """A format-independent table: title, headers, rows ``[label, Cell, ...]`` and notes."""

    name: str
    title: str
    headers: list[str]
    rows: list[list] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, label: str, trainer: str, optim: str, cells: list[tuple[str, str, Cell]]):
        """Append a row of ``(dataset, metric, cell)`` cells."""
        self.rows.append([label, *(c for _, _, c in cells)])
        for dataset, metric, cell in cells:
            self.notes += [f"{label} {n}" for n in cell.notes]
            self.records.append(_record(self.name, trainer, optim, dataset, metric, cell))


def _record(table, trainer, optim, dataset, metric, cell: Cell) -> dict:
    def r(v):
        return "" if v is None else round(v, 4)

    return {
        "table": table,
        "trainer": trainer,
        "optimizer": optim,
        "dataset": dataset,
        "metric": metric,
        "ours": r(cell.value),
        "std": r(cell.std),
        "complete": cell.complete,
        "paper": r(cell.paper),
        "diff": r(cell.diff),
        "notes": "; ".join(cell.notes),
    }


# -- collecting -------------------------------------------------------------------------------
def collect(chains: list[Chain]) -> dict[tuple, SeedStats]:
    """``{(table, trainer, optim, dataset, metric): SeedStats}`` over the chains' runs.

    Groups without any run folder (every seed missing) are left out.
    """
    groups: dict[tuple, dict[int, str]] = {}
    kinds: dict[tuple, str] = {}
    for chain in chains:
        for run in chain.runs:
            if run.protocol == "base2new":
                keys = [("base2new", run.dataset, "base" if run.stage == "train" else "new")]
            elif run.stage == "train":
                tables = {r.protocol for r in chain.evals} or {run.protocol}
                keys = [(t, SOURCE_DATASET, "acc") for t in sorted(tables)]
            else:
                keys = [(run.protocol, run.dataset, "acc")]
            for table, dataset, metric in keys:
                key = (table, run.trainer, run.optim, dataset, metric)
                groups.setdefault(key, {})[run.seed] = run.out_dir
                kinds[key] = run.stage
    stats = {k: collect_seeds(v, kinds[k]) for k, v in groups.items()}
    return {k: s for k, s in stats.items() if s.expected > len(s.missing)}


def _hm(b: float | None, n: float | None) -> float | None:
    return None if b is None or n is None or b + n == 0 else 2 * b * n / (b + n)


def _average(cells: list[Cell], what: str) -> Cell:
    """Mean of ``cells`` if every one has a value; else an empty cell with a note."""
    have = [c.value for c in cells if c.value is not None]
    if len(have) < len(cells):
        return Cell(complete=False, notes=[f"{what}: {len(have)}/{len(cells)} datasets, no mean"])
    return Cell(statistics.fmean(have), complete=all(c.complete for c in cells))


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
        cells.append(Cell.of(st, paper, f"{DATASET_TITLES.get(dataset, dataset)} {metric}"))
    base, new = cells
    hm = Cell(_hm(base.value, new.value), paper_value("base2new", trainer, optim, dataset, "hm"))
    hm.complete = base.complete and new.complete
    return [base, new, hm]


def base2new_tables(stats, rows, datasets, avg_hm: str = "hm-of-means") -> list[Table]:
    """The average panel, then one panel per dataset that has runs."""
    n = len(datasets)
    average = Table("base2new", f"Base-to-new: average over {n} datasets", B2N_HEADERS)
    panels = []
    per_row = {row: {d: base2new_cells(stats, *row, d) for d in datasets} for row in rows}
    for d in datasets:
        panel = Table("base2new", f"Base-to-new: {DATASET_TITLES.get(d, d)}", B2N_HEADERS)
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
        if tuple(datasets) == BASE2NEW_DATASETS:
            for cell, metric in zip((base, new, hm), METRICS):
                cell.paper = paper_value("base2new", *row, "average", metric)
        average.add(row_title(*row), *row, list(zip(["average"] * 3, METRICS, (base, new, hm))))
    return [average, *panels]


def transfer_table(stats, rows, table: str, targets: list[str]) -> Table:
    """Cross-dataset or domain generalization: source, targets and their average."""
    cols = [SOURCE_DATASET, *targets]
    title = {"cross_dataset": "Cross-dataset", "domain_gen": "Domain generalization"}[table]
    out = Table(table, title, ["Method", *[DATASET_TITLES.get(c, c) for c in cols], "Avg"])
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
            )
            for c, m in zip(cells, METRICS)
        ]
        out.add(label, "CoPrompt", optim, list(zip(["average"] * 3, METRICS, cells)))
    return out if out.rows else None


# -- rendering --------------------------------------------------------------------------------
def _num(v: float | None, signed: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:+.2f}" if signed else f"{v:.2f}"


def _ours(cell: Cell, std: bool) -> str:
    text = _num(cell.value)
    if cell.value is not None and std and cell.std is not None:
        text += f"±{cell.std:.2f}"
    return text + ("" if cell.complete or cell.value is None else "*")


def render_rows(table: Table, std: bool) -> list[list[str]]:
    """Cells as strings: three columns per cell in base-to-new, one combined otherwise."""
    out = []
    for label, *cells in table.rows:
        row = [label]
        for cell in cells:
            if table.name in ("base2new", "ablation"):
                row += [_ours(cell, std), _num(cell.paper), _num(cell.diff, signed=True)]
            elif cell.paper is None:
                row.append(_ours(cell, std))
            else:
                row.append(f"{_ours(cell, std)} ({_num(cell.paper)}, {_num(cell.diff, True)})")
        out.append(row)
    return out


def render(tables: list[Table], fmt: str, std: bool = False) -> str:
    """All tables in one format: terminal, markdown, latex or csv."""
    from tabulate import tabulate

    if fmt == "csv":
        buf = io.StringIO()
        fields = list(tables[0].records[0]) if tables and tables[0].records else ["table"]
        writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        for t in tables:
            writer.writerows(t.records)
        return buf.getvalue()
    tablefmt = {"terminal": "simple", "markdown": "github", "latex": "latex_booktabs"}[fmt]
    parts = []
    for t in tables:
        body = tabulate(
            render_rows(t, std), headers=t.headers, tablefmt=tablefmt, disable_numparse=True
        )
        if fmt == "markdown":
            parts.append(f"### {t.title}\n\n{body}\n" + "".join(f"\n- {n}" for n in t.notes))
        elif fmt == "latex":
            parts.append(f"% {t.title}\n{body}" + "".join(f"\n% {n}" for n in t.notes))
        else:
            parts.append(f"{t.title}\n{body}" + "".join(f"\n  {n}" for n in t.notes))
    legend = "cells: ours (paper, ours - paper); * = not every seed has a result (listed)"
    return "\n\n".join(parts) + f"\n\n{'% ' if fmt == 'latex' else ''}{legend}\n"


# -- command line -----------------------------------------------------------------------------
def grid_axes(grids) -> tuple[list[tuple[str, str]], list[str], dict[str, list[str]]]:
    """``(trainer x optimizer rows in the paper's order, base-to-new datasets, targets)``."""
    rows, datasets, targets = [], [], {"cross_dataset": [], "domain_gen": []}
    for g in grids:
        rows += [(t, o) for t in g.trainers for o in g.optims if (t, o) not in rows]
        if "base2new" in g.protocols:
            datasets += [d for d in g.datasets if d not in datasets]
        for table, have in (("cross_dataset", g.xd_targets), ("domain_gen", g.dg_targets)):
            if table in g.protocols:
                targets[table] += [d for d in have if d not in targets[table]]
    rows.sort(key=lambda r: (_order(r[0], TRAINERS), _order(r[1], OPTIMIZERS)))
    return rows, datasets, targets


def build_tables(args) -> list[Table]:
    """Parse the grid's run folders and build the requested tables."""
    if not args.preset and not args.trainers:
        args.preset = "paper"
    grids = grids_from_args(args)
    if any(v for g in grids for v in g.variants):
        raise GridError(
            "The tables have one cell per trainer x optimizer x dataset and would merge the "
            "values of a sweep: plot sweeps with tools/plot_sweep.py"
        )
    stats = collect(expand(grids, setup_from_args(args)))
    grid_rows, datasets, targets = grid_axes(grids)
    wanted = args.tables or TABLE_NAMES

    def rows_of(table, names):
        return [r for r in grid_rows if args.show_empty or _has_runs(stats, table, r, names)]

    tables = []
    b2n_rows = rows_of("base2new", datasets)
    if datasets and b2n_rows and {"base2new", "ablation"} & set(wanted):
        panels = base2new_tables(stats, b2n_rows, datasets, args.avg_hm)
        tables += panels if "base2new" in wanted else []
        if "ablation" in wanted:
            ablation = ablation_table(panels[0], tuple(datasets) == BASE2NEW_DATASETS)
            tables += [ablation] if ablation else []
    for table in ("cross_dataset", "domain_gen"):
        rows = rows_of(table, [SOURCE_DATASET, *targets[table]])
        if table in wanted and targets[table] and rows:
            tables.append(transfer_table(stats, rows, table, targets[table]))
    return tables


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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        tables = build_tables(args)
    except (GridError, ProtocolError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
