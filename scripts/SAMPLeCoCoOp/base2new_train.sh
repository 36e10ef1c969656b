#!/bin/bash
# The SAMPLe authors' scripts/SAMPLeCoCoOp/base2new_train.sh (same arguments and output folder):
# like the released file (CoCoOp's script) it trains --trainer CoCoOp, with CoCoOp's
# vit_b16_c4_ep10_batch1_ctxv1 config, 16 shots, on the base classes of DATASET.
#
# Usage: bash scripts/SAMPLeCoCoOp/base2new_train.sh DATASET SEED
# Run it from the folder that holds output/. Environment: DATA [./DATA] (the released file names
#   a folder of the authors' machine); PYTHON [python3]; EXTRA_OPTS: KEY VALUE options added at
#   the end of the train.py call.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DATA=${DATA:-./DATA}
TRAINER=CoCoOp

DATASET=$1
SEED=$2
CFG=vit_b16_c4_ep10_batch1_ctxv1
SHOTS=16

DIR=output/base2new/train_base/${DATASET}/shots_${SHOTS}/${TRAINER}/${CFG}/seed${SEED}
if [ -d "$DIR" ]; then
    echo "Results are available in ${DIR}. Resuming..."
else
    echo "Run this job and save the output to ${DIR}"
fi
# shellcheck disable=SC2086  # EXTRA_OPTS is a list of words
${PYTHON:-python3} "${REPO}/train.py" \
    --root "${DATA}" \
    --seed "${SEED}" \
    --trainer ${TRAINER} \
    --dataset-config-file "${REPO}/configs/datasets/${DATASET}.yaml" \
    --config-file "${REPO}/configs/trainers/${TRAINER}/${CFG}.yaml" \
    --output-dir "${DIR}" \
    DATASET.NUM_SHOTS ${SHOTS} \
    DATASET.SUBSAMPLE_CLASSES base \
    ${EXTRA_OPTS}
