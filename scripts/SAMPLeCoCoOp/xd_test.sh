#!/bin/bash
# The SAMPLe authors' scripts/SAMPLeCoCoOp/xd_test.sh (same arguments and output folders): evaluate
# the imagenet model of xd_train.sh (the same arguments) on all classes of DATASET.
#
# Usage: bash scripts/SAMPLeCoCoOp/xd_test.sh DATASET CFG CTP NCTX SHOTS CSC ENBLR RHO ALPHA LAMBDA SEED
# As in the released script the prompt options go to TRAINER.COOP, which this trainer does not
# read (its prompt keys come from the config file).
# Run it from the folder that holds output/. Environment: DATA [./DATA]; PYTHON [python3];
#   LOADEP [10] the epoch to load; EXTRA_OPTS: KEY VALUE options added at the end of the call.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DATA=${DATA:-./DATA}
TRAINER=SAMPLeCoCoOp
NORMALIZATION=False
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
LOADEP=${LOADEP:-10}
SUB=all

MODEL_DIR=output/Cross_Dataset/imagenet/${TRAINER}/${CFG}_${SHOTS}shots/nctx${NCTX}_csc${CSC}_ctp${CTP}/seed${SEED}/${ENBLR}/rho=${RHO}/alpha=${ALPHA}/lambda=${LAMBDA}
DIR=output/evaluation/Cross_Dataset/${TRAINER}/${CFG}_${SHOTS}shots/nctx${NCTX}_csc${CSC}_ctp${CTP}/${DATASET}/seed${SEED}
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
    TRAINER.COOP.N_CTX "${NCTX}" \
    TRAINER.COOP.CSC "${CSC}" \
    TRAINER.COOP.CLASS_TOKEN_POSITION "${CTP}" \
    DATASET.NUM_SHOTS "${SHOTS}" \
    TRAINER.SAMPLe.NORMALIZATION ${NORMALIZATION} \
    TRAINER.SAMPLe.ADAPTIVE ${ADAPTIVE} \
    TRAINER.SAMPLe.ENBLR "${ENBLR}" \
    TRAINER.SAMPLe.RHO "${RHO}" \
    TRAINER.SAMPLe.ALPHA "${ALPHA}" \
    TRAINER.SAMPLe.EMA_LAMBDA "${LAMBDA}" \
    DATASET.SUBSAMPLE_CLASSES ${SUB} \
    ${EXTRA_OPTS}
