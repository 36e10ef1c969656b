"""CoOp's command line as a library: the parser, the config merge and the run.

``train.py`` is a thin entry point over this module (it first imports the packages that register
the trainers and datasets); tools build configs with :func:`setup_cfg` from here, never from
``train.py``. Config merge order (as in CoOp): defaults, trainer keys, --dataset-config-file,
--config-file, --optim-config-file, the flags, then the trailing KEY VALUE options; then the
reproduction mode's overlay (``--repro``/``REPRODUCTION``, :mod:`engine.repro`), after which the
KEY VALUE options are merged again so that they win.
"""

from __future__ import annotations

import argparse
import logging
import sys

from . import distributed

logger = logging.getLogger("train")  # the name of the log lines users grep for
_MODES = {  # the line every run's log starts with (docs/reproducing.md)
    "paper": "the method as the paper writes it; the default of every command",
    "released": "an emulation of the SAMPLe authors' released code, chosen with --repro released",
}


class _ConfigFiles(argparse.Action):
    """``--config-file A.yaml [B.yaml ...]``: YAML files only. Tokens after the last YAML file
    (CoOp's trailing ``KEY VALUE`` options right after the flag) are kept as options."""

    def __call__(self, parser, namespace, values, option_string=None):
        n = 0
        while n < len(values) and values[n].endswith((".yaml", ".yml")):
            n += 1
        if n == 0:
            parser.error(f"{option_string} expects .yaml files, got {values[0]!r}")
        setattr(namespace, self.dest, [*getattr(namespace, self.dest, []), *values[:n]])
        namespace.leading_opts = [*getattr(namespace, "leading_opts", []), *values[n:]]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train or evaluate a prompt learner (CoOp-compatible flags).",
        epilog="Trailing KEY VALUE pairs override config keys, e.g. OPTIM.LR 0.002 "
        "OPTIM.SAM.NAME sample DATASET.NUM_SHOTS 16.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--root", type=str, default="", help="dataset root folder (DATASET.ROOT)")
    parser.add_argument("--output-dir", type=str, default="", help="run folder (OUTPUT_DIR)")
    parser.add_argument(
        "--resume", type=str, default="", help="folder to resume from (default: the output dir)"
    )
    parser.add_argument(
        "--seed", type=int, default=-1, help="random seed; any value >= 0 (0 included) fixes it"
    )
    parser.add_argument(
        "--source-domains", type=str, nargs="+", help="source domains (DATASET.SOURCE_DOMAINS)"
    )
    parser.add_argument(
        "--target-domains", type=str, nargs="+", help="target domains (DATASET.TARGET_DOMAINS)"
    )
    parser.add_argument(
        "--transforms", type=str, nargs="+", help="training transforms (INPUT.TRANSFORMS)"
    )
    parser.add_argument(
        "--config-file",
        nargs="+",
        default=[],
        action=_ConfigFiles,
        help="trainer config file(s) (.yaml), merged in order (later files override earlier "
        "ones, e.g. a per-dataset overlay after the trainer's main config); may be repeated",
    )
    parser.add_argument("--dataset-config-file", type=str, default="", help="dataset config file")
    parser.add_argument(
        "--optim-config-file",
        type=str,
        default="",
        help="optimizer config file merged after --config-file, e.g. "
        "configs/optim/CoOp/sample.yaml (the paper's values for that trainer)",
    )
    parser.add_argument("--trainer", type=str, default="", help="trainer name, e.g. CoOp")
    parser.add_argument("--backbone", type=str, default="", help="CLIP backbone, e.g. ViT-B/16")
    parser.add_argument("--head", type=str, default="", help="head name (Dassl compatibility)")
    parser.add_argument("--eval-only", action="store_true", help="evaluation only")
    parser.add_argument(
        "--model-dir", type=str, default="", help="load the model from this run folder"
    )
    parser.add_argument(
        "--load-epoch", type=int, help="load model.pth.tar-<epoch> (default: model-best)"
    )
    parser.add_argument("--no-train", action="store_true", help="build everything, do not train")
    parser.add_argument(
        "--repro",
        choices=("paper", "released"),
        default="",
        help="reproduction mode (REPRODUCTION): paper (default) or released, an emulation of the "
        "SAMPLe authors' released code (configs/repro/; docs/reproducing.md)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in --output-dir: move its previous content (checkpoints, logs) to "
        "<output-dir>.old-<time> first. Without it, a re-run resumes the folder's run",
    )
    parser.add_argument(
        "--force-resume",
        action="store_true",
        help="resume the run in --output-dir although its experiment config differs from this "
        "one (see experiment.json) or it diverged (diverged.json): it continues from its last "
        "(finite) checkpoint with the new values",
    )
    parser.add_argument(
        "--skip-done",
        action="store_true",
        help="stop at once (exit 0, nothing written) when the output folder already holds this "
        "run's result (same experiment), checked once the folder's lock is held; "
        "tools/grid.py passes it, so two grids on one output never repeat a finished run",
    )
    parser.add_argument(
        "--wait-for-folder",
        action="store_true",
        help="when another process holds the output folder, wait until it gives it back "
        "instead of stopping (with --skip-done: then stop if that run finished this one)",
    )
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE_OR_FILE",
        help="import a module registering your own trainer, dataset reader or optimizer "
        "before the config is built: a .py path or a module name; repeatable (also PLUGINS, "
        "$SAMPLE_PL_PLUGINS)",
    )
    parser.add_argument(
        "opts", default=None, nargs=argparse.REMAINDER, help="config overrides: KEY VALUE ..."
    )
    return parser


def reset_cfg(cfg, args) -> None:
    """Apply the command-line flags to ``cfg`` (``--seed 0`` counts)."""
    if args.root:
        cfg.DATASET.ROOT = args.root
    if args.output_dir:
        cfg.OUTPUT_DIR = args.output_dir
    if args.resume:
        cfg.RESUME = args.resume
    if args.seed is not None and args.seed >= 0:
        cfg.SEED = args.seed
    if args.source_domains:
        cfg.DATASET.SOURCE_DOMAINS = tuple(args.source_domains)
    if args.target_domains:
        cfg.DATASET.TARGET_DOMAINS = tuple(args.target_domains)
    if args.transforms:
        cfg.INPUT.TRANSFORMS = tuple(args.transforms)
    if args.trainer:
        cfg.TRAINER.NAME = args.trainer
    if args.backbone:
        cfg.MODEL.BACKBONE.NAME = args.backbone
    if args.head:
        cfg.MODEL.HEAD.NAME = args.head


def setup_cfg(args, notes: list | None = None):
    """plugins (engine/plugins.py) -> defaults -> trainer keys -> dataset config -> trainer
    config -> optim config -> flags -> opts -> the reproduction mode's overlay (engine/repro.py)
    -> opts again (they win).

    Every key of the files and options passes the trainer's ``translate_key`` (another code
    base's keys, e.g. KgCoOp's ``TRAINER.COOP.*``); ``notes`` receives one line per key that it
    changed, and one per line returned by the trainer's ``translate_cfg``.
    """
    from .config import ConfigError, get_cfg_default, merge_from_file, merge_from_list
    from .plugins import (
        add_plugin_config,
        env_plugins,
        load_plugins,
        plugins_in_files,
        plugins_in_opts,
    )
    from .registry import TRAINER_REGISTRY
    from .repro import apply_reproduction

    opts = list(args.opts or [])
    if opts and opts[0] == "--":
        opts = opts[1:]
    opts = [*getattr(args, "leading_opts", []), *opts]
    files = [args.dataset_config_file, *args.config_file, getattr(args, "optim_config_file", "")]
    named = [
        *env_plugins(),
        *plugins_in_files(files),
        *(getattr(args, "plugin", None) or []),
        *plugins_in_opts(opts),
    ]
    plugins = [s for s in dict.fromkeys(named) if s.strip()]  # once each, first place kept
    load_plugins(plugins)  # before the defaults: a plugin trainer adds its config keys
    if not len(TRAINER_REGISTRY):
        raise RuntimeError(
            "setup_cfg: no trainer is registered; import the trainers first (import trainers)"
        )
    cfg = get_cfg_default()
    notes = [] if notes is None else notes
    declared = add_plugin_config(cfg)  # keys of the plugins' repositories (their extend_cfg)
    if declared:
        notes.append(f"keys declared by the plugins' extend_cfg: {', '.join(declared)}")
    trainer = TRAINER_REGISTRY.get(args.trainer) if args.trainer in TRAINER_REGISTRY else None
    translate = trainer.translate_key if trainer is not None else None
    if args.dataset_config_file:
        merge_from_file(cfg, args.dataset_config_file, translate, notes)
    for path in args.config_file:
        merge_from_file(cfg, path, translate, notes)
    if getattr(args, "optim_config_file", ""):
        merge_from_file(cfg, args.optim_config_file, translate, notes)
    reset_cfg(cfg, args)
    flags = [o for o in opts[0::2] if o.startswith("--")]
    if flags:
        raise ConfigError(
            f"Flag {flags[0]} comes after the KEY VALUE options; put all --flags before them"
        )
    merge_from_list(cfg, opts, translate=translate, notes=notes)
    cfg.PLUGINS = plugins  # every plugin of the run, wherever it was named
    if cfg.TRAINER.NAME in TRAINER_REGISTRY:  # another code base's keys -> ours (default: none)
        notes.extend(TRAINER_REGISTRY.get(cfg.TRAINER.NAME).translate_cfg(cfg) or [])
    apply_reproduction(cfg, getattr(args, "repro", ""), opts, translate)  # opts win
    cfg.freeze()
    return cfg


def main(args) -> int:
    """Run train.py's command: take the output folder (lock, experiment check), then train or
    evaluate."""
    from .preflight import check_run_inputs
    from .run_folder import RunFolder
    from .validate import validate_cfg

    notes: list[str] = []
    cfg = setup_cfg(args, notes)
    validate_cfg(cfg)  # before the output folder is touched
    check_run_inputs(cfg)  # the trainer's name and the dataset's folder, as early
    if distributed.init_from_env(cfg) is not None and not distributed.is_main_process():
        return _follow(args, cfg)  # data-parallel (#29): rank 0 owns the run folder
    folder = RunFolder(cfg.OUTPUT_DIR)
    try:
        # one process per folder, for the run's life (a grid's run waits for a held one)
        folder.acquire(wait=getattr(args, "wait_for_folder", False))
        try:
            return _run_in_folder(args, cfg, folder, notes)
        finally:
            folder.release()
    except BaseException as e:
        distributed.release_followers(str(e))  # data-parallel (#29): unless already released
        raise


def _follow(args, cfg) -> int:
    """A data-parallel process other than rank 0: wait for rank 0 to prepare the run folder,
    then build the same trainer and take part in every step and evaluation (rank 0 writes)."""
    from . import build_trainer
    from .utils import set_random_seed

    distributed.setup_follower_logging()
    error = distributed.wait_for_main()
    if error == distributed.ALREADY_DONE:  # rank 0 found the run finished under its lock
        return 0
    if error is not None:
        logger.warning("rank 0 stopped before training: %s", error)
        return 2
    if cfg.SEED >= 0:
        set_random_seed(cfg.SEED)
    return _train_or_test(build_trainer(cfg), args)


def _train_or_test(trainer, args) -> int:
    """The run's work once its trainer is built: evaluate (--eval-only) or train."""
    if args.eval_only:
        trainer.load_model(args.model_dir, epoch=args.load_epoch)
        trainer.test()
    elif not args.no_train:
        trainer.train()
    return 0


def _evaluates_in_place(args, cfg) -> bool:
    """Whether this is ``--eval-only`` with ``--model-dir`` the output folder itself (the
    neighbours' test scripts do so): the evaluation then writes its log beside the training
    run's files and changes none of them. ``--overwrite`` would move the model away first, so
    it is refused."""
    import os.path as osp

    from .errors import OutputError

    if not (args.eval_only and args.model_dir and cfg.OUTPUT_DIR):
        return False
    if osp.realpath(args.model_dir) != osp.realpath(cfg.OUTPUT_DIR):
        return False
    if getattr(args, "overwrite", False):
        raise OutputError(
            f"--overwrite with --eval-only --model-dir {args.model_dir}, the --output-dir itself: "
            "it would move the model aside before evaluating it. Drop --overwrite: the "
            "evaluation writes its own log beside the training run's files and changes none "
            "of them"
        )
    return True


def _run_in_folder(args, cfg, folder, notes=()) -> int:
    import os.path as osp

    from . import build_trainer
    from .config import dump_cfg
    from .run_folder import experiment_config
    from .utils import collect_env_info, set_random_seed, setup_logger

    force = getattr(args, "force_resume", False)
    in_place = _evaluates_in_place(args, cfg)  # --eval-only in the folder of its model
    moved = folder.move_aside() if getattr(args, "overwrite", False) else None
    run = {"EVAL_ONLY": bool(args.eval_only)}
    if args.eval_only:
        run["MODEL_DIR"] = osp.abspath(args.model_dir) if args.model_dir else ""
        run["LOAD_EPOCH"] = args.load_epoch
    experiment = experiment_config(cfg, run)
    if not in_place:  # the folder stays its training run's: nothing to compare or record
        folder.check_experiment(experiment, force=force)  # before config.yaml is rewritten
        skip = getattr(args, "skip_done", False) and not moved
        if skip and folder.same_experiment(experiment):
            done = folder.result_log(bool(args.eval_only))  # checked under the lock: final
            if done:
                print(f"Already done: {folder.path} holds its result ({done}); nothing to do")
                distributed.release_followers(distributed.ALREADY_DONE)  # #29: they end too
                return 0
    if not args.eval_only:
        folder.check_divergence(force=force)
    folder.remove_orphans()
    kept = folder.set_aside_previous_run() if folder.reclaimed else []
    if cfg.SEED >= 0:
        set_random_seed(cfg.SEED)
    log_path = setup_logger(cfg.OUTPUT_DIR)
    if in_place:
        logger.info(
            "Evaluating the model of %s in its own folder: this evaluation's log is %s, beside "
            "the training run's log.txt; its config.yaml and experiment.json stay the training "
            "run's",
            folder.path,
            osp.basename(log_path or ""),
        )
    if folder.reclaimed:
        logger.info(
            "Output folder %s holds no checkpoint (its earlier run only evaluated, or stopped "
            "before its first checkpoint), so this run takes it over although its experiment "
            "differs (%s); the earlier run's files are kept as %s",
            folder.path,
            "; ".join(folder.reclaimed),
            ", ".join(kept) or "nothing",
        )
    if moved:
        logger.warning("--overwrite: the previous content of %s is now in %s", folder.path, moved)
    logger.info("Reproduction mode: %s (%s)", cfg.REPRODUCTION, _MODES.get(cfg.REPRODUCTION, ""))
    for note in notes:  # another code base's keys, mapped by the trainer (translate_key/_cfg)
        logger.info("Config translated for --trainer %s: %s", cfg.TRAINER.NAME, note)
    if not in_place:
        dump_cfg(cfg, osp.join(cfg.OUTPUT_DIR, "config.yaml"))
    logger.info("***************\n** Arguments **\n***************")
    for key in sorted(vars(args)):
        logger.info("%s: %s", key, getattr(args, key))
    logger.info("************\n** Config **\n************\n%s", cfg)
    logger.info("Collecting env info ...\n** System info **\n%s\n", collect_env_info())
    if distributed.data_parallel():
        logger.info(
            "Data-parallel run: %d processes (%s); DATALOADER.TRAIN_X.BATCH_SIZE %d is the global "
            "batch", distributed.world_size(), distributed.cost_meta()["backend"],
            cfg.DATALOADER.TRAIN_X.BATCH_SIZE,
        )  # fmt: skip
    distributed.release_followers(None)  # data-parallel (#29): the folder is ready

    trainer = build_trainer(cfg)
    if not in_place:
        folder.record_experiment(experiment)  # a config that builds: this folder's experiment
    return _train_or_test(trainer, args)


def _log_to_files(error: BaseException) -> None:
    """Record ``error`` in the log files of the run (not on stdout: it goes to stderr once)."""
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, "%s", (error,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def run(argv=None) -> int:
    """Parse ``argv`` and run; user errors become one paragraph on stderr (exit 2), divergence
    exit 3, anything unexpected keeps its traceback."""
    from optim.errors import UserError

    from . import phases

    phases.begin_run()  # the start-up phases of this run (engine/phases.py)
    args = build_parser().parse_args(argv)
    try:
        code = main(args)
        distributed.shutdown()  # data-parallel (#29): leave the process group
        return code
    except Exception as e:
        if distributed.data_parallel():  # data-parallel (#29): one line naming the rank
            print(distributed.failure_message(e), file=sys.stderr, flush=True)
        # plain ValueError / FileNotFoundError: the checks of trainers written before UserError
        user = isinstance(e, UserError) or type(e) in (ValueError, FileNotFoundError)
        if not (user or isinstance(e, FloatingPointError)):
            raise
        _log_to_files(e)  # the run's log.txt, when it exists; the terminal gets it once:
        print(f"Error: {e}", file=sys.stderr)
        return 2 if user else 3
