"""Fake run folders with logs in the CoOp code base's format (no train.py runs).

Shared by tests/test_results.py and tests/test_report.py.
"""

from __future__ import annotations

import os
import os.path as osp

from experiments.paper_results import paper_value
from experiments.protocols import Setup, base2new_dirs, cfg_component

ARGS = "***************\n** Arguments **\n***************\nbackbone: \neval_only: {}\nseed: 1\n"
RESULT = "=> result\n* total: 1,692\n* correct: 1,100\n* accuracy: {}%\n* error: 35.0%\n"


def train_log(acc=None, end="Finish training", val_acc=None) -> str:
    """A training log; ``val_acc`` adds a mid-training evaluation block before the end."""
    text = ARGS.format(False) + "epoch [1/2] batch [5/5] loss 1.2 acc 50.0 lr 2e-3\n"
    if val_acc is not None:
        text += "Evaluate on the *val* set\n" + RESULT.format(val_acc)
    if acc is not None:
        text += f"Checkpoint saved to x/prompt_learner/model.pth.tar-2\n{end}\n"
        text += "Evaluate on the *test* set\n" + RESULT.format(acc) + "Elapsed: 0:00:03\n"
    return text


def eval_log(acc=None) -> str:
    """An ``--eval-only`` log (no result when ``acc`` is None)."""
    text = ARGS.format(True) + "Loading weights to prompt_learner from x (epoch = 2)\n"
    return text + (RESULT.format(acc) if acc is not None else "Evaluate on the *test* set\n")


def write_run(run_dir: str, text: str, name: str = "log.txt") -> None:
    os.makedirs(run_dir, exist_ok=True)
    with open(osp.join(run_dir, name), "w") as f:
        f.write(text)


def fake_base2new(setup: Setup, trainer, optim, dataset, seeds, skip=(), accuracy=None) -> None:
    """Base-to-new run folders of one trainer x optimizer x dataset.

    Args:
        setup: the layout (output folder, shots, configs).
        seeds: the run seeds; by default seed ``i`` gets the paper's number plus
            ``(i - (len(seeds) - 1) / 2) * 0.3`` (spread by 0.3, the paper's number is the mean).
        skip: ``(dataset, seed, "base" | "new")`` leaves that run out; ``(dataset, seed,
            "fail")`` writes a training log without a result.
        accuracy: ``accuracy(metric, seed) -> float`` replaces the default values.
    """
    comp = cfg_component(setup.cfg_for("base2new", trainer, dataset), optim)
    for i, seed in enumerate(seeds):
        train, test = base2new_dirs(setup, dataset, trainer, comp, seed)
        delta = (i - (len(seeds) - 1) / 2) * 0.3

        def acc(metric, seed=seed, delta=delta):
            if accuracy is not None:
                return accuracy(metric, seed)
            return paper_value("base2new", trainer, optim, dataset, metric) + delta

        if (dataset, seed, "base") not in skip:
            write_run(train, train_log(acc("base")) if (dataset, seed, "fail") not in skip else "x")
        if (dataset, seed, "new") not in skip:
            write_run(test, eval_log(acc("new")))
