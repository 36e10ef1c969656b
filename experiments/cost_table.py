"""What each method's accuracy costs: the training cost of the grid's runs, one row per method
(``tools/make_tables.py --cost``; always in the HTML report).

Every training run records ``cost.json`` in its folder (:mod:`engine.cost`: training time, steps,
mean step time, peak memory, trainable parameters). A row averages the training runs of one
trainer x optimizer over every dataset and seed of the tables; ``x SGD`` is the row's training
time over its trainer's SGD row's on the runs both have (same protocol, dataset and seed), so a
reader sees what a point of accuracy costs on the same data. Runs without ``cost.json`` (made
before it existed, or that never trained) are left out and counted in the notes.
"""

from __future__ import annotations

import statistics

from engine.cost import read_cost
from experiments.paper_results import row_title
from experiments.tables_model import Cell, Table

COST_HEADERS = ["Method", "Time/run (s)", "x SGD", "Step (ms)", "Peak memory (MB)", "Runs"]
COST_HEADERS += ["Trainable params"]  # cost.json's trainable_params (runs that recorded it)
COST_FORMATS = [".1f", ".2f", ".1f", ".0f", ".0f", ".0f"]
SGD = "sgd"


def _unit(table: str, dataset: str, seed: int, metric: str = "") -> tuple:
    # a transfer protocol's training run is shared by its tables (cross-dataset, domain gen);
    # a few-shot run is one per shots value (its metric, e.g. 4shots)
    if table == "few_shot":
        return (table, dataset, metric, seed)
    return ("base2new" if table == "base2new" else "transfer", dataset, seed)


def training_costs(folders: dict, kinds: dict, row: tuple[str, str]) -> tuple[dict, int]:
    """``({unit: cost}, missing)``: the ``cost.json`` of ``row``'s training runs, keyed by
    (protocol, dataset, seed), and how many training runs have none."""
    costs, missing, seen = {}, set(), set()
    for key, seeds in folders.items():
        table, trainer, optim, dataset, metric = key
        if (trainer, optim) != row or kinds.get(key) != "train":
            continue
        for seed, folder in seeds.items():
            if folder in seen:  # ImageNet's 16-shot run may be the transfer training too
                continue
            seen.add(folder)
            unit = _unit(table, dataset, seed, metric)
            cost = read_cost(folder)
            if cost and cost.get("steps"):
                costs[unit] = cost
            else:
                missing.add(unit)
    return costs, len(missing - set(costs))


def _peak_mb(cost: dict) -> float | None:
    return cost.get("peak_cuda_mb") or cost.get("peak_cpu_rss_mb")


def _mean_cell(values: list) -> Cell:
    have = [v for v in values if v is not None]
    if not have:
        return Cell()
    std = statistics.stdev(have) if len(have) > 1 else None
    return Cell(statistics.fmean(have), std=std)


def cost_table(folders: dict, kinds: dict, rows: list[tuple[str, str]]) -> Table | None:
    """The cost table of ``rows`` (trainer, optimizer), or None when no run recorded a cost."""
    table = Table("cost", "Training cost per run", COST_HEADERS, formats=COST_FORMATS)
    per_row = {row: training_costs(folders, kinds, row) for row in rows}
    if not any(costs for costs, _ in per_row.values()):
        return None
    for row, (costs, missing) in per_row.items():
        if not costs:
            continue
        label = row_title(*row)
        times = {u: c["train_time_s"] for u, c in costs.items()}
        sgd_costs = per_row.get((row[0], SGD), ({}, 0))[0]
        common = [u for u in times if u in sgd_costs]
        ratio = Cell()
        if common:
            sgd_time = sum(sgd_costs[u]["train_time_s"] for u in common)
            if sgd_time > 0:
                ratio = Cell(sum(times[u] for u in common) / sgd_time)
        step_ms = [c["mean_step_s"] * 1e3 if c.get("mean_step_s") else None for c in costs.values()]
        cells = [
            ("all", "train_time_s", _mean_cell(list(times.values()))),
            ("all", "time_over_sgd", ratio),
            ("all", "step_ms", _mean_cell(step_ms)),
            ("all", "peak_mb", _mean_cell([_peak_mb(c) for c in costs.values()])),
            ("all", "runs", Cell(float(len(costs)))),
            (
                "all",
                "trainable_params",
                _mean_cell([c.get("trainable_params") for c in costs.values()]),
            ),
        ]
        table.add(label, *row, cells)
        if missing:
            table.notes.append(f"{label}: {missing} training run(s) without cost.json left out")
    return table
