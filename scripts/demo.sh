#!/usr/bin/env bash
# The main demo: base-to-new generalization on the built-in SmallWorld, end to end, offline, on
# CPU, with the small CLIP shipped in assets/ (7 minutes on a shared 2-core machine).
#
#   1. generate the SmallWorld dataset (datasets/small_world.py) into $DEMO_OUTPUT/data;
#   2. zero-shot CLIP ("a photo of a {}.") on the base and on the new classes;
#   3. CoOp trained on the 32 base classes with SGD, SAM, SAGM and SAMPLe (the paper's CoOp
#      optimizer configs, configs/optim/CoOp/) and tested on the 32 new classes, through
#      tools/grid.py (the protocol of scripts/base2new.sh: same folders, same train.py runs);
#   4. the Base / New / HM table with the zero-shot row (tools/make_tables.py --zeroshot), also
#      written to $DEMO_OUTPUT/table.txt; ± is the population standard deviation over seeds;
#   5. plots of the first seed's runs in $DEMO_OUTPUT/plots: the training-loss landscape around
#      the learned prompts (tools/loss_landscape.py, the paper's Figure 1) and the per-step
#      gradient-alignment diagnostics by stage (tools/plot_alignment.py, Figure 2).
#
# Usage: bash scripts/demo.sh
# Environment [default]:
#   DEMO_OUTPUT  [output/demo]            everything goes here; finished runs are skipped
#   DEMO_SEEDS   [1 2 3]                  run seeds (few-shot draw, prompt init is fixed)
#   DEMO_EPOCHS  [the config's, 20]       CoOp epochs (a value other than the config's makes
#                                         its own folders, tag "ep<N>")
#   DEMO_SHOTS   [16]                     training images per base class
#   DEMO_OPTIMS  [sgd sam sagm sample]    optimizers (sgd = CoOp's own SGD)
#   DEMO_REPRO   [paper]                  reproduction mode (docs/reproducing.md):
#                                         paper, or released (the SAMPLe authors' released code
#                                         emulated: its own folders, tag "released", and plots
#                                         in $DEMO_OUTPUT/plots-released). The table shows every
#                                         mode that has runs in $DEMO_OUTPUT, one row per mode
#   DEMO_FAST=1  a smoke test in about a minute: seed 1, 1 epoch, 2 shots, a tiny world, output
#                in output/demo_fast (the numbers mean nothing)
#   PYTHON       [python]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="${PYTHON:-python}"
CFG=small_world
WORLD_ARGS=()
if [[ "${DEMO_FAST:-0}" == 1 ]]; then
  OUT="${DEMO_OUTPUT:-output/demo_fast}"
  SEEDS="${DEMO_SEEDS:-1}"
  EPOCHS="${DEMO_EPOCHS:-1}"
  SHOTS="${DEMO_SHOTS:-2}"
  WORLD_ARGS=(--train 2 --val 1 --test 4)
else
  OUT="${DEMO_OUTPUT:-output/demo}"
  SEEDS="${DEMO_SEEDS:-1 2 3}"
  EPOCHS="${DEMO_EPOCHS:-}"
  SHOTS="${DEMO_SHOTS:-16}"
fi
OPTIMS="${DEMO_OPTIMS:-sgd sam sagm sample}"
REPRO="${DEMO_REPRO:-paper}"
PLOTS="$OUT/plots"
if [[ "$REPRO" != paper ]]; then PLOTS="$OUT/plots-$REPRO"; fi
DATA="$OUT/data"
# Tiny models: one thread per process is the fastest, and far faster than two on a busy CPU.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# The frozen image encoder's test features are cached here and shared by all runs.
export SAMPLE_PL_CACHE="$OUT/cache"

# grid selection shared by tools/grid.py and tools/make_tables.py
# shellcheck disable=SC2206  # SEEDS and OPTIMS are space-separated lists
GRID=(--trainers CoOp --optims $OPTIMS --datasets small_world --seeds $SEEDS --cfg "$CFG"
  --shots "$SHOTS" --output "$OUT")
MODES=(--repro paper released)  # the tables: every mode with runs, one row per mode
OPTS=()
if [[ -n "$EPOCHS" ]]; then
  GRID+=(--tag "ep$EPOCHS")
  OPTS=(-- OPTIM.MAX_EPOCH "$EPOCHS")
fi
T0=$SECONDS
step() { echo; echo "== [$((SECONDS - T0)) s] $*"; }

step "1/5 SmallWorld dataset in $DATA"
"$PY" tools/make_small_world.py --root "$DATA" ${WORLD_ARGS[@]+"${WORLD_ARGS[@]}"}

step "2/5 zero-shot CLIP on the base and new classes"
for half in base new; do
  run_dir="$OUT/zeroshot/$half/seed1"
  if grep -qs "=> result" "$run_dir/log.txt"; then
    echo "$half: done (kept)"
    continue
  fi
  "$PY" train.py --root "$DATA" --seed 1 --trainer ZeroshotCLIP \
    --dataset-config-file configs/datasets/small_world.yaml \
    --config-file "configs/trainers/CoOp/$CFG.yaml" --output-dir "$run_dir" --eval-only \
    DATASET.SUBSAMPLE_CLASSES "$half" > /dev/null
  echo "$half: $(grep -o '\* accuracy: .*' "$run_dir/log.txt" | tail -n 1)"
done

step "3/5 CoOp on the base classes, tested on the new classes (optimizers: $OPTIMS; seeds: $SEEDS;" \
  "mode: $REPRO)"
"$PY" tools/grid.py "${GRID[@]}" --repro "$REPRO" --data "$DATA" --quiet --no-data-check \
  ${OPTS[@]+"${OPTS[@]}"}

step "4/5 Base / New / HM (test accuracy %, mean over seeds $SEEDS)"
"$PY" tools/make_tables.py "${GRID[@]}" "${MODES[@]}" --std --zeroshot "$OUT/zeroshot" \
  | tee "$OUT/table.txt"

step "5/5 plots: loss landscape and gradient alignment (seed ${SEEDS%% *}) in $PLOTS"
# the train_base run folders of the first seed, one per optimizer (the layout of experiments/protocols.py)
# shellcheck disable=SC2086  # OPTIMS is a space-separated list
mapfile -t RUNS < <("$PY" - "$OUT" "$SHOTS" "${SEEDS%% *}" "$EPOCHS" "$CFG" "$REPRO" $OPTIMS <<'PYEOF'
import sys

from experiments.protocols import Setup, base2new_chain

out, shots, seed, epochs, cfg, repro, *optims = sys.argv[1:]
tag = f"ep{epochs}" if epochs else ""
setup = Setup(output=out, shots=int(shots), tag=tag, cfgs=(("CoOp", cfg),), repro=repro)
for optim in optims:
    print(base2new_chain(setup, "CoOp", optim, "small_world", int(seed)).train.out_dir)
PYEOF
)
"$PY" tools/loss_landscape.py "${RUNS[@]}" --out-dir "$PLOTS/landscape" --root "$DATA" \
  --points 15 --points-2d 9 --batches 2
"$PY" tools/plot_alignment.py "${RUNS[@]}" --out "$PLOTS/alignment.png"
"$PY" tools/make_tables.py "${GRID[@]}" "${MODES[@]}" --std --zeroshot "$OUT/zeroshot" \
  --report "$OUT/report" | tail -n 1

echo
echo "Done in $((SECONDS - T0)) s. Runs, logs and checkpoints: $OUT/base2new, $OUT/zeroshot;" \
  "table: $OUT/table.txt; plots: $PLOTS"
