#!/bin/bash
# The SAMPLe authors' scripts/SAMPLeMAP/base2new_test_maple.sh (same arguments and output folder):
# evaluate the model of base2new_train.sh (--trainer MaPLe, epoch 5) on the new classes.
#
# Usage: bash scripts/SAMPLeMAP/base2new_test_maple.sh DATASET SEED
# Run it from the folder that holds output/. Environment: DATA [./DATA]; PYTHON [python3];
#   LOADEP [5] the epoch to load; EXTRA_OPTS: KEY VALUE options added at the end of the call.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DATA=${DATA:-./DATA}
TRAINER=MaPLe

DATASET=$1
SEED=$2
CFG=vit_b16_c2_ep5_batch4_2ctx
SHOTS=16
LOADEP=${LOADEP:-5}
SUB=new

COMMON_DIR=${DATASET}/shots_${SHOTS}/${TRAINER}/${CFG}/seed${SEED}
MODEL_DIR=output/base2new/train_base/${COMMON_DIR}
DIR=output/base2new/test_${SUB}/${COMMON_DIR}
echo "Evaluating model"
if [ -d "$DIR" ]; then
    echo "Results are available in ${DIR}. Resuming..."
else
    echo "Runing the first phase job and save the output to ${DIR}"
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
    DATASET.NUM_SHOTS ${SHOTS} \
    DATASET.SUBSAMPLE_CLASSES ${SUB} \
    ${EXTRA_OPTS}
