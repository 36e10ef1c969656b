"""Train or evaluate a prompt learner (CoOp's command line).

Examples::

    # CoOp on DTD, base classes, 16 shots, seed 1
    python train.py --root DATA --seed 1 --trainer CoOp \\
        --dataset-config-file configs/datasets/dtd.yaml \\
        --config-file configs/trainers/CoOp/vit_b16_ctxv1.yaml \\
        --output-dir output/base2new/train_base/dtd/shots_16/CoOp/vit_b16_ctxv1/seed1 \\
        DATASET.NUM_SHOTS 16 DATASET.SUBSAMPLE_CLASSES base

    # ... with SAMPLe
    python train.py ... OPTIM.SAM.NAME sample

    # evaluate that model on the new classes
    python train.py --root DATA --seed 1 --trainer CoOp ... --eval-only \\
        --model-dir output/base2new/train_base/dtd/... --load-epoch 200 \\
        DATASET.SUBSAMPLE_CLASSES new

Config merge order (as in CoOp): defaults, trainer keys, --dataset-config-file, --config-file,
--optim-config-file, the flags below, then the trailing KEY VALUE options. Re-running into an
existing output folder resumes from its last checkpoint (the same experiment only: a changed
config is refused; --overwrite starts over, --force-resume continues anyway).
"""

import sys

import datasets  # noqa: F401  (registers the dataset readers)
import trainers  # noqa: F401  (registers the trainers)
from engine.cli import build_parser, main, reset_cfg, run, setup_cfg
from engine.phases import mark_process_start
from engine.runner import finish_process

__all__ = ["build_parser", "main", "reset_cfg", "run", "setup_cfg"]

if __name__ == "__main__":
    mark_process_start()  # the start-up phases (log.txt, cost.json) count from the process start
    sys.exit(finish_process(run()))  # finish_process: exit without the final GC walk
