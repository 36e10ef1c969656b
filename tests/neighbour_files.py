"""Files of the CoOp family's repositories in their published formats, for
tests/test_neighbour_files.py (issue 32). Written for these tests after the layout, keys,
command lines and conventions of htyao89/Textual-based_Class-aware_prompt_tuning (TCP),
ShuvenduRoy/CoPrompt, htyao89/KgCoOp, BeierZhu/Prompt-align (ProGrad) and yunncheng/MMRL: the
config files and scripts carry the published keys, values and command lines (only ``DATA=``
edited); the trainer files are small models written the way those files are (Dassl's
``TrainerX``, OpenAI's ``clip``, ``TRAINER.COOP``/``LOSS``/``TRAINER.MMRL`` keys, a package named
``trainers`` with relative imports), not their code.
"""

from __future__ import annotations

# -- TCP (htyao89/Textual-based_Class-aware_prompt_tuning) --------------------------------------
TCP_CONFIG = """DATALOADER:
  TRAIN_X:
    BATCH_SIZE: 32
  TEST:
    BATCH_SIZE: 500
  NUM_WORKERS: 8

INPUT:
  SIZE: (224, 224)
  INTERPOLATION: "bicubic"
  PIXEL_MEAN: [0.48145466, 0.4578275, 0.40821073]
  PIXEL_STD: [0.26862954, 0.26130258, 0.27577711]
  TRANSFORMS: ["random_resized_crop", "random_flip", "normalize"]

OPTIM:
  NAME: "adam"
  LR: 0.002
  MAX_EPOCH: 50
  LR_SCHEDULER: "cosine"
  WARMUP_EPOCH: 1
  WARMUP_TYPE: "constant"
  WARMUP_CONS_LR: 1e-5

TRAIN:
  PRINT_FREQ: 5

MODEL:
  BACKBONE:
    NAME: "ViT-B/16"

TRAINER:
  COOP:
    CTX_INIT: False
"""

# scripts/base2new_train.sh: train on the base classes, then evaluate epoch LOADEP on the new
# ones, for each dataset and seed (a folder that exists is skipped)
_TCP_RUN = "${{DATASET}}/shots_${{SHOTS}}_${{WEIGHT}}/${{TRAINER}}/${{CFG}}/seed${{SEED}}"
_TCP_TRAIN = """    DIR=${{FOLDER}}_${{NCTX}}/base2new/train_base/<RUN>
    if [ -d "$DIR" ]; then
        echo "Results are available in ${{DIR}}. Skip this job"
    else
        echo "Run this job and save the output to ${{DIR}}"
        CUDA_VISIBLE_DEVICES=0 python train.py \\
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
    fi"""
_TCP_TEST = """    COMMON_DIR=<RUN>
    MODEL_DIR=${{FOLDER}}_${{NCTX}}/base2new/train_base/${{COMMON_DIR}}
    DIR=${{FOLDER}}_${{NCTX}}{eval}/base2new/test_${{SUB}}/${{COMMON_DIR}}

    if [ -d "$DIR" ]; then
        echo "Results are available in ${{DIR}}. Skip this job"
    else
        echo "Run this job and save the output to ${{DIR}}"
        CUDA_VISIBLE_DEVICES=0 python train.py \\
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
    fi"""
_TCP_TRAIN, _TCP_TEST = (t.replace("<RUN>", _TCP_RUN) for t in (_TCP_TRAIN, _TCP_TEST))
TCP_DATASETS = ["caltech101", "dtd", "eurosat", "fgvc_aircraft", "food101", "oxford_flowers"]
TCP_DATASETS += ["oxford_pets", "stanford_cars", "ucf101"]
TCP_TRAIN_SH = f"""#!/bin/bash

cd ..

# custom config
DATA={{data}}
TRAINER=TCP
WEIGHT=1.0

CFG=vit_b16_ep100_ctxv1
CTP=end  # class token position (end or middle)
NCTX=4  # number of context tokens
SHOTS=16  # number of shots (1, 2, 4, 8, 16)
CSC=False  # class-specific context (False or True)
FOLDER=output_1108

for DATASET in {" ".join(TCP_DATASETS)}
do
for SEED in 1 2 3
do
{_TCP_TRAIN}
done


LOADEP=50
SUB=new
for SEED in 1 2 3
do
{_TCP_TEST.replace("{eval}", "_eval")}
done
done


for DATASET in sun397 imagenet
do
for SEED in 1 2 3
do
{_TCP_TRAIN}
done


LOADEP=25
SUB=new
for SEED in 1 2 3
do
{_TCP_TEST.replace("{eval}", "")}
done
done
"""

# TCP's parse_test_res.py (CoOp's parser; the results after "Finished training", or after
# "=> result" with --test-log; TCP's summary line names the 3rd and 4th folders of the path)
TCP_PARSE_TEST_RES = '''"""Read the results of the seed folders of a run directory."""
import re
import numpy as np
import os.path as osp
import argparse
from collections import OrderedDict, defaultdict

from dassl.utils import check_isfile, listdir_nohidden


def parse_function(*metrics, directory="", args=None, end_signal=None):
    outputs = []
    for subdir in listdir_nohidden(directory, sort=True):
        fpath = osp.join(directory, subdir, "log.txt")
        assert check_isfile(fpath)
        good_to_go = False
        output = OrderedDict()
        with open(fpath, "r") as f:
            for line in f.readlines():
                line = line.strip()
                if line == end_signal:
                    good_to_go = True
                for metric in metrics:
                    match = metric["regex"].search(line)
                    if match and good_to_go:
                        output[metric["name"]] = float(match.group(1))
        if output:
            outputs.append(output)
    assert len(outputs) > 0, f"Nothing found in {directory}"
    metrics_results = defaultdict(list)
    for output in outputs:
        for key, value in output.items():
            metrics_results[key].append(value)
    dir_sets = directory.split('/')
    for key, values in metrics_results.items():
        avg, std = np.mean(values), np.std(values)
        print(f"* {dir_sets[2]} {dir_sets[3]} {key}: {avg:.2f}% +- {std:.2f}%")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=str)
    parser.add_argument("--test-log", action="store_true")
    parser.add_argument("--keyword", default="accuracy", type=str)
    args = parser.parse_args()
    end_signal = "=> result" if args.test_log else "Finished training"
    metric = {"name": args.keyword, "regex": re.compile(fr"\\* {args.keyword}: ([\\.\\deE+-]+)%")}
    parse_function(metric, directory=args.directory, args=args, end_signal=end_signal)
'''

# -- CoPrompt (ShuvenduRoy/CoPrompt) ------------------------------------------------------------
COPROMPT_CONFIG = """DATALOADER:
  TRAIN_X:
    BATCH_SIZE: 4
  TEST:
    BATCH_SIZE: 100
  NUM_WORKERS: 8
  K_TRANSFORMS: 2

INPUT:
  SIZE: (224, 224)
  INTERPOLATION: "bicubic"
  PIXEL_MEAN: [0.48145466, 0.4578275, 0.40821073]
  PIXEL_STD: [0.26862954, 0.26130258, 0.27577711]
  TRANSFORMS: ["randaugment", "normalize"]

OPTIM:
  NAME: "sgd"
  LR: 0.0035
  MAX_EPOCH: 8
  LR_SCHEDULER: "cosine"
  WARMUP_EPOCH: 1
  WARMUP_TYPE: "constant"
  WARMUP_CONS_LR: 1e-5

TRAIN:
  PRINT_FREQ: 20

MODEL:
  BACKBONE:
    NAME: "ViT-B/16"

TRAINER:
  CoPrompt:
    N_CTX: 2
    CTX_INIT: "a photo of a"
    PREC: "fp16"
    PROMPT_DEPTH: 9
  W: 1.0
  DISTILL: "cosine"
"""
_COPROMPT_HEAD = """#!/bin/bash

#cd ../..

# custom config
DATA={data}
TRAINER=CoPrompt

DATASET=$1
SEED=$2
EXP_NAME=$3{extra}

CFG=coprompt
SHOTS=16
"""
COPROMPT_TRAIN_SH = (
    _COPROMPT_HEAD.replace("{extra}", " # base2new")
    + """
DIR=output/${{EXP_NAME}}/train_base/${{DATASET}}/shots_${{SHOTS}}/${{TRAINER}}/${{CFG}}/seed${{SEED}}

python train.py \\
\t--root ${{DATA}} \\
\t--seed ${{SEED}} \\
\t--trainer ${{TRAINER}} \\
\t--dataset-config-file configs/datasets/${{DATASET}}.yaml \\
\t--config-file configs/trainers/${{CFG}}.yaml \\
\t--output-dir ${{DIR}} \\
\tDATASET.NUM_SHOTS ${{SHOTS}} \\
\tDATASET.SUBSAMPLE_CLASSES base
"""
)
COPROMPT_TEST_SH = (
    _COPROMPT_HEAD.replace("{extra}", "")
    + """LOADEP=$4
SUB=new

COMMON_DIR=${{DATASET}}/shots_${{SHOTS}}/${{TRAINER}}/${{CFG}}/seed${{SEED}}
MODEL_DIR=output/${{EXP_NAME}}/train_base/${{COMMON_DIR}}
DIR=output/${{EXP_NAME}}/test_${{SUB}}/${{COMMON_DIR}}

echo "Runing the first phase job and save the output to ${{DIR}}"

python train.py \\
\t--root ${{DATA}} \\
\t--seed ${{SEED}} \\
\t--trainer ${{TRAINER}} \\
\t--dataset-config-file configs/datasets/${{DATASET}}.yaml \\
\t--config-file configs/trainers/${{CFG}}.yaml \\
\t--output-dir ${{DIR}} \\
\t--model-dir ${{MODEL_DIR}} \\
\t--load-epoch ${{LOADEP}} \\
\t--eval-only \\
\tDATASET.NUM_SHOTS ${{SHOTS}} \\
\tDATASET.SUBSAMPLE_CLASSES ${{SUB}}
"""
)

# -- a repository of the family: train.py's extend_cfg and a package named trainers -------------
# KgCoOp's / ProGrad's train.py (its datasets imports would fail here: only extend_cfg is run)
TRAIN_PY = '''import argparse
import torch

from dassl.utils import setup_logger, set_random_seed, collect_env_info
from dassl.config import get_cfg_default
from dassl.engine import build_trainer

import datasets.oxford_pets
import trainers.kgcoop
import trainers.prograd


def extend_cfg(cfg):
    """
    Add new config variables.
    """
    from yacs.config import CfgNode as CN

    cfg.TRAINER.COOP = CN()
    cfg.TRAINER.COOP.ALPHA = 1.0
    cfg.TRAINER.COOP.N_CTX = 16  # number of context vectors
    cfg.TRAINER.COOP.CSC = False  # class-specific context
    cfg.TRAINER.COOP.CTX_INIT = False  # initialization words
    cfg.TRAINER.COOP.W = 1.0
    cfg.TRAINER.COOP.PREC = "fp16"  # fp16, fp32, amp
    cfg.TRAINER.COOP.CLASS_TOKEN_POSITION = "end"  # 'middle' or 'end' or 'front'

    cfg.TRAINER.COCOOP = CN()
    cfg.TRAINER.COCOOP.N_CTX = 16  # number of context vectors
    cfg.TRAINER.COCOOP.CTX_INIT = False  # initialization words
    cfg.TRAINER.COCOOP.PREC = "fp16"  # fp16, fp32, amp

    cfg.DATASET.SUBSAMPLE_CLASSES = "all"  # all, base or new
    """
    Add new config
    """
    cfg.LOSS = CN()
    cfg.LOSS.GM = False
    cfg.LOSS.NAME = ""
    cfg.LOSS.ALPHA = 0.
    cfg.LOSS.T = 1.
    cfg.LOSS.LAMBDA = 1.


def main(args):
    raise SystemExit("train.py of the other repository was run")


if __name__ == "__main__":
    main(argparse.ArgumentParser().parse_args())
'''

# the family's trainer file prologue: CLIP through clip._MODELS / _download / build_model
_PROLOGUE = '''import os.path as osp

import torch
import torch.nn as nn
from torch.nn import functional as F

from dassl.engine import TRAINER_REGISTRY, TrainerX
from dassl.metrics import compute_accuracy
from dassl.optim import build_optimizer, build_lr_scheduler
{imports}


def load_clip_to_cpu(cfg):
    backbone_name = cfg.MODEL.BACKBONE.NAME
    url = clip._MODELS[backbone_name]
    model_path = clip._download(url)
    try:
        model = torch.jit.load(model_path, map_location="cpu").eval()
        state_dict = None
    except RuntimeError:
        state_dict = torch.load(model_path, map_location="cpu")
    return clip.build_model(state_dict or model.state_dict())


class CustomCLIP(nn.Module):
    """Frozen class text features of the initial prompt plus a learned per-class offset."""

    def __init__(self, cfg, classnames, clip_model):
        super().__init__()
        ctx_init = cfg.TRAINER.COOP.CTX_INIT
        temp = "a photo of a" if ctx_init else " ".join(["X"] * cfg.TRAINER.COOP.N_CTX)
        prompts = [f"{{temp}} {{name.replace('_', ' ')}}." for name in classnames]
        with torch.no_grad():
            text = clip_model.encode_text(clip.tokenize(prompts)).float()
        self.register_buffer("text_features", text / text.norm(dim=-1, keepdim=True))
        self.prompt_learner = nn.Linear(text.shape[1], text.shape[1], bias=False)
        nn.init.zeros_(self.prompt_learner.weight)
        self.image_encoder = clip_model.visual
        self.logit_scale = clip_model.logit_scale
        self.dtype = clip_model.dtype

    def encode_image(self, image):
        image_features = self.image_encoder(image.type(self.dtype)).float()
        return image_features / image_features.norm(dim=-1, keepdim=True)

    def forward(self, image, zero_shot=False):
        image_features = self.encode_image(image)
        text = self.text_features
        if not zero_shot:
            text = text + self.prompt_learner(text)
            text = text / text.norm(dim=-1, keepdim=True)
        return self.logit_scale.exp().float() * image_features @ text.t(), text


class _Base(TrainerX):
    def check_cfg(self, cfg):
        assert cfg.TRAINER.COOP.PREC in ["fp16", "fp32", "amp"]

    def build_model(self):
        cfg = self.cfg
        classnames = self.dm.dataset.classnames
        clip_model = load_clip_to_cpu(cfg)
        if cfg.TRAINER.COOP.PREC == "fp32" or cfg.TRAINER.COOP.PREC == "amp":
            clip_model.float()
        self.model = CustomCLIP(cfg, classnames, clip_model)
        for name, param in self.model.named_parameters():
            if "prompt_learner" not in name:
                param.requires_grad_(False)
        self.model.to(self.device)
        self.optim = build_optimizer(self.model.prompt_learner, cfg.OPTIM)
        self.sched = build_lr_scheduler(self.optim, cfg.OPTIM)
        self.register_model("prompt_learner", self.model.prompt_learner, self.optim, self.sched)

    def model_inference(self, input):
        return self.model(input)[0]

    def parse_batch_train(self, batch):
        input = batch["img"].to(self.device)
        label = batch["label"].to(self.device)
        return input, label
'''

# KgCoOp's trainers/kgcoop.py: TRAINER.COOP keys, W of KgCoOp's train.py
KGCOOP_PY = (
    _PROLOGUE.format(imports="from clip import clip")
    + """

@TRAINER_REGISTRY.register()
class KgCoOp(_Base):
    def build_model(self):
        super().build_model()
        self.w = self.cfg.TRAINER.COOP.W
        print(f"KgCoOp file: CTX_INIT {self.cfg.TRAINER.COOP.CTX_INIT!r}, W {self.w}")

    def forward_backward(self, batch):
        image, label = self.parse_batch_train(batch)
        output, text = self.model(image)
        score = torch.cosine_similarity(text, self.model.text_features, dim=1)
        loss = F.cross_entropy(output, label) + self.w * (1.0 - score.mean())
        self.model_backward_and_update(loss)
        loss_summary = {"loss": loss.item(), "acc": compute_accuracy(output, label)[0].item()}
        if (self.batch_idx + 1) == self.num_batches:
            self.update_lr()
        return loss_summary
"""
)

# ProGrad's trainers/prograd.py: LOSS.* keys of ProGrad's train.py, a sibling module imported
# relatively (its package's imagenet_templates.py)
PROGRAD_PY = (
    _PROLOGUE.format(
        imports="from clip import clip\n\nfrom .imagenet_templates import IMAGENET_TEMPLATES"
    )
    + """

@TRAINER_REGISTRY.register()
class ProGrad(_Base):
    def build_model(self):
        super().build_model()
        print(f"ProGrad file: LOSS.NAME {self.cfg.LOSS.NAME}, T {self.cfg.LOSS.T}, "
              f"{len(IMAGENET_TEMPLATES)} templates")

    def forward_backward(self, batch):
        image, label = self.parse_batch_train(batch)
        output, _ = self.model(image)
        with torch.no_grad():
            zs_output, _ = self.model(image, zero_shot=True)
        xe_loss = F.cross_entropy(output, label)
        kl_loss = F.kl_div(F.log_softmax(output / self.cfg.LOSS.T, dim=1),
                           F.softmax(zs_output / self.cfg.LOSS.T, dim=1), reduction="batchmean")
        self.prograd_backward_and_update(xe_loss, kl_loss, self.cfg.LOSS.LAMBDA)
        loss_summary = {"xe_loss": xe_loss.item(), "acc": compute_accuracy(output, label)[0].item()}
        if (self.batch_idx + 1) == self.num_batches:
            self.update_lr()
        return loss_summary
"""
)
IMAGENET_TEMPLATES_PY = 'IMAGENET_TEMPLATES = ["a photo of a {}.", "a sketch of a {}."]\n'

# TCP's trainers/tcp.py: its own bundled clip package (trainers/clip_text), which knows
# OpenAI's model names only
TCP_PY = (
    _PROLOGUE.format(imports="from .clip_text import clip")
    + """

@TRAINER_REGISTRY.register()
class TCP(_Base):
    pass
"""
)
CLIP_TEXT_PY = """_MODELS = {
    "RN50": "https://openaipublic.azureedge.net/clip/models/RN50.pt",
    "ViT-B/16": "https://openaipublic.azureedge.net/clip/models/ViT-B-16.pt",
}


def _download(url, root="~/.cache/clip"):
    raise RuntimeError("no download in the tests")
"""

# MMRL's trainers/mmrl.py: its CLIP comes from MMRL's own clip package (build_model_MMRL)
MMRL_PY = (
    _PROLOGUE.format(imports="from clip import clip")
    + """

@TRAINER_REGISTRY.register()
class MMRL(_Base):
    def build_model(self):
        cfg = self.cfg
        details = {"model": "MMRL", "n_rep_tokens": cfg.TRAINER.MMRL.N_REP_TOKENS}
        self.clip_model = clip.build_model_MMRL({}, details)
"""
)
