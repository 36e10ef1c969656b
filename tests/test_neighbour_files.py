"""The neighbours, second round (issue 32): TCP's and CoPrompt's own scripts and configs, trainer
files of another repository's ``trainers`` package, trainer files that fail, evaluation into the
trained folder, and the messages that point to the right place.

The neighbours' files are written in their published formats in tests/neighbour_files.py and
dropped next to the project in temporary folders laid out like their repositories (the scripts
run through tests/test_neighbours.py's ``neighbour_repo``: this project's ``train.py``, and a
``python`` that appends the toy setting's options). Trainer files register into the
process-wide registry, so those cases run in a subprocess.
"""

from __future__ import annotations

import json
import os
import os.path as osp
import subprocess
import sys

import pytest
from conftest import ROOT, make_cfg
from neighbour_files import (
    CLIP_TEXT_PY,
    COPROMPT_CONFIG,
    COPROMPT_TEST_SH,
    COPROMPT_TRAIN_SH,
    IMAGENET_TEMPLATES_PY,
    KGCOOP_PY,
    MMRL_PY,
    PROGRAD_PY,
    TCP_CONFIG,
    TCP_DATASETS,
    TCP_PARSE_TEST_RES,
    TCP_PY,
    TCP_TRAIN_SH,
    TRAIN_PY,
)
from test_neighbours import (
    CLASSES,
    KGCOOP_CONFIG,
    PROGRAD_CONFIG,
    neighbour_repo,
    parse_test_res,
    run_script,
)

from datasets.synthetic import DTD_CLASSES
from engine.cli import build_parser, setup_cfg
from engine.errors import ConfigError


# ----------------------------------------------------------------------------------------------
# Keys: TCP's and CoPrompt's layouts translated, suggestions within a trainer's node, the
# neighbours' layouts and MMRL named
# ----------------------------------------------------------------------------------------------
def _cfg(argv, notes=None):
    return setup_cfg(build_parser().parse_args(argv), notes)


def test_tcp_and_coprompt_files_are_read_through_the_translation(tmp_path):
    tcp, coprompt = tmp_path / "tcp.yaml", tmp_path / "coprompt.yaml"
    tcp.write_text(TCP_CONFIG)
    coprompt.write_text(COPROMPT_CONFIG)
    sun = osp.join(ROOT, "configs/datasets/sun397.yaml")
    # TCP's script's options; TCP's train.py trains SUN397 (and ImageNet) 25 epochs
    opts = ["TRAINER.COOP.N_CTX", "4", "TRAINER.COOP.CSC", "False", "TRAINER.COOP.W", "1.0"]
    opts += ["TRAINER.COOP.CLASS_TOKEN_POSITION", "end"]
    argv = ["--trainer", "TCP", "--dataset-config-file", sun, "--config-file", str(tcp), *opts]
    cfg = _cfg(argv, notes := [])
    assert (cfg.TRAINER.TCP.N_CTX, cfg.TRAINER.TCP.TRAIN_PY_RULES) == (4, True)
    assert cfg.OPTIM.MAX_EPOCH == 25 and cfg.OPTIM.NAME == "adam"
    assert cfg.TRAINER.TCP.KG_WEIGHT == 8.0  # TCP's loss weight; its COOP.W is unused there
    assert "TRAINER.COOP.W 1.0 (the command line) -> dropped (unused)" in notes
    assert "OPTIM.MAX_EPOCH 50 -> 25 (TRAINER.TCP.TRAIN_PY_RULES)" in notes[-1]
    with pytest.raises(ConfigError, match=r"supports CTX_INIT False only.*--trainer KgCoOp"):
        _cfg(["--trainer", "TCP", "TRAINER.COOP.CTX_INIT", "True"])
    # CoPrompt's config: TRAINER.CoPrompt / TRAINER.W / TRAINER.DISTILL, then the values of
    # CoPrompt's train.py for the dataset (DTD: depth 12, W 8.0); the command line still wins
    dtd = osp.join(ROOT, "configs/datasets/dtd.yaml")
    argv = ["--trainer", "CoPrompt", "--dataset-config-file", dtd, "--config-file", str(coprompt)]
    cfg = _cfg([*argv, "TRAINER.CoPrompt.N_CTX", "3"], notes := [])
    node = cfg.TRAINER.COPROMPT
    assert (node.PROMPT_DEPTH, node.W, node.N_CTX, node.DISTILL_LOSS) == (12, 8.0, 3, "cos")
    assert (node.CTX_INIT, node.PREC, node.TRAIN_PY_RULES) == ("a photo of a", "fp16", True)
    assert any(n.startswith("TRAINER.W 1.0 (config file") for n in notes)
    assert "PROMPT_DEPTH 9 -> 12, N_CTX 3 -> 2, W 1.0 -> 8.0 (the KEY VALUE" in notes[-1]
    # the project's own config files leave both rules off
    cfg = make_cfg([], trainer="TCP", dataset_cfg="configs/datasets/sun397.yaml",
                   config_file="configs/trainers/TCP/vit_b16_ep100_ctxv1.yaml")  # fmt: skip
    assert cfg.OPTIM.MAX_EPOCH == 50 and not cfg.TRAINER.TCP.TRAIN_PY_RULES


def test_unknown_keys_name_their_neighbour_and_never_another_trainers_node(tmp_path):
    def refused(argv):
        with pytest.raises(ConfigError) as info:
            _cfg(argv)
        return str(info.value)

    coprompt = tmp_path / "coprompt.yaml"
    coprompt.write_text(COPROMPT_CONFIG)
    # TCP's W with another trainer: KgCoOp's and TCP's layout, not "do you mean TRAINER.KGCOOP.W"
    msg = refused(["--trainer", "CoOp", "TRAINER.COOP.W", "1.0"])
    assert "KgCoOp's and TCP's layout" in msg and "--trainer KgCoOp or --trainer TCP" in msg
    assert "KGCOOP" not in msg
    msg = refused(["--trainer", "MaPLe", "--config-file", str(coprompt)])
    assert "'TRAINER.CoPrompt.N_CTX'" in msg and "CoPrompt's layout" in msg
    assert "ShuvenduRoy/CoPrompt" in msg and "--trainer CoPrompt" in msg and "TCP" not in msg
    # MMRL's top-level TASK with another trainer: MMRL's layout, named with --trainer MMRL;
    # MMRL++'s node: not a trainer here yet, the nearest named
    msg = refused(["--trainer", "MaPLe", "TASK", "B2N"])
    assert "MMRL's layout" in msg and "yunncheng/MMRL" in msg and "--trainer MMRL" in msg
    msg = refused(["--trainer", "MaPLe", "TRAINER.MMRLpp.BETA", "0.9"])
    assert "belongs to MMRL++" in msg and "--trainer MMRL with configs/trainers/MMRL/" in msg
    assert "do you mean" not in msg
    # ProGrad's keys name ProGrad's repository
    assert "BeierZhu/Prompt-align" in refused(["--trainer", "CoOp", "LOSS.LAMBDA", "1.0"])
    # a near miss inside the trainer's own node is suggested; across nodes nothing is
    assert "(do you mean TRAINER.TCP.N_CTX?)" in refused(
        ["--trainer", "TCP", "TRAINER.TCP.NCTX", "4"]
    )
    msg = refused(["--trainer", "CoCoOp", "TRAINER.COCOOP.W", "8.0"])
    assert "do you mean" not in msg  # not TRAINER.KGCOOP.W nor TRAINER.COPROMPT.W
    assert "(do you mean OPTIM.LR?)" in refused(["--trainer", "CoOp", "OPTIM.LRR", "0.1"])


# ----------------------------------------------------------------------------------------------
# Trainer files of another repository's trainers package
# ----------------------------------------------------------------------------------------------
def _family_repo(tmp_path):
    """A repository of the family: train.py (extend_cfg), configs, trainers/ with relative
    imports and a bundled clip package."""
    repo = tmp_path / "neighbour"
    files = {
        "train.py": TRAIN_PY,
        "configs/trainers/ProGrad/rn50.yaml": PROGRAD_CONFIG,
        "configs/trainers/KgCoOp/vit_b16_ep100_ctxv1.yaml": KGCOOP_CONFIG,
        "trainers/__init__.py": "",
        "trainers/imagenet_templates.py": IMAGENET_TEMPLATES_PY,
        "trainers/kgcoop.py": KGCOOP_PY,
        "trainers/prograd.py": PROGRAD_PY,
        "trainers/tcp.py": TCP_PY,
        "trainers/clip_text/__init__.py": "from .clip import *\n",
        "trainers/clip_text/clip.py": CLIP_TEXT_PY,
        "trainers/mmrl.py": MMRL_PY,
    }
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    return repo


_DRIVER = """
import contextlib, io, json, sys
import datasets, trainers
from engine.runner import run_in_process
from engine.registry import TRAINER_REGISTRY

def run(name, argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run_in_process(argv)
    print(json.dumps({"case": name, "code": code, "err": err.getvalue()}))

cases = json.loads(sys.argv[1])
for name, argv in cases[:2]:  # the repository is not on the path yet
    run(name, argv)
sys.path.append(sys.argv[2])  # as PYTHONPATH=<repository> would
for name, argv in cases[2:]:
    run(name, argv)
for name in ("ProGrad", "KgCoOp"):
    cls = TRAINER_REGISTRY.get(name)
    print(json.dumps({"case": name, "module": cls.__module__,
                      "file": sys.modules[cls.__module__].__file__}))
from engine.cli import build_parser, setup_cfg  # a plugin's own extend_cfg
cfg = setup_cfg(build_parser().parse_args(
    ["--plugin", sys.argv[3], "--trainer", "CoOp", "MYLAB.ALPHA", "0.5"]))
print(json.dumps({"case": "extend_cfg", "values": [cfg.MYLAB.ALPHA, cfg.MYLAB.NAME]}))
"""
OWN_KEYS = """from yacs.config import CfgNode as CN


def extend_cfg(cfg):
    cfg.MYLAB = CN()
    cfg.MYLAB.ALPHA = 1.0
    cfg.MYLAB.NAME = "mine"
"""


def test_trainer_files_of_another_repository_load_refuse_and_fail_as_one_paragraph(
    tmp_path, dtd_root, tiny_clip_opts
):
    repo = _family_repo(tmp_path)
    dtd = osp.join(ROOT, "configs/datasets/dtd.yaml")
    base = ["--root", dtd_root, "--seed", "1", "--dataset-config-file", dtd]
    toy = [*tiny_clip_opts, "TRAINER.COOP.PREC", "fp32", "DATASET.NUM_SHOTS", "2"]
    toy += ["OPTIM.MAX_EPOCH", "1"]

    def run(name, out, *flags, opts=()):
        return [name, [*base, "--output-dir", str(tmp_path / out), *flags, *toy, *opts]]

    prograd_cfg = str(repo / "configs/trainers/ProGrad/rn50.yaml")
    kgcoop_cfg = str(repo / "configs/trainers/KgCoOp/vit_b16_ep100_ctxv1.yaml")
    cases = [
        run("clash", "a", "--plugin", "trainers.tcp", "--trainer", "TCP"),
        run("by_path", "b", "--plugin", str(repo / "trainers/prograd.py"), "--trainer", "ProGrad"),
        run("kgcoop", "kgcoop", "--plugin", "trainers.kgcoop", "--trainer", "KgCoOp",
            "--config-file", kgcoop_cfg, "--no-train", opts=["TRAINER.COOP.W", "8.0"]),
        run("prograd", "prograd", "--plugin", "trainers.prograd", "--trainer", "ProGrad",
            "--config-file", prograd_cfg, opts=["DATASET.SUBSAMPLE_CLASSES", "base"]),
        run("tcp", "tcp", "--plugin", "trainers.tcp", "--trainer", "TCP"),
        run("mmrl", "mmrl", "--plugin", "trainers.mmrl", "--trainer", "MMRL"),
    ]  # fmt: skip
    own_keys = tmp_path / "mylab_keys.py"
    own_keys.write_text(OWN_KEYS)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("SAMPLE_PL_PLUGINS", None)
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(cases), str(repo), str(own_keys)],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith('{"case"'):
            row = json.loads(line)
            out[row["case"]] = row
    # by module name without the repository on the path: the project's own package, refused
    err = out["clash"]["err"]
    assert out["clash"]["code"] == 2 and "Traceback" not in err
    assert "names this project's own package 'trainers'" in err
    assert osp.join(ROOT, "trainers", "tcp.py") in err and "PYTHONPATH=/path/to/repo" in err
    # by path, a file with relative imports: the module form that loads it
    err = out["by_path"]["err"]
    assert out["by_path"]["code"] == 2 and "imports its package's modules relatively" in err
    assert f"--plugin trainers.prograd with {repo} on PYTHONPATH" in err
    # with the repository on the path: its trainers package, under a name of its own
    assert out["ProGrad"]["file"] == str(repo / "trainers" / "prograd.py")
    assert out["ProGrad"]["module"] == "trainers_of_neighbour.prograd"
    # ProGrad's file trains with the LOSS keys of its repository's train.py and its config
    assert out["prograd"]["code"] == 0, out["prograd"]["err"][-3000:]
    assert "ProGrad file: LOSS.NAME prograd, T 1.0, 2 templates" in proc.stdout
    log = (tmp_path / "prograd" / "log.txt").read_text()
    assert "TRAINER.COOP.CTX_INIT True (config file" in log and "Finished training" in log
    assert "LOSS:\n  ALPHA: 0.0\n  GM: False\n  LAMBDA: 1.0\n  NAME: prograd\n" in log
    assert parse_test_res(str(tmp_path / "prograd"), "Finished training") is not None
    # KgCoOp's file with KgCoOp's config: CTX_INIT True read as words, W from the command line
    assert out["kgcoop"]["code"] == 0, out["kgcoop"]["err"][-3000:]
    assert "KgCoOp file: CTX_INIT 'a photo of a', W 8.0" in proc.stdout
    assert out["KgCoOp"]["file"] == str(repo / "trainers" / "kgcoop.py")
    log = (tmp_path / "kgcoop" / "log.txt").read_text()  # what its train.py declares
    assert (
        "Config translated for --trainer KgCoOp: keys declared by the plugins' extend_cfg: LOSS"
        in log
    )
    assert (
        "TRAINER.COOP.CTX_INIT True (config file" in log
        and "-> TRAINER.COOP.CTX_INIT 'a photo of a'" in log
    )
    assert out["extend_cfg"]["values"] == [0.5, "mine"]  # a plugin's own declared keys
    # a file that fails while building: one paragraph, file, line, missing name, route
    for case, missing, route in (
        ("tcp", "KeyError: ''", "This project has its own TCP"),
        ("mmrl", "build_model_MMRL", "This project has its own MMRL"),
    ):
        err = out[case]["err"]
        assert out[case]["code"] == 2 and "Traceback" not in err, err
        assert f"The trainer file {repo / 'trainers' / case}.py" in err
        assert "failed while building its model (build_model)" in err and missing in err
        error = [line for line in err.splitlines() if line.startswith("Error: ")]
        assert len(error) == 1 and route in error[0]  # one paragraph
    assert f"{repo / 'trainers' / 'tcp.py'}:" in out["tcp"]["err"]
    assert "`url = clip._MODELS[backbone_name]`; the missing name is ''" in out["tcp"]["err"]
    assert "`self.clip_model = clip.build_model_MMRL({}, details)`" in out["mmrl"]["err"]


STEP_FAILS = """
import torch
import torch.nn as nn
from torch.nn import functional as F

from dassl.engine import TrainerX
from dassl.optim import build_optimizer, build_lr_scheduler


class Steps(TrainerX):
    def build_model(self):
        self.model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 3))
        self.optim = build_optimizer(self.model, self.cfg.OPTIM)
        self.sched = build_lr_scheduler(self.optim, self.cfg.OPTIM)
        self.register_model("model", self.model, self.optim, self.sched)

    def forward_backward(self, batch):
        image, label = self.parse_batch_train(batch)
        with torch.no_grad():
            zs = self.zs_clip(image)
        loss = F.cross_entropy(self.model(image), label) + 0 * zs.sum()
        self.model_backward_and_update(loss)
        return {"loss": loss.item()}
"""


def test_a_trainer_file_that_fails_at_its_first_step_is_one_paragraph(tmp_path, tiny_clip_opts):
    import importlib.util

    import torch

    from dassl.engine.file_errors import TrainerFileError

    path = tmp_path / "other" / "steps.py"
    path.parent.mkdir()
    path.write_text(STEP_FAILS)
    spec = importlib.util.spec_from_file_location("issue32_steps", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["issue32_steps"] = module
    try:
        spec.loader.exec_module(module)
        cfg = make_cfg([*tiny_clip_opts, "OUTPUT_DIR", str(tmp_path / "run")])
        tr = module.Steps(cfg, classnames=CLASSES)
        tr.epoch, tr.batch_idx, tr.num_batches = 0, 0, 1
        batch = {"img": torch.randn(2, 3, 32, 32), "label": torch.tensor([0, 1])}
        with pytest.raises(TrainerFileError) as info:
            tr.train_step(batch)
    finally:
        del sys.modules["issue32_steps"]
    msg = str(info.value)
    assert f"The trainer file {path} (Steps) failed in a training step" in msg
    assert "(forward_backward, epoch 1, batch 1)" in msg and f"{path}:20:" in msg
    assert "`zs = self.zs_clip(image)`; the missing name is 'zs_clip'" in msg
    assert "open an issue named 'Steps trainer'" in msg


# ----------------------------------------------------------------------------------------------
# Evaluating into the trained folder; a missing epoch
# ----------------------------------------------------------------------------------------------
def test_eval_into_the_folder_of_its_checkpoint_and_a_missing_epoch(
    tmp_path, dtd_root, tiny_clip_opts, capsys
):
    from helpers import coop_args

    from engine.runner import run_in_process

    def train_py(args):
        code = run_in_process(args)
        return code, capsys.readouterr().err

    run = str(tmp_path / "run")
    train = coop_args(dtd_root, run, tiny_clip_opts, "OPTIM.MAX_EPOCH", "1")
    assert train_py(train)[0] == 0
    kept = {n: open(osp.join(run, n), "rb").read() for n in ("experiment.json", "config.yaml")}
    kept["log.txt"] = open(osp.join(run, "log.txt"), "rb").read()
    new = ["DATASET.SUBSAMPLE_CLASSES", "new"]
    flags = ["--eval-only", "--model-dir", run, "--load-epoch", "1"]
    code, err = train_py(coop_args(dtd_root, run, tiny_clip_opts, *new, flags=flags))
    assert code == 0, err
    for name, data in kept.items():  # the training run's files are untouched
        assert open(osp.join(run, name), "rb").read() == data, name
    logs = [n for n in os.listdir(run) if n.startswith("log.txt-")]
    assert len(logs) == 1
    log = open(osp.join(run, logs[0])).read()
    assert "Evaluating the model of" in log and "* accuracy:" in log
    # the training command still runs there (the same experiment: already trained)
    assert train_py(train)[0] == 0
    # --overwrite would move the model away first: refused
    code, err = train_py(coop_args(dtd_root, run, tiny_clip_opts, flags=[*flags, "--overwrite"]))
    assert code == 2 and "it would move the model aside" in err
    # a missing epoch lists those found
    out = str(tmp_path / "eval")
    code, err = train_py(coop_args(dtd_root, out, tiny_clip_opts, flags=[*flags[:-1], "5"]))
    assert code == 2 and "model.pth.tar-5" in err
    assert f"the epochs found in {osp.join(run, 'prompt_learner')}: 1 (--load-epoch N)" in err


# ----------------------------------------------------------------------------------------------
# TCP's and CoPrompt's scripts, unchanged
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tcp_scripts_train_and_test_and_its_parser_reads_the_results(tmp_path, tiny_clip, dtd_root):
    files = {
        "scripts/base2new_train.sh": TCP_TRAIN_SH,
        "configs/trainers/TCP/vit_b16_ep100_ctxv1.yaml": TCP_CONFIG,
    }
    extra = ["TRAINER.COOP.PREC", "fp32", "TRAINER.TCP.INJECT_LAYER", "1"]
    repo, env = neighbour_repo(tmp_path, tiny_clip, files, dtd_root, *extra)
    (repo / "parse_test_res.py").write_text(TCP_PARSE_TEST_RES)
    tail = "shots_16_1.0/TCP/vit_b16_ep100_ctxv1"
    skipped = []  # every other dataset and seed exists already: "Results are available"
    for dataset in [*TCP_DATASETS, "sun397", "imagenet"]:
        for seed in (1, 2, 3) if dataset != "dtd" else (2, 3):
            for top in ("output_1108_4/base2new/train_base", "output_1108_4_eval/base2new/test_new",
                        "output_1108_4/base2new/test_new"):  # fmt: skip
                skipped.append(repo / top / dataset / tail / f"seed{seed}")
                skipped[-1].mkdir(parents=True)
    stdout = run_script(repo, env, "base2new_train.sh", cwd=repo / "scripts")
    assert stdout.count("Run this job") == 2
    train = repo / "output_1108_4/base2new/train_base/dtd" / tail / "seed1"
    test = repo / "output_1108_4_eval/base2new/test_new/dtd" / tail / "seed1"
    log = (train / "log.txt").read_text()
    head = log[: log.index("** Arguments **")]  # the translation at the top of the log
    assert "Config translated for --trainer TCP: TRAINER.COOP.CTX_INIT False (config file" in head
    assert "TRAINER.COOP.W 1.0 (the command line) -> dropped (unused)" in head
    assert (train / "prompt_learner" / "model.pth.tar-50").is_file()
    for path in skipped:
        if path.parent.parent.parent.parent.name == "dtd":
            path.rmdir()  # the parser reads every seed folder
    # TCP's eval.sh: its parser with --test-log on the evaluation (and the training) folder
    rel = osp.relpath(test.parent, repo) + "/"
    argv = [sys.executable, "parse_test_res.py", rel, "--test-log"]
    proc = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("* test_new dtd accuracy: "), proc.stdout
    assert parse_test_res(str(train), "=> result") is not None


@pytest.mark.slow
def test_coprompt_scripts_train_and_test(tmp_path, tiny_clip, dtd_root):
    files = {
        "scripts/base2new_train_coprompt.sh": COPROMPT_TRAIN_SH,
        "scripts/base2new_test_coprompt.sh": COPROMPT_TEST_SH,
        "configs/trainers/coprompt.yaml": COPROMPT_CONFIG,
    }
    extra = ["TRAINER.CoPrompt.PREC", "fp32", "TRAINER.CoPrompt.PROMPT_DEPTH", "2"]
    repo, env = neighbour_repo(tmp_path, tiny_clip, files, dtd_root, *extra)
    descriptions = {c: [f"a photo of {c}.", f"{c}, a texture."] for c in DTD_CLASSES}
    (repo / "gpt_file").mkdir()
    (repo / "gpt_file" / "dtd_prompt.json").write_text(json.dumps(descriptions))
    run_script(repo, env, "scripts/base2new_train_coprompt.sh", "dtd", "1", "base2new")
    run_script(repo, env, "scripts/base2new_test_coprompt.sh", "dtd", "1", "base2new", "8")
    common = "dtd/shots_16/CoPrompt/coprompt/seed1"
    train, test = (
        repo / "output/base2new/train_base" / common,
        repo / "output/base2new/test_new" / common,
    )
    log = (train / "log.txt").read_text()
    head = log[: log.index("** Arguments **")]
    assert "Config translated for --trainer CoPrompt: TRAINER.CoPrompt.N_CTX 2" in head
    assert "TRAINER.DISTILL cosine (config file configs/trainers/coprompt.yaml)" in head
    assert "CoPrompt's train.py values for DescribableTextures" in head
    assert f"description files: CoPrompt's {repo / 'gpt_file'}" in head
    config = (train / "config.yaml").read_text()
    assert "    W: 8.0\n" in config and "    PROMPT_DEPTH: 2\n" in config  # the option wins
    assert parse_test_res(str(train), "Finished training") is not None
    assert parse_test_res(str(test), "=> result") is not None
