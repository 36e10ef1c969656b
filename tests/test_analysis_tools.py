"""The analysis tools on real run folders: loss landscape, alignment plot, sweep preset and plot.

One module fixture trains on a miniature ImageNet with the tiny CLIP: a CoOp+SGD run (train.py,
in-process) and the real ``sweep-rho`` preset in a tiny form through ``tools/grid.py`` (CoOp+SAMPLe,
rho 0.02 and 0.1, seeds 1 and 2, base-to-new: 4 training and 4 evaluation runs, packed into two
``--in-process`` workers).
"""

from __future__ import annotations

import json
import os
import os.path as osp
import shutil
import statistics

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT
from dataset_trees import make_imagenet
from helpers import train_in_process
from PIL import Image

from experiments import grid_plan
from experiments.protocols import Setup, options_tag
from experiments.results import read_run
from tools import grid, loss_landscape, plot_alignment, plot_sweep
from tools.loss_landscape import (
    filter_normalize,
    landscape,
    learnable_parameters,
    load_run_trainer,
    prepare_batches,
    random_directions,
)

pytestmark = pytest.mark.slow

RHOS = ("0.02", "0.1")
SEEDS = ("1", "2")
TRAIN_OPTS = ["TRAINER.COOP.PREC", "fp32", "OPTIM.MAX_EPOCH", "2"]
TRAIN_OPTS += ["DATALOADER.TRAIN_X.BATCH_SIZE", "2"]


def _sweep_args(out: str) -> list[str]:
    return [
        *("--preset", "sweep-rho", "--trainers", "CoOp", "--optims", "sample"),
        *("--seeds", *SEEDS, "--sweep", "OPTIM.SAM.RHO", *RHOS),
        *("--shots", "4", "--output", out),
    ]


def _sample_dir(out: str, rho: str, seed: str, stage: str = "train_base") -> str:
    comp = f"vit_b16_ep50_ctxv1+sample-rho{rho}"
    return osp.join(out, "base2new", stage, "imagenet", "shots_4", "CoOp", comp, f"seed{seed}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_clip_opts):
    tmp = tmp_path_factory.mktemp("analysis")
    data = str(tmp / "data")
    make_imagenet(data)
    sgd = str(tmp / "sgd_seed1")
    train_in_process(
        [
            *("--root", data, "--seed", "1", "--trainer", "CoOp"),
            *("--dataset-config-file", osp.join(ROOT, "configs/datasets/imagenet.yaml")),
            *("--config-file", osp.join(ROOT, "configs/trainers/CoOp/vit_b16_ep50_ctxv1.yaml")),
            *("--output-dir", sgd, *tiny_clip_opts, *TRAIN_OPTS),
            *("DATASET.NUM_SHOTS", "4", "DATASET.SUBSAMPLE_CLASSES", "base"),
        ]
    )
    out = str(tmp / "output")
    argv = _sweep_args(out) + ["--data", data, "--no-data-check", "--quiet", "--gpus", "0,1"]
    # --in-process: each "GPU" worker is one process that runs its 4 runs (imports paid twice,
    # not 8 times; the same folders and numbers as a train.py per run, tests/test_packed_runs.py)
    argv.append("--in-process")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # two runs at a time (one per "GPU" worker)
        assert grid.main(argv + ["--", *tiny_clip_opts, *TRAIN_OPTS]) == 0
    return {"sgd": sgd, "sample": _sample_dir(out, RHOS[0], "1"), "output": out}


def _assert_png(path: str, min_bytes: int = 5000) -> None:
    assert osp.isfile(path) and osp.getsize(path) > min_bytes, path
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size[0] > 200 and img.size[1] > 200
        img.verify()


def _snapshot(folder: str) -> dict[str, bytes]:
    files = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            with open(osp.join(dirpath, name), "rb") as f:
                files[osp.relpath(osp.join(dirpath, name), folder)] = f.read()
    return files


# -- the sweep preset and plot_sweep ------------------------------------------------------------
def test_sweep_presets_give_each_value_its_folder(tmp_path):
    assert options_tag(("OPTIM.SAM.RHO", "0.05")) == "rho0.05"
    assert options_tag(("OPTIM.SAM.RHO", "0.1", "OPTIM.SAM.LAMBDA", "0.3")) == "rho0.1_lambda0.3"
    chains = grid_plan.expand(grid_plan.PRESETS["sweep"], Setup(output=str(tmp_path)))
    dirs = [r.out_dir for c in chains for r in c.runs]
    n_rho = 3 * 4 * len(grid_plan.SWEEP_RHO) * 3  # trainers x optimizers x values x seeds
    n_lambda = 3 * 2 * len(grid_plan.SWEEP_LAMBDA) * 3
    assert len(chains) == n_rho + n_lambda and len(set(dirs)) == len(dirs) == 2 * len(chains)
    chain = next(c for c in chains if c.train.variant == ("OPTIM.SAM.LAMBDA", "0.3"))
    assert chain.train.out_dir.endswith(
        "imagenet/shots_16/CoOp/vit_b16_ep50_ctxv1+fsam-lambda0.3/seed1"
    )
    assert chain.train.label == "CoOp+fsam lambda0.3 base2new train_base imagenet seed1"
    for run in chain.runs:  # the option reaches every run, after the protocol's options
        assert run.command(Setup(), 5)[-2:] == ["OPTIM.SAM.LAMBDA", "0.3"]
    args = grid.build_parser().parse_args(["--preset", "sweep", "--sweep", "OPTIM.SAM.RHO", "1"])
    rho, lam = grid.grids_from_args(args)
    assert rho.variants == (("OPTIM.SAM.RHO", "1"),) and len(lam.variants) == 6
    argv = ["--trainers", "CoOp", "--optims", "sam", "--sweep", "OPTIM.SAM.RHO", "0.1", "0.2"]
    (own,) = grid.grids_from_args(grid.build_parser().parse_args(argv))
    assert own.variants == (("OPTIM.SAM.RHO", "0.1"), ("OPTIM.SAM.RHO", "0.2"))
    assert plot_sweep.choose_xscale([float(v) for v in grid_plan.SWEEP_RHO]) == "log"
    assert plot_sweep.choose_xscale([float(v) for v in grid_plan.SWEEP_LAMBDA]) == "linear"
    args = grid.build_parser().parse_args(["--preset", "sweep-rho", "--sweep", "OPTIM.LR", "1"])
    with pytest.raises(grid.GridError, match="sweeps other keys"):
        grid.grids_from_args(args)


def test_sweep_runs_and_plot(runs, tmp_path, capsys):
    out = runs["output"]
    for rho in RHOS:
        for seed in SEEDS:
            with open(osp.join(_sample_dir(out, rho, seed), "config.yaml")) as f:
                assert f"RHO: {rho}" in f.read()
    png = str(tmp_path / "sweep.png")
    assert plot_sweep.main(_sweep_args(out) + ["--metric", "hm", "--out", png]) == 0
    _assert_png(png)
    with open(tmp_path / "sweep.json") as f:
        points = json.load(f)["points"]
    assert [(p["value"], p["seeds"]) for p in points] == [(0.02, "2/2 seeds"), (0.1, "2/2 seeds")]
    for p in points:  # HM per seed from parse_results, then mean and CV across seeds
        rho = "0.02" if p["value"] == 0.02 else "0.1"
        hms = []
        for seed in SEEDS:
            b = read_run(_sample_dir(out, rho, seed)).accuracy
            n = read_run(_sample_dir(out, rho, seed, "test_new")).accuracy
            hms.append(2 * b * n / (b + n) if b + n else 0.0)
        assert p["mean"] == pytest.approx(statistics.fmean(hms), abs=1e-3)
        if p["mean"]:
            cv = 100 * statistics.pstdev(hms) / statistics.fmean(hms)
            assert p["cv_percent"] == pytest.approx(cv, abs=1e-3)
    assert "OPTIM.SAM.RHO" in capsys.readouterr().out
    empty = str(tmp_path / "nothing")
    assert plot_sweep.main(_sweep_args(empty) + ["--out", str(tmp_path / "x.png")]) == 2
    assert "No results yet" in capsys.readouterr().err


# -- plot_alignment -----------------------------------------------------------------------------
def test_alignment_plot_of_sgd_and_sample_runs(runs, tmp_path):
    png = str(tmp_path / "alignment.png")
    metrics = ["cos_g_gp", "cos_gp_m", "xi", "grad_norm", "loss"]
    argv = [runs["sgd"], runs["sample"], "--out", png, "--metrics", *metrics]
    assert plot_alignment.main(argv) == 0
    _assert_png(png, 20000)
    with open(tmp_path / "alignment.json") as f:
        summary = json.load(f)
    sample, sgd = summary["CoOp+SAMPLe"], summary["CoOp"]
    assert set(sgd) == {"loss"}  # SGD logs no diagnostics
    assert set(sample) == set(metrics)
    stages = sample["cos_g_gp"]
    assert list(stages) == ["early", "middle", "late"]
    assert sum(s["steps"] for s in stages.values()) == 12  # 2 epochs x 6 steps
    assert all(-1.0 <= s["mean"] <= 1.0 for s in stages.values())


def test_alignment_reads_resumed_runs_and_rejects_runs_without_diagnostics(runs, tmp_path):
    run = tmp_path / "resumed"
    run.mkdir()
    shutil.copy(osp.join(runs["sample"], "config.yaml"), run)
    rows = [
        {"step": 0, "train/loss": 2.0, "train/cos_g_gp": 0.1},
        {"step": 1, "train/loss": 1.9, "train/cos_g_gp": 0.2},
        {"step": 0, "test/accuracy": 50.0},  # per-epoch evaluation: not a training step
        {"step": 1, "train/loss": 1.5, "train/cos_g_gp": 0.7},  # the resumed attempt
        {"step": 1, "train/lr": 0.002},
    ]
    (run / "scalars.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    scalars = plot_alignment.read_scalars(str(run))
    assert scalars == {
        0: {"loss": 2.0, "cos_g_gp": 0.1},
        1: {"loss": 1.5, "cos_g_gp": 0.7, "lr": 0.002},
    }
    assert plot_alignment.main([runs["sgd"], "--out", str(tmp_path / "a.png")]) == 2
    assert not osp.exists(tmp_path / "a.png")


# -- loss_landscape -----------------------------------------------------------------------------
def test_filter_normalisation_matches_parameter_rows():
    g = torch.Generator().manual_seed(0)
    for shape in ((4, 8), (3, 4, 8), (8,)):
        param = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g)
        d = filter_normalize(torch.randn(shape, generator=g), param)
        width = shape[-1] if len(shape) > 1 else len(param)
        torch.testing.assert_close(
            d.reshape(-1, width).norm(dim=1), param.reshape(-1, width).norm(dim=1)
        )
    params = {"m.ctx": torch.randn(4, 8) * torch.arange(1.0, 5.0).unsqueeze(1)}
    first, again, other = (random_directions(params, 2, s) for s in (3, 3, 4))
    torch.testing.assert_close(first[0]["m.ctx"].norm(dim=1), params["m.ctx"].norm(dim=1))
    assert torch.equal(first[1]["m.ctx"], again[1]["m.ctx"])  # same seed, same directions
    assert not torch.equal(first[0]["m.ctx"], other[0]["m.ctx"])
    assert not torch.allclose(first[0]["m.ctx"], first[1]["m.ctx"])


def test_landscape_origin_is_the_trained_loss_and_parameters_are_restored(runs, tmp_path):
    run = runs["sample"]
    trainer, epoch = load_run_trainer(run, str(tmp_path / "scratch"))
    assert epoch == 2
    params = learnable_parameters(trainer)
    assert list(params) == ["prompt_learner.ctx"]
    ckpt = torch.load(osp.join(run, "prompt_learner", "model.pth.tar-2"), weights_only=False)
    assert torch.equal(params["prompt_learner.ctx"].detach(), ckpt["state_dict"]["ctx"])
    before = {n: p.detach().clone() for n, p in params.items()}
    directions = random_directions(params, 2, seed=0)
    for d in directions:
        torch.testing.assert_close(
            d["prompt_learner.ctx"].norm(dim=1), before["prompt_learner.ctx"].norm(dim=1)
        )
    batches = prepare_batches(trainer, 2)
    alphas = loss_landscape.axis(1.0, 5)
    out = landscape(
        trainer, params, directions, batches, [1, 2], alphas, loss_landscape.axis(1.0, 3)
    )
    for n, p in params.items():  # restored exactly
        assert torch.equal(p.detach(), before[n])
    # the loss at the learned prompts, recomputed through the model's forward on the same batches
    loader = trainer.train_loader_x
    loader.sampler.set_epoch(0)
    total, count = 0.0, 0
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if i == 2:
                break
            logits = trainer.model(batch["img"])
            total += float(F.cross_entropy(logits.float(), batch["label"])) * len(batch["label"])
            count += len(batch["label"])
    assert out["loss_origin"] == pytest.approx(total / count, rel=1e-5)
    assert out["loss_1d"][2] == pytest.approx(out["loss_origin"], rel=1e-6)
    assert out["loss_2d"][1, 1] == pytest.approx(out["loss_origin"], rel=1e-6)
    assert out["loss_2d"][:, 1] == pytest.approx(out["loss_1d"][::2], rel=1e-6)  # d1 is shared
    assert abs(out["loss_1d"][0] - out["loss_origin"]) > 1e-4  # the perturbation is applied


def test_loss_landscape_command(runs, tmp_path, capsys):
    before = {k: _snapshot(runs[k]) for k in ("sgd", "sample")}
    out = str(tmp_path / "landscape")
    argv = [runs["sgd"], runs["sample"], "--out-dir", out, "--points", "5"]
    argv += ["--points-2d", "3", "--batches", "2", "--surface"]
    assert loss_landscape.main(argv) == 0
    for name in ("loss_1d.png", "loss_2d.png", "loss_3d.png"):
        _assert_png(osp.join(out, name))
    for k in ("sgd", "sample"):  # nothing in the run folders was written
        assert _snapshot(runs[k]) == before[k]
    with open(osp.join(out, "landscape.json")) as f:
        result = json.load(f)
    assert [r["label"] for r in result["runs"]] == ["CoOp", "CoOp+SAMPLe"]
    assert loss_landscape.plot_scale(result["runs"], "loss_1d", raw=False) == max(
        abs(v) for r in result["runs"] for v in r["loss_1d"]
    )
    for r in result["runs"]:
        assert r["loss_1d"][2] == pytest.approx(r["loss_origin"], rel=1e-6)
        assert r["parameters"] == {"prompt_learner.ctx": [4, 32]}
    os.remove(osp.join(out, "loss_1d.png"))
    assert (
        loss_landscape.main(["--from-json", osp.join(out, "landscape.json"), "--out-dir", out]) == 0
    )
    _assert_png(osp.join(out, "loss_1d.png"))
    capsys.readouterr()
    assert loss_landscape.main([runs["sample"], "--params", "nothing*", "--out-dir", out]) == 2
    assert "matches no parameter" in capsys.readouterr().err


def test_help_of_every_tool(capsys):
    for tool in (loss_landscape, plot_alignment, plot_sweep):
        with pytest.raises(SystemExit) as e:
            tool.main(["--help"])
        assert e.value.code == 0
        assert "Examples" in capsys.readouterr().out
