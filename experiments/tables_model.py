"""The table model shared by ``tools/make_tables.py`` (which builds and renders the tables) and
``experiments/report.py`` (which draws them as HTML): cells, paired-difference cells, method pairs,
format-independent tables with their CSV records, the cell texts and the legend under them, and
:class:`Results`, what the tables were built from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from experiments.paper_results import row_title
from experiments.results import SeedStats
from experiments.stats import Diff, describe_methods

MARK = "\u2020"  # dagger: the difference's interval contains 0
RECORD_FIELDS = (
    "table",
    "trainer",
    "optimizer",
    "dataset",
    "metric",
    "ours",
    "std",
    "n_seeds",
    "complete",
    "paper",
    "diff",
    "compared_to",
    "difference",
    "ci_low",
    "ci_high",
    "interval",
    "p_wilcoxon",
    "resolved",
    "seeds_needed",
    "notes",
)


@dataclass
class Cell:
    """A measured number (seed mean or derived), the paper's number and how complete it is."""

    value: float | None = None
    paper: float | None = None
    std: float | None = None
    complete: bool = True
    notes: list[str] = field(default_factory=list)
    n: int = 0  # seeds behind the value (the fewest over the cells it is derived from)

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
        return cls(stats.mean, paper, stats.std, stats.complete, notes, stats.n)


@dataclass
class DiffCell:
    """A paired difference a - b (None: no seed in common) and the seeds it would need."""

    diff: Diff | None
    needed: int | None = None


@dataclass
class Pair:
    """Two methods to compare, ``a - b``; each is ``(trainer, optimizer)``."""

    a: tuple[str, str]
    b: tuple[str, str]

    @property
    def label(self) -> str:
        return f"{row_title(*self.a)} - {row_title(*self.b)}"


@dataclass
class Table:
    """A format-independent table: title, headers, rows ``[label, Cell, ...]`` and notes.

    A values table may carry ``diffs``: its paired comparisons, a table of the same columns
    whose rows are ``[label, DiffCell, ...]`` (rendered right under it). ``formats``: one format
    spec per cell column for a table of plain numbers (no paper values, e.g. the cost table).
    """

    name: str
    title: str
    headers: list[str]
    rows: list[list] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    diffs: Table | None = None
    formats: list[str] | None = None

    @property
    def seeds_text(self) -> str:
        """How many seeds the cells (or the paired differences) have: ``3 seeds``, ``1-3 seeds
        per cell``."""
        counts = set()
        for row in self.rows:
            for c in row[1:]:
                if isinstance(c, Cell) and c.n:
                    counts.add(c.n)
                elif isinstance(c, DiffCell) and c.diff is not None:
                    counts.add(len(c.diff.seeds))
        if not counts:
            return ""
        lo, hi = min(counts), max(counts)
        return f"{lo} seed{'s' * (lo > 1)}" if lo == hi else f"{lo}-{hi} seeds per cell"

    @property
    def heading(self) -> str:
        return f"{self.title} ({self.seeds_text})" if self.seeds_text else self.title

    def add(self, label: str, trainer: str, optim: str, cells: list[tuple[str, str, Cell]]):
        """Append a row of ``(dataset, metric, cell)`` cells."""
        self.rows.append([label, *(c for _, _, c in cells)])
        for dataset, metric, cell in cells:
            self.notes += [f"{label} {n}" for n in cell.notes]
            self.records.append(cell_record(self.name, trainer, optim, dataset, metric, cell))


def _r(v):
    return "" if v is None else round(v, 4)


def cell_record(table, trainer, optim, dataset, metric, cell: Cell) -> dict:
    return {
        **dict.fromkeys(RECORD_FIELDS, ""),
        "table": table,
        "trainer": trainer,
        "optimizer": optim,
        "dataset": dataset,
        "metric": metric,
        "ours": _r(cell.value),
        "std": _r(cell.std),
        "n_seeds": cell.n,
        "complete": cell.complete,
        "paper": _r(cell.paper),
        "diff": _r(cell.diff),
        "notes": "; ".join(cell.notes),
    }


def diff_record(table, pair: Pair, dataset, metric, cell: DiffCell) -> dict:
    d = cell.diff
    out = {
        **dict.fromkeys(RECORD_FIELDS, ""),
        "table": f"{table}_diff",
        "trainer": pair.a[0],
        "optimizer": pair.a[1],
        "dataset": dataset,
        "metric": metric,
        "compared_to": row_title(*pair.b),
        "notes": "no seed in common" if d is None else "",
    }
    if d is not None:
        out.update(
            difference=_r(d.mean),
            ci_low=_r(d.lo),
            ci_high=_r(d.hi),
            n_seeds=d.n if d.method == "t" else "",
            interval=f"{d.confidence:.0%} {d.method}",
            p_wilcoxon=_r(d.p),
            resolved=not d.contains_zero,
            seeds_needed="" if cell.needed is None else cell.needed,
        )
    return out


def _num(v: float | None, signed: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:+.2f}" if signed else f"{v:.2f}"


def _ours(cell: Cell, std: bool) -> str:
    text = _num(cell.value)
    if cell.value is not None and std and cell.std is not None and cell.n > 1:  # 1 seed: none
        text += f"±{cell.std:.2f}"
    return text + ("" if cell.complete or cell.value is None else "*")


def _signed(v: float) -> str:
    text = f"{v:+.2f}"
    return "+0.00" if text == "-0.00" else text


def diff_text(cell: DiffCell, mark: str = MARK) -> str:
    """``+1.23 [-0.50, +2.96]†``: difference, interval, Wilcoxon p, mark, seeds needed."""
    d = cell.diff
    if d is None:
        return "-"
    text = f"{_signed(d.mean)} " + (
        "[n=1]" if d.lo is None else f"[{_signed(d.lo)}, {_signed(d.hi)}]"
    )
    if d.p is not None:
        text += f" p={d.p:.2g}"
    text += mark if d.contains_zero else ""
    if cell.needed is not None:
        text += f" need {cell.needed}"
    return text


def render_rows(table: Table, std: bool, mark: str = MARK) -> list[list[str]]:
    """Cells as strings: three columns per cell in base-to-new, one combined otherwise."""
    out = []
    for label, *cells in table.rows:
        row = [label]
        if table.formats:
            row += [
                "-" if c.value is None else format(c.value, f) for c, f in zip(cells, table.formats)
            ]
            out.append(row)
            continue
        for cell in cells:
            if isinstance(cell, DiffCell):
                row.append(diff_text(cell, mark))
            elif table.name in ("base2new", "ablation"):
                row += [_ours(cell, std), _num(cell.paper), _num(cell.diff, signed=True)]
            elif cell.paper is None:
                row.append(_ours(cell, std))
            else:
                row.append(f"{_ours(cell, std)} ({_num(cell.paper)}, {_num(cell.diff, True)})")
        out.append(row)
    return out


def _cells(tables: list[Table]):
    return [c for t in tables for row in t.rows for c in row[1:] if isinstance(c, Cell)]


STD_TEXT = "±: the standard deviation of the seeds' values (population: divided by n, not n - 1)"


def legend(tables: list[Table], mark: str = MARK, std: bool = False) -> list[str]:
    """The lines under the tables: how to read the cells and the marks, each line only when the
    tables hold what it explains."""
    cells = _cells(tables)
    lines = []
    if any(c.paper is not None for c in cells):
        lines.append("cells: ours (paper, ours - paper)")
    if any(not c.complete and c.value is not None for c in cells):
        lines.append("* = not every seed has a result (listed under the table)")
    if std and any(c.std is not None and c.n > 1 for c in cells):
        lines.append(STD_TEXT)
    diffs = [t.diffs for t in tables if t.diffs is not None]
    dcells = [c for t in diffs for r in t.rows for c in r[1:] if c.diff is not None]
    if dcells:
        notes = ["p: Wilcoxon over datasets, average rows"] * any(
            c.diff.p is not None for c in dcells
        )
        notes += ["HM: of each seed's Base and New"] * any(t.name == "base2new" for t in diffs)
        lines.append(
            "differences: a - b [interval]" + (f" ({'; '.join(notes)})" if notes else "") + "; "
            f"{mark} = the interval contains 0: not resolved by the seeds"
        )
        lines.append(describe_methods(averages=any(c.diff.method != "t" for c in dcells)))
    if any(c.needed is not None for c in dcells):
        lines.append(
            "need N: seeds a paired t-test would need to resolve the difference (95% interval, "
            "80% power, the observed seed spread)"
        )
    return lines


def empty_paper_columns(table: Table) -> list[int]:
    """Indices of the ``paper``/``diff`` columns of a base-to-new table without any published
    number (e.g. a dataset or trainer the paper does not have): left out when rendered."""
    if not table.headers or not all(isinstance(c, Cell) for row in table.rows for c in row[1:]):
        return []
    if any(c.paper is not None for row in table.rows for c in row[1:]):
        return []
    return [i for i, h in enumerate(table.headers) if h.endswith((" paper", " diff"))]


@dataclass
class Results:
    """What the tables were built from (the HTML report reads it too)."""

    tables: list[Table]
    stats: dict[tuple, SeedStats]
    folders: dict[tuple, dict[int, str]]  # same keys: {seed: run folder}
    rows: list[tuple[str, str]]
    datasets: list[str]
    targets: dict[str, list[str]]
    pairs: list[Pair]
    few_shot: tuple = ((), ())  # (datasets, shots) of the few-shot tables
