#!/bin/bash
# The GPU measurements of issues 12 and 22 as one prepared script for a lent device (about 12
# minutes on an H100/H200; every part has its own time limit, so a slow part cannot starve the
# others).
#
# Prepare on the CPU machine (the device has torch but not these packages):
#   pip download --no-deps -d wheels open-clip-torch==3.3.0 yacs==0.1.8 ftfy wcwidth tabulate
# then run through the device tool:  bash tools/gpu_check.sh   (carry: wheels)
#
# Writes to $OUT (default /tmp/gpu_check):
#   steps.json/.log  tools/benchmark.py --device cuda: CoOp, CoCoOp, MaPLe x {SGD, SAMPLe} at
#                    their published batch sizes: compiled default, eager, reference style;
#                    compilation seconds; evaluation; loader images/s vs the step's demand
#   runs.json/.log   tools/benchmark.py --runs --device cuda: fixed cost per run (process and
#                    in-process), runs/hour with 1, 2, 4, 8 workers, the paper-grid GPU-hours
#   memory.json/.log tools/benchmark.py --memory --device cuda (issue 23): peak memory of a
#                    training step of CoOp, KgCoOp, MaPLe, PromptSRC at 100 and 1,000 classes,
#                    plain and with MODEL.TEXT_CHUNK / MODEL.CHECKPOINT_TEXT (random ViT-B/16,
#                    the configs' fp16); at most 4 minutes (MEMORY_LIMIT)
#   efficient.json/.log  tools/benchmark.py --efficient --device cuda: the step of LookSAM,
#                    SAMPLe-k5, ESAM, RWP, m-RWP, SAF, MESA (and SAM, SAMPLe) relative to SGD for
#                    CoOp, CoCoOp, MaPLe, eager (EFFICIENT_LIMIT s, default 150)
#   whole.json/.log, loader.json/.log  (issue 30, part "whole", about 5 minutes) a 1-epoch CoOp
#                    run as a fresh train.py process with empty caches (compilation cold), again
#                    (warm), and as the second run of a packed worker, MODEL.COMPILE
#                    reduce-overhead and INPUT.PIPELINE tensor_device (tools/benchmark.py --runs
#                    --run-opts); the loader pipelines with their device share on the GPU
#                    (tools/benchmark.py --loader --device cuda); the step's demand is in steps.log
#   nvidia-smi.txt
# GPU_CHECK_PARTS picks parts (default "steps runs memory efficient", up to 16 minutes: more than
# one device call allows, so give a call one or two parts, e.g. GPU_CHECK_PARTS=memory; "whole"
# is not in the default: GPU_CHECK_PARTS=whole).
# GPU_CHECK_SMALL=1 runs the same sequence on CPU with --small and tiny runs (a smoke test).
set -u
OUT=${OUT:-/tmp/gpu_check}
PY=${PY:-python3}
mkdir -p "$OUT"
if compgen -G "wheels/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps wheels/*.whl || exit 1
fi
PARTS=" ${GPU_CHECK_PARTS:-steps runs memory efficient} "
if [[ ${GPU_CHECK_SMALL:-0} == 1 ]]; then
  STEPS=(--small --device cpu --steps 1 --warmup 0 --compile aot_eager)
  EFF=(--small --device cpu --steps 1 --warmup 0)
  RUNS=(--device cpu --run-epochs 1 --run-repeats 1 --run-workers 1 --packed-runs 2)
  MEMORY=(--small --device cpu --memory-classes 20,40 --memory-chunk 10)
  WHOLE=(--device cpu --run-workers 1 --packed-runs 2 --run-opts MODEL.COMPILE aot_eager)
  LOADER=(--small --device cpu --steps 1)
else
  STEPS=(--device cuda)
  EFF=(--device cuda --steps 5 --warmup 1 --compile off)
  RUNS=(--device cuda --run-workers 1,2,4,8)
  MEMORY=(--device cuda --memory-chunk 100)
  WHOLE=(--device cuda --run-workers 1 --packed-runs 2 --run-opts MODEL.COMPILE reduce-overhead)
  LOADER=(--device cuda)
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
fi
if [[ $PARTS == *" memory "* ]]; then
  timeout "${MEMORY_LIMIT:-240}" $PY tools/benchmark.py --memory "${MEMORY[@]}" \
    --trainers CoOp,KgCoOp,MaPLe,PromptSRC --json "$OUT/memory.json" > "$OUT/memory.log" 2>&1
  echo "memory: exit $?"
  tail -n 30 "$OUT/memory.log"
fi
if [[ $PARTS == *" steps "* ]]; then
timeout "${STEPS_LIMIT:-360}" $PY tools/benchmark.py "${STEPS[@]}" --trainers CoOp,CoCoOp,MaPLe \
  --optims sgd,sample --json "$OUT/steps.json" > "$OUT/steps.log" 2>&1
echo "steps: exit $?"
fi
if [[ $PARTS == *" runs "* ]]; then
# the grid estimate from the CoOp SGD and SAMPLe steps just measured (else the released anchors)
STEP_MS=$($PY - "$OUT/steps.json" <<'EOF'
import json, sys
try:
    rows = {r["optimizer"]: r["step_ms"] for r in json.load(open(sys.argv[1]))["rows"]
            if r["trainer"] == "CoOp"}
    print(f"{rows['sgd']:.2f},{rows['sample']:.2f}")
except (OSError, KeyError, ValueError):
    pass
EOF
)
timeout "${RUNS_LIMIT:-200}" $PY tools/benchmark.py --runs "${RUNS[@]}" ${STEP_MS:+--step-ms $STEP_MS} \
  --json "$OUT/runs.json" > "$OUT/runs.log" 2>&1
echo "runs: exit $?"
tail -n 30 "$OUT/steps.log" "$OUT/runs.log"
fi
if [[ $PARTS == *" whole "* ]]; then
  timeout "${WHOLE_LIMIT:-240}" $PY tools/benchmark.py --runs "${WHOLE[@]}" \
    INPUT.PIPELINE tensor_device --run-epochs 1 --run-repeats 2 \
    --json "$OUT/whole.json" > "$OUT/whole.log" 2>&1
  echo "whole: exit $?"
  timeout "${LOADER_LIMIT:-90}" $PY tools/benchmark.py --loader "${LOADER[@]}" \
    --json "$OUT/loader.json" > "$OUT/loader.log" 2>&1
  echo "loader: exit $?"
  tail -n 14 "$OUT/whole.log"
  tail -n 26 "$OUT/loader.log"
fi
if [[ $PARTS == *" efficient "* ]]; then
  timeout "${EFFICIENT_LIMIT:-150}" $PY tools/benchmark.py --efficient "${EFF[@]}" \
    --efficient-trainers CoOp,CoCoOp,MaPLe --json "$OUT/efficient.json" > "$OUT/efficient.log" 2>&1
  echo "efficient: exit $?"
  tail -n 35 "$OUT/efficient.log"
fi
