"""Reproduction modes (engine/repro.py, configs/repro/), the released code's LR stepping, staged
training's rules and stage-2 schedule, Dassl's drop_last, and the modes in the grid's folders
and tables."""

from __future__ import annotations

import math
import os
import os.path as osp

import pytest
import torch
from conftest import ROOT, make_cfg

from engine import build_trainer
from engine.errors import ConfigError
from experiments.paper_results import paper_value, row_title, split_mode, with_mode
from experiments.protocols import Setup, base2new_chain, load_epoch, repro_of, split_cfg_component
from optim import build_lr_scheduler
from optim.errors import OptimConfigError
from optim.staging import Staging, total_epochs
from tools import make_tables

COOP_SAMPLE = osp.join(ROOT, "configs/optim/CoOp/sample.yaml")
MAPLE_SAMPLE = osp.join(ROOT, "configs/optim/MaPLe/sample.yaml")


# ----------------------------------------------------------------------------------------------
# The modes' configs
# ----------------------------------------------------------------------------------------------
def test_paper_mode_is_the_default_and_keeps_the_config_files():
    cfg = make_cfg(["--optim-config-file", MAPLE_SAMPLE], trainer="MaPLe")
    sam = cfg.OPTIM.SAM
    assert cfg.REPRODUCTION == "paper" and not cfg.OPTIM.LR_STEP_PER_BATCH
    assert (sam.VARIANT, sam.STAGE2_EPOCHS, sam.START_EPOCH) == ("paper", 2, 0)
    assert not cfg.DATALOADER.TRAIN_X.DROP_LAST  # the protocols set it for the paper grid


@pytest.mark.parametrize("how", [["--repro", "released"], ["REPRODUCTION", "released"]])
def test_released_mode_overlay(how):
    flags, opts = (how, []) if how[0].startswith("--") else ([], how)
    cfg = make_cfg([*flags, "--optim-config-file", MAPLE_SAMPLE, *opts], trainer="MaPLe")
    sam = cfg.OPTIM.SAM
    assert cfg.REPRODUCTION == "released" and cfg.OPTIM.LR_STEP_PER_BATCH
    assert (sam.VARIANT, sam.SCHEDULE) == ("reference", "constant")
    assert (sam.START_EPOCH, sam.STAGE2_EPOCHS, tuple(sam.FREEZE)) == (0, 0, ())  # no staging
    assert cfg.DATALOADER.TRAIN_X.DROP_LAST
    assert (sam.RHO, sam.ALPHA, sam.LAMBDA) == (0.1, 0.0015, 0.15)  # the paper's values stay
    # command-line options still win over the overlay
    cfg = make_cfg(["--repro", "released", "DATALOADER.TRAIN_X.DROP_LAST", "False"])
    assert not cfg.DATALOADER.TRAIN_X.DROP_LAST and cfg.OPTIM.LR_STEP_PER_BATCH


def test_released_cocoop_uses_its_own_samples_copy():
    def variant(optim, *flags):
        path = osp.join(ROOT, f"configs/optim/CoCoOp/{optim}.yaml")
        return make_cfg([*flags, "--optim-config-file", path], trainer="CoCoOp").OPTIM.SAM

    assert (variant("sample", "--repro", "released").VARIANT, variant("sample").VARIANT) == (
        "reference-cocoop",
        "paper",
    )
    assert variant("sam", "--repro", "released").VARIANT == "reference"  # SAMPLe's copy only
    assert variant("sample", "--repro", "released").UPDATE == ""  # the variant's own: mean
    assert variant("sample").UPDATE == "mean"  # the paper mode's explicit choice


def test_unknown_or_contradicting_modes_are_errors():
    with pytest.raises(ConfigError, match="REPRODUCTION 'exact': one of paper, released"):
        make_cfg(["REPRODUCTION", "exact"])
    with pytest.raises(ConfigError, match="--repro released and REPRODUCTION paper disagree"):
        make_cfg(["--repro", "released", "REPRODUCTION", "paper"])


# ----------------------------------------------------------------------------------------------
# The released trainers' LR: Dassl's constant warmup + cosine, stepped per batch and per epoch
# ----------------------------------------------------------------------------------------------
def _lr_per_batch(tr) -> list[list[float]]:
    """The LR of every training step, per epoch (read when the step runs)."""
    lrs: list[list[float]] = []
    step = tr.forward_backward

    def recording(batch):
        if tr.batch_idx == 0:
            lrs.append([])
        lrs[-1].append(tr.get_current_lr())
        return step(batch)

    tr.forward_backward = recording
    tr.train()
    return lrs


def _coop(tmp_path, root, tiny_clip_opts, *extra):
    opts = ["--root", root, "--seed", "1", "--output-dir", str(tmp_path / "out")]
    opts += ["--optim-config-file", COOP_SAMPLE, *tiny_clip_opts]
    opts += ["DATASET.NUM_SHOTS", "2", "DATALOADER.TRAIN_X.BATCH_SIZE", "3", "TEST.NO_TEST", "True"]
    opts += ["OPTIM.MAX_EPOCH", "3", "TRAIN.PRINT_FREQ", "100", *extra]
    return build_trainer(make_cfg(opts, config_file="configs/trainers/CoOp/vit_b16_ctxv1.yaml"))


def test_released_mode_lr_sequence_matches_the_released_trainers(
    tmp_path, dtd_root, tiny_clip_opts
):
    # 7 classes x 2 shots = 14 images, batch 3: Dassl's drop_last gives 4 batches per epoch
    tr = _coop(tmp_path, dtd_root, tiny_clip_opts, "REPRODUCTION", "released")
    lrs = _lr_per_batch(tr)
    base, cons, max_epoch, batches = 0.002, 1e-5, 3, 4
    assert [len(e) for e in lrs] == [batches] * max_epoch

    # The released trainers: Dassl's ConstantWarmupScheduler(CosineAnnealingLR(T_max=MAX_EPOCH),
    # 1 epoch at 1e-5). Its counter c starts at 0 and advances after every batch (the SAMPLe
    # branch) and once more at the end of each epoch (update_lr): batches + 1 per epoch. The
    # warmup holds while c < 1; afterwards the cosine runs at t = c - 1, past T_max too (periodic).
    def dassl(c):
        return cons if c < 1 else base * (1 + math.cos(math.pi * (c - 1) / max_epoch)) / 2

    expected = [[dassl(e * (batches + 1) + b) for b in range(batches)] for e in range(max_epoch)]
    for got, want in zip(lrs, expected, strict=True):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    # by hand: epoch 1 = 1e-5, then cos(0), cos(pi/3), cos(2pi/3); epoch 2 starts at t = 4
    assert lrs[0] == pytest.approx([1e-5, 0.002, 0.0015, 0.0005])
    assert lrs[1] == pytest.approx([0.0005, 0.0015, 0.002, 0.0015])
    assert lrs[2][0] == pytest.approx(0.0)  # t = 9: cos(3 pi) -> the LR oscillates
    # the paper mode: once per epoch (1e-5, then the cosine at t = 0, 1), every sample kept
    tr = _coop(tmp_path / "paper", dtd_root, tiny_clip_opts)  # the paper mode
    lrs = _lr_per_batch(tr)
    assert [len(e) for e in lrs] == [5] * 3  # 14 images, batch 3: the last partial batch kept
    assert [e[0] for e in lrs] == pytest.approx([1e-5, 0.002, 0.0015])
    assert all(len(set(e)) == 1 for e in lrs)


def test_per_batch_stepping_only_while_the_sharpness_aware_optimizer_steps(
    tmp_path, dtd_root, tiny_clip_opts
):
    tr = _coop(tmp_path, dtd_root, tiny_clip_opts, "REPRODUCTION", "released", "OPTIM.SAM.NAME", "")
    assert [e[0] for e in _lr_per_batch(tr)] == pytest.approx([1e-5, 0.002, 0.0015])
    tr = _coop(tmp_path / "s", dtd_root, tiny_clip_opts, "REPRODUCTION", "released",
               "OPTIM.SAM.START_EPOCH", "2")  # fmt: skip
    lrs = _lr_per_batch(tr)
    assert [len(set(e)) for e in lrs] == [1, 1, 4]  # per batch from the SAMPLe epoch on


# ----------------------------------------------------------------------------------------------
# Staged training: rules and the stage-2 schedule
# ----------------------------------------------------------------------------------------------
def test_stage2_is_added_after_the_published_schedule_with_its_own_cosine():
    cfg = make_cfg(
        ["--optim-config-file", MAPLE_SAMPLE, "OPTIM.LR", "0.004", "OPTIM.SAM.STAGE2_LR", "0.001"],
        trainer="MaPLe",
        config_file="configs/trainers/MaPLe/vit_b16_c2_ep5_batch4_2ctx.yaml",
    )
    assert total_epochs(cfg.OPTIM) == 7
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.004)
    sched = build_lr_scheduler(opt, cfg.OPTIM)
    lrs = []
    for _ in range(7):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step()
    cosine = [0.004 * (1 + math.cos(math.pi * t / 5)) / 2 for t in range(4)]
    assert lrs == pytest.approx([1e-5, *cosine, 0.001, 0.0005])  # stage 2: 0.001 -> 0 over 2
    cfg = make_cfg(["--optim-config-file", MAPLE_SAMPLE], trainer="MaPLe")
    assert cfg.OPTIM.SAM.STAGE2_LR == 0.0  # 0: the config's OPTIM.LR


def test_freezing_before_a_full_lr_epoch_is_refused():
    cases = [  # (START_EPOCH, STAGE2_EPOCHS, MAX_EPOCH, WARMUP_EPOCH)
        (1, 0, 5, 1),  # the switch right after the constant warmup
        (0, 0, 5, -1),  # frozen from the first step
        (2, 0, 5, 2),
        (0, 1, 1, 1),  # stage 2 after a schedule that is all warmup
    ]
    for start, stage2, max_epoch, warmup in cases:
        with pytest.raises(OptimConfigError, match="OPTIM.SAM.FREEZE.*OPTIM.WARMUP_EPOCH"):
            Staging(start, ["proj.*"], stage2, max_epoch, warmup)
    Staging(2, ["proj.*"], 0, 5, 1)  # one full-LR epoch (epoch 1) before the freeze
    Staging(0, ["proj.*"], 1, 2, 1)  # stage 2 after the published 2 epochs (MaPLe's xd)
    with pytest.raises(OptimConfigError, match="two ways to stage"):
        Staging(1, ["proj.*"], 2, 5, 0)


def test_the_engine_refuses_the_old_maple_cross_dataset_switch(tmp_path, dtd_root, deep_opts):
    from helpers import build

    with pytest.raises(OptimConfigError, match="START_EPOCH 1.*OPTIM.WARMUP_EPOCH is 1"):
        build(tmp_path, dtd_root, deep_opts, "OPTIM.MAX_EPOCH", "2", "OPTIM.SAM.START_EPOCH", "1",
              "OPTIM.SAM.STAGE2_EPOCHS", "0", "OPTIM.WARMUP_EPOCH", "1",
              optim_file="configs/optim/MaPLe/sample.yaml")  # fmt: skip
    with pytest.raises(OptimConfigError, match="LR_STEP_PER_BATCH.*STAGE2_EPOCHS 2"):
        build(tmp_path, dtd_root, deep_opts, "OPTIM.LR_STEP_PER_BATCH", "True",
              optim_file="configs/optim/MaPLe/sample.yaml")  # fmt: skip


def test_load_epoch_counts_stage2(tmp_path):
    run = tmp_path / "run"
    (run / "MultiModalPromptLearner").mkdir(parents=True)
    (run / "config.yaml").write_text("OPTIM:\n  MAX_EPOCH: 5\n  SAM:\n    STAGE2_EPOCHS: 2\n")
    (run / "MultiModalPromptLearner" / "checkpoint").write_text("model.pth.tar-7")
    (run / "MultiModalPromptLearner" / "model.pth.tar-7").write_text("")
    assert load_epoch(str(run)) == 7


# ----------------------------------------------------------------------------------------------
# Dassl's drop_last
# ----------------------------------------------------------------------------------------------
def test_drop_last_follows_dassl(tmp_path, dtd_root, tiny_clip_opts):
    def batches(*extra):
        opts = ["--root", dtd_root, "--seed", "1", "--output-dir", str(tmp_path), *tiny_clip_opts]
        opts += ["DATASET.NUM_SHOTS", "2", "DATALOADER.TRAIN_X.BATCH_SIZE", *extra]
        return len(build_trainer(make_cfg(opts)).train_loader_x)

    assert batches("4") == 4  # 14 images: 3 full batches and a partial one
    assert batches("4", "DATALOADER.TRAIN_X.DROP_LAST", "True") == 3
    assert batches("32", "DATALOADER.TRAIN_X.DROP_LAST", "True") == 1  # smaller than a batch


# ----------------------------------------------------------------------------------------------
# Folders, grid and tables
# ----------------------------------------------------------------------------------------------
def test_the_modes_never_share_a_folder():
    paper = base2new_chain(Setup(output="o"), "CoOp", "sample", "dtd", 1)
    released = base2new_chain(Setup(output="o", repro="released"), "CoOp", "sample", "dtd", 1)
    sgd = base2new_chain(Setup(output="o", repro="released", tag="ep5"), "CoOp", "sgd", "dtd", 1)
    assert paper.train.out_dir.endswith("/CoOp/vit_b16_ctxv1+sample/seed1")
    assert released.train.out_dir.endswith("/CoOp/vit_b16_ctxv1+sample-released/seed1")
    assert sgd.train.out_dir.endswith("/CoOp/vit_b16_ctxv1+sgd-released_ep5/seed1")
    for chain, mode in ((paper, "paper"), (released, "released"), (sgd, "released")):
        tag = split_cfg_component(chain.train.out_dir.split("/")[-2])[2]
        assert repro_of(tag) == mode
        for run in chain.runs:
            cmd = run.command(Setup(), load_epoch=3)
            assert ("--repro" in cmd) == (mode == "released")
            assert (cmd[cmd.index("--repro") + 1] if "--repro" in cmd else "paper") == mode
    cmd = paper.train.command(Setup())
    assert cmd[cmd.index("DATALOADER.TRAIN_X.DROP_LAST") + 1] == "True"  # the paper grid's loader
    assert "DATALOADER.TRAIN_X.DROP_LAST" not in paper.evals[0].command(Setup(), load_epoch=3)


def test_row_keys_of_modes():
    assert split_mode(with_mode("sample", "released")) == ("sample", "released")
    assert split_mode("sample") == ("sample", None)
    assert row_title("CoOp", "sample@released") == "CoOp+SAMPLe [released]"
    assert row_title("CoOp", "sgd@paper") == "CoOp [paper]"
    assert paper_value("base2new", "CoOp", "sample@released", "dtd", "hm") == paper_value(
        "base2new", "CoOp", "sample", "dtd", "hm"
    )


RESULT = "=> result\n* total: 100\n* correct: 50\n* accuracy: {:.2f}%\n"


def _fake(setup, optim, base, new, seeds=(1, 2)):
    chain = base2new_chain(setup, "CoOp", optim, "dtd", 1)
    for seed in seeds:
        for run, acc in ((chain.train, base), (chain.evals[0], new)):
            folder = osp.join(osp.dirname(run.out_dir), f"seed{seed}")
            os.makedirs(folder, exist_ok=True)
            end = "Finish training\n" if run.stage == "train" else ""
            with open(osp.join(folder, "log.txt"), "w") as f:
                f.write(end + RESULT.format(acc))


def test_make_tables_shows_each_mode_as_its_own_row(tmp_path, capsys):
    out = str(tmp_path)
    for optim, b in (("sgd", 80.0), ("sample", 82.0)):
        _fake(Setup(output=out), optim, b, 70.0)
    argv = ["--trainers", "CoOp", "--optims", "sgd", "sample", "--datasets", "dtd"]
    argv += ["--seeds", "1", "2", "--output", out, "--tables", "base2new"]
    assert make_tables.main([*argv, "--repro", "paper", "released"]) == 0
    text = capsys.readouterr().out
    assert "CoOp+SAMPLe " in text and "[paper]" not in text  # only paper runs: no labels
    for optim, b in (("sgd", 79.0), ("sample", 84.0)):
        _fake(Setup(output=out, repro="released"), optim, b, 71.0)
    assert make_tables.main([*argv, "--repro", "paper", "released"]) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.lstrip("| ").startswith("CoOp")]
    titles = [r.strip("| ").split("  ")[0].strip() for r in rows]
    assert titles[:4] == ["CoOp [paper]", "CoOp [released]", "CoOp+SAMPLe [paper]",
                          "CoOp+SAMPLe [released]"]  # fmt: skip
    assert "84.00" in rows[3] and "82.00" in rows[2]
    assert make_tables.main([*argv, "--repro", "released"]) == 0
    text = capsys.readouterr().out
    assert "CoOp+SAMPLe [released]" in text and "[paper]" not in text


# ----------------------------------------------------------------------------------------------
# Point 7: ZeroshotCLIP2's templates, the paper's inconsistent averages
# ----------------------------------------------------------------------------------------------
def test_zeroshotclip2_uses_coops_seven_templates_for_imagenet():
    from trainers.zsclip import IMAGENET_TEMPLATES_SELECT, ZeroshotCLIP2

    zs = ZeroshotCLIP2.__new__(ZeroshotCLIP2)  # templates() reads the config only
    zs.cfg = make_cfg(["DATASET.NAME", "ImageNet"], trainer="ZeroshotCLIP2")
    assert zs.templates() == IMAGENET_TEMPLATES_SELECT and len(zs.templates()) == 7
    zs.cfg = make_cfg([], trainer="ZeroshotCLIP2")  # DTD: CoOp adds its template
    assert zs.templates() == [*IMAGENET_TEMPLATES_SELECT, "{} texture."]
    zs.cfg = make_cfg(["DATASET.NAME", "ImageNetV2"], trainer="ZeroshotCLIP2")
    assert len(zs.templates()) == 8  # CoOp: every dataset but ImageNet gets its template


def test_the_papers_inconsistent_averages_are_pinned():
    from experiments.paper_results import AVERAGE_INCONSISTENCIES, average_conventions

    assert len(AVERAGE_INCONSISTENCIES) == 5
    for trainer, optim, metric, printed, mean, hm in AVERAGE_INCONSISTENCIES:
        assert paper_value("base2new", trainer, optim, "average", metric) == printed
        got_mean, got_hm = average_conventions(trainer, optim, metric)
        assert round(got_mean, 2) == mean and (hm is None) == (got_hm is None)
        assert abs(printed - got_mean) > 0.05  # the printed cell follows from neither
        if hm is not None:
            assert round(got_hm, 2) == hm and abs(printed - got_hm) > 0.05
    assert average_conventions("TCP", "fsam", "base")[0] == pytest.approx(84.1145, abs=1e-4)
    # a consistent row for contrast: CoOp's own average HM is the HM of the means
    assert round(average_conventions("CoOp", "sgd", "hm")[1], 2) == paper_value(
        "base2new", "CoOp", "sgd", "average", "hm"
    )
