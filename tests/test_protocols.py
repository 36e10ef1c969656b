"""Protocol scripts and the experiment grid: layout, expansion, scheduling, end-to-end runs."""

from __future__ import annotations

import os
import os.path as osp
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml
from conftest import ROOT

from experiments import grid_plan, protocols
from experiments.grid_plan import expand, select
from experiments.protocols import (
    ProtocolError,
    Setup,
    cfg_component,
    load_epoch,
    run_status,
    split_cfg_component,
    trainer_config_files,
)
from experiments.results import read_run
from tools import grid, make_tables
from tools.grid import GridError, run_local, submit_slurm

# A stand-in for `python train.py ...`: writes what train.py writes that the grid reads (a log
# with a result, config.yaml and a checkpoint) and records its GPU and arguments.
FAKE_TRAIN = """#!{python}
import os, sys, time
args = sys.argv[2:]
opt = lambda name: args[args.index(name) + 1]
out, seed, ev = opt("--output-dir"), int(opt("--seed")), "--eval-only" in args
if os.environ.get("FAKE_FAIL", "#") in opt("--dataset-config-file"):
    sys.exit(1)
time.sleep(0.2)
os.makedirs(os.path.join(out, "prompt_learner"), exist_ok=True)
log = os.path.join(out, "log.txt")
if os.path.exists(log):
    log += "-2099-01-01-00-00-%02d" % len(os.listdir(out))
with open(log, "w") as f:
    f.write("eval_only: %s\\ngpu: %s\\nargs: %s\\n"
            % (ev, os.environ.get("CUDA_VISIBLE_DEVICES"), " ".join(args)))
    f.write(("=> result" if ev else "Finish training") + "\\n* accuracy: %d.0%%\\n" % (seed + ev))
if not ev:
    with open(os.path.join(out, "config.yaml"), "w") as f:
        f.write("OPTIM:\\n  MAX_EPOCH: 3\\n")
    for name, text in (("model.pth.tar-3", ""), ("checkpoint", "model.pth.tar-3\\n")):
        with open(os.path.join(out, "prompt_learner", name), "w") as f:
            f.write(text)
"""


@pytest.fixture
def fake_python(tmp_path):
    path = tmp_path / "fake_python"
    path.write_text(FAKE_TRAIN.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def _chains(setup, **axes):
    return expand(select(None, **axes), setup)


# -- layout and expansion -----------------------------------------------------------------------
def test_paper_grid_dry_run(tmp_path, capsys):
    out = str(tmp_path / "output")
    # the paper's grids run the paper mode by default, as every command; released is named
    assert (
        grid.main(["--preset", "paper", "--dry-run", "--output", out, "--repro", "released"]) == 0
    )
    text = capsys.readouterr().out
    assert "2100 runs in 855 chains" in text
    b2n = f"{out}/base2new/train_base/dtd/shots_16/CoOp"
    for folder in (
        f"{b2n}/vit_b16_ctxv1+sgd-released/seed1",
        f"{b2n}/vit_b16_ctxv1+sample-released/seed3",
    ):
        assert f"\n{'':>16}{folder}\n" in text, folder
    assert grid.main(["--preset", "paper", "--dry-run", "--output", out]) == 0
    text = capsys.readouterr().out
    assert "2100 runs in 855 chains: 0 done (skipped), 0 to resume or re-run, 2100 to run" in text
    b2n = f"{out}/base2new/train_base/dtd/shots_16/CoOp"
    for folder in (
        f"{b2n}/vit_b16_ctxv1/seed1",  # sgd: CoOp's exact layout
        f"{b2n}/vit_b16_ctxv1+sample/seed3",
        f"{out}/base2new/test_new/dtd/shots_16/CoOp/vit_b16_ctxv1+fsam/seed2",
        f"{out}/base2new/train_base/imagenet/shots_16/CoOp/vit_b16_ep50_ctxv1+sagm/seed1",
        f"{out}/base2new/train_base/sun397/shots_16/TCP/vit_b16_ep25_ctxv1/seed1",
        f"{out}/imagenet/MaPLe/vit_b16_c2_ep5_batch4_2ctx_cross_datasets+sample_16shots/seed1",
        f"{out}/evaluation/CoOp/vit_b16_ep50_ctxv1_16shots/imagenet_r/seed3",
    ):
        assert f"\n{'':>16}{folder}\n" in text, folder
    chains = expand(grid_plan.PRESETS["paper"], Setup(output=out))
    dirs = [r.out_dir for c in chains for r in c.runs]
    assert len(dirs) == len(set(dirs)) == 2100  # optimizers never share a folder
    for chain in chains:
        for run in chain.runs:
            assert ("+" in run.out_dir) == (run.optim != "sgd")


def test_transfer_protocols_share_the_imagenet_training():
    setup = Setup(output="o")
    both = _chains(
        setup, trainers=["MaPLe"], optims=["sample"], seeds=[1], protocols=grid_plan._TRANSFER
    )
    assert len(both) == 1 and len(both[0].evals) == 14
    dg = _chains(setup, trainers=["MaPLe"], optims=["sample"], seeds=[1], protocols=["domain_gen"])
    assert dg[0].train.out_dir == both[0].train.out_dir
    train = both[0].train
    assert train.cfg == "vit_b16_c2_ep5_batch4_2ctx_cross_datasets"
    cmd = train.command(setup)
    # Dassl's drop_last for the grid's training runs; no START_EPOCH override for MaPLe's 2-epoch
    # config any more: its staged SAMPLe adds stage 2 after the published schedule
    assert cmd[-4:] == ["DATALOADER.TRAIN_X.DROP_LAST", "True", "DATASET.NUM_SHOTS", "16"]
    ev = both[0].evals[0].command(setup, load_epoch=2)
    assert ev[ev.index("--load-epoch") + 1] == "2" and "--eval-only" in ev
    assert ev[ev.index("--model-dir") + 1] == train.out_dir
    with pytest.raises(ProtocolError, match="needs the training epoch"):
        both[0].evals[0].command(setup)


def test_base2new_commands_and_user_options():
    setup = Setup(data="/data", output="o", shots=8, opts=("MODEL.BACKBONE.PATH", "w.pt"))
    (chain,) = _chains(setup, trainers=["CoOp"], optims=["sample"], datasets=["dtd"], seeds=[2])
    train = chain.train.command(setup)
    assert train[train.index("--optim-config-file") + 1].endswith("configs/optim/CoOp/sample.yaml")
    assert train[-6:] == [
        *("DATASET.NUM_SHOTS", "8", "DATASET.SUBSAMPLE_CLASSES", "base"),
        *("MODEL.BACKBONE.PATH", "w.pt"),
    ]
    test = chain.evals[0].command(setup, 5)
    assert test[-4:-2] == ["DATASET.SUBSAMPLE_CLASSES", "new"]
    assert (
        chain.evals[0].out_dir == "o/base2new/test_new/dtd/shots_8/CoOp/vit_b16_ctxv1+sample/seed2"
    )


def test_grid_selection_and_errors():
    paper = select("paper", trainers=["CoOp", "Foo"], optims=["sample"], seeds=[1])
    assert [(g.trainers, g.optims, g.seeds) for g in paper] == [(("CoOp",), ("sample",), (1,))] * 2
    assert select("paper", protocols=["domain_gen"])[0].protocols == ("domain_gen",)
    with pytest.raises(GridError, match="--preset or give --trainers"):
        select(None)
    with pytest.raises(GridError, match="Unknown preset"):
        select("papers")
    args = grid.build_parser().parse_args(["--preset", "paper", "--optims", "adam"])
    with pytest.raises(GridError, match="leaves no runs; the preset offers .*'optims'"):
        grid.grids_from_args(args)
    with pytest.raises(GridError, match="leaves no runs"):
        select("sweep-rho", datasets=["small_world"])
    args = make_tables.build_parser().parse_args(["--preset", "sweep-rho"])
    with pytest.raises(GridError, match="would merge the values of a sweep"):
        make_tables.build_tables(args)
    args = grid.build_parser().parse_args(["--trainers", "CoOp", "MaPLe", "--cfg", "x"])
    with pytest.raises(GridError, match="TRAINER=x"):
        grid.setup_from_args(args)
    args = grid.build_parser().parse_args(["--trainers", "CoOp", "--cfg", "vit_b16"])
    assert grid.setup_from_args(args).cfg_for("base2new", "CoOp", "imagenet") == "vit_b16"
    with pytest.raises(GridError, match="KEY VALUE pairs"):
        grid.setup_from_args(args, ["OPTIM.LR"])
    with pytest.raises(ProtocolError, match="No default config"):
        Setup().cfg_for("base2new", "MyTrainer", "dtd")


def test_config_component_round_trip():
    assert cfg_component("vit_b16_ctxv1", "sgd") == "vit_b16_ctxv1"
    assert cfg_component("vit_b16_ctxv1", "sample", "rho0.1") == "vit_b16_ctxv1+sample-rho0.1"
    assert split_cfg_component("vit_b16_ctxv1+sample-rho0.1") == (
        "vit_b16_ctxv1",
        "sample",
        "rho0.1",
    )
    assert split_cfg_component("vit_b16_ctxv1") == ("vit_b16_ctxv1", "sgd", "")
    assert cfg_component("c", "sgd", "t") == "c+sgd-t"
    for bad in (("a+b", "sgd", ""), ("c", "sa-m", ""), ("c", "sam", "a/b")):
        with pytest.raises(ProtocolError):
            cfg_component(*bad)


def test_per_dataset_overlays_are_picked_when_present(tmp_path, monkeypatch):
    folder = tmp_path / "configs" / "trainers" / "T"
    (folder / "per_dataset").mkdir(parents=True)
    for name in ("c.yaml", "per_dataset/dtd.yaml", "c_dtd.yaml", "c_eurosat.yaml"):
        (folder / name).write_text("{}\n")
    monkeypatch.setattr(protocols, "REPO", str(tmp_path))
    assert trainer_config_files("T", "c", "dtd") == (
        "configs/trainers/T/c.yaml",
        "configs/trainers/T/per_dataset/dtd.yaml",
        "configs/trainers/T/c_dtd.yaml",
    )
    assert trainer_config_files("T", "c", "eurosat")[1:] == ("configs/trainers/T/c_eurosat.yaml",)
    assert trainer_config_files("T", "c", "food101") == ("configs/trainers/T/c.yaml",)
    chain = protocols.base2new_chain(Setup(cfgs=(("T", "c"),)), "T", "sam", "dtd", 1)
    assert len(chain.evals[0].config_files) == 3  # evaluations rebuild the trained model
    problems = protocols.missing_files(chain.train)
    assert "configs/optim/sam.yaml not found" in problems[0]
    assert "configs/datasets/dtd.yaml not found" in problems[1]


# -- status, epochs, checks ---------------------------------------------------------------------
def test_run_status_and_load_epoch(tmp_path):
    setup = Setup(output=str(tmp_path))
    (chain,) = _chains(setup, trainers=["CoOp"], optims=["sgd"], datasets=["dtd"], seeds=[1])
    run = chain.train
    assert run_status(run) == "todo"
    os.makedirs(osp.join(run.out_dir, "prompt_learner"))
    with open(osp.join(run.out_dir, "log.txt"), "w") as f:
        f.write("eval_only: False\nepoch [3/10]\n")
    assert run_status(run) == "partial"
    with pytest.raises(ProtocolError, match="no config.yaml or checkpoint pointer"):
        load_epoch(run.out_dir)
    with open(osp.join(run.out_dir, "prompt_learner", "checkpoint"), "w") as f:
        f.write("model.pth.tar-3\n")
    with pytest.raises(ProtocolError, match="not finished"):
        load_epoch(run.out_dir)
    open(osp.join(run.out_dir, "prompt_learner", "model.pth.tar-3"), "w").close()
    assert load_epoch(run.out_dir) == 3  # from the pointer file
    with open(osp.join(run.out_dir, "config.yaml"), "w") as f:
        yaml.safe_dump({"OPTIM": {"MAX_EPOCH": 10}}, f)
    with pytest.raises(ProtocolError, match="model.pth.tar-10"):
        load_epoch(run.out_dir)  # config.yaml says 10 epochs: training is not finished
    open(osp.join(run.out_dir, "prompt_learner", "model.pth.tar-10"), "w").close()
    assert load_epoch(run.out_dir) == 10
    with open(osp.join(run.out_dir, "log.txt"), "a") as f:
        f.write("Finish training\n* accuracy: 61.5%\n")
    assert run_status(run) == "done"


def test_data_check_degrades_without_the_tool(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(protocols, "CHECK_DATA_TOOL", str(tmp_path / "nothing.py"))
    assert protocols.check_data("/data", ["dtd", "imagenet"]) is None
    note = capsys.readouterr().out
    assert "tools/check_data.py not found" in note and "DescribableTextures, ImageNet" in note
    with pytest.raises(ProtocolError, match="Unknown dataset 'dtdd'.*available: .*dtd"):
        protocols.check_data("/data", ["dtdd"])


def test_weights_check_names_the_places_searched(tmp_path, monkeypatch, tiny_clip_opts):
    import huggingface_hub.constants

    monkeypatch.setenv("HOME", str(tmp_path))  # ~/.cache/clip
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    setup = Setup(data="d", opts=("MODEL.BACKBONE.NAME", "ViT-B/16"))
    (chain,) = _chains(setup, trainers=["CoOp"], optims=["sgd"], datasets=["dtd"], seeds=[1])
    problem = protocols.check_run_config(chain.train, setup)
    assert "no CLIP weights" in problem and ".cache/clip/ViT-B-16.pt" in problem
    assert "MODEL.BACKBONE.PATH" in problem
    ok = Setup(data="d", opts=tuple(tiny_clip_opts))
    assert protocols.check_run_config(chain.train, ok) is None
    bad = Setup(data="d", opts=("OPTIM.NOT_A_KEY", "1"))
    assert "OPTIM.NOT_A_KEY" in protocols.check_run_config(chain.train, bad)


# -- scheduling (a stand-in for train.py) -------------------------------------------------------
def test_parallel_workers_one_gpu_each(tmp_path, fake_python, capsys):
    setup = Setup(data="d", output=str(tmp_path / "out"), python=fake_python)
    chains = _chains(
        setup, trainers=["CoOp"], optims=["sgd", "sample"], datasets=["dtd", "eurosat"], seeds=[1]
    )
    assert run_local(chains, setup, ["0", "1"], stream=False) == []
    gpus = set()
    for chain in chains:
        for run in chain.runs:
            assert read_run(run.out_dir, run.stage).accuracy == 1 + (run.stage == "eval")
            with open(osp.join(run.out_dir, "log.txt")) as f:
                log = f.read()
            gpus.add(log.split("gpu: ")[1].split()[0])
            if run.stage == "eval":
                assert "--load-epoch 3" in log  # OPTIM.MAX_EPOCH of the training run
            with open(osp.join(run.out_dir, "console.txt")) as f:
                assert f.read().startswith("\n$ ")
    assert gpus == {"0", "1"}
    out = capsys.readouterr().out
    assert "[done 8/8]" in out and "ETA" in out
    assert run_local(chains, setup, ["0", "1"], stream=False) == []  # all done: nothing runs
    assert "[run" not in capsys.readouterr().out


def test_failures_are_reported_and_resumed(tmp_path, fake_python, monkeypatch, capsys):
    out = str(tmp_path / "out")
    argv = ["--trainers", "CoOp", "--optims", "sgd", "--datasets", "dtd", "eurosat", "--seeds", "1"]
    argv += ["--output", out, "--data", "d", "--no-check", "--quiet"]
    monkeypatch.setattr(sys, "executable", fake_python)  # Setup.python's default
    monkeypatch.setenv("FAKE_FAIL", "eurosat")
    assert grid.main(argv) == 1
    err = capsys.readouterr().err
    assert "2 run(s) failed" in err and "train_base eurosat seed1: train.py exited with 1" in err
    assert "test_new eurosat seed1: not run: its training run has no result" in err
    monkeypatch.delenv("FAKE_FAIL")
    assert grid.main(argv) == 0
    text = capsys.readouterr().out
    assert "2 done (skipped), 1 to resume or re-run, 1 to run" in text
    assert "[resume 1/2] CoOp base2new train_base eurosat seed1" in text


def test_slurm_submission_through_submitit(tmp_path, fake_python, monkeypatch, capsys):
    class FakeExecutor:
        def __init__(self, folder, **kwargs):
            self.folder, self.params, self.kwargs = folder, {}, kwargs
            created.append(self)

        def update_parameters(self, **params):
            self.params.update(params)

        def map_array(self, fn, *iterables):  # runs the jobs here, like submitit's debug mode
            return [
                SimpleNamespace(job_id=f"7_{i}", out=fn(*a)) for i, a in enumerate(zip(*iterables))
            ]

    created = []
    monkeypatch.setitem(sys.modules, "submitit", SimpleNamespace(AutoExecutor=FakeExecutor))
    setup = Setup(data="d", output=str(tmp_path / "out"), python=fake_python)
    chains = _chains(setup, trainers=["CoOp"], optims=["sample"], datasets=["dtd"], seeds=[1, 2])
    args = grid.build_parser().parse_args(
        ["--trainers", "CoOp", "--slurm", "--slurm-partition", "gpu", "--slurm-param", "qos=3"]
    )
    jobs = submit_slurm(chains, setup, args)
    (executor,) = created
    assert executor.folder == osp.join(setup.output, "slurm", "%j")
    assert executor.params["gpus_per_node"] == 1 and executor.params["slurm_partition"] == "gpu"
    assert executor.params["qos"] == 3 and executor.params["slurm_setup"][0].startswith("cd ")
    assert [j.out for j in jobs] == [f"{c.train.label}: done" for c in chains]
    assert "submitted job 7_1: CoOp+sample base2new train_base dtd seed2" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "submitit", None)
    with pytest.raises(GridError, match="pip install submitit"):
        submit_slurm(chains, setup, args)


def test_slurm_status_gpus_and_a_refused_submission(tmp_path, fake_python, monkeypatch, capsys):
    from experiments import grid_slurm

    class Executor:
        refuse = False

        def __init__(self, folder, **kwargs):
            self.folder, self.params = folder, {}
            created.append(self)

        def update_parameters(self, **params):
            self.params.update(params)

        def map_array(self, fn, *iterables):
            if self.refuse:  # what submitit leaves before sbatch refuses the array
                base = osp.dirname(self.folder)
                os.makedirs(base, exist_ok=True)
                for name in ("a1b2.pkl", ".submission_file_a1b2.sh"):
                    open(osp.join(base, name), "w").close()
                raise RuntimeError("sbatch: error: Invalid generic resource (gres) specification")
            return [
                SimpleNamespace(job_id=f"9_{i}", out=fn(*a)) for i, a in enumerate(zip(*iterables))
            ]

    created = []
    monkeypatch.setitem(sys.modules, "submitit", SimpleNamespace(AutoExecutor=Executor))
    monkeypatch.setattr(grid_slurm, "_query", lambda cmd: None)  # no sacct/squeue here
    monkeypatch.setattr(sys, "executable", fake_python)  # Setup.python's default
    out = str(tmp_path / "out")
    argv = ["--trainers", "CoOp", "--optims", "sgd", "sample", "--datasets", "dtd", "--seeds", "1"]
    argv += ["--output", out, "--data", "d", "--no-check", "--slurm", "--slurm-gpus", "0"]
    assert grid.main(argv) == 0
    assert "gpus_per_node" not in created[0].params  # a CPU partition
    assert created[0].params["slurm_additional_parameters"] == {"requeue": True}
    assert grid.main(["--status", "--output", out]) == 0
    text = capsys.readouterr().out
    assert "     done  job 9_1: CoOp+sample base2new train_base dtd seed1 (2/2 runs done)" in text
    assert "2 chains: 2 done (SLURM not reachable: run folders only)" in text
    # a refused submission leaves nothing: no pickles, no sbatch files, no records
    Executor.refuse = True
    other = str(tmp_path / "other")
    assert grid.main([*argv, "--output", other, "--slurm-gpus", "1"]) == 2
    err = capsys.readouterr().err
    assert "SLURM submission failed" in err and "Invalid generic resource" in err
    assert not osp.exists(osp.join(other, "slurm"))
    jobs = osp.join(out, "slurm", grid_slurm.JOBS_FILE)
    with open(jobs) as f:
        recorded = f.read()
    shutil.rmtree(osp.join(out, "base2new", "test_new"))  # the evaluations to run again
    assert grid.main(argv) == 2
    assert sorted(os.listdir(osp.join(out, "slurm"))) == [grid_slurm.JOBS_FILE]
    with open(jobs) as f:
        assert f.read() == recorded


def test_slurm_wait_reports_requeues_and_each_chains_end(tmp_path, monkeypatch, capsys):
    from experiments import grid_slurm

    records = []
    for i in range(3):
        run = tmp_path / f"chain{i}"
        run.mkdir()
        (run / "console.txt").write_text("")
        records.append({"job_id": f"5_{i}", "label": f"chain {i}", "train_dir": str(run),
                        "runs": [[str(run), "train"]], "log": f"/logs/5_{i}.err"})  # fmt: skip
    (tmp_path / "chain2" / "log.txt").write_text("Finish training\n* accuracy: 50.0%\n")
    answers = iter(  # sacct -X -D: one line per attempt of a job
        [
            "5_0|PENDING\n5_1|PENDING\n5_2|PENDING\n",
            "5_0|RUNNING\n5_1|RUNNING\n5_2|RUNNING\n",  # chain 2 is done, its job still runs
            "5_0|FAILED\n5_1|REQUEUED\n5_1|RUNNING\n5_2|COMPLETED\n",
            "5_0|FAILED\n5_1|REQUEUED\n5_1|CANCELLED by 0\n5_2|COMPLETED\n",
        ]
    )
    monkeypatch.setattr(
        grid_slurm, "_query", lambda cmd: next(answers) if cmd[0] == "sacct" else ""
    )
    assert grid_slurm.wait(records, poll_s=0) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == [
        f"[failed] job 5_0: chain 0 (0/1 runs done, SLURM FAILED); logs: "
        f"{tmp_path / 'chain0' / 'console.txt'}, /logs/5_0.err",
        "[requeued] job 5_1: chain 1 (attempt 2)",
        "[done] job 5_2: chain 2 (1/1 runs done)",
        "[cancelled] job 5_1: chain 1 (0/1 runs done, SLURM CANCELLED); the next invocation of "
        "the grid submits it again",
        "3 chains: 1 done, 1 failed, 1 cancelled",
    ]


# -- the scripts, end to end on generated data and the tiny CLIP --------------------------------
def _script(name: str, args: list[str], env: dict, ok: bool = True):
    env = dict(
        os.environ, PYTHON=sys.executable, OMP_NUM_THREADS=os.environ["OMP_NUM_THREADS"], **env
    )
    proc = subprocess.run(
        ["bash", osp.join(ROOT, "scripts", name), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    if ok and proc.returncode != 0:
        raise AssertionError(f"{name} failed ({proc.returncode})\n{proc.stdout}\n{proc.stderr}")
    return proc


def _tiny(tiny_clip_opts):
    return [*tiny_clip_opts, "TRAINER.COOP.PREC", "fp32", "OPTIM.MAX_EPOCH", "1"]


@pytest.mark.slow
def test_base2new_script_end_to_end(tmp_path, dtd_root, tiny_clip_opts):
    out = tmp_path / "output"
    env = {"DATA": dtd_root, "OUTPUT": str(out), "OPTIM": "sgd sample", "SEEDS": "1", "SHOTS": "4"}
    env["REPRO"] = "paper"  # CoOp's folders (also the scripts' default)
    args = ["--quiet", "--no-data-check", "dtd", *_tiny(tiny_clip_opts)]
    proc = _script("base2new.sh", args, env)
    assert "4 runs in 2 chains: 0 done (skipped), 0 to resume or re-run, 4 to run" in proc.stdout
    assert "All runs finished." in proc.stdout
    acc = {}
    for comp, sam in (("vit_b16_ctxv1", ""), ("vit_b16_ctxv1+sample", "sample")):
        for stage in ("train_base", "test_new"):
            run = out / "base2new" / stage / "dtd" / "shots_4" / "CoOp" / comp / "seed1"
            result = read_run(str(run))
            assert result.status == "done", (run, result.detail)
            acc[comp, stage] = result.accuracy
            with open(run / "config.yaml") as f:
                cfg = yaml.safe_load(f)
            assert cfg["OPTIM"]["SAM"]["NAME"] == sam
            assert cfg["DATASET"]["SUBSAMPLE_CLASSES"] == (
                "base" if stage == "train_base" else "new"
            )
        with open(run / "log.txt") as f:
            assert "load_epoch: 1" in f.read()
    proc = _script("base2new.sh", args, env)  # everything finished: nothing runs
    assert "4 runs in 2 chains: 4 done (skipped), 0 to resume or re-run, 0 to run" in proc.stdout
    assert "[run" not in proc.stdout
    argv = ["--output", str(out), "--shots", "4", "--trainers", "CoOp", "--optims", "sgd", "sample"]
    tables = make_tables.build_tables(
        make_tables.build_parser().parse_args([*argv, "--datasets", "dtd", "--seeds", "1"])
    )
    (panel,) = tables
    (_, base, new, hm), (_, sbase, snew, _) = panel.rows
    assert (base.value, new.value) == (
        acc["vit_b16_ctxv1", "train_base"],
        acc["vit_b16_ctxv1", "test_new"],
    )
    assert (sbase.value, snew.value) == (
        acc["vit_b16_ctxv1+sample", "train_base"],
        acc["vit_b16_ctxv1+sample", "test_new"],
    )
    assert (base.paper, snew.paper, hm.paper) == (79.44, 63.04, 54.24)


@pytest.mark.slow
def test_script_stops_when_data_or_weights_are_missing(tmp_path, tiny_clip_opts):
    if not osp.isfile(protocols.CHECK_DATA_TOOL):
        pytest.skip("tools/check_data.py is not in this checkout")
    opts = _tiny(tiny_clip_opts)
    opts[opts.index("MODEL.BACKBONE.PATH") + 1] = str(tmp_path / "missing.pt")
    out = tmp_path / "output"
    env = {"DATA": str(tmp_path / "no_data"), "OUTPUT": str(out), "OPTIM": "sgd", "SEEDS": "1"}
    proc = _script("base2new.sh", ["dtd", *opts], env, ok=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Pre-flight checks failed" in proc.stderr and "data check failed" in proc.stderr
    assert "MODEL.BACKBONE.PATH does not exist" in proc.stderr
    assert not out.exists()


@pytest.mark.slow
def test_transfer_scripts_end_to_end(tmp_path, tiny_clip_opts):
    from datasets.synthetic import make_dtd, make_image_folder

    data, out = tmp_path / "data", tmp_path / "output"
    wnids = ["n01440764", "n01443537", "n01484850"]
    for split, seed in (("train", 1), ("val", 2)):
        make_image_folder(str(data / "imagenet" / "images" / split), wnids, per_class=4, seed=seed)
    (data / "imagenet" / "classnames.txt").write_text(
        "n01440764 tench\nn01443537 goldfish\nn01484850 great white shark\n"
    )
    make_image_folder(str(data / "imagenet-sketch" / "images"), wnids, per_class=3, seed=3)
    make_dtd(str(data), per_class=6)
    env = {"DATA": str(data), "OUTPUT": str(out), "OPTIM": "sgd", "SEEDS": "1", "SHOTS": "2"}
    args = ["--quiet", "--no-check", *_tiny(tiny_clip_opts)]  # checks: see the tests above
    _script("cross_dataset.sh", args, dict(env, TARGETS="dtd"))
    comp = "vit_b16_ep50_ctxv1_2shots"  # the scripts' default mode: paper (CoOp's folder)
    train = out / "imagenet" / "CoOp" / comp / "seed1"
    dtd = out / "evaluation" / "CoOp" / comp / "dtd" / "seed1"
    result = read_run(str(train))
    assert result.status == "done" and read_run(str(dtd), "eval").status == "done"
    # domain generalization evaluates the same ImageNet model: its training is skipped
    proc = _script("domain_gen.sh", args, dict(env, TARGETS="imagenet_sketch"))
    assert "2 runs in 1 chains: 1 done (skipped), 0 to resume or re-run, 1 to run" in proc.stdout
    assert "[run 1/1] CoOp domain_gen eval imagenet_sketch seed1" in proc.stdout
    sketch = dtd.parent.parent / "imagenet_sketch" / "seed1"
    assert read_run(str(sketch)).status == "done"
    argv = ["--output", str(out), "--shots", "2", "--trainers", "CoOp", "--optims", "sgd"]
    argv += ["--protocols", "cross_dataset", "domain_gen", "--seeds", "1"]
    argv += ["--xd-targets", "dtd", "--dg-targets", "imagenet_sketch"]
    xd, dg = make_tables.build_tables(make_tables.build_parser().parse_args(argv))
    assert xd.headers == ["Method", "ImageNet", "DTD", "Avg"] and dg.headers[2] == "ImageNet-S"
    assert xd.rows[0][1].value == result.accuracy and xd.rows[0][1].paper == 71.51
    assert dg.rows[0][2].value == read_run(str(sketch)).accuracy


_PLUGIN_TRAINER = """
from engine.registry import TRAINER_REGISTRY
from trainers.coop import CoOp


@TRAINER_REGISTRY.register()
class ProtocolCoOp(CoOp):
    PROTOCOL_CFGS = {"base2new": "vit_b16_ctxv1", "base2new/dtd": "vit_b16_ep50_ctxv1",
                     "transfer": "vit_b16_c2"}
"""


def test_a_new_trainer_declares_its_protocol_configs_beside_itself(tmp_path):
    """A plugin trainer's PROTOCOL_CFGS give the grid its configs for every protocol (no edit in
    tools/); the project's trainers declare theirs the same way."""
    from engine.registry import TRAINER_REGISTRY
    from experiments.protocols import trainer_cfgs

    plugin = tmp_path / "protocol_coop.py"
    plugin.write_text(_PLUGIN_TRAINER)
    saved = dict(TRAINER_REGISTRY._obj_map)  # the plugin registers into a copy (undone below)
    try:
        setup = Setup(plugins=(str(plugin),))
        assert setup.cfg_for("base2new", "ProtocolCoOp", "eurosat") == "vit_b16_ctxv1"
        assert setup.cfg_for("base2new", "ProtocolCoOp", "dtd") == "vit_b16_ep50_ctxv1"
        assert setup.cfg_for("cross_dataset", "ProtocolCoOp", "imagenet") == "vit_b16_c2"
        assert setup.cfg_for("domain_gen", "ProtocolCoOp", "imagenet") == "vit_b16_c2"
    finally:
        TRAINER_REGISTRY._obj_map.clear()
        TRAINER_REGISTRY._obj_map.update(saved)
    assert Setup().cfg_for("base2new", "TCP", "sun397") == "vit_b16_ep25_ctxv1"
    assert Setup().cfg_for("cross_dataset", "CoOp", "dtd") == "vit_b16_ep50_ctxv1"  # ImageNet's
    assert Setup().cfg_for("cross_dataset", "MaPLe", "dtd").endswith("_cross_datasets")
    assert trainer_cfgs("ZeroshotCLIP") == {}  # declares none: --cfg needed
    for name in ("CoOp", "CoCoOp", "MaPLe", "CoPrompt", "TCP", "KgCoOp", "IVLP", "PromptSRC"):
        for cfg in trainer_cfgs(name).values():  # every declared config exists
            assert osp.isfile(osp.join(ROOT, "configs", "trainers", name, f"{cfg}.yaml")), cfg
