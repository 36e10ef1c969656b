#!/bin/bash
# The SAMPLe authors' scripts/SAMPLe/xd_train.sh (same arguments and output folders): train
# --trainer SAMPLe on all classes of DATASET (imagenet for the cross-dataset protocol).
#
# Usage: bash scripts/SAMPLe/xd_train.sh DATASET CFG CTP NCTX SHOTS CSC ENBLR RHO ALPHA LAMBDA \
#            SEED NORMALIZATION LR
#   e.g. imagenet vit_b16_c2_ep20_batch8_4+4ctx_cross_datasets end 4 16 False SAMPLe 0.1 0.005 \
#        0.2 1 False 0.005
# Run it from the folder that holds output/. Environment: DATA [./DATA]; PYTHON [python3];
#   EXTRA_OPTS: KEY VALUE options added at the end of the train.py call.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DATA=${DATA:-./DATA}
TRAINER=SAMPLe
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
SUB=all

DIR=output/Cross_Dataset/${DATASET}/${TRAINER}/${CFG}_${SHOTS}shots/nctx${NCTX}_csc${CSC}_ctp${CTP}/seed${SEED}/${ENBLR}/rho=${RHO}/alpha=${ALPHA}/lambda=${LAMBDA}
echo "Run this job and save the output to ${DIR}"
# shellcheck disable=SC2086  # EXTRA_OPTS is a list of words
${PYTHON:-python3} "${REPO}/train.py" \
    --root "${DATA}" \
    --seed "${SEED}" \
    --trainer ${TRAINER} \
    --dataset-config-file "${REPO}/configs/datasets/${DATASET}.yaml" \
    --config-file "${REPO}/configs/trainers/${TRAINER}/${CFG}.yaml" \
    --output-dir "${DIR}" \
    TRAINER.SAMPLe.N_CTX "${NCTX}" \
    TRAINER.SAMPLe.CSC "${CSC}" \
    TRAINER.SAMPLe.CLASS_TOKEN_POSITION "${CTP}" \
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
