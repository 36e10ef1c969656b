#!/usr/bin/env bash
# Cross-dataset transfer: train on ImageNet (all classes, SHOTS shots per class), then evaluate
# the model on the 10 other datasets (or the space-separated TARGETS), for every seed in SEEDS.
# Settings: see scripts/common.sh.
#
# Usage: bash scripts/cross_dataset.sh [grid.py options] [KEY VALUE ...]
#
#   DATA=/data TRAINER=CoOp OPTIM="sgd sample" bash scripts/cross_dataset.sh
#   DATA=/data TARGETS="dtd eurosat" bash scripts/cross_dataset.sh --gpus=auto
#   DATA=/data TARGETS=folder:mydata bash scripts/cross_dataset.sh   # your images (DATA/mydata)
#
# Folders (REPRO=paper, the default; REPRO=released adds "-released" after OPTIM, sgd: "+sgd"):
#          OUTPUT/imagenet/TRAINER/CFG[+OPTIM]_SHOTSshots/seedN                 (training)
#          OUTPUT/evaluation/TRAINER/CFG[+OPTIM]_SHOTSshots/TARGET/seedN        (evaluations)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
split_args "$@"
OPTS=(${REST[@]+"${REST[@]}"})
# shellcheck disable=SC2086  # TARGETS is a space-separated list
run_grid --protocols cross_dataset ${TARGETS:+--xd-targets $TARGETS}
