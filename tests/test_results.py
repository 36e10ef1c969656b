"""The paper's numbers as data, the log parser and the result tables (no train.py runs)."""

from __future__ import annotations

import csv
import io
import os
import os.path as osp
import statistics

import pytest
from run_folders import RESULT, eval_log, fake_base2new, train_log, write_run

from experiments.paper_results import (
    BASE2NEW_DATASETS,
    CROSS_DATASET_TARGETS,
    DOMAIN_GEN_TARGETS,
    OPTIMIZERS,
    PAPER_CSV,
    TRAINERS,
    load_paper_results,
    paper_value,
)
from experiments.protocols import Setup, cfg_component, transfer_dirs
from experiments.results import collect_seeds, log_files, parse_log, read_run
from tools import make_tables
from tools.parse_results import main as parse_main


# -- the paper's numbers ------------------------------------------------------------------------
def test_paper_data_hand_checked_cells():
    """Cells read off the LaTeX tables by hand."""
    assert paper_value("base2new", "CoOp", "sgd", "average", "base") == 82.69
    assert paper_value("base2new", "TCP", "sample", "average", "hm") == 81.95
    assert paper_value("base2new", "CoOp", "sample", "dtd", "base") == 78.12
    assert paper_value("base2new", "CoOp", "sample", "dtd", "new") == 63.04
    assert paper_value("base2new", "CoOp", "sample", "dtd", "hm") == 69.77
    assert paper_value("base2new", "CoCoOp", "sgd", "stanford_cars", "new") == 73.59
    assert paper_value("base2new", "MaPLe", "sam", "average", "hm") == 79.42  # printed "SAM"
    assert paper_value("base2new", "MaPLe", "sample", "sun397", "new") == 80.48
    assert paper_value("base2new", "CoPrompt", "sagm", "oxford_pets", "new") == 99.25
    assert paper_value("base2new", "TCP", "fsam", "fgvc_aircraft", "base") == 42.05
    assert paper_value("base2new", "CoOp", "sgd", "ucf101", "new") == 56.05
    assert paper_value("cross_dataset", "CoOp", "sample", "fgvc_aircraft") == 23.61
    assert paper_value("cross_dataset", "MaPLe", "sample", "eurosat") == 53.12
    assert paper_value("cross_dataset", "TCP", "sgd", "imagenet") == 71.40
    assert paper_value("domain_gen", "TCP", "sgd", "imagenet") == 71.20
    assert paper_value("domain_gen", "CoCoOp", "sample", "imagenet") == 71.03  # printed "71,03"
    assert paper_value("domain_gen", "CoPrompt", "sample", "imagenet_sketch") == 50.28
    assert paper_value("ablation", "CoPrompt", "sagm", "average", "new") == 78.47
    assert paper_value("cross_dataset", "CoOp", "sam", "dtd") is None  # not in the paper


def test_paper_data_is_complete():
    data = load_paper_results()
    for trainer in TRAINERS:
        for optim in OPTIMIZERS:
            for d in ("average", *BASE2NEW_DATASETS):
                for m in ("base", "new", "hm"):
                    assert ("base2new", trainer, optim, d, m) in data
        for optim in ("sgd", "sample"):
            for d in ("imagenet", *CROSS_DATASET_TARGETS, "average"):
                assert ("cross_dataset", trainer, optim, d, "acc") in data
            for d in ("imagenet", *DOMAIN_GEN_TARGETS, "average"):
                assert ("domain_gen", trainer, optim, d, "acc") in data
    assert len(data) == 12 * 25 * 3 + 10 * 12 + 10 * 6 + 4 * 3


def test_other_papers_averages_are_the_comparison_column():
    """ProGrad's and MMRL's own papers give their rows' paper column (experiments/published/):
    base, new and an HM that is the HM of the two."""
    from experiments.paper_results import load_published_results

    published = load_published_results()
    for trainer, hm in (("ProGrad", 76.16), ("MMRL", 81.20)):
        b, n, h = (
            paper_value("base2new", trainer, "sgd", "average", m) for m in ("base", "new", "hm")
        )
        assert h == hm and abs(2 * b * n / (b + n) - h) < 0.015  # as printed: rounding
        assert ("base2new", trainer, "sgd", "average", "hm") in published
        assert paper_value("base2new", trainer, "sample", "average", "hm") is None


def test_paper_data_is_self_consistent():
    """Catches a shifted column or row: HM, averages and the ablation agree with the cells,
    except for the paper's own inconsistencies listed in experiments/paper_results.py."""
    v = load_paper_results()
    for trainer in TRAINERS:
        for optim in OPTIMIZERS:
            for d in BASE2NEW_DATASETS:
                b, n, h = (v["base2new", trainer, optim, d, m] for m in ("base", "new", "hm"))
                assert abs(2 * b * n / (b + n) - h) < 0.12, (trainer, optim, d)
            for m in ("base", "new"):
                mean = statistics.fmean(
                    v["base2new", trainer, optim, d, m] for d in BASE2NEW_DATASETS
                )
                off = abs(mean - v["base2new", trainer, optim, "average", m]) > 0.011
                known = trainer == "TCP" and optim in ("fsam", "sagm", "sample") and m == "base"
                assert off == known, (trainer, optim, m, mean)
    for table, targets, known in (
        ("cross_dataset", CROSS_DATASET_TARGETS, {("CoPrompt", "sample"), ("TCP", "sample")}),
        ("domain_gen", DOMAIN_GEN_TARGETS, {("CoOp", "sample")}),
    ):
        for trainer in TRAINERS:
            for optim in ("sgd", "sample"):
                mean = statistics.fmean(v[table, trainer, optim, d, "acc"] for d in targets)
                off = abs(mean - v[table, trainer, optim, "average", "acc"]) > 0.011
                assert off == ((trainer, optim) in known), (table, trainer, optim, mean)
    for optim in ("sgd", "sam", "sagm", "sample"):
        for m in ("base", "new", "hm"):
            assert (
                v["ablation", "CoPrompt", optim, "average", m]
                == v["base2new", "CoPrompt", optim, "average", m]
            )


def test_paper_data_rejects_bad_files(tmp_path):
    with open(PAPER_CSV) as f:
        header, first = f.readline(), f.readline()
    dup = tmp_path / "dup.csv"
    dup.write_text(header + first + first)
    with pytest.raises(ValueError, match="duplicate"):
        load_paper_results(str(dup))
    bad = tmp_path / "bad.csv"
    bad.write_text(header + "base2new,CoOp,sgd,dtd,base,seventy\n")
    with pytest.raises(ValueError, match="malformed"):
        load_paper_results(str(bad))


# -- parsing logs -------------------------------------------------------------------------------
def test_parse_log_spellings_and_kinds():
    assert parse_log(train_log(71.5)) == 71.5
    assert parse_log(train_log(64.25, end="Finished training")) == 64.25  # CoOp-era spelling
    assert parse_log(eval_log(55.0)) == 55.0
    assert parse_log(eval_log(55.0), kind="eval") == 55.0
    # an interrupted run's mid-training evaluation is not its result
    assert parse_log(train_log(None, val_acc=40.0)) is None
    assert parse_log(train_log(70.0, val_acc=40.0)) == 70.0
    # the last accuracy after the marker wins (e.g. a per-class block then a re-test)
    assert parse_log(train_log(60.0) + RESULT.format(61.0)) == 61.0
    assert parse_log("no markers here") is None
    with pytest.raises(ValueError, match="Unknown log kind"):
        parse_log("", kind="test")


def test_read_run_resumed_and_incomplete(tmp_path):
    run = str(tmp_path / "seed1")
    assert read_run(run).status == "missing"
    os.makedirs(run)
    assert read_run(run).detail == "no log.txt"
    write_run(run, train_log(None))  # interrupted
    result = read_run(run)
    assert result.status == "no_result" and "last line: epoch [1/2]" in result.detail
    write_run(run, train_log(72.0), "log.txt-2024-05-01-10-00-00")  # resumed, finished
    result = read_run(run)
    assert (result.status, result.accuracy) == ("done", 72.0)
    assert result.log.endswith("log.txt-2024-05-01-10-00-00")
    write_run(run, train_log(73.5), "log.txt-2024-05-02-09-00-00")  # re-run: the newest wins
    assert read_run(run).accuracy == 73.5
    write_run(run, train_log(None), "log.txt-2024-05-03-09-00-00")  # a later crash
    assert read_run(run).accuracy == 73.5
    assert [osp.basename(p) for p in log_files(run)] == [
        "log.txt",
        "log.txt-2024-05-01-10-00-00",
        "log.txt-2024-05-02-09-00-00",
        "log.txt-2024-05-03-09-00-00",
    ]


def test_seed_statistics_report_missing_and_failed(tmp_path):
    write_run(str(tmp_path / "seed1"), train_log(70.0))
    write_run(str(tmp_path / "seed2"), train_log(None))  # failed
    write_run(str(tmp_path / "seed4"), train_log(74.0))
    stats = collect_seeds({s: str(tmp_path / f"seed{s}") for s in (1, 2, 3, 4)})
    assert stats.values == {1: 70.0, 4: 74.0}
    assert (stats.missing, stats.failed, stats.complete) == ([3], [2], False)
    assert stats.mean == 72.0 and stats.std == 2.0  # population std, as CoOp's parser
    assert stats.describe() == "2/4 seeds; missing seed3; no result seed2"


def test_parse_results_cli(tmp_path, capsys):
    group = tmp_path / "base2new/train_base/dtd/shots_16/CoOp/vit_b16_ctxv1"
    for seed, acc in ((1, 70.0), (2, 72.0)):
        write_run(str(group / f"seed{seed}"), train_log(acc, end="Finished training"))
    assert parse_main([str(tmp_path), "--seeds", "1", "2", "3", "--per-run"]) == 1
    out = capsys.readouterr().out  # the table is printed, the exit status says incomplete
    assert "71.00" in out and "1.00" in out and "2/3 seeds; missing seed3" in out
    assert "incomplete" in out
    assert parse_main([str(tmp_path), "--seeds", "1", "2", "3", "--allow-incomplete"]) == 0
    assert "2/3 seeds" in capsys.readouterr().out
    assert parse_main([str(tmp_path), "--seeds", "1", "2"]) == 0
    capsys.readouterr()
    assert parse_main([str(group / "seed1")]) == 0
    assert "70.00" in capsys.readouterr().out


# -- tables -------------------------------------------------------------------------------------
def _records(tables):
    rows = csv.DictReader(io.StringIO(make_tables.render(tables, "csv")))
    return {(r["table"], r["trainer"], r["optimizer"], r["dataset"], r["metric"]): r for r in rows}


def test_base2new_tables_against_the_paper(tmp_path):
    out = str(tmp_path / "output")
    setup = Setup(output=out)
    skip = {("eurosat", 3, "new"), ("dtd", 2, "fail")}
    for optim in ("sgd", "sample"):
        for d in BASE2NEW_DATASETS:
            fake_base2new(setup, "CoOp", optim, d, (1, 2, 3), skip if optim == "sgd" else ())
    args = make_tables.build_parser().parse_args(["--output", out, "--tables", "base2new"])
    tables = make_tables.build_tables(args)
    assert [t.title for t in tables][:2] == [
        "Base-to-new: average over 11 datasets",
        "Base-to-new: ImageNet",
    ]
    assert len(tables) == 12 and [r[0] for r in tables[0].rows] == ["CoOp", "CoOp+SAMPLe"]
    rec = _records(tables)
    dtd = rec["base2new", "CoOp", "sample", "dtd", "base"]
    assert float(dtd["ours"]) == pytest.approx(78.12) and float(dtd["diff"]) == pytest.approx(0)
    assert float(dtd["std"]) == pytest.approx(0.2449, abs=1e-4)
    hm = rec["base2new", "CoOp", "sample", "dtd", "hm"]
    assert float(hm["ours"]) == pytest.approx(2 * 78.12 * 63.04 / (78.12 + 63.04))
    # average panel: means of the 11 datasets; HM of the averaged Base and New
    avg = {m: rec["base2new", "CoOp", "sample", "average", m] for m in ("base", "new", "hm")}
    b = statistics.fmean(
        paper_value("base2new", "CoOp", "sample", d, "base") for d in BASE2NEW_DATASETS
    )
    n = statistics.fmean(
        paper_value("base2new", "CoOp", "sample", d, "new") for d in BASE2NEW_DATASETS
    )
    assert float(avg["base"]["ours"]) == pytest.approx(b) and abs(float(avg["base"]["diff"])) < 0.01
    assert float(avg["hm"]["ours"]) == pytest.approx(2 * b * n / (b + n))
    assert float(avg["hm"]["paper"]) == 78.88  # the paper averages per-dataset HMs here
    # missing and failed seeds are explicit, never silently averaged
    eurosat = rec["base2new", "CoOp", "sgd", "eurosat", "new"]
    assert eurosat["complete"] == "False" and "missing seed3" in eurosat["notes"]
    assert "no result seed2" in rec["base2new", "CoOp", "sgd", "dtd", "base"]["notes"]
    assert rec["base2new", "CoOp", "sgd", "average", "base"]["complete"] == "False"
    text = make_tables.render(tables, "terminal")
    assert "CoOp EuroSAT new: 2/3 seeds; missing seed3" in text and "*" in text
    # the other HM convention reproduces the paper's average HM
    args.avg_hm = "mean-of-hms"
    rec = _records(make_tables.build_tables(args))
    assert abs(float(rec["base2new", "CoOp", "sample", "average", "hm"]["diff"])) < 0.011


def test_transfer_and_ablation_tables(tmp_path):
    out = str(tmp_path / "output")
    setup = Setup(output=out)
    for optim in ("sgd", "sample"):
        comp = cfg_component(setup.cfg_for("cross_dataset", "CoOp", "imagenet"), optim)
        for seed in (1, 2, 3):
            train, _ = transfer_dirs(setup, "CoOp", comp, seed, "dtd")
            write_run(train, train_log(paper_value("cross_dataset", "CoOp", optim, "imagenet")))
            for table, targets in (
                ("cross_dataset", CROSS_DATASET_TARGETS),
                ("domain_gen", DOMAIN_GEN_TARGETS[:2]),
            ):
                for t in targets:
                    _, ev = transfer_dirs(setup, "CoOp", comp, seed, t)
                    write_run(ev, eval_log(paper_value(table, "CoOp", optim, t)))
    for optim in ("sgd", "sam", "sagm", "sample"):
        for d in BASE2NEW_DATASETS:
            fake_base2new(setup, "CoPrompt", optim, d, (1,))
    args = make_tables.build_parser().parse_args(["--output", out, "--seeds", "1", "2", "3"])
    tables = {t.name + t.title: t for t in make_tables.build_tables(args)}
    xd = tables["cross_datasetCross-dataset"]
    assert [r[0] for r in xd.rows] == ["CoOp", "CoOp+SAMPLe"]
    sample_avg = xd.rows[1][-1]
    assert sample_avg.value == pytest.approx(65.85, abs=0.01) and sample_avg.paper == 65.85
    dg = tables["domain_genDomain generalization"]
    assert dg.rows[0][-1].value is None  # two of four targets: no average
    assert "CoOp Avg: 2/4 datasets, no mean" in dg.notes
    assert "CoOp imagenet_a: no runs" in dg.notes
    ablation = tables["ablationTerm-wise ablation (CoPrompt, average)"]
    assert [r[0] for r in ablation.rows][0] == "L" and len(ablation.rows) == 4
    assert ablation.rows[3][1].paper == 85.62
    assert abs(ablation.rows[3][1].diff) < 0.01  # mean of the paper's 11 CoPrompt values
    assert ablation.rows[3][1].complete is False  # 1 of 3 seeds
    md = make_tables.render(list(tables.values()), "markdown")
    assert "### Cross-dataset" in md and "| CoOp+SAMPLe |" in md
    assert "65.85 (65.85, +0.00)" in md
    tex = make_tables.render(list(tables.values()), "latex")
    assert "\\toprule" in tex and "% Domain generalization" in tex


def test_make_tables_cli_saves_all_formats(tmp_path, capsys):
    out = str(tmp_path / "output")
    fake_base2new(Setup(output=out), "CoOp", "sample", "dtd", (1,))
    argv = ["--output", out, "--trainers", "CoOp", "--optims", "sample", "--datasets", "dtd"]
    assert make_tables.main([*argv, "--seeds", "1", "--save", str(tmp_path / "t"), "--std"]) == 0
    printed = capsys.readouterr().out
    assert "Base-to-new: DTD" in printed and " 78.12 " in printed
    assert "±" not in printed  # one seed: no spread to show, and no ± to define
    assert sorted(os.listdir(tmp_path / "t")) == [
        f"tables.{e}" for e in ("csv", "md", "tex", "txt")
    ]
    assert make_tables.main(["--output", str(tmp_path / "empty")]) == 1


def test_one_dataset_has_no_average_and_no_ablation(tmp_path):
    # one --datasets value: the per-dataset panel only (the ablation reads the average panel)
    out = str(tmp_path / "output")
    setup = Setup(output=out)
    for optim in ("sgd", "sam", "sagm", "sample"):
        fake_base2new(setup, "CoPrompt", optim, "dtd", (1,))
    argv = ["--output", out, "--seeds", "1", "--datasets", "dtd"]
    tables = make_tables.build_tables(make_tables.build_parser().parse_args(argv))
    titles = [t.title for t in tables]
    assert "Base-to-new: DTD" in titles and not any("ablation" in t.name for t in tables)
    empty = make_tables.build_parser().parse_args([*argv, "--show-empty", "--trainers", "CoOp"])
    make_tables.build_tables(empty)  # no runs of the grid's rows: no crash


def test_cost_table_beside_the_accuracy(tmp_path, capsys):
    # cost.json of each training run (engine/cost.py): time per run, relative to the trainer's
    # SGD runs on the same dataset and seed, step time, peak memory; a run without one is noted
    import json

    from experiments.protocols import base2new_dirs

    out = str(tmp_path / "output")
    setup = Setup(output=out)
    times = {("sgd", 1): 100.0, ("sgd", 2): 120.0, ("sample", 1): 130.0, ("sample", 2): 150.0}
    for optim in ("sgd", "sample"):
        fake_base2new(setup, "CoOp", optim, "dtd", (1, 2, 3))
        comp = cfg_component(setup.cfg_for("base2new", "CoOp", "dtd"), optim)
        for seed in (1, 2):  # seed 3 has no cost.json (a run from before it existed)
            train, _ = base2new_dirs(setup, "dtd", "CoOp", comp, seed)
            cost = {"steps": 200, "train_time_s": times[optim, seed]}
            cost |= {"mean_step_s": times[optim, seed] / 200, "peak_cpu_rss_mb": 500.0 + seed}
            cost |= {"peak_cuda_mb": None, "trainable_params": 2048}
            with open(osp.join(train, "cost.json"), "w") as f:
                json.dump(cost, f)
    argv = ["--output", out, "--trainers", "CoOp", "--optims", "sgd", "sample"]
    argv += ["--datasets", "dtd", "--seeds", "1", "2", "3"]
    assert make_tables.main(argv) == 0
    assert "Training cost" not in capsys.readouterr().out  # an option of the printed tables
    assert make_tables.main([*argv, "--cost", "--format", "csv"]) == 0
    printed = capsys.readouterr().out
    tables = make_tables.build_tables(make_tables.build_parser().parse_args([*argv, "--cost"]))
    cost = next(t for t in tables if t.name == "cost")
    rows = {r[0]: [c.value for c in r[1:]] for r in cost.rows}
    assert rows["CoOp"] == pytest.approx([110.0, 1.0, 550.0, 501.5, 2.0, 2048.0])
    assert rows["CoOp+SAMPLe"] == pytest.approx([140.0, 280 / 220, 700.0, 501.5, 2.0, 2048.0])
    assert any("1 training run(s) without cost.json" in n for n in cost.notes)
    assert "train_time_s" in printed and "time_over_sgd" in printed
    report = tmp_path / "report"
    assert make_tables.main([*argv, "--report", str(report)]) == 0  # always in the report
    html = (report / "index.html").read_text()
    assert "Training cost per run" in html and "1.27" in html
