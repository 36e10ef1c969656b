#!/bin/bash
# The SAMPLe authors' scripts/SAMPLeMAP/reproduce_maple_xd.sh (MaPLe's script; same arguments
# and output folder): evaluate released cross-dataset MaPLe weights (WEIGHTSPATH/seed<SEED>,
# epoch 2) on all classes of DATASET; a finished evaluation folder is skipped.
#
# Usage: bash scripts/SAMPLeMAP/reproduce_maple_xd.sh DATASET SEED WEIGHTSPATH
# Run it from the folder that holds output/. Environment: DATA [./DATA]; PYTHON [python3];
#   LOADEP [2] the epoch to load; EXTRA_OPTS: KEY VALUE options added at the end of the call.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DATA=${DATA:-./DATA}
TRAINER=MaPLe

DATASET=$1
SEED=$2
WEIGHTSPATH=$3
CFG=vit_b16_c2_ep5_batch4_2ctx_cross_datasets
SHOTS=16
LOADEP=${LOADEP:-2}

MODEL_DIR=${WEIGHTSPATH}/seed${SEED}
DIR=output/evaluation/${TRAINER}/${CFG}_${SHOTS}shots/${DATASET}/seed${SEED}
if [ -d "$DIR" ]; then
    echo "Results are already available in ${DIR}. Skipping..."
    exit 0
fi
echo "Evaluating model"
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
    ${EXTRA_OPTS}
