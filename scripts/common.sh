# Shared by base2new.sh, cross_dataset.sh, domain_gen.sh and few_shot.sh (sourced, not run).
#
# The scripts turn environment variables into a tools/grid.py command and run it: grid.py prints
# the runs and their folders, fetches the configured CLIP weights once (downloaded into
# ~/.cache/clip on first use; SAMPLE_PL_OFFLINE=1: never; docs/weights.md), checks the data,
# configs and weights, skips finished runs, resumes interrupted ones and then runs train.py. The
# layout is in experiments/protocols.py.
#
# Environment [default]:
#   DATA     dataset root, the folder holding dtd/, imagenet/, ... (required unless --dry-run)
#   TRAINER  [CoOp]    one or more trainers, space-separated (CoOp CoCoOp MaPLe CoPrompt TCP)
#   OPTIM    [sample]  one or more of sgd sam fsam sagm sample (sgd = the trainer's own optimizer)
#   CFG      [the trainer's paper config]  a name in configs/trainers/<TRAINER>/ (one trainer)
#   SEEDS    [1 2 3]   SHOTS [16; few_shot.sh: 1 2 4 8 16]   OUTPUT [output]
#   TAG      []        folder suffix for runs whose extra options change the experiment
#   REPRO    [paper]   reproduction mode, the same default as train.py and the demo: paper (the
#                      method as the paper writes it; CoOp's folders), released (the SAMPLe
#                      authors' released code emulated, judged the likelier to reproduce the
#                      published tables; folders tagged "released") or "paper released";
#                      docs/reproducing.md. Each run's log states its mode
#   PYTHON   [python]
#   REPORT   []        after the runs: print the tables (tools/make_tables.py) and write the HTML
#                      report REPORT/index.html (not with --dry-run; not when a run failed)
# Arguments: [grid.py options such as --dry-run --commands --gpus=auto --quiet] ...
#            [KEY VALUE ...]  config options for every train.py run (e.g. MODEL.BACKBONE.PATH f)

set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# split_args "$@": leading --options -> GRID_FLAGS, the rest -> REST
split_args() {
  GRID_FLAGS=()
  while [[ $# -gt 0 && "$1" == --* ]]; do
    GRID_FLAGS+=("$1")
    shift
  done
  REST=("$@")
}

# run_grid GRID_ARGS...: run tools/grid.py with the environment's settings, GRID_ARGS, the
# leading options and the KEY VALUE options in OPTS; then, with REPORT set, the tables and report
run_grid() {
  local axes=()
  # shellcheck disable=SC2206  # TRAINER/OPTIM/SEEDS are space-separated lists
  axes+=(--trainers ${TRAINER:-CoOp} --optims ${OPTIM:-sample} --seeds ${SEEDS:-1 2 3})
  # shellcheck disable=SC2206  # SHOTS: one value, or several for few_shot.sh
  axes+=(--shots ${SHOTS:-16} --output "${OUTPUT:-output}")
  if [[ -n "${CFG:-}" ]]; then axes+=(--cfg "$CFG"); fi
  if [[ -n "${TAG:-}" ]]; then axes+=(--tag "$TAG"); fi
  # shellcheck disable=SC2206  # REPRO may name both modes
  axes+=(--repro ${REPRO:-paper})
  local cmd=("${PYTHON:-python}" "$REPO/tools/grid.py" "${axes[@]}" --data "${DATA:-}")
  cmd+=("$@" ${GRID_FLAGS[@]+"${GRID_FLAGS[@]}"})
  if [[ ${#OPTS[@]} -gt 0 ]]; then cmd+=(-- "${OPTS[@]}"); fi
  echo "+ ${cmd[*]}"
  if [[ -z "${REPORT:-}" || " ${GRID_FLAGS[*]-} " == *" --dry-run "* ]]; then
    exec "${cmd[@]}"
  fi
  "${cmd[@]}"
  local tables=("${PYTHON:-python}" "$REPO/tools/make_tables.py" "${axes[@]}" "$@")
  tables+=(--report "$REPORT")
  echo "+ ${tables[*]}"
  exec "${tables[@]}"
}

# run_per_dataset PROTOCOL "$@": the per-dataset scripts' command line (leading grid options,
# DATASET - a name, 'all' or folder:NAME - then KEY VALUE options) run as one grid of PROTOCOL
run_per_dataset() {
  local protocol="$1" script
  script="scripts/$(basename "${BASH_SOURCE[1]}")"
  shift
  split_args "$@"
  if [[ ${#REST[@]} -eq 0 || ("${REST[0]}" == *.* && "${REST[0]}" != folder:* \
        && "${REST[0]}" != *.yaml) ]]; then
    echo "Usage: bash $script [grid.py options] DATASET [KEY VALUE ...]" >&2
    echo "  DATASET: a name in configs/datasets/ (e.g. dtd), 'all', or folder:NAME (DATA/NAME)" >&2
    exit 2
  fi
  local dataset="${REST[0]}"
  OPTS=("${REST[@]:1}")
  if [[ "$dataset" == all ]]; then
    run_grid --protocols "$protocol"
  else
    run_grid --protocols "$protocol" --datasets "$dataset"
  fi
}
