"""The other papers' numbers in ``experiments/published/`` (the comparison column of the trainers
the SAMPLe paper has no numbers for): each base-to-new row's HM is 2BN/(B+N) of its Base and New,
the printed averages follow from the 11 rows (a mistyped or shifted cell shows in one of them),
every file names its source, and ``tools/make_tables.py`` puts them in the paper column."""

import glob
import os.path as osp
import statistics

import pytest

from experiments.paper_results import (
    BASE2NEW_DATASETS,
    CROSS_DATASET_TARGETS,
    DOMAIN_GEN_TARGETS,
    PUBLISHED_DIR,
    load_paper_results,
    load_published_results,
    paper_value,
)

# trainers with the 11 datasets' Base / New / HM in experiments/published/
PER_DATASET = (
    "MMRL",
    "SkipTuning",
    "ProGrad",
    "DePT_CoOp",
    "DePT_CoCoOp",
    "DePT_KgCoOp",
    "DePT_MaPLe",
)
# HMs printed other than 2BN/(B+N) of their row, kept as printed:
# (trainer, dataset, printed, 2BN/(B+N) of the printed Base and New)
HM_AS_PRINTED = (("MMRL", "dtd", 73.82, 73.92),)
# rounding: a 2-decimal HM of 2-decimal Base/New is within 0.01 of 2BN/(B+N); a 2-decimal mean
# of 11 2-decimal values within 0.005 + 0.005 of the printed 2-decimal average
HM_TOL = 0.012
METRICS = ("base", "new", "hm")
MEAN_TOL = 0.011


def _hm(b, n):
    return 2 * b * n / (b + n)


@pytest.mark.parametrize("trainer", PER_DATASET)
def test_each_rows_hm_and_the_averages_follow_from_the_cells(trainer):
    v = load_published_results()
    cell = {(d, m): v["base2new", trainer, "sgd", d, m] for d in BASE2NEW_DATASETS
            for m in ("base", "new", "hm")}  # fmt: skip
    for d in BASE2NEW_DATASETS:
        b, n, h = cell[d, "base"], cell[d, "new"], cell[d, "hm"]
        known = [(p, c) for t, ds, p, c in HM_AS_PRINTED if (t, ds) == (trainer, d)]
        if known:
            (printed, computed), = known  # fmt: skip
            assert h == printed and round(_hm(b, n), 2) == computed, (trainer, d)
        else:
            assert abs(_hm(b, n) - h) < HM_TOL, (trainer, d, h, _hm(b, n))
    means = {m: statistics.fmean(cell[d, m] for d in BASE2NEW_DATASETS) for m in ("base", "new")}
    for m in ("base", "new"):
        printed = v["base2new", trainer, "sgd", "average", m]
        assert abs(means[m] - printed) < MEAN_TOL, (trainer, m, means[m], printed)
    printed_hm = v["base2new", trainer, "sgd", "average", "hm"]
    assert abs(_hm(means["base"], means["new"]) - printed_hm) < MEAN_TOL, (trainer, printed_hm)


def test_the_published_values_and_what_is_absent():
    """Spot values of each source, and the cells no source gives stay absent (None)."""
    assert paper_value("base2new", "MMRL", "sgd", "average", "hm") == 81.20
    assert paper_value("base2new", "MMRL", "sgd", "eurosat", "new") == 80.17
    assert paper_value("base2new", "SkipTuning", "sgd", "average", "base") == 85.04
    assert paper_value("base2new", "SkipTuning", "sgd", "fgvc_aircraft", "hm") == 40.84
    assert paper_value("base2new", "ProGrad", "sgd", "dtd", "new") == 52.35
    assert paper_value("domain_gen", "MMRL", "sgd", "imagenet_r") == 77.53
    assert paper_value("cross_dataset", "SkipTuning", "sgd", "average") == 67.00
    assert paper_value("domain_gen", "ProGrad", "sgd", "average") == 59.07
    for trainer in ("SkipTuning", "ProGrad"):  # only the source and the targets' average
        for table, targets in (("cross_dataset", CROSS_DATASET_TARGETS),
                               ("domain_gen", DOMAIN_GEN_TARGETS)):  # fmt: skip
            assert all(paper_value(table, trainer, "sgd", d) is None for d in targets)
    assert all(paper_value("cross_dataset", "MMRL", "sgd", d) is None
               for d in ("imagenet", *CROSS_DATASET_TARGETS, "average"))  # fmt: skip
    assert paper_value("base2new", "MMRL", "sample", "dtd", "hm") is None  # the method row only


def test_domain_generalisation_rows_round_to_the_second_source():
    """MMRL's domain-generalisation row (VaMP's table) rounds to VACSR's one-decimal row."""
    v = load_published_results()
    second = {"imagenet": 72.0, "imagenetv2": 64.5, "imagenet_sketch": 49.2,
              "imagenet_a": 51.2, "imagenet_r": 77.5}  # fmt: skip
    for d, one_decimal in second.items():
        assert round(v["domain_gen", "MMRL", "sgd", d, "acc"], 1) == one_decimal, d


def test_every_published_file_names_its_source():
    for path in glob.glob(osp.join(PUBLISHED_DIR, "*.csv")):
        head = [line for line in open(path) if line.startswith("#")]
        assert head and any("arXiv" in line for line in head), path


def test_comment_lines_are_skipped_and_errors_name_the_files_line(tmp_path):
    path = tmp_path / "x.csv"
    rows = "base2new,T,sgd,dtd,base,80.00\nbase2new,T,sgd,dtd,new,oops\n"
    path.write_text("# source: a paper\n# second line\ntable,trainer,optimizer,dataset,metric,"
                    "value\n" + rows)  # fmt: skip
    with pytest.raises(ValueError, match=r"x\.csv:5: malformed row"):
        load_paper_results(str(path))
    path.write_text("# source\ntable,trainer,optimizer,dataset,metric,value\n" + rows[:30])
    assert load_paper_results(str(path)) == {("base2new", "T", "sgd", "dtd", "base"): 80.0}


def test_make_tables_shows_them_in_the_paper_column(tmp_path):
    """Every dataset panel and the average carry the published Base / New / HM of MMRL,
    SkipTuning and ProGrad; the transfer tables their source, targets and averages."""
    from run_folders import fake_base2new

    from experiments.protocols import Setup
    from tools import make_tables

    trainers = ("MMRL", "SkipTuning", "ProGrad")
    out = str(tmp_path / "output")
    for trainer in trainers:
        for d in BASE2NEW_DATASETS:
            fake_base2new(Setup(output=out), trainer, "sgd", d, (1,), accuracy=lambda m, s: 70.0)
    argv = ["--output", out, "--tables", "base2new", "--trainers", *trainers, "--optims", "sgd"]
    panels = make_tables.build_tables(make_tables.build_parser().parse_args(argv))
    assert len(panels) == 12  # the average and one panel per dataset
    for panel, d in zip(panels, ("average", *BASE2NEW_DATASETS)):
        assert sorted(row[0] for row in panel.rows) == sorted(trainers), panel.title
        for row in panel.rows:
            published = [paper_value("base2new", row[0], "sgd", d, m) for m in METRICS]
            assert [c.paper for c in row[1:]] == published and None not in published
            assert [c.value for c in row[1:]] == pytest.approx([70.0] * 3)
    rows = [(t, "sgd") for t in trainers]
    for table, targets in (("cross_dataset", CROSS_DATASET_TARGETS),
                           ("domain_gen", DOMAIN_GEN_TARGETS)):  # fmt: skip
        t = make_tables.transfer_table({}, rows, table, list(targets))
        for row in t.rows:
            assert [c.paper for c in row[1:]] == [
                paper_value(table, row[0], "sgd", d) for d in ("imagenet", *targets, "average")
            ]
    skip_dg = make_tables.transfer_table({}, rows[1:2], "domain_gen", list(DOMAIN_GEN_TARGETS))
    assert [c.paper for c in skip_dg.rows[0][1:]] == [72.77, None, None, None, None, 61.20]
