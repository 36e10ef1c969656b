"""The few-shot protocol (experiments/few_shot.py): plan, configs, commands, folders, tables,
report, and one end-to-end run of scripts/few_shot.sh on generated data and the tiny CLIP."""

from __future__ import annotations

import json
import os
import os.path as osp
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT
from run_folders import train_log, write_run

from experiments.few_shot import FEW_SHOTS, few_shot_chain, few_shot_dir
from experiments.grid_plan import expand, select
from experiments.protocols import ProtocolError, Setup, trainer_cfgs
from experiments.results import read_run
from tools import grid, make_tables
from tools.grid import GridError


def _chains(setup, **axes):
    return expand(select(None, protocols=["few_shot"], **axes), setup)


def _epochs(run) -> int:
    with open(osp.join(ROOT, run.config_files[0])) as f:
        return yaml.safe_load(f)["OPTIM"]["MAX_EPOCH"]


def _opts(run) -> dict:
    opts = run.protocol_opts
    return dict(zip(opts[0::2], opts[1::2]))


# -- plan, configs, commands and folders --------------------------------------------------------
def test_few_shot_plan_configs_commands_and_folders(tmp_path):
    setup = Setup(output=str(tmp_path), opts=("OPTIM.LR", "0.1"))
    trainers = ["CoOp", "ProGrad", "MMRL", "PromptSRC", "SkipTuning", "KgCoOp"]
    chains = _chains(
        setup, trainers=trainers, optims=["sgd", "sample"], datasets=["dtd", "imagenet"]
    )
    assert len(chains) == 6 * 2 * 2 * len(FEW_SHOTS) * 3  # x datasets x shots x seeds 1 2 3
    assert all(not c.evals and c.train.protocol == "few_shot" for c in chains)
    runs = {(r.trainer, r.optim, r.dataset, r.shots, r.seed): r for r in (c.train for c in chains)}
    assert len({r.label for r in runs.values()}) == len(runs)  # the grid keys its estimate by label
    assert runs["CoOp", "sgd", "dtd", 4, 2].label == "CoOp few_shot train dtd 4shots seed2"

    # CoOp's published schedule (its COOP.md): 16 context vectors, 50/100/100/200/200 epochs,
    # ImageNet 50 for every shots value; ProGrad's README: the same with its own configs
    for trainer, cfgs in (
        ("CoOp", ("vit_b16_ep50", "vit_b16_ep100", "vit_b16_ep100", "vit_b16", "vit_b16")),
        ("ProGrad", tuple(f"vit_b16{e}_ctxv1" for e in ("_ep50", "_ep100", "_ep100", "", ""))),
    ):
        dtd = [runs[trainer, "sgd", "dtd", s, 1] for s in FEW_SHOTS]
        assert tuple(r.cfg for r in dtd) == cfgs
        assert [_epochs(r) for r in dtd] == [50, 100, 100, 200, 200]
        assert {_epochs(runs[trainer, "sgd", "imagenet", s, 1]) for s in FEW_SHOTS} == {50}
    coop = runs["CoOp", "sgd", "dtd", 1, 1]
    with open(osp.join(ROOT, coop.config_files[0])) as f:
        assert "COOP" not in (yaml.safe_load(f).get("TRAINER") or {})  # N_CTX 16, random init
    # ProGrad's LAMBDA 0.8 (8 and 16 shots on DTD) comes with the 200-epoch config's overlay
    assert runs["ProGrad", "sgd", "dtd", 8, 1].config_files[1:] == (
        "configs/trainers/ProGrad/vit_b16_ctxv1_dtd.yaml",
    )
    assert runs["ProGrad", "sgd", "dtd", 1, 1].config_files[1:] == ()
    # the trainers' own few-shot configs; MMRL's ImageNet config with TASK FS (its few_shot.sh)
    assert runs["MMRL", "sgd", "dtd", 1, 1].cfg == "vit_b16_few_shot"
    mmrl = runs["MMRL", "sample", "imagenet", 16, 3]
    assert mmrl.cfg == "vit_b16_imagenet" and _opts(mmrl)["TRAINER.MMRL.TASK"] == "FS"
    assert runs["SkipTuning", "sgd", "dtd", 2, 1].cfg == "vit_b16_bs4_few_shot"
    src = runs["PromptSRC", "sgd", "dtd", 2, 1]
    assert src.cfg == "vit_b16_c2_ep50_batch4_4x4ctx_few_shot" and _epochs(src) == 50
    with open(osp.join(ROOT, src.config_files[1])) as f:  # PromptSRC's GPA for DTD
        assert yaml.safe_load(f)["TRAINER"]["PROMPTSRC"] == {"GPA_MEAN": 45, "GPA_STD": 5}
    assert runs["PromptSRC", "sgd", "imagenet", 2, 1].config_files[1:] == ()
    assert runs["KgCoOp", "sgd", "dtd", 1, 1].cfg == "vit_b16_ep100_ctxv1"  # no few-shot config

    # CoOp's few-shot folders; the command trains all classes on the shots, user options last
    run = runs["CoOp", "sample", "dtd", 1, 2]
    assert run.out_dir == str(tmp_path / "dtd" / "CoOp" / "vit_b16_ep50+sample_1shots" / "seed2")
    cmd = run.command(setup)
    assert cmd[cmd.index("--config-file") + 1].endswith("configs/trainers/CoOp/vit_b16_ep50.yaml")
    assert cmd[cmd.index("--optim-config-file") + 1].endswith("configs/optim/CoOp/sample.yaml")
    assert "--eval-only" not in cmd
    tail = ["DATALOADER.TRAIN_X.DROP_LAST", "True", "DATASET.NUM_SHOTS", "1"]
    assert cmd[-8:] == [*tail, "DATASET.SUBSAMPLE_CLASSES", "all", "OPTIM.LR", "0.1"]
    assert runs["CoOp", "sgd", "dtd", 16, 1].out_dir.endswith("dtd/CoOp/vit_b16_16shots/seed1")
    # --cfg wins; released runs carry their tag
    over = Setup(output="o", cfgs=(("CoOp", "vit_b32"),), repro="released")
    chain = few_shot_chain(over, "CoOp", "sgd", "eurosat", 1, 8)
    assert chain.train.out_dir == osp.join(
        "o", "eurosat", "CoOp", "vit_b32+sgd-released_8shots", "seed1"
    )
    # every declared few-shot config exists
    for name in trainers + ["DePT_CoOp", "TCP", "MaPLe"]:
        for key, cfg in trainer_cfgs(name).items():
            assert osp.isfile(osp.join(ROOT, "configs", "trainers", name, f"{cfg}.yaml")), (
                key,
                cfg,
            )


def test_imagenet_few_shot_run_is_the_transfer_training_when_the_configs_agree(tmp_path):
    setup = Setup(output=str(tmp_path))
    axes = dict(protocols=["few_shot", "cross_dataset"], optims=["sgd"], datasets=["imagenet"])
    axes.update(shots=[16], seeds=[1], xd_targets=["dtd"])
    grids = select(None, trainers=["KgCoOp", "MMRL"], **axes)
    chains = {c.train.out_dir: c for c in expand(grids, setup)}
    shared = chains[str(tmp_path / "imagenet" / "KgCoOp" / "vit_b16_ep100_ctxv1_16shots" / "seed1")]
    assert shared.train.protocol == "few_shot" and [r.dataset for r in shared.evals] == ["dtd"]
    # its result is both tables' cell: the few-shot ImageNet 16 shots and the transfer source
    folders, kinds = make_tables.run_folders([shared])
    assert {k: v[1] for k, v in folders.items()} == {
        ("cross_dataset", "KgCoOp", "sgd", "imagenet", "acc"): shared.train.out_dir,
        ("few_shot", "KgCoOp", "sgd", "imagenet", "16shots"): shared.train.out_dir,
        ("cross_dataset", "KgCoOp", "sgd", "dtd", "acc"): shared.evals[0].out_dir,
    }
    # MMRL: its few-shot and cross-dataset configs differ, so do the folders
    assert sum(c.train.trainer == "MMRL" for c in chains.values()) == 2
    # one folder, two experiments (MMRL's few-shot TASK FS): refused, not silently merged
    clash = Setup(output=str(tmp_path), cfgs=(("MMRL", "vit_b16_imagenet"),))
    with pytest.raises(ProtocolError, match="different experiments in this one folder"):
        expand(select(None, trainers=["MMRL"], **axes), clash)


def test_few_shot_grid_selection_and_errors(capsys):
    args = grid.build_parser().parse_args(
        ["--protocols", "few_shot", "--trainers", "CoOp", "--datasets", "dtd", "--shots", "2", "8"]
    )
    assert grid.setup_from_args(args).shots == 8  # what the data check checks
    (g,) = grid.grids_from_args(args)
    assert g.shots == (2, 8)
    default = grid.build_parser().parse_args(["--protocols", "few_shot", "--trainers", "CoOp"])
    assert grid.grids_from_args(default)[0].shots == FEW_SHOTS
    assert grid.setup_from_args(grid.build_parser().parse_args(["--trainers", "CoOp"])).shots == 16
    both = ["--protocols", "base2new", "few_shot", "--trainers", "CoOp", "--shots", "1", "2"]
    with pytest.raises(GridError, match="several values are for the few_shot protocol only"):
        grid.setup_from_args(grid.build_parser().parse_args(both))
    with pytest.raises(GridError, match="at least 1 shot"):
        grid.grids_from_args(grid.build_parser().parse_args([*both[:5], "--shots", "0"]))
    (preset,) = select("few-shot", trainers=["CoOp", "MMRL"], shots=[1, 16], seeds=[4])
    assert (preset.trainers, preset.shots, preset.seeds) == (("CoOp", "MMRL"), (1, 16), (4,))
    assert len(expand(select("few-shot"), Setup())) == 5 * 2 * 11 * 5 * 3
    with pytest.raises(ProtocolError, match="folder of another protocol's runs"):
        few_shot_dir(Setup(), "my/evaluation.yaml", "CoOp", "vit_b16", 1, 1)
    assert grid.main(["--protocols", "few_shot", "--trainers", "CoOp", "--datasets", "dtd",
                      "--seeds", "1", "--dry-run", "--output", "nowhere"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "5 runs in 5 chains: 0 done (skipped), 0 to resume or re-run, 5 to run" in out
    assert "nowhere/dtd/CoOp/vit_b16_ep100+sample_2shots/seed1" in out


# -- tables and report from run folders ----------------------------------------------------------
def _fake_grid(out, seeds=(1, 2, 3)):
    """CoOp x {sgd, sample} on dtd and eurosat, 1 and 4 shots: accuracy = 40 + 5 * shots +
    dataset offset + seed / 10, and SAMPLe 1 point higher on dtd, 2 on eurosat."""
    setup = Setup(output=str(out))
    values = {}
    for dataset, offset in (("dtd", 0.0), ("eurosat", 10.0)):
        for optim, gain in (("sgd", 0.0), ("sample", 1.0 + offset / 10)):
            for shots in (1, 4):
                for seed in seeds:
                    run = few_shot_chain(setup, "CoOp", optim, dataset, seed, shots).train
                    acc = 40 + 5 * shots + offset + seed / 10 + gain
                    write_run(run.out_dir, train_log(acc))
                    cost = {"steps": 10 * shots, "train_time_s": shots * (2 if gain else 1)}
                    write_run(run.out_dir, json.dumps(cost), "cost.json")
                    values[optim, dataset, shots, seed] = acc
    return values


def _table_args(out, *more):
    argv = ["--output", str(out), "--protocols", "few_shot", "--trainers", "CoOp"]
    argv += ["--optims", "sgd", "sample", "--datasets", "dtd", "eurosat", "--shots", "1", "4"]
    return make_tables.build_parser().parse_args([*argv, *more])


def test_few_shot_tables_paired_differences_csv_and_report(tmp_path):
    from experiments.report import render_report

    out = tmp_path / "output"
    values = _fake_grid(out)
    results = make_tables.build(_table_args(out))
    average, dtd, eurosat = results.tables
    assert average.title == "Few-shot: average over 2 datasets"
    assert dtd.headers == ["Method", "1 shot", "4 shots"] and eurosat.title == "Few-shot: EuroSAT"
    (_, one, four), (_, s_one, _) = dtd.rows
    assert one.value == pytest.approx(45.2) and four.value == pytest.approx(60.2)
    assert one.n == 3 and one.paper is None and s_one.value == pytest.approx(46.2)
    assert average.rows[0][1].value == pytest.approx((45.2 + 55.2) / 2)
    # SAMPLe - SGD, paired by seed: exactly 1 on dtd, 2 on eurosat, 1.5 on average
    (label, d1, d4), = dtd.diffs.rows  # fmt: skip
    assert label == "CoOp+SAMPLe - CoOp" and d1.diff.mean == pytest.approx(1.0)
    assert d1.diff.seeds == (1, 2, 3) and d4.diff.lo == pytest.approx(1.0)
    avg = average.diffs.rows[0][1].diff
    assert avg.mean == pytest.approx(1.5) and avg.method == "bootstrap" and avg.p is not None
    text = make_tables.render(results.tables, "terminal")
    assert "Few-shot: DTD (3 seeds)" in text and "paper" not in text.split("cells:")[0]
    csv = make_tables.render(results.tables, "csv")
    assert "few_shot,CoOp,sample,eurosat,4shots,72.2," in csv
    assert "few_shot_diff,CoOp,sample,average,1shots," in csv
    # a missing seed is marked and named; the average waits for every dataset
    os.remove(osp.join(out, "eurosat", "CoOp", "vit_b16_ep50_1shots", "seed3", "log.txt"))
    average, _, eurosat = make_tables.build(_table_args(out)).tables
    assert eurosat.rows[0][1].complete is False and eurosat.rows[0][1].n == 2
    assert any("EuroSAT 1 shot: 2/3 seeds; no result seed3" in n for n in eurosat.notes)
    # the cost of each row's 12 runs (2 datasets x 2 shots x 3 seeds), SAMPLe twice SGD's time
    (cost,) = make_tables.build(_table_args(out, "--cost")).tables[3:]
    ((_, sgd_time, sgd_ratio, *_), (_, _, ratio, _, _, runs, _)) = cost.rows
    assert (sgd_time.value, sgd_ratio.value, ratio.value, runs.value) == (2.5, 1.0, 2.0, 12)
    page = render_report(results, str(tmp_path / "report"))
    assert 'alt="Few-shot: DTD bar chart"' in page and "Few-shot: average over 2 datasets" in page
    assert values["sample", "eurosat", 4, 1] == pytest.approx(72.1)


# -- end to end: scripts/few_shot.sh on generated data and the tiny CLIP -------------------------
@pytest.mark.slow
def test_few_shot_script_end_to_end(tmp_path, dtd_root, tiny_clip_opts, capsys):
    """scripts/few_shot.sh: SHOTS="1 2" of CoOp+SAMPLe on the 7-class DTD (2 train.py runs),
    then the grid again (nothing to run) and the table."""
    out = tmp_path / "output"
    env = dict(os.environ, PYTHON=sys.executable, DATA=dtd_root, OUTPUT=str(out), OPTIM="sample")
    env.update(SEEDS="1", SHOTS="1 2", TRAINER="CoOp")
    opts = [*tiny_clip_opts, "TRAINER.COOP.PREC", "fp32", "OPTIM.MAX_EPOCH", "1"]
    cmd = ["bash", osp.join(ROOT, "scripts", "few_shot.sh"), "--quiet", "--no-data-check", "dtd"]
    proc = subprocess.run([*cmd, *opts], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 runs in 2 chains: 0 done (skipped), 0 to resume or re-run, 2 to run" in proc.stdout
    assert "All runs finished." in proc.stdout
    acc = {}
    for comp, shots in (("vit_b16_ep50+sample_1shots", 1), ("vit_b16_ep100+sample_2shots", 2)):
        run = out / "dtd" / "CoOp" / comp / "seed1"
        result = read_run(str(run))
        assert result.status == "done", (run, result.detail)
        acc[shots] = result.accuracy
        with open(run / "config.yaml") as f:
            cfg = yaml.safe_load(f)
        assert cfg["OPTIM"]["SAM"]["NAME"] == "sample"
        assert (cfg["DATASET"]["NUM_SHOTS"], cfg["DATASET"]["SUBSAMPLE_CLASSES"]) == (shots, "all")
        assert cfg["TRAINER"]["COOP"]["N_CTX"] == 16 and cfg["TRAINER"]["COOP"]["CTX_INIT"] == ""
        with open(run / "log.txt") as f:  # all 7 classes, shots x 7 images; the full test split
            log = f.read()
        assert "# classes  7" in log and f"# train_x  {7 * shots}\n" in log
        assert "* total: 21\n" in log.split("Finish training", 1)[1]
    argv = ["--output", str(out), "--protocols", "few_shot", "--trainers", "CoOp", "--optims"]
    argv += ["sample", "--datasets", "dtd", "--seeds", "1", "--shots", "1", "2"]
    assert grid.main([*argv, "--data", dtd_root]) == 0  # finished runs are skipped
    assert "2 runs in 2 chains: 2 done (skipped)" in capsys.readouterr().out
    (panel,) = make_tables.build_tables(make_tables.build_parser().parse_args(argv))
    ((label, one, two),) = panel.rows
    assert (label, one.value, two.value) == ("CoOp+SAMPLe", acc[1], acc[2])
