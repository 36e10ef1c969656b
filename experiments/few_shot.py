"""The few-shot protocol (``few_shot``): CoOp's setting as a grid protocol.

One training run per dataset x shots x seed on ALL the classes of the dataset
(``DATASET.SUBSAMPLE_CLASSES all``, ``DATASET.NUM_SHOTS`` = the shots); the test at the end of
training, on the dataset's full test set, is the result (no separate evaluation run). Shots
default to CoOp's 1, 2, 4, 8, 16 (:data:`FEW_SHOTS`), seeds to 1, 2, 3.

Folders, as CoOp's and PromptSRC's few-shot scripts write them (their parsers read them;
``{cfg}`` with the optimizer and tag as in ``experiments/protocols.py``)::

    OUTPUT/{dataset}/{trainer}/{cfg}[+{optim}]_{S}shots/seed{n}

On ImageNet this is the transfer protocols' training folder: with the same config the 16-shot
run IS that training run (the same experiment), so the two protocols share it (one run).

The config of a run (:meth:`experiments.protocols.Setup.cfg_for`), first found of the trainer's
``PROTOCOL_CFGS``: ``few_shot/<dataset>``, ``few_shot/<S>shots``, ``few_shot``; else its base-to-new
config (``base2new/<dataset>``, ``base2new``) unchanged. ``--cfg`` overrides them all. The
per-dataset overlays of ``experiments/protocols.py`` apply (e.g. ProGrad's LAMBDA 0.8 on DTD,
EuroSAT and Flowers102 at 8 and 16 shots). A trainer's ``PROTOCOL_OPTS["few_shot"]`` (KEY VALUE
options) go to every few-shot run of it, before the user's options (MMRL: ``TASK FS``, as its
few_shot.sh passes). The schedules each trainer gets, and where they come from: docs/running.md.
"""

from __future__ import annotations

import os.path as osp
from dataclasses import replace

from experiments.protocols import (
    Chain,
    ProtocolError,
    Run,
    Setup,
    cfg_component,
    dataset_dir,
    run_tag,
    trainer_cfgs,
    training_run,
)

FEW_SHOTS = (1, 2, 4, 8, 16)  # CoOp's few-shot curve
# first folder components of the other protocols (OUTPUT/base2new/..., OUTPUT/evaluation/...):
# a dataset of that name would put its few-shot runs among theirs
RESERVED = ("base2new", "evaluation")


def check_shots(shots) -> tuple[int, ...]:
    """The shots of a few-shot grid: integers >= 1, in the given order without repeats.

    Raises:
        ProtocolError: a value below 1 (``DATASET.NUM_SHOTS`` <= 0 trains on every image).
    """
    shots = tuple(dict.fromkeys(int(s) for s in shots))
    bad = [s for s in shots if s < 1]
    if bad or not shots:
        raise ProtocolError(
            f"--shots {' '.join(map(str, bad))}: few-shot runs need at least 1 shot per class "
            "(DATASET.NUM_SHOTS <= 0 trains on all the images: use --protocols base2new or "
            "train.py for that)"
        )
    return shots


def shots_metric(shots: int) -> str:
    """The metric name of a few-shot table cell: ``4shots`` (CoOp's folder spelling)."""
    return f"{shots}shots"


def shots_title(shots: int) -> str:
    """A few-shot table's column title: ``1 shot``, ``4 shots``."""
    return f"{shots} shot" + ("s" if shots != 1 else "")


def trainer_protocol_opts(trainer: str, protocol: str, plugins: tuple[str, ...] = ()) -> tuple:
    """The KEY VALUE options the trainer declares for ``protocol`` (its class's own
    ``PROTOCOL_OPTS``; empty for an unknown trainer or one that declares none)."""
    from engine.registry import TRAINER_REGISTRY

    trainer_cfgs(trainer, plugins)  # registers the project's trainers and the plugins
    if trainer not in TRAINER_REGISTRY:
        return ()
    declared = vars(TRAINER_REGISTRY.get(trainer)).get("PROTOCOL_OPTS") or {}
    opts = tuple(map(str, declared.get(protocol, ())))
    if len(opts) % 2:
        raise ProtocolError(f"{trainer}.PROTOCOL_OPTS[{protocol!r}]: KEY VALUE pairs, got {opts}")
    return opts


def few_shot_dir(setup: Setup, dataset: str, trainer: str, comp: str, shots: int, seed: int):
    """``OUTPUT/{dataset}/{trainer}/{comp}_{shots}shots/seed{seed}``."""
    name = dataset_dir(dataset)
    if name in RESERVED:
        raise ProtocolError(
            f"Dataset {dataset!r}: its few-shot runs would go to {setup.output}/{name}/, the "
            "folder of another protocol's runs; rename the dataset (its folder or config file)"
        )
    return osp.join(setup.output, name, trainer, f"{comp}_{shots}shots", f"seed{seed}")


def few_shot_chain(
    setup: Setup,
    trainer: str,
    optim: str,
    dataset: str,
    seed: int,
    shots: int,
    variant: tuple[str, ...] = (),
) -> Chain:
    """Train on all the classes of ``dataset`` with ``shots`` shots per class; the training
    run's final test is the result (a chain without evaluations).

    ``variant``: KEY VALUE options of a sweep point (named in the folder tag).
    """
    (shots,) = check_shots([shots])
    cfg = setup.cfg_for("few_shot", trainer, dataset, shots)
    comp = cfg_component(cfg, optim, run_tag(setup.tag, variant, setup.repro))
    opts = ("DATASET.NUM_SHOTS", str(shots), "DATASET.SUBSAMPLE_CLASSES", "all")
    opts += trainer_protocol_opts(trainer, "few_shot", setup.plugins)
    out = few_shot_dir(setup, dataset, trainer, comp, shots, seed)
    train = training_run(
        setup, "few_shot", trainer, cfg, optim, dataset, seed, out, opts, variant, shots=shots
    )
    return Chain(train)


def _training(run: Run) -> tuple:
    """What defines a training run's experiment in the grid: its files and its options, with
    the default ``DATASET.SUBSAMPLE_CLASSES all`` left out."""
    opts = list(run.protocol_opts)
    pairs = [tuple(opts[i : i + 2]) for i in range(0, len(opts), 2)]
    pairs = [p for p in pairs if p != ("DATASET.SUBSAMPLE_CLASSES", "all")]
    return (run.config_files, run.optim_file, tuple(sorted(pairs)), run.repro)


def merge_training(have: Chain, chain: Chain) -> None:
    """``chain``'s training run shares ``have``'s folder (ImageNet's few-shot run and the
    transfer protocols' training): keep one training run, the few-shot one (so the tables read
    its result for both), and every evaluation.

    Raises:
        ProtocolError: the two trainings differ (a trainer's few-shot options, a --cfg): they
            would need two folders.
    """
    a, b = have.train, chain.train
    if a.protocol == b.protocol or "few_shot" not in (a.protocol, b.protocol):
        return
    if _training(a) != _training(b):
        raise ProtocolError(
            f"{a.out_dir}: the {a.protocol} and {b.protocol} protocols would train different "
            f"experiments in this one folder ({' '.join(a.protocol_opts)} | "
            f"{' '.join(b.protocol_opts)}); run them in two grids with different --output or --tag"
        )
    if b.protocol == "few_shot":
        have.train = replace(b)


__all__ = [
    "FEW_SHOTS",
    "check_shots",
    "few_shot_chain",
    "few_shot_dir",
    "merge_training",
    "shots_metric",
    "shots_title",
    "trainer_protocol_opts",
]
