#!/bin/bash
# The SAMPLe authors' scripts/SAMPLeSRC/main.sh (same arguments and output folder): few-shot
# training on all classes of DATASET. Like the released file it runs --trainer SAMPLe (CoOp's
# prompt learner), not SAMPLeSRC, and differs from SAMPLe/main.sh only in the output folder.
#
# Usage: bash scripts/SAMPLeSRC/main.sh DATASET CFG CTP NCTX SHOTS CSC ENBLR RHO ALPHA LAMBDA SEED
#   e.g. oxford_flowers vit_b16_ep50 end 16 16 False SAMPLe 0.2 0.001 0.015 1
# As in the released script: CSC is always False (the 6th argument is ignored), NORMALIZATION and
# ADAPTIVE are False, and the prompt options go to TRAINER.COOP, which the SAMPLe trainer does not
# read (its prompt keys are TRAINER.SAMPLe's: the config file's and the defaults).
# Run it from the folder that holds output/. Environment: DATA [./DATA]; PYTHON [python3];
#   EXTRA_OPTS: KEY VALUE options added at the end of the train.py call.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DATA=${DATA:-./DATA}
TRAINER=SAMPLe
NORMALIZATION=False
ADAPTIVE=False

DATASET=$1
CFG=$2
CTP=$3
NCTX=$4
SHOTS=$5
CSC=False
ENBLR=$7
RHO=$8
ALPHA=$9
LAMBDA=${10}
SEED=${11}

DIR=output/${DATASET}/${TRAINER}/${CFG}_${SHOTS}shots/nctx${NCTX}_csc${CSC}_ctp${CTP}/seed${SEED}/${ENBLR}/rho=${RHO}/alpha=${ALPHA}/lambda=${LAMBDA}
echo "Run this job and save the output to ${DIR}"
# shellcheck disable=SC2086  # EXTRA_OPTS is a list of words
${PYTHON:-python3} "${REPO}/train.py" \
    --root "${DATA}" \
    --seed "${SEED}" \
    --trainer ${TRAINER} \
    --dataset-config-file "${REPO}/configs/datasets/${DATASET}.yaml" \
    --config-file "${REPO}/configs/trainers/${TRAINER}/${CFG}.yaml" \
    --output-dir "${DIR}" \
    TRAINER.COOP.N_CTX "${NCTX}" \
    TRAINER.COOP.CSC ${CSC} \
    TRAINER.COOP.CLASS_TOKEN_POSITION "${CTP}" \
    DATASET.NUM_SHOTS "${SHOTS}" \
    TRAINER.SAMPLe.NORMALIZATION ${NORMALIZATION} \
    TRAINER.SAMPLe.ADAPTIVE ${ADAPTIVE} \
    TRAINER.SAMPLe.ENBLR "${ENBLR}" \
    TRAINER.SAMPLe.RHO "${RHO}" \
    TRAINER.SAMPLe.ALPHA "${ALPHA}" \
    TRAINER.SAMPLe.EMA_LAMBDA "${LAMBDA}" \
    ${EXTRA_OPTS}
