"""The CoOp family's files run here: KgCoOp's configs and scripts, the neighbours' result
parsers, PromptSRC's cross-dataset scripts, IVLP/PromptSRC/MaPLe whole-model checkpoints, Dassl's
re-runs into an output folder (issue 21).

The neighbours' files are reproduced below as they are published (htyao89/KgCoOp,
muzairkhattak/PromptSRC), only their ``DATA=`` line edited; they run in a temporary folder laid
out like their repositories, where ``train.py`` is this project's and ``python`` is a shim that
appends the toy setting's options (the tiny CLIP, 32-pixel images, no loader workers) to every
call. Their result parsers are reimplemented from their matching rule (a whole line equal to the
end-of-training signal, then the last ``* accuracy: X%`` after it).
"""

from __future__ import annotations

import os
import os.path as osp
import re
import shlex
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, make_cfg
from helpers import DEPTH

from datasets.synthetic import DTD_CLASSES
from engine import build_trainer
from engine.cli import build_parser, setup_cfg
from engine.errors import CheckpointError, ConfigError, OutputError

CLASSES = DTD_CLASSES[:3]

# -- KgCoOp's files (htyao89/KgCoOp, KgCoOp/configs/trainers/... and KgCoOp/scripts/) ----------
KGCOOP_COMMON = """DATALOADER:
  TRAIN_X:
    BATCH_SIZE: {batch}
  TEST:
    BATCH_SIZE: 100
  NUM_WORKERS: 8

INPUT:
  SIZE: (224, 224)
  INTERPOLATION: "bicubic"
  PIXEL_MEAN: [0.48145466, 0.4578275, 0.40821073]
  PIXEL_STD: [0.26862954, 0.26130258, 0.27577711]
  TRANSFORMS: ["random_resized_crop", "random_flip", "normalize"]

OPTIM:
  NAME: "sgd"
  LR: 0.002
  MAX_EPOCH: {epochs}
  LR_SCHEDULER: "cosine"
  WARMUP_EPOCH: 1
  WARMUP_TYPE: "constant"
  WARMUP_CONS_LR: 1e-5
{loss}
TRAIN:
  PRINT_FREQ: {print_freq}

MODEL:
  BACKBONE:
    NAME: "{backbone}"

TRAINER:
{trainer}"""
KGCOOP_CONFIG = KGCOOP_COMMON.format(
    batch=128,
    epochs=100,
    loss="",
    print_freq=5,
    backbone="ViT-B/16",
    trainer="  COOP:\n    CTX_INIT: True\n",
)  # KgCoOp/vit_b16_ep100_ctxv1.yaml
PROGRAD_CONFIG = KGCOOP_COMMON.format(
    batch=32,
    epochs=200,
    loss='\nLOSS:\n  NAME: "prograd"\n  T: 1.0\n',
    print_freq=5,
    backbone="RN50",
    trainer="  COOP:\n    CTX_INIT: True",
)  # ProGrad/rn50.yaml
COCOOP_CONFIG = KGCOOP_COMMON.format(
    batch=1,
    epochs=10,
    loss="",
    print_freq=20,
    backbone="RN50",
    trainer='  COCOOP:\n    N_CTX: 4\n    CTX_INIT: True\n    PREC: "fp16"',
)  # CoCoOp/rn50_c4_ep10_batch1_ctxv1.yaml

KGCOOP_TRAIN_SH = """#!/bin/bash

cd ..

# custom config
DATA={data}
TRAINER=KgCoOp
WEIGHT=$2
DATASET=$1
#CFG=rn50_ep100  # config file\\
CFG=vit_b16_ep100_ctxv1
CTP=end  # class token position (end or middle)
NCTX=4  # number of context tokens
SHOTS=16  # number of shots (1, 2, 4, 8, 16)
CSC=False  # class-specific context (False or True)

for SEED in 1 2 3
do
    DIR=output/base2new/train_base/${{DATASET}}/shots_${{SHOTS}}_${{WEIGHT}}/${{TRAINER}}/${{CFG}}/seed${{SEED}}
    if [ -d "$DIR" ]; then
        echo "Results are available in ${{DIR}}. Skip this job"
    else
        echo "Run this job and save the output to ${{DIR}}"
        python train.py \\
        --root ${{DATA}} \\
        --seed ${{SEED}} \\
        --trainer ${{TRAINER}} \\
        --dataset-config-file configs/datasets/${{DATASET}}.yaml \\
        --config-file configs/trainers/${{TRAINER}}/${{CFG}}.yaml \\
        --output-dir ${{DIR}} \\
        TRAINER.COOP.N_CTX ${{NCTX}} \\
        TRAINER.COOP.CSC ${{CSC}} \\
        TRAINER.COOP.W ${{WEIGHT}} \\
        TRAINER.COOP.CLASS_TOKEN_POSITION ${{CTP}} \\
        DATASET.NUM_SHOTS ${{SHOTS}} \\
        DATASET.SUBSAMPLE_CLASSES base
    fi
done
"""
KGCOOP_TEST_SH = """#!/bin/bash

cd ..

# custom config
DATA={data}
TRAINER=KgCoOp
DATASET=$1
#CFG=rn50_ep100  # config file
CFG=vit_b16_ep100_ctxv1
CTP=end  # class token position (end or middle)
NCTX=4  # number of context tokens
SHOTS=16  # number of shots (1, 2, 4, 8, 16)
CSC=False  # class-specific context (False or True)
WEIGHT=$2

LOADEP=100
SUB=new

for SEED in 1 2 3
do
    COMMON_DIR=${{DATASET}}/shots_${{SHOTS}}_${{WEIGHT}}/${{TRAINER}}/${{CFG}}/seed${{SEED}}
    MODEL_DIR=output/base2new/train_base/${{COMMON_DIR}}
    DIR=output/base2new/test_${{SUB}}/${{COMMON_DIR}}


    if [ -d "$DIR" ]; then
        echo "Results are available in ${{DIR}}. Skip this job"
    else
        echo "Run this job and save the output to ${{DIR}}"
        python train.py \\
        --root ${{DATA}} \\
        --seed ${{SEED}} \\
        --trainer ${{TRAINER}} \\
        --dataset-config-file configs/datasets/${{DATASET}}.yaml \\
        --config-file configs/trainers/${{TRAINER}}/${{CFG}}.yaml \\
        --output-dir ${{DIR}} \\
        --model-dir ${{MODEL_DIR}} \\
        --load-epoch ${{LOADEP}} \\
        --eval-only \\
        TRAINER.COOP.N_CTX ${{NCTX}} \\
        TRAINER.COOP.CSC ${{CSC}} \\
        TRAINER.COOP.CLASS_TOKEN_POSITION ${{CTP}} \\
        DATASET.NUM_SHOTS ${{SHOTS}} \\
        DATASET.SUBSAMPLE_CLASSES ${{SUB}}
    fi
done
"""

# -- PromptSRC's scripts (muzairkhattak/PromptSRC, scripts/promptsrc/) --------------------------
PROMPTSRC_XD = """#!/bin/bash


# custom config
DATA={data}
TRAINER=PromptSRC

DATASET=$1
SEED=$2

CFG=vit_b16_c2_ep5_batch4_4+4ctx_cross_datasets
SHOTS=16

{body}"""
PROMPTSRC_XD_TRAIN = PROMPTSRC_XD.replace(
    "{body}",
    """
DIR=output/${{DATASET}}/${{TRAINER}}/${{CFG}}_${{SHOTS}}shots/seed${{SEED}}
if [ -d "$DIR" ]; then
    echo "Results are available in ${{DIR}}."
else
    echo "Run this job and save the output to ${{DIR}}"

    python train.py \\
    --root ${{DATA}} \\
    --seed ${{SEED}} \\
    --trainer ${{TRAINER}} \\
    --dataset-config-file configs/datasets/${{DATASET}}.yaml \\
    --config-file configs/trainers/${{TRAINER}}/${{CFG}}.yaml \\
    --output-dir ${{DIR}} \\
    DATASET.NUM_SHOTS ${{SHOTS}}
fi""",
)
PROMPTSRC_XD_TEST = PROMPTSRC_XD.replace(
    "{body}",
    """
DIR=output/evaluation/${{TRAINER}}/${{CFG}}_${{SHOTS}}shots/${{DATASET}}/seed${{SEED}}
if [ -d "$DIR" ]; then
    echo "Results are available in ${{DIR}}. Skip this job"
else
    echo "Run this job and save the output to ${{DIR}}"

    python train.py \\
    --root ${{DATA}} \\
    --seed ${{SEED}} \\
    --trainer ${{TRAINER}} \\
    --dataset-config-file configs/datasets/${{DATASET}}.yaml \\
    --config-file configs/trainers/${{TRAINER}}/${{CFG}}.yaml \\
    --output-dir ${{DIR}} \\
    --model-dir output/imagenet/${{TRAINER}}/${{CFG}}_${{SHOTS}}shots/seed${{SEED}} \\
    --load-epoch 20 \\
    --eval-only
fi""",
)

ACCURACY = re.compile(r"\* accuracy: ([\.\deE+-]+)%")


def parse_test_res(run_dir: str, end_signal: str) -> float | None:
    """The CoOp family's parse_test_res.py on one seed folder: results count from the line
    equal (stripped) to ``end_signal`` on; the last ``* accuracy`` wins. CoOp's parser waits for
    "Finish training"; MaPLe's, PromptSRC's and KgCoOp's for "Finished training"; with
    ``--test-log`` all of them for "=> result"."""
    found, good_to_go = None, False
    with open(osp.join(run_dir, "log.txt")) as f:
        for line in f:
            line = line.strip()
            if line == end_signal:
                good_to_go = True
            match = ACCURACY.search(line)
            if match and good_to_go:
                found = float(match.group(1))
    return found


def neighbour_repo(tmp_path, tiny_clip, files: dict[str, str], data: str, *extra: str):
    """A folder laid out like a neighbour's repository around this project's train.py, and
    the environment whose ``python`` appends the toy options (see the module docstring): the
    tiny CLIP ``(config, checkpoint)``, 32-pixel images, 1 shot, fp32, no loader workers, and
    ``extra``."""
    repo = tmp_path / "repo"
    (repo / "configs").mkdir(parents=True)
    os.symlink(osp.join(ROOT, "configs", "datasets"), repo / "configs" / "datasets")
    os.symlink(osp.join(ROOT, "train.py"), repo / "train.py")
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text.format(data=data))
    cfg_path, ckpt = tiny_clip
    toy = ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", cfg_path]
    toy += ["MODEL.BACKBONE.PATH", ckpt, "INPUT.SIZE", "(32, 32)", "DATALOADER.NUM_WORKERS", "0"]
    toy += ["DATALOADER.TEST.BATCH_SIZE", "8", "DATASET.NUM_SHOTS", "1", *extra]
    shim = tmp_path / "bin" / "python"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/bash\nexec {shlex.quote(sys.executable)} "$@" {shlex.join(toy)}\n')
    shim.chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{shim.parent}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=ROOT,
        OMP_NUM_THREADS="1",  # a tiny model: more threads only wait for each other
    )
    return repo, env


def run_script(repo, env, script: str, *args: str, cwd=None) -> str:
    proc = subprocess.run(
        ["bash", script, *args],
        cwd=cwd or repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{script}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "Error" not in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


# ----------------------------------------------------------------------------------------------
# KgCoOp's configs, keys and scripts
# ----------------------------------------------------------------------------------------------
KEYS_SAMPLE = ["TRAINER.SAMPLe.ENBLR", "SAMPLe"]
KGCOOP_TRAIN_OPTS = ["TRAINER.COOP.N_CTX", "4", "TRAINER.COOP.CSC", "False"]
KGCOOP_TRAIN_OPTS += ["TRAINER.COOP.W", "2.0", "TRAINER.COOP.CLASS_TOKEN_POSITION", "front"]


def test_kgcoop_files_are_read_as_kgcoop_keys(tmp_path, tiny_clip_opts):
    config = tmp_path / "vit_b16_ep100_ctxv1.yaml"
    config.write_text(KGCOOP_CONFIG)
    dtd = osp.join(ROOT, "configs/datasets/dtd.yaml")
    args = ["--trainer", "KgCoOp", "--dataset-config-file", dtd, "--config-file", str(config)]
    notes = []
    cfg = setup_cfg(build_parser().parse_args(args + KGCOOP_TRAIN_OPTS), notes)
    node = cfg.TRAINER.KGCOOP
    assert node.CTX_INIT == "a photo of a"  # KgCoOp's CTX_INIT True
    assert (node.N_CTX, node.CSC, node.W, node.CLASS_TOKEN_POSITION) == (4, False, 2.0, "front")
    assert cfg.TRAINER.COOP.CTX_INIT == "" and cfg.TRAINER.COOP.N_CTX == 16  # CoOp's untouched
    assert f"TRAINER.COOP.CTX_INIT True (config file {config}) -> TRAINER.KGCOOP.CTX_INIT " in (
        "\n".join(notes)
    )
    assert "TRAINER.COOP.W 2.0 (the command line) -> TRAINER.KGCOOP.W 2.0" in notes
    assert len(notes) == 5
    # KgCoOp's defaults: CTX_INIT False is a random context; ALPHA (read by none of its
    # trainers) is dropped, and said so
    cfg = setup_cfg(
        build_parser().parse_args(
            ["--trainer", "KgCoOp", "TRAINER.COOP.CTX_INIT", "False", "TRAINER.COOP.ALPHA", "1.0"]
        ),
        notes := [],
    )
    assert cfg.TRAINER.KGCOOP.CTX_INIT == "" and "dropped (unused)" in notes[-1]
    # the SAMPLe authors' aliases report their mapping through the same seam
    setup_cfg(build_parser().parse_args(["--trainer", "SAMPLe"] + KEYS_SAMPLE), notes := [])
    assert "TRAINER.SAMPLe (ENBLR SAMPLe) -> OPTIM.SAM.NAME sample" in notes
    # the test script's keys take effect (they changed nothing before)
    opts = ["TRAINER.COOP.N_CTX", "8", "TRAINER.COOP.CTX_INIT", "", "TRAINER.COOP.CSC", "True"]
    tr = build_trainer(make_cfg([*tiny_clip_opts, *opts], trainer="KgCoOp"), classnames=CLASSES)
    assert tuple(tr.model.prompt_learner.ctx.shape[:2]) == (3, 8)  # class-specific, 8 tokens


def test_keys_of_trainers_not_here_name_their_trainer(tmp_path):
    for name, text in (("prograd.yaml", PROGRAD_CONFIG), ("cocoop.yaml", COCOOP_CONFIG)):
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as info:  # KgCoOp's ProGrad configs
        make_cfg([], trainer="KgCoOp", config_file=str(tmp_path / "prograd.yaml"))
    msg = str(info.value)
    assert "'LOSS.NAME'" in msg and "ProGrad's layout" in msg and "BeierZhu/Prompt-align" in msg
    assert "--trainer ProGrad" in msg
    cfg = make_cfg([], trainer="ProGrad", config_file=str(tmp_path / "prograd.yaml"))  # its own
    node = cfg.TRAINER.PROGRAD
    assert (node.CTX_INIT, node.LOSS, node.T, cfg.OPTIM.MAX_EPOCH) == (
        "template",
        "prograd",
        1.0,
        200,
    )
    with pytest.raises(ConfigError, match=r"TRAINER.VPT.N_CTX_VISION.*belongs to VPT"):
        make_cfg(["TRAINER.VPT.N_CTX_VISION", "8"], trainer="IVLP")
    with pytest.raises(ConfigError) as info:  # KgCoOp's CoCoOp configs: CTX_INIT True
        make_cfg([], trainer="CoCoOp", config_file=str(tmp_path / "cocoop.yaml"))
    msg = str(info.value)
    assert "TRAINER.COCOOP.CTX_INIT True" in msg and "KgCoOp's code base" in msg
    assert 'set TRAINER.COCOOP.CTX_INIT "a photo of a"' in msg
    cfg = make_cfg(["TRAINER.COCOOP.CTX_INIT", "False"], trainer="CoCoOp")
    assert cfg.TRAINER.COCOOP.CTX_INIT == ""


@pytest.mark.slow
def test_kgcoop_scripts_train_and_test_and_every_parser_finds_the_results(
    tmp_path, tiny_clip, dtd_root
):
    files = {
        "scripts/base2new_train.sh": KGCOOP_TRAIN_SH,
        "scripts/base2new_test.sh": KGCOOP_TEST_SH,
        "configs/trainers/KgCoOp/vit_b16_ep100_ctxv1.yaml": KGCOOP_CONFIG,
    }
    repo, env = neighbour_repo(tmp_path, tiny_clip, files, dtd_root, "TRAINER.COOP.PREC", "fp32")
    tail = "dtd/shots_16_8.0/KgCoOp/vit_b16_ep100_ctxv1"
    for split in ("train_base", "test_new"):  # seeds 2 and 3: "Results are available ... Skip"
        for seed in (2, 3):
            (repo / f"output/base2new/{split}/{tail}/seed{seed}").mkdir(parents=True)
    scripts = repo / "scripts"
    run_script(repo, env, "base2new_train.sh", "dtd", "8.0", cwd=scripts)
    run_script(repo, env, "base2new_test.sh", "dtd", "8.0", cwd=scripts)
    train = repo / f"output/base2new/train_base/{tail}/seed1"
    test = repo / f"output/base2new/test_new/{tail}/seed1"
    log = (train / "log.txt").read_text()
    assert "TRAINER.COOP.W 8.0 (the command line) -> TRAINER.KGCOOP.W 8.0" in log
    assert "TRAINER.COOP.CTX_INIT True" in log and "model.pth.tar-100" in log
    config = (train / "config.yaml").read_text()
    assert re.search(r"KGCOOP:\n(  .*\n)*?    CTX_INIT: a photo of a\n", config)
    # CoOp's parser ("Finish training") and MaPLe's/PromptSRC's/KgCoOp's ("Finished training")
    # both read the training run's test result; --test-log reads the evaluation's
    base = parse_test_res(str(train), "Finish training")
    assert base is not None and base == parse_test_res(str(train), "Finished training")
    assert parse_test_res(str(test), "=> result") is not None
    assert re.search(r"# classes\s+3\n", (test / "log.txt").read_text())  # the new classes


# ----------------------------------------------------------------------------------------------
# Re-runs into a folder without a trained model (Dassl's behaviour)
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def train_py(capsys):
    """train.py in this process (engine.runner): ``args -> (exit code, stderr)``."""
    from engine.runner import run_in_process

    def call(args):
        code = run_in_process(args)
        return code, capsys.readouterr().err

    return call


def test_eval_rerun_takes_over_a_folder_without_checkpoints(
    tmp_path, dtd_root, tiny_clip_opts, train_py
):
    from helpers import coop_args

    model = str(tmp_path / "model")
    assert train_py(coop_args(dtd_root, model, tiny_clip_opts, "OPTIM.MAX_EPOCH", "1"))[0] == 0
    # CoOp's parser and MaPLe's/PromptSRC's/KgCoOp's find the training run's result
    base = parse_test_res(model, "Finish training")
    assert base is not None and base == parse_test_res(model, "Finished training")
    out = str(tmp_path / "test_new")
    flags = ["--eval-only", "--load-epoch", "1", "--model-dir"]
    # the folder was mistyped: the evaluation fails before it evaluates anything
    code, err = train_py(coop_args(dtd_root, out, tiny_clip_opts, flags=[*flags, model + "x"]))
    assert code == 2 and "Model not found" in err
    failed_log = open(osp.join(out, "log.txt")).read()
    # the corrected command runs into the same folder (no --overwrite); the old log is kept
    assert train_py(coop_args(dtd_root, out, tiny_clip_opts, flags=[*flags, model]))[0] == 0
    log = open(osp.join(out, "log.txt")).read()
    assert "holds no checkpoint" in log and "RUN.MODEL_DIR" in log and "* accuracy:" in log
    kept = [n for n in os.listdir(out) if n.startswith("log.txt-")]
    assert len(kept) == 1 and open(osp.join(out, kept[0])).read() == failed_log
    # a folder with a trained model is still one experiment's
    code, err = train_py(coop_args(dtd_root, model, tiny_clip_opts, "OPTIM.MAX_EPOCH", "2"))
    assert code == 2 and "holds a run of another experiment" in err


# ----------------------------------------------------------------------------------------------
# PromptSRC's cross-dataset scripts
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_promptsrc_cross_dataset_scripts_run_end_to_end(tmp_path, dtd_root, deep_opts):
    files = {"scripts/promptsrc/xd_train.sh": PROMPTSRC_XD_TRAIN}
    files["scripts/promptsrc/xd_test.sh"] = PROMPTSRC_XD_TEST
    cfg = "vit_b16_c2_ep5_batch4_4+4ctx_cross_datasets"
    files[f"configs/trainers/PromptSRC/{cfg}.yaml"] = (
        open(osp.join(ROOT, "configs/trainers/PromptSRC", cfg + ".yaml"))
        .read()
        .replace("{", "{{")
        .replace("}", "}}")
    )
    i = deep_opts.index("MODEL.BACKBONE.CONFIG")
    clip = deep_opts[i + 1 : i + 4 : 2]
    repo, env = neighbour_repo(tmp_path, clip, files, dtd_root, "TRAINER.PROMPTSRC.PREC", "fp32")
    # xd_train.sh trains on imagenet; the toy dtd stands in for it (the dataset argument)
    run_script(repo, env, "scripts/promptsrc/xd_train.sh", "dtd", "1")
    trained = repo / f"output/dtd/PromptSRC/{cfg}_16shots/seed1"
    assert (trained / "VLPromptLearner" / "model.pth.tar-20").is_file()
    os.symlink(repo / "output/dtd", repo / "output/imagenet")
    run_script(repo, env, "scripts/promptsrc/xd_test.sh", "dtd", "1")
    evaluation = repo / f"output/evaluation/PromptSRC/{cfg}_16shots/dtd/seed1"
    assert parse_test_res(str(evaluation), "=> result") is not None


# ----------------------------------------------------------------------------------------------
# Whole-model checkpoints of PromptSRC's code base (IVLP, PromptSRC, SAMPLeSRC) and MaPLe's
# ----------------------------------------------------------------------------------------------
def _dassl_file(state_dict: dict, path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": state_dict, "epoch": 2, "optimizer": None, "scheduler": None}, path)


def _promptsrc_whole_model(own: dict, depth: int, teacher: bool) -> dict:
    """The state dict that PromptSRC's code base saves for this project's prompts ``own``:
    its whole CustomCLIP, deep prompts on the blocks, frozen weights and token buffers."""
    whole = {
        "prompt_learner.ctx": own["ctx"].half(),  # PromptSRC's ctx is fp16
        "image_encoder.VPT": own["vpt"],
        "prompt_learner.token_prefix": torch.randn(3, 1, 32),
        "prompt_learner.token_suffix": torch.randn(3, 72, 32),
        "image_encoder.conv1.weight": torch.randn(64, 3, 8, 8),
        "image_encoder.transformer.resblocks.0.attn.in_proj_weight": torch.randn(192, 64),
        "text_encoder.transformer.resblocks.0.ln_1.weight": torch.randn(32),
        "logit_scale": torch.tensor(4.6),
    }
    for i in range(1, depth):
        whole[f"image_encoder.transformer.resblocks.{i}.VPT_shallow"] = own[f"deep_vision.{i - 1}"]
        whole[f"text_encoder.transformer.resblocks.{i}.VPT_shallow"] = own[f"deep_text.{i - 1}"]
    if teacher:  # PromptSRC's frozen teacher inside its prompt learner
        whole["prompt_learner.ZS_image_encoder.conv1.weight"] = torch.randn(64, 3, 8, 8)
    return whole


def _deep(trainer: str, deep_opts, depth=DEPTH) -> list[str]:
    node = f"TRAINER.{trainer.upper()}"
    opts = [*deep_opts, f"{node}.PROMPT_DEPTH_TEXT", str(depth)]
    return opts + [f"{node}.PROMPT_DEPTH_VISION", str(depth), f"{node}.PREC", "fp32"]


@pytest.mark.parametrize("trainer", ["IVLP", "PromptSRC", "SAMPLeSRC"])
def test_promptsrc_code_base_checkpoints_load_by_block(trainer, tmp_path, deep_opts):
    cfg_trainer = "PromptSRC" if trainer == "SAMPLeSRC" else trainer
    opts = _deep(cfg_trainer, deep_opts)
    model = build_trainer(make_cfg(opts, trainer=trainer), classnames=CLASSES)
    name = "VLPromptLearner"
    own = {k: torch.randn_like(v) for k, v in model.get_model(name).state_dict().items()}
    assert set(own) == {"ctx", "vpt"} | {
        f"deep_{t}.{i}" for t in ("text", "vision") for i in range(DEPTH - 1)
    }
    whole = _promptsrc_whole_model(own, DEPTH, teacher=cfg_trainer == "PromptSRC")
    _dassl_file(whole, tmp_path / "released" / "seed1" / name / "model.pth.tar-2")
    model.load_model(str(tmp_path / "released" / "seed1"), epoch=2)  # evaluation
    got = model.get_model(name).state_dict()
    for k in own:
        assert torch.equal(got[k], own[k].half().float() if k == "ctx" else own[k]), k
    # weight-resume: a run folder of the original code base
    resume = build_trainer(make_cfg(opts, trainer=trainer), classnames=CLASSES)
    (tmp_path / "released" / "seed1" / name / "checkpoint").write_text("model.pth.tar-2\n")
    assert resume.resume_model_if_exist(str(tmp_path / "released" / "seed1")) == 2
    assert torch.equal(resume.get_model(name).state_dict()["deep_text.1"], own["deep_text.1"])
    # another depth: the message names the trainer that made the file and the saved names
    cfg = make_cfg(_deep(cfg_trainer, deep_opts, 2), trainer=trainer)
    shallow = build_trainer(cfg, classnames=CLASSES)
    with pytest.raises(CheckpointError) as info:
        shallow.load_model(str(tmp_path / "released" / "seed1"), epoch=2)
    msg = str(info.value)
    assert f"made by {cfg_trainer} (inferred from its folder and tensor names" in msg
    assert "deep_text.1 (saved as text_encoder.transformer.resblocks.2.VPT_shallow)" in msg
    assert f"--trainer {cfg_trainer} and its config files" in msg


def test_maple_whole_model_checkpoint_and_unknown_trainer_message(tmp_path, deep_opts):
    opts = [*deep_opts, "TRAINER.MAPLE.PROMPT_DEPTH", str(DEPTH), "TRAINER.MAPLE.PREC", "fp32"]
    maple = build_trainer(make_cfg(opts, trainer="SAMPLeMAP"), classnames=CLASSES)
    name = "MultiModalPromptLearner"
    own = maple.get_model(name).state_dict()
    assert {f"compound_prompts_text.{i}" for i in range(DEPTH - 1)} <= set(own)
    whole = {f"prompt_learner.{k}": torch.randn_like(v) for k, v in own.items()}
    whole["image_encoder.conv1.weight"] = torch.randn(64, 3, 8, 8)
    _dassl_file(whole, tmp_path / "maple" / name / "model.pth.tar-2")
    maple.load_model(str(tmp_path / "maple"), epoch=2)
    got = maple.get_model(name).state_dict()
    assert all(torch.equal(got[k], whole[f"prompt_learner.{k}"]) for k in own)
    # a file of no known trainer: no made-up --trainer in the message
    ivlp = build_trainer(make_cfg(_deep("IVLP", deep_opts), trainer="IVLP"), classnames=CLASSES)
    _dassl_file({"mystery": torch.zeros(2)}, tmp_path / "odd/VLPromptLearner/model.pth.tar-1")
    with pytest.raises(CheckpointError) as info:
        ivlp.load_model(str(tmp_path / "odd"), epoch=1)
    msg = str(info.value)
    assert "made by an unknown trainer" in msg and "--trainer" not in msg
    assert "(its config.yaml)" in msg


# ----------------------------------------------------------------------------------------------
# The scalar writers on a full disk; PromptSRC's aggregate loaded weights-only
# ----------------------------------------------------------------------------------------------
def test_scalar_and_tensorboard_writes_on_a_full_disk(tmp_path, monkeypatch, capfd):
    import errno

    from tensorboard.compat.tensorflow_stub.io.gfile import LocalFileSystem

    from engine.writers import ScalarWriter

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    writer = ScalarWriter()
    writer.open(str(tmp_path), str(tmp_path / "tensorboard"))
    writer.add({"train/loss": 1.0}, 0)
    writer.flush()  # tensorboard's writer is started
    # the disk fills up now: tensorboard's writer thread fails on its next event file write,
    # which tensorboard raises again at its next write or at close
    monkeypatch.setattr(LocalFileSystem, "append", full)
    for step in range(1, 50):
        writer.add({"train/loss": 0.5}, step)
    with pytest.raises(OutputError) as info:
        writer.flush()
        writer.close()
    msg = str(info.value)
    assert f"no space left on the device of {tmp_path / 'tensorboard'}" in msg
    assert "events.out.tfevents" in msg
    assert "Traceback" not in capfd.readouterr().err  # the writer thread printed nothing
    monkeypatch.undo()

    class FullAtClose:  # scalars.jsonl's buffered rows meet the full disk when it is closed
        def __init__(self, file):
            self.file = file

        def write(self, text):
            return self.file.write(text)

        def flush(self):
            return None  # rows stay buffered

        def close(self):
            self.file.close()
            full()

    writer = ScalarWriter()
    writer.open(str(tmp_path / "b"), str(tmp_path / "b" / "tensorboard"))
    writer._file = FullAtClose(writer._file)
    writer.add({"train/loss": 1.0}, 0)
    with pytest.raises(OutputError) as info:
        writer.close()
    assert f"no space left on the device of {tmp_path / 'b'}" in str(info.value)
    assert "scalars.jsonl" in str(info.value)
    assert writer._file is None and writer._tb is None  # both closed


def test_promptsrc_aggregate_is_loaded_weights_only(tmp_path, dtd_root, deep_opts):
    opts = ["--root", dtd_root, "--seed", "1", "--output-dir", str(tmp_path / "run")]
    opts += [*_deep("PromptSRC", deep_opts), "OPTIM.MAX_EPOCH", "2", "DATASET.NUM_SHOTS", "1"]
    tr = build_trainer(make_cfg(opts, trainer="PromptSRC"))
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tr._gpa_path()
    os.makedirs(osp.dirname(path))
    torch.save({"epoch": 1, "state": {}, "x": Evil()}, path)
    tr.max_epoch = 2
    tr.resume_model_if_exist = lambda directory: 1  # the run resumes at epoch 1
    with pytest.raises(CheckpointError, match="Refused to load checkpoint"):
        tr.before_train()
    assert not marker.exists()
