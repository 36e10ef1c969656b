#!/bin/bash
# The SAMPLe authors' scripts/SAMPLeSRC/base2new_train.sh (same arguments and output folders):
# train --trainer SAMPLeSRC on the base classes of DATASET. (The released file trains on all
# classes, into train_all/, which its own base2new_test.sh never reads: base-to-new trains on
# the base classes, so SUB is base here and the model lands where base2new_test.sh looks.)
#
# Usage: bash scripts/SAMPLeSRC/base2new_train.sh DATASET CFG CTP NCTX SHOTS CSC ENBLR RHO ALPHA \
#            LAMBDA SEED NORMALIZATION LR
#   e.g. dtd vit_b16_c2_ep20_batch4_4+4ctx end 4 16 False SAMPLe 0.1 0.005 0.2 1 False 0.0025
#   CFG: a file of configs/trainers/SAMPLeSRC/; ENBLR: None | SAM | SAMPLe. As in the released script,
#   CTP, NCTX and CSC only name the output folder (the prompt keys come from the config file).
# Run it from the folder that holds output/ (the repository root, as the authors do).
# Environment: DATA [./DATA] dataset root; PYTHON [python3]; EXTRA_OPTS: KEY VALUE options added
#   at the end of the train.py call (the tests pass a tiny CLIP and 1 epoch this way).
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DATA=${DATA:-./DATA}
TRAINER=SAMPLeSRC
ADAPTIVE=False

DATASET=$1
CFG=$2
CTP=$3
NCTX=$4
SHOTS=$5
CSC=$6
ENBLR=$7
RHO=$8
ALPHA=$9
LAMBDA=${10}
SEED=${11}
NORMALIZATION=${12}
LR=${13}
SUB=base

if [ "$NORMALIZATION" = False ]; then NORMAL=not-normal; else NORMAL=normal; fi
DIR=output/base2new/${NORMAL}/train_${SUB}/${DATASET}/${TRAINER}/${CFG}_${SHOTS}shots/nctx${NCTX}_csc${CSC}_ctp${CTP}/seed${SEED}/${ENBLR}/rho=${RHO}/alpha=${ALPHA}/lambda=${LAMBDA}/LR=${LR}
if [ -d "$DIR" ]; then
    echo "Results are available in ${DIR}. Resuming..."
else
    echo "Running this job and saving the output to ${DIR}..."
fi
# shellcheck disable=SC2086  # EXTRA_OPTS is a list of words
${PYTHON:-python3} "${REPO}/train.py" \
    --root "${DATA}" \
    --seed "${SEED}" \
    --trainer ${TRAINER} \
    --dataset-config-file "${REPO}/configs/datasets/${DATASET}.yaml" \
    --config-file "${REPO}/configs/trainers/${TRAINER}/${CFG}.yaml" \
    --output-dir "${DIR}" \
    DATASET.NUM_SHOTS "${SHOTS}" \
    TRAINER.SAMPLe.NORMALIZATION "${NORMALIZATION}" \
    TRAINER.SAMPLe.ADAPTIVE ${ADAPTIVE} \
    TRAINER.SAMPLe.ENBLR "${ENBLR}" \
    TRAINER.SAMPLe.RHO "${RHO}" \
    TRAINER.SAMPLe.ALPHA "${ALPHA}" \
    TRAINER.SAMPLe.EMA_LAMBDA "${LAMBDA}" \
    OPTIM.LR "${LR}" \
    DATASET.SUBSAMPLE_CLASSES ${SUB} \
    ${EXTRA_OPTS}
