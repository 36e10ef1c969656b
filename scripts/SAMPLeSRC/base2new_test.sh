#!/bin/bash
# The SAMPLe authors' scripts/SAMPLeSRC/base2new_test.sh (same arguments and output folders):
# evaluate the model of base2new_train.sh (the same arguments) on the new classes of DATASET.
#
# Usage: bash scripts/SAMPLeSRC/base2new_test.sh DATASET CFG CTP NCTX SHOTS CSC ENBLR RHO ALPHA \
#            LAMBDA SEED NORMALIZATION LR
# It loads the model that base2new_train.sh wrote (output/base2new/.../train_base/...), epoch
# LOADEP.
# Run it from the folder that holds output/. Environment: DATA [./DATA]; PYTHON [python3];
#   LOADEP [20] the epoch to load (the configs' 20 epochs); EXTRA_OPTS: KEY VALUE options added
#   at the end of the train.py call.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DATA=${DATA:-./DATA}
TRAINER=SAMPLeSRC

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
LOADEP=${LOADEP:-20}
SUB=new

COMMON_DIR=${DATASET}/${TRAINER}/${CFG}_${SHOTS}shots/nctx${NCTX}_csc${CSC}_ctp${CTP}/seed${SEED}/${ENBLR}/rho=${RHO}/alpha=${ALPHA}/lambda=${LAMBDA}/LR=${LR}
if [ "$NORMALIZATION" = False ]; then NORMAL=not-normal; else NORMAL=normal; fi
MODEL_DIR=output/base2new/${NORMAL}/train_base/${COMMON_DIR}
DIR=output/base2new/${NORMAL}/test_${SUB}/${COMMON_DIR}
if [ -d "$DIR" ]; then
    echo "Results are available in ${DIR}. Resuming evaluation..."
else
    echo "Running evaluation and saving the output to ${DIR}..."
fi
# shellcheck disable=SC2086  # EXTRA_OPTS is a list of words
${PYTHON:-python3} "${REPO}/train.py" \
    --root "${DATA}" \
    --seed "${SEED}" \
    --trainer ${TRAINER} \
    --dataset-config-file "${REPO}/configs/datasets/${DATASET}.yaml" \
    --config-file "${REPO}/configs/trainers/${TRAINER}/${CFG}.yaml" \
    --output-dir "${DIR}" \
    --model-dir "${MODEL_DIR}" \
    --load-epoch "${LOADEP}" \
    --eval-only \
    DATASET.NUM_SHOTS "${SHOTS}" \
    DATASET.SUBSAMPLE_CLASSES ${SUB} \
    ${EXTRA_OPTS}
