#!/usr/bin/env bash
# Few-shot learning on one dataset (CoOp's setting): train on all its classes with SHOTS shots
# per class (default 1 2 4 8 16), for every seed in SEEDS; the test at the end of training, on
# the full test set, is the result. Settings: see scripts/common.sh.
#
# Usage: bash scripts/few_shot.sh [grid.py options] DATASET [KEY VALUE ...]
#   DATASET: a config stem of configs/datasets/ (dtd, eurosat, imagenet, ...), "all" (the 11),
#            folder:NAME (your own images in DATA/NAME) or a dataset config file PATH.yaml
#
#   DATA=/data TRAINER=CoOp OPTIM="sgd sample" bash scripts/few_shot.sh dtd
#   DATA=/data SHOTS="1 4 16" SEEDS=1 bash scripts/few_shot.sh --gpus=auto all
#   TRAINER=MMRL bash scripts/few_shot.sh --dry-run --commands eurosat
#
# Configs: the trainer's few-shot schedule (CoOp and ProGrad: 50 epochs for 1 shot, 100 for 2
#   and 4, 200 for 8 and 16, ImageNet 50; MMRL, PromptSRC, SkipTuning: their few-shot configs;
#   the others: their base-to-new config; docs/running.md). CFG=<name> overrides it.
# Folders: OUTPUT/DATASET/TRAINER/CFG[+OPTIM]_SHOTSshots/seedN (CoOp's few-shot scripts'; with
#   REPRO=released: CFG+OPTIM-released)
SHOTS="${SHOTS:-1 2 4 8 16}"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
run_per_dataset few_shot "$@"
