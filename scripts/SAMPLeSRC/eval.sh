#!/bin/bash
# The SAMPLe authors' scripts/SAMPLeSRC/eval.sh (same arguments and output folder): evaluate a
# --trainer SAMPLe model on all classes of DATASET, seed 1. Like the released file it is
# SAMPLe/eval.sh (it runs --trainer SAMPLe, not SAMPLeSRC).
#
# Usage: bash scripts/SAMPLeSRC/eval.sh DATASET CFG CTP NCTX SHOTS CSC ENBLR RHO ALPHA LAMBDA
# The model folder is fixed in the released script (an oxford_flowers run of main.sh, epoch 50);
# here it is the same by default and MODEL_DIR / LOADEP choose another one.
# Run it from the folder that holds output/. Environment: DATA [./DATA]; PYTHON [python3];
#   MODEL_DIR, LOADEP [50]; EXTRA_OPTS: KEY VALUE options added at the end of the train.py call.
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
CSC=$6
ENBLR=$7
RHO=$8
ALPHA=$9
LAMBDA=${10}
MODEL_DIR=${MODEL_DIR:-output/oxford_flowers/SAMPLe/vit_b16_ep50_16shots/nctx4_cscFalse_ctpend/seed1/None/rho=0.05/alpha=0.5/lambda=0.5}
LOADEP=${LOADEP:-50}
SUB=all

for SEED in 1; do
    # shellcheck disable=SC2086  # EXTRA_OPTS is a list of words
    ${PYTHON:-python3} "${REPO}/train.py" \
        --root "${DATA}" \
        --seed ${SEED} \
        --trainer ${TRAINER} \
        --dataset-config-file "${REPO}/configs/datasets/${DATASET}.yaml" \
        --config-file "${REPO}/configs/trainers/${TRAINER}/${CFG}.yaml" \
        --output-dir "output/evaluation/${TRAINER}/${CFG}_${SHOTS}shots/nctx${NCTX}_csc${CSC}_ctp${CTP}/${DATASET}/seed${SEED}" \
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
done
