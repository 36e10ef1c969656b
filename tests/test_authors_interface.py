"""The SAMPLe authors' interface: trainer aliases, TRAINER.SAMPLe keys, config files, scripts;
CoOp's remaining config files; ResNet backbones.

The script tests run each family of scripts/SAMPLe*/ unchanged (bash, in a temporary folder that
receives output/) on a generated DTD with a tiny CLIP passed through ``EXTRA_OPTS`` (1 epoch, 2
shots, so ``LOADEP=1``), and check the output folders the scripts' users expect and the
``* accuracy:`` line.
"""

from __future__ import annotations

import glob
import json
import os
import os.path as osp
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, make_cfg
from helpers import DEPTH, assert_one_step_updates, write_descriptions

from datasets.synthetic import DTD_CLASSES
from engine import build_trainer
from engine.clip.model import BackboneError, build_clip, save_clip_checkpoint
from engine.clip.toy import TINY_OPTS
from engine.errors import ConfigError

ALIASES = ("SAMPLe", "SAMPLeCoCoOp", "SAMPLeMAP", "SAMPLeSRC")
COOP_FILES = ("rn101", "rn101_ep50", "rn50_ep100", "rn50_ep50_ctxv1", "rn50_val")
COOP_FILES += ("vit_b16_ep100_ctxv1", "vit_b32_ep50")
# a tiny OpenAI-style ResNet CLIP: 4 stages of 1 bottleneck, attention pool over 2x2 cells
TINY_RN = {
    "embed_dim": 32,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 64, "layers": [1, 1, 1, 1], "width": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 1, "layers": 1},
}


def _without_name(opts: list[str]) -> list[str]:
    """``opts`` minus ``MODEL.BACKBONE.NAME ""``: MODEL.BACKBONE.CONFIG wins over the config
    files' names, and EXTRA_OPTS (split into words) cannot hold an empty value."""
    i = opts.index("MODEL.BACKBONE.NAME")
    return opts[:i] + opts[i + 2 :]


@pytest.fixture(scope="module")
def rn_clip(tmp_path_factory):
    """(config JSON, state-dict checkpoint) of the tiny ResNet CLIP, OpenAI key names."""
    folder = tmp_path_factory.mktemp("rn_clip")
    torch.manual_seed(0)
    ckpt = str(folder / "rn.pt")
    save_clip_checkpoint(build_clip(TINY_RN), ckpt)
    cfg_path = str(folder / "rn.json")
    with open(cfg_path, "w") as f:
        json.dump(TINY_RN, f)
    return cfg_path, ckpt


def rn_opts(rn_clip) -> list[str]:
    cfg_path, ckpt = rn_clip
    sizes = ["INPUT.SIZE", "(64,64)"]
    return ["MODEL.BACKBONE.CONFIG", cfg_path, "MODEL.BACKBONE.PATH", ckpt, *TINY_OPTS, *sizes]


# ----------------------------------------------------------------------------------------------
# The alias keys
# ----------------------------------------------------------------------------------------------
def sam(cfg) -> tuple:
    s = cfg.OPTIM.SAM
    return s.NAME, s.VARIANT, s.RHO, s.ALPHA, s.LAMBDA


KEYS = ["TRAINER.SAMPLe.RHO", "0.3", "TRAINER.SAMPLe.ALPHA", "0.02", "TRAINER.SAMPLe.EMA_LAMBDA"]
KEYS += ["0.4"]


@pytest.mark.parametrize(
    "trainer,enblr,mode,expected",
    [
        ("SAMPLe", "SAMPLe", "released", ("sample", "reference", 0.3, 0.02, 0.4)),
        ("SAMPLe", "SAMPLe", "paper", ("sample", "paper", 0.3, 0.02, 0.4)),
        ("SAMPLe", "SAM", "released", ("sam", "reference", 0.3, 0.02, 0.4)),
        ("SAMPLeMAP", "SAMPLe", "released", ("sample", "reference", 0.3, 0.02, 0.4)),
        # the released CoCoOp copy: no moving average, e = rho g/|g| - alpha g, mean update
        ("SAMPLeCoCoOp", "SAMPLe", "released", ("sagm", "reference", 0.3, 0.02, 0.4)),
        ("SAMPLeCoCoOp", "SAMPLe", "paper", ("sample", "paper", 0.3, 0.02, 0.4)),
        # the released PromptSRC copy of SAM averages g and g_p: SAGM without the alpha step
        ("SAMPLeSRC", "SAM", "released", ("sagm", "reference", 0.3, 0.0, 0.4)),
        ("SAMPLeSRC", "SAM", "paper", ("sam", "paper", 0.3, 0.02, 0.4)),
        ("SAMPLeSRC", "SAMPLe", "released", ("sample", "reference", 0.3, 0.02, 0.4)),
    ],
)
def test_enblr_maps_onto_optim_sam(trainer, enblr, mode, expected):
    opts = ["TRAINER.SAMPLe.ENBLR", enblr, "TRAINER.SAMPLe.REPRODUCTION", mode, *KEYS]
    cfg = make_cfg(opts, trainer=trainer)
    assert sam(cfg) == expected
    assert cfg.REPRODUCTION == mode
    assert cfg.OPTIM.LR_STEP_PER_BATCH == (mode == "released")  # the mode's overlay applied


def test_enblr_none_trains_the_base_optimizer():
    cfg = make_cfg(["TRAINER.SAMPLe.ENBLR", "None", *KEYS], trainer="SAMPLe")
    assert cfg.OPTIM.SAM.NAME == "" and cfg.OPTIM.SAM.RHO == 0.05  # untouched defaults
    assert cfg.REPRODUCTION == "released"  # the aliases' default mode
    # ENBLR None leaves OPTIM.SAM to the project's own keys
    cfg = make_cfg(["OPTIM.SAM.NAME", "fsam"], trainer="SAMPLeMAP")
    assert cfg.OPTIM.SAM.NAME == "fsam"


def test_prompt_keys(tiny_clip_opts):
    opts = [*tiny_clip_opts, "TRAINER.SAMPLe.N_CTX", "8", "TRAINER.SAMPLe.CTX_INIT", ""]
    opts += ["TRAINER.SAMPLe.CSC", "True", "TRAINER.SAMPLe.PREC", "amp"]
    opts += ["TRAINER.SAMPLe.CLASS_TOKEN_POSITION", "front"]
    opts += ["TRAINER.COOP.N_CTX", "2"]  # the released SAMPLe trainer never reads TRAINER.COOP
    tr = build_trainer(make_cfg(opts, trainer="SAMPLe"), classnames=DTD_CLASSES[:3])
    learner = tr.model.prompt_learner
    assert tr.prec == "amp" and tuple(learner.ctx.shape[:2]) == (3, 8)  # CSC, N_CTX 8
    assert learner.class_token_position == "front" and learner.prompt_prefix == "X " * 7 + "X"
    # the other aliases read their parent's node and ignore TRAINER.SAMPLe's prompt keys
    cfg = make_cfg(opts, trainer="SAMPLeCoCoOp")
    assert cfg.TRAINER.COCOOP.N_CTX == 16 and cfg.TRAINER.COCOOP.PREC == "fp16"
    assert {n: make_cfg([], trainer=n).TRAINER.NAME for n in ALIASES} == {n: n for n in ALIASES}


def test_alias_refusals():
    def error(*opts, trainer="SAMPLe"):
        with pytest.raises(ConfigError) as info:
            build_trainer(make_cfg(list(opts), trainer=trainer), classnames=DTD_CLASSES[:2])
        return str(info.value)

    assert "(do you mean SAM?)" in error("TRAINER.SAMPLe.ENBLR", "sam")
    msg = error("TRAINER.SAMPLe.ENBLR", "SAMPLe", "TRAINER.SAMPLe.NORMALIZATION", "True")
    assert "NORMALIZATION" in msg and "set TRAINER.SAMPLe.NORMALIZATION False" in msg
    msg = error("TRAINER.SAMPLe.ENBLR", "SAMPLe", "TRAINER.SAMPLe.ADAPTIVE", "True")
    assert "ADAPTIVE False" in msg
    assert "disagree" in error("--repro", "paper")
    assert "REPRODUCTION" in error("TRAINER.SAMPLe.REPRODUCTION", "paperr")
    # what the released code ignores is ignored: NORMALIZATION without SAMPLe; ADAPTIVE -> ASAM
    opts = ["TRAINER.SAMPLe.ENBLR", "SAM", "TRAINER.SAMPLe.ADAPTIVE", "True"]
    cfg = make_cfg(opts + ["TRAINER.SAMPLe.NORMALIZATION", "True"], trainer="SAMPLe")
    assert cfg.OPTIM.SAM.NAME == "sam" and cfg.OPTIM.SAM.ADAPTIVE


@pytest.mark.parametrize("trainer", ALIASES)
def test_alias_trains_one_step(trainer, tmp_path, dtd_root, deep_opts):
    node = {"SAMPLeMAP": ["PROMPT_DEPTH"], "SAMPLeSRC": ["PROMPT_DEPTH_VISION"]}
    node["SAMPLeSRC"].append("PROMPT_DEPTH_TEXT")
    parent = {"SAMPLeMAP": "MAPLE", "SAMPLeSRC": "PROMPTSRC"}.get(trainer)
    opts = ["--root", dtd_root, "--seed", "1", "--output-dir", str(tmp_path), *deep_opts]
    for key in node.get(trainer, []):
        opts += [f"TRAINER.{parent}.{key}", str(DEPTH)]
    opts += ["TRAINER.SAMPLe.ENBLR", "SAMPLe", "OPTIM.MAX_EPOCH", "1", "DATASET.NUM_SHOTS", "2"]
    tr = build_trainer(make_cfg(opts, trainer=trainer))
    tr.set_model_mode("train")
    out = assert_one_step_updates(tr)
    assert "grad_norm" in out  # the two-pass step ran


# ----------------------------------------------------------------------------------------------
# Config files
# ----------------------------------------------------------------------------------------------
AUTHOR_FILES = sorted(
    osp.relpath(p, ROOT)
    for name in ALIASES
    for p in glob.glob(osp.join(ROOT, "configs", "trainers", name, "*.yaml"))
)


def test_config_files_merge():
    assert len(AUTHOR_FILES) == 25 + 4 + 4 + 29  # the released folders' files
    for path in AUTHOR_FILES:
        make_cfg([], trainer=path.split(os.sep)[-2], config_file=path)
    for name in COOP_FILES:
        make_cfg([], trainer="CoOp", config_file=f"configs/trainers/CoOp/{name}.yaml")
    cfg = make_cfg([], trainer="SAMPLe", config_file="configs/trainers/SAMPLe/rn50_ctxv1.yaml")
    assert (cfg.MODEL.BACKBONE.NAME, cfg.OPTIM.MAX_EPOCH, cfg.OPTIM.LR) == ("RN50", 200, 0.002)
    path = "configs/trainers/SAMPLeMAP/vit_b16_c2_ep5_batch4_2ctx_cross_datasets.yaml"
    cfg = make_cfg([], trainer="SAMPLeMAP", config_file=path)
    assert (cfg.TRAINER.MAPLE.PROMPT_DEPTH, cfg.OPTIM.LR, cfg.OPTIM.MAX_EPOCH) == (3, 0.0026, 2)
    path = "configs/trainers/SAMPLeSRC/vit_b16_c2_ep20_batch4_4+4ctx.yaml"
    src = make_cfg([], trainer="SAMPLeSRC", config_file=path).TRAINER.PROMPTSRC
    assert (src.N_CTX_TEXT, src.TEXT_LOSS_WEIGHT, src.GPA_MEAN) == (4, 25.0, 15.0)
    cfg = make_cfg([], trainer="CoOp", config_file="configs/trainers/CoOp/rn101_ep50.yaml")
    assert (cfg.MODEL.BACKBONE.NAME, cfg.OPTIM.MAX_EPOCH) == ("RN101", 50)


# ----------------------------------------------------------------------------------------------
# ResNet backbones
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("trainer", ["CoOp", "CoCoOp"])
@pytest.mark.parametrize("prec", ["fp32", "fp16"])
def test_resnet_trains(trainer, prec, rn_clip, tmp_path, dtd_root):
    # MODEL.BACKBONE.NAME "": the architecture is read from the OpenAI-style state dict
    opts = ["--root", dtd_root, "--seed", "1", "--output-dir", str(tmp_path), *rn_opts(rn_clip)]
    opts += ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", ""]
    opts += [f"TRAINER.{trainer.upper()}.PREC", prec, "OPTIM.NAME", "sgd", "OPTIM.MAX_EPOCH", "1"]
    tr = build_trainer(make_cfg(opts + ["DATASET.NUM_SHOTS", "2"], trainer=trainer))
    assert type(tr.model.image_encoder).__name__ == "ModifiedResNet"
    features = tr.model.encode_image(torch.zeros(2, 3, 64, 64))
    assert features.shape == (2, TINY_RN["embed_dim"])  # the attention pool's output dim
    assert features.dtype == (torch.float16 if prec == "fp16" else torch.float32)
    tr.set_model_mode("train")
    assert_one_step_updates(tr)


@pytest.mark.parametrize(
    "trainer", ["MaPLe", "IVLP", "PromptSRC", "CoPrompt", "SAMPLeMAP", "SAMPLeSRC"]
)
def test_vision_prompt_trainers_refuse_resnet(trainer, rn_clip, tmp_path):
    opts = rn_opts(rn_clip)
    if trainer == "CoPrompt":  # two views and class descriptions, or it stops earlier
        opts += ["DATALOADER.K_TRANSFORMS", "2", "INPUT.TRANSFORMS", "['randaugment']"]
        opts += ["TRAINER.COPROMPT.DESCRIPTIONS_DIR", write_descriptions(tmp_path)]
    cfg = make_cfg(opts, trainer=trainer)
    with pytest.raises(BackboneError, match="ViT image encoder") as info:
        build_trainer(cfg, classnames=DTD_CLASSES[:2])
    assert "ModifiedResNet" in str(info.value) and "MODEL.BACKBONE.NAME ViT-B/16" in str(info.value)


# ----------------------------------------------------------------------------------------------
# The scripts, end to end
# ----------------------------------------------------------------------------------------------
B2N = ["end", "4", "16", "False", "SAMPLe", "0.1", "0.005", "0.2", "1", "False", "0.0025"]
TAIL = "nctx4_cscFalse_ctpend/seed1/SAMPLe/rho=0.1/alpha=0.005/lambda=0.2"


def run_script(cwd, script: str, args, extra_opts, **env) -> str:
    """``bash scripts/<script> args`` in ``cwd`` with DATA and EXTRA_OPTS; returns stdout."""
    environ = dict(
        os.environ,
        PATH=osp.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        PYTHON=sys.executable,
        OMP_NUM_THREADS=os.environ["OMP_NUM_THREADS"],
        EXTRA_OPTS=" ".join(o.replace(" ", "") for o in extra_opts),  # words: "(32,32)"
        **env,
    )
    proc = subprocess.run(
        ["bash", osp.join(ROOT, "scripts", script), *args],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{script}\nSTDOUT:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def accuracy(run_dir) -> float:
    log = open(osp.join(run_dir, "log.txt")).read()
    return float(re.findall(r"\* accuracy: ([\d.]+)%", log)[-1])


@pytest.fixture
def script_env(tmp_path, dtd_root, deep_opts):
    """(folder that receives output/, EXTRA_OPTS words for the 4-block tiny CLIP, DATA)."""
    depths = ["TRAINER.MAPLE.PROMPT_DEPTH", str(DEPTH)]
    for key in ("PROMPT_DEPTH_VISION", "PROMPT_DEPTH_TEXT"):
        depths += [f"TRAINER.PROMPTSRC.{key}", str(DEPTH)]
    extra = [*_without_name(deep_opts), "OPTIM.MAX_EPOCH", "1", "DATASET.NUM_SHOTS", "2", *depths]
    work = tmp_path / "work"
    work.mkdir()
    return work, extra, {"DATA": dtd_root}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["SAMPLe", "SAMPLeSRC"])
def test_sample_base2new_scripts(family, script_env):
    work, extra, env = script_env
    cfg = "vit_b16_c2_ep20_batch4_4+4ctx"
    run_script(work, f"{family}/base2new_train.sh", ["dtd", cfg, *B2N], extra, **env)
    tail = f"dtd/{family}/{cfg}_16shots/{TAIL}/LR=0.0025"
    train = work / f"output/base2new/not-normal/train_base/{tail}"
    run_script(work, f"{family}/base2new_test.sh", ["dtd", cfg, *B2N], extra, LOADEP="1", **env)
    test = work / f"output/base2new/not-normal/test_new/{tail}"
    assert 0 <= accuracy(train) <= 100 and 0 <= accuracy(test) <= 100
    log = (train / "log.txt").read_text()
    assert "Optimizer: sample(sgd)" in log and "variant=reference" in log
    assert re.search(r"# classes\s+4\n", log)  # base classes
    assert re.search(r"# classes\s+3\n", (test / "log.txt").read_text())  # new classes


@pytest.mark.slow
@pytest.mark.parametrize("family", ["SAMPLe", "SAMPLeSRC"])
def test_sample_cross_dataset_scripts(family, script_env):
    work, extra, env = script_env
    cfg = "vit_b16_c2_ep20_batch4_4+4ctx_cross_datasets"
    lr = "/lr=0.0025" if family == "SAMPLeSRC" else ""
    run_script(work, f"{family}/xd_train.sh", ["dtd", cfg, *B2N], extra, **env)
    source = work / f"output/Cross_Dataset/dtd/{family}/{cfg}_16shots/{TAIL}{lr}"
    assert 0 <= accuracy(source) <= 100
    # xd_test.sh evaluates the imagenet model: the dtd run stands in for it
    os.symlink(work / "output/Cross_Dataset/dtd", work / "output/Cross_Dataset/imagenet")
    args = ["dtd", cfg, *B2N[:9]] + (B2N[9:] if family == "SAMPLeSRC" else [])
    run_script(work, f"{family}/xd_test.sh", args, extra, LOADEP="1", **env)
    out = f"output/evaluation/Cross_Dataset/{family}/{cfg}_16shots/nctx4_cscFalse_ctpend/dtd/seed1"
    assert 0 <= accuracy(work / f"{out}{lr}") <= 100


@pytest.mark.slow
@pytest.mark.parametrize("family", ["SAMPLe", "SAMPLeSRC"])
def test_sample_main_and_eval_scripts_on_resnet(family, script_env, rn_clip):
    work, _, env = script_env
    extra = [*rn_opts(rn_clip), "OPTIM.MAX_EPOCH", "1", "DATASET.NUM_SHOTS", "2"]
    args = ["dtd", "rn50_ctxv1", *B2N[:9]]
    run_script(work, f"{family}/main.sh", args, extra, **env)
    cross = "" if family == "SAMPLeSRC" else "Cross_Dataset/"
    model = work / f"output/dtd/{cross}SAMPLe/rn50_ctxv1_16shots/{TAIL}"
    assert 0 <= accuracy(model) <= 100
    assert "RN50" in (model / "config.yaml").read_text()
    run_script(work, f"{family}/eval.sh", args[:-1], extra, MODEL_DIR=str(model), LOADEP="1", **env)
    out = work / "output/evaluation/SAMPLe/rn50_ctxv1_16shots/nctx4_cscFalse_ctpend/dtd/seed1"
    assert 0 <= accuracy(out) <= 100


@pytest.mark.slow
def test_sample_cocoop_scripts(script_env):
    work, extra, env = script_env
    run_script(work, "SAMPLeCoCoOp/base2new_train.sh", ["dtd", "1"], extra, **env)
    tail = "dtd/shots_16/CoCoOp/vit_b16_c4_ep10_batch1_ctxv1/seed1"
    run_script(work, "SAMPLeCoCoOp/base2new_test.sh", ["dtd", "1"], extra, LOADEP="1", **env)
    for split in ("train_base", "test_new"):
        assert 0 <= accuracy(work / f"output/base2new/{split}/{tail}") <= 100
    cfg = "vit_b16_c4_ep10_batch1_ctxv1"
    run_script(work, "SAMPLeCoCoOp/xd_train.sh", ["dtd", cfg, *B2N], extra, **env)
    log = (work / f"output/Cross_Dataset/dtd/SAMPLeCoCoOp/{cfg}_16shots/{TAIL}/log.txt").read_text()
    assert "Optimizer: sagm(sgd)" in log  # the released CoCoOp copy of the optimizer
    os.symlink(work / "output/Cross_Dataset/dtd", work / "output/Cross_Dataset/imagenet")
    run_script(work, "SAMPLeCoCoOp/xd_test.sh", ["dtd", cfg, *B2N[:9]], extra, LOADEP="1", **env)
    out = f"output/evaluation/Cross_Dataset/SAMPLeCoCoOp/{cfg}_16shots/nctx4_cscFalse_ctpend"
    assert 0 <= accuracy(work / out / "dtd/seed1") <= 100


@pytest.mark.slow
def test_sample_maple_scripts(script_env):
    work, extra, env = script_env
    run_script(work, "SAMPLeMAP/base2new_train_maple.sh", ["dtd", "1"], extra, **env)
    run_script(work, "SAMPLeMAP/base2new_test_maple.sh", ["dtd", "1"], extra, LOADEP="1", **env)
    tail = "dtd/shots_16/MaPLe/vit_b16_c2_ep5_batch4_2ctx/seed1"
    for split in ("train_base", "test_new"):
        assert 0 <= accuracy(work / f"output/base2new/{split}/{tail}") <= 100
    # released weights: WEIGHTSPATH/base/seed1 (base-to-new) and WEIGHTSPATH/seed1 (cross-dataset)
    weights = work / "weights"
    (weights / "base").mkdir(parents=True)
    os.symlink(work / f"output/base2new/train_base/{tail}", weights / "base" / "seed1")
    os.symlink(work / f"output/base2new/train_base/{tail}", weights / "seed1")
    args = ["dtd", "1", str(weights)]
    fresh = work.parent / "reproduce"  # its test_new/ folder is base2new_test_maple.sh's
    fresh.mkdir()
    run_script(fresh, "SAMPLeMAP/reproduce_maple.sh", args, extra, LOADEP="1", **env)
    for split in ("test_base", "test_new"):
        assert 0 <= accuracy(fresh / f"output/base2new/{split}/{tail}") <= 100
    run_script(fresh, "SAMPLeMAP/reproduce_maple_xd.sh", args, extra, LOADEP="1", **env)
    xd = "output/evaluation/MaPLe/vit_b16_c2_ep5_batch4_2ctx_cross_datasets_16shots/dtd/seed1"
    assert 0 <= accuracy(fresh / xd) <= 100
    cfg = "vit_b16_c2_ep5_batch4_2ctx_cross_datasets"
    run_script(work, "SAMPLeMAP/xd_train.sh", ["dtd", cfg, *B2N], extra, **env)
    assert 0 <= accuracy(work / f"output/Cross_Dataset/dtd/SAMPLeMAP/{cfg}_16shots/{TAIL}") <= 100
    os.symlink(work / "output/Cross_Dataset/dtd", work / "output/Cross_Dataset/imagenet")
    run_script(work, "SAMPLeMAP/xd_test.sh", ["dtd", cfg, *B2N[:9]], extra, LOADEP="1", **env)
    out = f"output/evaluation/Cross_Dataset/SAMPLeMAP/{cfg}_16shots/nctx4_cscFalse_ctpend"
    assert 0 <= accuracy(work / out / "dtd/seed1") <= 100
