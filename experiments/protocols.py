"""The paper's protocols as runs: output folders, train.py commands, status and pre-flight checks.

One place defines the output layout, shared by ``scripts/*.sh`` (through ``tools/grid.py``),
``tools/grid.py`` and ``tools/make_tables.py``. CoOp's layout, with the optimizer in the config
component (``{cfg}`` -> ``{cfg}+{optim}``; plain ``sgd`` runs keep CoOp's exact folders)::

    base2new:   OUTPUT/base2new/train_base/{dataset}/shots_{S}/{trainer}/{cfg}[+{optim}]/seed{n}
                OUTPUT/base2new/test_new/{dataset}/shots_{S}/{trainer}/{cfg}[+{optim}]/seed{n}
    transfer:   OUTPUT/imagenet/{trainer}/{cfg}[+{optim}]_{S}shots/seed{n}          (training)
                OUTPUT/evaluation/{trainer}/{cfg}[+{optim}]_{S}shots/{target}/seed{n}
    few_shot:   OUTPUT/{dataset}/{trainer}/{cfg}[+{optim}]_{S}shots/seed{n}        (training)

Cross-dataset (10 targets) and domain generalization (4 ImageNet variants) evaluate the same
ImageNet training runs. A ``tag`` (for runs whose extra options change the experiment, e.g. a
rho sweep) makes the component ``{cfg}+{optim}-{tag}``. Config names must not contain ``+``.
The reproduction mode (``Setup.repro``, docs/reproducing.md): ``paper`` runs keep the
folders above; ``released`` runs (``train.py --repro released``) carry the tag ``released``
first (``{cfg}+{optim}-released``, sgd runs too: ``{cfg}+sgd-released``), so the two modes
never share a folder or a table cell.

Few-shot (``few_shot``, ``experiments/few_shot.py``): CoOp's setting, one training run per
dataset x shots x seed on all the classes, whose test at the end (the full test set) is the result;
the folders of CoOp's and PromptSRC's few-shot scripts. ImageNet's 16-shot run is the transfer
protocols' training run when both use the same config (the same experiment, one folder).

A chain's ``variant`` (KEY VALUE options of one point of a sweep, see ``tools/grid.py``) is
passed to all its runs and named in the tag (:func:`options_tag`: ``OPTIM.SAM.RHO 0.1`` ->
``rho0.1``; after the ``--tag``, if any: ``{tag}_rho0.1``), so sweep points never share a folder.

A dataset is a config stem of ``configs/datasets/``; or ``folder:<name>``, the folder dataset
``DATA/<name>`` (``DATASET.NAME Folder``, ``datasets/folder.py``): its runs use
``configs/datasets/folder.yaml`` with ``DATASET.FOLDER <name>``; or the path of a dataset config
file of one's own, ``path/<stem>.yaml`` (e.g. naming a plugin's reader). ``<name>`` / ``<stem>``
is its ``{dataset}`` / ``{target}`` in the folders above.

Every training run gets ``DATALOADER.TRAIN_X.DROP_LAST True`` (:data:`TRAIN_OPTS`: Dassl's
loader, as in the code bases that produced the published numbers).

Config files of a run: ``configs/trainers/{trainer}/{cfg}.yaml``, then the per-dataset
overlays that exist, in this order: ``configs/trainers/{trainer}/per_dataset/{dataset}.yaml``
(for every config of the trainer) and ``configs/trainers/{trainer}/{cfg}_{dataset}.yaml`` (for
that config only); dataset = config stem of the TRAINING data (evaluation runs reuse their
training run's files, so a model is always rebuilt as it was trained); then
``--optim-config-file``: ``configs/optim/{trainer}/{optim}.yaml``, else
``configs/optim/{optim}.yaml``. Default configs per trainer are declared beside the trainer
(``PROTOCOL_CFGS``: ``base2new``, ``base2new/<dataset>``, ``transfer``, ``few_shot``,
``few_shot/<N>shots``, ``few_shot/<dataset>``); the transfer protocols train with the trainer's
ImageNet config unless its ``transfer`` entry names another.
"""

from __future__ import annotations

import glob
import os
import os.path as osp
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field, replace

from experiments.paper_results import DATASET_TITLES, TARGETS_BY_TABLE
from experiments.results import read_run

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
CHECK_DATA_TOOL = osp.join(REPO, "tools", "check_data.py")  # the datasets' checker
PROTOCOLS = ("base2new", "cross_dataset", "domain_gen", "few_shot")
TARGETS = TARGETS_BY_TABLE
SOURCE_DATASET = "imagenet"

# Default trainer configs (configs/trainers/<trainer>/<cfg>.yaml; override with --cfg / CFG=)
# are declared beside each trainer (its class's PROTOCOL_CFGS, engine.trainer.TrainerBase):
# a new trainer, in trainers/ or a plugin, joins every protocol without an edit here.


def trainer_cfgs(trainer: str, plugins: tuple[str, ...] = ()) -> dict[str, str]:
    """The protocol defaults the trainer ``trainer`` declares (its registered class's own
    ``PROTOCOL_CFGS``; empty for an unknown trainer or one that declares none)."""
    import trainers  # noqa: F401  (registers the project's trainers, as train.py does)
    from engine.plugins import load_plugins
    from engine.registry import TRAINER_REGISTRY

    if trainer not in TRAINER_REGISTRY:  # a plugin's trainer: its files are loaded only then
        load_plugins(plugins)
    if trainer not in TRAINER_REGISTRY:
        return {}
    return dict(vars(TRAINER_REGISTRY.get(trainer)).get("PROTOCOL_CFGS") or {})


# Options of every training run of the grid: Dassl's drop_last (the original code bases').
# No config needs per-optimizer options any more: the staged SAMPLe configs of MaPLe/CoPrompt
# add their stage 2 after the published schedule (OPTIM.SAM.STAGE2_EPOCHS), so MaPLe's 2-epoch
# cross-dataset config trains its projections for a full-LR epoch before they are frozen.
TRAIN_OPTS = ("DATALOADER.TRAIN_X.DROP_LAST", "True")
REPRO_MODES = ("paper", "released")  # engine/repro.py; "paper" is the default
FOLDER_PREFIX = "folder:"  # a folder dataset: folder:<name> (datasets/folder.py: PREFIX)
FOLDER_CONFIG = "folder"  # its dataset config stem (configs/datasets/folder.yaml)


class ProtocolError(ValueError):
    """A run cannot be set up (unknown config, optimizer, dataset or layout clash)."""


@dataclass(frozen=True)
class Setup:
    """What every run of an invocation shares.

    Attributes:
        data: dataset root (``--root``).
        output: output root; the layout above lives under it.
        shots: few-shot training samples per class.
        tag: optional suffix of the optimizer component (see the module docstring).
        opts: KEY VALUE options appended to every train.py command.
        cfgs: ``{trainer: cfg}`` overriding the default configs.
        python: the interpreter that runs train.py.
        repro: reproduction mode, ``paper`` (default) or ``released`` (folder tag, --repro).
        plugins: ``--plugin`` modules or .py files given to every train.py command (a user's
            own trainers, readers or optimizers; engine/plugins.py).
    """

    data: str = ""
    output: str = "output"
    shots: int = 16
    tag: str = ""
    opts: tuple[str, ...] = ()
    cfgs: tuple[tuple[str, str], ...] = ()
    python: str = field(default_factory=lambda: sys.executable)
    repro: str = "paper"
    plugins: tuple[str, ...] = ()

    def __post_init__(self):
        if self.repro not in REPRO_MODES:
            raise ProtocolError(f"Reproduction mode {self.repro!r}: one of {REPRO_MODES}")

    def cfg_for(self, protocol: str, trainer: str, dataset: str, shots: int | None = None) -> str:
        """The trainer config of a training run (``few_shot``: of ``shots`` shots per class, its
        order in ``experiments/few_shot.py``)."""
        override = dict(self.cfgs).get(trainer)
        if override:
            return override
        declared = trainer_cfgs(trainer, self.plugins)
        if protocol == "few_shot":
            for key in (f"few_shot/{dataset}", f"few_shot/{shots}shots", "few_shot"):
                if declared.get(key):
                    return declared[key]
        elif protocol != "base2new":
            dataset = SOURCE_DATASET
            cfg = declared.get("transfer")
            if cfg:
                return cfg
        cfg = declared.get(f"base2new/{dataset}") or declared.get("base2new")
        if cfg is None:
            raise ProtocolError(
                f"No default config for trainer {trainer!r}: pass --cfg {trainer}=<name> "
                f"(scripts: CFG=<name>) with a file in configs/trainers/{trainer}/"
            )
        return cfg


@dataclass(frozen=True)
class Run:
    """One train.py invocation.

    Attributes:
        protocol: ``base2new``, ``cross_dataset``, ``domain_gen`` or ``few_shot``.
        stage: ``train`` or ``eval`` (``--eval-only`` on ``model_dir``).
        trainer, cfg, optim: the method, its config name and the optimizer setting.
        dataset: config stem of the data this run trains or evaluates on.
        seed: the run seed.
        out_dir: the run folder.
        config_files: trainer config and overlay, relative to the repository.
        optim_file: the ``--optim-config-file``.
        model_dir: eval runs: the training run folder.
        protocol_opts: KEY VALUE options the protocol sets (the variant's included).
        variant: KEY VALUE options of a sweep point (named in the folder's tag).
        repro: the reproduction mode (``train.py --repro``; named in the folder's tag).
        shots: ``few_shot`` runs: the training shots per class (named in the label).
    """

    protocol: str
    stage: str
    trainer: str
    cfg: str
    optim: str
    dataset: str
    seed: int
    out_dir: str
    config_files: tuple[str, ...]
    optim_file: str
    model_dir: str = ""
    protocol_opts: tuple[str, ...] = ()
    variant: tuple[str, ...] = ()
    repro: str = "paper"
    shots: int = 0

    @property
    def label(self) -> str:
        step = {"base2new": ("train_base", "test_new")}.get(self.protocol, ("train", "eval"))
        what = step[0] if self.stage == "train" else step[1]
        variant = f" {options_tag(self.variant)}" if self.variant else ""
        variant += f" [{self.repro}]" if self.repro != "paper" else ""
        return (
            f"{self.trainer}{'' if self.optim == 'sgd' else '+' + self.optim}{variant} "
            f"{self.protocol} {what} {self.dataset}"
            + (f" {self.shots}shots" if self.protocol == "few_shot" else "")
            + f" seed{self.seed}"
        )

    def command(self, setup: Setup, load_epoch: int | str | None = None) -> list[str]:
        """The train.py command line, valid from the current folder.

        ``load_epoch`` is required for eval runs.
        """
        cmd = [setup.python, here("train.py"), "--root", setup.data, "--seed", str(self.seed)]
        cmd += ["--trainer", self.trainer]
        cmd += ["--dataset-config-file", here(dataset_config(self.dataset))]
        cmd += ["--config-file", *map(here, self.config_files)]
        cmd += ["--optim-config-file", here(self.optim_file), "--output-dir", self.out_dir]
        if self.stage == "eval":
            if load_epoch is None:
                raise ProtocolError(f"{self.label}: the evaluation needs the training epoch")
            cmd += ["--eval-only", "--model-dir", self.model_dir, "--load-epoch", str(load_epoch)]
        if self.repro != "paper":
            cmd += ["--repro", self.repro]
        for plugin in setup.plugins:
            cmd += ["--plugin", plugin]
        opts = [*dataset_opts(self.dataset), *self.protocol_opts, *setup.opts]
        return cmd + opts


@dataclass
class Chain:
    """A training run and the evaluations of its model, executed in this order."""

    train: Run
    evals: list[Run] = field(default_factory=list)

    @property
    def runs(self) -> list[Run]:
        return [self.train, *self.evals]


def here(path: str) -> str:
    """A repository path as typed in the current folder: relative inside the repository."""
    full = osp.join(REPO, path)
    rel = osp.relpath(full)
    return full if rel.startswith("..") else rel


# -- layout -----------------------------------------------------------------------------------
def cfg_component(cfg: str, optim: str, tag: str = "") -> str:
    """The folder name that CoOp calls ``{cfg}``: ``cfg``, ``cfg+optim`` or ``cfg+optim-tag``."""
    if "+" in cfg or "/" in cfg:
        raise ProtocolError(f"Config name {cfg!r} contains '+' or '/', which the layout reserves")
    if not re.fullmatch(r"[A-Za-z0-9_.]+", optim):
        raise ProtocolError(f"Optimizer name {optim!r}: use letters, digits, '_' or '.'")
    if tag and not re.fullmatch(r"[A-Za-z0-9_.=-]+", tag):
        raise ProtocolError(f"Tag {tag!r}: use letters, digits and _ . = - only")
    if optim == "sgd" and not tag:
        return cfg
    return f"{cfg}+{optim}" + (f"-{tag}" if tag else "")


def options_tag(opts: tuple[str, ...] | list[str]) -> str:
    """The folder tag of KEY VALUE options: ``("OPTIM.SAM.RHO", "0.1")`` -> ``rho0.1``.

    Each pair becomes the key's last component in lower case followed by the value; pairs are
    joined by ``_``. Values may hold letters, digits and ``. -`` only.
    """
    if len(opts) % 2:
        raise ProtocolError(f"Variant options must be KEY VALUE pairs, got {list(opts)}")
    parts = []
    for key, value in zip(opts[0::2], opts[1::2]):
        if not re.fullmatch(r"[A-Za-z0-9.-]+", str(value)):
            raise ProtocolError(
                f"Variant value {value!r} of {key}: use letters, digits, '.' or '-' only"
            )
        parts.append(f"{key.rsplit('.', 1)[-1].lower()}{value}")
    return "_".join(parts)


def run_tag(setup_tag: str, variant: tuple[str, ...], repro: str = "paper") -> str:
    """The tag of a run: ``released`` (that mode only), the ``--tag`` and the variant's
    :func:`options_tag`, joined by ``_``."""
    mode = "" if repro == "paper" else repro
    return "_".join(t for t in (mode, setup_tag, options_tag(variant)) if t)


def repro_of(tag: str) -> str:
    """The reproduction mode of a folder tag (:func:`run_tag`)."""
    first = tag.split("_", 1)[0]
    return first if first in REPRO_MODES[1:] else "paper"


def split_cfg_component(name: str) -> tuple[str, str, str]:
    """Inverse of :func:`cfg_component`: ``(cfg, optim, tag)``."""
    cfg, _, rest = name.partition("+")
    if not rest:
        return cfg, "sgd", ""
    optim, _, tag = rest.partition("-")
    return cfg, optim, tag


def base2new_dirs(setup: Setup, dataset: str, trainer: str, comp: str, seed: int):
    """``(train_base dir, test_new dir)``."""
    tail = osp.join(dataset_dir(dataset), f"shots_{setup.shots}", trainer, comp, f"seed{seed}")
    root = osp.join(setup.output, "base2new")
    return osp.join(root, "train_base", tail), osp.join(root, "test_new", tail)


def transfer_dirs(setup: Setup, trainer: str, comp: str, seed: int, target: str):
    """``(ImageNet training dir, evaluation dir on target)``."""
    name = f"{comp}_{setup.shots}shots"
    train = osp.join(setup.output, "imagenet", trainer, name, f"seed{seed}")
    evaluation = osp.join(setup.output, "evaluation", trainer, name, dataset_dir(target))
    return train, osp.join(evaluation, f"seed{seed}")


# -- datasets and config files ----------------------------------------------------------------
def _run_folder_name(dataset: str, name: str, what: str) -> str:
    """``name`` if it can name a dataset's run folders; ProtocolError otherwise."""
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        raise ProtocolError(
            f"Dataset {dataset!r}: the {what} may hold letters, digits and _ . - only (it names "
            "the run folders); rename it or link it under such a name"
        )
    if name != FOLDER_CONFIG and osp.isfile(osp.join(REPO, "configs", "datasets", f"{name}.yaml")):
        raise ProtocolError(
            f"Dataset {dataset!r}: {name!r} is a built-in dataset's name, whose run folders it "
            f"would share; rename your {what} (or use the built-in dataset: --datasets {name})"
        )
    return name


def folder_of(dataset: str) -> str | None:
    """The folder of a folder dataset ``folder:<name>`` (None for other datasets).

    Raises:
        ProtocolError: a name that cannot be a run folder's name, or one of a built-in dataset.
    """
    if not dataset.startswith(FOLDER_PREFIX):
        return None
    return _run_folder_name(dataset, dataset[len(FOLDER_PREFIX) :], "folder name (under --data)")


def own_config(dataset: str) -> str | None:
    """The absolute path of a dataset given by its own config file (``path/x.yaml``, e.g. for a
    plugin's reader), else None."""
    if not dataset.endswith((".yaml", ".yml")):
        return None
    return osp.abspath(osp.expanduser(dataset))


def dataset_dir(dataset: str) -> str:
    """The component that names a dataset in the run folders: the config stem, the folder name
    of ``folder:<name>``, or the file stem of a config file ``path/<stem>.yaml``."""
    path = own_config(dataset)
    if path:
        return _run_folder_name(dataset, osp.splitext(osp.basename(path))[0], "config file's name")
    return folder_of(dataset) or dataset


def dataset_title(dataset: str) -> str:
    """A dataset's name in tables and reports (``dtd`` -> ``DTD``, ``folder:birds`` ->
    ``birds``)."""
    return DATASET_TITLES.get(dataset) or dataset_dir(dataset)


def dataset_opts(dataset: str) -> tuple[str, ...]:
    """The KEY VALUE options that select a dataset beyond its config file (a folder's name)."""
    folder = folder_of(dataset)
    return ("DATASET.FOLDER", folder) if folder else ()


def dataset_config(stem: str) -> str:
    """``configs/datasets/<stem>.yaml`` (relative to the repository); ``folder.yaml`` for a
    folder dataset ``folder:<name>``; the absolute path of a config file ``path/x.yaml``."""
    path = own_config(stem)
    if path:
        return path
    if folder_of(stem):
        stem = FOLDER_CONFIG
    return osp.join("configs", "datasets", f"{stem}.yaml")


def trainer_config_files(trainer: str, cfg: str, dataset: str) -> tuple[str, ...]:
    """The main config and the per-dataset overlays that exist (module docstring)."""
    folder = osp.join("configs", "trainers", trainer)
    overlays = (
        osp.join(folder, "per_dataset", f"{dataset}.yaml"),
        osp.join(folder, f"{cfg}_{dataset}.yaml"),
    )
    return (osp.join(folder, f"{cfg}.yaml"),) + tuple(
        p for p in overlays if osp.isfile(osp.join(REPO, p))
    )


def protocol_opts(stage: str, *opts: str) -> tuple[str, ...]:
    """The protocol's KEY VALUE options of a ``train`` or ``eval`` run (:data:`TRAIN_OPTS`)."""
    return (TRAIN_OPTS if stage == "train" else ()) + tuple(opts)


def optim_config_file(trainer: str, optim: str) -> str:
    """``configs/optim/<trainer>/<optim>.yaml``, else the generic ``configs/optim/<optim>.yaml``."""
    own = osp.join("configs", "optim", trainer, f"{optim}.yaml")
    if osp.isfile(osp.join(REPO, own)):
        return own
    return osp.join("configs", "optim", f"{optim}.yaml")


def missing_files(run: Run) -> list[str]:
    """Config files of ``run`` that do not exist, each with a hint."""
    problems = []
    for path in (run.config_files[0], run.optim_file, dataset_config(run.dataset)):
        if not osp.isfile(osp.join(REPO, path)):
            folder = osp.dirname(path)
            have = sorted(
                osp.splitext(osp.basename(p))[0]
                for p in glob.glob(osp.join(REPO, folder, "*.yaml"))
            )
            hint = f"available: {', '.join(have)}" if have else f"{folder}/ has no configs"
            problems.append(f"{path} not found ({hint})")
    return problems


# -- chains -----------------------------------------------------------------------------------
def training_run(
    setup: Setup,
    protocol: str,
    trainer: str,
    cfg: str,
    optim: str,
    dataset: str,
    seed: int,
    out_dir: str,
    opts: tuple[str, ...],
    variant: tuple[str, ...] = (),
    **fields,
) -> Run:
    """The training run of a chain: the trainer's config files, the optimizer's file, the
    protocol's KEY VALUE ``opts`` then the sweep point's ``variant``, the setup's reproduction
    mode (``fields``: other :class:`Run` attributes, e.g. ``shots``)."""
    return Run(
        protocol,
        "train",
        trainer,
        cfg,
        optim,
        dataset,
        seed,
        out_dir,
        trainer_config_files(trainer, cfg, dataset),
        optim_config_file(trainer, optim),
        protocol_opts=protocol_opts("train", *opts) + tuple(variant),
        variant=tuple(variant),
        repro=setup.repro,
        **fields,
    )


def base2new_chain(
    setup: Setup, trainer: str, optim: str, dataset: str, seed: int, variant: tuple[str, ...] = ()
) -> Chain:
    """Train on the base classes of ``dataset``, then test on its new classes.

    ``variant``: KEY VALUE options of a sweep point, for both runs (named in the folder tag).
    """
    cfg = setup.cfg_for("base2new", trainer, dataset)
    comp = cfg_component(cfg, optim, run_tag(setup.tag, variant, setup.repro))
    train_dir, test_dir = base2new_dirs(setup, dataset, trainer, comp, seed)
    shots = ("DATASET.NUM_SHOTS", str(setup.shots))
    opts = (*shots, "DATASET.SUBSAMPLE_CLASSES", "base")
    train = training_run(
        setup, "base2new", trainer, cfg, optim, dataset, seed, train_dir, opts, variant
    )
    test = replace(
        train,
        stage="eval",
        out_dir=test_dir,
        model_dir=train_dir,
        protocol_opts=protocol_opts("eval", *shots, "DATASET.SUBSAMPLE_CLASSES", "new")
        + tuple(variant),
    )
    return Chain(train, [test])


def transfer_chain(
    setup: Setup,
    trainer: str,
    optim: str,
    seed: int,
    targets: list[tuple[str, str]],
    variant: tuple[str, ...] = (),
) -> Chain:
    """Train on ImageNet (all classes), then evaluate on ``[(protocol, target), ...]``.

    ``variant``: KEY VALUE options of a sweep point, for every run (named in the folder tag).
    """
    cfg = setup.cfg_for("cross_dataset", trainer, SOURCE_DATASET)
    comp = cfg_component(cfg, optim, run_tag(setup.tag, variant, setup.repro))
    train_dir, _ = transfer_dirs(setup, trainer, comp, seed, SOURCE_DATASET)
    protocol = targets[0][0] if targets else "cross_dataset"
    opts = ("DATASET.NUM_SHOTS", str(setup.shots))
    train = training_run(
        setup, protocol, trainer, cfg, optim, SOURCE_DATASET, seed, train_dir, opts, variant
    )
    evals = [
        replace(
            train,
            protocol=proto,
            stage="eval",
            dataset=target,
            out_dir=transfer_dirs(setup, trainer, comp, seed, target)[1],
            model_dir=train_dir,
            protocol_opts=protocol_opts("eval") + tuple(variant),
        )
        for proto, target in targets
    ]
    return Chain(train, evals)


# -- status -----------------------------------------------------------------------------------
def run_status(run: Run) -> str:
    """``done`` (has a result), ``partial`` (folder without result: resumes) or ``todo``."""
    result = read_run(run.out_dir, run.stage)
    if result.status == "done":
        return "done"
    return "partial" if result.status == "no_result" else "todo"


def load_epoch(train_dir: str) -> int:
    """The epoch to load from a finished training run: its last, ``OPTIM.MAX_EPOCH`` plus
    ``OPTIM.SAM.STAGE2_EPOCHS`` (staged training adds its stage 2 after the published schedule).

    Read from the run's ``config.yaml``, else from a ``<model>/checkpoint`` pointer file; the
    checkpoint ``<model>/model.pth.tar-<epoch>`` must exist.
    """
    import yaml

    epoch = None
    cfg_path = osp.join(train_dir, "config.yaml")
    if osp.isfile(cfg_path):
        with open(cfg_path) as f:
            optim = (yaml.safe_load(f) or {}).get("OPTIM", {})
        stage2 = int((optim.get("SAM") or {}).get("STAGE2_EPOCHS", 0) or 0)
        epoch = int(optim.get("MAX_EPOCH", 0)) + max(stage2, 0) or None
    pointers = sorted(glob.glob(osp.join(train_dir, "*", "checkpoint")))
    if epoch is None:
        for pointer in pointers:
            with open(pointer) as f:
                m = re.search(r"model\.pth\.tar-(\d+)", f.read())
            if m:
                epoch = int(m.group(1))
                break
    if epoch is None:
        raise ProtocolError(f"{train_dir}: no config.yaml or checkpoint pointer to read the epoch")
    ckpts = [osp.join(osp.dirname(p), f"model.pth.tar-{epoch}") for p in pointers]
    if not any(osp.isfile(c) for c in ckpts):
        raise ProtocolError(
            f"{train_dir}: no checkpoint model.pth.tar-{epoch} (OPTIM.MAX_EPOCH): "
            "the training run is not finished; re-run it to resume"
        )
    return epoch


# -- pre-flight checks ------------------------------------------------------------------------
def dataset_registry_name(stem: str) -> str:
    """The name ``tools/check_data.py`` checks: ``DATASET.NAME`` of the dataset's config file,
    ``folder:<name>`` for a folder dataset (``folder:<FOLDER>`` when the file sets ``DATASET.NAME
    Folder`` and ``DATASET.FOLDER``)."""
    import yaml

    if folder_of(stem):
        return stem
    path = osp.join(REPO, dataset_config(stem))
    if not osp.isfile(path):
        have = sorted(osp.splitext(p)[0] for p in os.listdir(osp.join(REPO, "configs", "datasets")))
        raise ProtocolError(
            f"Unknown dataset {stem!r}: no {path} (available: {', '.join(have)}, "
            "folder:<name> for your images in DATA/<name>, or the path of a dataset config file)"
        )
    with open(path) as f:
        node = (yaml.safe_load(f) or {}).get("DATASET") or {}
    name = node.get("NAME")
    if not name:
        raise ProtocolError(f"{path} sets no DATASET.NAME")
    if name == "Folder" and node.get("FOLDER"):
        return FOLDER_PREFIX + str(node["FOLDER"])
    return name


def shots_warnings(chains: list[Chain], setup: Setup) -> list[str]:
    """One line per folder dataset of ``chains`` whose classes are too small for the grid's
    shots (the check of ``tools/check_data.py --shots``; also printed by a dry run)."""
    from datasets.folder import shots_problem
    from engine.errors import DataError

    out = []
    stems = dict.fromkeys(r.dataset for c in chains for r in c.runs if r.stage == "train")
    for stem in stems:
        name = dataset_registry_name(stem)
        if not name.startswith(FOLDER_PREFIX) or not setup.data:
            continue
        try:
            problem = shots_problem(setup.data, name[len(FOLDER_PREFIX) :], setup.shots)
        except (DataError, OSError):
            continue  # the data check names it
        out += [f"{name}: {problem}"] if problem else []
    return out


def check_data(
    root: str, stems: list[str], plugins: tuple[str, ...] = (), shots: int = 16
) -> str | None:
    """Run the datasets' checker on ``stems`` (``--shots shots``); returns a problem or None.

    This is the one place that calls ``tools/check_data.py --root ROOT NAME ...`` (registry
    names). Without that tool the check is skipped with a message (train.py still stops at
    start-up, naming what is missing, when a dataset is absent).
    """
    names = [dataset_registry_name(s) for s in stems]
    tool = CHECK_DATA_TOOL
    if not osp.isfile(tool):
        print(f"note: tools/check_data.py not found: data check of {', '.join(names)} skipped")
        return None
    cmd = [sys.executable, tool, "--root", root, *[f"--plugin={p}" for p in plugins]]
    cmd += [f"--shots={shots}", *names]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = (proc.stdout + proc.stderr).strip()
    if proc.returncode == 0:
        print(out, flush=True)
        return None
    return f"data check failed ({shlex.join(cmd)}):\n{out}"


def check_run_config(run: Run, setup: Setup) -> str | None:
    """Merge ``run``'s config like train.py does and look for the CLIP weights.

    Returns a problem (bad config file or option, unknown trainer, no weights) or None.
    """
    import datasets  # noqa: F401  (registers the readers)
    import trainers  # noqa: F401  (registers the trainers)
    from engine.cli import build_parser, setup_cfg
    from engine.clip.model import find_weights

    missing = missing_files(run)
    if missing:
        return f"{run.label}: " + "; ".join(missing)
    try:
        cfg = setup_cfg(build_parser().parse_args(run.command(setup)[2:]))
        if cfg.TRAINER.NAME:
            from engine.registry import TRAINER_REGISTRY

            TRAINER_REGISTRY.get(cfg.TRAINER.NAME)
        if not cfg.MODEL.BACKBONE.PRETRAINED:
            return None
        path, searched = find_weights(cfg)
    except Exception as e:  # config/registry/backbone errors: report, do not crash the plan
        return f"{run.label}: {type(e).__name__}: {e}"
    if path is None:
        where = "\n    ".join(searched) or "(no MODEL.BACKBONE.NAME or PATH)"
        return (
            f"no CLIP weights for MODEL.BACKBONE.NAME={cfg.MODEL.BACKBONE.NAME!r}; searched:\n"
            f"    {where}\n  put OpenAI's checkpoint in ~/.cache/clip/ or pass "
            "MODEL.BACKBONE.PATH /path/to/weights.pt as a trailing option"
        )
    return None


def fetch_weights(chains: list[Chain], setup: Setup) -> None:
    """Fetch the CLIP weights of ``chains`` once, before any run starts (each distinct
    ``MODEL.BACKBONE`` once; engine/clip/weights.py: checked, atomic, one download for many
    processes). A config that does not merge, and a local ``MODEL.BACKBONE.PATH``, are left to
    :func:`preflight`, which reports them.

    Raises :class:`ProtocolError` with the downloader's paragraph when weights cannot be fetched.
    """
    import datasets  # noqa: F401  (registers the readers)
    import trainers  # noqa: F401  (registers the trainers)
    from engine.cli import build_parser, setup_cfg
    from engine.clip.model import ensure_weights
    from optim.errors import UserError

    seen_runs, seen_backbones = set(), set()
    for chain in chains:
        run = chain.train
        key = (run.trainer, run.config_files, run.optim_file)
        if key in seen_runs or missing_files(run):
            continue
        seen_runs.add(key)
        try:
            cfg = setup_cfg(build_parser().parse_args(run.command(setup)[2:]))
        except Exception:  # reported by preflight
            continue
        bb = cfg.MODEL.BACKBONE
        backbone = (bb.NAME, bb.PATH, bb.URL, bb.SHA256)
        if not bb.PRETRAINED or bb.PATH or backbone in seen_backbones:
            continue  # a local file (MODEL.BACKBONE.PATH) is preflight's to check
        seen_backbones.add(backbone)
        try:
            ensure_weights(cfg)
        except UserError as e:
            raise ProtocolError(str(e)) from None


def preflight(chains: list[Chain], setup: Setup, data: bool = True) -> list[str]:
    """Problems that would stop runs of ``chains``: data, configs, weights (each checked once)."""
    problems = []
    if data:
        stems = list(dict.fromkeys(r.dataset for c in chains for r in c.runs))
        try:
            problems.append(check_data(setup.data, stems, setup.plugins, setup.shots))
        except ProtocolError as e:
            problems.append(str(e))
    seen = set()
    for chain in chains:
        key = (chain.train.trainer, chain.train.config_files, chain.train.optim_file)
        if key not in seen:
            seen.add(key)
            problems.append(check_run_config(chain.train, setup))
    return [p for p in problems if p]
