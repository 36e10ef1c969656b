"""A trainer class's interface to the configuration: its ``TRAINER.<NODE>`` keys, the
translation of other code bases' keys onto them, and the configs the grid runs it with (mixed
into :class:`engine.trainer.TrainerBase`)."""

from __future__ import annotations

from .registry import TRAINER_REGISTRY


class TrainerInterface:
    """The class-level configuration interface of a trainer (every method a classmethod: the
    config is merged before any trainer is built)."""

    CONFIG_NODE: str | None = None  # TRAINER.<node> of this trainer; default: registry name
    # The grid's default configs (configs/trainers/<name>/<cfg>.yaml; experiments/protocols.py):
    # "base2new", "base2new/<dataset>" (a dataset's own), "transfer" (default: base2new's
    # ImageNet config), "few_shot", "few_shot/<N>shots", "few_shot/<dataset>" (default: the
    # base2new config; experiments/few_shot.py). Not inherited: a subclass registered under its
    # own name states its own
    PROTOCOL_CFGS: dict[str, str] = {}
    # KEY VALUE options the grid gives a protocol's runs of this trainer, e.g. {"few_shot":
    # ("TRAINER.MMRL.TASK", "FS")} (experiments/few_shot.py). Not inherited either
    PROTOCOL_OPTS: dict[str, tuple[str, ...]] = {}

    @classmethod
    def add_config(cls, cfg) -> None:
        """Add this trainer's ``TRAINER.<NODE>`` keys to ``cfg`` (override per trainer)."""

    @classmethod
    def translate_cfg(cls, cfg) -> list[str] | None:
        """Map keys of another code base's interface onto this project's keys (default: none).

        Called by :func:`engine.cli.setup_cfg` on the merged, not yet frozen config of the trainer
        named by ``--trainer``, after every file and ``KEY VALUE`` option and before the
        reproduction mode's overlay (so a translation may choose ``REPRODUCTION``); e.g. the
        SAMPLe authors' aliases map ``TRAINER.SAMPLe.*`` onto the prompt-learner and ``OPTIM.SAM``
        keys (``trainers/sample_aliases.py``). Must be idempotent. Returns lines for the run's
        log (``old -> new``), or None.
        """

    @classmethod
    def translate_key(cls, key: str, value, source: str) -> list[tuple[str, object]]:
        """Map one key of another code base's config files or options before it is merged.

        Called by :func:`engine.cli.setup_cfg` (through the merge functions of
        :mod:`engine.config`) for every leaf ``key``/``value`` of every config file and
        ``KEY VALUE`` option of a run of this trainer; returns the pairs to merge instead (none:
        the key is dropped; raise :class:`~engine.errors.ConfigError` to refuse it). Every
        change is logged. Default: the key unchanged. E.g. KgCoOp reads KgCoOp's
        ``TRAINER.COOP.*`` keys as its own node (trainers/kgcoop.py); :meth:`translate_cfg`
        runs after the merge.
        """
        return [(key, value)]

    @classmethod
    def config_node(cls) -> str:
        """The name of this trainer's ``TRAINER.<NODE>`` config node.

        ``CONFIG_NODE`` when set (inherited by subclasses that reuse their parent's keys), else
        the upper-cased name under which the class (or its nearest registered base) is
        registered; never the runtime class name of an unregistered subclass.
        """
        if cls.CONFIG_NODE:
            return cls.CONFIG_NODE
        for klass in cls.__mro__:
            name = TRAINER_REGISTRY.name_of(klass)
            if name is not None:
                return name.upper()
        return cls.__name__.upper()
