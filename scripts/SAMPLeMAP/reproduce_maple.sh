#!/bin/bash
# The SAMPLe authors' scripts/SAMPLeMAP/reproduce_maple.sh (MaPLe's script; same arguments and
# output folders): evaluate released base-to-new MaPLe weights (WEIGHTSPATH/base/seed<SEED>,
# epoch 5) on the base and on the new classes of DATASET.
#
# Usage: bash scripts/SAMPLeMAP/reproduce_maple.sh DATASET SEED WEIGHTSPATH
# Run it from the folder that holds output/. Environment: DATA [./DATA]; PYTHON [python3];
#   LOADEP [5] the epoch to load; EXTRA_OPTS: KEY VALUE options added at the end of each call.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DATA=${DATA:-./DATA}
TRAINER=MaPLe

DATASET=$1
SEED=$2
WEIGHTSPATH=$3
CFG=vit_b16_c2_ep5_batch4_2ctx
SHOTS=16
LOADEP=${LOADEP:-5}

COMMON_DIR=${DATASET}/shots_${SHOTS}/${TRAINER}/${CFG}/seed${SEED}
MODEL_DIR=${WEIGHTSPATH}/base/seed${SEED}
echo "Evaluating model"
for SUB in base new; do
    DIR=output/base2new/test_${SUB}/${COMMON_DIR}
    echo "Runing the first phase job and save the output to ${DIR}"
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
done
