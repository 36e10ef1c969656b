#!/usr/bin/env bash
# Domain generalization: evaluate the ImageNet models of the cross-dataset protocol on
# ImageNet-V2, -Sketch, -A and -R (or the space-separated TARGETS), for every seed in SEEDS.
# Trains on ImageNet first where that run is not finished (the same folders as
# scripts/cross_dataset.sh, so each model is trained once). Settings: see scripts/common.sh.
#
# Usage: bash scripts/domain_gen.sh [grid.py options] [KEY VALUE ...]
#
#   DATA=/data TRAINER=CoOp OPTIM="sgd sample" bash scripts/domain_gen.sh
#
# Folders (REPRO=paper, the default; REPRO=released adds "-released" after OPTIM, sgd: "+sgd"):
#          OUTPUT/imagenet/TRAINER/CFG[+OPTIM]_SHOTSshots/seedN                 (training)
#          OUTPUT/evaluation/TRAINER/CFG[+OPTIM]_SHOTSshots/TARGET/seedN        (evaluations)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
split_args "$@"
OPTS=(${REST[@]+"${REST[@]}"})
# shellcheck disable=SC2086  # TARGETS is a space-separated list
run_grid --protocols domain_gen ${TARGETS:+--dg-targets $TARGETS}
