#!/usr/bin/env bash
# Base-to-new generalization on one dataset: train on its base classes (SHOTS shots per class;
# the test at the end of training gives the Base accuracy), then evaluate that model on the new
# classes, for every seed in SEEDS. Settings: see scripts/common.sh.
#
# Usage: bash scripts/base2new.sh [grid.py options] DATASET [KEY VALUE ...]
#   DATASET: a config stem of configs/datasets/ (dtd, eurosat, imagenet, ...), "all" (the 11)
#            folder:NAME (your own images in DATA/NAME) or a dataset config file PATH.yaml of
#            your own (docs/own-dataset.md)
#
#   DATA=/data TRAINER=CoOp OPTIM=sample bash scripts/base2new.sh dtd
#   DATA=/data OPTIM="sgd sample" SEEDS=1 bash scripts/base2new.sh --gpus=auto all
#   TRAINER=MaPLe bash scripts/base2new.sh --dry-run --commands eurosat
#   DATA=/data bash scripts/base2new.sh dtd MODEL.BACKBONE.PATH /weights/ViT-B-16.pt
#   DATA=/data REPRO=released bash scripts/base2new.sh dtd   # the released code's emulation
#   DATA=/data REPORT=report bash scripts/base2new.sh folder:mydata   # + tables, report/index.html
#
# Reproduction mode: paper (REPRO=paper, the default of train.py, the demo and every script: the
#   two train.py commands of the README per seed); REPRO=released emulates the SAMPLe authors'
#   released code. Each run's log.txt states its mode ("Reproduction mode: ...").
# Folders: OUTPUT/base2new/{train_base,test_new}/DATASET/shots_SHOTS/TRAINER/CFG[+OPTIM]/seedN
#   with REPRO=released: CFG+OPTIM-released (sgd: CFG+sgd-released)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
run_per_dataset base2new "$@"
